"""Step simulator: hand-computed results on tiny graphs, memory, determinism, trace, errors; zoo sanity."""
import dataclasses
import json

import numpy as np
import pytest

from tag.cost.model import CostModel, DeviceProfile, Profile
from tag.errors import StrategyError
from tag.sim.simulator import SimResult, Simulator
from tag.strategy.grouping import group_ops
from tag.strategy.types import Action, Grouping, Strategy
from tiny import DeviceSpec, GraphBuilder, chain_graph, make_topology, mlp_graph

# An ideal device for hand computation: ops cost flops / 1 TFLOP/s exactly, memory traffic is free,
# no launch overhead.
EXACT = Profile({"GPU-A": DeviceProfile(peak_flops=1e12, memory_bandwidth=1e30, launch_overhead_s=0.0,
                                        efficiency={"MatMul": 1.0, "default": 1.0}),
                 "GPU-B": DeviceProfile(peak_flops=3e12, memory_bandwidth=1e30, launch_overhead_s=0.0,
                                        efficiency={"MatMul": 1.0, "default": 1.0})})
# Communication-only: compute is (practically) free.
FREE = Profile({"GPU-A": DeviceProfile(peak_flops=1e30, memory_bandwidth=1e30, launch_overhead_s=0.0,
                                       efficiency={"MatMul": 1.0, "default": 1.0})})


def _sim(tg, topo, profile=EXACT, target=64):
    grouping = group_ops(tg, target)
    return Simulator(tg, topo, grouping, CostModel(tg, topo, profile)), grouping


def _all(grouping, action, **kw):
    return Strategy(grouping, [action] * grouping.num_groups, **kw)


def _hosts(n, per_host=1, **kw):
    return make_topology([(f"h{i}", [("GPU-A", per_host)]) for i in range(n)], **kw)


def test_chain_on_one_device():
    tg = chain_graph([1e9, 2e9, 3e9])
    topo = _hosts(1)
    sim, gr = _sim(tg, topo)
    assert gr.num_groups == 3
    r = sim.evaluate(_all(gr, Action((0,), "allreduce")))
    assert isinstance(r, SimResult)
    assert r.step_time == pytest.approx(6e-3)
    assert r.compute_time[0] == pytest.approx(6e-3) and r.utilisation[0] == pytest.approx(1.0)
    assert r.comm_bytes == 0 and r.feasible and r.oom_devices == []
    # the same as model parallelism on that device
    part = _all(gr, Action((0,), "partition"), partition={i: 0 for i in range(len(tg.ops))})
    assert sim.evaluate(part).step_time == pytest.approx(6e-3)
    # groups run back to back: makespan of each is its own time, no idle time between them
    assert np.allclose(r.group_makespan, [1e-3, 2e-3, 3e-3])
    assert np.allclose(r.group_idle_after, 0.0)


def test_two_devices_one_transfer():
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)     # layer0 sends 4 x 1 MB to layer1
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-4)
    sim, gr = _sim(tg, topo)
    expected = 1e-3 + (1e-4 + 4e6 / 1e9) + 2e-3
    part = Strategy(gr, [Action((0, 1), "partition")] * 2, partition={0: 0, 1: 1})
    r = sim.evaluate(part)
    assert r.step_time == pytest.approx(expected)
    assert r.comm_bytes == pytest.approx(4e6)
    # the same placement written as one device group per op group
    rep = Strategy(gr, [Action((0,), "allreduce"), Action((1,), "allreduce")])
    assert sim.evaluate(rep).step_time == pytest.approx(expected)
    # device 0 waits for nothing, device 1 waits for the transfer
    assert r.group_idle_after[0] == pytest.approx(expected - 1e-3)
    # inside one host the interconnect is used instead
    topo1 = make_topology([("h0", [("GPU-A", 2)])], intra_bandwidth=1e10, intra_latency=1e-6)
    sim1, gr1 = _sim(tg, topo1)
    r1 = sim1.evaluate(Strategy(gr1, [Action((0,), "partition")] * 2, partition={0: 0, 1: 1}))
    assert r1.step_time == pytest.approx(1e-3 + 1e-6 + 4e6 / 1e10 + 2e-3)


