"""tag.optimize, tag.Plan (save/load), tag.rewrite: the public entry points end to end on tiny graphs."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from tag.errors import GraphError, MemoryBudgetError, StrategyError, TagError  # noqa: E402
from tiny import TINY_ZOO_OPTIONS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
BUILTINS = {"dp_allreduce", "ps", "single", "partition"}
REPORT_KEYS = {"model", "topology", "devices", "groups", "predicted_step_time_s", "baselines", "speedup_vs_dp",
               "search_seconds", "peak_memory_bytes", "feasible", "sfb_gradients", "sfb_bytes_saved", "method",
               "reference", "strategy", "batch_size", "baselines_feasible", "memory_capacity_bytes",
               "utilisation", "communication_bytes", "oom_devices", "notes"}
BATCH = 12
CPU = 'device {{ type: "CPU" kind: CPU memory_gib: {mem} peak_tflops: {tflops} memory_bandwidth_gbs: 10 }}'


def topology_text(ports, tflops=None, mem=2, name="loop"):
    tflops = tflops or [0.05] * len(ports)
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} {CPU.format(mem=mem, tflops=f)} }}'
                      for i, (p, f) in enumerate(zip(ports, tflops, strict=True)))
    return f'name: "{name}"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n'


def mlp(batch=BATCH, **options):
    return tag.zoo.training_graph("mlp", batch_size=batch, **{**TINY_ZOO_OPTIONS["mlp"], **options})


def user_graph(batch=BATCH):
    """What a new user writes: no names, Adam's minimize, global_variables_initializer."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [batch, 16], name="features")
        y = v1.placeholder(tf.int32, [batch], name="classes")
        h = tf.nn.relu(tf.matmul(x, v1.get_variable("w1", [16, 32])))
        logits = tf.matmul(h, v1.get_variable("w2", [32, 4]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        v1.train.AdamOptimizer(1e-3).minimize(loss)
        v1.global_variables_initializer()
    return g.as_graph_def()


@pytest.fixture(scope="module")
def plan():
    return tag.optimize(mlp(), LOCALHOST, playouts=20, seed=0, name="mlp")


def _bytes(graph_def) -> bytes:
    return graph_def.SerializeToString(deterministic=True)


def _best_feasible(p):
    r = p.report()
    return min(t for n, t in r["baselines"].items() if r["baselines_feasible"][n])


def test_optimize_is_never_slower_than_a_feasible_baseline(plan):
    r = plan.report()
    assert BUILTINS | {"best_uniform", "mcts"} <= set(plan.baselines)
    from helpers import allowed_slack
    for name, t in plan.baselines.items():     # searched strategies replace a built-in only by a margin
        if r["baselines_feasible"][name]:
            assert plan.predicted_step_time <= t * (1 + allowed_slack(name)), name
    builtins = [t for n, t in r["baselines"].items() if n in BUILTINS and r["baselines_feasible"][n]]
    assert plan.predicted_step_time in (pytest.approx(_best_feasible(plan)), pytest.approx(min(builtins)),
                                        pytest.approx(plan.baselines["best_uniform"]))
    assert plan.batch_size == BATCH and plan.topology == "localhost"
    assert {plan.train_op, plan.loss, plan.init} <= {n.name for n in plan.step_graph.node}
    for task, host in enumerate(plan.hosts):          # each host's program holds only that host's devices
        program = plan.program(host)
        assert program is plan.program(task) and program.task == task
        assert all(n.device.startswith(f"/job:worker/task:{task}/") for n in program.graph_def.node), host


def test_report_keys_and_json(plan):
    r = plan.report()
    assert REPORT_KEYS <= set(r)
    text = json.dumps(r, allow_nan=False)
    assert json.loads(text) == r
    assert r["model"] == "mlp" and r["topology"] == "localhost" and r["devices"] == 3 and r["groups"] >= 1
    assert r["predicted_step_time_s"] == pytest.approx(plan.predicted_step_time)
    assert r["speedup_vs_dp"] == pytest.approx(r["baselines"]["dp_allreduce"] / plan.predicted_step_time)
    assert r["speedup_vs_dp"] >= 1.0 - 1e-9
    assert r["sfb_gradients"] == [] and r["sfb_bytes_saved"] == 0 and r["feasible"] is True
    assert set(r["peak_memory_bytes"]) == {"cpu0/CPU:0", "cpu1/CPU:0", "cpu2/CPU:0"}
    assert r["method"] == plan.method and r["reference"] == "dp_allreduce" and r["search_seconds"] > 0
    assert r["entry_points"]["train_op"] == "train_op"
    r["model"] = "changed"
    assert plan.report()["model"] == "mlp"          # report() hands out a copy


def test_save_load_round_trip(plan, tmp_path):
    d = tmp_path / "plan"
    assert plan.save(d) == str(d)
    files = ["graph.pb", "plan.json", "report.json", "strategy.pb", "topology.pbtxt"]
    assert sorted(os.listdir(d)) == files
    meta = json.loads((d / "plan.json").read_text())
    assert meta["format"] == "tag-plan" and meta["version"] == 2 and meta["batch_size"] == BATCH
    assert meta["topology"] == "localhost" and meta["train_op"] == plan.train_op
    assert meta["fingerprint"] == plan.fingerprint and meta["hosts"] == ["cpu0", "cpu1", "cpu2"]
    back = tag.Plan.load(d)
    assert back.strategy.to_dict() == plan.strategy.to_dict() and back.fingerprint == plan.fingerprint
    assert _bytes(back.step_graph) == _bytes(plan.step_graph)
    for host in plan.hosts:                           # every host builds the same program from the files
        assert _bytes(back.program(host).graph_def) == _bytes(plan.program(host).graph_def)
    assert (back.train_op, back.loss, back.init, back.inputs) == (plan.train_op, plan.loss, plan.init, plan.inputs)
    assert back.report() == plan.report() and back.baselines == plan.baselines
    assert back.predicted_step_time == plan.predicted_step_time and back.method == plan.method
    plan.save(d)                                      # overwriting a saved plan is fine
    assert sorted(os.listdir(d)) == files


def test_a_host_not_in_the_plan_and_a_plan_of_several_hosts_have_one_line_errors(plan):
    with pytest.raises(TagError, match=r"host 'gpu9' is not in the plan \(hosts: cpu0, cpu1, cpu2\)"):
        plan.program("gpu9")
    with pytest.raises(TagError, match="host 7 is not in the plan"):
        plan.program(7)
    if len({p.task for p in plan.programs().values() if len(p.graph_def.node) > 2}) > 1:
        with pytest.raises(TagError, match="runs on 3 hosts, each its own program"):
            _ = plan.graph_def


def test_a_plan_on_one_host_is_one_graph():
    one = tag.parse_topology('name: "one"\nhost { name: "solo" address: "127.0.0.1" port: 23999 '
                             'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 '
                             'memory_bandwidth_gbs: 10 } }\n')
    from tag.api import plan_for, prepare
    p = plan_for(prepare(mlp(), one), "single")
    names = {n.name for n in p.graph_def.node}
    assert {p.train_op, p.loss, p.init} <= names and "input" in names   # the whole batch is fed as before


def test_an_earlier_plan_directory_and_changed_files_are_refused_in_one_line(plan, tmp_path):
    d = tmp_path / "plan"
    plan.save(d)
    meta = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**meta, "batch_size": BATCH * 2}))
    with pytest.raises(TagError, match="files changed after the plan was saved"):
        tag.Plan.load(d)
    (d / "plan.json").write_text(json.dumps({**meta, "version": 1}))
    with pytest.raises(TagError, match="saved by an earlier tag .* make and save the plan again"):
        tag.Plan.load(d)


