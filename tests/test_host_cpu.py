"""The runtime's own CPU work on hosts whose device is their CPU (tag.sim.host_cpu), in both kernels."""
import dataclasses

import numpy as np
import pytest

from tag.cost.model import CostModel, DeviceProfile, NetworkProfile, Profile
from tag.sim.host_cpu import cpu_extra, cpu_speed
from tag.sim.simulator import Simulator
from tag.strategy.grouping import group_ops
from tag.strategy.types import Action, Strategy
from tiny import DeviceSpec, make_topology, mlp_graph

CPU_FLOPS = 1e11
# a full-speed CPU host (h0) and a quarter-speed one (h1), as the testbed's quotas make them
SPECS = {"CPU-full": DeviceSpec(tf_device_type="CPU", peak_flops=CPU_FLOPS),
         "CPU-quarter": DeviceSpec(tf_device_type="CPU", peak_flops=CPU_FLOPS / 4)}
DEVICES = {t: DeviceProfile(peak_flops=s.peak_flops, memory_bandwidth=1e30, launch_overhead_s=0.0,
                            efficiency={"default": 1.0}) for t, s in SPECS.items()}
NET = NetworkProfile(per_tensor_s=40e-6, worker_step_cpu_s=0.6e-3, master_step_cpu_s=0.4e-3, tensor_cpu_s=30e-6,
                     byte_cpu_s=0.3e-9, cpu_flops=CPU_FLOPS)
NO_CPU = dataclasses.replace(NET, **{k: 0.0 for k in NetworkProfile.HOST_CPU_FIELDS})


def _topology():
    return make_topology([("h0", [("CPU-full", 1)]), ("h1", [("CPU-quarter", 1)])], specs=SPECS,
                         inter_bandwidth=1e9, inter_latency=1e-5)


def _simulators(net):
    tg = mlp_graph(batch=8, widths=(256, 256, 256))
    topo = _topology()
    grouping = group_ops(tg, target_groups=4)
    cost = CostModel(tg, topo, Profile(dict(DEVICES), network=net))
    return tg, grouping, {k: Simulator(tg, topo, grouping, cost, kernel=k) for k in ("python", "compiled")}


def test_speeds_and_extras_follow_the_measured_cpu():
    topo = make_topology([("h0", [("CPU-full", 1)]), ("h1", [("CPU-quarter", 1)]), ("h2", [("GPU-A", 1)])],
                         specs=SPECS)
    assert cpu_speed(topo, NET).tolist() == pytest.approx([1.0, 0.25, 1.0])    # a GPU's host CPU works beside it
    assert cpu_extra(topo, NET).tolist() == pytest.approx([0.0, 3.0, 0.0])     # 1/s - 1: beyond the calibration
    assert not cpu_extra(topo, NO_CPU).any() and not cpu_extra(topo, None).any()


def test_a_step_on_a_slower_remote_cpu_host_waits_for_its_launch():
    """Everything on h1 (a quarter-speed CPU, not the session's host): the step starts after h1 has launched
    its part, 0.6 ms of the measured CPU at a quarter of the speed; on h0 nothing changes."""
    tg, grouping, with_cpu = _simulators(NET)
    _, _, without = _simulators(NO_CPU)
    for k in ("python", "compiled"):
        on_h1 = Strategy(grouping, [Action((1,), "allreduce")] * grouping.num_groups)
        on_h0 = Strategy(grouping, [Action((0,), "allreduce")] * grouping.num_groups)
        assert with_cpu[k].evaluate(on_h1).step_time == pytest.approx(
            without[k].evaluate(on_h1).step_time + 0.6e-3 / 0.25, rel=1e-9)
        assert with_cpu[k].evaluate(on_h0).step_time == pytest.approx(without[k].evaluate(on_h0).step_time)


