"""Variables: where their copies live, and where the ops that read or update them run.

The rules are the package's (see ``tag.backend.rewrite``): the owner of a variable is the op group of
its optimizer apply op, else of the variable's own op; slots share their variable's copies. An
``allreduce`` owner keeps a copy per replica device, a ``ps`` owner one on ``ps_device`` (per-replica
state aside), a ``partition`` owner one on the partition device (``placement.place_variables`` applies
these rules; this module answers which variables an op takes and where it may run). Readers and
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

from .context import RewriteState
from .graph_edit import Range, split_tensor

# Ops that take a variable (resource or ref) without changing it.
VAR_READERS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "ResourceGather",
                         "ResourceGatherNd", "VariableShape", "Identity", "Snapshot", "Shape", "Size", "Rank"})
# Stateful ops that may nevertheless be recomputed (they only read).
CLONABLE_STATEFUL = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"})


def var_of(st: RewriteState, t: str) -> str | None:
    """The variable op behind a tensor that is a variable handle/ref (through Identity), else None."""
    seen = 0
    while seen < 64:
        op, k = split_tensor(t)
        node = st.nodes[op]
        if node.op in VARIABLE_TYPES:
            return op
        if node.op == "Identity" and node.input and node.attr["T"].type == tf.resource.as_datatype_enum:
            t = node.input[0]
            seen += 1
            continue
        return None
    return None


def vars_of_inputs(st: RewriteState, op: str) -> list[str]:
    """The variables OP takes as data inputs, in input order (cached)."""
    if op not in st.vars_cache:
        out = []
        for i in st.nodes[op].input:
            if i.startswith("^"):
                continue
            v = var_of(st, i)
            if v is not None and v not in out:
                out.append(v)
        st.vars_cache[op] = out
    return st.vars_cache[op]


def writes(st: RewriteState, op: str) -> bool:
    """Does OP (not a function call) update a variable it takes?"""
    node = st.nodes[op]
    if node.op in VAR_READERS or node.op in VARIABLE_TYPES or node.op in FUNCTION_CALL_TYPES:
        return False
    return bool(vars_of_inputs(st, op))


def may_write(st: RewriteState, op: str) -> bool:
    """Like _writes, counting function calls that take variables (their bodies may assign)."""
    return writes(st, op) or (st.nodes[op].op in FUNCTION_CALL_TYPES and bool(vars_of_inputs(st, op)))


def device_for(st: RewriteState, op: str, asked_dev: int) -> int:
    """Where an instance of OP asked on ASKED_DEV runs: a device holding a copy of every variable
    it takes (ASKED_DEV if it does)."""
    vs = vars_of_inputs(st, op)
    if not vs or st.nodes[op].op in FUNCTION_CALL_TYPES:
        return asked_dev
    cand = [d for d in st.var_copies[vs[0]] if all(d in st.var_copies[v] for v in vs[1:])]
    if not cand:
        raise RewriteError(f"op {op!r} uses variables {', '.join(vs)} whose copies share no device")
    return asked_dev if asked_dev in cand else cand[0]


def shares_copy(st: RewriteState, op: str) -> bool:
    """Do two instances of OP (same examples, asked on different devices) take the same copy of a
    variable? Then they act on one shared state, such as Adam's beta powers, which live on one device
    while the update ops of a stage run once per device of the stage: each such instance must come after
    every replica's instance of what it waits for, not only its own replica's."""
    if not vars_of_inputs(st, op) or st.nodes[op].op in FUNCTION_CALL_TYPES:
        return False
    seen = set()
    for rng, asked in st.placements.get(op, []):
        key = (rng, device_for(st, op, asked))
        if key in seen:
            return True
        seen.add(key)
    return False


def writer_placements(st: RewriteState, n: str, placements: list[tuple[Range, int]]) -> list[tuple[Range, int]]:
    """Instances of N, which updates a variable: one per copy of the variable."""
    copies = st.var_copies[vars_of_inputs(st, n)[0]]
    devs = [device_for(st, n, k) for _, k in placements]
    if sorted(devs) == sorted(copies) and len(set(devs)) == len(devs):
        return placements
    if st.pipelined(st.group(n)) and sorted(set(devs)) == sorted(copies) and not shares_copy(st, n):
        return placements     # micro-batches update their device's copy in turn (BatchNorm statistics)
    if all(r == st.full_batch for r, _ in placements):
        return [(st.full_batch, c) for c in copies]
    raise RewriteError(f"op {n!r} updates a variable whose copies ({copies}) do not match its replicas "
                       f"({devs}); put it in the variable's op group")
