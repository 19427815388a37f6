"""Parameter server and gradient aggregation: whole-batch sums of gradient partial sums.

Optimizer-update ops that depend on gradients run on the summed gradient (range = whole batch): once
per replica device for ``allreduce`` (copies stay identical; ``collectives`` sums them), once on
``ps_device`` for ``ps`` -- the replicas' partial sums are added there by one ``AddN``, as they are
wherever else a whole-batch value is needed. Sparse (IndexedSlices) updates get the indices and
values of the whole batch, so the deduplication and scatter run as on one device. A ``ps`` group keeps
its variables on ``ps_device``, except state that replicas update with their own batch (BatchNorm
moving statistics), which stays per replica.

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

from typing import TYPE_CHECKING

from tensorflow.core.framework import node_def_pb2

from tag.errors import RewriteError

from .context import RewriteContext
from .graph_edit import Range, attr_type, canonical, split_tensor, tensor_name

if TYPE_CHECKING:  # pragma: no cover
    from tag.ir.types import VariableInfo


class ParameterServerMixin(RewriteContext):
    """Whole-batch gradients for update ops, and where a ps group's variables live."""

    def _ps_variable_devices(self, n: str, v: "VariableInfo | None", owner: int, writers: list[str]) -> list[int]:
        """Devices of variable N of ps op group OWNER: ``ps_device``, or every replica for state
        (not trainable) that a step op in WRITERS updates per batch slice."""
        per_replica = (v is None or v.kind == "state") and any(
            any(r != self.full_batch for r, _ in self._step_placements(w)) for w in writers)
        return self._replicas(owner)[0] if per_replica else [int(self.strategy.actions[owner].ps_device)]

    def _aggregate(self, t: str, dev: int, consumer: str) -> str:
        """The whole-batch sum of gradient partial sums T, on DEV, for an update op CONSUMER.

        Gradients in ``strategy.sfb`` are recomputed on the whole batch instead (``sfb``); gradients of
        allreduce groups come from their (fused) collective; anything else is an AddN on DEV.
        """
        t = canonical(t)
        p, k = split_tensor(t)
        if t in self.sfb_tensors:
            return self._sfb_gradient(t, dev, consumer)
        fused = self._fused(t, dev)
        if fused is not None:
            return fused
        g = self._group(consumer)
        if g is not None and self.strategy.actions[g].mode == "allreduce":
            devs, ranges = self._replicas(g)
            if len(devs) > 1 and dev in devs:
                return self._allreduce(t, devs, ranges)[dev]
        parts = self._tiling(p, self.full_batch)
        if parts is None:
            raise RewriteError(f"gradient {t!r}: its instances do not tile the batch, cannot sum them")
        if self._pipelined(self._group(p)):   # each device first adds its micro-batches' partial sums
            partials = [self._replica_partial(t, None, d) for d in dict.fromkeys(i.asked_dev for i in parts)]
            return self._add_n(t, partials, self.full_batch, dev)
        return self._add_n(t, [tensor_name(i.name, k) for i in parts], self.full_batch, dev)

    def _add_n(self, t: str, parts: list[str], rng: Range, dev: int, memo_key: tuple | None = None) -> str:
        """PARTS (partial sums of T over examples RNG) summed by one AddN on DEV (memoised by MEMO_KEY,
        default: T, RNG and DEV)."""
        memo_key = memo_key or ("sum", t, rng, dev)
        if memo_key in self.memo:
            return self.memo[memo_key]
        if len(parts) == 1:
            return parts[0]
        p, k = split_tensor(t)
        name = self._fresh(f"tag/sum/{p}_{k}/{dev}")
        node = node_def_pb2.NodeDef(name=name, op="AddN", device=self.topo.tf_device(dev))
        node.input.extend(parts)
        node.attr["N"].i = len(parts)
        node.attr["T"].CopyFrom(attr_type(self._dtype(t)))
        self.out_nodes.append(node)
        self.counts["sums"] += 1
        self.memo[memo_key] = name
        return name