def test_parameter_server_coefficients_charge_the_slower_end():
    """A PS on h0 with a worker on h1: each variable costs the per-tensor figure once (one remote worker) plus
    the runtime's CPU at the quarter-speed worker (3 times the measured 30 us beyond the calibration), each
    byte 3 x 0.3 ns more."""
    _, _, sims = _simulators(NET)
    _, _, plain = _simulators(NO_CPU)
    c = sims["python"].routing.collective("ps", [0, 1], (0, 1), 0)
    c0 = plain["python"].routing.collective("ps", [0, 1], (0, 1), 0)
    assert c[6] == pytest.approx(40e-6 + 3 * 30e-6)
    assert c0[6] == pytest.approx(40e-6)
    assert c[1] - c0[1] == pytest.approx(3 * 0.3e-9)
    ring = sims["python"].routing.collective("allreduce", [0, 1], (0, 1), None)
    ring0 = plain["python"].routing.collective("allreduce", [0, 1], (0, 1), None)
    # two devices: 2 ring steps, each a send and a receive at the slower end; 2(n-1)/n = 1 of the payload each way
    assert ring[0] - ring0[0] == pytest.approx(2 * 2 * 30e-6 * 3)
    assert ring[1] - ring0[1] == pytest.approx(2 * 0.3e-9 * 3)


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_both_kernels_charge_the_same_and_more_than_without(mode):
    tg, grouping, sims = _simulators(NET)
    _, _, plain = _simulators(NO_CPU)
    a = Action((0, 1), mode, ps_device=0 if mode == "ps" else None)
    s = Strategy(grouping, [a] * grouping.num_groups)
    python, compiled = sims["python"].evaluate(s).step_time, sims["compiled"].evaluate(s).step_time
    assert python == pytest.approx(compiled, rel=1e-9)
    assert python > plain["python"].evaluate(s).step_time + 0.6e-3 / 0.25 * 0.99


def test_profiles_keep_the_measurement_and_old_profiles_load_without_it(tmp_path):
    prof = Profile(dict(DEVICES), network=NET)
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path).network
    assert back.host_cpu and back.worker_step_cpu_s == pytest.approx(0.6e-3) and back.cpu_flops == CPU_FLOPS
    d = prof.to_dict()
    for k in NetworkProfile.HOST_CPU_FIELDS:
        del d["network"][k]
    old = Profile.from_dict(d).network
    assert not old.host_cpu and old.tensor_cpu_s == 0.0 and np.isclose(old.per_tensor_s, 40e-6)


# ------------------------------------------------------------------ synchronisation beside compute
SERIAL = dataclasses.replace(NET, sync_serial_allreduce=1.0, sync_serial_ps=1.0)


def _sims_on(topology, net, widths=(512, 512, 512, 512, 512)):
    tg = mlp_graph(batch=64, widths=widths)
    grouping = group_ops(tg, target_groups=8)
    cost = CostModel(tg, topology, Profile(dict(DEVICES), network=net))
    return grouping, {k: Simulator(tg, topology, grouping, cost, kernel=k) for k in ("python", "compiled")}


def _three_cpu_hosts():
    return make_topology([("h0", [("CPU-full", 1)]), ("h1", [("CPU-quarter", 1)]), ("h2", [("CPU-quarter", 1)])],
                         specs=SPECS, inter_bandwidth=3e7, inter_latency=5e-5)


def test_sync_serial_is_charged_on_cpu_devices_only():
    from tag.sim.host_cpu import sync_serial
    topo = make_topology([("h0", [("CPU-full", 1)]), ("h1", [("GPU-A", 2)])], specs=SPECS)
    half = dataclasses.replace(NET, sync_serial_allreduce=0.6, sync_serial_ps=0.3)
    assert sync_serial(topo, half).tolist() == [[0.6, 0.3], [0.0, 0.0], [0.0, 0.0]]
    assert sync_serial(topo, NET) is None and sync_serial(topo, None) is None
    gpus = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-A", 2)])])
    assert sync_serial(gpus, half) is None


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_synchronisation_beside_compute_delays_the_step_in_both_kernels(mode):
    """Data parallelism over three CPU hosts whose gradients are synchronised group by group during the backward
    pass (pushes to a parameter server; all-reduces one per group when their groups alternate with ps groups, so
    no fusion bucket holds them back to the end): with the fraction at 1 the synchronisation and the compute
    beside it run one after the other, so the step is slower than with 0 and at 0.5 in between; the two kernels
    agree; profiles without the fields behave as before."""
    topo = _three_cpu_hosts()
    grouping, plain = _sims_on(topo, NET)
    _, serial = _sims_on(topo, SERIAL)
    _, half = _sims_on(topo, dataclasses.replace(NET, sync_serial_allreduce=0.5, sync_serial_ps=0.5))
    ar, ps = Action((0, 1, 2), "allreduce"), Action((0, 1, 2), "ps", ps_device=0)
    acts = [ps] * grouping.num_groups if mode == "ps" else [ar if g % 2 else ps for g in range(grouping.num_groups)]
    s = Strategy(grouping, acts)
    times = {}
    for name, sims in (("plain", plain), ("serial", serial), ("half", half)):
        python, compiled = sims["python"].evaluate(s).step_time, sims["compiled"].evaluate(s).step_time
        assert python == pytest.approx(compiled, rel=1e-12), name
        times[name] = python
    assert times["plain"] < times["half"] < times["serial"]
    # nothing beside compute (one device): no charge
    one = Strategy(grouping, [Action((1,), "allreduce")] * grouping.num_groups)
    assert serial["python"].evaluate(one).step_time == plain["python"].evaluate(one).step_time