@pytest.mark.parametrize("damage, message", [
    (lambda d: os.remove(d / "graph.pb"), "graph.pb"),
    (lambda d: os.remove(d / "strategy.pb"), "strategy.pb"),
    (lambda d: os.remove(d / "topology.pbtxt"), "topology.pbtxt"),
    (lambda d: (d / "topology.pbtxt").write_text("host { name: "), "topology.pbtxt"),
    (lambda d: (d / "strategy.pb").write_bytes(b"\xff\xff\xff garbage"), "strategy.pb"),
    (lambda d: (d / "graph.pb").write_bytes(b"\xff\xff\xff garbage"), "graph.pb"),
    (lambda d: (d / "plan.json").write_text("{not json"), "plan.json"),
    (lambda d: (d / "plan.json").write_text(json.dumps({"format": "tag-plan", "version": 99})), "version 99"),
    (lambda d: (d / "report.json").write_text("[1, 2"), "report.json"),
    (lambda d: shutil.rmtree(d), "not a plan directory"),
])
def test_load_names_the_bad_file(plan, tmp_path, damage, message):
    d = tmp_path / "plan"
    plan.save(d)
    damage(d)
    with pytest.raises(TagError, match=message.replace(".", r"\.")):
        tag.Plan.load(d)


def test_trace_and_plans_for_given_strategies(plan, tmp_path):
    from tag.api import plan_for, prepare
    trace = plan.trace()
    assert trace and json.dumps(trace)
    with pytest.raises(TagError, match="loaded plan"):
        tag.Plan.load(plan.save(tmp_path / "p")).trace()
    analysis = prepare(mlp(), LOCALHOST, name="mlp")
    ps = plan_for(analysis, "ps")
    assert ps.method == "ps" and ps.predicted_step_time == pytest.approx(ps.baselines["ps"])
    assert set(ps.baselines) == BUILTINS and ps.report()["search_seconds"] == 0
    again = plan_for(analysis, plan.strategy, name="saved")
    assert again.predicted_step_time == pytest.approx(plan.predicted_step_time)
    assert again.report()["strategy"] == "saved" and "saved" in again.baselines


