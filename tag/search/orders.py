"""Decision orders: the sequence in which the tree search decides op groups (the traversal order).

Sequential placement decides one op group after another, and which groups come first changes what a
fixed search budget can find; which order is best depends on the network family. The orders:

- ``cost_descending`` (TAG's): the costliest groups first (compute time on the fastest device group plus
  the time to all-reduce their gradients over all devices), so the budget goes where the time goes;
- ``topological``: the step's order (phase, then depth below the batch inputs);
- ``reverse_topological``: its reverse (loss end first);
- ``bfs``, ``dfs_preorder``, ``dfs_postorder``: traversals of the forward data-flow graph between groups
  from its sources, neighbours in step order.

``auto`` picks per model family (``model_family``) the order that ``scripts/bench_orders.py`` measured
best at an equal budget (``AUTO_ORDER``).

Example::

    from tag.search.orders import decision_order
    order = decision_order("cost_descending", tg, topo, grouping, cost_model)   # group indices
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from tag.errors import StrategyError
from tag.strategy.baselines import group_order

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.cost.model import CostModel
    from tag.ir.types import TrainingGraph
    from tag.strategy.types import Grouping

ORDERS: tuple[str, ...] = ("cost_descending", "topological", "reverse_topological", "bfs", "dfs_preorder",
                           "dfs_postorder")
# model family -> the order bench_orders measured best for it (scripts/bench_orders.py; README table)
# (150 playouts, 4 examples per device, the three heterogeneous ready topologies: CNNs and MLPs tie
# between orders with cost_descending first; transformers: reverse_topological ahead by 0.9%)
AUTO_ORDER: dict[str, str] = {"cnn": "cost_descending", "transformer": "reverse_topological",
                              "mlp": "cost_descending", "other": "cost_descending"}

_CONV_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "_FusedConv2D"})
_ATTENTION_TYPES = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


def model_family(graph: "TrainingGraph") -> str:
    """``cnn`` (convolutions), ``transformer`` (batched matmuls with a softmax), ``mlp`` (MatMuls only) or
    ``other``."""
    types = {op.type for op in graph.ops if op.phase == "forward"}
    if types & _CONV_TYPES:
        return "cnn"
    if types & _ATTENTION_TYPES and "Softmax" in types:
        return "transformer"
    if "MatMul" in types:
        return "mlp"
    return "other"


def group_costs(graph: "TrainingGraph", topology: "Topology", grouping: "Grouping",
                cost_model: "CostModel", batch: int) -> np.ndarray:
    """Seconds per op group: compute on the fastest device group at the full batch + all-reducing the
    group's gradients over every device."""
    fastest = max(range(len(topology.groups)), key=lambda g: topology.groups[g].peak_flops)
    gof = np.asarray(grouping.group_of_op, dtype=np.int64)
    compute = np.bincount(gof, weights=np.asarray(cost_model.op_times(fastest, batch)),
                          minlength=grouping.num_groups)
    grad_bytes = np.zeros(grouping.num_groups)
    for v in graph.variables:
        if v.kind == "trainable":
            grad_bytes[gof[v.op]] += v.nbytes
    all_devices = list(range(topology.num_devices))
    sync = np.array([cost_model.allreduce_time(b, all_devices) if b > 0 else 0.0 for b in grad_bytes])
    return compute + sync


def _forward_successors(graph: "TrainingGraph", grouping: "Grouping", rank: np.ndarray) -> list[list[int]]:
    """Per group, the groups its forward ops feed (by forward data edges), in step order."""
    gof = np.asarray(grouping.group_of_op, dtype=np.int64)
    succ: list[set] = [set() for _ in range(grouping.num_groups)]
    for e in graph.edges:
        a, b = int(gof[e.src]), int(gof[e.dst])
        if a != b and graph.ops[e.src].phase == "forward" and graph.ops[e.dst].phase == "forward":
            succ[a].add(b)
    return [sorted(s, key=lambda g: rank[g]) for s in succ]


def decision_order(name: str, graph: "TrainingGraph", topology: "Topology", grouping: "Grouping",
                   cost_model: "CostModel", batch: int | None = None) -> list[int]:
    """Op-group indices in decision order NAME (one of ``ORDERS`` or ``auto``); every group exactly once."""
    if name == "auto":
        name = AUTO_ORDER[model_family(graph)]
    if name not in ORDERS:
        raise StrategyError(f"unknown decision order {name!r} (known: auto, {', '.join(ORDERS)})")
    step_order = [int(g) for g in group_order(graph, grouping)]
    n = grouping.num_groups
    rank = np.empty(n, dtype=np.int64)
    rank[step_order] = np.arange(n)
    if name == "topological":
        return step_order
    if name == "reverse_topological":
        return step_order[::-1]
    if name == "cost_descending":
        cost = group_costs(graph, topology, grouping, cost_model, int(batch or graph.batch_size))
        return [int(g) for g in np.lexsort((rank, -cost))]
    succ = _forward_successors(graph, grouping, rank)
    has_pred = np.zeros(n, dtype=bool)
    for s in succ:
        has_pred[s] = True
    roots = [g for g in step_order if not has_pred[g]] + step_order    # then any group not reached
    if name == "bfs":
        return _bfs(roots, succ, n)
    return _dfs(roots, succ, n, post=(name == "dfs_postorder"))


def _bfs(roots: list[int], succ: list[list[int]], n: int) -> list[int]:
    """Breadth-first from each unvisited root in turn."""
    seen = np.zeros(n, dtype=bool)
    out: list[int] = []
    queue: deque[int] = deque()
    for r in roots:
        if not seen[r]:
            seen[r] = True
            queue.append(r)
        while queue:
            g = queue.popleft()
            out.append(g)
            unseen = [s for s in succ[g] if not seen[s]]
            seen[unseen] = True
            queue.extend(unseen)
    return out


def _dfs(roots: list[int], succ: list[list[int]], n: int, post: bool) -> list[int]:
    """Depth-first from each unvisited root in turn; pre-order, or post-order with POST."""
    seen = np.zeros(n, dtype=bool)
    out: list[int] = []

    def visit(root: int) -> None:
        seen[root] = True
        stack = [(root, iter(succ[root]))]     # (group, iterator over its successors still to visit)
        if not post:
            out.append(root)
        while stack:
            g, successors = stack[-1]
            nxt = next((s for s in successors if not seen[s]), None)
            if nxt is None:
                stack.pop()
                if post:
                    out.append(g)
                continue
            seen[nxt] = True
            if not post:
                out.append(nxt)
            stack.append((nxt, iter(succ[nxt])))

    for r in roots:
        if not seen[r]:
            visit(r)
    return out
