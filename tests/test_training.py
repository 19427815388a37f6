"""tag.train: per-host input pipelines, TensorFlow checkpoints under the original names, curves.

Correctness is checked against the original graph trained on one device on the same batches: the
checkpoint of a mixed strategy (allreduce, ps and partitioned op groups, uneven shares), restored into
the original graph with TensorFlow's own ``Saver``, holds the same weights.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from helpers import forward_group_order, in_process_servers  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.runtime.checkpoint import export_npz, read_checkpoint_meta  # noqa: E402
from tag.backend.runtime.input_pipeline import build_inputs, plan_pipelines  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.errors import GraphError, TagError  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.pipeline import Pipeline, PipelineStage  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402

tf1 = tf.compat.v1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, FEATURES, CLASSES = 8, 6, 3


def build_model():
    """A 2-layer MLP with Adam, built in Python (variables, a Saver), and its GraphDef."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
        y = tf1.placeholder(tf.int64, [BATCH], name="y")
        w1 = tf1.get_variable("w1", [FEATURES, 16])
        b1 = tf1.get_variable("b1", [16], initializer=tf1.zeros_initializer())
        w2 = tf1.get_variable("w2", [16, CLASSES])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.AdamOptimizer(0.05).minimize(loss, name="train_op")
        init = tf1.global_variables_initializer()
    return g, init


def data(n_batches: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n_batches * BATCH, FEATURES)).astype(np.float32)
    ys = np.argmax(xs[:, :CLASSES], axis=1).astype(np.int64)     # learnable: the largest of 3 features
    return xs, ys


def topology(ports):
    """Three loopback CPU hosts of unequal speed: uneven batch shares (4:2:2 of 8)."""
    hosts = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU memory_gib: 2 '
        f'peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}'
        for i, (p, f) in enumerate(zip(ports, [0.1, 0.05, 0.05], strict=True)))
    return parse_topology(f'name: "train"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n')


def mixed_strategy(ir, topo) -> Strategy:
    """Op groups in turn allreduce, ps and partitioned over every device."""
    grouping = group_ops(ir, 9)
    everything = tuple(g.index for g in topo.groups)
    part = builtin_strategy("partition", ir, topo, grouping)
    actions, partition = [], {}
    for g in range(grouping.num_groups):
        mode = ("allreduce", "ps", "partition")[g % 3]
        if mode == "partition":
            actions.append(Action(everything, "partition"))
            partition.update({int(i): part.partition[int(i)] for i in grouping.members(g)})
        else:
            actions.append(Action(everything, mode, ps_device=2 if mode == "ps" else None))
    return Strategy(grouping, actions, partition)


def single_device_training(xs, ys, steps):
    """(weights by variable name, losses) of the original graph trained on one device, batch by batch."""
    g, init = build_model()
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        losses = [sess.run(["train_op", "loss:0"], {"x:0": xs[k * BATCH:(k + 1) * BATCH],
                                                     "y:0": ys[k * BATCH:(k + 1) * BATCH]})[1] for k in range(steps)]
        return {v.op.name: sess.run(v) for v in g.get_collection("variables")}, losses


@pytest.fixture(scope="module")
def cluster():
    ports, servers = in_process_servers(3)
    yield ports, f"grpc://127.0.0.1:{ports[0]}"
    del servers


@pytest.fixture(scope="module")
def mixed_plan(cluster):
    ports, _ = cluster
    g, _ = build_model()
    gd = g.as_graph_def()
    ir = tag.analyze(gd)
    topo = topology(ports)
    return rewrite(gd, ir, mixed_strategy(ir, topo), topo, init="init")


def presliced(xs, ys):
    """dataset_fn giving batches already cut to the pipeline's share (ctx.batch_range of each global batch)."""
    def dataset_fn(ctx):
        lo, hi = ctx.batch_range
        assert ctx.get_per_replica_batch_size(BATCH) == ctx.batch_size == hi - lo
        ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(BATCH, drop_remainder=True)
        return ds.skip(ctx.start_step).map(lambda x, y: (x[lo:hi], y[lo:hi]))
    return dataset_fn