def test_partition_splits_a_group_over_devices():
    b = GraphBuilder(batch_size=4)
    x = b.op("l/a", "MatMul", flops=1e9, out_pe=1e6)              # one op group, two devices
    y = b.op("l/b", "MatMul", inputs=(x,), flops=2e9, out_pe=1e6)
    b.op("m/c", "MatMul", inputs=(y,), flops=3e9)                  # next group back on device 0
    tg = b.build()
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-4)
    sim, gr = _sim(tg, topo)
    assert gr.num_groups == 2
    s = Strategy(gr, [Action((0, 1), "partition")] * 2, partition={0: 0, 1: 1, 2: 0})
    r = sim.evaluate(s)
    hop = 1e-4 + 4e6 / 1e9
    assert r.step_time == pytest.approx(1e-3 + hop + 2e-3 + hop + 3e-3)
    assert r.comm_bytes == pytest.approx(8e6)
    assert r.compute_time == pytest.approx([4e-3, 2e-3])
    tr = sim.trace(s)
    assert max(e["ts"] + e["dur"] for e in tr["traceEvents"] if e["ph"] == "X") == pytest.approx(r.step_time * 1e6)


def test_batch_resplit_between_groups():
    b = GraphBuilder(batch_size=4)
    x = b.op("l0/op", "MatMul", flops_pe=2.5e8, out_pe=1e6)
    b.op("l1/op", "MatMul", inputs=(x,), flops_pe=2.5e8, out_pe=1e6)
    tg = b.build()
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-4)
    sim, gr = _sim(tg, topo)
    # layer0 on device 0 (all 4 examples), layer1 data-parallel on both devices (2 examples each):
    # device 1 needs its 2 examples (2 MB); device 0 keeps its half
    r = sim.evaluate(Strategy(gr, [Action((0,), "allreduce"), Action((0, 1), "allreduce")]))
    assert r.comm_bytes == pytest.approx(2e6)
    assert r.step_time == pytest.approx(1e-3 + (1e-4 + 2e6 / 1e9) + 0.5e-3)


def test_ring_allreduce_of_known_bytes():
    tg = mlp_graph(batch=4, widths=(5000, 5000))      # one 5000x5000 float32 kernel: 1e8 bytes of gradient
    assert tg.variables[0].nbytes == 1e8
    topo = _hosts(4, inter_bandwidth=1e9, inter_latency=1e-5)
    sim, gr = _sim(tg, topo, FREE)
    r = sim.evaluate(_all(gr, Action((0, 1, 2, 3), "allreduce")))
    ring = 2 * 3 / 4 * 1e8 / 1e9 + 2 * 3 * 1e-5
    assert r.step_time == pytest.approx(ring, rel=1e-6)
    assert r.comm_bytes == pytest.approx(2 * 3 * 1e8)
    assert r.step_time == pytest.approx(sim.cost.allreduce_time(1e8, [0, 1, 2, 3]), rel=1e-6)


def test_collectives_share_links_one_after_another():
    tg = mlp_graph(batch=4, widths=(5000, 5000, 5000))   # two kernels of 1e8 bytes
    topo = _hosts(4, inter_bandwidth=1e9, inter_latency=1e-5)
    sim, gr = _sim(tg, topo, FREE)
    r = sim.evaluate(_all(gr, Action((0, 1, 2, 3), "allreduce")))
    assert r.step_time == pytest.approx(2 * (2 * 3 / 4 * 1e8 / 1e9 + 6e-5), rel=1e-6)


def test_parameter_server_bottleneck():
    tg = mlp_graph(batch=4, widths=(5000, 5000))
    topo = _hosts(4, inter_bandwidth=1e9, inter_latency=1e-5)
    sim, gr = _sim(tg, topo, FREE)
    r = sim.evaluate(_all(gr, Action((0, 1, 2, 3), "ps", ps_device=0)))
    # pull 3 x 1e8 bytes through the PS host's 1 GB/s NIC, later push them back
    assert r.step_time == pytest.approx(2 * (1e-5 + 3e8 / 1e9), rel=1e-6)
    assert r.step_time == pytest.approx(sim.cost.ps_time(1e8, [0, 1, 2, 3], 0), rel=1e-6)
    assert r.comm_bytes == pytest.approx(2 * 3 * 1e8)
    # memory: the PS holds the weights, Adam's slots and the aggregated gradient besides its replica
    W, S = 1e8, 2e8
    assert r.static_memory[0] == pytest.approx(2 * W + 2 * W + S)
    assert np.allclose(r.static_memory[1:], 2 * W)


def test_out_of_memory():
    tg = mlp_graph(batch=4, widths=(5000, 5000))
    roomy = _hosts(4, specs={"GPU-A": DeviceSpec(memory_bytes=1 << 30)})
    tight = _hosts(4, specs={"GPU-A": DeviceSpec(memory_bytes=300_000_000)})
    for topo, ok in ((roomy, True), (tight, False)):
        sim, gr = _sim(tg, topo, FREE)
        r = sim.evaluate(_all(gr, Action((0, 1, 2, 3), "allreduce")))
        # every replica holds weights + gradients + Adam slots (2x weights) = 4e8 bytes
        assert np.allclose(r.static_memory, 4e8)
        assert np.all(r.peak_memory >= r.static_memory)
        assert r.feasible is ok
        assert r.oom_devices == ([] if ok else [0, 1, 2, 3])


