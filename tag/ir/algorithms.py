"""Graph algorithms over the IR: dependency arrays, topological order, phase stages, depths, union-find.

Pure functions of a ``TrainingGraph`` (numpy only), shared by the grouping, the simulator, the
baselines and the search.

Example::

    import tag
    from tag.ir.algorithms import op_stages, topological_order
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    order = topological_order(tg)           # op indices, ties by index
    stages = op_stages(tg, order)           # 0 forward, 1 backward, 2 update per op
"""
from __future__ import annotations

import heapq

import numpy as np

from tag.ir.types import PHASES, TrainingGraph


def dependency_arrays(graph: TrainingGraph) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) op-index arrays of every data and control dependency."""
    src = [e.src for e in graph.edges] + [c[0] for c in graph.control_edges]
    dst = [e.dst for e in graph.edges] + [c[1] for c in graph.control_edges]
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def predecessors(graph: TrainingGraph) -> list[list[int]]:
    """Per op, the ops it depends on (data and control), in edge order."""
    src, dst = dependency_arrays(graph)
    preds: list[list[int]] = [[] for _ in range(len(graph.ops))]
    for s, d in zip(src.tolist(), dst.tolist()):
        preds[d].append(s)
    return preds


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
    stage = np.array([PHASES.index(op.phase) for op in graph.ops], dtype=np.int64)
    if order is None:
        order = topological_order(graph)
    preds = predecessors(graph)
    st = stage.tolist()
    for i in order.tolist():
        for p in preds[i]:
            if st[p] > st[i]:
                st[i] = st[p]
    return np.asarray(st, dtype=np.int8)


def op_levels(graph: TrainingGraph, order: np.ndarray | None = None) -> np.ndarray:
    """Longest-path depth of each op below the batch inputs (``graph.inputs``; all sources if none).

    Ops that no input reaches (variables, constants and what only they feed) get -1, so parameters do
    not pull a layer to the front of the step.
    """
    n = len(graph.ops)
    if order is None:
        order = topological_order(graph)
    preds = predecessors(graph)
    starts = {graph.op_index[nm] for nm in graph.inputs if nm in graph.op_index}
    if not starts:
        starts = {i for i in range(n) if not preds[i]}
    lv = [-1] * n
    for i in order.tolist():
        if i in starts:
            lv[i] = max(lv[i], 0)
        for p in preds[i]:
            if lv[p] >= 0 and lv[p] + 1 > lv[i]:
                lv[i] = lv[p] + 1
    return np.asarray(lv, dtype=np.int64)


class UnionFind:
    """Disjoint sets over 0..n-1 with path compression; a union keeps the lower index as the root,
    so the result does not depend on the order of unions."""

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
