"""tag.backend.runtime.one_device: a one-device program run as a process of its own on its host, no server."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag.backend.runtime import LocalCluster, RunControl, run_steps  # noqa: E402
from tag.backend.runtime.checkpoint import read_checkpoint_meta  # noqa: E402
from tag.backend.runtime.measure import run_on  # noqa: E402
from tag.backend.runtime.one_device import device_task, localized, run_one_device, runs_alone, single_device  # noqa: E402
from tag.errors import RunError, TagError  # noqa: E402
from test_runtime import loopback_topology, mlp_graph  # noqa: E402  (pyproject's pytest pythonpath holds tests/)


def test_single_device_names_the_one_device_or_none():
    on_one = mlp_graph(tasks=(1, 1))
    assert single_device(on_one) == "/job:worker/task:1/device:CPU:0"
    assert device_task(single_device(on_one)) == 1
    assert single_device(mlp_graph(tasks=(0, 1))) is None          # two tasks
    assert single_device(mlp_graph(tasks=(None, None))) is None    # nothing placed
    assert single_device(mlp_graph(tasks=(None, 0))) == "/job:worker/task:0/device:CPU:0"
    legacy = mlp_graph(tasks=(None, None))
    for node in legacy.node:
        node.device = "/job:worker/replica:0/task:2/cpu:0"
    assert device_task(single_device(legacy)) == 2
    assert {n.device for n in localized(legacy).node} == {"/device:CPU:0"}
    assert {n.device for n in localized(on_one).node} - {""} == {"/device:CPU:0"}
    assert {n.device for n in on_one.node} - {""} == {"/job:worker/task:1/device:CPU:0"}   # the input unchanged
    assert runs_alone(on_one) and not runs_alone(on_one, RunControl(trace_step=2))
    assert not runs_alone(mlp_graph(tasks=(0, 1)))


def test_a_child_that_dies_without_a_result_is_a_run_error():
    with pytest.raises(RunError, match=r"exited \(rc 1\) without a result"):
        run_one_device(mlp_graph(tasks=(0, 0)), steps=2, warmup=1, prefix=["false"],
                       control=RunControl(step_timeout_s=30, setup_timeout_s=30))
    with pytest.raises(TagError, match="traced step"):
        run_one_device(mlp_graph(tasks=(0, 0)), steps=2, warmup=1, control=RunControl(trace_step=1))


class _OnOne:
    """A hand-made graph on one device as ``run_on`` takes a rewritten step (its graph and entry points)."""

    def __init__(self, graph_def):
        self.graph_def, self.train_op, self.loss, self.init = graph_def, "train_op", "loss", "init"


@pytest.mark.slow
def test_one_device_run_matches_the_server_path_and_checkpoints(tmp_path):
    import tag
    gd = mlp_graph(tasks=(1, 1))
    topo = loopback_topology(2)
    with LocalCluster(topo, threads_per_worker=1) as cluster:
        through_server = run_steps(gd, cluster.target, steps=6, warmup=1, synthetic=True)
        events = []
        path = str(tmp_path / "ckpt")
        ctl = RunControl(progress=events.append, step_timeout_s=120, setup_timeout_s=120, checkpoint_every=3,
                         checkpoint_path=path, checkpoint_meta={"plan": "one"})
        alone = run_on(cluster, _OnOne(gd), steps=6, warmup=1, control=ctl)
        # the same synthetic batch and initial weights: the same losses as through the server
        np.testing.assert_allclose(alone.losses, through_server.losses, rtol=1e-5)
        assert len(alone.step_times) == 6 and alone.warmup == 1
        assert any(e.kind == "phase" and "in-process session" in e.text for e in events)
        assert [e.step for e in events if e.kind == "step"] == [1, 2, 3, 4, 5, 6]
        assert [e.step for e in events if e.kind == "checkpoint"] == [3, 6]
        assert read_checkpoint_meta(path)["plan"] == "one"
        # resuming carries on in the child, its losses the whole curve
        resumed = cluster.run_one_device(gd, steps=8, warmup=1, control=RunControl(resume_from=path))
        assert resumed.start_step == 6 and resumed.losses[:6] == pytest.approx(alone.losses, rel=1e-6)
        # a plan on two devices runs as host programs beside the servers; a bad entry point is the child's
        # one-line error
        split = []
        two = tag.rewrite(tag.zoo.training_graph("mlp", batch_size=8, hidden=(8,)), topo, "dp_allreduce")
        run_on(cluster, two, steps=2, warmup=1, control=RunControl(progress=split.append))
        assert any("grpc://" in e.text for e in split if e.kind == "phase")
        with pytest.raises(TagError, match="no op named 'nope'"):
            cluster.run_one_device(gd, train_op="nope", steps=2, warmup=1)