def test_activations_live_until_backward():
    topo = _hosts(2, specs={"GPU-A": DeviceSpec(memory_bytes=1 << 40)})
    widths = (256, 256, 256, 10)
    sim, gr = _sim(mlp_graph(batch=512, widths=widths), topo)
    one = sim.evaluate(_all(gr, Action((0,), "allreduce")))
    two = sim.evaluate(_all(gr, Action((0, 1), "allreduce")))
    assert one.activation_memory[0] > 0 and one.activation_memory[1] == 0
    # weights, gradients and Adam slots are static memory: 4 x the weights on every replica
    weights = 4 * (256 * 256 * 2 + 256 * 10)
    assert np.allclose(two.static_memory, 4 * weights)
    # the forward activations every layer keeps for its weight gradient (batch x width floats) are live
    # together at the start of the backward pass
    saved = 4 * 512 * (256 + 256 + 256)
    assert one.activation_memory[0] >= saved
    # data parallelism halves each replica's activations
    assert two.activation_memory[0] < 0.6 * one.activation_memory[0]
    # activations grow linearly with the batch: evaluate the same graph at other batch sizes
    a = [sim.evaluate(_all(gr, Action((0,), "allreduce")), batch_size=b).activation_memory[0]
         for b in (256, 512, 1024)]
    assert a[1] == one.activation_memory[0]
    assert a[2] - a[1] == pytest.approx(2 * (a[1] - a[0]))
    # ... the same as a graph built for that batch
    sim2, gr2 = _sim(mlp_graph(batch=1024, widths=widths), topo)
    assert sim2.evaluate(_all(gr2, Action((0,), "allreduce"))).activation_memory[0] == pytest.approx(a[2])


def test_uneven_shares_balance_unequal_devices():
    b = GraphBuilder(batch_size=16)
    x = b.op("l0/op", "MatMul", flops_pe=1e9, out_pe=4)
    b.op("l1/op", "MatMul", inputs=(x,), flops_pe=1e9, out_pe=4)
    tg = b.build()
    topo = make_topology([("h0", [("GPU-A", 1), ("GPU-B", 1)])],
                         specs={"GPU-A": DeviceSpec(peak_flops=1e12), "GPU-B": DeviceSpec(peak_flops=3e12)})
    sim, gr = _sim(tg, topo)
    r = sim.evaluate(_all(gr, Action((0, 1), "allreduce")))
    # shares 4 : 12 for speeds 1 : 3, so both devices compute for 2 x 4e9 / 1e12 = 8 ms
    assert r.compute_time == pytest.approx([8e-3, 8e-3])
    assert r.step_time == pytest.approx(8e-3)
    # calibrated speeds in the strategy win over peak FLOP/s: equal speeds give 8 : 8 shares
    even = dataclasses.replace(_all(gr, Action((0, 1), "allreduce")), device_speeds=(1.0, 1.0))
    r = sim.evaluate(even)
    assert r.compute_time == pytest.approx([16e-3, 16e-3 / 3])
    assert sim.evaluate(_all(gr, Action((0, 1), "allreduce"))).step_time == pytest.approx(8e-3)   # back again
    with pytest.raises(StrategyError, match="device speeds"):
        sim.evaluate(dataclasses.replace(even, device_speeds=(1.0,)))


