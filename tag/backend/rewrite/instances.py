"""Instances: one copy of every kept op per placement, and the tensor each input of a copy reads.

Every op gets one *instance* per (batch range, device) of its placement; replica ``d`` of op ``x`` is
named ``x/replica_d``, while ops with one instance keep their names. Each data input of an instance is
*resolved*: the producer's instance with the same range (on the same device if possible); else a
re-split of a batch-axis tensor (``batch_split``), a sum of gradient partial sums (``parameter_server``,
``collectives``), or -- for anything else that depends on the batch (shapes, statistics) -- a clone of
the producer computed for the consumer's range.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    [n.name for n in res.graph_def.node if n.name.startswith("mlp/dense_0/MatMul")]
"""
from __future__ import annotations

import hashlib

from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import op_def_registry

from tag.errors import RewriteError
from tag.ir.op_types import FUNCTION_CALL_TYPES, PLACEHOLDER_TYPES, VARIABLE_TYPES

from . import batch_split, collectives, loop_state, loss, parameter_server, pipeline, variables
from .context import Emission, RewriteState
from .graph_edit import Instance, Range, pick_instance, split_tensor, tensor_name

# what the rewrite adds -> counted in the notes ("3 slices added")
_COUNTED = ("slices", "concats", "sums", "allreduces", "fused allreduces", "dense table sums", "clones")


def begin_output(st: RewriteState) -> None:
    """An empty output graph (every original name taken), its instance tables and memos, the token that
    seeds collective instance keys, zero counts, and the function library for per-batch copies."""
    st.out_nodes = []
    st.used_names = set(st.nodes)
    st.instances = {}
    st.instance_at = {}
    st.memo = {}
    token = hashlib.sha1()
    token.update(st.strategy.to_json().encode())
    token.update(repr(sorted(st.nodes)).encode())
    st.token = token.hexdigest()      # makes collective instance keys differ between graphs
    st.counts = {k: 0 for k in _COUNTED}
    st.allreduce_memo = {}
    st.instance_key_of = {}
    st.taken_instance_keys = set()
    st.emission = Emission(resolve, clone)
    loop_state.begin_function_copies(st)


def emit_instances(st: RewriteState) -> None:
    """Emit every op's instances in topological order (with what resolving their inputs adds)."""
    for n in st.order:
        placements = st.placements[n]
        names = _instance_names(st, n, placements)
        st.instances[n] = []
        for (rng, asked_dev), name in zip(placements, names, strict=True):
            _emit(st, n, rng, asked_dev, name, primary=True)


def note_counts(st: RewriteState) -> None:
    """A note per kind of node the rewrite added ("3 slices added")."""
    for k, v in st.counts.items():
        if v:
            st.notes.append(f"{v} {k} added")


def _instance_names(st: RewriteState, n: str, placements: list[tuple[Range, int]]) -> list[str]:
    if len(placements) == 1:
        return [n]
    names = []
    micro = st.stage_of_group is not None and len({d for _, d in placements}) < len(placements)
    for rng, asked_dev in placements:
        name = f"{n}/replica_{asked_dev}"
        if micro:
            name += f"_micro_{pipeline.micro_index(st, rng)}"
        if name in st.nodes:
            raise RewriteError(f"op {n!r}: the name {name!r} of its replica is taken in the graph")
        names.append(name)
    if len(set(names)) != len(names):
        raise RewriteError(f"op {n!r} has two instances on one device")
    return names


def _emit(st: RewriteState, n: str, rng: Range, asked_dev: int, name: str, primary: bool) -> Instance:
    """A copy of op N named NAME for examples RNG, asked on ASKED_DEV, with resolved inputs."""
    if n in st.dense_sparse:
        dense = collectives.dense_rows(st, n, rng, asked_dev, name, primary)
        if dense is not None:
            return dense
    orig = st.nodes[n]
    dev = variables.device_for(st, n, asked_dev)
    inst = Instance(name, rng, asked_dev, dev, primary)
    node = node_def_pb2.NodeDef()
    if orig.op == "Const":
        scaled = batch_split.batch_const_value(st, n, rng) if st.batch_axis(n) is not None else \
            batch_split.const_value(st, n, rng[1] - rng[0])
        node.CopyFrom(scaled if scaled is not None else orig)
    else:
        node.CopyFrom(orig)
    node.name = name
    st.used_names.add(name)
    node.device = st.topo.tf_device(dev)
    for a in ("_class", "_output_shapes"):
        if a in node.attr:
            del node.attr[a]
    size = rng[1] - rng[0]
    if orig.op in VARIABLE_TYPES and orig.op == "VarHandleOp" and name != n:
        node.attr["shared_name"].s = name.encode()
    if orig.op in PLACEHOLDER_TYPES:
        batch_split.rescale_placeholder(st, n, node)
    if size != st.ref_batch and "output_shapes" in node.attr:
        for s in node.attr["output_shapes"].list.shape:
            s.Clear()
            s.unknown_rank = True
    if size != st.ref_batch:
        loop_state.rescale_function_attrs(st, node, size)     # loop bodies with batch-sized list elements
        loop_state.rescale_element_shape_attr(st, node, size)
    del node.input[:]
    data, ctrl = [], []
    for i in orig.input:
        if i.startswith("^"):
            ctrl.extend(_control(st, i[1:], n, rng, asked_dev))
        else:
            data.append(resolve(st, i, rng, dev, n, asked_dev))
    if n in st.seeds:
        loss.scale_seed(st, n, name, data, size, dev)
    node.input.extend(data)
    seen = set()
    for c in ctrl:
        if c not in seen:
            seen.add(c)
            node.input.append("^" + c)
    st.out_nodes.append(node)
    st.instances.setdefault(n, []).append(inst)
    st.instance_at.setdefault((n, rng, asked_dev), inst)
    return inst


