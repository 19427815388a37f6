"""tag-deploy (prediction without search): reports, traces, and one-line errors with no file left behind."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tag.cli.deploy import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
LAB = os.path.join(ROOT, "topologies", "lab-v100-1080ti.pbtxt")
MLP = "zoo:mlp,input_dim=64,hidden=128x128"
REPORT_KEYS = {"model", "topology", "devices", "groups", "predicted_step_time_s", "baselines", "speedup_vs_dp",
               "search_seconds", "peak_memory_bytes", "feasible", "sfb_gradients", "strategy"}
BUILTINS = {"dp_allreduce", "ps", "single", "partition"}


@pytest.fixture(autouse=True)
def _no_user_profile(monkeypatch, tmp_path_factory):
    # predictions here must not depend on a profile someone left in their cache
    monkeypatch.delenv("TAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


def _run(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_localhost_mlp_report_and_trace(tmp_path, capsys):
    report, trace = tmp_path / "r.json", tmp_path / "t.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", MLP, "--strategy", "dp_allreduce", "--batch", "12",
                         "--report", str(report), "--trace", str(trace)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert REPORT_KEYS <= set(r)
    assert r["model"] == "mlp" and r["topology"] == "localhost" and r["strategy"] == "dp_allreduce"
    assert r["devices"] == 3 and r["groups"] >= 1 and r["search_seconds"] == 0
    assert set(r["baselines"]) == BUILTINS and all(t > 0 for t in r["baselines"].values())
    assert r["predicted_step_time_s"] == r["baselines"]["dp_allreduce"]
    assert r["speedup_vs_dp"] == pytest.approx(1.0)
    assert set(r["peak_memory_bytes"]) == {"cpu0/CPU:0", "cpu1/CPU:0", "cpu2/CPU:0"} or len(r["peak_memory_bytes"]) == 3
    assert all(b > 0 for b in r["peak_memory_bytes"].values())
    assert r["feasible"] is True and r["sfb_gradients"] == []
    t = json.loads(trace.read_text())
    assert t  # a Chrome trace: a dict with traceEvents or a list of events
    assert "predicted step time" in out and "dp_allreduce" in out and "partition" in out


def test_lab_topology_each_strategy(tmp_path, capsys):
    times = {}
    for name in sorted(BUILTINS):
        report = tmp_path / f"{name}.json"
        rc, out, err = _run(["--topo", LAB, "--model", MLP, "--strategy", name, "--batch", "64",
                             "--groups", "8", "--report", str(report)], capsys)
        assert rc == 0, err
        r = json.loads(report.read_text())
        assert r["strategy"] == name and r["devices"] == 16 and len(r["peak_memory_bytes"]) == 16
        assert r["predicted_step_time_s"] == pytest.approx(r["baselines"][name])
        assert r["speedup_vs_dp"] == pytest.approx(r["baselines"]["dp_allreduce"] / r["predicted_step_time_s"])
        times[name] = r["baselines"]
    # every run predicts the same baselines (deterministic)
    assert all(b == times["dp_allreduce"] for b in times.values())
    # single: one device holds everything, the other 15 hold nothing
    r = json.loads((tmp_path / "single.json").read_text())
    assert sum(1 for b in r["peak_memory_bytes"].values() if b > 0) == 1


@pytest.mark.parametrize("args, message", [
    (["--topo", "no/such/topology.pbtxt", "--model", MLP], "no/such/topology.pbtxt"),
    (["--topo", LOCALHOST, "--model", "zoo:no_such_model"], "no_such_model"),
    (["--topo", LOCALHOST, "--model", "missing_graph.pb"], "missing_graph.pb"),
    (["--topo", LOCALHOST, "--model", MLP, "--strategy", "horovod"], "dp_allreduce, ps, single, partition"),
    (["--topo", LOCALHOST, "--model", MLP, "--batch", "2"], "smaller than the 3 devices"),
    (["--topo", LOCALHOST, "--model", MLP, "--batch", "0"], "--batch"),
    (["--topo", LOCALHOST, "--model", MLP, "--groups", "0"], "--groups"),
    (["--topo", LOCALHOST, "--model", MLP, "--profile", "no_profile.json"], "no_profile.json"),
    (["--topo", LOCALHOST, "--model", MLP, "--run", "--steps", "0"], "--steps"),
])
def test_bad_input_exits_2_one_line_no_files(tmp_path, capsys, args, message):
    report, trace = tmp_path / "r.json", tmp_path / "t.json"
    rc, out, err = _run(args + ["--report", str(report), "--trace", str(trace)], capsys)
    assert rc == 2
    assert err.startswith("tag-deploy: error:") and len(err.strip().splitlines()) == 1
    assert message in err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_out_of_memory_is_reported_not_an_error(tmp_path, capsys):
    # localhost with 16 MiB per device: the mlp's weights, gradients and Adam slots do not fit
    text = open(LOCALHOST).read().replace("memory_gib: 2", "memory_gib: 0.015625")
    topo = tmp_path / "tiny-memory.pbtxt"
    topo.write_text(text)
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", str(topo), "--model", "zoo:mlp,input_dim=784,hidden=2048x2048",
                         "--strategy", "single", "--report", str(report)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["feasible"] is False and r["oom_devices"] and not r["baselines_feasible"]["single"]
    assert "OUT OF MEMORY" in out


def test_model_from_a_graphdef_file(tmp_path, capsys):
    from tag import zoo
    gd = zoo.training_graph("mlp", batch_size=8, input_dim=32, hidden=(64,))
    path = tmp_path / "my_mlp.pb"
    path.write_bytes(gd.SerializeToString())
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", str(path), "--strategy", "partition",
                         "--report", str(report)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["model"] == "my_mlp" and r["batch_size"] == 8 and r["strategy"] == "partition"
    # a truncated file is bad input
    path.write_bytes(gd.SerializeToString()[:100])
    report.unlink()
    rc, out, err = _run(["--topo", LOCALHOST, "--model", str(path), "--report", str(report)], capsys)
    assert rc == 2 and "my_mlp.pb" in err and not report.exists()


def test_bad_profile_file_exits_2(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text('{"version": 1, "devices": {"CPU": {"efficiency": {"MatMul": 7}}}}')
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", MLP, "--profile", str(prof), "--report", str(report)],
                        capsys)
    assert rc == 2 and "p.json" in err and not report.exists()


def test_profile_changes_the_prediction(tmp_path, capsys):
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"version": 1, "source": "test", "devices": {"CPU": {
        "peak_flops": 1e9, "memory_bandwidth": 1e9, "launch_overhead_s": 1e-3, "efficiency": {"default": 0.01}}}}))
    base, cal = tmp_path / "base.json", tmp_path / "cal.json"
    assert main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "single", "--report", str(base)]) == 0
    assert main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "single", "--profile", str(slow),
                 "--report", str(cal)]) == 0
    t0 = json.loads(base.read_text())["predicted_step_time_s"]
    t1 = json.loads(cal.read_text())["predicted_step_time_s"]
    assert t1 > 5 * t0


def test_console_script(tmp_path):
    exe = shutil.which("tag-deploy")
    cmd = [exe] if exe else [sys.executable, "-m", "tag.cli.deploy"]
    report = tmp_path / "r.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("TAG_PROFILE", None)
    proc = subprocess.run(cmd + ["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--report", str(report)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["strategy"] == "ps" and REPORT_KEYS <= set(r)
    bad = subprocess.run(cmd + ["--topo", str(tmp_path / "nope.pbtxt"), "--model", MLP],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_run_measures_plan_and_baseline_on_local_workers(tmp_path, capsys):
    """--run: the plan and the dp_allreduce baseline run on three real local TF servers."""
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", "zoo:mlp,input_dim=32,hidden=64", "--batch", "12",
                         "--strategy", "ps", "--run", "--steps", "4", "--report", str(report)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["measured_step_time_s"] > 0 and r["measured_baseline_step_time_s"] > 0
    assert r["measured_speedup_vs_dp"] == pytest.approx(r["measured_baseline_step_time_s"] / r["measured_step_time_s"])
    assert len(r["measured_losses"]) == 4 and all(np.isfinite(r["measured_losses"]))
    assert "measured speedup vs dp_allreduce" in out


@pytest.mark.slow
def test_run_of_a_one_device_plan_needs_no_server_and_checkpoints(tmp_path, capsys):
    """--run of a plan on one device: a process of its own on its host (no server), checkpoints written there."""
    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    report, ckpt = tmp_path / "r.json", tmp_path / "ckpt"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", "zoo:mlp,input_dim=32,hidden=64", "--batch", "12",
                         "--strategy", "single", "--run", "--steps", "4", "--checkpoint-every", "2",
                         "--checkpoint-dir", str(ckpt), "--report", str(report)], capsys)
    assert rc == 0, err
    assert "single: connecting to an in-process session" in err          # the plan: no server
    assert re.search(r"dp_allreduce: cpu\d: connecting to grpc://", err)   # the baseline: a program per host
    r = json.loads(report.read_text())
    assert len(r["measured_losses"]) == 4 and all(np.isfinite(r["measured_losses"]))
    assert read_checkpoint_meta(r["checkpoint"])["step"] == 4


@pytest.mark.slow
def test_several_runs_at_once_on_the_shipped_loopback_topology(tmp_path):
    """localhost.pbtxt says port: 0, so runs started together each get free ports and all finish."""
    runs = 3
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    env.pop("TAG_PROFILE", None)
    reports = [tmp_path / f"r{i}.json" for i in range(runs)]
    procs = [subprocess.Popen([sys.executable, "-m", "tag.cli.deploy", "--topo", LOCALHOST, "--model",
                               "zoo:mlp,input_dim=32,hidden=64", "--batch", "12", "--strategy", "ps", "--run",
                               "--steps", "3", "--report", str(report)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for report in reports]
    try:
        outcomes = [p.communicate(timeout=540) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, (_, err) in zip(procs, outcomes, strict=True):
        assert p.returncode == 0, err[-3000:]
    for report in reports:
        assert json.loads(report.read_text())["measured_steps"] == 3


# ------------------------------------------------------------------------------------------------
# the search: tag-deploy without --strategy
# ------------------------------------------------------------------------------------------------

TINY_MLP = "zoo:mlp,input_dim=20,hidden=32x16,num_classes=5"
SEARCH = ["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--playouts", "20"]
PLAN_FILES = ["graph.pb", "plan.json", "report.json", "strategy.pb", "topology.pbtxt"]


def test_search_report_table_and_saved_plan(tmp_path, capsys):
    import tag
    report, plan_dir = tmp_path / "r.json", tmp_path / "plan"
    rc, out, err = _run(SEARCH + ["--report", str(report), "--save", str(plan_dir)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert REPORT_KEYS | {"method", "reference", "sfb_bytes_saved", "entry_points"} <= set(r)
    assert BUILTINS | {"best_uniform", "mcts"} <= set(r["baselines"])
    assert r["search_seconds"] > 0 and r["strategy"] == r["method"]
    from helpers import allowed_slack
    for name, t in r["baselines"].items():   # a searched strategy replaces a built-in only by a margin
        if r["baselines_feasible"][name]:
            assert r["predicted_step_time_s"] <= t * (1 + allowed_slack(name)), name
    assert sorted(os.listdir(plan_dir)) == PLAN_FILES
    plan = tag.Plan.load(plan_dir)
    assert plan.report() == r and plan.method == r["method"]
    assert "strategies simulated" in out and "this plan" in out and "mcts" in out and f"plan: {plan_dir}" in out


def test_search_is_repeatable_for_a_seed(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        rc, out, err = _run(SEARCH + ["--seed", "3", "--order", "topological", "--save", str(d)], capsys)
        assert rc == 0, err
    assert (a / "strategy.pb").read_bytes() == (b / "strategy.pb").read_bytes()
    assert (a / "graph.pb").read_bytes() == (b / "graph.pb").read_bytes()


def test_strategy_file_predicts_a_saved_plan(tmp_path, capsys):
    plan_dir, r1, r2 = tmp_path / "plan", tmp_path / "r1.json", tmp_path / "r2.json"
    assert _run(SEARCH + ["--save", str(plan_dir), "--report", str(r1)], capsys)[0] == 0
    searched = json.loads(r1.read_text())
    # the plan directory knows its batch; a bare strategy.pb needs --batch
    for args in (["--strategy-file", str(plan_dir)],
                 ["--strategy-file", str(plan_dir / "strategy.pb"), "--batch", "12"]):
        rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, *args, "--report", str(r2)], capsys)
        assert rc == 0, err
        r = json.loads(r2.read_text())
        assert r["strategy"] == "saved" and r["search_seconds"] == 0 and r["batch_size"] == 12
        assert r["predicted_step_time_s"] == pytest.approx(searched["predicted_step_time_s"])
        assert "strategy file" in out


def test_the_summary_line_names_precision_and_xla(capsys):
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--strategy", "ps",
                         "--precision", "tf32", "--xla"], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].endswith("strategy ps, precision tf32, XLA")
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--strategy", "ps"], capsys)
    assert out.splitlines()[0].endswith("strategy ps, precision fp32")


def test_run_prints_the_plan_table_before_training(monkeypatch, capsys):
    """--run: the table is on stdout before the run starts; the measured block follows it, once."""
    import tag.cli.deploy as deploy
    from tag.cli.deploy_run import RunOutcome
    seen = {}

    def fake_run_plan(args, analysis, name, strategy, report, searched=None, *, k=None):
        seen["stdout"] = capsys.readouterr().out
        return RunOutcome({"measured_step_time_s": 0.01, "measured_baseline_step_time_s": 0.02,
                           "measured_speedup_vs_dp": 2.0, "measured_steps": 3, "measured_warmup_steps": 2,
                           "measured_losses": [1.0, 0.9, 0.8]}, name, strategy)

    monkeypatch.setattr(deploy, "run_plan", fake_run_plan)
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--strategy", "ps", "--run",
                         "--steps", "3"], capsys)
    assert rc == 0, err
    assert "strategy ps, precision fp32" in seen["stdout"] and "(this plan)" in seen["stdout"]
    assert "measured" not in seen["stdout"]
    assert "(this plan)" not in out and out.count("measured speedup vs dp_allreduce: 2x") == 1


def _saved_ps_plan(tmp_path, capsys):
    plan_dir, r1 = tmp_path / "plan", tmp_path / "r1.json"
    rc, _, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--strategy", "ps",
                       "--save", str(plan_dir), "--report", str(r1)], capsys)
    assert rc == 0, err
    return plan_dir, json.loads(r1.read_text())


def test_strategy_file_of_a_plan_directory_needs_no_model(tmp_path, capsys):
    """--strategy-file DIR without --model: the plan's own step (DIR/graph.pb) is the model."""
    plan_dir, saved = _saved_ps_plan(tmp_path, capsys)
    r2 = tmp_path / "r2.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--strategy-file", str(plan_dir), "--report", str(r2)], capsys)
    assert rc == 0, err
    r = json.loads(r2.read_text())
    assert r["strategy"] == "saved" and r["batch_size"] == 12 and r["model"] == saved["model"]
    assert r["predicted_step_time_s"] == pytest.approx(saved["predicted_step_time_s"])
    assert r["entry_points"]["train_op"] == saved["entry_points"]["train_op"]
    assert os.path.join(str(plan_dir), "graph.pb") in out.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    ([], "--model is required"),
    (["--strategy-file", "{plan}/strategy.pb", "--batch", "12"], "--model is required"),
    (["--strategy-file", "{plan}", "--loss", "loss"], "--loss: the plan in"),
    (["--strategy-file", "{plan}", "--precision", "mixed_bfloat16"], "was made for fp32"),
])
def test_no_model_without_a_plan_directory_exits_2(tmp_path, capsys, args, message):
    plan_dir, _ = _saved_ps_plan(tmp_path, capsys)
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, *[a.format(plan=plan_dir) for a in args], "--report", str(report)],
                        capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not report.exists()