def test_deterministic_and_trace_structure():
    tg = mlp_graph(batch=16, widths=(64, 128, 128, 10))
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-A", 2)])])
    sim, gr = _sim(tg, topo)
    g = gr.num_groups
    strategies = [
        _all(gr, Action((0, 1), "allreduce")),
        _all(gr, Action((0, 1), "ps", ps_device=2)),
        Strategy(gr, [Action((0,), "allreduce"), Action((1,), "allreduce")] * (g // 2) + [Action((0, 1))] * (g % 2)),
        _all(gr, Action((0, 1), "partition"), partition={i: int(gr.group_of_op[i]) % 4 for i in range(len(tg.ops))}),
    ]
    for s in strategies:
        a, b = sim.evaluate(s), sim.evaluate(s)
        c = Simulator(tg, topo, gr, CostModel(tg, topo, EXACT)).evaluate(s)
        for x in (b, c):
            assert x.step_time == a.step_time and x.comm_bytes == a.comm_bytes
            for f in ("peak_memory", "utilisation", "group_makespan", "group_idle_after", "compute_time"):
                assert np.array_equal(getattr(a, f), getattr(x, f)), f
        assert a.step_time > 0 and len(a.group_makespan) == g and len(a.peak_memory) == topo.num_devices
        tr = sim.trace(s)
        assert json.dumps(tr) == json.dumps(sim.trace(s))
        ev = tr["traceEvents"]
        assert {e["ph"] for e in ev} <= {"X", "M"}
        rows = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {(0, d) for d in range(topo.num_devices)} <= rows
        assert (1, 0) in rows and (1, 2) in rows              # host interconnects and NICs
        xs = [e for e in ev if e["ph"] == "X"]
        assert xs and all(e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["name"], str) for e in xs)
        assert all((e["pid"], e["tid"]) in rows for e in xs)
        end = max(e["ts"] + e["dur"] for e in xs)
        assert end == pytest.approx(a.step_time * 1e6, rel=1e-9)
        if s.actions[0].mode == "ps":
            assert any(e["cat"] == "comm" and e["name"].startswith("push") for e in xs)


def test_nics_are_full_duplex_and_a_receiver_is_shared():
    """A transfer holds the sender's NIC send side and the receiver's receive side: h0->h1 and h1->h0 share
    no resource (full duplex), while h1->h0 and h2->h0 both wait on h0's receive side."""
    from tag.sim.routing import Routing
    from tag.sim.task_graph import TaskGraph
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)
    topo = _hosts(3, inter_bandwidth=1e9, inter_latency=1e-4)
    routing = Routing(topo, CostModel(tg, topo), TaskGraph(tg, group_ops(tg, target_groups=2)))
    there, back = routing.route(0, 1)[0], routing.route(1, 0)[0]
    assert not set(there) & set(back)
    assert set(routing.route(1, 0)[0]) & set(routing.route(2, 0)[0]) == {2 * 3 + 0}
    assert routing.resource_names[2 * 3 + 0].endswith("receive")


def test_parameter_server_pull_and_push_each_hold_one_direction():
    """Two groups on two hosts, each with its PS on the other host: one group's pull (PS send side, worker
    receive side) and the other's (the reverse) share no NIC side, so they run at once, as the pushes do."""
    tg = mlp_graph(batch=4, widths=(5000, 5000, 5000))      # two kernels of 1e8 bytes
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-5)
    grouping = Grouping(np.array([0 if "dense_0" in op.name else 1 for op in tg.ops], dtype=np.int64), ["a", "b"])
    one_way = 1e-5 + 1e8 / 1e9                  # one pull or push of a kernel over the 1 GB/s NIC
    crossed = Strategy(grouping, [Action((0, 1), "ps", ps_device=1), Action((0, 1), "ps", ps_device=0)])
    same = Strategy(grouping, [Action((0, 1), "ps", ps_device=0)] * 2)
    for kernel in ("python", "compiled"):
        sim = Simulator(tg, topo, grouping, CostModel(tg, topo, FREE), kernel=kernel)
        # the pulls overlap and so do the pushes: two one-way times, where holding both directions took four
        assert sim.evaluate(crossed).step_time == pytest.approx(2 * one_way, rel=1e-3)
        # both PS on one host: the pulls share its send side, the pushes its receive side
        assert sim.evaluate(same).step_time == pytest.approx(4 * one_way, rel=1e-3)


def test_transfers_hold_the_link_for_their_bytes_and_overlap_their_latencies():
    """Two transfers issued at once on one route: the second waits only for the first one's bytes to leave
    the wire, not for its latency (1 ms here), so it arrives one transfer time after the first."""
    from tag.sim.routing import Routing
    from tag.sim.schedule import StepSchedule
    from tag.sim.task_graph import TaskGraph
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-3)
    tasks = TaskGraph(tg, group_ops(tg, target_groups=2))
    sched = StepSchedule(tasks, Routing(topo, CostModel(tg, topo), tasks), [], {}, 1, {}, ["a", "b"], None)
    wire = 4e6 / 1e9
    first = sched._transfer(0, 1, 4e6, 0.0, "first")
    second = sched._transfer(0, 1, 4e6, 0.0, "second")
    assert first == pytest.approx(1e-3 + wire)
    assert second == pytest.approx(1e-3 + 2 * wire)


