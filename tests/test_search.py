"""tag.search: candidates, SearchEnv, decision orders, MCTS, local refinement and the portfolio driver.

Built on the hand-made graphs of tests/tiny.py (no TensorFlow) and the real simulator.
"""
import itertools

import numpy as np
import pytest

from tag.cluster.topology import load_topology
from tag.errors import StrategyError
from tag.search import SearchEnv, search
from tag.search.candidates import _group_class, candidate_actions, candidate_placements
from tag.search.local import refine
from tag.search.mcts import complete, mcts
from tag.search.orders import ORDERS, decision_order
from tag.strategy.grouping import group_ops
from tiny import DeviceSpec, make_topology, mlp_graph


def _hetero_topology():
    specs = {"FAST": DeviceSpec(peak_flops=20e12), "SLOW": DeviceSpec(peak_flops=4e12)}
    return make_topology([("h0", [("FAST", 2)]), ("h1", [("SLOW", 2)])], specs=specs, inter_bandwidth=1.25e9)


def _env(batch=64, widths=(256, 1024, 1024, 10), groups=8, topo=None):
    tg = mlp_graph(batch=batch, widths=widths)
    grouping = group_ops(tg, target_groups=groups)
    return SearchEnv(tg, topo or _hetero_topology(), grouping)


def test_candidates_hold_every_group_alone_all_groups_and_hosts():
    topo = _hetero_topology()
    placements = candidate_placements(topo, np.array([2.0, 2.0, 1.0, 1.0]))
    assert (0,) in placements and (1,) in placements and (0, 1) in placements
    assert placements[0] == (0,)                       # the fastest group first
    actions = candidate_actions(topo, np.array([2.0, 2.0, 1.0, 1.0]))
    modes = {(c.action.placement, c.action.mode) for c in actions}
    assert ((0, 1), "ps") in modes and ((0, 1), "partition") in modes
    singles = [c for c in actions if c.action.mode == "partition" and len(c.partition_devices) == 1]
    assert singles and singles[0].partition_devices == (0,)


@pytest.mark.parametrize("name", ["fabric-64x8", "lab-v100-1080ti", "cloud-slow-link", "consumer-lab-4host"])
def test_candidate_sets_stay_bounded_on_ready_topologies(name):
    topo = load_topology(f"topologies/{name}.pbtxt")
    speeds = np.array([d.peak_flops for d in topo.devices])
    actions = candidate_actions(topo, speeds)
    assert 3 <= len(actions) <= 48
    assert len(set(actions)) == len(actions)
    alone = {c.action.placement[0] for c in actions if len(c.action.placement) == 1}
    # every device group is listed alone, or an interchangeable twin (same symmetry class) is
    classes = {_group_class(topo, g) for g in alone}
    assert {_group_class(topo, g.index) for g in topo.groups} == classes
    if name == "fabric-64x8":            # 64 identical hosts: one representative
        assert len(alone) == 1


def test_env_caches_by_value_and_scores_against_dp():
    env = _env()
    dp = env.builtin_results["dp_allreduce"]
    assert env.reference_name == "dp_allreduce"
    all_groups = next(k for k, c in enumerate(env.candidates)
                      if c.action.placement == (0, 1) and c.action.mode == "allreduce")
    out = env.evaluate(env.uniform_choice(all_groups))
    assert out.step_time == pytest.approx(dp.step_time)
    assert out.value == pytest.approx(1.0)
    runs = env.evaluations
    env.evaluate(list(env.uniform_choice(all_groups)))    # an equal choice built anew: a cache hit
    assert env.evaluations == runs and env.cache_hits >= 1


def test_partition_maps_are_valid():
    env = _env()
    tg = env.graph
    for k, c in enumerate(env.candidates):
        if c.action.mode != "partition":
            continue
        for g in range(env.num_groups):
            m = env.partition_map(g, k)
            assert set(m) == set(int(i) for i in env.group_ops[g])
            assert set(m.values()) <= set(c.partition_devices)
            for names in tg.colocation:
                devs = {m[tg.op_index[n]] for n in names if tg.op_index[n] in m}
                assert len(devs) <= 1


