"""tag.backend.rewrite.loop_state: a tf_keras LSTM built at a static batch (its TensorList loop state holds
[batch, units] elements) rewrites under every strategy with uneven shares and trains exactly like the
original graph on one device (loss and every weight, 2 steps); so does a language model of two stacked
LSTMs (the first layer's output gradient is a list stacked with a folded ``slice(shape(t), [1], [-1])``
element shape), under dp_allreduce, ps, partition and a searched plan (float64, 3 steps, 1e-5)."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from helpers import in_process_servers  # noqa: E402
from tag.backend.rewrite import loop_state, rewrite  # noqa: E402
from tag.backend.runtime import session_config  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.frontend import real_graphs  # noqa: E402
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


def loopback(ports):
    """Three CPU hosts on PORTS with shares 4:2:2 of a batch of 8."""
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                      f'memory_gib: 2 peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}'
                      for i, (p, f) in enumerate(zip(ports, [0.1, 0.05, 0.05], strict=True)))
    return parse_topology(f'name: "lstm"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 20 }}\n')


@pytest.fixture(scope="module")
def servers():
    ports, live = in_process_servers(3)
    yield ports
    del live


@pytest.mark.parametrize("mode", ["dp_allreduce", "mixed"])
def test_static_batch_lstm_trains_exactly_under_every_strategy(servers, mode):
    ports = servers
    topo = loopback(ports)
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


# ------------------------------------------------------------------------------------------ two stacked LSTMs
STACKED = dict(batch_size=8, seq_len=6, vocab_size=50, embed=16, units=16, layers=2)


@pytest.mark.parametrize("mode", ["dp_allreduce", "ps", "partition"])
def test_stacked_static_batch_lstm_rewrites(mode):
    """Two stacked LSTMs at a fixed batch of 8 rewrite on 4:2:2 shares (the graph imports); the folded shape
    [seq, batch, units] whose slice is the element shape of the first layer's output gradient follows each
    replica's share, and data-parallel replicas run per-batch copies of the loop bodies."""
    gd = real_graphs.static_lstm_lm_graph(**STACKED)
    ir = tag.analyze(gd)
    topo = loopback([1, 2, 3])
    res = rewrite(gd, ir, builtin_strategy(mode, ir, topo, group_ops(ir, 8)), topo)
    shape = "gradients/lstm1/TensorArrayUnstack/TensorListFromTensor_grad/Shape"
    values = sorted(tuple(tf.make_ndarray(n.attr["value"].tensor)) for n in res.graph_def.node
                    if n.name == shape or n.name.startswith(shape + "/replica_"))
    if mode == "partition":
        assert values == [(6, 8, 16)]
    else:
        assert values == [(6, 2, 16), (6, 2, 16), (6, 4, 16)]
        assert {f.signature.name.rsplit("_tag_b", 1)[1] for f in res.graph_def.library.function
                if "_tag_b" in f.signature.name} == {"2", "4"}


def test_element_shape_attr_follows_the_share():
    """An element shape held in an attr (TensorArrayV3, TensorListConcat) starts with the batch: rescaled for
    an instance's share; another first entry, or the whole batch, stays."""
    from types import SimpleNamespace

    from tensorflow.core.framework import node_def_pb2

    st = SimpleNamespace(ref_batch=8)
    node = node_def_pb2.NodeDef(name="ta", op="TensorArrayV3")
    node.attr["element_shape"].shape.CopyFrom(tf.TensorShape([8, 16]).as_proto())
    assert loop_state.rescale_element_shape_attr(st, node, 2)
    assert [d.size for d in node.attr["element_shape"].shape.dim] == [2, 16]
    other = node_def_pb2.NodeDef(name="c", op="TensorListConcat")
    other.attr["element_shape"].shape.CopyFrom(tf.TensorShape([16, 8]).as_proto())
    assert not loop_state.rescale_element_shape_attr(st, other, 2)
    assert not loop_state.rescale_element_shape_attr(st, node, 8)


def test_sliced_folded_shape_in_a_loop_body_follows_the_share():
    """Inside a function body, a folded tf.shape [6, 8, 16] whose slice [1:] is a TensorList's element shape:
    the copy for 2 of 8 examples holds [6, 2, 16]; the original function is left as it is."""
    from types import SimpleNamespace

    g = tf.Graph()
    with g.as_default():
        @tf.function(input_signature=[tf.TensorSpec([6, 8, 16], tf.float32)])
        def body(x):
            shape = tf.slice(tf.shape(x), [1], [-1])
            items = tf.raw_ops.EmptyTensorList(element_shape=shape, max_num_elements=-1, element_dtype=tf.float32)
            return tf.raw_ops.TensorListPushBack(input_handle=items, tensor=x[0])
        fdef = body.get_concrete_function().function_def
    gd = tf1.GraphDef()
    gd.library.function.add().CopyFrom(fdef)
    st = SimpleNamespace(ref_batch=8, graph_def=gd, ir=SimpleNamespace(variables=[]))
    loop_state.begin_function_copies(st)
    assert loop_state._function_for(st, fdef.signature.name, 2) == fdef.signature.name + "_tag_b2"
    shapes = [tuple(tf.make_ndarray(n.attr["value"].tensor)) for f in st.added_functions for n in f.node_def
              if n.name == "Shape"]
    assert shapes == [(6, 2, 16)]
    assert [tuple(tf.make_ndarray(n.attr["value"].tensor)) for n in fdef.node_def if n.name == "Shape"] == [(6, 8, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dp_allreduce", "ps", "partition", "searched"])
def test_stacked_static_batch_lstm_trains_like_one_device(servers, mode):
    """The two-layer fixed-batch LSTM language model, built in float64, on three servers with shares 4:2:2:
    the loss and every weight equal one device's within 1e-5 over three steps, under each built-in strategy
    and under the plan tag.optimize searches."""
    from test_rewrite import assert_same_training, reference, run_rewritten

    topo = loopback(servers)
    gd = real_graphs.static_lstm_lm_graph(dtype="float64", **STACKED)
    if mode == "searched":
        plan = tag.optimize(gd, topo, playouts=8, groups=8, seed=0)
        ir, res = plan.analysis.graph, plan.analysis.rewrite(plan.strategy)
    else:
        ir = tag.analyze(gd)
        res = rewrite(gd, ir, builtin_strategy(mode, ir, topo, group_ops(ir, 8)), topo)
    rng = np.random.default_rng(0)
    shape = (STACKED["batch_size"], STACKED["seq_len"])
    batches = [{k: rng.integers(0, STACKED["vocab_size"], shape).astype(np.int32) for k in ("input", "labels")}
               for _ in range(3)]
    ref, grads0 = reference(gd, ir, batches)
    got = run_rewritten(res, ir, batches)
    assert_same_training(got, ref, grads0, ir, learning_rate=0.5, rtol=1e-5)