def test_a_fast_nic_sends_beside_a_slow_link_and_the_slow_link_serialises():
    """h0's NIC runs at its fastest link (1 GB/s to h1); its link to h2 runs at 0.2 GB/s. A transfer to h2
    holds h0's send side only for its bytes at 1 GB/s, so a transfer to h1 issued at once waits 1/5 of it,
    not all of it; a second transfer to h2 waits for the h0 -> h2 link's whole time."""
    from tag.sim.routing import Routing
    from tag.sim.schedule import StepSchedule
    from tag.sim.task_graph import TaskGraph
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)
    topo = _hosts(3, inter_bandwidth=1e9, inter_latency=0.0,
                  host_links={("h0", "h2"): (0.2e9, 0.0), ("h1", "h2"): (0.2e9, 0.0)})
    tasks = TaskGraph(tg, group_ops(tg, target_groups=2))
    routing = Routing(topo, CostModel(tg, topo), tasks)
    # h2's NIC is itself 0.2 GB/s (its fastest link): no link is slower than both its ends' NICs
    assert [n for n in routing.resource_names if n.endswith(" link")] == []
    sched = StepSchedule(tasks, routing, [], {}, 1, {}, ["a", "b"], None)
    slow = sched._transfer(0, 2, 2e6, 0.0, "to h2")
    fast = sched._transfer(0, 1, 2e6, 0.0, "to h1")
    again = sched._transfer(0, 2, 2e6, 0.0, "to h2 again")
    assert slow == pytest.approx(2e6 / 0.2e9)
    assert fast == pytest.approx(2e6 / 1e9 + 2e6 / 1e9)        # after h0's NIC has sent the first at 1 GB/s
    assert again == pytest.approx(2 * 2e6 / 0.2e9)             # h2's receive side (0.2 GB/s) serialises


def test_a_link_slower_than_both_nics_is_a_resource_of_its_own():
    """Three hosts with 1 GB/s NICs, h0 -> h2 at 0.2 GB/s: that pair gets a link resource; a second transfer
    on it waits for the first's whole time, a transfer h0 -> h1 beside them does not; both kernels agree."""
    from tag.sim.routing import Routing
    from tag.sim.schedule import StepSchedule
    from tag.sim.task_graph import TaskGraph
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)
    topo = _hosts(3, inter_bandwidth=1e9, inter_latency=0.0, host_links={("h0", "h2"): (0.2e9, 0.0)})
    tasks = TaskGraph(tg, group_ops(tg, target_groups=2))
    routing = Routing(topo, CostModel(tg, topo), tasks)
    assert [n for n in routing.resource_names if n.endswith(" link")] == ["h0 -> h2 link", "h2 -> h0 link"]
    sched = StepSchedule(tasks, routing, [], {}, 1, {}, ["a", "b"], None)
    first = sched._transfer(0, 2, 2e6, 0.0, "to h2")
    beside = sched._transfer(0, 1, 2e6, 0.0, "to h1")
    second = sched._transfer(0, 2, 2e6, 0.0, "to h2 again")
    assert first == pytest.approx(2e6 / 0.2e9)
    assert beside == pytest.approx(2 * 2e6 / 1e9)
    assert second == pytest.approx(2 * 2e6 / 0.2e9)
    # whole steps: a chain over the three hosts, the compiled kernel equal to the reference bit for bit
    tg3 = chain_graph([1e9, 1e9, 1e9], batch=4, act_bytes_pe=1e6)
    gr = group_ops(tg3, target_groups=3)
    s = Strategy(gr, [Action((0, 1, 2), "partition")] * 3, partition={i: i % 3 for i in range(len(tg3.ops))})
    s2 = Strategy(gr, [Action((0,), "allreduce"), Action((2,), "allreduce"), Action((1,), "allreduce")])
    for strat in (s, s2):
        ref = Simulator(tg3, topo, gr, CostModel(tg3, topo, EXACT), kernel="python").evaluate(strat).step_time
        fast = Simulator(tg3, topo, gr, CostModel(tg3, topo, EXACT), kernel="compiled").evaluate(strat).step_time
        assert ref == fast and ref > 0


def test_trace_shows_the_transfer_on_the_network_rows():
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-4)
    sim, gr = _sim(tg, topo)
    tr = sim.trace(Strategy(gr, [Action((0, 1), "partition")] * 2, partition={0: 0, 1: 1}))
    comm = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert sorted(e["tid"] for e in comm) == [2, 5]        # h0's network send side, h1's receive side
    assert all(e["args"]["bytes"] == 4e6 and e["ts"] == pytest.approx(1e3) for e in comm)


def test_bad_strategies():
    tg = mlp_graph(batch=4, widths=(16, 32, 4))
    topo = _hosts(2)
    sim, gr = _sim(tg, topo)
    g = gr.num_groups
    with pytest.raises(StrategyError, match="has no device"):
        sim.evaluate(_all(gr, Action((0,), "partition"), partition={0: 0}))
    with pytest.raises(StrategyError, match="outside the group's placement"):
        sim.evaluate(_all(gr, Action((0,), "partition"), partition={i: 1 for i in range(len(tg.ops))}))
    with pytest.raises(StrategyError, match="device group 5"):
        sim.evaluate(_all(gr, Action((5,), "allreduce")))
    with pytest.raises(StrategyError, match="ps_device"):
        sim.evaluate(_all(gr, Action((0,), "ps", ps_device=9)))
    with pytest.raises(StrategyError, match="smaller than"):
        sim.evaluate(_all(gr, Action((0, 1), "allreduce")), batch_size=1)
    other = Grouping(np.zeros(len(tg.ops), dtype=np.int64), ["all"])
    with pytest.raises(StrategyError, match="grouping"):
        sim.evaluate(Strategy(other, [Action((0,))]))
    with pytest.raises(StrategyError):
        Simulator(tg, topo, Grouping(np.zeros(3, dtype=np.int64), ["x"]))
    assert sim.evaluate(_all(gr, Action((0, 1), "allreduce"))).feasible
    assert g >= 3


