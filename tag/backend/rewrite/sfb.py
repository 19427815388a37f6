"""Sufficient-factor broadcasting (SFB): weight gradients recomputed on every replica, not summed.

For a variable in ``strategy.sfb`` the gradient is not all-reduced: its factors (the layer's input and
output gradient, which have a batch axis) are gathered to every replica device -- sliced and
concatenated like any batch-axis tensor -- and the gradient op runs there once more on the whole batch
(a clone of it, see ``instances``). The tensors involved are the gradient, the Identity ops between it
and the op that computes it, and that op; each is used only on the device it was computed on.

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
    res = rewrite(gd, tg, st, topo)    # kernels' gradients: gathered factors, recomputed per replica
"""
from __future__ import annotations

from tag.errors import StrategyError

from .context import RewriteContext
from .graph_edit import canonical, split_tensor, tensor_name


class SfbMixin(RewriteContext):
    """Finds the SFB gradient tensors (``sfb_tensors``) and recomputes them where they are needed."""

    def _find_sfb_tensors(self) -> set[str]:
        """Gradients sent by sufficient-factor broadcasting (``strategy.sfb``), with the Identity ops
        between them and the op that computes them from batch-carrying factors."""
        out: set[str] = set()
        info = {v.name: v for v in self.ir.variables}
        for name in self.strategy.sfb:
            v = info.get(name)
            if v is None or not v.gradient:
                raise StrategyError(f"strategy.sfb names {name!r}, which is not a trainable variable with a gradient")
            t = canonical(v.gradient)
            while True:
                out.add(t)
                node = self.nodes[split_tensor(t)[0]]
                if node.op != "Identity":
                    break
                t = canonical(node.input[0])
        return out

    def _sfb_gradient(self, t: str, dev: int, consumer: str) -> str:
        """SFB gradient T for update op CONSUMER on DEV: its op recomputed there on the whole batch,
        from factors gathered to DEV."""
        p, k = split_tensor(t)
        return tensor_name(self._clone(p, self.full_batch, dev, consumer).name, k)
