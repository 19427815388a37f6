"""tag-deploy's printed output, pinned: a plan on the loopback topology and a bad-input error, each compared
with a committed golden file (tests/golden/) after masking only what varies from run to run (seconds, the
repository's path). Any other change to what tag-deploy prints fails here; when a change is meant, rewrite the
goldens with ``TAG_UPDATE_GOLDEN=1 python -m pytest tests/test_cli_golden.py`` and review the diff."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
TIMEOUT_S = 120
SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")


def _deploy(args: list[str], tmp_path) -> tuple[int, str]:
    """Run tag-deploy as a process from the repository root; its exit code and stdout+stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TAG_PROFILE"}
    env["XDG_CACHE_HOME"] = str(tmp_path)  # no calibration profile someone left in their cache
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run([sys.executable, "-m", "tag.cli.deploy", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout


def _masked(text: str) -> str:
    return SECONDS.sub("<S> s", text.replace(ROOT, "<ROOT>"))


def _check(name: str, text: str) -> None:
    path = os.path.join(GOLDEN, name)
    if os.environ.get("TAG_UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, f"tag-deploy's output differs from tests/golden/{name}"


def test_loopback_plan_output(tmp_path):
    rc, out = _deploy(["--topo", "topologies/localhost.pbtxt", "--model", "zoo:mlp,input_dim=64,hidden=128x128",
                       "--batch-size", "12", "--playouts", "30", "--seed", "0"], tmp_path)
    assert rc == 0, out
    _check("deploy_localhost_mlp.txt", _masked(out))


def test_missing_topology_output(tmp_path):
    rc, out = _deploy(["--topo", "topologies/no-such-topology.pbtxt", "--model", "zoo:mlp"], tmp_path)
    assert rc == 2
    assert out.count("\n") == 1
    _check("deploy_missing_topology.txt", _masked(out))


def test_masking_keeps_figures():
    # only the seconds are masked: a changed step time, byte count or speedup still fails the comparison
    assert _masked("predicted step time  0.50 ms\nsimulated in 0.04 s; 1.53x") == \
        "predicted step time  0.50 ms\nsimulated in <S> s; 1.53x"