@pytest.mark.slow
def test_run_of_a_saved_plan_without_model(tmp_path, capsys):
    plan_dir, _ = _saved_ps_plan(tmp_path, capsys)
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--strategy-file", str(plan_dir), "--run", "--steps", "3",
                         "--report", str(report)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["measured_steps"] == 3 and r["measured_step_time_s"] > 0 and r["measured_baseline_step_time_s"] > 0


def test_builtin_strategy_can_be_saved(tmp_path, capsys):
    import tag
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", "--strategy", "ps",
                         "--save", str(tmp_path / "ps")], capsys)
    assert rc == 0, err
    plan = tag.Plan.load(tmp_path / "ps")
    assert plan.method == "ps" and plan.report()["strategy"] == "ps"


def test_user_graph_without_names_is_searched(tmp_path, capsys):
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [12, 8], name="x")
        y = v1.placeholder(tf.int32, [12], name="y")
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, v1.get_variable("w1", [8, 16]))), v1.get_variable("w2", [16, 3]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        v1.train.AdamOptimizer(1e-3).minimize(loss)
        v1.global_variables_initializer()
    path = tmp_path / "step.pb"
    path.write_bytes(g.as_graph_def().SerializeToString())
    report = tmp_path / "r.json"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", str(path), "--playouts", "5", "--report", str(report)],
                        capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["model"] == "step" and r["entry_points"]["train_op"] == "Adam" and r["entry_points"]["loss"] == "Mean"


def test_progress_bar_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, err = _run(SEARCH, capsys)
    assert rc == 0
    assert "playout/s" in err and "20/20" in err and "best speedup" in err


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "ps", "--strategy-file", "x"], "exclude each other"),
    (["--strategy", "ps", "--budget", "3"], "--budget"),
    (["--strategy-file", "x", "--seed", "1"], "--seed"),
    (["--budget", "0"], "--budget"),
    (["--playouts", "0"], "--playouts"),
    (["--min-gain", "-0.1"], "--min-gain"),
    (["--strategy", "single", "--min-gain", "0"], "--min-gain"),
    (["--mixed-min-gain", "-0.1"], "--mixed-min-gain"),
    (["--strategy", "single", "--mixed-min-gain", "0"], "--mixed-min-gain"),
    (["--order", "sideways"], "sideways"),
    (["--strategy-file", "no/such/plan"], "no/such/plan"),
    (["--save", "no/such/dir/plan"], "does not exist"),
    (["--train-op", "no_such_op"], "no_such_op"),
])
def test_search_flags_bad_input_exit_2_nothing_written(tmp_path, capsys, extra, message):
    report, plan_dir = tmp_path / "r.json", tmp_path / "plan"
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", *extra,
                         "--report", str(report), "--save", str(plan_dir)] if "--save" not in extra else
                        ["--topo", LOCALHOST, "--model", TINY_MLP, *extra, "--report", str(report)], capsys)
    assert rc == 2, err
    assert err.startswith("tag-deploy: error:") and len(err.strip().splitlines()) == 1 and message in err
    assert os.listdir(tmp_path) == []


