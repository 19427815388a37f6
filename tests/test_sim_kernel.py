"""The compiled simulation kernel (tag.sim.kernel) against the Python reference (tag.sim.schedule, memory).

Several zoo models (the small versions other tests build, so the zoo's cache serves them), two topologies,
random strategies over the search's candidate actions and random edit sequences (1-10 op groups changed
from the strategy before), the built-ins, and random pipelines: both paths must give the same step time
(bit for bit, so a search makes the same decisions on either), feasibility, memory and bytes on the wire
(to 1e-9 relative).
"""
from __future__ import annotations

import functools
import os
import random

import numpy as np
import pytest

import tag
from tag.errors import StrategyError
from tag.search.env import SearchEnv
from tag.sim import kernel as sim_kernel
from tag.sim.simulator import Simulator
from tag.strategy.grouping import group_ops
from tag.strategy.pipeline import SCHEDULES, Pipeline, PipelineStage
from tag.strategy.types import Action, Strategy
from tiny import TINY_ZOO_OPTIONS

pytestmark = pytest.mark.skipif(not sim_kernel.available(), reason="numba is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = os.path.join(ROOT, "topologies", "lab-v100-1080ti.pbtxt")
CONSUMER = os.path.join(ROOT, "topologies", "consumer-lab-4host.pbtxt")
RTOL = 1e-9


@functools.lru_cache(maxsize=None)
def analysed(name: str):
    return tag.analyze(tag.zoo.training_graph(name, batch_size=2, **TINY_ZOO_OPTIONS[name]))


def assert_same(fast, ref, what) -> None:
    # the kernel repeats the reference's arithmetic operation for operation: the same step time, bit for bit
    assert fast.step_time == ref.step_time, what
    assert fast.feasible == ref.feasible and fast.oom_devices == ref.oom_devices, what
    assert fast.comm_bytes == pytest.approx(ref.comm_bytes, rel=RTOL, abs=1e-6), what
    for name in ("peak_memory", "static_memory", "activation_memory"):
        np.testing.assert_allclose(getattr(fast, name), getattr(ref, name), rtol=RTOL, atol=1e-6, err_msg=what)
    np.testing.assert_allclose(fast.group_makespan, ref.group_makespan, rtol=RTOL, atol=1e-15, err_msg=what)


def choices(env: SearchEnv, rng: random.Random, count: int) -> list[tuple[int, ...]]:
    """COUNT choices: every fourth one uniformly random, the others 1-10 op groups away from the one before."""
    choice = list(env.uniform_choice(0))
    out = []
    for i in range(count):
        if i % 4 == 0:
            choice = [rng.choice(env.allowed[g]) for g in range(env.num_groups)]
        else:
            for _ in range(rng.randint(1, 10)):
                g = rng.randrange(env.num_groups)
                choice[g] = rng.choice(env.allowed[g])
        out.append(tuple(choice))
    return out


@pytest.mark.parametrize("name,topology", [("mlp", CONSUMER), ("transformer", LAB), ("resnet50", LAB),
                                           ("bert_base", CONSUMER), ("vgg19", LAB), ("inception_v3", CONSUMER),
                                           ("mobilenet_v2", LAB), ("bert_large", LAB)])
def test_compiled_kernel_equals_the_python_reference(name, topology):
    graph = analysed(name)
    topo = tag.load_topology(topology)
    grouping = group_ops(graph, target_groups=24)
    fast = Simulator(graph, topo, grouping, kernel="compiled")
    ref = Simulator(graph, topo, grouping, fast.cost_model, kernel="python")
    assert (fast.kernel, ref.kernel) == ("compiled", "python")
    env = SearchEnv(graph, topo, grouping, cost_model=fast.cost_model, batch_size=4 * topo.num_devices,
                    simulator=fast)
    for n, s in env.builtin_strategies.items():
        assert_same(fast.evaluate(s, env.batch_size), ref.evaluate(s, env.batch_size), n)
    rng = random.Random(sum(map(ord, name)))
    ran = fast.compiled_evaluations
    tried = 0
    for choice in choices(env, rng, 60):
        s = env.strategy(choice)
        assert_same(fast.evaluate(s, env.batch_size), ref.evaluate(s, env.batch_size), choice)
        tried += 1
    # single-device placements of whole groups (no split tasks): all of them on the kernel, with
    # batch shares by peak FLOP/s (no device_speeds)
    ng = len(topo.groups)
    dp = Action(tuple(range(ng)), "allreduce")
    for _ in range(20):
        acts, partition = [dp] * grouping.num_groups, {}
        for _ in range(rng.randint(1, 10)):
            g = rng.randrange(grouping.num_groups)
            placement = tuple(sorted(rng.sample(range(ng), rng.randint(1, ng))))
            devs = [d for p in placement for d in topo.groups[p].devices]
            u = rng.random()
            acts[g] = (Action(placement, "allreduce") if u < 0.5 else
                       Action(placement, "ps", ps_device=rng.choice(devs)) if u < 0.8 else
                       Action(placement[:1], "partition"))
        for g, a in enumerate(acts):
            if a.mode == "partition":
                partition.update({i: topo.groups[a.placement[0]].devices[0] for i in grouping.members(g).tolist()})
        # a random fusion bucket size (tag.search.buckets): both kernels close the buckets at the same bytes
        s = Strategy(grouping, acts, partition=partition, bucket_bytes=rng.choice([None, 2.0 ** 12, 2.0 ** 18]))
        before = fast.compiled_evaluations
        assert_same(fast.evaluate(s, env.batch_size), ref.evaluate(s, env.batch_size), (acts, s.bucket_bytes))
        assert fast.compiled_evaluations == before + 1
        tried += 1
    # every one of them ran on the kernel
    assert fast.compiled_evaluations - ran == tried


@pytest.mark.parametrize("name,topology", [("mlp", CONSUMER), ("transformer", LAB), ("resnet50", LAB)])
def test_compiled_pipelines_equal_the_python_reference(name, topology):
    """Random pipelines (1-4 stages of consecutive op groups, all-reduce or parameter-server stages, 1-4
    micro-batches, every schedule): the same step time, bubble, memory and bytes on either path."""
    graph = analysed(name)
    topo = tag.load_topology(topology)
    grouping = group_ops(graph, target_groups=12)
    fast = Simulator(graph, topo, grouping, kernel="compiled")
    ref = Simulator(graph, topo, grouping, fast.cost_model, kernel="python")
    rng = random.Random(7)
    ng, G = len(topo.groups), grouping.num_groups
    batch = 8 * topo.num_devices
    compared = 0
    for _ in range(60):
        S = rng.randint(1, min(4, G))
        bounds = [0] + sorted(rng.sample(range(1, G), S - 1)) + [G]
        stages = []
        for i in range(S):
            placement = tuple(sorted(rng.sample(range(ng), rng.randint(1, ng))))
            devices = [d for p in placement for d in topo.groups[p].devices]
            ps = rng.random() < 0.3
            stages.append(PipelineStage(tuple(range(bounds[i], bounds[i + 1])), placement, "ps" if ps else "allreduce",
                                        rng.choice(devices) if ps else None))
        pipeline = Pipeline(tuple(stages), rng.choice([1, 2, 4]), rng.choice(SCHEDULES))
        try:
            strategy = Strategy.pipelined(grouping, pipeline)
            want = ref.evaluate(strategy, batch)
        except StrategyError:       # data flowing backwards between stages: not a pipeline
            continue
        got = fast.evaluate(strategy, batch)
        assert_same(got, want, pipeline)
        assert got.bubble_fraction == pytest.approx(want.bubble_fraction, rel=RTOL, abs=1e-12)
        compared += 1
    assert compared >= 10 and fast.compiled_evaluations == compared


def test_kernel_choice():
    graph = analysed("mlp")
    topo = tag.load_topology(CONSUMER)
    grouping = group_ops(graph, target_groups=4)
    with pytest.raises(StrategyError, match="kernel"):
        Simulator(graph, topo, grouping, kernel="fortran")
    old = os.environ.get(sim_kernel.ENV_VAR)
    try:
        os.environ[sim_kernel.ENV_VAR] = "python"
        assert Simulator(graph, topo, grouping).kernel == "python"
        os.environ[sim_kernel.ENV_VAR] = "compiled"
        assert Simulator(graph, topo, grouping).kernel == "compiled"
    finally:
        if old is None:
            os.environ.pop(sim_kernel.ENV_VAR, None)
        else:
            os.environ[sim_kernel.ENV_VAR] = old