# ---------------------------------------------------------------- zoo sanity (real training graphs)
def _fast_links(topo):
    """The same cluster with every link between hosts as fast as its best one (bandwidth and latency)."""
    n = len(topo.hosts)
    off = ~np.eye(n, dtype=bool)
    bw_best, lat_best = float(topo.host_bandwidth[off].max()), float(topo.host_latency[off].min())
    hbw, hlat = topo.host_bandwidth.copy(), topo.host_latency.copy()
    hbw[off], hlat[off] = bw_best, lat_best
    bw, lat = topo.bandwidth.copy(), topo.latency.copy()
    hidx = np.array([d.host_index for d in topo.devices])
    cross = hidx[:, None] != hidx[None, :]
    bw[cross], lat[cross] = bw_best, lat_best
    return dataclasses.replace(topo, bandwidth=bw, latency=lat, host_bandwidth=hbw, host_latency=hlat,
                               name=topo.name + "-fast")


@pytest.fixture(scope="module")
def resnet50():
    tag = pytest.importorskip("tag")
    graph = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=64))
    return graph, group_ops(graph, target_groups=100)


@pytest.mark.slow
def test_zoo_resnet50_grouping(resnet50):
    import networkx as nx

    from tag.strategy.grouping import nominal_op_cost, op_stages
    graph, gr = resnet50
    assert 80 <= gr.num_groups <= 100
    cost = nominal_op_cost(graph)
    share = np.bincount(gr.group_of_op, weights=cost) / cost.sum()
    assert share.max() < 0.1
    stage = op_stages(graph)
    dg = nx.DiGraph()
    for e in graph.edges:
        a, b = (gr.group_of_op[e.src], stage[e.src]), (gr.group_of_op[e.dst], stage[e.dst])
        if a != b:
            dg.add_edge(a, b)
    assert nx.is_directed_acyclic_graph(dg)


@pytest.mark.slow
def test_zoo_dp_beats_single_device_on_8_equal_gpus(resnet50):
    import tag
    graph, gr = resnet50
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    sim = Simulator(graph, topo, gr)
    dp = sim.evaluate(_all(gr, Action((0,), "allreduce")))
    single = sim.evaluate(_all(gr, Action((0,), "partition"), partition={i: 0 for i in range(len(graph.ops))}))
    assert dp.feasible and single.feasible
    assert dp.step_time < single.step_time / 3
    assert np.allclose(dp.utilisation, dp.utilisation[0])
    assert single.utilisation[0] > 0.9 and np.all(single.utilisation[1:] == 0)


@pytest.mark.slow
def test_zoo_slow_link_hurts_data_parallelism(resnet50):
    import tag
    graph, gr = resnet50
    slow = tag.load_topology("topologies/cloud-slow-link.pbtxt")
    fast = _fast_links(slow)
    everywhere = Action(tuple(range(len(slow.groups))), "allreduce")
    t_slow = Simulator(graph, slow, gr).evaluate(_all(gr, everywhere)).step_time
    t_fast = Simulator(graph, fast, gr).evaluate(_all(gr, everywhere)).step_time
    assert t_slow > 2 * t_fast
    # leaving the host behind the slow link out is better than including it
    no_t4 = Action(tuple(g.index for g in slow.groups if g.host != "t4-remote"), "allreduce")
    assert Simulator(graph, slow, gr).evaluate(_all(gr, no_t4)).step_time < t_slow


def test_network_profile_adds_step_overhead():
    from tag.cost.model import NetworkProfile
    tg = chain_graph([1e9, 2e9, 3e9])
    topo = _hosts(1)
    prof = dataclasses.replace(EXACT, network=NetworkProfile(step_overhead_s=0.5e-3))
    sim, gr = _sim(tg, topo, prof)
    assert sim.evaluate(_all(gr, Action((0,), "allreduce"))).step_time == pytest.approx(6.5e-3)