def _control(st: RewriteState, p: str, consumer: str, rng: Range, asked_dev: int) -> list[str]:
    """Control inputs: the matching instance when both ops have the same instances (and the consumer's
    instances act on their own replica's state), else all of them -- in a pipeline, all of them that
    share examples with RNG: a micro-batch's op waits for the same micro-batch of an op in another
    stage, not for every micro-batch (which orders a later micro-batch's backward before an earlier one's
    and, under 1F1B's schedule, closes a cycle). A micro-batch's op does not wait for a deferred
    weight-gradient op (``deferred_ops``), which runs once all micro-batches are done."""
    if p in st.deferred_ops and consumer not in st.deferred_ops and rng != st.full_batch:
        return []
    if st.placements.get(consumer) == st.placements.get(p) and not variables.shares_copy(st, consumer):
        inst = st.instance_at.get((p, rng, asked_dev))
        if inst is not None:
            return [inst.name]
    primary = [i for i in st.instances[p] if i.primary]
    if st.stage_of_group is not None:
        overlapping = [i.name for i in primary if i.rng[0] < rng[1] and rng[0] < i.rng[1]]
        if overlapping:
            return overlapping
    return [i.name for i in primary]


def clone(st: RewriteState, p: str, rng: Range, dev: int, consumer: str) -> Instance:
    """An extra instance of P computed on RNG at DEV (for a consumer that needs exactly that)."""
    inst = st.instance_at.get((p, rng, dev))
    if inst is not None:
        return inst
    node = st.nodes[p]
    op_def = op_def_registry.get(node.op)
    if node.op in PLACEHOLDER_TYPES or node.op in VARIABLE_TYPES or variables.writes(st, p) or (
            op_def is not None and op_def.is_stateful and node.op not in variables.CLONABLE_STATEFUL):
        raise RewriteError(f"op {consumer!r} needs {p!r} ({node.op}) for examples {rng[0]}..{rng[1] - 1}, "
                           f"which only its own instances compute, and {node.op} cannot be recomputed")
    name = st.fresh(f"{p}/tag_{dev}_{rng[0]}_{rng[1]}")
    st.counts["clones"] += 1
    return _emit(st, p, rng, dev, name, primary=False)


# -------------------------------------------------------------------------------- resolution
def resolve(st: RewriteState, t: str, rng: Range, dev: int, consumer: str, consumer_asked_dev: int) -> str:
    """Name of the tensor that gives instance (RNG, DEV) of CONSUMER the value of T."""
    p, k = split_tensor(t)
    insts = st.instances[p]
    if st.nodes[p].op in VARIABLE_TYPES or variables.var_of(st, t) is not None:
        same = [i for i in insts if i.dev == dev]
        if not same and st.nodes[consumer].op in FUNCTION_CALL_TYPES:
            same = insts[:1]
        if not same:
            raise RewriteError(f"op {consumer!r} needs variable {p!r} on {st.topo.tf_device(dev)}, "
                               f"where it has no copy")
        return tensor_name(same[0].name, k)
    if not st.batch_dependent[p]:
        if st.stage_of_group is not None:   # per-micro-batch copies (a constant after a gradient) stay in theirs
            same = [i for i in insts if i.rng == rng and i.dev == dev]
            if same:
                return tensor_name(same[0].name, k)
        return tensor_name(pick_instance(insts, dev, consumer_asked_dev).name, k)
    same = [i for i in insts if i.rng == rng]
    if tensor_name(p, k) in st.sfb_tensors:        # recomputed on every device that needs it, not shipped
        same = [i for i in same if i.dev == dev]
    if same:
        return tensor_name(pick_instance(same, dev, consumer_asked_dev).name, k)
    if st.batch_axis(t) is not None:
        return batch_split.resplit(st, t, rng, dev)
    if st.additive(t):
        if rng == st.full_batch:
            return parameter_server.aggregate(st, t, dev, consumer)
        parts = st.tiling(p, rng)
        if parts is not None:
            return parameter_server.add_n(st, t, [tensor_name(i.name, k) for i in parts], rng, dev)
    return tensor_name(clone(st, p, rng, dev, consumer).name, k)


