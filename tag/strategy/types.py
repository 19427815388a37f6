"""Strategy data types: what to do with each op group, as plain data.

A ``Strategy`` = a ``Grouping`` of the IR's ops + one ``Action`` per op group (+ the op -> device
assignment of partitioned groups). Every stage after search (simulator, compression, rewriter) reads it.

Example::

    s = Strategy(grouping, [Action(placement=(0, 1), mode="allreduce")] * grouping.num_groups)
    s.devices_of(0, topo)                # devices of group 0's placement
    s.to_json()
    Strategy.from_proto(s.to_proto().SerializeToString())   # proto/strategy.proto round trip
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from tag.errors import StrategyError
from tag.strategy.action import MODES, Action, Mode  # noqa: F401 - re-exported: a Strategy holds Actions
from tag.strategy.pipeline import Pipeline, PipelineStage


@dataclass
class Grouping:
    """Op groups: ``group_of_op[i]`` is the group of IR op i; groups are numbered 0..num_groups-1."""

    group_of_op: np.ndarray
    names: list[str]                  # a readable name per group (its main layer / scope)

    @property
    def num_groups(self) -> int:
        return len(self.names)

    def members(self, group: int) -> np.ndarray:
        return np.flatnonzero(self.group_of_op == group)

    def to_dict(self) -> dict:
        return {"group_of_op": [int(g) for g in self.group_of_op], "names": list(self.names)}

    @classmethod
    def from_dict(cls, d: dict) -> "Grouping":
        return cls(np.asarray(d["group_of_op"], dtype=np.int64), list(d["names"]))


@dataclass
class Strategy:
    grouping: Grouping
    actions: list[Action]
    # partitioned groups: IR op index -> global device index (every op of a partition group is listed)
    partition: dict[int, int] = field(default_factory=dict)
    # gradients sent by sufficient-factor broadcasting instead of all-reduce (variable names)
    sfb: list[str] = field(default_factory=list)
    name: str = ""
    # examples/s per device (topology order) that batch shares follow; empty: the devices' peak FLOP/s
    device_speeds: tuple[float, ...] = ()
    # stages, micro-batches and schedule of a pipelined strategy (tag/strategy/pipeline.py); None: no pipeline.
    # Every op group of a stage carries the stage's action in ``actions``.
    pipeline: Pipeline | None = None
    # gradient bytes at which a fusion bucket of all-reduced op groups closes (tag/strategy/fusion.py); None:
    # ``FUSION_BUCKET_BYTES``. The search picks it per plan (tag.search.buckets): slow links want several
    # buckets that overlap the backward pass, rings over many devices want few.
    bucket_bytes: float | None = None

    def __post_init__(self):
        if len(self.actions) != self.grouping.num_groups:
            raise StrategyError(f"strategy has {len(self.actions)} actions for {self.grouping.num_groups} op groups")
        self.device_speeds = tuple(float(x) for x in self.device_speeds)
        if any(not (x > 0) for x in self.device_speeds):
            raise StrategyError("device speeds must be positive")
        if self.bucket_bytes is not None:
            b = self.bucket_bytes
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
                raise StrategyError(f"bucket_bytes must be a positive number of bytes, got {b!r}")
            self.bucket_bytes = float(b)
        if self.pipeline is not None:
            stage_of = self.pipeline.stage_of_group(self.grouping.num_groups)
            for g, a in enumerate(self.actions):
                want = self.pipeline.stages[int(stage_of[g])].action()
                if a != want:
                    raise StrategyError(f"op group {g} ({self.grouping.names[g]}): action {a.to_dict()} differs "
                                        f"from its pipeline stage {int(stage_of[g])}'s {want.to_dict()}")

    @classmethod
    def pipelined(cls, grouping: Grouping, pipeline: Pipeline, name: str = "pipeline",
                  device_speeds: tuple[float, ...] = ()) -> "Strategy":
        """A strategy that runs PIPELINE: every op group gets its stage's action."""
        stage_of = pipeline.stage_of_group(grouping.num_groups)
        actions = [pipeline.stages[int(stage_of[g])].action() for g in range(grouping.num_groups)]
        return cls(grouping, actions, name=name, device_speeds=device_speeds, pipeline=pipeline)

    def share_speeds(self, devices, topology) -> list[float]:
        """The speeds that batch shares over DEVICES follow: ``device_speeds`` when set, else peak FLOP/s."""
        if self.device_speeds:
            if len(self.device_speeds) != topology.num_devices:
                raise StrategyError(f"strategy has {len(self.device_speeds)} device speeds for "
                                    f"{topology.num_devices} devices")
            return [self.device_speeds[d] for d in devices]
        return [topology.devices[d].peak_flops for d in devices]

    def devices_of(self, group: int, topology) -> list[int]:
        """Global device indices of the device groups in group's placement."""
        return [d for g in self.actions[group].placement for d in topology.groups[g].devices]

    def to_dict(self) -> dict:
        return {"name": self.name, "grouping": self.grouping.to_dict(),
                "actions": [a.to_dict() for a in self.actions],
                "partition": {str(k): int(v) for k, v in sorted(self.partition.items())},
                "sfb": list(self.sfb), "device_speeds": list(self.device_speeds),
                **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
                **({"bucket_bytes": self.bucket_bytes} if self.bucket_bytes is not None else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Strategy":
        pipeline = Pipeline.from_dict(d["pipeline"]) if d.get("pipeline") else None
        return cls(Grouping.from_dict(d["grouping"]), [Action.from_dict(a) for a in d["actions"]],
                   {int(k): int(v) for k, v in d.get("partition", {}).items()}, list(d.get("sfb", [])),
                   d.get("name", ""), tuple(d.get("device_speeds", ())), pipeline, d.get("bucket_bytes"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        return cls.from_dict(json.loads(text))

    def to_proto(self):
        """The strategy as a ``tag.Strategy`` protobuf message (proto/strategy.proto)."""
        pb = _strategy_pb2()
        msg = pb.Strategy(name=self.name)
        msg.grouping.group_of_op.extend(int(g) for g in self.grouping.group_of_op)
        msg.grouping.names.extend(self.grouping.names)
        for a in self.actions:
            act = msg.actions.add(placement=[int(g) for g in a.placement], mode=_MODE_TO_PB[a.mode])
            if a.ps_device is not None:
                act.ps_device = int(a.ps_device)
        for op, dev in self.partition.items():
            msg.partition[int(op)] = int(dev)
        msg.sfb.extend(self.sfb)
        msg.device_speed.extend(self.device_speeds)
        if self.pipeline is not None:
            p = self.pipeline
            msg.pipeline.micro_batches = p.micro_batches
            msg.pipeline.schedule = p.schedule
            for st in p.stages:
                stage = msg.pipeline.stages.add(groups=list(st.groups), placement=list(st.placement),
                                                mode=_MODE_TO_PB[st.mode])
                if st.ps_device is not None:
                    stage.ps_device = st.ps_device
        if self.bucket_bytes is not None:
            msg.bucket_bytes = self.bucket_bytes
        return msg

    @classmethod
    def from_proto(cls, msg) -> "Strategy":
        """Build a Strategy from a ``tag.Strategy`` message (or its serialised bytes)."""
        pb = _strategy_pb2()
        if isinstance(msg, (bytes, bytearray)):
            parsed = pb.Strategy()
            try:
                parsed.ParseFromString(bytes(msg))
            except Exception as err:  # protobuf's DecodeError
                raise StrategyError(f"not a serialised tag.Strategy message: {err}") from None
            msg = parsed
        actions = []
        for i, a in enumerate(msg.actions):
            if a.mode not in _MODE_FROM_PB:
                raise StrategyError(f"strategy action {i}: mode is unspecified")
            actions.append(Action(tuple(a.placement), _MODE_FROM_PB[a.mode],
                                  int(a.ps_device) if a.HasField("ps_device") else None))
        grouping = Grouping(np.asarray(list(msg.grouping.group_of_op), dtype=np.int64), list(msg.grouping.names))
        pipeline = None
        if msg.HasField("pipeline"):
            stages = []
            for i, st in enumerate(msg.pipeline.stages):
                if st.mode not in _MODE_FROM_PB:
                    raise StrategyError(f"pipeline stage {i}: mode is unspecified")
                stages.append(PipelineStage(tuple(st.groups), tuple(st.placement), _MODE_FROM_PB[st.mode],
                                            int(st.ps_device) if st.HasField("ps_device") else None))
            pipeline = Pipeline(tuple(stages), msg.pipeline.micro_batches, msg.pipeline.schedule or "1f1b")
        return cls(grouping, actions, {int(k): int(v) for k, v in sorted(msg.partition.items())},
                   list(msg.sfb), msg.name, tuple(msg.device_speed), pipeline, msg.bucket_bytes or None)


_MODE_TO_PB = {"allreduce": 1, "ps": 2, "partition": 3}   # values of enum tag.Mode in proto/strategy.proto
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()}


def _strategy_pb2():
    """The generated strategy protobuf module (built from proto/strategy.proto at install time)."""
    try:
        from tag._proto import strategy_pb2
    except ImportError as err:  # not generated: the package was not built
        raise RuntimeError("tag/_proto/strategy_pb2.py is missing; reinstall tag (pip install -e .) to "
                           f"generate it ({err})") from None
    return strategy_pb2


def batch_shares(speeds: list[float] | np.ndarray, batch: int) -> list[int]:
    """Split BATCH into integer shares proportional to SPEEDS (largest remainder), summing to BATCH.

    Every device gets at least one example when batch >= number of devices.
    """
    speeds = np.asarray(speeds, dtype=np.float64)
    n = len(speeds)
    if n == 0:
        raise StrategyError("cannot split a batch over zero devices")
    if batch < n:
        raise StrategyError(f"global batch {batch} is smaller than the {n} replicas it must be split over")
    ideal = speeds / speeds.sum() * batch
    shares = np.maximum(np.floor(ideal).astype(np.int64), 1)
    while shares.sum() > batch:  # the minimum of one pushed us over: take from the largest
        over = np.where(shares > 1, shares - ideal, -np.inf)
        shares[np.argmax(over)] -= 1
    rest = batch - int(shares.sum())
    if rest:
        order = np.argsort(-(ideal - shares), kind="stable")
        for i in order[:rest]:
            shares[i] += 1
    return [int(s) for s in shares]