def test_bad_strategy_files_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\xff\xfe not a strategy")
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--strategy-file", str(bad)], capsys)
    assert rc == 2 and "bad.pb" in err and len(err.strip().splitlines()) == 1
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    rc, out, err = _run(SEARCH + ["--save", str(not_a_dir)], capsys)
    assert rc == 2 and "not a directory" in err


def test_nothing_fits_is_bad_input_when_searching(tmp_path, capsys):
    text = open(LOCALHOST).read().replace("memory_gib: 2", "memory_gib: 0.001")
    topo = tmp_path / "tiny-memory.pbtxt"
    topo.write_text(text)
    rc, out, err = _run(["--topo", str(topo), "--model", "zoo:mlp,input_dim=512,hidden=512x512", "--batch", "12",
                         "--playouts", "5", "--report", str(tmp_path / "r.json")], capsys)
    assert rc == 2 and "no strategy fits in memory" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["tiny-memory.pbtxt"]


@pytest.mark.slow
def test_run_deploys_the_searched_plan(tmp_path, capsys):
    report = tmp_path / "r.json"
    rc, out, err = _run(SEARCH + ["--run", "--steps", "4", "--report", str(report)], capsys)
    assert rc == 0, err
    r = json.loads(report.read_text())
    assert r["measured_step_time_s"] > 0 and r["measured_baseline_step_time_s"] > 0
    assert len(r["measured_losses"]) == 4 and all(np.isfinite(r["measured_losses"]))
    assert "measured speedup vs dp_allreduce" in out


