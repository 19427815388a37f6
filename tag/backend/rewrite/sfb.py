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

from .collectives import collective_group_key
from .context import RewriteContext
from .graph_edit import attr_type, canonical, fill_defaults, split_tensor, tensor_name


class SfbMixin(RewriteContext):
    """Finds the SFB gradient tensors (``sfb_tensors``) and computes them from gathered factors."""

    def _find_sfb_tensors(self) -> set[str]:
        """Gradients sent by sufficient-factor broadcasting (``strategy.sfb``, where it applies), with the
        Identity ops between them and the MatMul that computes them; fills ``sfb_factors`` (MatMul op ->
        its factors)."""
        out: set[str] = set()
        self.sfb_factors: dict[str, SufficientFactors] = {}
        self.sfb_gathers: dict[str, dict[int, str]] = {}      # MatMul op -> device -> its gradient there
        if not self.strategy.sfb:
            return out
        info = {v.name: v for v in self.ir.variables}
        eligible = {f.variable: f for f in eligible_gradients(self.ir)}
        for name in dict.fromkeys(self.strategy.sfb):
            v = info.get(name)
            if v is None or v.kind != "trainable" or not v.gradient:
                raise StrategyError(f"strategy.sfb names {name!r}, which is not a trainable variable with a gradient")
            f = eligible.get(name)
            g = self._group(v.apply_op) if v.apply_op else None
            if f is None or g is None or self.strategy.actions[g].mode != "allreduce" or self._pipelined(g) \
                    or len(self._replicas(g)[0]) < 2 or not self._attributes_match(f):
                self.notes.append(f"sfb: {name} keeps its all-reduce (its gradient is not one batch-contracting "
                                  f"MatMul in a replicated allreduce group)")
                continue
            t = canonical(v.gradient)
            while True:
                out.add(t)
                node = self.nodes[split_tensor(t)[0]]
                if node.op != "Identity":
                    break
                t = canonical(node.input[0])
            self.sfb_factors[split_tensor(t)[0]] = f
        return out

    def _attributes_match(self, f: SufficientFactors) -> bool:
        """The gradient MatMul's transpose attributes contract the factors' batch axes (as the IR implies)."""
        node = self.nodes[self.ir.ops[f.gradient_op].name]
        return bool(node.attr["transpose_a"].b) == (f.batch_axes[0] == 0) and \
            bool(node.attr["transpose_b"].b) == (f.batch_axes[1] == 1)

    def _sfb_gradient(self, t: str, dev: int, consumer: str) -> str:
        """SFB gradient T for update op CONSUMER on DEV: the MatMul over gathered factors, or an Identity
        between it and the gradient recomputed on DEV."""
        p, k = split_tensor(t)
        if p in self.sfb_factors:
            gathered = self._sfb_gather(p, self._group(consumer))
            if dev in gathered:
                return gathered[dev]
        return tensor_name(self._clone(p, self.full_batch, dev, consumer).name, k)

    def _sfb_gather(self, p: str, g: int) -> dict[int, str]:
        """Gradient MatMul P recomputed on every replica of op group G from all-gathered factors."""
        if p in self.sfb_gathers:
            return self.sfb_gathers[p]
        f = self.sfb_factors[p]
        devs, ranges = self._replicas(g)
        max_rows = max(r[1] - r[0] for r in ranges) * f.rows_per_example[0]
        dtype = self._dtype(f.factors[0])
        dstrs = [self.topo.tf_device(d) for d in devs]
        ikey = self._instance_key(f"sfb|{f.variable}", devs, dstrs)
        m = self._ref_shape(tensor_name(p, 0))[0]
        out = {}
        base = f"tag/sfb/{p}"
        for d, r in zip(devs, ranges, strict=True):
            block = self._factor_block(f, p, d, r, max_rows, dtype, base)
            consts = [self._const(f"{base}/{key}_{d}", np.array(v, np.int32), d)
                      for key, v in (("group_size", len(devs)), ("group_key", collective_group_key(dstrs)),
                                     ("instance_key", ikey))]
            gather = self._fresh(f"{base}/gather_{d}")
            node = node_def_pb2.NodeDef(name=gather, op="CollectiveGatherV2", device=self.topo.tf_device(d))
            node.input.extend([block] + consts)
            node.attr["T"].CopyFrom(attr_type(dtype))
            cpu_only = all(self.topo.devices[x].tf_device_type == "CPU" for x in devs)
            node.attr["communication_hint"].s = b"ring" if cpu_only else b"auto"
            self.out_nodes.append(fill_defaults(node))
            a = self._column_slice(f"{base}/a_{d}", gather, 0, m, dtype, d)
            b = self._column_slice(f"{base}/b_{d}", gather, m, -1, dtype, d)
            mm = self._fresh(f"{base}/matmul_{d}")
            node = node_def_pb2.NodeDef(name=mm, op="MatMul", device=self.topo.tf_device(d))
            node.input.extend([a, b])
            node.attr["T"].CopyFrom(attr_type(dtype))
            node.attr["transpose_a"].b = True
            node.attr["transpose_b"].b = False
            self.out_nodes.append(fill_defaults(node))
            out[d] = mm
        self.counts["sfb gathers"] = self.counts.get("sfb gathers", 0) + 1
        self.sfb_gathers[p] = out
        return out

    def _factor_block(self, f: SufficientFactors, p: str, d: int, r: tuple[int, int], max_rows: int,
                      dtype: "tf.DType", base: str) -> str:
        """Replica D's factors of examples R as one [max_rows, m + n] block: batch rows first, side by
        side, zero rows appended up to MAX_ROWS."""
        parts = []
        for j, (factor, ax) in enumerate(zip(f.factors, f.batch_axes, strict=True)):
            x = self._resolve(factor, r, d, p, d)
            if ax == 1:
                perm = self._const(f"{base}/perm_{j}_{d}", np.array([1, 0], np.int32), d)
                x = self._int32_indexed(self._fresh(f"{base}/transpose_{j}_{d}"), "Transpose", [x, perm], dtype,
                                        "Tperm", d)
            parts.append(x)
        axis = self._const(f"{base}/concat_{d}/axis", np.array(1, np.int32), d)
        block = self._concat_node(self._fresh(f"{base}/concat_{d}"), parts, axis, dtype, d)
        rows = (r[1] - r[0]) * f.rows_per_example[0]
        if rows == max_rows:
            return block
        pads = self._const(f"{base}/pad_{d}/paddings", np.array([[0, max_rows - rows], [0, 0]], np.int32), d)
        return self._int32_indexed(self._fresh(f"{base}/pad_{d}"), "Pad", [block, pads], dtype, "Tpaddings", d)

    def _column_slice(self, base: str, t: str, begin: int, size: int, dtype: "tf.DType", dev: int) -> str:
        """Columns BEGIN..BEGIN+SIZE (SIZE -1: to the end) of the 2-D tensor T on DEV."""
        name = self._fresh(base)
        b = self._const(f"{name}/begin", np.array([0, begin], np.int32), dev)
        s = self._const(f"{name}/size", np.array([-1, size], np.int32), dev)
        return self._int32_indexed(name, "Slice", [t, b, s], dtype, "Index", dev)