def test_mixed_strategy_checkpoint_restores_into_the_original_graph(mixed_plan, tmp_path):
    """3 steps of a mixed plan on per-host pipelines; the data set ends before the 5 steps asked; the
    checkpoint (TF format, original names, one copy each) restored into the original graph by a Saver
    equals single-device training on the same batches, weight by weight.

    On servers of its own: the step that finds the data set's end aborts collectives in flight, and TF
    cleans that step up on the servers after the session has returned (a CI run once saw the next test's
    first step on shared servers fail with AbortedError)."""
    ports, _servers = in_process_servers(3)        # held until the test ends
    target = f"grpc://127.0.0.1:{ports[0]}"
    xs, ys = data(3)
    specs = plan_pipelines(mixed_plan.graph_def, mixed_plan.inputs, BATCH)
    assert [(s.task, s.lo, s.hi) for s in specs] == [(0, 0, 4), (1, 4, 6), (2, 6, 8)]   # uneven shares
    evals = []
    def eval_fn(w, step):
        evals.append((step, sorted(w)))
        return {"w1_norm": float(np.abs(w["w1"]).sum())}

    result = tag.train(mixed_plan, presliced(xs, ys), steps=5, checkpoint_dir=tmp_path / "ckpt", target=target,
                       eval_fn=eval_fn,
                       progress=False)
    assert result.ended_early and result.steps_done == 3 and len(result.losses) == 3
    ref, ref_losses = single_device_training(xs, ys, 3)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-5)
    reader = tf.train.load_checkpoint(result.checkpoint)
    assert set(reader.get_variable_to_shape_map()) == set(ref)          # one entry per original variable
    g, _ = build_model()
    with tf1.Session(graph=g) as sess:
        tf1.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path / "ckpt")))
        restored = {v.op.name: sess.run(v) for v in g.get_collection("variables")}
    for name, value in ref.items():
        np.testing.assert_allclose(restored[name], value, rtol=1e-5, atol=2e-5, err_msg=name)  # Adam: ~0 gradients
    assert read_checkpoint_meta(tmp_path / "ckpt")["step"] == 3
    assert evals == [(3, sorted(ref))] and result.evals[0][0] == 3
    assert glob.glob(str(tmp_path / "ckpt" / "events.out.tfevents.*"))      # TensorBoard scalars
    with np.load(export_npz(tmp_path / "ckpt", tmp_path / "w.npz"), allow_pickle=False) as npz:
        np.testing.assert_allclose(npz["w2"], ref["w2"], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("schedule", ["fill_drain", "1f1b"])
def test_pipelined_plan_trains_from_per_host_pipelines(cluster, tmp_path, schedule):
    """A two-stage pipeline (the first layer on h0, the rest data parallel over h1 and h2, 2 micro-batches)
    fed by per-host input pipelines: losses and the checkpoint equal single-device training, 3 steps."""
    ports, target = cluster
    g, _ = build_model()
    gd = g.as_graph_def()
    ir = tag.analyze(gd)
    topo = topology(ports)
    grouping = group_ops(ir, 9)
    order, rest = forward_group_order(ir, grouping)
    pipe = Pipeline((PipelineStage(tuple(order[:1]), (0,)), PipelineStage(tuple(order[1:] + rest), (1, 2))),
                    2, schedule)
    plan = rewrite(gd, ir, Strategy.pipelined(grouping, pipe), topo, init="init")
    xs, ys = data(3)
    result = tag.train(plan, presliced(xs, ys), steps=3, checkpoint_dir=tmp_path / "ckpt", target=target,
                       progress=False)
    assert result.steps_done == 3
    ref, ref_losses = single_device_training(xs, ys, 3)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-5)
    from tag.training import load_weights
    weights = load_weights(tmp_path / "ckpt")
    for name, value in ref.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-5, atol=2e-5, err_msg=name)


def test_resume_continues_the_curve(cluster, mixed_plan, tmp_path):
    """2 steps, checkpoint, resume to 3 (the data set skips ctx.start_step batches): the same weights and
    losses as 3 steps in one go."""
    _, target = cluster
    xs, ys = data(3)
    first = tag.train(mixed_plan, presliced(xs, ys), steps=2, checkpoint_dir=tmp_path, target=target, progress=False)
    assert first.steps_done == 2 and not first.ended_early
    resumed = tag.train(mixed_plan, presliced(xs, ys), steps=3, checkpoint_dir=tmp_path, resume=True,
                        target=target, progress=False)
    assert resumed.start_step == 2 and resumed.steps_done == 3 and len(resumed.step_times) == 1
    ref, ref_losses = single_device_training(xs, ys, 3)
    np.testing.assert_allclose(resumed.losses, ref_losses, rtol=1e-5)
    from tag.training import load_weights
    weights = load_weights(tmp_path)
    for name, value in ref.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-5, atol=2e-5, err_msg=name)  # Adam: ~0 gradients
    with pytest.raises(TagError, match="nothing left"):
        tag.train(mixed_plan, presliced(xs, ys), steps=3, checkpoint_dir=tmp_path, resume=True, target=target,
                  progress=False)


def test_single_examples_are_batched_per_host_and_matched_by_name(cluster, tmp_path):
    """Data parallel over 3 hosts: a dict of single examples is batched at each host's share; training
    reduces the loss; the client sends no example (its feeds are empty)."""
    ports, target = cluster
    g, _ = build_model()
    plan = tag.rewrite(g.as_graph_def(), topology(ports), "dp_allreduce", init="init")
    xs, ys = data(40)
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.batch_size))
        ds = tf.data.Dataset.from_tensor_slices({"x": xs, "y": ys})
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat()

    result = tag.train(plan, dataset_fn, steps=30, target=target, progress=False)
    shares = [s.hi - s.lo for s in plan_pipelines(plan.graph_def, plan.inputs, BATCH)]
    assert sorted(seen) == [(k, 3, n) for k, n in enumerate(shares)] and sum(shares) == BATCH
    assert [s.task for s in result.pipelines] == [0, 1, 2]
    assert result.steps_done == 30 and not result.ended_early
    assert np.mean(result.losses[-5:]) < 0.7 * np.mean(result.losses[:5])
    assert result.client_bytes["feeds"] == 0


