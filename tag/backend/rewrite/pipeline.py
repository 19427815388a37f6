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

from .context import RewriteState
from .graph_edit import Range, attr_type, split_tensor, tensor_name

# ops whose last data input has the type of attr "T" and that oneDNN's layout pass merges with a neighbour,
# checking their in-edges (a control input among them aborts the TensorFlow worker)
_FUSED_BY_ONEDNN = frozenset({"Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "DepthwiseConv2dNative",
                              "BiasAdd", "BiasAddGrad", "MatMul"})
_STEP_PHASE = {"forward": "F", "backward": "B"}


# -------------------------------------------------------------------------------- set-up and checks
def setup_pipeline(st: RewriteState) -> None:
    """Stage of every op group, micro-batch ranges, per-stage instances and deferred ops (None and empty
    without a pipeline); StrategyError (naming the stage) for a pipeline that does not fit the graph or
    the batch."""
    st.stage_of_group = None
    st.micro_ranges = []
    st.stage_instances = {}
    st.deferred_ops = set()
    p = st.strategy.pipeline
    if p is None:
        return
    ngroups = st.strategy.grouping.num_groups
    if p.num_stages > ngroups:
        raise StrategyError(f"pipeline stage {ngroups}: the pipeline has {p.num_stages} stages for "
                            f"{ngroups} op groups")
    st.stage_of_group = p.stage_of_group(ngroups)
    M = p.micro_batches
    if M > st.batch:
        raise StrategyError(f"pipeline: {M} micro-batches for a batch of {st.batch} examples")
    start = 0
    for size in batch_shares([1.0] * M, st.batch):
        st.micro_ranges.append((start, start + size))
        start += size
    for s, stage in enumerate(p.stages):
        devs = [d for g in stage.placement for d in st.topo.groups[g].devices]
        if not devs:
            raise StrategyError(f"pipeline stage {s} is placed on no device")
        speeds = st.strategy.share_speeds(devs, st.topo)
        whole = batch_shares(speeds, st.batch) if len(devs) <= st.batch else [0] * len(devs)
        if min(whole) < M:
            d = devs[int(np.argmin(whole))]
            raise StrategyError(f"pipeline stage {s}: {M} micro-batches, but device {d} "
                                f"({st.topo.tf_device(d)}) has a batch share of {min(whole)} examples")
        insts = []
        for lo, hi in st.micro_ranges:
            if hi - lo < len(devs):
                raise StrategyError(f"pipeline stage {s}: a micro-batch of {hi - lo} examples cannot be "
                                    f"split over the stage's {len(devs)} devices")
            at = lo
            for d, share in zip(devs, batch_shares(speeds, hi - lo), strict=True):
                insts.append(((at, at + share), d))
                at += share
        st.stage_instances[s] = insts
    st.notes.append(f"pipeline: {p.num_stages} stages, {M} micro-batches, {p.schedule} schedule")
    _defer_weight_gradients(st)


def _defer_weight_gradients(st: RewriteState) -> None:
    """``deferred_ops``: the weight-gradient ops of the ``deferred_w`` pipeline's one-device stages."""
    p = st.strategy.pipeline
    if p.schedule != DEFERRED_W or len(st.micro_ranges) < 2:
        return
    single = {s for s, insts in st.stage_instances.items() if len({d for _, d in insts}) == 1}
    weight = weight_gradient_ops(st.ir)
    for i in weight.nonzero()[0].tolist():
        name = st.ir.ops[i].name
        g = int(st.strategy.grouping.group_of_op[i])
        if name in st.nodes and int(st.stage_of_group[g]) in single:
            st.deferred_ops.add(name)
    if st.deferred_ops:
        st.notes.append(f"pipeline: {len(st.deferred_ops)} weight-gradient ops run once per step")


def check_pipeline_order(st: RewriteState) -> None:
    """StrategyError unless the stages follow the dataflow: forward tensors only flow to the same or a
    later stage, backward tensors to the same or an earlier one (else a stage would wait for itself)."""
    if st.stage_of_group is None:
        return
    names = st.strategy.grouping.names
    for n in st.order:
        g = st.group(n)
        phase = st.phase(n)
        if g is None or phase not in _STEP_PHASE:
            continue
        s = int(st.stage_of_group[g])
        for i in st.nodes[n].input:
            p = split_tensor(i.lstrip("^"))[0]
            gp = st.group(p)
            pphase = st.phase(p)
            if gp is None or pphase not in _STEP_PHASE:
                continue
            sp = int(st.stage_of_group[gp])
            if pphase == phase and ((phase == "forward" and sp > s) or (phase == "backward" and sp < s)):
                later = "later" if phase == "forward" else "earlier"
                raise StrategyError(
                    f"pipeline stage {s}: op group {g} ({names[g]}) takes a {phase} tensor of {p!r} from "
                    f"stage {sp}, which comes {later}; a stage's op groups must be contiguous in dependency "
                    f"order")
    for s, stage in enumerate(st.strategy.pipeline.stages):
        if not any(st.phase(n) in _STEP_PHASE and st.group(n) in stage.groups for n in st.order):
            st.notes.append(f"pipeline stage {s}: its op groups hold no forward or backward op (only "
                              f"optimizer bookkeeping runs there)")


