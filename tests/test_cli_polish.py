"""The command line for a new user: no TensorFlow noise, one-line errors, bad input refused cleanly,
profiles reported per device type, TensorBoard output, the worker's security notice."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tag.cli import deploy, profile, topo, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
LAB = os.path.join(ROOT, "topologies", "lab-v100-1080ti.pbtxt")
MLP = "zoo:mlp,input_dim=32,hidden=64"
NOISE = ("absl::InitializeLog", "cudart_stub", "cuInit", "oneDNN", "WARNING:tensorflow", "deprecat")


@pytest.fixture(autouse=True)
def _no_user_profile(monkeypatch, tmp_path_factory):
    monkeypatch.delenv("TAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


def _cli(module: str, args: list[str], tmp_path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TAG_PROFILE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def _one_line_error(err: str, prog: str) -> None:
    assert err.startswith(f"{prog}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------ noise
def test_deploy_console_has_no_tensorflow_noise(tmp_path):
    proc = _cli("tag.cli.deploy", ["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("mlp (") and not any(n in proc.stdout for n in NOISE)
    bad = _cli("tag.cli.deploy", ["--topo", LOCALHOST, "--model", "missing.pb"], tmp_path)
    assert bad.returncode == 2
    _one_line_error(bad.stderr, "tag-deploy")


def test_verbose_lets_tensorflow_speak(tmp_path):
    proc = _cli("tag.cli.deploy", ["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--verbose"], tmp_path)
    assert proc.returncode == 0
    assert proc.stderr.strip(), "--verbose: TensorFlow's own start-up lines are shown"


def test_quiet_import_in_a_fresh_interpreter():
    code = ("from tag.cli.quiet import quiet_tensorflow; quiet_tensorflow(); import tensorflow as tf; "
            "tf.constant(1); print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == "ok\n" and proc.stderr == "", proc.stderr


# ------------------------------------------------------------------------------------------------ argparse
@pytest.mark.parametrize("main, prog, argv, message", [
    (deploy.main, "tag-deploy", ["--topo", LOCALHOST, "--model", MLP, "--batch", "abc"],
     "tag-deploy: error: argument --batch: invalid int value: 'abc'\n"),
    (deploy.main, "tag-deploy", ["--model", MLP], "tag-deploy: error: the following arguments are required: --topo\n"),
    (deploy.main, "tag-deploy", ["--topo", LOCALHOST, "--model", MLP, "--frobnicate"],
     "tag-deploy: error: unrecognized arguments: --frobnicate\n"),
    (topo.main, "tag-topo", ["frobnicate"], None),
    (profile.main, "tag-profile", ["--steps", "x"], "tag-profile: error: argument --steps: invalid int value: 'x'\n"),
    (worker.main, "tag-worker", ["--threads", "many"], "tag-worker: error: argument --threads: invalid int value: "
                                                       "'many'\n"),
])
def test_argparse_errors_are_one_line_exit_2(capsys, main, prog, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_line_error(err, prog)
    if message is not None:
        assert err == message


# ------------------------------------------------------------------------------------------------ inputs
def test_named_pipes_are_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [
        (deploy.main, ["--topo", str(fifo), "--model", MLP, "--strategy", "ps"]),
        (deploy.main, ["--topo", LOCALHOST, "--model", str(fifo), "--strategy", "ps"]),
        (deploy.main, ["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--profile", str(fifo)]),
        (deploy.main, ["--topo", LOCALHOST, "--model", MLP, "--strategy-file", str(fifo)]),
        (topo.main, ["validate", str(fifo)]),
        (topo.main, ["show", str(fifo)]),
        (profile.main, ["--merge", str(fifo), str(fifo)]),
        (worker.main, ["--topo", str(fifo), "--host", "cpu0"]),
    ]
    for main, argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "not a regular file" in err and str(fifo) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("model, words", [
    ("/dev/zero", "not a regular file"),
    ("zoo:transformer,seq_len=100000000", "constants"),
    ("zoo:bert_base,num_layers=10000000", "ops"),
    ("zoo:mlp,input_dim=100000000000,hidden=100000000", "PiB"),
])
def test_absurd_models_end_in_a_size_error(tmp_path, capsys, model, words):
    report = tmp_path / "r.json"
    assert deploy.main(["--topo", LOCALHOST, "--model", model, "--strategy", "dp_allreduce",
                        "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not report.exists()


@pytest.mark.parametrize("flag, path", [("--report", "/proc/tag-no/r.json"), ("--trace", "/proc/t.json"),
                                        ("--report", "/dev/full/r.json")])
def test_unwritable_output_is_exit_2_naming_the_path(capsys, flag, path):
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", flag, path]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "tag-deploy")
    assert path in err and ".tmp" not in err


def test_write_failure_after_the_work_names_the_users_path(tmp_path, capsys, monkeypatch):
    """A path that passes the early check but fails when written: still exit 2 and the user's name."""
    import tag.files
    report = tmp_path / "r.json"
    real_open = open

    def failing_open(path, mode="r", *a, **kw):
        if "w" in mode and ".r.json.tmp" in os.fspath(path):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(tag.files, "open", failing_open, raising=False)
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"{report}: cannot write: No space left on device" in err and ".tmp" not in err
    assert list(tmp_path.iterdir()) == []