def test_mismatched_data_sets_are_one_line_errors_naming_the_input(mixed_plan):
    gd, inputs = mixed_plan.graph_def, mixed_plan.inputs
    cases = [
        (lambda ctx: tf.data.Dataset.from_tensor_slices({"x": np.zeros((8, FEATURES), np.float64),
                                                         "y": np.zeros(8, np.int64)}), "input 'x'.*float64"),
        (lambda ctx: tf.data.Dataset.from_tensor_slices((np.zeros((8, FEATURES + 1), np.float32),
                                                         np.zeros(8, np.int64))), "input 'x'.*\\[7\\]"),
        (lambda ctx: tf.data.Dataset.from_tensor_slices({"x": np.zeros((8, FEATURES), np.float32)}),
         "no element for 'y'"),
        (lambda ctx: tf.data.Dataset.from_tensor_slices(np.zeros((8, FEATURES), np.float32)), "1 parts"),
        (lambda ctx: [1, 2], "not a tf.data.Dataset"),
    ]
    for fn, pattern in cases:
        with pytest.raises(TagError, match=pattern) as err:
            build_inputs(tf.Graph(), gd, inputs, BATCH, fn)
        assert "\n" not in str(err.value)
    assert isinstance(err.value, TagError)
    with pytest.raises(GraphError, match="batch input 'nope'"):
        plan_pipelines(gd, ["nope"], BATCH)


def test_deploy_input_spec_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from tag.cli import deploy
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_data.py").write_text("import no_such_module_anywhere\n")
    (tmp_path / "good_data.py").write_text("train_set = 3\n")
    base = ["--topo", os.path.join(REPO, "topologies", "localhost.pbtxt"), "--model", "zoo:mlp", "--strategy",
            "dp_allreduce"]
    for argv, words in ((["--run", "--input", "nocolon"], "expected MODULE:FUNCTION"),
                        (["--run", "--input", "broken_data:f"], "cannot import broken_data (ModuleNotFoundError"),
                        (["--run", "--input", "good_data:nope"], "has no 'nope'"),
                        (["--run", "--input", "good_data:train_set"], "not a function"),
                        (["--input", "good_data:train_set"], "only apply to --run")):
        assert deploy.main(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_deploy_run_input_trains_on_the_data_set_and_checkpoints(tmp_path):
    """tag-deploy --run --input module:function on 3 local workers: trains, reports, writes a TF checkpoint."""
    import json
    import subprocess
    import sys

    from tag.backend.runtime import free_ports
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                      f'memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}'
                      for i, p in enumerate(free_ports(3)))
    (tmp_path / "loop.pbtxt").write_text(f'name: "loop"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 20 }}\n')
    (tmp_path / "my_data.py").write_text(
        "import numpy as np\nimport tensorflow as tf\n\n"
        "def train_set(ctx):\n"
        "    rng = np.random.default_rng(ctx.input_pipeline_id)\n"
        "    x = rng.standard_normal((60, 32)).astype(np.float32)\n"
        "    y = (x[:, 0] > 0).astype(np.int32)\n"
        "    return tf.data.Dataset.from_tensor_slices((x, y))       # ends after a few steps\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tag.cli.deploy", "--topo", "loop.pbtxt", "--model",
                           "zoo:mlp,input_dim=32,hidden=16", "--batch", "24", "--strategy", "dp_allreduce", "--run",
                           "--input", "my_data:train_set", "--steps", "50", "--report", "r.json"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = json.loads((tmp_path / "r.json").read_text())["trained"]
    assert trained["ended_early"] and trained["steps_done"] == 7 and len(trained["pipelines"]) == 3
    assert "the data set ended first" in done.stderr
    assert tf.train.load_checkpoint(str(tmp_path / trained["checkpoint"])).has_tensor("mlp/dense_0/kernel")


def test_a_rewrite_without_a_topology_is_named_as_such():
    """tag.train of something with no cluster says to pass topology=, not that a plan was loaded from files."""
    import dataclasses
    g, _ = build_model()
    rewritten = tag.rewrite(g.as_graph_def(), topology([0, 0, 0]), "dp_allreduce", init="init")
    with pytest.raises(TagError, match=r"^tag.train: the plan names no cluster; pass topology="):
        tag.train(dataclasses.replace(rewritten, topology=None), lambda ctx: None, steps=1)


@pytest.mark.slow
def test_a_rewrite_trains_on_its_own_loopback_topology_without_topology(tmp_path):
    """tag.train(tag.rewrite(...)) with no topology= and no target=: the rewrite's own cluster (port 0: free ports)
    is started for it."""
    g, _ = build_model()
    plan = tag.rewrite(g.as_graph_def(), topology([0, 0, 0]), "dp_allreduce", init="init")
    xs, ys = data(10)
    result = tag.train(plan, lambda ctx: tf.data.Dataset.from_tensor_slices({"x": xs, "y": ys}).repeat(), steps=3,
                       progress=False)
    assert result.steps_done == 3 and np.all(np.isfinite(result.losses))