def test_per_tensor_cost_is_charged_per_tensor_between_hosts():
    """NetworkProfile.per_tensor_s: a transfer between hosts pays it per tensor on the link; on one host nothing."""
    from tag.cost.model import NetworkProfile
    tg = chain_graph([1e9, 2e9], batch=4, act_bytes_pe=1e6)     # one tensor from layer0 to layer1
    topo = _hosts(2, inter_bandwidth=1e9, inter_latency=1e-4)
    base = dataclasses.replace(EXACT, network=NetworkProfile())
    charged = dataclasses.replace(EXACT, network=NetworkProfile(per_tensor_s=2e-3))
    split = None
    times = []
    for prof in (base, charged):
        sim, gr = _sim(tg, topo, prof)
        split = Strategy(gr, [Action((0,), "allreduce"), Action((1,), "allreduce")])
        times.append(sim.evaluate(split).step_time)
    assert times[1] == pytest.approx(times[0] + 2e-3)
    sim, gr = _sim(tg, topo, charged)
    # both groups on one host: no tensor crosses, nothing charged
    assert sim.evaluate(_all(gr, Action((0,), "allreduce"))).step_time == pytest.approx(3e-3)


def test_per_tensor_cost_of_parameter_server_grows_with_variables_and_remote_workers():
    from tag.cost.model import NetworkProfile
    tg = mlp_graph(batch=8, widths=(16, 32, 32, 4))
    topo = _hosts(3, inter_bandwidth=1e12, inter_latency=0.0)
    grouping = Grouping(np.zeros(len(tg.ops), dtype=np.int64), ["all"])
    n_vars = sum(1 for v in tg.variables if v.kind == "trainable")
    ps = Strategy(grouping, [Action((0, 1, 2), "ps", ps_device=0)])
    got = []
    for pt in (0.0, 1e-3):
        prof = dataclasses.replace(FREE, network=NetworkProfile(per_tensor_s=pt))
        got.append(Simulator(tg, topo, grouping, CostModel(tg, topo, prof)).evaluate(ps).step_time)
    # pull and push, each: every variable for each of the 2 workers on other hosts
    assert got[1] - got[0] == pytest.approx(2 * 2 * n_vars * 1e-3, rel=0.05)


def test_allreduce_is_charged_as_the_deployed_flat_ring():
    """Hosts with several devices: the cost model's hierarchical all-reduce would be cheaper, but the
    rewriter emits one flat ring collective, so the simulator charges the ring (and lists it)."""
    topo = make_topology([("h0", [("GPU-A", 4)]), ("h1", [("GPU-A", 4)])], inter_bandwidth=1e9)
    tg = mlp_graph(batch=64, widths=(256, 512, 512, 8))
    grouping = Grouping(np.zeros(len(tg.ops), dtype=np.int64), ["all"])
    cost = CostModel(tg, topo)
    sim = Simulator(tg, topo, grouping, cost)
    dp = Strategy(grouping, [Action((0, 1), "allreduce")])
    (ring_a, ring_b), (hier_a, hier_b) = cost.allreduce_coeffs(list(range(8)))
    [c] = sim.collectives(dp)
    W = c["bytes"]
    assert c["kind"] == "allreduce" and c["devices"] == list(range(8)) and W == sim.memory.weight_bytes.sum()
    assert hier_a + hier_b * W < ring_a + ring_b * W
    assert c["end_s"] - c["start_s"] == pytest.approx(ring_a + ring_b * W)
    trace = sim.trace(dp)
    assert trace["otherData"]["collectives"][0]["kind"] == "allreduce"


def _four_host_sims(tg):
    """Both simulator kernels of TG on four hosts (free compute), and dp_allreduce / ps over all four."""
    topo = _hosts(4, inter_bandwidth=1e9, inter_latency=1e-5)
    sims = {k: Simulator(tg, topo, group_ops(tg, 16), CostModel(tg, topo, FREE), kernel=k)
            for k in ("compiled", "python")}
    gr = sims["python"].grouping
    return sims, _all(gr, Action((0, 1, 2, 3), "allreduce")), _all(gr, Action((0, 1, 2, 3), "ps", ps_device=0))


def test_sparse_embedding_gradients_move_as_rows():
    """An embedding's IndexedSlices gradient is not all-reduced or pushed as its whole table: allreduce
    charges an all-gather of the batch's rows (half their bytes in the ring formula), ps each worker's share;
    the compiled kernel and the Python reference agree."""
    from tag.frontend import analyze
    from tag.sim.memory import sparse_gradient_bytes
    from tag_bench.mwms import SEQ_LEN, tf1_graph
    batch, width, vocab = 8, 16, 4096
    tg = analyze(tf1_graph("transformer", batch, width=width, depth=1, vocab=vocab))
    table = next(v for v in tg.variables if v.kind == "trainable" and len(v.shape) == 2 and v.shape[0] == vocab)
    rows = SEQ_LEN * width * 4 + SEQ_LEN * 4                       # float32 rows and their int32 indices
    assert sparse_gradient_bytes(tg, table) == pytest.approx(rows)
    assert all(sparse_gradient_bytes(tg, v) == 0 for v in tg.variables if v.kind == "trainable" and v is not table)
    weights = sum(v.nbytes for v in tg.variables if v.kind == "trainable")
    dense = weights - table.nbytes
    sims, dp, ps = _four_host_sims(tg)
    for sim in sims.values():
        assert sim.memory.sparse_weight_bytes.sum() == table.nbytes
        assert sim.evaluate(dp).comm_bytes == pytest.approx(2 * 3 * (dense + batch * rows / 2))
        assert sim.evaluate(ps).comm_bytes == pytest.approx(2 * 3 * (dense + batch * rows / 4))
    # far less than the table's all-reduce, and the same step on both kernels
    assert sims["python"].evaluate(dp).comm_bytes < 2 * 3 * weights / 2
    for s in (dp, ps):
        assert sims["compiled"].evaluate(s).step_time == pytest.approx(sims["python"].evaluate(s).step_time,
                                                                      rel=1e-9)


