"""Pipelines as plain data: stages of op groups, micro-batches and the schedule both simulator and rewriter run.

A ``Pipeline`` cuts the op groups into an ordered list of ``PipelineStage``s. Each stage is a contiguous run
of op groups in the pipeline's group order (forward dependency order), placed on a set of device groups and
replicated inside the stage (``allreduce`` or ``ps`` over the stage's devices, batch shares by device speed).
The global batch is cut into ``micro_batches`` equal micro-batches; each stage runs every micro-batch's
forward, then (in reverse stage order) its backward; gradients accumulate over micro-batches and are
synchronised inside the stage and applied once per step, so the step equals the single-device step.

The schedule is generated once (``pipeline_schedule``) and read by both the simulator (the order each stage
runs its micro-batch tasks) and the rewriter (control dependencies that enforce it), so what is predicted is
what runs. Three schedules:

``fill_drain`` (GPipe): every forward, then every backward. 3 stages, M=4 (F2 = forward of micro-batch 2)::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1 |    F0 F1 F2 F3 .  .  .  B3 B2 B1 B0
    stage 2 |       F0 F1 F2 F3 B3 B2 B1 B0

(backwards in reverse micro-batch order: the last forward's activations are the freshest; any order is exact).

``1f1b`` (one forward, one backward): stage s runs ``min(S - s, M)`` warm-up forwards, then alternates one
backward and one forward, then drains the remaining backwards, so it holds at most ``S - s`` micro-batches'
activations instead of M::

    stage 0 | F0 F1 F2 .  B0 F3 B1 .  B2 .  B3
    stage 1 |    F0 F1 .  B0 F2 B1 F3 B2 .  B3
    stage 2 |       F0 B0 F1 B1 F2 B2 F3 B3

``deferred_w``: fill-drain's order, but a stage on one device computes its weight gradients once, after its
last backward step, over every micro-batch's rows at once (``tag.ir.algorithms.weight_gradient_ops``: one
``MatMul`` of the concatenated activations and output gradients instead of M partial sums added into running
sums). Each backward step then only computes input gradients, so the stage before gets them sooner, the
weight-gradient kernels run at the whole batch's efficiency, and the M - 1 accumulations of every gradient
(three passes over it each) disappear; the price is holding every micro-batch's output gradients as well
until the end. The step is still the single-device step (a sum over the same rows). A stage on several
devices runs it as ``fill_drain`` (its devices' rows are not contiguous in the batch)::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  b3 b2 b1 b0 W
    stage 1 |    F0 F1 F2 F3 .  .  b3 b2 b1 b0 W
    stage 2 |       F0 F1 F2 F3 b3 b2 b1 b0 W

A strategy with a pipeline still carries one ``Action`` per op group: every group of a stage has the stage's
action (``PipelineStage.action``), so code that reads per-group actions (memory, reports) keeps working;
``Strategy.pipeline`` adds the stages, M and the schedule.

Example::

    from tag.strategy.pipeline import Pipeline, PipelineStage, pipeline_schedule
    p = Pipeline(stages=(PipelineStage(groups=(0, 1, 2), placement=(0,)),
                         PipelineStage(groups=(3, 4), placement=(1, 2))),
                 micro_batches=4, schedule="1f1b")
    p.stage_of_group(num_groups=5)        # array([0, 0, 0, 1, 1])
    pipeline_schedule(2, 4, "1f1b")[1]    # [('F', 0), ('B', 0), ('F', 1), ('B', 1), ...]
    Pipeline.from_dict(p.to_dict()) == p  # True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from tag.errors import StrategyError
from tag.strategy.action import Action

ScheduleKind = Literal["fill_drain", "1f1b", "deferred_w"]
SCHEDULES: tuple[str, ...] = ("fill_drain", "1f1b", "deferred_w")
#: the schedule whose single-device stages run their weight gradients once per step (module docstring)
DEFERRED_W = "deferred_w"
STAGE_MODES: tuple[str, ...] = ("allreduce", "ps")

# one entry of a stage's schedule: ('F' or 'B', micro-batch index)
ScheduleStep = tuple[str, int]


@dataclass(frozen=True)
class PipelineStage:
    """One stage: op groups (in pipeline order), the device groups it runs on, and how it replicates.

    ``mode`` is ``allreduce`` (gradients summed over the stage's devices by one collective after the last
    micro-batch) or ``ps`` (gradients pushed to ``ps_device``, a global device index, which applies them).
    """

    groups: tuple[int, ...]
    placement: tuple[int, ...]
    mode: str = "allreduce"
    ps_device: int | None = None

    def __post_init__(self):
        if not self.groups:
            raise StrategyError("a pipeline stage needs at least one op group")
        if not self.placement:
            raise StrategyError("a pipeline stage needs at least one device group")
        if self.mode not in STAGE_MODES:
            raise StrategyError(f"pipeline stage mode {self.mode!r} (expected one of {', '.join(STAGE_MODES)})")
        if self.mode == "ps" and self.ps_device is None:
            raise StrategyError("pipeline stage mode 'ps' needs ps_device")
        object.__setattr__(self, "groups", tuple(int(g) for g in self.groups))
        object.__setattr__(self, "placement", tuple(sorted(set(int(g) for g in self.placement))))
        if self.ps_device is not None:
            object.__setattr__(self, "ps_device", int(self.ps_device))

    def action(self) -> Action:
        """The per-group ``Action`` every op group of this stage carries in ``Strategy.actions``."""
        return Action(self.placement, self.mode, self.ps_device)

    def to_dict(self) -> dict:
        d = {"groups": list(self.groups), "placement": list(self.placement), "mode": self.mode}
        if self.ps_device is not None:
            d["ps_device"] = self.ps_device
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineStage":
        return cls(tuple(d["groups"]), tuple(d["placement"]), d.get("mode", "allreduce"), d.get("ps_device"))


@dataclass(frozen=True)
class Pipeline:
    """Ordered stages, the number of micro-batches M and the schedule (``fill_drain``, ``1f1b`` or
    ``deferred_w``)."""

    stages: tuple[PipelineStage, ...]
    micro_batches: int
    schedule: str = "1f1b"

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        if len(self.stages) < 1:
            raise StrategyError("a pipeline needs at least one stage")
        if int(self.micro_batches) < 1:
            raise StrategyError(f"a pipeline needs at least one micro-batch (got {self.micro_batches})")
        object.__setattr__(self, "micro_batches", int(self.micro_batches))
        if self.schedule not in SCHEDULES:
            raise StrategyError(f"unknown pipeline schedule {self.schedule!r} (expected one of {', '.join(SCHEDULES)})")
        seen: set[int] = set()
        for i, st in enumerate(self.stages):
            twice = seen.intersection(st.groups)
            if twice:
                raise StrategyError(f"pipeline stage {i}: op group {min(twice)} is already in an earlier stage")
            seen.update(st.groups)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def on_one_placement(self) -> bool:
        """Every stage on the same devices: the micro-batches take turns on them (gradient accumulation), and
        nothing overlaps across devices that the same per-group actions without a pipeline would not overlap.
        What it can buy is memory (one micro-batch's activations at a time), not speed, so the search offers it
        as a pipeline only when those actions do not fit (``tag.search.driver.pipeline_admitted``)."""
        return len({st.placement for st in self.stages}) == 1

    @property
    def in_name_only(self) -> bool:
        """One micro-batch through stages that all sit on the same devices: the same per-group actions under
        another name, never offered as a pipeline (``tag.search.driver``). B/cnn in bench_fidelity runs 13-14:
        such a "pipeline" (two stages on all three hosts) was the benchmark's max regret; a one-off benchmark
        (its figures are in docs/) measured one predicted 13% faster than the same actions without it run 46%
        slower (192.5 against 132.1 ms)."""
        return self.micro_batches == 1 and self.on_one_placement

    def group_order(self) -> list[int]:
        """Every op group in pipeline order (stage 0's groups first)."""
        return [g for st in self.stages for g in st.groups]

    def stage_of_group(self, num_groups: int) -> np.ndarray:
        """``stage_of_group[g]`` = the stage holding op group g; raises when a group is in no stage."""
        out = np.full(num_groups, -1, dtype=np.int64)
        for i, st in enumerate(self.stages):
            for g in st.groups:
                if not 0 <= g < num_groups:
                    raise StrategyError(f"pipeline stage {i}: op group {g} does not exist "
                                        f"(the grouping has {num_groups})")
                out[g] = i
        missing = np.flatnonzero(out < 0)
        if len(missing):
            raise StrategyError(f"pipeline: op group {int(missing[0])} is in no stage "
                                f"({len(missing)} of {num_groups} groups unassigned)")
        return out

    def steps(self) -> list[list[ScheduleStep]]:
        """This pipeline's schedule: per stage, the ordered ('F'|'B', micro-batch) steps."""
        return pipeline_schedule(self.num_stages, self.micro_batches, self.schedule)

    def bubble_fraction(self) -> float:
        """Idle fraction of an ideal pipeline with equal stage times: (S - 1) / (M + S - 1)."""
        s, m = self.num_stages, self.micro_batches
        return (s - 1) / (m + s - 1)

    def to_dict(self) -> dict:
        return {"stages": [st.to_dict() for st in self.stages], "micro_batches": self.micro_batches,
                "schedule": self.schedule}

    @classmethod
    def from_dict(cls, d: dict) -> "Pipeline":
        return cls(tuple(PipelineStage.from_dict(s) for s in d["stages"]), int(d["micro_batches"]),
                   d.get("schedule", "1f1b"))


def pipeline_schedule(num_stages: int, micro_batches: int, kind: str) -> list[list[ScheduleStep]]:
    """Per stage, the order in which it runs its micro-batches' forward ('F') and backward ('B') steps.

    ``fill_drain`` and ``deferred_w``: F0..F(M-1), then B(M-1)..B0. ``1f1b``: min(S - s, M) forwards, then one
    backward and one forward alternately, then the remaining backwards (module docstring draws them). Every
    stage's list holds each ('F', m) and ('B', m) once, and ('F', m) before ('B', m).
    """
    if num_stages < 1 or micro_batches < 1:
        raise StrategyError(f"a schedule needs at least one stage and one micro-batch "
                            f"(got {num_stages} stages, {micro_batches} micro-batches)")
    if kind not in SCHEDULES:
        raise StrategyError(f"unknown pipeline schedule {kind!r} (expected one of {', '.join(SCHEDULES)})")
    out: list[list[ScheduleStep]] = []
    for s in range(num_stages):
        if kind in ("fill_drain", DEFERRED_W):
            steps = [("F", m) for m in range(micro_batches)] + [("B", m) for m in reversed(range(micro_batches))]
        else:
            warmup = min(num_stages - s, micro_batches)
            steps = [("F", m) for m in range(warmup)]
            next_f, next_b = warmup, 0
            while next_b < micro_batches:
                steps.append(("B", next_b))
                next_b += 1
                if next_f < micro_batches:
                    steps.append(("F", next_f))
                    next_f += 1
        out.append(steps)
    return out


def max_in_flight(steps: list[ScheduleStep]) -> int:
    """The most micro-batches whose activations one stage holds at once (forward run, backward not yet)."""
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
