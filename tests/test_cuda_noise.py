"""TensorFlow's cuInit error line stays off the console where it means nothing (no NVIDIA driver), and every
other line written to stderr, TensorFlow's warnings included, still reaches it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tag.cuda_noise import _FilteredStderr, cuda_line_is_noise, is_cuda_startup_noise, without_cuinit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUINIT = ("E0000 00:00:1796691586.677838   28426 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)\n")
WARNING = "W0000 00:00:1796691586.7   28426 op_level_cost_estimator.cc:699] Error in PredictCost() for the op\n"
ERROR = "E0000 00:00:1796691587.1   28426 grpc_server_lib.cc:10] Could not start gRPC server: port in use\n"


def test_captured_stream_loses_only_the_cuinit_line():
    assert without_cuinit(WARNING + CUINIT + ERROR + "plain text\n") == WARNING + ERROR + "plain text\n"
    assert without_cuinit(CUINIT) == ""


def test_filtered_stderr_replays_the_rest_in_order(capfd):
    with _FilteredStderr():
        os.write(2, (WARNING + CUINIT).encode())
        os.write(2, ERROR.encode())
    err = capfd.readouterr().err
    assert err == WARNING + ERROR


def test_startup_noise_in_a_childs_tail():
    assert is_cuda_startup_noise(CUINIT)
    assert is_cuda_startup_noise("I0000 00:00:1.0  1 cudart_stub.cc:31] Could not find cuda drivers on your machine")
    assert not is_cuda_startup_noise(WARNING) and not is_cuda_startup_noise(ERROR)
    assert not is_cuda_startup_noise("RuntimeError: CUDA out of memory in my model")


def _stderr_of(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"          # TensorFlow's errors shown: what a user's own script sees
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    return proc.stderr


@pytest.mark.skipif(not cuda_line_is_noise(), reason="an NVIDIA driver is installed: a failed cuInit is shown")
def test_a_session_after_import_tf_prints_no_cuinit_line():
    session = "with tf.compat.v1.Session() as s: s.run(tf.constant(1)); print('ok')"
    plain = _stderr_of("import tensorflow as tf\n" + session)
    if "cuInit" not in plain:
        pytest.skip("this TensorFlow build does not call cuInit: nothing to hide")
    quiet = _stderr_of("from tag.backend.runtime.cluster_spec import import_tf\ntf = import_tf()\n" + session)
    assert "cuInit" not in quiet, quiet
