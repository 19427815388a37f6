"""Random search (tag.search.random_search): deterministic per seed, returns the best it evaluated."""
from __future__ import annotations

import pytest

from tag.search.env import SearchEnv
from tag.search.random_search import random_search
from tag.strategy.grouping import group_ops
from tiny import make_topology, mlp_graph


def make_env() -> SearchEnv:
    graph = mlp_graph(batch=8, widths=(16, 32, 32, 32, 32, 32, 32, 32, 4))
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-B", 1)])])
    return SearchEnv(graph, topo, group_ops(graph, target_groups=12))


def test_deterministic_for_a_seed():
    first = random_search(make_env(), evaluations=20, seed=3)
    again = random_search(make_env(), evaluations=20, seed=3)
    assert first.choice == again.choice and first.outcome == again.outcome
    assert first.evaluations == 20


def test_returns_best_evaluated_and_spends_the_budget():
    env = make_env()
    seen = []
    evaluate = env.evaluate

    def recording(choice):
        out = evaluate(choice)
        seen.append((tuple(choice), out))
        return out

    env.evaluate = recording
    found = random_search(env, evaluations=15, seed=1)
    assert env.num_groups > 8
    assert len(seen) == 15
    assert all(k in env.allowed[g] for choice, _ in seen for g, k in enumerate(choice))
    best = max(out.value for _, out in seen)
    assert found.outcome.value == best
    assert (found.choice, found.outcome) in seen
    for i in range(8, 15):                          # the second half mutates an earlier (the best) choice
        assert any(sum(a != b for a, b in zip(seen[i][0], earlier, strict=True)) <= 4 for earlier, _ in seen[:i])


def test_needs_a_budget():
    with pytest.raises(ValueError):
        random_search(make_env(), evaluations=0)
