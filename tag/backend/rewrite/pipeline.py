"""Pipelines: micro-batched copies of each stage's forward and backward, accumulated gradients, and the
schedule enforced by control dependencies.

For a strategy with a ``pipeline`` (``tag.strategy.pipeline``), the global batch is cut into M equal
micro-batches (``batch_shares`` of equal weights: sizes differ by at most one example). Each op of a
stage's op groups that works on the batch gets one instance per (micro-batch, device of the stage): the
stage's devices split every micro-batch by their speeds (data parallelism inside the stage, as
``allreduce``/``ps`` groups split the batch), so an instance is an ordinary (batch range, device) instance
of the rewriter whose range lies inside one micro-batch. Everything else follows from the rewriter's
rules:

* activations and their gradients that cross stages are batch-axis tensors of another range: sliced and
  concatenated where needed and sent by TensorFlow's runtime between devices;
* each instance's gradient seed is ``s / B`` for its ``s`` examples of the global batch ``B``, so every
  weight gradient of an instance is an exact partial sum; a device first adds its micro-batches' partial
  sums one by one, in the order its backward steps run (gradient accumulation: a running sum), then the
  stage sums its devices' accumulations (one all-reduce or a push to the parameter server) and applies the
  original optimizer ops once per step: the step equals the single-device step;
* the loss is the share-weighted sum of the micro-batches' losses.

Under the ``deferred_w`` schedule, a stage on one device runs its weight-gradient ops
(``tag.ir.algorithms.weight_gradient_ops``) once per step over the whole batch: their batch-axis inputs are
the micro-batches' tensors concatenated, their result is the device's whole gradient (no running sums), and
they, and the concatenations they read, wait (control dependency) for the stage's last schedule step, so they run
after it rather than beside the last micro-batch's backward (``_defer_after``). The control edges
``tf.tuple`` adds from them to the same layer's input gradients are dropped (they would make every
micro-batch's input gradient wait for the whole batch's weight gradient).

Ops that do not depend on the batch (variable reads) run once per device of the stage. BatchNorm
computes its statistics per micro-batch (and per device), as data parallelism does per replica.

TensorFlow's dataflow executor overlaps micro-batches across stages by itself. The schedule
(``Pipeline.steps()``: fill-drain or 1F1B) is enforced per stage and device: the instances of step k+1 wait
(control dependency) for a NoOp that waits for every instance of step k, so a stage runs its forward and
backward steps in the schedule's order and 1F1B holds at most ``S - s`` micro-batches' activations.
Instance names carry the micro-batch: ``x/replica_<device>_micro_<m>``.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tag.strategy.types import Strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    grouping = group_ops(tg, 8)
    half = grouping.num_groups // 2
    p = Pipeline((PipelineStage(tuple(range(half)), (0,)),
                  PipelineStage(tuple(range(half, grouping.num_groups)), (0,))), micro_batches=4)
    res = rewrite(gd, tg, Strategy.pipelined(grouping, p), topo)   # may raise StrategyError on a bad cut
"""
from __future__ import annotations

import bisect

import numpy as np
from tensorflow.core.framework import node_def_pb2

from tag.errors import StrategyError
from tag.ir.algorithms import weight_gradient_ops
from tag.ir.op_types import PLACEHOLDER_TYPES
from tag.strategy.pipeline import DEFERRED_W
from tag.strategy.types import batch_shares

from .context import RewriteContext
from .graph_edit import Range, attr_type, split_tensor, tensor_name

# ops whose last data input has the type of attr "T" and that oneDNN's layout pass merges with a neighbour,
# checking their in-edges (a control input among them aborts the TensorFlow worker)
_FUSED_BY_ONEDNN = frozenset({"Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "DepthwiseConv2dNative",
                              "BiasAdd", "BiasAddGrad", "MatMul"})
_STEP_PHASE = {"forward": "F", "backward": "B"}


