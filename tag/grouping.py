"""Op grouping: coarsen a TrainingGraph's ops into layer-sized op groups, the unit a strategy decides.

Rules (deterministic, numpy only):

1. Forward and update ops group by name scope (the layer: ``conv2_block1_1_conv/Conv2D`` -> ``conv2_block1_1_conv``;
   top-level ops each start their own group).
2. Backward ops go with the forward op they differentiate: ``gradients/<fwd op>_grad/...`` (also
   ``gradients_1/...``) joins the group of ``<fwd op>``. Backward ops with no ``_grad`` part (``gradients/AddN_3``,
   the loss seed) join the group of their first consumer, else of their first producer.
3. Every ``TrainingGraph.colocation`` set (a variable, its reads, its optimizer op, its slots) ends up in one
   group, and so does the op producing each trainable variable's gradient.
4. Groups that would make the group-level dependency graph cyclic are merged: the graph whose nodes are
   (group, stage) pairs -- stage = the op's phase raised to the latest phase of its ancestors
   (``op_stages``) -- is always acyclic, which the simulator relies on.
5. While there are more than ``target_groups`` groups, the adjacent pair (in topological order of the
   groups' first ops) with the smallest combined cost (a nominal roofline time) is merged.

Group names are the layer scope of the group's costliest part, with ``(+k)`` when k more scopes were merged in.

Example::

    tg = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=32))
    grouping = group_ops(tg, target_groups=100)
    grouping.num_groups, grouping.names[:3]      # e.g. 100, ['conv1_pad(+1)', 'conv1_conv', 'conv1_bn']
"""
from __future__ import annotations

import heapq
import re

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from tag.errors import TagError
from tag.ir import PHASES, TrainingGraph
from tag.strategy import Grouping

_GRAD_PREFIX = re.compile(r"^gradients(?:_\d+)?/(.+)$")
# nominal device for the grouping's cost proxy (roughly one V100): FLOP/s, bytes/s, seconds per op
_NOMINAL_FLOPS, _NOMINAL_BW, _NOMINAL_OVERHEAD = 1e13, 9e11, 5e-6


def dependency_arrays(graph: TrainingGraph) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) op-index arrays of every data and control dependency."""
    src = [e.src for e in graph.edges] + [c[0] for c in graph.control_edges]
    dst = [e.dst for e in graph.edges] + [c[1] for c in graph.control_edges]
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def topological_order(graph: TrainingGraph) -> np.ndarray:
    """Op indices in a topological order (ties: lower index first). Ops on a cycle come last, by index."""
    n = len(graph.ops)
    src, dst = dependency_arrays(graph)
    indeg = np.bincount(dst, minlength=n).astype(np.int64)
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist()):
        succ[s].append(d)
    heap = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    order, seen = [], np.zeros(n, dtype=bool)
    indeg = indeg.tolist()
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        seen[i] = True
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, j)
    if len(order) < n:  # a cycle (should not happen in a training step): append the rest by index
        order.extend(np.flatnonzero(~seen).tolist())
    return np.asarray(order, dtype=np.int64)


def op_stages(graph: TrainingGraph, order: np.ndarray | None = None) -> np.ndarray:
    """Per op: 0 forward, 1 backward, 2 update -- its phase raised to the latest stage of its ancestors.

    Stages never decrease along a dependency, so (group, stage) tasks form an acyclic graph whenever the
    groups of each stage do.
    """
    n = len(graph.ops)
    stage = np.array([PHASES.index(op.phase) for op in graph.ops], dtype=np.int64)
    if order is None:
        order = topological_order(graph)
    src, dst = dependency_arrays(graph)
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist()):
        preds[d].append(s)
    st = stage.tolist()
    for i in order.tolist():
        for p in preds[i]:
            if st[p] > st[i]:
                st[i] = st[p]
    return np.asarray(st, dtype=np.int8)


def op_levels(graph: TrainingGraph, order: np.ndarray | None = None) -> np.ndarray:
    """Longest-path depth of each op from the graph's sources (sources: 0)."""
    n = len(graph.ops)
    if order is None:
        order = topological_order(graph)
    src, dst = dependency_arrays(graph)
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist()):
        preds[d].append(s)
    lv = [0] * n
    for i in order.tolist():
        for p in preds[i]:
            if lv[p] + 1 > lv[i]:
                lv[i] = lv[p] + 1
    return np.asarray(lv, dtype=np.int64)