# -------------------------------------------------------------------------------- instances
def compute_instances(st: RewriteState, g: int, op: str | None = None) -> list[tuple[Range, int]]:
    """(batch range, device) of the instances that compute op group G's batch work: one per replica,
    or, in a pipeline, one per (micro-batch, device of the stage). An op of a pipelined group that
    does not depend on the batch (a variable read) runs once per device."""
    if not st.pipelined(g):
        devs, ranges = st.replicas(g)
        return list(zip(ranges, devs, strict=True))
    insts = st.stage_instances[int(st.stage_of_group[g])]
    if op in st.deferred_ops:
        return [(st.full_batch, insts[0][1])]
    if op is not None and not _per_micro_batch(st, op):
        first: dict[int, Range] = {}
        for rng, d in insts:
            first.setdefault(d, rng)
        return [(rng, d) for d, rng in first.items()]
    return list(insts)


def _per_micro_batch(st: RewriteState, op: str) -> bool:
    """Does OP run once per micro-batch: it depends on the batch, or (also through control inputs, such
    as the NoOps of ``tf.tuple``) on an op that does?"""
    memo = st.micro_memo
    if memo is None:          # once, in topological order (producers first)
        memo = st.micro_memo = {}
        for n in st.order:
            memo[n] = st.batch_dependent.get(n, False) or any(
                memo.get(split_tensor(i.lstrip("^"))[0], False) for i in st.nodes[n].input)
    return memo.get(op, False)


def _batch_source(st: RewriteState, n: str) -> bool:
    """A batch input (placeholder, iterator) or what only feeds one: it runs once, on the whole batch, and
    takes no control input (a synthetic input stands in for a placeholder by data edges only)."""
    return n in st.inputs or st.nodes[n].op in PLACEHOLDER_TYPES or (
        bool(st.consumers.get(n)) and all(c in st.inputs for c, _, _ in st.consumers[n]))


def micro_index(st: RewriteState, rng: Range) -> int:
    """The micro-batch holding the examples RNG."""
    return bisect.bisect_right([r[0] for r in st.micro_ranges], rng[0]) - 1


def replica_partial(st: RewriteState, t: str, rng: Range | None, dev: int) -> str:
    """Gradient partial sum T of replica DEV (examples RNG): for a pipelined producer, the sum of its
    micro-batch partial sums on DEV (gradient accumulation), else T resolved for (RNG, DEV).

    The micro-batches' partial sums are added one by one in the order the stage runs its backward steps,
    each as soon as it exists, so a device holds a running sum and at most one more partial per gradient
    rather than all M of them."""
    p, k = split_tensor(t)
    g = st.group(p)
    if not st.pipelined(g):
        return st.emission.resolve(st, t, rng, dev, p, dev)
    parts = [i for i in st.instances[p] if i.primary and i.asked_dev == dev]
    if not parts or any(i.rng == st.full_batch for i in parts):
        return st.emission.resolve(st, t, rng, dev, p, dev)
    memo_key = ("accumulated", t, dev)
    if memo_key in st.memo:
        return st.memo[memo_key]
    backward = [m for kind, m in st.strategy.pipeline.steps()[int(st.stage_of_group[g])] if kind == "B"]
    position = {m: j for j, m in enumerate(backward)}
    parts.sort(key=lambda i: (position.get(micro_index(st, i.rng), len(backward)), i.rng))
    total = tensor_name(parts[0].name, k)
    base = f"tag/accumulate/{p}_{k}/{dev}"
    for j, part in enumerate(parts[1:], start=1):
        name = st.fresh(f"{base}/{j}")
        node = node_def_pb2.NodeDef(name=name, op="AddV2", device=st.topo.tf_device(dev))
        node.input.extend([total, tensor_name(part.name, k)])
        node.attr["T"].CopyFrom(attr_type(st.dtype(t)))
        st.out_nodes.append(node)
        total = name
    st.memo[memo_key] = total
    return total