def test_random_mixed_strategies_on_cpu_hosts_cost_the_same_in_both_kernels():
    import random
    topo = _three_cpu_hosts()
    grouping, sims = _sims_on(topo, dataclasses.replace(NET, sync_serial_allreduce=0.7, sync_serial_ps=0.3))
    rng = random.Random(5)
    for _ in range(30):
        acts = []
        for _g in range(grouping.num_groups):
            placement = tuple(sorted(rng.sample(range(3), rng.randint(1, 3))))
            u = rng.random()
            acts.append(Action(placement, "allreduce") if u < 0.6 else
                        Action(placement, "ps", ps_device=rng.choice(placement)))
        s = Strategy(grouping, acts)
        assert sims["python"].evaluate(s).step_time == pytest.approx(sims["compiled"].evaluate(s).step_time,
                                                                     rel=1e-12), acts


def test_profiles_keep_the_sync_fractions_and_reject_more_than_one(tmp_path):
    from tag.errors import TagError
    prof = Profile(dict(DEVICES), network=dataclasses.replace(NET, sync_serial_allreduce=0.7, sync_serial_ps=0.25))
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path).network
    assert (back.sync_serial_allreduce, back.sync_serial_ps) == (0.7, 0.25)
    d = prof.to_dict()
    d["network"]["sync_serial_ps"] = 1.5
    with pytest.raises(TagError, match="sync_serial_ps is a fraction"):
        Profile.from_dict(d)


def test_pipelines_on_cpu_hosts_cost_the_same_in_both_kernels_with_sync_fractions():
    """Random pipelines over the three CPU hosts (stages all-reduced or on a parameter server): the stages'
    gradient synchronisation is charged beside compute alike on both paths, and never makes a step faster."""
    import random

    from tag.errors import StrategyError
    from tag.strategy.pipeline import SCHEDULES, Pipeline, PipelineStage
    topo = _three_cpu_hosts()
    grouping, sims = _sims_on(topo, dataclasses.replace(NET, sync_serial_allreduce=0.8, sync_serial_ps=0.4))
    _, plain = _sims_on(topo, NET)
    rng = random.Random(11)
    G, compared = grouping.num_groups, 0
    for _ in range(40):
        S = rng.randint(1, min(3, G))
        bounds = [0] + sorted(rng.sample(range(1, G), S - 1)) + [G]
        stages = []
        for i in range(S):
            placement = tuple(sorted(rng.sample(range(3), rng.randint(1, 3))))
            ps = rng.random() < 0.3
            stages.append(PipelineStage(tuple(range(bounds[i], bounds[i + 1])), placement, "ps" if ps else "allreduce",
                                        rng.choice(placement) if ps else None))
        try:
            s = Strategy.pipelined(grouping, Pipeline(tuple(stages), rng.choice([1, 2, 4]), rng.choice(SCHEDULES)))
            want = sims["python"].evaluate(s, 48).step_time
        except StrategyError:
            continue
        assert sims["compiled"].evaluate(s, 48).step_time == pytest.approx(want, rel=1e-12)
        assert want >= plain["python"].evaluate(s, 48).step_time - 1e-12
        compared += 1
    assert compared >= 10