def test_run_flags_need_run(capsys):
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--checkpoint-every", "2"]) == 2
    assert "only apply to --run" in capsys.readouterr().err
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--run", "--resume",
                        "--checkpoint-dir", "/nonexistent-tag"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ profiles
def _profile_file(path, dtype: str) -> str:
    path.write_text(json.dumps({"version": 1, "source": "test", "devices": {dtype: {
        "peak_flops": 1e12, "memory_bandwidth": 1e11, "launch_overhead_s": 1e-5, "efficiency": {"default": 0.3}}}}))
    return str(path)


def test_profile_matching_no_device_type_is_reported(tmp_path, capsys):
    prof = _profile_file(tmp_path / "v100.json", "V100")
    report = tmp_path / "r.json"
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--profile", prof,
                        "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    assert "warning: profile" in err and "matches no device type of localhost" in err and "V100" in err
    r = json.loads(report.read_text())
    assert r["profile_use"] == {"CPU": "built-in defaults"}
    assert any("matches no device type" in n for n in r["notes"])
    assert "matches no device type" in out


def test_merged_profiles_serve_each_device_type(tmp_path, capsys):
    a, b = _profile_file(tmp_path / "v100.json", "V100"), _profile_file(tmp_path / "gtx.json", "GTX1080Ti")
    merged = tmp_path / "lab.json"
    assert profile.main(["--merge", a, b, "--out", str(merged)]) == 0
    assert "V100" in capsys.readouterr().out
    data = json.loads(merged.read_text())
    assert set(data["devices"]) == {"V100", "GTX1080Ti"}
    report = tmp_path / "r.json"
    assert deploy.main(["--topo", LAB, "--model", MLP, "--strategy", "ps", "--batch", "64",
                        "--profile", str(merged), "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    use = json.loads(report.read_text())["profile_use"]
    assert use["V100"] == f"{merged} entry 'V100'" and use["GTX1080Ti"] == f"{merged} entry 'GTX1080Ti'"
    assert use["P100"] == "built-in defaults"
    assert "V100:" in out and "warning" not in err


def test_merge_conflict_and_usage(tmp_path, capsys):
    a = _profile_file(tmp_path / "a.json", "V100")
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"version": 1, "devices": {"V100": {"peak_flops": 5e12, "efficiency": {}}}}))
    out = tmp_path / "c.json"
    assert profile.main(["--merge", a, str(b), "--out", str(out)]) == 2
    assert "both describe device type 'V100'" in capsys.readouterr().err and not out.exists()
    assert profile.main(["--merge", a, "--model", "zoo:mlp"]) == 2
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------ tensorboard
def test_tensorboard_graph_event_file_and_trace(tmp_path, capsys):
    tb = tmp_path / "tb"
    assert deploy.main(["--topo", LOCALHOST, "--model", MLP, "--strategy", "ps", "--tensorboard", str(tb)]) == 0
    assert f"tensorboard: {tb}" in capsys.readouterr().out
    events = [p for p in tb.iterdir() if p.name.startswith("events.out.tfevents.")]
    assert len(events) == 1
    import tensorflow as tf
    graphs = []
    for ev in tf.compat.v1.train.summary_iterator(str(events[0])):
        if ev.graph_def:
            gd = tf.compat.v1.GraphDef()
            gd.ParseFromString(ev.graph_def)
            graphs.append(gd)
    assert len(graphs) == 1
    devices = {n.device for n in graphs[0].node}
    assert {"/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"} <= devices
    trace = json.loads((tb / "predicted_step.trace.json").read_text())
    assert trace


# ------------------------------------------------------------------------------------------------ worker
def test_worker_security_notice():
    text = worker.security_notice("10.0.0.2:2222")
    assert "no authentication" in text and "every network interface" in text and "port 2222" in text
    assert "trusted network" in text
