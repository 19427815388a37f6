"""Sufficient-factor broadcasting (SFB): weight gradients recomputed on every replica from gathered factors.

For a variable in ``strategy.sfb`` whose gradient is one batch-contracting MatMul ``dW = A^T B``
(``tag.strategy.sfb_eligibility``) in a multi-replica ``allreduce`` op group, the gradient is not all-reduced.
On every replica the two factors of its batch slice (``A_r``: rows x m, ``B_r``: rows x n; a 2-D operand
with its batch on axis 1 is transposed first) are put side by side, padded with zero rows to the largest
share, and one ``CollectiveGatherV2`` (ring on CPUs) gives every replica all blocks; each replica then
computes ``dW = A^T B`` over the gathered rows with one MatMul (zero rows add nothing). The MatMul's real
``transpose_a`` / ``transpose_b`` attributes are checked against the orientation the IR implies. That is
exactly what the simulator charges (``tag.sim.sfb``): one all-gather of ``max_share * (m + n)`` values per
replica and per SFB variable, and one MatMul on ``n * max_share`` rows.

Variables of ``strategy.sfb`` that are not eligible, or whose group is not a multi-replica allreduce
group, keep their all-reduce (a note says so); a name that is not a trainable variable with a gradient
is a StrategyError.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    st = builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16))
    st.sfb = [v.name for v in tg.variables if v.name.endswith("kernel")]
    res = rewrite(gd, tg, st, topo)    # kernels' gradients: gathered factors, one MatMul per replica
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tag.errors import StrategyError
from tag.strategy.sfb_eligibility import SufficientFactors, eligible_gradients

from . import collectives
from .context import RewriteState
from .graph_edit import attr_type, canonical, fill_defaults, split_tensor, tensor_name


def plan_sfb(st: RewriteState) -> None:
    """``sfb_tensors``: the gradients sent by sufficient-factor broadcasting (``strategy.sfb``, where it
    applies), with the Identity ops between them and the MatMul that computes them; ``sfb_factors``
    (MatMul op -> its factors); ``sfb_gathers`` empty (filled as the MatMuls are emitted)."""
    st.sfb_tensors = _find_sfb_tensors(st)


def _find_sfb_tensors(st: RewriteState) -> set[str]:
    """The SFB gradient tensors (``plan_sfb``); fills ``sfb_factors`` and ``sfb_gathers``."""
    out: set[str] = set()
    st.sfb_factors = {}
    st.sfb_gathers = {}
    if not st.strategy.sfb:
        return out
    info = {v.name: v for v in st.ir.variables}
    eligible = {f.variable: f for f in eligible_gradients(st.ir)}
    for name in dict.fromkeys(st.strategy.sfb):
        v = info.get(name)
        if v is None or v.kind != "trainable" or not v.gradient:
            raise StrategyError(f"strategy.sfb names {name!r}, which is not a trainable variable with a gradient")
        f = eligible.get(name)
        g = st.group(v.apply_op) if v.apply_op else None
        if f is None or g is None or st.strategy.actions[g].mode != "allreduce" or st.pipelined(g) \
                or len(st.replicas(g)[0]) < 2 or not _attributes_match(st, f):
            st.notes.append(f"sfb: {name} keeps its all-reduce (its gradient is not one batch-contracting "
                              f"MatMul in a replicated allreduce group)")
            continue
        t = canonical(v.gradient)
        while True:
            out.add(t)
            node = st.nodes[split_tensor(t)[0]]
            if node.op != "Identity":
                break
            t = canonical(node.input[0])
        st.sfb_factors[split_tensor(t)[0]] = f
    return out


def _attributes_match(st: RewriteState, f: SufficientFactors) -> bool:
    """The gradient MatMul's transpose attributes contract the factors' batch axes (as the IR implies)."""
    node = st.nodes[st.ir.ops[f.gradient_op].name]
    return bool(node.attr["transpose_a"].b) == (f.batch_axes[0] == 0) and \
        bool(node.attr["transpose_b"].b) == (f.batch_axes[1] == 1)


def sfb_gradient(st: RewriteState, t: str, dev: int, consumer: str) -> str:
    """SFB gradient T for update op CONSUMER on DEV: the MatMul over gathered factors, or an Identity
    between it and the gradient recomputed on DEV."""
    p, k = split_tensor(t)
    if p in st.sfb_factors:
        gathered = _sfb_gather(st, p, st.group(consumer))
        if dev in gathered:
            return gathered[dev]
    return tensor_name(st.emission.clone(st, p, st.full_batch, dev, consumer).name, k)


def _sfb_gather(st: RewriteState, p: str, g: int) -> dict[int, str]:
    """Gradient MatMul P recomputed on every replica of op group G from all-gathered factors."""
    if p in st.sfb_gathers:
        return st.sfb_gathers[p]
    f = st.sfb_factors[p]
    devs, ranges = st.replicas(g)
    max_rows = max(r[1] - r[0] for r in ranges) * f.rows_per_example[0]
    dtype = st.dtype(f.factors[0])
    dstrs = [st.topo.tf_device(d) for d in devs]
    ikey = collectives.instance_key(st, f"sfb|{f.variable}", devs, dstrs)
    m = st.ref_shape(tensor_name(p, 0))[0]
    out = {}
    base = f"tag/sfb/{p}"
    for d, r in zip(devs, ranges, strict=True):
        block = _factor_block(st, f, p, d, r, max_rows, dtype, base)
        consts = [st.const(f"{base}/{key}_{d}", np.array(v, np.int32), d)
                  for key, v in (("group_size", len(devs)), ("group_key", collectives.collective_group_key(dstrs)),
                                 ("instance_key", ikey))]
        gather = st.fresh(f"{base}/gather_{d}")
        node = node_def_pb2.NodeDef(name=gather, op="CollectiveGatherV2", device=st.topo.tf_device(d))
        node.input.extend([block] + consts)
        node.attr["T"].CopyFrom(attr_type(dtype))
        cpu_only = all(st.topo.devices[x].tf_device_type == "CPU" for x in devs)
        node.attr["communication_hint"].s = b"ring" if cpu_only else b"auto"
        st.out_nodes.append(fill_defaults(node))
        a = _column_slice(st, f"{base}/a_{d}", gather, 0, m, dtype, d)
        b = _column_slice(st, f"{base}/b_{d}", gather, m, -1, dtype, d)
        mm = st.fresh(f"{base}/matmul_{d}")
        node = node_def_pb2.NodeDef(name=mm, op="MatMul", device=st.topo.tf_device(d))
        node.input.extend([a, b])
        node.attr["T"].CopyFrom(attr_type(dtype))
        node.attr["transpose_a"].b = True
        node.attr["transpose_b"].b = False
        st.out_nodes.append(fill_defaults(node))
        out[d] = mm
    st.counts["sfb gathers"] = st.counts.get("sfb gathers", 0) + 1
    st.sfb_gathers[p] = out
    return out


def _factor_block(st: RewriteState, f: SufficientFactors, p: str, d: int, r: tuple[int, int], max_rows: int,
                  dtype: "tf.DType", base: str) -> str:
    """Replica D's factors of examples R as one [max_rows, m + n] block: batch rows first, side by
    side, zero rows appended up to MAX_ROWS."""
    parts = []
    for j, (factor, ax) in enumerate(zip(f.factors, f.batch_axes, strict=True)):
        x = st.emission.resolve(st, factor, r, d, p, d)
        if ax == 1:
            perm = st.const(f"{base}/perm_{j}_{d}", np.array([1, 0], np.int32), d)
            x = st.int32_indexed(st.fresh(f"{base}/transpose_{j}_{d}"), "Transpose", [x, perm], dtype,
                                    "Tperm", d)
        parts.append(x)
    axis = st.const(f"{base}/concat_{d}/axis", np.array(1, np.int32), d)
    block = st.concat_node(st.fresh(f"{base}/concat_{d}"), parts, axis, dtype, d)
    rows = (r[1] - r[0]) * f.rows_per_example[0]
    if rows == max_rows:
        return block
    pads = st.const(f"{base}/pad_{d}/paddings", np.array([[0, max_rows - rows], [0, 0]], np.int32), d)
    return st.int32_indexed(st.fresh(f"{base}/pad_{d}"), "Pad", [block, pads], dtype, "Tpaddings", d)


def _column_slice(st: RewriteState, base: str, t: str, begin: int, size: int, dtype: "tf.DType", dev: int) -> str:
    """Columns BEGIN..BEGIN+SIZE (SIZE -1: to the end) of the 2-D tensor T on DEV."""
    name = st.fresh(base)
    b = st.const(f"{name}/begin", np.array([0, begin], np.int32), dev)
    s = st.const(f"{name}/size", np.array([-1, size], np.int32), dev)
    return st.int32_indexed(name, "Slice", [t, b, s], dtype, "Index", dev)
