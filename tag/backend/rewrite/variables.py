"""Variables: where their copies live, and where the ops that read or update them run.

The rules are the package's (see ``tag.backend.rewrite``): the owner of a variable is the op group of
its optimizer apply op, else of the variable's own op; slots share their variable's copies. An
``allreduce`` owner keeps a copy per replica device, a ``ps`` owner one on ``ps_device`` (per-replica
state aside, see ``parameter_server``), a ``partition`` owner one on the partition device. Readers and
updaters move to a device holding a copy of every variable they take (TF colocates resource ops with
their resource), except function calls, which may take handles from another device; an updater gets
one instance per copy.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("ps", tg, topo, group_ops(tg, 16)), topo)
    res.copies("mlp/dense_0/kernel")   # one copy, on the parameter server
"""
from __future__ import annotations

import tensorflow as tf

from tag.errors import RewriteError
from tag.ir.op_types import FUNCTION_CALL_TYPES, VARIABLE_TYPES

from .context import RewriteContext
from .graph_edit import Range, split_tensor

# Ops that take a variable (resource or ref) without changing it.
VAR_READERS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "ResourceGather",
                         "ResourceGatherNd", "VariableShape", "Identity", "Snapshot", "Shape", "Size", "Rank"})
# Stateful ops that may nevertheless be recomputed (they only read).
CLONABLE_STATEFUL = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"})


class VariablesMixin(RewriteContext):
    """Fills ``var_copies`` / ``var_owner``; says which ops take, write and follow variables."""

    def _var_of(self, t: str) -> str | None:
        """The variable op behind a tensor that is a variable handle/ref (through Identity), else None."""
        seen = 0
        while seen < 64:
            op, k = split_tensor(t)
            node = self.nodes[op]
            if node.op in VARIABLE_TYPES:
                return op
            if node.op == "Identity" and node.input and node.attr["T"].type == tf.resource.as_datatype_enum:
                t = node.input[0]
                seen += 1
                continue
            return None
        return None

    def _vars_of_inputs(self, op: str) -> list[str]:
        """The variables OP takes as data inputs, in input order (cached)."""
        if op not in self._vars_cache:
            out = []
            for i in self.nodes[op].input:
                if i.startswith("^"):
                    continue
                v = self._var_of(i)
                if v is not None and v not in out:
                    out.append(v)
            self._vars_cache[op] = out
        return self._vars_cache[op]

    def _writes(self, op: str) -> bool:
        """Does OP (not a function call) update a variable it takes?"""
        node = self.nodes[op]
        if node.op in VAR_READERS or node.op in VARIABLE_TYPES or node.op in FUNCTION_CALL_TYPES:
            return False
        return bool(self._vars_of_inputs(op))

    def _may_write(self, op: str) -> bool:
        """Like _writes, counting function calls that take variables (their bodies may assign)."""
        return self._writes(op) or (self.nodes[op].op in FUNCTION_CALL_TYPES and bool(self._vars_of_inputs(op)))

    def _place_variables(self) -> None:
        """Owner op group and copy devices of every variable (``var_owner``, ``var_copies``)."""
        info = {v.name: v for v in self.ir.variables}
        slot_owner = {}      # slot variable -> the variable it belongs to
        for v in self.ir.variables:
            for s in v.slots:
                slot_owner[s] = v.name
        writers: dict[str, list[str]] = {}    # variable -> step ops that may update it
        for n in self.order:
            if n in self.ir_index and self._may_write(n):
                for v in self._vars_of_inputs(n):
                    writers.setdefault(v, []).append(n)
        var_order = [n for n in self.order if self.nodes[n].op in VARIABLE_TYPES]
        # trainable variables before slots: a slot lives where its variable lives
        var_order.sort(key=lambda n: n in slot_owner and slot_owner[n] in self.nodes)
        for n in var_order:
            v = info.get(n)
            parent = slot_owner.get(n)
            if parent in self.var_copies:
                self.var_owner[n] = self.var_owner[parent]
                self.var_copies[n] = list(self.var_copies[parent])
                continue
            owner = None
            if v is not None and v.apply_op in self.ir_index:
                owner = self._group(v.apply_op)
            if owner is None:
                owner = self._group(n)
            self.var_owner[n] = owner
            if owner is None:
                self.var_copies[n] = [self._main_device()]
                continue
            a = self.strategy.actions[owner]
            if a.mode == "allreduce":
                copies = self._replicas(owner)[0]
            elif a.mode == "ps":
                copies = self._ps_variable_devices(n, v, owner, writers.get(n, []))
            else:
                i = self.ir_index.get(n)
                d = self.strategy.partition.get(i) if i is not None else None
                if d is None and v is not None and v.apply_op in self.ir_index:
                    d = self.strategy.partition.get(self.ir_index[v.apply_op])
                copies = [int(d) if d is not None else self._replicas(owner)[0][0]]
            self.var_copies[n] = list(copies)

    def _device_for(self, op: str, asked_dev: int) -> int:
        """Where an instance of OP asked on ASKED_DEV runs: a device holding a copy of every variable
        it takes (ASKED_DEV if it does)."""
        vs = self._vars_of_inputs(op)
        if not vs or self.nodes[op].op in FUNCTION_CALL_TYPES:
            return asked_dev
        cand = [d for d in self.var_copies[vs[0]] if all(d in self.var_copies[v] for v in vs[1:])]
        if not cand:
            raise RewriteError(f"op {op!r} uses variables {', '.join(vs)} whose copies share no device")
        return asked_dev if asked_dev in cand else cand[0]

    def _shares_copy(self, op: str) -> bool:
        """Do two instances of OP (same examples, asked on different devices) take the same copy of a
        variable? Then they act on one shared state, such as Adam's beta powers, which live on one device
        while the update ops of a stage run once per device of the stage: each such instance must come after
        every replica's instance of what it waits for, not only its own replica's."""
        if not self._vars_of_inputs(op) or self.nodes[op].op in FUNCTION_CALL_TYPES:
            return False
        seen = set()
        for rng, asked in self.placements.get(op, []):
            key = (rng, self._device_for(op, asked))
            if key in seen:
                return True
            seen.add(key)
        return False

    def _writer_placements(self, n: str, placements: list[tuple[Range, int]]) -> list[tuple[Range, int]]:
        """Instances of N, which updates a variable: one per copy of the variable."""
        copies = self.var_copies[self._vars_of_inputs(n)[0]]
        devs = [self._device_for(n, k) for _, k in placements]
        if sorted(devs) == sorted(copies) and len(set(devs)) == len(devs):
            return placements
        if self._pipelined(self._group(n)) and sorted(set(devs)) == sorted(copies) and not self._shares_copy(n):
            return placements     # micro-batches update their device's copy in turn (BatchNorm statistics)
        if all(r == self.full_batch for r, _ in placements):
            return [(self.full_batch, c) for c in copies]
        raise RewriteError(f"op {n!r} updates a variable whose copies ({copies}) do not match its replicas "
                           f"({devs}); put it in the variable's op group")