class PipelineMixin(RewriteContext):
    """Micro-batch instances of pipelined op groups, gradient accumulation and the schedule's order."""

    # -------------------------------------------------------------------------------- set-up and checks
    def _setup_pipeline(self) -> None:
        """Stage of every op group, micro-batch ranges and per-stage instances; StrategyError (naming the
        stage) for a pipeline that does not fit the graph or the batch."""
        p = self.strategy.pipeline
        if p is None:
            return
        ngroups = self.strategy.grouping.num_groups
        if p.num_stages > ngroups:
            raise StrategyError(f"pipeline stage {ngroups}: the pipeline has {p.num_stages} stages for "
                                f"{ngroups} op groups")
        self.stage_of_group = p.stage_of_group(ngroups)
        M = p.micro_batches
        if M > self.batch:
            raise StrategyError(f"pipeline: {M} micro-batches for a batch of {self.batch} examples")
        start = 0
        for size in batch_shares([1.0] * M, self.batch):
            self.micro_ranges.append((start, start + size))
            start += size
        for s, stage in enumerate(p.stages):
            devs = [d for g in stage.placement for d in self.topo.groups[g].devices]
            if not devs:
                raise StrategyError(f"pipeline stage {s} is placed on no device")
            speeds = self.strategy.share_speeds(devs, self.topo)
            whole = batch_shares(speeds, self.batch) if len(devs) <= self.batch else [0] * len(devs)
            if min(whole) < M:
                d = devs[int(np.argmin(whole))]
                raise StrategyError(f"pipeline stage {s}: {M} micro-batches, but device {d} "
                                    f"({self.topo.tf_device(d)}) has a batch share of {min(whole)} examples")
            insts = []
            for lo, hi in self.micro_ranges:
                if hi - lo < len(devs):
                    raise StrategyError(f"pipeline stage {s}: a micro-batch of {hi - lo} examples cannot be "
                                        f"split over the stage's {len(devs)} devices")
                at = lo
                for d, share in zip(devs, batch_shares(speeds, hi - lo), strict=True):
                    insts.append(((at, at + share), d))
                    at += share
            self._stage_instances[s] = insts
        self.notes.append(f"pipeline: {p.num_stages} stages, {M} micro-batches, {p.schedule} schedule")
        self._defer_weight_gradients()

    def _defer_weight_gradients(self) -> None:
        """``deferred_ops``: the weight-gradient ops of the ``deferred_w`` pipeline's one-device stages."""
        p = self.strategy.pipeline
        if p.schedule != DEFERRED_W or len(self.micro_ranges) < 2:
            return
        single = {s for s, insts in self._stage_instances.items() if len({d for _, d in insts}) == 1}
        weight = weight_gradient_ops(self.ir)
        for i in weight.nonzero()[0].tolist():
            name = self.ir.ops[i].name
            g = int(self.strategy.grouping.group_of_op[i])
            if name in self.nodes and int(self.stage_of_group[g]) in single:
                self.deferred_ops.add(name)
        if self.deferred_ops:
            self.notes.append(f"pipeline: {len(self.deferred_ops)} weight-gradient ops run once per step")

    def _check_pipeline_order(self) -> None:
        """StrategyError unless the stages follow the dataflow: forward tensors only flow to the same or a
        later stage, backward tensors to the same or an earlier one (else a stage would wait for itself)."""
        if self.stage_of_group is None:
            return
        names = self.strategy.grouping.names
        for n in self.order:
            g = self._group(n)
            phase = self._phase(n)
            if g is None or phase not in _STEP_PHASE:
                continue
            s = int(self.stage_of_group[g])
            for i in self.nodes[n].input:
                p = split_tensor(i.lstrip("^"))[0]
                gp = self._group(p)
                pphase = self._phase(p)
                if gp is None or pphase not in _STEP_PHASE:
                    continue
                sp = int(self.stage_of_group[gp])
                if pphase == phase and ((phase == "forward" and sp > s) or (phase == "backward" and sp < s)):
                    later = "later" if phase == "forward" else "earlier"
                    raise StrategyError(
                        f"pipeline stage {s}: op group {g} ({names[g]}) takes a {phase} tensor of {p!r} from "
                        f"stage {sp}, which comes {later}; a stage's op groups must be contiguous in dependency "
                        f"order")
        for s, stage in enumerate(self.strategy.pipeline.stages):
            if not any(self._phase(n) in _STEP_PHASE and self._group(n) in stage.groups for n in self.order):
                self.notes.append(f"pipeline stage {s}: its op groups hold no forward or backward op (only "
                                  f"optimizer bookkeeping runs there)")

    # -------------------------------------------------------------------------------- instances
    def _compute_instances(self, g: int, op: str | None = None) -> list[tuple[Range, int]]:
        """(batch range, device) of the instances that compute op group G's batch work: one per replica,
        or, in a pipeline, one per (micro-batch, device of the stage). An op of a pipelined group that
        does not depend on the batch (a variable read) runs once per device."""
        if not self._pipelined(g):
            devs, ranges = self._replicas(g)
            return list(zip(ranges, devs, strict=True))
        insts = self._stage_instances[int(self.stage_of_group[g])]
        if op in self.deferred_ops:
            return [(self.full_batch, insts[0][1])]
        if op is not None and not self._per_micro_batch(op):
            first: dict[int, Range] = {}
            for rng, d in insts:
                first.setdefault(d, rng)
            return [(rng, d) for d, rng in first.items()]
        return list(insts)

    def _per_micro_batch(self, op: str) -> bool:
        """Does OP run once per micro-batch: it depends on the batch, or (also through control inputs, such
        as the NoOps of ``tf.tuple``) on an op that does?"""
        memo = self.__dict__.get("_micro_memo")
        if memo is None:          # once, in topological order (producers first)
            memo = self.__dict__["_micro_memo"] = {}
            for n in self.order:
                memo[n] = self.batch_dependent.get(n, False) or any(
                    memo.get(split_tensor(i.lstrip("^"))[0], False) for i in self.nodes[n].input)
        return memo.get(op, False)

    def _batch_source(self, n: str) -> bool:
        """A batch input (placeholder, iterator) or what only feeds one: it runs once, on the whole batch, and
        takes no control input (a synthetic input stands in for a placeholder by data edges only)."""
        return n in self.inputs or self.nodes[n].op in PLACEHOLDER_TYPES or (
            bool(self.consumers.get(n)) and all(c in self.inputs for c, _, _ in self.consumers[n]))

    def _micro_index(self, rng: Range) -> int:
        """The micro-batch holding the examples RNG."""
        return bisect.bisect_right([r[0] for r in self.micro_ranges], rng[0]) - 1

    def _replica_partial(self, t: str, rng: Range | None, dev: int) -> str:
        """Gradient partial sum T of replica DEV (examples RNG): for a pipelined producer, the sum of its
        micro-batch partial sums on DEV (gradient accumulation), else T resolved for (RNG, DEV).

        The micro-batches' partial sums are added one by one in the order the stage runs its backward steps,
        each as soon as it exists, so a device holds a running sum and at most one more partial per gradient
        rather than all M of them."""
        p, k = split_tensor(t)
        g = self._group(p)
        if not self._pipelined(g):
            return self._resolve(t, rng, dev, p, dev)
        parts = [i for i in self.instances[p] if i.primary and i.asked_dev == dev]
        if not parts or any(i.rng == self.full_batch for i in parts):
            return self._resolve(t, rng, dev, p, dev)
        memo_key = ("accumulated", t, dev)
        if memo_key in self.memo:
            return self.memo[memo_key]
        backward = [m for kind, m in self.strategy.pipeline.steps()[int(self.stage_of_group[g])] if kind == "B"]
        position = {m: j for j, m in enumerate(backward)}
        parts.sort(key=lambda i: (position.get(self._micro_index(i.rng), len(backward)), i.rng))
        total = tensor_name(parts[0].name, k)
        base = f"tag/accumulate/{p}_{k}/{dev}"
        for j, part in enumerate(parts[1:], start=1):
            name = self._fresh(f"{base}/{j}")
            node = node_def_pb2.NodeDef(name=name, op="AddV2", device=self.topo.tf_device(dev))
            node.input.extend([total, tensor_name(part.name, k)])
            node.attr["T"].CopyFrom(attr_type(self._dtype(t)))
            self.out_nodes.append(node)
            total = name
        self.memo[memo_key] = total
        return total

    # -------------------------------------------------------------------------------- the schedule
    def _enforce_schedule(self) -> None:
        """Control dependencies that make every (stage, device) run its steps in ``Pipeline.steps()`` order:
        instances of step k+1 wait for a NoOp that waits for every instance of step k."""
        if self.stage_of_group is None:
            return
        members: dict[tuple[int, int, str, int], list[str]] = {}
        for n, insts in self.instances.items():
            g, phase = self._group(n), self._phase(n)
            if g is None or phase not in _STEP_PHASE or not self._per_micro_batch(n) or self._batch_source(n):
                continue
            s = int(self.stage_of_group[g])
            for i in insts:
                if i.rng != self.full_batch or len(self.micro_ranges) == 1:
                    members.setdefault((s, i.asked_dev, _STEP_PHASE[phase], self._micro_index(i.rng)), []).append(
                        i.name)
        by_name = {node.name: node for node in self.out_nodes}
        readers: dict[str, set[str]] = {}       # node -> the nodes reading it (for _defer_after), built once
        for node in self.out_nodes if self.deferred_ops else ():
            for i in node.input:
                readers.setdefault(split_tensor(i.lstrip("^"))[0], set()).add(node.name)
        edges = 0
        for s, steps in enumerate(self.strategy.pipeline.steps()):
            devs = sorted({d for (s2, d, _, _) in members if s2 == s})
            for d in devs:
                prev = None
                for kind, m in steps:
                    names = members.get((s, d, kind, m), [])
                    if not names:
                        continue
                    if prev is not None:
                        for name in names:
                            self._wait_for(by_name[name], prev)
                            edges += 1
                    done = self._fresh(f"tag/pipeline/stage_{s}/{d}/{kind}{m}_done")
                    node = node_def_pb2.NodeDef(name=done, op="NoOp", device=self.topo.tf_device(d))
                    node.input.extend("^" + x for x in names)
                    self.out_nodes.append(node)
                    prev = done
                if prev is not None:
                    edges += self._defer_after(s, d, prev, by_name, readers)
        self.notes.append(f"pipeline: schedule enforced by {edges} control dependencies")

    def _defer_after(self, s: int, d: int, last: str, by_name: dict, readers: dict) -> int:
        """Make stage S's deferred weight-gradient instances on device D, and the concatenations of micro-batch
        tensors they read, start after the NoOp LAST of the stage's last step (READERS: node -> the nodes reading
        it); the control edges added.

        Why: ungated, a layer's weight-gradient ops become ready as soon as the last micro-batch's output
        gradient of that layer exists, and TensorFlow runs them beside the rest of that micro-batch's backward
        step, which then reaches the previous stage late. Traced on the testbed (bench_pipeline's transformer,
        three stages, M=16), the last micro-batch's backward left each stage 100-330 ms late while its 130-150
        ms whole-batch MatMuls shared the core, and the step ran 14-17% slower than fill-drain, where the
        simulator, which runs a stage's W task after its last step, put it within 3%."""
        if not self.deferred_ops:
            return 0
        deferred = [by_name[i.name] for n in self.deferred_ops
                    if (g := self._group(n)) is not None and int(self.stage_of_group[g]) == s
                    for i in self.instances.get(n, ()) if i.asked_dev == d and i.name in by_name]
        if not deferred:
            return 0
        names = {x.name for x in deferred}
        # a concatenation is gated only when deferred instances alone read it (a step reading it would wait
        # for itself)
        concats = {f.name: f for x in deferred for i in x.input if not i.startswith("^")
                   if (f := by_name.get(split_tensor(i)[0])) is not None and f.op == "ConcatV2"
                   and f.name.startswith("tag/concat/") and readers.get(f.name, set()) <= names}
        for x in deferred + list(concats.values()):
            self._wait_for(x, last)
        return len(deferred) + len(concats)

    def _wait_for(self, node: node_def_pb2.NodeDef, done: str) -> None:
        """Make NODE start after the NoOp DONE: a control input, or for ops oneDNN's graph pass fuses (which
        aborts the worker on a convolution with a control input: ``MergeConv2DWithBiasAdd``, "Check failed:
        pred->in_edges().size() == 2"), an Identity of NODE's last data input that waits for DONE instead."""
        data = [j for j, i in enumerate(node.input) if not i.startswith("^")]
        if node.op not in _FUSED_BY_ONEDNN or not data or "T" not in node.attr:
            node.input.append("^" + done)
            return
        j = data[-1]
        gate = node_def_pb2.NodeDef(name=self._fresh(f"{node.name}/tag_wait"), op="Identity", device=node.device)
        gate.input.extend([node.input[j], "^" + done])
        gate.attr["T"].CopyFrom(node.attr["T"])
        self.out_nodes.append(gate)
        node.input[j] = gate.name

    def _pipeline_replicas(self) -> dict[int, list[tuple[int, int, int]]]:
        """Pipelined op group -> [(device, first example, end example)] of its micro-batch instances."""
        if self.stage_of_group is None:
            return {}
        return {g: [(d, r[0], r[1]) for r, d in self._stage_instances[int(s)]]
                for g, s in enumerate(self.stage_of_group)}
