"""Where each op's instances run: one (batch range, device) per instance of every kept op.

Ops of the analysed step follow their op group's action: replicas of ``allreduce``/``ps`` groups get
the batch slices of ``tag.strategy.batch_shares``; ``partition`` ops run once on
``strategy.partition[op]``; update ops on summed gradients run on the whole batch, once per replica
device (``allreduce``) or once on ``ps_device`` (``ps``). Batch sources (placeholders, iterators) run
once on the whole batch. Ops outside the step follow their batch-dependent producer or sit with their
first consumer. The device of an op that takes a variable is then moved to a copy of the variable
(``tag.backend.rewrite.variables``).

Variables are placed first (``place_variables``, by the rules of ``variables``): a ``ps`` group keeps its
variables on ``ps_device``, except state that replicas update with their own batch (BatchNorm moving
statistics), which stays per replica (``ps_variable_devices``, which asks where the step's writers run).

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

from typing import TYPE_CHECKING

from tag.ir.op_types import FUNCTION_CALL_TYPES, PLACEHOLDER_TYPES, VARIABLE_TYPES

from . import pipeline, variables
from .context import RewriteState
from .graph_edit import Range, split_tensor

if TYPE_CHECKING:  # pragma: no cover
    from tag.ir.types import VariableInfo


def place_all(st: RewriteState) -> None:
    """(batch range, asked device) of every instance of every op (``placements``).

    Step ops follow their op group's action; variables their copies; ops that take a variable one
    per copy; other ops outside the analysed step follow their batch-dependent producer (the loss
    of a static-shape graph, metrics), else sit with their first consumer ("home").
    """
    st.placements = {}
    for n in st.order:
        node = st.nodes[n]
        if node.op in VARIABLE_TYPES:
            st.placements[n] = [(st.full_batch, c) for c in st.var_copies[n]]
        elif node.op in PLACEHOLDER_TYPES or n in st.inputs:
            # batch sources run once, whole batch (an iterator must not be read once per replica)
            if n in st.ir_index:
                st.placements[n] = [(st.full_batch, _placeholder_home(st, n))]
        elif n in st.ir_index and st.consumers[n] and all(
                c in st.inputs and c in st.ir_index for c, _, _ in st.consumers[n]):
            # what feeds a batch source (the iterator resource) goes with it
            st.placements[n] = [(st.full_batch, _placeholder_home(st, st.consumers[n][0][0]))]
        elif n in st.ir_index:
            st.placements[n] = step_placements(st, n)
        elif variables.vars_of_inputs(st, n) and node.op not in FUNCTION_CALL_TYPES:
            st.placements[n] = [(st.full_batch, c) for c in st.var_copies[variables.vars_of_inputs(st, n)[0]]]
        elif st.batch_dependent[n]:
            for i in st.nodes[n].input:
                p = split_tensor(i)[0]
                if not i.startswith("^") and st.batch_dependent[p] and p in st.placements:
                    st.placements[n] = list(st.placements[p])
                    break
    for n in reversed(st.order):
        if n not in st.placements:
            st.placements[n] = [(st.full_batch, _home(st, n))]
    for n in st.order:
        if variables.writes(st, n):
            st.placements[n] = variables.writer_placements(st, n, st.placements[n])


def step_placements(st: RewriteState, op: str) -> list[tuple[Range, int]]:
    """Instances of an op of the analysed step, from its op group's action."""
    i = st.ir_index[op]
    g = st.group(op)
    a = st.strategy.actions[g]
    if a.mode == "partition":
        return [(st.full_batch, int(st.strategy.partition[i]))]
    devs, ranges = st.replicas(g)
    if st.phase(op) == "update" and (st.on_summed_grads[op] or not st.batch_dependent[op]):
        if a.mode == "allreduce":
            return [(st.full_batch, d) for d in devs]
        return [(st.full_batch, int(a.ps_device))]
    return pipeline.compute_instances(st, g, op)


def _placeholder_home(st: RewriteState, n: str) -> int:
    """The one device of batch source N: its partition device, else its group's first replica."""
    g = st.group(n)
    a = st.strategy.actions[g]
    if a.mode == "partition":
        return int(st.strategy.partition[st.ir_index[n]])
    return st.replicas(g)[0][0]


def _home(st: RewriteState, n: str) -> int:
    """Device of an op outside the step: its first consumer's, else its first placed input's."""
    for c, _, _ in st.consumers[n]:
        if c in st.placements:
            return variables.device_for(st, c, st.placements[c][0][1])
    for i in st.nodes[n].input:
        p = split_tensor(i.lstrip("^"))[0]
        if p in st.placements:
            return variables.device_for(st, p, st.placements[p][0][1])
    return main_device(st)


def main_device(st: RewriteState) -> int:
    """Where ops without a better home go: the first device of the first input's group, else 0."""
    for n in st.inputs:
        g = st.group(n)
        if g is not None:
            a = st.strategy.actions[g]
            if a.mode == "partition":
                return int(st.strategy.partition[st.ir_index[n]])
            return st.replicas(g)[0][0]
    return 0


# -------------------------------------------------------------------------------- variables
def place_variables(st: RewriteState) -> None:
    """Owner op group and copy devices of every variable (``var_owner``, ``var_copies``)."""
    st.var_owner = {}
    st.var_copies = {}
    info = {v.name: v for v in st.ir.variables}
    slot_owner = {}      # slot variable -> the variable it belongs to
    for v in st.ir.variables:
        for s in v.slots:
            slot_owner[s] = v.name
    writers: dict[str, list[str]] = {}    # variable -> step ops that may update it
    for n in st.order:
        if n in st.ir_index and variables.may_write(st, n):
            for v in variables.vars_of_inputs(st, n):
                writers.setdefault(v, []).append(n)
    var_order = [n for n in st.order if st.nodes[n].op in VARIABLE_TYPES]
    # trainable variables before slots: a slot lives where its variable lives
    var_order.sort(key=lambda n: n in slot_owner and slot_owner[n] in st.nodes)
    for n in var_order:
        v = info.get(n)
        parent = slot_owner.get(n)
        if parent in st.var_copies:
            st.var_owner[n] = st.var_owner[parent]
            st.var_copies[n] = list(st.var_copies[parent])
            continue
        owner = None
        if v is not None and v.apply_op in st.ir_index:
            owner = st.group(v.apply_op)
        if owner is None:
            owner = st.group(n)
        st.var_owner[n] = owner
        if owner is None:
            st.var_copies[n] = [main_device(st)]
            continue
        a = st.strategy.actions[owner]
        if a.mode == "allreduce":
            copies = st.replicas(owner)[0]
        elif a.mode == "ps":
            copies = ps_variable_devices(st, n, v, owner, writers.get(n, []))
        else:
            i = st.ir_index.get(n)
            d = st.strategy.partition.get(i) if i is not None else None
            if d is None and v is not None and v.apply_op in st.ir_index:
                d = st.strategy.partition.get(st.ir_index[v.apply_op])
            copies = [int(d) if d is not None else st.replicas(owner)[0][0]]
        st.var_copies[n] = list(copies)


def ps_variable_devices(st: RewriteState, n: str, v: "VariableInfo | None", owner: int,
                        writers: list[str]) -> list[int]:
    """Devices of variable N of ps op group OWNER: ``ps_device``, or every replica for state
    (not trainable) that a step op in WRITERS updates per batch slice."""
    per_replica = (v is None or v.kind == "state") and any(
        any(r != st.full_batch for r, _ in step_placements(st, w)) for w in writers)
    return st.replicas(owner)[0] if per_replica else [int(st.strategy.actions[owner].ps_device)]
