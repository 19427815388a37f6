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
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        preds[d].append(s)
    return preds


def topological_order(graph: TrainingGraph) -> np.ndarray:
    """Op indices in a topological order (ties: lower index first). Ops on a cycle come last, by index."""
    n = len(graph.ops)
    src, dst = dependency_arrays(graph)
    indeg = np.bincount(dst, minlength=n).astype(np.int64)
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
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


_GRADIENT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def weight_gradient_ops(graph: TrainingGraph, stages: np.ndarray | None = None) -> np.ndarray:
    """Per op: does it only add up weight-gradient partial sums over the batch (a pipeline may run it once,
    over every micro-batch's rows, instead of once per micro-batch: ``deferred_w``)?

    Such an op is a backward op (``op_stages`` 1) whose outputs are floating point and carry no batch axis,
    that reads a batch-axis tensor (a ``MatMul`` of activations and output gradients, ``BiasAddGrad``,
    ``Conv2DBackpropFilter``, a ``Sum`` over the batch) or another such op's output (a ``Reshape`` or ``AddN``
    of the partial sums), and whose outputs no other backward op reads (a batch reduction that feeds input
    gradients, as batch normalisation's does, stays per micro-batch). Control edges are not followed: the
    grouping ``tf.tuple`` adds between gradients orders nothing the values need. STAGES: ``op_stages``."""
    n = len(graph.ops)
    if stages is None:
        stages = op_stages(graph)
    producers: list[list[int]] = [[] for _ in range(n)]
    consumers: list[list[int]] = [[] for _ in range(n)]
    for e in graph.edges:
        producers[e.dst].append(e.src)
        consumers[e.src].append(e.dst)
    batch_axis = np.zeros(n, dtype=bool)        # some output carries the batch axis
    reduced = np.zeros(n, dtype=bool)           # backward, float outputs, none with a batch axis
    for i, op in enumerate(graph.ops):
        batch_axis[i] = any(t.batch_axis is not None for t in op.outputs)
        reduced[i] = (int(stages[i]) == 1 and bool(op.outputs) and not batch_axis[i]
                      and all(t.dtype in _GRADIENT_DTYPES for t in op.outputs))
    order = topological_order(graph).tolist()
    weight = np.zeros(n, dtype=bool)
    for _ in range(n + 1):              # until stable (each round only removes ops)
        before = weight.copy()
        for i in order:
            weight[i] = reduced[i] and any(batch_axis[p] or weight[p] for p in producers[i])
        for i in reversed(order):
            if weight[i] and any(int(stages[c]) == 1 and not weight[c] for c in consumers[i]):
                weight[i] = False
        if (weight == before).all():
            break
    return weight