def nominal_op_cost(graph: TrainingGraph, batch: float | None = None) -> np.ndarray:
    """A device-independent cost per op (seconds on a nominal GPU), used to balance groups."""
    from tag.cost import ZERO_COST_TYPES  # numpy-only module

    a = graph.arrays()
    b = graph.batch_size if batch is None else batch
    t = np.maximum(a.flops(b) / _NOMINAL_FLOPS, a.mem_bytes(b) / _NOMINAL_BW) + _NOMINAL_OVERHEAD
    zero = np.array([op.type in ZERO_COST_TYPES for op in graph.ops], dtype=bool)
    t[zero] = 0.0
    return t


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        p = self.parent
        root = x
        while p[root] != root:
            root = p[root]
        while p[x] != root:
            p[x], x = root, p[x]
        return root

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if rb < ra:
            ra, rb = rb, ra
        self.parent[rb] = ra  # the lower index stays the root: deterministic
        return ra


def _scope(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else name


def _forward_op_of_gradient(name: str) -> tuple[str | None, bool]:
    """For ``gradients/a/b/MatMul_grad/x``: ('a/b/MatMul', True). Non-gradient names: (None, False)."""
    m = _GRAD_PREFIX.match(name)
    if not m:
        return None, False
    parts = m.group(1).split("/")
    for k, p in enumerate(parts):
        if p.endswith("_grad") and len(p) > 5:
            return "/".join(parts[:k] + [p[:-5]]), True
    return None, True


def group_ops(graph: TrainingGraph, target_groups: int = 64) -> Grouping:
    """Coarsen GRAPH's ops into at most TARGET_GROUPS layer-sized groups (see the module docstring)."""
    if target_groups < 1:
        raise TagError(f"target_groups must be at least 1, got {target_groups}")
    n = len(graph.ops)
    if n == 0:
        return Grouping(np.zeros(0, dtype=np.int64), [])
    ops = graph.ops
    index = graph.op_index
    order = topological_order(graph)
    stage = op_stages(graph, order)
    uf = _UnionFind(n)

    # 1-2: keys by scope; backward ops join their forward op
    key_root: dict[str, int] = {}
    label = [""] * n            # readable scope name per op (for group names)
    unresolved = []
    for i, op in enumerate(ops):
        fwd, is_grad = _forward_op_of_gradient(op.name)
        if is_grad:
            if fwd is None:
                unresolved.append(i)
                continue
            j = index.get(fwd)
            key = _scope(fwd)
            label[i] = key
            if j is not None and j != i:
                uf.union(i, j)
                continue
        else:
            key = _scope(op.name)
        label[i] = key
        r = key_root.get(key)
        if r is None:
            key_root[key] = i
        else:
            uf.union(r, i)

    # 3: colocation sets and gradient producers with their variables
    for names in graph.colocation:
        idx = [index[nm] for nm in names if nm in index]
        for j in idx[1:]:
            uf.union(idx[0], j)
    for v in graph.variables:
        if v.kind == "trainable" and v.gradient:
            j = index.get(v.gradient.rsplit(":", 1)[0].lstrip("^"))
            if j is not None:
                uf.union(v.op, j)

    # backward ops without a forward op: join the first consumer, else the first producer
    if unresolved:
        src, dst = dependency_arrays(graph)
        succ: list[list[int]] = [[] for _ in range(n)]
        pred: list[list[int]] = [[] for _ in range(n)]
        for s, d in zip(src.tolist(), dst.tolist()):
            succ[s].append(d)
            pred[d].append(s)
        pending = set(unresolved)
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        for sweep in ("consumers", "producers"):
            seq = sorted(pending, key=lambda i: -pos[i]) if sweep == "consumers" else sorted(pending, key=lambda i: pos[i])
            for i in seq:
                nbrs = succ[i] if sweep == "consumers" else pred[i]
                for j in sorted(nbrs):
                    if j not in pending:
                        uf.union(i, j)
                        pending.discard(i)
                        break
        for i in sorted(pending):
            label[i] = ops[i].name

    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)
    roots = _make_acyclic(graph, roots, stage, uf)

    # 5: merge adjacent cheapest groups until at most target_groups remain
    cost = nominal_op_cost(graph)
    levels = op_levels(graph, order)
    roots = _merge_to_target(graph, roots, stage, levels, cost, target_groups, uf)

    # number groups in topological order of their first op; name each after its costliest scope
    set_ids = np.unique(roots)
    key_of = {int(r): _position_key(np.flatnonzero(roots == r), stage, levels) for r in set_ids}
    ordered = sorted(set_ids.tolist(), key=lambda r: key_of[r])
    gid = {r: g for g, r in enumerate(ordered)}
    group_of_op = np.array([gid[int(r)] for r in roots], dtype=np.int64)
    names = []
    used: dict[str, int] = {}
    for r in ordered:
        members = np.flatnonzero(roots == r)
        members = members[stage[members] == stage[members].min()]   # name after the earliest stage's ops
        if (cost[members] > 0).any():                               # ... that do some work
            members = members[cost[members] > 0]
        scope_cost: dict[str, float] = {}
        for i in members.tolist():
            lab = label[i] or _scope(ops[i].name)
            scope_cost[lab] = scope_cost.get(lab, 0.0) + float(cost[i])
        best = max(sorted(scope_cost), key=lambda s: scope_cost[s])
        name = best if len(scope_cost) == 1 else f"{best}(+{len(scope_cost) - 1})"
        if name in used:
            used[name] += 1
            name = f"{name}#{used[name]}"
        else:
            used[name] = 1
        names.append(name)
    return Grouping(group_of_op, names)