def test_out_of_memory_ranks_below_every_feasible_strategy():
    specs = {"FAST": DeviceSpec(peak_flops=20e12, memory_bytes=64 << 20), "SLOW": DeviceSpec(peak_flops=4e12)}
    topo = make_topology([("h0", [("FAST", 1)]), ("h1", [("SLOW", 2)])], specs=specs)
    env = _env(widths=(256, 2048, 2048, 10), topo=topo)
    outs = [env.evaluate(env.uniform_choice(k)) for k in range(len(env.candidates))]
    bad = [o for o in outs if not o.feasible]
    good = [o for o in outs if o.feasible]
    assert bad and good
    assert max(o.value for o in bad) < 0 < min(o.value for o in good)


@pytest.mark.parametrize("order", ORDERS)
def test_decision_orders_are_permutations(order):
    env = _env()
    seq = decision_order(order, env.graph, env.topology, env.grouping, env.cost_model)
    assert sorted(seq) == list(range(env.num_groups))


def test_unknown_order_is_a_strategy_error():
    env = _env()
    with pytest.raises(StrategyError, match="unknown decision order"):
        decision_order("sideways", env.graph, env.topology, env.grouping, env.cost_model)


def _restricted_env(n_candidates=3, groups=3):
    env = _env(groups=groups)
    keep = list(range(n_candidates))
    env.allowed = [[k for k in a if k in keep] or a[:1] for a in env.allowed]
    env.allowed_sets = [frozenset(a) for a in env.allowed]
    return env


def test_mcts_finds_the_brute_force_optimum_on_a_small_case():
    env = _restricted_env()
    best = min((env.evaluate(c) for c in itertools.product(*env.allowed)), key=lambda o: -o.value)
    fresh = _restricted_env()
    tree = mcts(fresh, order="topological", playouts=200, seed=0)
    assert tree.outcome.value == pytest.approx(best.value)


def test_mcts_is_deterministic_for_a_seed():
    a = mcts(_env(), order="cost_descending", playouts=60, seed=3)
    b = mcts(_env(), order="cost_descending", playouts=60, seed=3)
    assert a.choice == b.choice and a.playouts == b.playouts == 60


def test_completion_follows_the_first_decision():
    env = _env()
    order = list(range(env.num_groups))[::-1]
    first = env.allowed[order[0]][0]
    choice = complete(env, order, (first,))
    assert choice == env.uniform_choice(first)


def test_refine_never_gets_worse_and_reaches_a_local_optimum():
    env = _env()
    start = env.uniform_choice(0)
    r = refine(env, start)
    assert r.outcome.value >= env.evaluate(start).value
    for g in range(env.num_groups):           # no single-group move improves the answer
        for k in env.allowed[g]:
            trial = list(r.choice)
            trial[g] = k
            assert env.evaluate(tuple(trial)).value <= r.outcome.value * (1 + 1e-9)


def test_search_is_never_slower_than_the_best_feasible_builtin():
    env = _env()
    found = search(env, playouts=50, seed=0, min_gain=0.0)
    feasible = [t for n, t in found.baselines.items() if found.baselines_feasible[n]]
    assert found.outcome.feasible
    assert found.step_time <= min(feasible) * (1 + 1e-9)
    named = {"dp_allreduce", "ps", "single", "partition", "best_uniform", "pase_dp", "mcts", "refine"}
    assert named <= set(found.baselines)


def test_search_on_one_device_returns_the_best_builtin_and_says_so():
    topo = make_topology([("h0", [("GPU", 1)])])
    env = _env(topo=topo)
    found = search(env, playouts=20, seed=0)
    assert found.method in env.builtin_results
    assert found.notes and "built-in" in found.notes[0]


