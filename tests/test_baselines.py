"""Built-in strategies (tag.strategy.baselines) and the strategy protobuf round trip."""
from __future__ import annotations

import dataclasses
import filecmp
import os
import subprocess
import sys

import numpy as np
import pytest

from tag.cluster.topology import Device, DeviceGroup, Host, Topology
from tag.errors import StrategyError
from tag.ir.types import Edge, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo
from tag.strategy.baselines import (
    BUILTIN_STRATEGIES,
    best_connected_device,
    builtin_strategy,
    fastest_device,
    group_order,
    topological_op_order,
)
from tag.strategy.types import Action, Grouping, Strategy

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_topology(spec: list[tuple[str, str, int, float]], intra_bw: float = 100 * GB,
                  inter_bw: dict | float = 1 * GB) -> Topology:
    """SPEC: (host, device type, count, peak FLOP/s) per device group, hosts in order of first mention."""
    host_names: list[str] = []
    for h, *_ in spec:
        if h not in host_names:
            host_names.append(h)
    hosts = [Host(h, "127.0.0.1", 20000 + i, i, intra_bw, 1e-6) for i, h in enumerate(host_names)]
    groups, devices = [], []
    local_count: dict[str, int] = {}
    for gi, (h, dtype, count, flops) in enumerate(spec):
        idx = []
        for _ in range(count):
            d = len(devices)
            local = local_count.get(h, 0)
            local_count[h] = local + 1
            devices.append(Device(d, f"{h}/{dtype}:{local}", h, host_names.index(h), gi, "GPU", local, dtype,
                                  16 * 2**30, flops, 900 * GB))
            idx.append(d)
        groups.append(DeviceGroup(gi, f"{h}/{dtype}", h, dtype, "GPU", tuple(idx), 16 * 2**30, flops, 900 * GB))
    n, nh = len(devices), len(hosts)
    hbw = np.full((nh, nh), np.inf)
    for a in range(nh):
        for b in range(nh):
            if a != b:
                hbw[a, b] = inter_bw if isinstance(inter_bw, float) else inter_bw.get(frozenset((a, b)), 1 * GB)
    bw = np.empty((n, n))
    for i, di in enumerate(devices):
        for j, dj in enumerate(devices):
            bw[i, j] = np.inf if i == j else (intra_bw if di.host_index == dj.host_index
                                              else hbw[di.host_index, dj.host_index])
    lat = np.where(np.isinf(bw), 0.0, 1e-6)
    return Topology("test", "test.pbtxt", hosts, groups, devices, bw, lat, hbw, np.zeros((nh, nh)))


def chain_graph(n: int, flops: float = 1e9, act_bytes: float = 1000.0) -> TrainingGraph:
    """A chain op0 -> op1 -> ... -> op(n-1); each op FLOPS at the batch of 10, edges ACT_BYTES per example."""
    ops, edges = [], []
    for i in range(n):
        ops.append(OpInfo(f"op{i}", "MatMul", "", "forward", [f"op{i-1}:0"] if i else [], [],
                          [TensorInfo(f"op{i}:0", "float32", (10, 4), 0, Linear(0, act_bytes))],
                          Linear(0, flops / 10), Linear(0, 0)))
        if i:
            edges.append(Edge(i - 1, i, f"op{i-1}:0", Linear(0, act_bytes)))
    return TrainingGraph(ops, edges, [], [], 10, ["op0"], [])


class FlopCostModel:
    """A hand-computable stand-in cost model for the DP tests: op time = FLOPs / device peak."""

    def __init__(self, graph: TrainingGraph, topology: Topology):
        self.graph, self.topology = graph, topology

    def op_times(self, device_group, batch):
        return np.array([op.flops.at(batch) for op in self.graph.ops]) / self.topology.groups[device_group].peak_flops


def test_unknown_name_lists_known():
    tg, topo = chain_graph(3), make_topology([("h0", "V100", 2, 1e12)])
    with pytest.raises(StrategyError, match="dp_allreduce, ps, single, partition"):
        builtin_strategy("horovod", tg, topo, Grouping(np.arange(3), ["a", "b", "c"]))


def test_dp_and_ps_replicate_everywhere():
    topo = make_topology([("h0", "V100", 2, 15e12), ("h1", "P100", 1, 9e12), ("h2", "P100", 1, 9e12)],
                         intra_bw=2 * GB, inter_bw={frozenset((0, 1)): 10 * GB, frozenset((0, 2)): 1 * GB,
                                                    frozenset((1, 2)): 10 * GB})
    tg = chain_graph(4)
    grouping = Grouping(np.array([0, 0, 1, 1]), ["a", "b"])
    dp = builtin_strategy("dp_allreduce", tg, topo, grouping)
    assert all(a == Action((0, 1, 2), "allreduce") for a in dp.actions) and dp.name == "dp_allreduce"
    ps = builtin_strategy("ps", tg, topo, grouping)
    # device 2 (h1) has 10 GB/s to each of the 3 others (30 GB/s); devices 0 and 1: 2 + 10 + 1 = 13 GB/s
    assert best_connected_device(topo) == 2
    assert all(a.mode == "ps" and a.ps_device == 2 and a.placement == (0, 1, 2) for a in ps.actions)


