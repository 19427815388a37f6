"""PaSE-style DP (tag.search.pase): exact against brute force, vertex order, cost tables, the env wrapper."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tag.search.env import SearchEnv
from tag.search.pase import PaseCosts, dependent_order, edge_costs, node_costs, pase_costs, pase_dp, solve
from tag.strategy.types import Grouping
from tiny import GraphBuilder, make_topology, mlp_graph


# ------------------------------------------------------------------------------ helpers
def random_costs(n: int, sizes: list[int], edges: list[tuple[int, int]], seed: int) -> PaseCosts:
    rng = np.random.default_rng(seed)
    node = [rng.uniform(0, 1, size=sizes[g]) for g in range(n)]
    table = {}
    neighbors: list[set[int]] = [set() for _ in range(n)]
    for u, v in edges:
        u, v = min(u, v), max(u, v)
        table[(u, v)] = rng.uniform(0, 1, size=(sizes[u], sizes[v]))
        neighbors[u].add(v)
        neighbors[v].add(u)
    return PaseCosts(node, table, neighbors)


def brute_force(costs: PaseCosts) -> float:
    return min(costs.total(p) for p in itertools.product(*[range(c.size) for c in costs.node]))


def dependent_sizes_by_definition(neighbors: list[set[int]], order: list[int]) -> list[int]:
    sizes = []
    for i in range(len(order)):
        prefix = set(order[:i + 1])
        sizes.append(sum(1 for u in prefix if neighbors[u] - prefix))
    return sizes


GRAPHS = {
    "chain": (5, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    "residual": (5, [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4), (2, 4)]),
    "hub": (5, [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (3, 4)]),
    "complete4": (4, [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]),
    "two_parts": (5, [(0, 1), (2, 3), (3, 4)]),
}


# ------------------------------------------------------------------------------ DP on synthetic costs
@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_brute_force_when_cap_not_hit(name, seed):
    n, edges = GRAPHS[name]
    sizes = [3, 4, 3, 4, 3][:n]
    costs = random_costs(n, sizes, edges, seed)
    order, dep = dependent_order(costs.neighbors)
    positions, value, pinned = solve(costs, order, max_dependent=max(dep))
    assert pinned == 0
    assert value == pytest.approx(brute_force(costs), abs=1e-12)
    assert value == pytest.approx(costs.total(positions), abs=1e-12)
    assert all(0 <= p < sizes[g] for g, p in enumerate(positions))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cap_pins_groups_and_stays_consistent(seed):
    n, edges = GRAPHS["complete4"]           # every dependent set of a clique is as big as it can be
    costs = random_costs(n, [4, 3, 4, 3], edges, seed)
    order, dep = dependent_order(costs.neighbors)
    assert max(dep) == 3
    positions, value, pinned = solve(costs, order, max_dependent=1)
    assert pinned >= 1
    assert value == pytest.approx(costs.total(positions), abs=1e-12)     # the value is the answer's cost
    assert value >= brute_force(costs) - 1e-12


def test_dp_handles_impossible_candidates():
    costs = random_costs(3, [3, 3, 3], [(0, 1), (1, 2)], 5)
    costs.node[1][[0, 2]] = np.inf
    order, _ = dependent_order(costs.neighbors)
    positions, value, _ = solve(costs, order)
    assert positions[1] == 1 and np.isfinite(value)
    assert value == pytest.approx(brute_force(costs))


# ------------------------------------------------------------------------------ vertex order
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_order_is_permutation_and_sizes_follow_definition(name):
    n, edges = GRAPHS[name]
    costs = random_costs(n, [2] * n, edges, 0)
    order, sizes = dependent_order(costs.neighbors)
    assert sorted(order) == list(range(n))
    assert sizes == dependent_sizes_by_definition(costs.neighbors, order)
    assert sizes[-1] == 0


def test_order_is_greedy_with_rank_ties():
    n, edges = GRAPHS["residual"]
    neighbors = random_costs(n, [2] * n, edges, 0).neighbors
    rank = np.array([4, 3, 2, 1, 0])                 # reversed step order: ties go to the highest index
    order, sizes = dependent_order(neighbors, rank)
    assert order[0] == 4                            # every first vertex gives |D| = 1; rank decides
    for i in range(n):                              # each step takes a vertex giving the smallest next set
        rest = [v for v in range(n) if v not in order[:i]]
        best = min(dependent_sizes_by_definition(neighbors, order[:i] + [v])[-1] for v in rest)
        assert sizes[i] == best
    chain = random_costs(5, [2] * 5, GRAPHS["chain"][1], 0).neighbors
    assert dependent_order(chain)[1] == [1, 1, 1, 1, 0]


# ------------------------------------------------------------------------------ costs from an env
def residual_graph():
    """x -> a -> b -> c with a skip x -> c, each op its own group (dependent sets of two)."""
    b = GraphBuilder(8, "residual")
    b.op("x", "Placeholder", out_pe=4 * 64)
    b.op("a", "MatMul", inputs=("x",), flops_pe=2e6, out_pe=4 * 64)
    b.op("b", "MatMul", inputs=("a",), flops_pe=4e6, out_pe=4 * 64)
    b.op("c", "AddV2", inputs=("b", "x"), flops_pe=1e3, out_pe=4 * 64)
    b.op("d", "MatMul", inputs=("c",), flops_pe=2e6, out_pe=4 * 16)
    tg = b.build()
    return tg, Grouping(np.arange(len(tg.ops)), [op.name for op in tg.ops])


def small_env(graph, grouping, per_group: int = 3) -> SearchEnv:
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-B", 1)])])
    env = SearchEnv(graph, topo, grouping)
    for g in range(env.num_groups):                  # few candidates per group, modes mixed
        allowed = env.allowed[g]
        picks = [allowed[0], allowed[1]] + [k for k in allowed if env.candidates[k].action.mode == "partition"]
        env.allowed[g] = list(dict.fromkeys(picks))[:per_group]
    return env


@pytest.mark.parametrize("build", ["residual", "mlp"])
def test_env_dp_matches_brute_force(build):
    if build == "residual":
        graph, grouping = residual_graph()
    else:
        from tag.strategy.grouping import group_ops
        graph = mlp_graph(batch=8, widths=(16, 32, 32, 4))
        grouping = group_ops(graph, target_groups=4)
    env = small_env(graph, grouping)
    found = pase_dp(env, negligible_fraction=0.0)
    costs = pase_costs(env)
    assert found.dropped == 0 and found.ignored_edges == 0
    assert found.additive_cost == pytest.approx(brute_force(costs), rel=1e-12)
    assert all(k in env.allowed[g] for g, k in enumerate(found.choice))
    assert found.outcome == env.evaluate(found.choice)
    assert sorted(found.order) == list(range(env.num_groups))
    assert found.dependent_sizes == dependent_sizes_by_definition(costs.neighbors, found.order)
    assert found.max_dependent_set == max(found.dependent_sizes)
    if build == "residual":
        assert found.max_dependent_set == 2


def test_node_costs_by_hand():
    graph, grouping = residual_graph()
    env = SearchEnv(graph, make_topology([("h0", [("GPU-A", 2)])]), grouping)
    node = node_costs(env)
    cm, B = env.cost_model, env.batch_size
    a = graph.op_index["a"]
    for i, k in enumerate(env.allowed[a]):
        c = env.candidates[k]
        if c.action.mode == "partition" and len(c.partition_devices) == 1:      # one device, full batch
            assert node[a][i] == pytest.approx(cm.op_times(0, B)[a])
        if c.action.mode == "allreduce":                                        # two equal devices, half batch
            assert node[a][i] == pytest.approx(cm.op_times(0, B // 2)[a])      # no weights: no sync


def test_edge_costs_zero_for_same_layout_else_transfer():
    graph, grouping = residual_graph()
    env = SearchEnv(graph, make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-B", 1)])]), grouping)
    ops = graph.op_index
    alone = {c.action.placement[0]: k for k, c in enumerate(env.candidates)      # one device: its whole copy
             if c.action.mode == "allreduce" and len(c.action.placement) == 1}
    both = next(k for k, c in enumerate(env.candidates)
                if c.action.mode == "allreduce" and len(c.action.placement) == 2)
    assert sorted(alone) == [0, 1]
    env.allowed = [[alone[0], alone[1], both] for _ in range(env.num_groups)]
    table = edge_costs(env)[(ops["a"], ops["b"])]
    nbytes = 4 * 64 * env.batch_size
    expect = env.cost_model.transfer_time(nbytes, 0, 1)
    assert table[2, 2] == 0.0 and table[0, 0] == 0.0 and table[1, 1] == 0.0
    assert table[0, 1] == pytest.approx(expect)
    assert table[2, 0] == pytest.approx(expect)          # slowest link between the sets, full bytes
    skip = edge_costs(env)[(ops["x"], ops["c"])]         # x feeds a and c: one edge each
    assert skip[0, 1] == pytest.approx(expect)
