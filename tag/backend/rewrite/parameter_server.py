"""Parameter server and gradient aggregation: whole-batch sums of gradient partial sums.

Optimizer-update ops that depend on gradients run on the summed gradient (range = whole batch): once
per replica device for ``allreduce`` (copies stay identical; ``collectives`` sums them), once on
``ps_device`` for ``ps`` -- the replicas' partial sums are added there by one ``AddN``, as they are
wherever else a whole-batch value is needed. Sparse (IndexedSlices) updates get the indices and
values of the whole batch, so the deduplication and scatter run as on one device. Where a ``ps``
group's variables live is decided with the other placements (``placement.ps_variable_devices``).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("ps", tg, topo, group_ops(tg, 16)), topo)
    [n.name for n in res.graph_def.node if n.name.startswith("tag/sum/")]   # AddN on the server
"""
from __future__ import annotations

from tensorflow.core.framework import node_def_pb2

from tag.errors import RewriteError

from . import collectives, pipeline, sfb
from .context import RewriteState
from .graph_edit import Range, attr_type, canonical, split_tensor, tensor_name


def aggregate(st: RewriteState, t: str, dev: int, consumer: str) -> str:
    """The whole-batch sum of gradient partial sums T, on DEV, for an update op CONSUMER.

    Gradients in ``strategy.sfb`` are recomputed on the whole batch instead (``sfb``); gradients of
    allreduce groups come from their (fused) collective; anything else is an AddN on DEV.
    """
    t = canonical(t)
    p, k = split_tensor(t)
    if t in st.sfb_tensors:
        return sfb.sfb_gradient(st, t, dev, consumer)
    fused = collectives.fused(st, t, dev)
    if fused is not None:
        return fused
    g = st.group(consumer)
    if g is not None and st.strategy.actions[g].mode == "allreduce":
        devs, ranges = st.replicas(g)
        if len(devs) > 1 and dev in devs:
            return collectives.allreduce(st, t, devs, ranges)[dev]
    parts = st.tiling(p, st.full_batch)
    if parts is None:
        raise RewriteError(f"gradient {t!r}: its instances do not tile the batch, cannot sum them")
    if st.pipelined(st.group(p)):   # each device first adds its micro-batches' partial sums
        partials = [pipeline.replica_partial(st, t, None, d) for d in dict.fromkeys(i.asked_dev for i in parts)]
        return add_n(st, t, partials, st.full_batch, dev)
    return add_n(st, t, [tensor_name(i.name, k) for i in parts], st.full_batch, dev)


def add_n(st: RewriteState, t: str, parts: list[str], rng: Range, dev: int, memo_key: tuple | None = None) -> str:
    """PARTS (partial sums of T over examples RNG) summed by one AddN on DEV (memoised by MEMO_KEY,
    default: T, RNG and DEV)."""
    memo_key = memo_key or ("sum", t, rng, dev)
    if memo_key in st.memo:
        return st.memo[memo_key]
    if len(parts) == 1:
        return parts[0]
    p, k = split_tensor(t)
    name = st.fresh(f"tag/sum/{p}_{k}/{dev}")
    node = node_def_pb2.NodeDef(name=name, op="AddN", device=st.topo.tf_device(dev))
    node.input.extend(parts)
    node.attr["N"].i = len(parts)
    node.attr["T"].CopyFrom(attr_type(st.dtype(t)))
    st.out_nodes.append(node)
    st.counts["sums"] += 1
    st.memo[memo_key] = name
    return name