def test_ps_tie_goes_to_lowest_index():
    topo = make_topology([("h0", "V100", 1, 1e12), ("h1", "V100", 1, 1e12), ("h2", "V100", 1, 1e12)])
    assert best_connected_device(topo) == 0


def test_single_is_one_device_of_a_multi_device_group():
    topo = make_topology([("h0", "P100", 2, 9e12), ("h1", "V100", 4, 15e12), ("h2", "V100", 1, 15e12)])
    tg = chain_graph(5)
    grouping = Grouping(np.array([0, 1, 1, 2, 2]), ["a", "b", "c"])
    s = builtin_strategy("single", tg, topo, grouping)
    assert fastest_device(topo) == 2                      # the first V100 (group 1 holds devices 2..5)
    assert all(a == Action((1,), "partition") for a in s.actions)
    assert s.partition == {i: 2 for i in range(5)}


def test_partition_balances_equal_devices_on_a_chain():
    topo = make_topology([("h0", "V100", 4, 1e12)])
    tg = chain_graph(8)
    grouping = Grouping(np.arange(8), [f"g{i}" for i in range(8)])
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    devs = [s.partition[i] for i in range(8)]
    assert devs == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(a.mode == "partition" and a.placement == (0,) for a in s.actions)


def test_partition_gives_faster_devices_more_work():
    # device 0 is 3x faster than device 1: 8 equal groups split 6 / 2
    topo = make_topology([("h0", "A", 1, 3e12), ("h0", "B", 1, 1e12)])
    tg = chain_graph(8)
    grouping = Grouping(np.arange(8), [f"g{i}" for i in range(8)])
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    assert [s.partition[i] for i in range(8)] == [0] * 6 + [1] * 2


def test_partition_prefers_cheap_cuts():
    # 4 equal ops on 2 equal devices; the tensor after op0 is tiny, the others are big, and the link
    # is slow enough that moving a big tensor costs more than an extra op of compute.
    tg = chain_graph(4, flops=1e9)
    tg.edges[0].nbytes = Linear(0, 1.0)          # op0 -> op1: 10 bytes at batch 10
    for e in tg.edges[1:]:
        e.nbytes = Linear(0, 1e8)                # 1 GB at batch 10
    topo = make_topology([("h0", "V", 1, 1e12), ("h1", "V", 1, 1e12)], inter_bw=1 * GB)
    grouping = Grouping(np.arange(4), ["a", "b", "c", "d"])
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    assert [s.partition[i] for i in range(4)] == [0, 1, 1, 1]


def test_partition_respects_device_memory():
    # 4 equal ops on 4 equal devices would go 1 per device; on 2 devices 2 per device. Here device 0 has
    # room for the weights of one op only, so it takes op0 and device 1 the other three.
    topo = make_topology([("h0", "V", 1, 1e12), ("h0", "W", 1, 1e12)], intra_bw=1e15)
    topo.devices[0] = dataclasses.replace(topo.devices[0], memory_bytes=3 * 2**30)
    tg = chain_graph(4, act_bytes=0.0)
    tg.variables = [VariableInfo(f"w{i}", i, (2**28,), "float32", 2**30, "trainable") for i in range(4)]
    grouping = Grouping(np.arange(4), ["a", "b", "c", "d"])
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    assert [s.partition[i] for i in range(4)] == [0, 1, 1, 1]
    # when nothing fits, time alone decides
    topo.devices[1] = dataclasses.replace(topo.devices[1], memory_bytes=2**30)
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    assert [s.partition[i] for i in range(4)] == [0, 0, 1, 1]