def test_sparse_gradients_outweighing_their_table_are_all_reduced_as_the_table():
    """A small vocabulary: the batch's embedding rows outweigh twice the table, so an allreduce group over
    several devices is charged the dense table plus the gathered indices (as the rewriter deploys it,
    ``tag.strategy.sparse``); ps still moves rows; both kernels agree."""
    from tag.frontend import analyze
    from tag.strategy.sparse import dense_sum_pays, sparse_dedups
    from tag_bench.mwms import SEQ_LEN, tf1_graph
    batch, width, vocab = 8, 16, 64
    tg = analyze(tf1_graph("transformer", batch, width=width, depth=1, vocab=vocab))
    table = next(v for v in tg.variables if v.kind == "trainable" and len(v.shape) == 2 and v.shape[0] == vocab)
    [found] = sparse_dedups(tg).values()
    assert found.variable == table.name and found.rows == vocab
    assert found.values_bytes_per_example == SEQ_LEN * width * 4
    assert dense_sum_pays(found.values_bytes_per_example, table.nbytes, batch)
    assert not dense_sum_pays(found.values_bytes_per_example, table.nbytes, 4)
    rows = SEQ_LEN * width * 4 + SEQ_LEN * 4
    weights = sum(v.nbytes for v in tg.variables if v.kind == "trainable")
    sims, dp, ps = _four_host_sims(tg)
    for sim in sims.values():
        assert sim.evaluate(dp).comm_bytes == pytest.approx(2 * 3 * (weights + batch * SEQ_LEN * 4 / 2))
        assert sim.evaluate(ps).comm_bytes == pytest.approx(2 * 3 * (weights - table.nbytes + batch * rows / 4))
        # at 4 examples the rows weigh exactly twice the table, no more: gathered as rows
        assert sim.evaluate(dp, batch_size=4).comm_bytes == pytest.approx(
            2 * 3 * (weights - table.nbytes + 4 * rows / 2))
    for s in (dp, ps):
        assert sims["compiled"].evaluate(s).step_time == pytest.approx(sims["python"].evaluate(s).step_time,
                                                                      rel=1e-9)


def test_hosts_that_share_one_machine_cost_busy_steps_with_the_levels_timed_under_load():
    tg = chain_graph([1e9, 2e9, 3e9], batch=6)
    topo = _hosts(3, inter_bandwidth=1e12, inter_latency=0.0)
    loaded = dataclasses.replace(EXACT.devices["GPU-A"], family_scale={"conv": 2.0, "matmul": 2.0, "other": 2.0})
    shared = Profile(dict(EXACT.devices), devices_under_load={"GPU-A": loaded})
    alone_sim, gr = _sim(tg, topo)
    shared_sim, _ = _sim(tg, topo, shared)
    one = _all(gr, Action((0,), "allreduce"))
    # one host busy: the other hosts idle, the step as timed alone
    assert shared_sim.evaluate(one).step_time == pytest.approx(alone_sim.evaluate(one).step_time)
    # every host busy all step: the step at the loaded levels (twice the compute)
    dp = _all(gr, Action((0, 1, 2), "allreduce"))
    alone = alone_sim.evaluate(dp)
    assert alone_sim.other_hosts_busy(alone) == pytest.approx(1.0, abs=0.02)
    assert shared_sim.evaluate(dp).step_time == pytest.approx(2 * alone.step_time, rel=0.03)
    # a stage per host: each host busy a part of the step, the step between the two by that part
    stages = Strategy(gr, [Action((min(g, 2),), "allreduce") for g in range(gr.num_groups)])
    part = alone_sim.evaluate(stages)
    busy = alone_sim.other_hosts_busy(part)
    assert 0.0 < busy < 1.0
    assert shared_sim.evaluate(stages).step_time == pytest.approx(part.step_time * (1 + busy), rel=0.03)