# ------------------------------------------------------------------------------------------------
# --run --tune K: the most promising candidates measured on the cluster before training
# ------------------------------------------------------------------------------------------------

def _two_host_topology(tmp_path) -> str:
    """localhost.pbtxt without its third host (port 0: free ports chosen at start)."""
    text = open(LOCALHOST).read()
    start = text.index('host {\n  name: "cpu2"')
    text = text[:start] + text[text.index("}\n}\n", start) + 4:]
    path = tmp_path / "two.pbtxt"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("extra, message", [
    (["--tune", "3"], "--tune only apply to --run"),
    (["--verify"], "--verify only apply to --run"),
    (["--run", "--tune", "0"], "--tune must be a positive number of candidates to measure, got 0"),
    (["--run", "--tune", "-2"], "--tune must be a positive number of candidates to measure, got -2"),
    (["--run", "--tune", "many"], "--tune must be a positive number of candidates to measure, got 'many'"),
    (["--run", "--verify", "--tune", "3"], "--verify is --tune 2: give one of them"),
    (["--run", "--tune", "3", "--resume"], "--tune and --resume exclude each other"),
    (["--run", "--verify", "--resume"], "--verify and --resume exclude each other"),
])
def test_tune_flags_bad_input_exit_2_nothing_written(tmp_path, capsys, extra, message):
    rc, out, err = _run(["--topo", LOCALHOST, "--model", TINY_MLP, "--batch", "12", *extra,
                         "--report", str(tmp_path / "r.json"), "--save", str(tmp_path / "plan")], capsys)
    assert rc == 2, err
    assert err.startswith("tag-deploy: error:") and len(err.strip().splitlines()) == 1 and message in err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def _run_tune(tmp_path, capsys, tune: list[str], steps: int, topo: str | None = None):
    """tag-deploy --run --tune ... of TINY_MLP on local workers: (report, saved plan, stdout, stderr)."""
    import tag
    report, plan_dir = tmp_path / "r.json", tmp_path / "plan"
    rc, out, err = _run(["--topo", topo or _two_host_topology(tmp_path), "--model", TINY_MLP, "--batch", "12",
                         "--playouts", "5", "--min-gain", "0", "--mixed-min-gain", "0", "--run", *tune,
                         "--steps", str(steps),
                         "--report", str(report), "--save", str(plan_dir)], capsys)
    assert rc == 0, err
    return json.loads(report.read_text()), tag.Plan.load(plan_dir), out, err