# -------------------------------------------------------------------------------- the schedule
def enforce_schedule(st: RewriteState) -> None:
    """Control dependencies that make every (stage, device) run its steps in ``Pipeline.steps()`` order:
    instances of step k+1 wait for a NoOp that waits for every instance of step k."""
    if st.stage_of_group is None:
        return
    members: dict[tuple[int, int, str, int], list[str]] = {}
    for n, insts in st.instances.items():
        g, phase = st.group(n), st.phase(n)
        if g is None or phase not in _STEP_PHASE or not _per_micro_batch(st, n) or _batch_source(st, n):
            continue
        s = int(st.stage_of_group[g])
        for i in insts:
            if i.rng != st.full_batch or len(st.micro_ranges) == 1:
                members.setdefault((s, i.asked_dev, _STEP_PHASE[phase], micro_index(st, i.rng)), []).append(
                    i.name)
    by_name = {node.name: node for node in st.out_nodes}
    readers: dict[str, set[str]] = {}       # node -> the nodes reading it (for _defer_after), built once
    for node in st.out_nodes if st.deferred_ops else ():
        for i in node.input:
            readers.setdefault(split_tensor(i.lstrip("^"))[0], set()).add(node.name)
    edges = 0
    for s, steps in enumerate(st.strategy.pipeline.steps()):
        devs = sorted({d for (s2, d, _, _) in members if s2 == s})
        for d in devs:
            prev = None
            for kind, m in steps:
                names = members.get((s, d, kind, m), [])
                if not names:
                    continue
                if prev is not None:
                    for name in names:
                        _wait_for(st, by_name[name], prev)
                        edges += 1
                done = st.fresh(f"tag/pipeline/stage_{s}/{d}/{kind}{m}_done")
                node = node_def_pb2.NodeDef(name=done, op="NoOp", device=st.topo.tf_device(d))
                node.input.extend("^" + x for x in names)
                st.out_nodes.append(node)
                prev = done
            if prev is not None:
                edges += _defer_after(st, s, d, prev, by_name, readers)
    st.notes.append(f"pipeline: schedule enforced by {edges} control dependencies")


def _defer_after(st: RewriteState, s: int, d: int, last: str, by_name: dict, readers: dict) -> int:
    """Make stage S's deferred weight-gradient instances on device D, and the concatenations of micro-batch
    tensors they read, start after the NoOp LAST of the stage's last step (READERS: node -> the nodes reading
    it); the control edges added.

    Why: ungated, a layer's weight-gradient ops become ready as soon as the last micro-batch's output
    gradient of that layer exists, and TensorFlow runs them beside the rest of that micro-batch's backward
    step, which then reaches the previous stage late. Traced on the testbed (bench_pipeline's transformer,
    three stages, M=16), the last micro-batch's backward left each stage 100-330 ms late while its 130-150
    ms whole-batch MatMuls shared the core, and the step ran 14-17% slower than fill-drain, where the
    simulator, which runs a stage's W task after its last step, put it within 3%."""
    if not st.deferred_ops:
        return 0
    deferred = [by_name[i.name] for n in sorted(st.deferred_ops)
                if (g := st.group(n)) is not None and int(st.stage_of_group[g]) == s
                for i in st.instances.get(n, ()) if i.asked_dev == d and i.name in by_name]
    if not deferred:
        return 0
    names = {x.name for x in deferred}
    # a concatenation is gated only when deferred instances alone read it (a step reading it would wait
    # for itself)
    concats = {f.name: f for x in deferred for i in x.input if not i.startswith("^")
               if (f := by_name.get(split_tensor(i)[0])) is not None and f.op == "ConcatV2"
               and f.name.startswith("tag/concat/") and readers.get(f.name, set()) <= names}
    for x in deferred + list(concats.values()):
        _wait_for(st, x, last)
    return len(deferred) + len(concats)


def _wait_for(st: RewriteState, node: node_def_pb2.NodeDef, done: str) -> None:
    """Make NODE start after the NoOp DONE: a control input, or for ops oneDNN's graph pass fuses (which
    aborts the worker on a convolution with a control input: ``MergeConv2DWithBiasAdd``, "Check failed:
    pred->in_edges().size() == 2"), an Identity of NODE's last data input that waits for DONE instead."""
    data = [j for j, i in enumerate(node.input) if not i.startswith("^")]
    if node.op not in _FUSED_BY_ONEDNN or not data or "T" not in node.attr:
        node.input.append("^" + done)
        return
    j = data[-1]
    gate = node_def_pb2.NodeDef(name=st.fresh(f"{node.name}/tag_wait"), op="Identity", device=node.device)
    gate.input.extend([node.input[j], "^" + done])
    gate.attr["T"].CopyFrom(node.attr["T"])
    st.out_nodes.append(gate)
    node.input[j] = gate.name


def pipeline_replicas(st: RewriteState) -> dict[int, list[tuple[int, int, int]]]:
    """Pipelined op group -> [(device, first example, end example)] of its micro-batch instances."""
    if st.stage_of_group is None:
        return {}
    return {g: [(d, r[0], r[1]) for r, d in st.stage_instances[int(s)]]
            for g, s in enumerate(st.stage_of_group)}
