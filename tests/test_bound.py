"""The step-time lower bound (tag.sim.bound) against the full simulation, and the screened search.

Every zoo model (the small versions the zoo and analysis tests build, so the zoo's cache serves them in a
full run; analysed once per module) on a heterogeneous
topology: random edit sequences of 1-4 op groups per step over the search's candidate actions (all-reduce,
parameter server, partition over one or several devices); every bound must be at most the simulated step
time, and the refinement with screening must make exactly the moves of the refinement without it.
"""
from __future__ import annotations

import functools
import os
import random

import numpy as np
import pytest

import tag
from tag.search.env import SearchEnv
from tag.search.local import refine
from tag.sim.bound import StepBound
from tag.strategy.baselines import BUILTIN_STRATEGIES
from tag.strategy.grouping import group_ops
from tiny import TINY_ZOO_OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = os.path.join(ROOT, "topologies", "lab-v100-1080ti.pbtxt")
CONSUMER = os.path.join(ROOT, "topologies", "consumer-lab-4host.pbtxt")
SMALL = TINY_ZOO_OPTIONS
SLACK = 1e-9


@functools.lru_cache(maxsize=None)
def analysed(name: str):
    return tag.analyze(tag.zoo.training_graph(name, batch_size=2, **SMALL[name]))


def edit_sequence(env: SearchEnv, steps: int, seed: int) -> list[tuple[int, ...]]:
    """Choices from data parallelism, each one to four op groups away from the one before."""
    rng = random.Random(seed)
    choice = list(env.uniform_choice(0))
    out = []
    for _ in range(steps):
        for _ in range(rng.randint(1, 4)):
            g = rng.randrange(env.num_groups)
            choice[g] = rng.choice(env.allowed[g])
        out.append(tuple(choice))
    return out


def test_every_zoo_model_is_covered():
    assert set(SMALL) == set(tag.zoo.names())


@pytest.mark.parametrize("name", list(SMALL))
def test_bound_never_exceeds_the_simulation(name):
    graph = analysed(name)
    topo = tag.load_topology(LAB if name != "mlp" else CONSUMER)
    env = SearchEnv(graph, topo, group_ops(graph, target_groups=12), batch_size=4 * topo.num_devices)
    bound = StepBound(env.simulator)
    for n, strategy in env.builtin_strategies.items():           # built-ins through the Strategy interface
        lb = bound.lower_bound(strategy, env.batch_size)
        assert lb <= env.builtin_results[n].step_time * (1 + SLACK), n
    dp = env.uniform_choice(0)
    assert env.step_lower_bound(dp) >= 0.5 * env.evaluate(dp).step_time      # not vacuous where nothing moves
    for choice in edit_sequence(env, 20, seed=sum(map(ord, name))):
        lb = env.step_lower_bound(choice)
        step = env.evaluate(choice).step_time
        assert 0 < lb <= step * (1 + SLACK), (choice, lb, step)
        # the same bound through the Strategy interface
        assert bound.lower_bound(env.strategy(choice), env.batch_size) == pytest.approx(lb, rel=1e-12)
        # static memory exactly as the simulator counts it (what static_fits compares with capacity)
        static = np.add.reduce([t.static for t in env._bound_terms(choice)])
        np.testing.assert_allclose(static, env.result(choice).static_memory, rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet50"])
def test_screened_refinement_makes_the_same_moves(name):
    graph = analysed(name)
    topo = tag.load_topology(CONSUMER)
    grouping = group_ops(graph, target_groups=10)
    runs = {}
    for screen in (False, True):
        env = SearchEnv(graph, topo, grouping, batch_size=4 * topo.num_devices)
        starts = edit_sequence(env, 3, seed=7)
        runs[screen] = [refine(env, s, max_evaluations=150, screen=screen) for s in starts], env
    plain, screened = runs[False][0], runs[True][0]
    for a, b in zip(plain, screened, strict=True):
        assert a.choice == b.choice and a.outcome == b.outcome and a.moves == b.moves and a.sweeps == b.sweeps
    env = runs[True][1]
    assert env.screened > 0 and env.evaluations < runs[False][1].evaluations


def test_no_screening_against_an_infeasible_incumbent():
    graph = analysed("mlp")
    topo = tag.load_topology(CONSUMER)
    env = SearchEnv(graph, topo, group_ops(graph, target_groups=6), batch_size=28)
    choice = env.uniform_choice(0)
    out = env.evaluate(choice)
    worse = type(out)(out.step_time * 0.0 + 1e-12, False, -0.5, 1.0)       # infeasible, absurdly fast
    assert env.evaluate_unless_slower(env.uniform_choice(1), worse) is not None
    assert BUILTIN_STRATEGIES


def test_bound_with_sufficient_factors():
    import dataclasses

    from tag.strategy.sfb_eligibility import eligible_gradients
    graph = analysed("mlp")
    topo = tag.load_topology(CONSUMER)
    env = SearchEnv(graph, topo, group_ops(graph, target_groups=6), batch_size=28)
    bound = StepBound(env.simulator)
    names = [f.variable for f in eligible_gradients(graph)]
    assert names
    for k in (0, 1, 2):
        s = dataclasses.replace(env.strategy(env.uniform_choice(k)), sfb=names)
        lb = bound.lower_bound(s, env.batch_size)
        assert 0 < lb <= env.simulator.evaluate(s, batch_size=env.batch_size).step_time * (1 + SLACK)
