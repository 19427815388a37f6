"""The testbed benchmarks' shared helpers that need no testbed: the background runner that keeps hosts busy
(scripts/_testbed_cases.py ``BackgroundSteps``) and bench_transfers' kernel chains, on in-process sessions."""
import os
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from _testbed_cases import BackgroundSteps  # noqa: E402


def counter_graph():
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        v = tf.Variable(0.0, name="v")
        v.assign_add(1.0, name="step")
        tf.compat.v1.variables_initializer([v], name="init")
    return g.as_graph_def()


def test_background_steps_run_until_exit():
    with BackgroundSteps(counter_graph(), "", train_op="step", loss=None, timeout_s=60) as busy:
        assert busy.steps >= 1
        time.sleep(0.3)
    done = busy.steps
    assert done > 1 and not busy.thread.is_alive()
    time.sleep(0.1)
    assert busy.steps == done


def test_background_steps_report_a_failed_run():
    with pytest.raises(RuntimeError, match="background steps failed"):
        with BackgroundSteps(counter_graph(), "", train_op="no_such_op", loss=None, timeout_s=60):
            pass


def test_kernel_chains_run_on_one_device():
    from bench_transfers import CONTENTION_KERNELS, kernel_chain_graph
    from tag.backend.runtime import run_steps
    for kind in ("conv", "conv_filter_grad", "matmul"):
        r = run_steps(kernel_chain_graph(kind, "/device:CPU:0"), "", train_op="step", loss=None, steps=2, warmup=1)
        assert len(r.step_times) == 2, kind
    assert set(CONTENTION_KERNELS) == {"conv", "conv_filter_grad", "matmul", "elementwise"}


def test_rounds_disagree_when_a_quota_spreads_beyond_the_limit():
    from _testbed_cases import rounds_disagree
    assert rounds_disagree({0: [0.93, 1.26], 1: [0.49, 0.49]}, 0.15)          # run 26's full core: 30% apart
    assert not rounds_disagree({0: [0.98, 1.01], 1: [0.49, 0.486]}, 0.15)
    assert not rounds_disagree({0: [0.5]}, 0.0)                               # one round cannot disagree
    assert not rounds_disagree({0: [0.93, 1.26]}, float("inf"))               # no limit set: never