def test_partition_keeps_colocation_sets_together():
    topo = make_topology([("h0", "V100", 4, 1e12)])
    tg = chain_graph(8)
    tg.colocation = [["op1", "op6"]]             # a grouping that split a set: op6 follows op1
    grouping = Grouping(np.arange(8), [f"g{i}" for i in range(8)])
    s = builtin_strategy("partition", tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
    assert s.partition[1] == s.partition[6] == 0


def test_group_order_is_topological():
    tg = chain_graph(5)
    # reverse the op list order relation: groups numbered against the data flow
    grouping = Grouping(np.array([2, 2, 1, 0, 0]), ["late", "mid", "early"])
    assert list(topological_op_order(tg)) == [0, 1, 2, 3, 4]
    assert list(group_order(tg, grouping)) == [2, 1, 0]


def test_every_builtin_round_trips_through_proto_and_json():
    topo = make_topology([("h0", "V100", 2, 15e12), ("h1", "P100", 2, 9e12)])
    tg = chain_graph(6)
    grouping = Grouping(np.array([0, 0, 1, 1, 2, 2]), ["a", "b", "c"])
    for name in BUILTIN_STRATEGIES:
        s = builtin_strategy(name, tg, topo, grouping, cost_model=FlopCostModel(tg, topo))
        msg = s.to_proto()
        t = Strategy.from_proto(msg.SerializeToString())
        assert t.actions == s.actions and t.partition == s.partition and t.name == name
        assert list(t.grouping.group_of_op) == list(grouping.group_of_op) and t.grouping.names == grouping.names
        assert Strategy.from_json(s.to_json()).actions == s.actions


def test_proto_round_trip_keeps_ps_device_zero_and_sfb():
    from tag._proto import strategy_pb2
    g = Grouping(np.array([0, 1, 1]), ["x", "y"])
    s = Strategy(g, [Action((0,), "ps", ps_device=0), Action((0, 1), "partition")], partition={1: 3, 2: 0},
                 sfb=["dense/kernel"], name="mixed")
    msg = s.to_proto()
    assert msg.actions[0].mode == strategy_pb2.PS and msg.actions[0].HasField("ps_device")
    assert not msg.actions[1].HasField("ps_device") and msg.actions[1].mode == strategy_pb2.PARTITION
    t = Strategy.from_proto(msg)
    assert t.actions[0].ps_device == 0 and t.actions[1].ps_device is None
    assert t.partition == {1: 3, 2: 0} and t.sfb == ["dense/kernel"]


def test_proto_rejects_unspecified_mode_and_garbage():
    from tag._proto import strategy_pb2
    msg = strategy_pb2.Strategy()
    msg.grouping.group_of_op.extend([0])
    msg.grouping.names.append("a")
    msg.actions.add(placement=[0])               # mode left at MODE_UNSPECIFIED
    with pytest.raises(StrategyError, match="unspecified"):
        Strategy.from_proto(msg)
    with pytest.raises(StrategyError):
        Strategy.from_proto(b"\xff\xff\xff garbage")


def test_generated_strategy_module_matches_the_proto(tmp_path):
    # protoc runs in its own process: in a process that has loaded TensorFlow it crashes
    import grpc_tools

    from tag._proto import strategy_pb2
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"-I{include}",
                             f"--python_out={tmp_path}", "strategy.proto"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert filecmp.cmp(tmp_path / "strategy_pb2.py", strategy_pb2.__file__, shallow=False), (
        "tag/_proto/strategy_pb2.py is stale: run `pip install -e . --no-deps` to regenerate it")


# ---------------------------------------------------------------- zoo graphs on the ready topologies


@pytest.fixture(scope="module", params=["zoo:mlp", "zoo:bert_base,num_layers=2,seq_len=16"])
def zoo_case(request):
    from tag import zoo
    from tag.frontend.analyze import analyze
    from tag.strategy.grouping import group_ops
    _, gd = zoo.resolve_model(request.param, 16)
    tg = analyze(gd)
    return tg, group_ops(tg, target_groups=16)


@pytest.mark.parametrize("topo_file", ["lab-v100-1080ti.pbtxt", "fabric-64x8.pbtxt"])
def test_builtins_on_zoo_graphs(zoo_case, topo_file):
    from tag.cluster.topology import load_topology
    from tag.cost.model import CostModel
    tg, grouping = zoo_case
    topo = load_topology(os.path.join(ROOT, "topologies", topo_file))
    cm = CostModel(tg, topo)
    everything = tuple(range(len(topo.groups)))
    for name in BUILTIN_STRATEGIES:
        s = builtin_strategy(name, tg, topo, grouping, cost_model=cm)
        assert s.name == name and len(s.actions) == grouping.num_groups
        if name in ("dp_allreduce", "ps"):
            assert all(a.placement == everything for a in s.actions) and not s.partition
            continue
        assert set(s.partition) == set(range(len(tg.ops)))
        devs = np.array([s.partition[i] for i in range(len(tg.ops))])
        assert devs.min() >= 0 and devs.max() < topo.num_devices
        for a in s.actions:
            assert a.mode == "partition"
            allowed = {d for g in a.placement for d in topo.groups[g].devices}
            assert set(devs[np.flatnonzero(grouping.group_of_op == s.actions.index(a))]) <= allowed
        index = tg.op_index
        for names in tg.colocation:      # colocation sets never split
            assert len({devs[index[n]] for n in names if n in index}) <= 1
        if name == "single":
            assert len(set(devs)) == 1 and topo.devices[devs[0]].peak_flops == max(d.peak_flops for d in topo.devices)
        else:
            assert len(set(devs)) > 1
            # stages follow the groups' step order: the device of a layer (the group's forward compute
            # ops) never goes back. (Small update-only groups can be pulled to device 0 by colocation:
            # Adam's beta powers are colocated with the first variable.)
            from tag.cost.model import ZERO_COST_TYPES
            layer_devs = []
            for g in group_order(tg, grouping):
                fwd = [i for i in grouping.members(g)
                       if tg.ops[i].phase == "forward" and tg.ops[i].type not in ZERO_COST_TYPES]
                if fwd:
                    layer_devs.append(int(np.bincount(devs[fwd]).argmax()))
            assert len(layer_devs) >= 2 and layer_devs == sorted(layer_devs)