def test_one_device_returns_the_best_baseline_and_says_so():
    one = tag.parse_topology('name: "one"\nhost { name: "solo" address: "127.0.0.1" port: 23999 '
                             'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 '
                             'memory_bandwidth_gbs: 10 } }\n')
    p = tag.optimize(mlp(), one, playouts=10)
    r = p.report()
    assert p.method in BUILTINS
    assert p.predicted_step_time == pytest.approx(min(p.baselines.values()))
    assert any("no searched strategy beat" in n for n in r["notes"]) and r["notes"] == p.notes[:len(r["notes"])]
    assert r["devices"] == 1 and r["speedup_vs_dp"] == pytest.approx(1.0)


def test_nothing_fits_raises_memory_budget_error():
    tiny_memory = tag.parse_topology(topology_text([24001, 24002], mem=0.001))   # 1 MiB per device
    with pytest.raises(MemoryBudgetError) as err:
        tag.optimize(mlp(input_dim=512, hidden=(512, 512)), tiny_memory, playouts=5)
    e = err.value
    assert e.shortfall_bytes > 0 and e.device in {"h0/CPU:0", "h1/CPU:0"} and e.strategy
    assert "no strategy fits in memory" in str(e) and e.device in str(e) and e.strategy in str(e)


def test_user_graph_without_names():
    p = tag.optimize(user_graph(), LOCALHOST, playouts=10)
    r = p.report()
    assert r["entry_points"]["train_op"] == "Adam" and r["entry_points"]["init"] == "init"
    assert r["entry_points"]["loss"] == "Mean"
    names = {n.name for n in p.step_graph.node}
    assert {p.train_op, p.loss, p.init} <= names and set(p.inputs) == {"features", "classes"}


def test_rewrite_accepts_names_strategies_and_saved_files(plan, tmp_path):
    gd = mlp()
    topo = tag.load_topology(LOCALHOST)
    by_name = tag.rewrite(gd, topo, "dp_allreduce")
    assert by_name.train_op == "train_op" and len(by_name.devices) == 3
    d = plan.save(tmp_path / "plan")
    want = _bytes(plan.rewritten.graph_def)
    assert _bytes(tag.rewrite(gd, LOCALHOST, d).graph_def) == want                 # batch from plan.json
    assert _bytes(tag.rewrite(gd, LOCALHOST, os.path.join(d, "strategy.pb"), batch_size=BATCH).graph_def) == want
    assert _bytes(tag.rewrite(gd, LOCALHOST, plan.strategy, batch_size=BATCH).graph_def) == want
    with pytest.raises(StrategyError, match="horovod"):
        tag.rewrite(gd, LOCALHOST, "horovod")
    with pytest.raises(StrategyError, match="ops"):      # made for another graph
        tag.rewrite(user_graph(), LOCALHOST, plan.strategy)


