"""tag-deploy (prediction without search): reports, traces, and one-line errors with no file left behind."""
from __future__ import annotations

import json
import os
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