def _position_key(members: np.ndarray, stage: np.ndarray, levels: np.ndarray) -> tuple[int, int, int]:
    """Where a set of ops sits in the step: (earliest stage, its shallowest depth there, first index)."""
    s = int(stage[members].min())
    in_stage = members[stage[members] == s]
    return s, int(levels[in_stage].min()), int(members.min())


def _task_graph_sccs(graph: TrainingGraph, roots: np.ndarray, stage: np.ndarray) -> list[np.ndarray]:
    """Strongly connected components (with more than one node) of the (set, stage) task graph."""
    src, dst = dependency_arrays(graph)
    uniq, inv = np.unique(roots, return_inverse=True)
    task = inv * 3 + stage.astype(np.int64)
    a, b = task[src], task[dst]
    keep = a != b
    m = len(uniq) * 3
    mat = csr_matrix((np.ones(int(keep.sum()), dtype=np.int8), (a[keep], b[keep])), shape=(m, m))
    ncomp, lab = connected_components(mat, directed=True, connection="strong")
    if ncomp == m:
        return []
    counts = np.bincount(lab, minlength=ncomp)
    out = []
    for c in np.flatnonzero(counts > 1):
        tasks = np.flatnonzero(lab == c)
        out.append(uniq[np.unique(tasks // 3)])
    return out


def _make_acyclic(graph: TrainingGraph, roots: np.ndarray, stage: np.ndarray, uf: _UnionFind) -> np.ndarray:
    """Merge sets until the (set, stage) task graph has no cycle."""
    while True:
        sccs = _task_graph_sccs(graph, roots, stage)
        if not sccs:
            return roots
        for sets in sccs:
            for r in sets[1:].tolist():
                uf.union(int(sets[0]), r)
        roots = np.array([uf.find(i) for i in range(len(roots))], dtype=np.int64)


def _merge_to_target(graph: TrainingGraph, roots: np.ndarray, stage: np.ndarray, levels: np.ndarray,
                     cost: np.ndarray, target: int, uf: _UnionFind) -> np.ndarray:
    """Merge the cheapest adjacent pair (in topological order of the sets) until at most TARGET sets."""
    set_ids = np.unique(roots)
    if len(set_ids) <= target:
        return roots
    seq = sorted(set_ids.tolist(), key=lambda r: _position_key(np.flatnonzero(roots == r), stage, levels))
    totals = np.bincount(np.searchsorted(set_ids, roots), weights=cost, minlength=len(set_ids))
    set_cost = {int(r): float(totals[k]) for k, r in enumerate(set_ids.tolist())}
    while len(seq) > target:
        best_k, best_c = 0, None
        for k in range(len(seq) - 1):
            c = set_cost[seq[k]] + set_cost[seq[k + 1]]
            if best_c is None or c < best_c:
                best_k, best_c = k, c
        a, b = seq[best_k], seq[best_k + 1]
        r = uf.union(a, b)
        merged_cost = set_cost.pop(a) + set_cost.pop(b)
        seq[best_k:best_k + 2] = [r]
        set_cost[r] = merged_cost
        roots = np.where((roots == a) | (roots == b), r, roots)
        sccs = _task_graph_sccs(graph, roots, stage)
        if sccs:
            roots = _make_acyclic(graph, roots, stage, uf)
            alive = set(np.unique(roots).tolist())
            # drop absorbed sets from the sequence, keeping each survivor at its first position
            new_seq, new_cost = [], {}
            for s in seq:
                rr = uf.find(s)
                if rr in new_cost:
                    new_cost[rr] += set_cost[s]
                else:
                    new_seq.append(rr)
                    new_cost[rr] = set_cost[s]
            assert set(new_seq) == alive
            seq, set_cost = new_seq, new_cost
    return roots
