"""Structure: the pruned original graph in topological order, and what each op depends on.

``prune_and_order`` keeps the ops the fetches, the analysed step and the inputs need and orders them
(Kahn, original node order as tie-break), recording every op's data consumers; ``flag_dependencies``
marks the ops that depend on the batch or on a gradient seed, the update ops that run on whole-batch
gradients, and the loss kind.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite.context import RewriteState
    from tag.backend.rewrite.structure import prune_and_order

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    st = RewriteState(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    prune_and_order(st)
    st.order[:2]                       # original op names, producers first
"""
from __future__ import annotations

import heapq

from tag.errors import RewriteError
from tag.ir.op_types import TF1_LOOP_TYPES

from . import loss
from .context import RewriteState
from .graph_edit import split_tensor


def prune_and_order(st: RewriteState) -> None:
    """Keep the ops the fetches, the analysed step and the inputs need; order them (``order``) and
    record their data consumers (``consumers``)."""
    roots = [st.train_op] + [n for n in (st.loss, st.init) if n] + list(st.ir_index) + st.inputs
    keep: set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        if n not in st.nodes:
            raise RewriteError(f"an input of the graph names the missing op {n!r}")
        keep.add(n)
        for i in st.nodes[n].input:
            stack.append(split_tensor(i.lstrip("^"))[0])
    st.order = _topological_order(st, keep)


def _topological_order(st: RewriteState, keep: set[str]) -> list[str]:
    """KEEP in topological order (Kahn), original node order as tie-break; fills ``consumers``."""
    pos = {name: i for i, name in enumerate(st.nodes)}
    names = sorted(keep, key=pos.__getitem__)
    indeg = {n: 0 for n in names}
    succ: dict[str, list[str]] = {n: [] for n in names}
    st.consumers = {n: [] for n in names}
    for n in names:
        node = st.nodes[n]
        if node.op in TF1_LOOP_TYPES:
            raise RewriteError(f"op {n!r}: TF1 while-loop frames ({node.op}) cannot be split between devices; "
                               f"build the loop with control flow v2 (a While op)")
        seen = set()
        for slot, i in enumerate(node.input):
            p, k = split_tensor(i.lstrip("^"))
            if not i.startswith("^"):
                st.consumers[p].append((n, k, slot))
            if p not in seen:
                seen.add(p)
                succ[p].append(n)
                indeg[n] += 1
    ready = [(pos[n], n) for n in names if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(ready, (pos[m], m))
    if len(order) != len(names):
        stuck = next(n for n in names if indeg[n] > 0)
        raise RewriteError(f"op {stuck!r} is on a cycle; the training step must be acyclic")
    return order


def flag_dependencies(st: RewriteState) -> None:
    """Fill ``seeds``, ``batch_dependent``, ``grad_dependent``, ``on_summed_grads`` and the loss kind."""
    st.seeds = loss.find_seeds(st)
    st.batch_dependent = {}
    st.grad_dependent = {}
    st.on_summed_grads = {}
    inputs = set(st.inputs)
    for n in st.order:
        data_in = [split_tensor(i)[0] for i in st.nodes[n].input if not i.startswith("^")]
        st.batch_dependent[n] = n in inputs or n in st.seeds or n in st.const_scale or any(
            st.batch_dependent[p] for p in data_in) or (
            st.nodes[n].op == "Const" and st.batch_axis(n) is not None)
        st.grad_dependent[n] = n in st.seeds or any(st.grad_dependent[p] for p in data_in)
    for n in reversed(st.order):
        st.on_summed_grads[n] = st.phase(n) == "update" and (
            st.grad_dependent[n] or any(st.on_summed_grads.get(c, False) for c, _, _ in st.consumers[n]))
    st.loss_is_mean = loss.loss_kind(st) == "mean"

