"""Where each op's instances run: one (batch range, device) per instance of every kept op.

Ops of the analysed step follow their op group's action: replicas of ``allreduce``/``ps`` groups get
the batch slices of ``tag.strategy.batch_shares``; ``partition`` ops run once on
``strategy.partition[op]``; update ops on summed gradients run on the whole batch, once per replica
device (``allreduce``) or once on ``ps_device`` (``ps``). Batch sources (placeholders, iterators) run
once on the whole batch. Ops outside the step follow their batch-dependent producer or sit with their
first consumer. The device of an op that takes a variable is then moved to a copy of the variable
(``tag.backend.rewrite.variables``).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    res.replicas                       # op group -> [(device, first example, end example), ...]
"""
from __future__ import annotations

from tag.ir.op_types import FUNCTION_CALL_TYPES, PLACEHOLDER_TYPES, VARIABLE_TYPES

from .context import RewriteContext
from .graph_edit import Range, split_tensor


class PlacementMixin(RewriteContext):
    """Fills ``placements``: op -> [(batch range, asked device)] of its instances."""

    def _place_all(self) -> None:
        """(batch range, asked device) of every instance of every op (``placements``).

        Step ops follow their op group's action; variables their copies; ops that take a variable one
        per copy; other ops outside the analysed step follow their batch-dependent producer (the loss
        of a static-shape graph, metrics), else sit with their first consumer ("home").
        """
        self.placements = {}
        for n in self.order:
            node = self.nodes[n]
            if node.op in VARIABLE_TYPES:
                self.placements[n] = [(self.full_batch, c) for c in self.var_copies[n]]
            elif node.op in PLACEHOLDER_TYPES or n in self.inputs:
                # batch sources run once, whole batch (an iterator must not be read once per replica)
                if n in self.ir_index:
                    self.placements[n] = [(self.full_batch, self._placeholder_home(n))]
            elif n in self.ir_index and self.consumers[n] and all(
                    c in self.inputs and c in self.ir_index for c, _, _ in self.consumers[n]):
                # what feeds a batch source (the iterator resource) goes with it
                self.placements[n] = [(self.full_batch, self._placeholder_home(self.consumers[n][0][0]))]
            elif n in self.ir_index:
                self.placements[n] = self._step_placements(n)
            elif self._vars_of_inputs(n) and node.op not in FUNCTION_CALL_TYPES:
                self.placements[n] = [(self.full_batch, c) for c in self.var_copies[self._vars_of_inputs(n)[0]]]
            elif self.batch_dependent[n]:
                for i in self.nodes[n].input:
                    p = split_tensor(i)[0]
                    if not i.startswith("^") and self.batch_dependent[p] and p in self.placements:
                        self.placements[n] = list(self.placements[p])
                        break
        for n in reversed(self.order):
            if n not in self.placements:
                self.placements[n] = [(self.full_batch, self._home(n))]
        for n in self.order:
            if self._writes(n):
                self.placements[n] = self._writer_placements(n, self.placements[n])

    def _step_placements(self, op: str) -> list[tuple[Range, int]]:
        """Instances of an op of the analysed step, from its op group's action."""
        i = self.ir_index[op]
        g = self._group(op)
        a = self.strategy.actions[g]
        if a.mode == "partition":
            return [(self.full_batch, int(self.strategy.partition[i]))]
        devs, ranges = self._replicas(g)
        if self._phase(op) == "update" and (self.on_summed_grads[op] or not self.batch_dependent[op]):
            if a.mode == "allreduce":
                return [(self.full_batch, d) for d in devs]
            return [(self.full_batch, int(a.ps_device))]
        return self._compute_instances(g, op)

    def _placeholder_home(self, n: str) -> int:
        """The one device of batch source N: its partition device, else its group's first replica."""
        g = self._group(n)
        a = self.strategy.actions[g]
        if a.mode == "partition":
            return int(self.strategy.partition[self.ir_index[n]])
        return self._replicas(g)[0][0]

    def _home(self, n: str) -> int:
        """Device of an op outside the step: its first consumer's, else its first placed input's."""
        for c, _, _ in self.consumers[n]:
            if c in self.placements:
                return self._device_for(c, self.placements[c][0][1])
        for i in self.nodes[n].input:
            p = split_tensor(i.lstrip("^"))[0]
            if p in self.placements:
                return self._device_for(p, self.placements[p][0][1])
        return self._main_device()

    def _main_device(self) -> int:
        """Where ops without a better home go: the first device of the first input's group, else 0."""
        for n in self.inputs:
            g = self._group(n)
            if g is not None:
                a = self.strategy.actions[g]
                if a.mode == "partition":
                    return int(self.strategy.partition[self.ir_index[n]])
                return self._replicas(g)[0][0]
        return 0