def test_rewrite_of_a_graph_whose_updates_nothing_groups():
    """The made-up step and init NoOps (tag.frontend.entry_points) reach the rewritten graph."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [BATCH, 4], name="x")
        y = v1.placeholder(tf.int32, [BATCH], name="y")
        w1, w2 = v1.get_variable("w1", [4, 6]), v1.get_variable("w2", [6, 3])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        g1, g2 = tf.gradients(loss, [w1, w2])
        tf.raw_ops.ResourceApplyGradientDescent(var=w1.handle, alpha=0.1, delta=g1, name="upd1")
        tf.raw_ops.ResourceApplyGradientDescent(var=w2.handle, alpha=0.1, delta=g2, name="upd2")
    res = tag.rewrite(g.as_graph_def(), LOCALHOST, "dp_allreduce")
    assert (res.train_op, res.init) == ("tag_train_op", "tag_init") and res.loss == loss.op.name
    assert {res.train_op, res.init, res.loss} <= {n.name for n in res.graph_def.node}


def test_bad_arguments():
    with pytest.raises(TagError, match="topology"):
        tag.optimize(mlp(), 42, playouts=1)
    with pytest.raises(tag.TopologyError):
        tag.optimize(mlp(), "no/such/topology.pbtxt", playouts=1)
    with pytest.raises(GraphError):
        tag.optimize("not a graph", LOCALHOST, playouts=1)
    with pytest.raises(TagError, match="smaller than the 3 devices"):
        tag.optimize(mlp(batch=2), LOCALHOST, playouts=1)
    with pytest.raises(TagError, match="no_profile.json"):
        tag.optimize(mlp(), LOCALHOST, playouts=1, profile="no_profile.json")
    with pytest.raises(GraphError, match="train_op="):
        tag.optimize(mlp(), LOCALHOST, playouts=1, train_op="no_such_op")


@pytest.mark.slow
def test_saved_plan_runs_on_local_workers(tmp_path):
    from tag.backend.runtime import LocalCluster, free_ports
    from tag.backend.runtime.measure import run_on
    topo = tag.parse_topology(topology_text(free_ports(3), tflops=[0.1, 0.05, 0.05]))
    plan = tag.optimize(user_graph(), topo, playouts=20)
    loaded = tag.Plan.load(plan.save(tmp_path / "plan"))
    with LocalCluster(topo) as cluster:
        run = run_on(cluster, loaded, steps=4, warmup=1)
    assert len(run.losses) >= 3 and all(math.isfinite(x) for x in run.losses)
    assert np.isfinite(run.mean_step_time_s) and run.mean_step_time_s > 0


def test_search_prior_names():
    from tag.api import search_prior
    from tag.errors import StrategyError
    assert search_prior("uniform") is None
    assert callable(search_prior("gnn"))
    with pytest.raises(StrategyError, match="unknown prior"):
        search_prior("oracle")


def test_a_simpler_builtin_within_the_margin_passes_the_guarantee_check():
    from types import SimpleNamespace

    from tag.api import _check_not_slower
    found = SimpleNamespace(method="single", step_time=1.03, baselines={"single": 1.03, "partition": 1.0},
                            baselines_feasible={"single": True, "partition": True})
    _check_not_slower(found, 0.05)                       # one device within 5% of the fastest built-in
    with pytest.raises(AssertionError, match="slower than the best feasible baseline"):
        _check_not_slower(found, 0.01)
    found.method = "refine"                              # a searched strategy never gets the margin
    with pytest.raises(AssertionError):
        _check_not_slower(found, 0.05)
