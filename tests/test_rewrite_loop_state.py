"""tag.backend.rewrite.loop_state: a tf_keras LSTM built at a static batch (its TensorList loop state holds
[batch, units] elements) rewrites under every strategy with uneven shares and trains exactly like the
original graph on one device (loss and every weight, 2 steps)."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from helpers import in_process_servers  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.runtime import session_config  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402

tf1 = tf.compat.v1
B, S, V = 4, 5, 11


def lstm_graph():
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.int32, [B, S], name="tokens")
        y = tf1.placeholder(tf.int32, [B, S], name="labels")
        init = tf_keras.initializers
        h = tf_keras.layers.Embedding(V, 8, embeddings_initializer=init.RandomUniform(-0.5, 0.5, seed=0))(x)
        h = tf_keras.layers.LSTM(8, return_sequences=True, kernel_initializer=init.GlorotUniform(seed=1),
                                 recurrent_initializer=init.Orthogonal(seed=11))(h)
        logits = tf_keras.layers.Dense(V, kernel_initializer=init.GlorotUniform(seed=21))(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.GradientDescentOptimizer(1.0).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def run(gd, target, batches, variables, devices=True):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        reads = {v: tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(c + ":0"),
                                              dtype=g.get_operation_by_name(c).get_attr("dtype"))
                 for v, c in variables.items()}
    with tf1.Session(target, graph=g, config=session_config() if devices else None) as s:
        s.run("init")
        losses = [s.run(["train_op", "loss:0"], {"tokens:0": t, "labels:0": lab})[1] for t, lab in batches]
        return losses, s.run(reads)


@pytest.fixture(scope="module")
def servers():
    ports, live = in_process_servers(3)
    yield ports
    del live


@pytest.mark.parametrize("mode", ["dp_allreduce", "mixed"])
def test_static_batch_lstm_trains_exactly_under_every_strategy(servers, mode):
    ports = servers
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                      f'memory_gib: 2 peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}'
                      for i, (p, f) in enumerate(zip(ports, [0.1, 0.05, 0.05], strict=True)))
    topo = parse_topology(f'name: "lstm"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 20 }}\n')
    gd = lstm_graph()
    ir = tag.analyze(gd)
    grouping = group_ops(ir, 8)
    if mode == "mixed":
        part = builtin_strategy("partition", ir, topo, grouping)
        everything = tuple(g.index for g in topo.groups)
        actions = [Action(everything, "allreduce") if g % 2 == 0 else Action(everything, "partition")
                   for g in range(grouping.num_groups)]
        st = Strategy(grouping, actions, {int(i): part.partition[int(i)] for g in range(grouping.num_groups)
                                          if g % 2 for i in grouping.members(g)})
    else:
        st = builtin_strategy(mode, ir, topo, grouping)
    res = rewrite(gd, ir, st, topo)
    assert any("_tag_b" in f.signature.name for f in res.graph_def.library.function) or mode == "mixed"
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, (B, S)).astype(np.int32), rng.integers(0, V, (B, S)).astype(np.int32))
               for _ in range(2)]
    names = [v.name for v in ir.variables if v.kind == "trainable"]
    ref_losses, ref = run(gd, "", batches, {n: n for n in names}, devices=False)
    got_losses, got = run(res.graph_def, f"grpc://127.0.0.1:{ports[0]}", batches,
                          {n: res.variables[n][0] for n in names})
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)
    for n in names:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-5, atol=1e-6, err_msg=n)