@pytest.mark.slow
def test_run_tune_measures_k_candidates_on_three_local_workers_and_trains_what_it_keeps(tmp_path, capsys):
    r, plan, out, err = _run_tune(tmp_path, capsys, ["--tune", "3"], steps=3, topo=LOCALHOST)
    t = r["tune"]
    rows = t["candidates"]
    assert 3 <= len(rows) <= 5 and len({x["name"] for x in rows}) == len(rows) and rows[0]["name"] == t["plan"]
    # the best pipeline too when predicted within reach (tag.tune.TUNE_PIPELINE_WITHIN)
    assert sorted(role for x in rows for role in x["roles"] if role != "best pipeline") == [
        "best built-in", "best uniform action", "one device", "the plan"]
    extra = t["extra_rounds"]
    assert all(x["measured_ms"] > 0 and x["mad_ms"] >= 0 and 6 <= x["steps"] <= 6 + 2 * extra for x in rows)
    # kept: the fastest, or a candidate within its noise (tag.tune.keep: the fewest hosts, then the plan)
    from helpers import kept_within_noise
    kept = t["kept"]
    assert kept_within_noise(t)
    assert kept == r["method"] == r["strategy"] == plan.method       # trained, reported, saved
    assert r["predicted_step_time_s"] == pytest.approx(r["baselines"][kept])
    assert t["plan"] in r["baselines"] and r["search_seconds"] > 0                # the search is still reported
    assert len(r["measured_losses"]) == 3 and t["seconds"] > 0
    tune_lines = [line for line in err.splitlines() if line.startswith("tag-deploy: tune: ")]
    rounds = [line for line in tune_lines if ": round " in line]
    assert len(rounds) == 3 * len(rows) and rounds[0].endswith(f"round 1/3: {rows[0]['name']}")   # interleaved rounds
    extra_lines = [line for line in tune_lines if ": extra round " in line]   # of those within the noise
    assert len(extra_lines) == sum((x["steps"] - 6) // 2 for x in rows)
    assert len(tune_lines) == 1 + 3 * len(rows) + len(extra_lines) + 1 + len(rows)   # what, rounds, verdict, each
    assert all(f"{x['name']} " in "\n".join(tune_lines) for x in rows)
    assert f"tune                 measured {len(rows)} candidates" in out and out.count("  <- kept") == 1


@pytest.mark.slow
def test_run_verify_is_tune_2_and_the_kept_candidate_is_trained_and_saved(tmp_path, capsys, monkeypatch):
    """--verify measures the plan, the best built-in and the best uniform action; the measurement is real,
    the decision is forced to the slowest predicted candidate to follow the path where the plan is replaced."""
    import tag.tune
    monkeypatch.setattr(tag.tune.Measured, "median_s", property(lambda m: 1.0 / m.candidate.predicted_s))
    r, plan, out, err = _run_tune(tmp_path, capsys, ["--verify"], steps=2)
    t = r["tune"]
    assert 2 <= len(t["candidates"]) <= 3 and {"the plan", "best built-in"} <= {
        role for x in t["candidates"] for role in x["roles"]}
    kept = max(t["candidates"], key=lambda x: x["predicted_ms"])["name"]
    assert t["kept"] == kept != t["plan"] and t["overrode_simulator"]
    assert r["method"] == r["strategy"] == kept and plan.method == kept and plan.report()["strategy"] == kept
    assert f"strategy {kept}" in out and f"kept {kept}, overriding the simulator's {t['plan']}" in out


def _pipeline_file(tmp_path, spec: str, name: str, micro_batches: int = 3, extra_stages: int = 0) -> str:
    """A saved two-stage pipeline of SPEC on localhost (stage 0: the first two forward op groups on worker
    0, stage 1 the rest on workers 1 and 2); EXTRA_STAGES one-group stages of op groups that do not exist."""
    from helpers import forward_group_order
    from tag.api import prepare
    from tag.frontend import zoo
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tag.strategy.types import Strategy
    an = prepare(zoo.resolve_model(spec, 12)[1], LOCALHOST)
    order, rest = forward_group_order(an.graph, an.grouping)
    pipe = Pipeline((PipelineStage(tuple(order[:2]), (0,)), PipelineStage(tuple(order[2:] + rest), (1, 2))),
                    micro_batches, "1f1b")
    msg = Strategy.pipelined(an.grouping, pipe).to_proto()
    for k in range(extra_stages):
        msg.pipeline.stages.add(groups=[an.grouping.num_groups + k], placement=[0], mode=1)
    path = tmp_path / f"{name}.pb"
    path.write_bytes(msg.SerializeToString())
    return str(path)


def test_bad_pipeline_strategy_files_exit_2_naming_the_stage(tmp_path, capsys):
    """Issue 21's bad pipelines, read with --strategy-file: one line naming the stage, exit 2, nothing run
    or written (the model's batch is 32: workers 1 and 2 get 16 examples each)."""
    big = "zoo:mlp,input_dim=4096,hidden=16384x16384,num_classes=5"     # stage 0 needs more than 2 GiB
    cases = [(TINY_MLP, _pipeline_file(tmp_path, TINY_MLP, "stages", extra_stages=2), [],
              r"pipeline stage \d+: op group \d+ does not exist"),
             (TINY_MLP, _pipeline_file(tmp_path, TINY_MLP, "micro", micro_batches=20), [],
              "pipeline stage 1: 20 micro-batches but device cpu1/CPU:0 gets only 16 examples"),
             (big, _pipeline_file(tmp_path, big, "oom"), ["--run", "--steps", "1"],
              r"does not fit in the devices' memory \(out of memory on cpu0/CPU:0, pipeline stage 0\); "
              r"nothing was run")]
    for model, path, extra, message in cases:
        report = tmp_path / "r.json"
        rc, out, err = _run(["--topo", LOCALHOST, "--model", model, "--strategy-file", path, "--report",
                             str(report), *extra], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert re.search(message, err), err
        assert not report.exists()