def test_a_searched_strategy_must_beat_the_best_builtin_by_the_margin():
    """With min_gain 0 the search keeps the fastest predicted; with a margin larger than its predicted gain
    over the best built-in, the built-in is the answer and the notes say why."""
    env = _env(batch=512)
    free = search(env, playouts=50, seed=0, min_gain=0.0, mixed_min_gain=0.0)
    builtins = {n: env.builtin_results[n].step_time for n in env.builtin_results if free.baselines_feasible[n]}
    best = min(builtins, key=builtins.get)
    assert free.method not in env.builtin_results          # this case has a mixed strategy that wins
    gain = builtins[best] / free.step_time - 1.0
    assert gain > 0
    held = search(env, playouts=50, seed=0, min_gain=gain + 0.01, mixed_min_gain=0.0)
    assert held.method == best and held.step_time == pytest.approx(builtins[best])
    assert any("margin" in n for n in held.notes)
    assert search(env, playouts=50, seed=0, min_gain=gain / 2, mixed_min_gain=0.0).method == free.method


def test_a_mixed_strategy_must_beat_the_best_uniform_action_by_its_margin():
    """With mixed_min_gain 0 the search keeps the fastest predicted mixed strategy; with a margin larger than
    its predicted gain over the best uniform action, that uniform action is the answer and the notes say why."""
    from tag.search.driver import is_mixed
    env = _env(batch=512)
    free = search(env, playouts=50, seed=0, min_gain=0.0, mixed_min_gain=0.0)
    assert free.method not in env.builtin_results and free.method != "best_uniform"
    assert len(set(free.strategy.actions)) > 1 or free.strategy.pipeline is not None    # mixed
    uniform = free.baselines["best_uniform"]
    gain = uniform / free.step_time - 1.0
    assert gain > 0
    held = search(env, playouts=50, seed=0, min_gain=0.0, mixed_min_gain=gain + 0.01)
    assert held.method == "best_uniform" and held.step_time == pytest.approx(uniform)
    assert len(set(held.strategy.actions)) == 1 and held.strategy.pipeline is None
    assert any("uniform action" in n and "margin" in n for n in held.notes)
    assert search(env, playouts=50, seed=0, min_gain=0.0, mixed_min_gain=gain / 2).method == free.method
    assert not is_mixed(None) and not is_mixed((2, 2, 2)) and is_mixed((0, 1, 1))


def test_a_builtin_on_more_devices_must_beat_one_on_fewer_by_the_margin():
    from tag.search.driver import devices_used, simplest_builtin
    env = _env()
    used = {n: devices_used(s, env.topology) for n, s in env.builtin_strategies.items()}
    assert used["single"] < used["dp_allreduce"] == env.topology.num_devices   # one device group against all
    # dp predicted 2% faster than one device: within a 5% margin, one device is the answer; beyond, dp
    assert simplest_builtin(env, {"dp_allreduce": 1.0, "single": 1.02}, 0.05) == "single"
    assert simplest_builtin(env, {"dp_allreduce": 1.0, "single": 1.02}, 0.01) == "dp_allreduce"
    assert simplest_builtin(env, {"dp_allreduce": 1.0, "single": 1.10}, 0.05) == "dp_allreduce"
    # the fastest among the near ones that use the fewest devices, not simply the fastest
    assert simplest_builtin(env, {"dp_allreduce": 1.0, "ps": 1.01, "single": 1.5}, 0.05) == "dp_allreduce"


def test_search_answers_the_simplest_builtin_within_the_margin():
    from tag.search.driver import devices_used
    env = _env()
    found = search(env, playouts=20, seed=0, min_gain=10.0)     # nothing may beat a built-in by 1000%
    times = {n: found.baselines[n] for n in env.builtin_results if found.baselines_feasible[n]}
    used = {n: devices_used(env.builtin_strategies[n], env.topology) for n in times}
    assert found.method == min(times, key=lambda n: (used[n], times[n]))      # every built-in is within 1000%
    assert used[found.method] < env.topology.num_devices and any(found.notes)
