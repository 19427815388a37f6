"""Sufficient-factor broadcasting: what is predicted is what runs, the MILP selection, and exactness.

Fast tests: the simulator charges SFB; the MILP equals brute force on small instances; the collectives of
rewritten graphs (kind, members, payload bytes) are exactly those the simulator lists, for plain, mixed,
multi-device-host and SFB strategies. Slow tests (TF servers): updated weights with and without SFB agree
within 1e-5 (relative) for an MLP, a VGG19-like classifier head and a transformer feed-forward block.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from helpers import in_process_servers, train_copies  # noqa: E402
from tag import zoo  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.compress import eligible_gradients, select_sfb  # noqa: E402
from tag.compress.selection import SfbProblem, brute_force, solve  # noqa: E402
from tag.sim.simulator import Simulator  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402

tf1 = tf.compat.v1
RTOL = 1e-5
STEPS = 3


# ------------------------------------------------------------------------------------------------ models
def dense_head(batch: int = 8):
    """A small VGG19-like classifier head: flattened features -> fc1 -> fc2 -> predictions (Momentum)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, 2, 2, 8], name="input")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        h = tf.reshape(x, [batch, 32], name="flatten")
        for i, width in enumerate((24, 24)):
            w = tf1.get_variable(f"fc{i + 1}/kernel", [h.shape[1], width],
                                 initializer=tf1.glorot_uniform_initializer(seed=i))
            b = tf1.get_variable(f"fc{i + 1}/bias", [width], initializer=tf1.zeros_initializer())
            h = tf.nn.relu(tf.matmul(h, w) + b)
        w = tf1.get_variable("predictions/kernel", [24, 5], initializer=tf1.glorot_uniform_initializer(seed=9))
        logits = tf.matmul(h, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tf1.train.MomentumOptimizer(0.05, 0.9).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


def feed_forward_block(batch: int = 8, seq: int = 4, d_model: int = 8, d_ff: int = 16):
    """A transformer feed-forward block on [B, S, d]: reshape to [B*S, d], d -> d_ff -> d (+ residual),
    mean over the sequence, a classifier; Adam."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, seq, d_model], name="input")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        flat = tf.reshape(x, [batch * seq, d_model])
        w_in = tf1.get_variable("ffn_in/kernel", [d_model, d_ff], initializer=tf1.glorot_uniform_initializer(seed=1))
        w_out = tf1.get_variable("ffn_out/kernel", [d_ff, d_model],
                                 initializer=tf1.glorot_uniform_initializer(seed=2))
        h = tf.matmul(tf.nn.relu(tf.matmul(flat, w_in)), w_out) + flat
        pooled = tf.reduce_mean(tf.reshape(h, [batch, seq, d_model]), axis=1)
        w_cls = tf1.get_variable("classifier/kernel", [d_model, 3], initializer=tf1.glorot_uniform_initializer(seed=3))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pooled @ w_cls))
        tf1.train.AdamOptimizer(1e-2).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


def mlp():
    return zoo.training_graph("mlp", batch_size=8, hidden=(16, 16))


MODELS = {"mlp": mlp, "vgg19_head": dense_head, "ffn_block": feed_forward_block}


def cpu_topology_text(ports, tflops, per_host: int = 1, bandwidth_gbps: float = 10) -> str:
    """Loopback CPU hosts (PER_HOST devices each), peak TFLOP/s as given (batch shares follow them)."""
    inter = "interconnect { kind: PCIE bandwidth_gbs: 10 latency_us: 5 }" if per_host > 1 else ""
    hosts = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU count: {per_host} '
        f'memory_gib: 2 peak_tflops: {f} memory_bandwidth_gbs: 10 }} {inter} }}'
        for i, (p, f) in enumerate(zip(ports, tflops, strict=True)))
    return f'name: "sfb"\n{hosts}\nfabric {{ bandwidth_gbps: {bandwidth_gbps} latency_us: 50 }}\n'


def cpu_topology(ports, tflops, per_host: int = 1, bandwidth_gbps: float = 10):
    return parse_topology(cpu_topology_text(ports, tflops, per_host, bandwidth_gbps))


def kernels(ir):
    return [f.variable for f in eligible_gradients(ir)]


# ------------------------------------------------------------------------------------------------ simulator
def test_eligible_gradients_follow_the_matmul_orientation():
    ir = tag.analyze(feed_forward_block())
    found = {f.variable: f for f in eligible_gradients(ir)}
    assert set(found) == {"ffn_in/kernel", "ffn_out/kernel", "classifier/kernel"}
    f = found["ffn_in/kernel"]
    assert f.rows_per_example == (4, 4) and f.batch_axes == (0, 0)
    assert f.factor_bytes_per_example == 4 * 4 * (8 + 16) and f.weight_bytes == 8 * 16 * 4
    assert not any(v.endswith("bias") for v in kernels(tag.analyze(dense_head())))


def mlp_dp(topo, batch: int):
    """(ir, simulator, dp_allreduce strategy) of a 512x512 MLP at global batch BATCH on TOPO, 8 groups."""
    ir = tag.analyze(zoo.training_graph("mlp", batch_size=batch, hidden=(512, 512)))
    grouping = group_ops(ir, 8)
    return ir, Simulator(ir, topo, grouping), builtin_strategy("dp_allreduce", ir, topo, grouping)


def test_simulator_charges_sfb():
    """SFB moves fewer bytes at a small per-replica batch, more at a large one; memory grows; the update
    waits for the gather; variables that cannot use SFB are ignored."""
    topo = cpu_topology([1, 2, 3, 4], [0.1] * 4, bandwidth_gbps=0.1)
    for batch, fewer in ((8, True), (4096, False)):
        ir, sim, dp = mlp_dp(topo, batch)
        with_sfb = dataclasses.replace(dp, sfb=kernels(ir))
        r0, r1 = sim.evaluate(dp), sim.evaluate(with_sfb)
        assert (r1.comm_bytes < r0.comm_bytes) == fewer and r1.step_time != r0.step_time
        assert np.all(r1.peak_memory > r0.peak_memory)
        kinds = Counter(c["kind"] for c in sim.collectives(with_sfb))
        assert kinds["allgather"] == 3
    single = builtin_strategy("single", ir, topo, sim.grouping)
    assert sim.evaluate(dataclasses.replace(single, sfb=kernels(ir))).step_time == sim.evaluate(single).step_time


# ------------------------------------------------------------------------------------------------ selection
def random_problem(rng, n):
    devices = 3
    item_devices = [sorted(rng.choice(devices, size=rng.randint(2, devices + 1), replace=False).tolist())
                    for _ in range(n)]
    groups, at = [], 0
    while at < n:
        k = rng.randint(1, 3)
        if rng.rand() < 0.6:
            groups.append(list(range(at, min(n, at + k))))
        at += k
    return SfbProblem([f"v{i}" for i in range(n)], rng.randn(n), rng.uniform(1, 10, n), item_devices,
                      rng.randn(n), groups, rng.uniform(0, 1.5, len(groups)), rng.uniform(0, 25, devices))


def test_milp_equals_brute_force_on_small_instances():
    rng = np.random.RandomState(0)
    for trial in range(60):
        p = random_problem(rng, rng.randint(1, 9))
        got, best = solve(p), brute_force(p)
        assert p.fits(got), trial
        assert p.value(got) == pytest.approx(p.value(best), abs=1e-9), trial


def test_selection_pays_only_where_the_simulator_agrees():
    topo = cpu_topology([1, 2, 3, 4], [0.1] * 4, bandwidth_gbps=0.1)
    for batch, expect in ((8, True), (4096, False)):
        ir, sim, dp = mlp_dp(topo, batch)
        chosen = select_sfb(sim, dp)
        assert bool(chosen.chosen) == expect
        assert chosen.step_time <= chosen.base_step_time
        p = chosen.problem
        assert p.value(solve(p)) == pytest.approx(p.value(brute_force(p)), abs=1e-12)
        if expect:
            assert chosen.bytes_saved > 0 and chosen.strategy.sfb == chosen.chosen
            assert sim.evaluate(chosen.strategy).step_time == pytest.approx(chosen.step_time)


def test_optimize_reports_sfb_and_no_sfb_turns_it_off():
    topo = cpu_topology([1, 2, 3, 4], [0.01] * 4, bandwidth_gbps=1)
    gd = zoo.training_graph("mlp", batch_size=32, hidden=(1024, 1024))
    # per-group plans only: on these 1 Gbit/s hosts a pipeline is predicted faster than any per-group plan
    plan = tag.optimize(gd, topo, playouts=4, groups=8, pipeline=False)
    r = plan.report()
    assert r["sfb_gradients"] == list(plan.strategy.sfb) and r["sfb_gradients"]
    assert r["sfb_bytes_saved"] > 0
    assert r["baselines"]["without_sfb"] > r["predicted_step_time_s"]
    off = tag.optimize(gd, topo, playouts=4, groups=8, sfb=False, pipeline=False).report()
    assert off["sfb_gradients"] == [] and off["predicted_step_time_s"] >= r["predicted_step_time_s"]


def test_deploy_no_sfb_flag(tmp_path, capsys):
    from tag.cli.deploy import main
    topo = tmp_path / "t.pbtxt"
    topo.write_text(cpu_topology_text([1, 2, 3, 4], [0.01] * 4, bandwidth_gbps=1))
    args = ["--topo", str(topo), "--model", "zoo:mlp,hidden=1024x1024", "--batch", "32", "--playouts", "4",
            "--groups", "8", "--no-pipeline"]      # per-group plans (a pipeline wins on these hosts)
    reports = {}
    for flag in ([], ["--no-sfb"]):
        out = tmp_path / f"r{len(flag)}.json"
        assert main(args + flag + ["--report", str(out)]) == 0, capsys.readouterr().err
        reports[bool(flag)] = json.loads(out.read_text())
    assert reports[False]["sfb_gradients"] and reports[False]["sfb_bytes_saved"] > 0
    assert reports[True]["sfb_gradients"] == [] and reports[True]["sfb_bytes_saved"] == 0


# ------------------------------------------------------------------------------------------------ consistency
def rewritten_collectives(res, topo) -> Counter:
    """(kind, member devices, payload bytes) of every TF collective in a rewritten graph."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(res.graph_def, name="")
    device_index = {topo.tf_device(d): d for d in range(topo.num_devices)}
    by_key: dict[tuple, dict] = {}
    for op in g.get_operations():
        kind = {"CollectiveReduceV2": "allreduce", "CollectiveGatherV2": "allgather"}.get(op.type)
        if kind is None:
            continue
        key = tf.get_static_value(op.inputs[3])
        size = op.inputs[0].shape.num_elements()
        assert size is not None, op.name
        entry = by_key.setdefault((kind, int(key)), {"devices": set(), "bytes": set()})
        entry["devices"].add(device_index[op.device])
        entry["bytes"].add(size * op.inputs[0].dtype.size)
    out = Counter()
    for (kind, _), e in by_key.items():
        assert len(e["bytes"]) == 1
        out[(kind, tuple(sorted(e["devices"])), float(e["bytes"].pop()))] += 1
    return out


def simulated_collectives(sim, strategy) -> Counter:
    return Counter((c["kind"], tuple(sorted(c["devices"])), float(c["bytes"])) for c in sim.collectives(strategy))


def consistency_strategies(ir, topo, grouping):
    everything = tuple(g.index for g in topo.groups)
    dp = builtin_strategy("dp_allreduce", ir, topo, grouping)
    part = builtin_strategy("partition", ir, topo, grouping)
    mixed, partition = [], {}
    for g in range(grouping.num_groups):
        mode = ("allreduce", "ps", "partition", "allreduce")[g % 4]
        if mode == "partition":
            mixed.append(Action(everything, "partition"))
            partition.update({int(i): part.partition[int(i)] for i in grouping.members(g)})
        elif mode == "allreduce" and g % 8 == 3:
            mixed.append(Action(everything[:2], "allreduce"))        # a subset of the devices
        else:
            mixed.append(Action(everything, mode, ps_device=0 if mode == "ps" else None))
    mixed = Strategy(grouping, mixed, partition)
    sfb = kernels(ir)
    return {"dp": dp, "mixed": mixed, "dp+sfb": dataclasses.replace(dp, sfb=sfb),
            "mixed+sfb": dataclasses.replace(mixed, sfb=sfb), "sfb-half": dataclasses.replace(dp, sfb=sfb[::2])}


@pytest.mark.parametrize("per_host", [1, 2], ids=["flat", "multi-device-hosts"])
@pytest.mark.parametrize("name", list(MODELS))
def test_rewritten_collectives_are_those_the_simulator_lists(name, per_host):
    """Kind, members and bytes of every all-reduce and all-gather agree between rewrite and simulator
    (two devices per host: where the cost model's hierarchical all-reduce would have applied)."""
    gd = MODELS[name]()
    ir = tag.analyze(gd)
    hosts = 3 if per_host == 1 else 2
    topo = cpu_topology([23401, 23402, 23403][:hosts], [0.1, 0.05, 0.05][:hosts], per_host)
    grouping = group_ops(ir, 8)
    sim = Simulator(ir, topo, grouping)
    for label, st in consistency_strategies(ir, topo, grouping).items():
        res = rewrite(gd, ir, st, topo)
        want = simulated_collectives(sim, st)
        assert rewritten_collectives(res, topo) == want, label
        if "sfb" in label:
            assert any(k[0] == "allgather" for k in want), label


# ------------------------------------------------------------------------------------------------ exactness
@pytest.fixture(scope="module")
def cluster():
    ports, servers = in_process_servers(3)
    return ports, servers[0].target


def feeds(gd, ir, seed: int = 0):
    nodes = {n.name: n for n in gd.node}
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(STEPS):
        fd = {}
        for name in ir.inputs:
            shape = [d.size for d in nodes[name].attr["shape"].shape.dim]
            if nodes[name].attr["dtype"].type == tf.int32.as_datatype_enum:
                fd[name + ":0"] = rng.randint(0, 3, shape).astype(np.int32)
            else:
                fd[name + ":0"] = rng.randn(*shape).astype(np.float32)
        out.append(fd)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_same_weights_with_and_without_sfb(cluster, name):
    """3 workers, uneven shares (4:2:2 of 8): every eligible kernel by SFB (one CollectiveGatherV2 each)
    gives the weights plain all-reduce gives, within 1e-5 relative, on every replica."""
    ports, target = cluster
    gd = MODELS[name]()
    ir = tag.analyze(gd)
    topo = cpu_topology(ports, [0.1, 0.05, 0.05])
    dp = Strategy(group_ops(ir, 8), [Action((0, 1, 2), "allreduce")] * group_ops(ir, 8).num_groups)
    sfb = kernels(ir)
    assert len(sfb) == 3
    plain = rewrite(gd, ir, dp, topo)
    factored = rewrite(gd, ir, dataclasses.replace(dp, sfb=sfb), topo)
    assert sum(n.op == "CollectiveGatherV2" for n in factored.graph_def.node) == 3 * len(sfb)
    batches = feeds(gd, ir)
    want, got = train_copies(plain, ir, batches), train_copies(factored, ir, batches)
    worst = 0.0
    for step_want, step_got in zip(want, got, strict=True):
        for v in step_want:
            ref = step_want[v][0]
            scale = float(np.max(np.abs(ref))) or 1.0
            for copy in step_got[v]:
                worst = max(worst, float(np.max(np.abs(copy - ref))) / scale)
    assert worst <= RTOL, worst
