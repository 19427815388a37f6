"""tag.frontend.entry_points: the step op, loss and initialiser of graphs built the way users build them."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from tag.errors import GraphError  # noqa: E402
from tag.frontend.entry_points import EntryPoints, find_entry_points  # noqa: E402

v1 = tf.compat.v1


def _model(batch=8, features=4):
    """Placeholders and a two-layer network; returns (x, y, weights, logits)."""
    x = v1.placeholder(tf.float32, [batch, features], name="x")
    y = v1.placeholder(tf.int32, [batch], name="y")
    w1 = v1.get_variable("w1", [features, 6])
    w2 = v1.get_variable("w2", [6, 3])
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    return x, y, (w1, w2), logits


def _xent(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def test_adam_minimize_without_names():
    g = tf.Graph()
    with g.as_default():
        _, y, _, logits = _model()
        loss = _xent(y, logits)
        step = v1.train.AdamOptimizer(0.01).minimize(loss)
        init = v1.global_variables_initializer()
    ep = find_entry_points(g.as_graph_def())
    assert ep == EntryPoints(step.name, loss.op.name, init.name)
    assert step.name == "Adam" and ep.added == ()
    assert any("gradient seed" in n for n in ep.notes)


def test_gradient_descent_with_named_loss_and_global_step():
    g = tf.Graph()
    with g.as_default():
        _, y, _, logits = _model()
        loss = tf.identity(_xent(y, logits), name="my_loss")
        step = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=v1.train.get_or_create_global_step())
        init = v1.global_variables_initializer()
    gd = g.as_graph_def()
    ep = find_entry_points(gd)
    assert step.type == "AssignAddVariableOp"         # minimize(global_step=...) returns the increment
    assert (ep.train_op, ep.loss, ep.init) == (step.name, "my_loss", init.name)
    # explicit names win ("op:0" accepted for an op)
    mean = next(n.name for n in gd.node if n.op == "Mean")
    ep = find_entry_points(gd, loss=mean + ":0", train_op="GradientDescent/update", init="w1/Assign")
    assert (ep.train_op, ep.loss, ep.init) == ("GradientDescent/update", mean, "w1/Assign")


def test_two_optimizers_are_ambiguous_until_named():
    g = tf.Graph()
    with g.as_default():
        _, y, (w1, w2), logits = _model()
        loss = _xent(y, logits)
        a = v1.train.AdamOptimizer(0.01).minimize(loss, var_list=[w1])
        b = v1.train.GradientDescentOptimizer(0.1).minimize(2.0 * loss, var_list=[w2])
        v1.global_variables_initializer()
    gd = g.as_graph_def()
    with pytest.raises(GraphError, match="2 candidate train ops") as err:
        find_entry_points(gd)
    assert a.name in str(err.value) and b.name in str(err.value) and "train_op=" in str(err.value)
    ep = find_entry_points(gd, train_op=b.name)
    assert ep.train_op == b.name and ep.loss is not None and ep.init == "init"


def test_init_never_runs_a_training_step():
    """A NoOp grouping the initialisers with the training step is not an initialiser."""
    g = tf.Graph()
    with g.as_default():
        _, y, _, logits = _model()
        step = v1.train.GradientDescentOptimizer(0.1).minimize(_xent(y, logits))
        setup = v1.variables_initializer(v1.global_variables(), name="setup")
        tf.group(setup, step, name="setup_and_train")
    ep = find_entry_points(g.as_graph_def(), train_op=step.name)
    assert ep.train_op == "GradientDescent" and ep.init == "setup"


def test_two_optimizers_grouped_are_one_step():
    g = tf.Graph()
    with g.as_default():
        _, y, (w1, w2), logits = _model()
        loss = _xent(y, logits)
        a = v1.train.AdamOptimizer(0.01).minimize(loss, var_list=[w1])
        b = v1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=[w2])
        tf.group(a, b, name="step")
    ep = find_entry_points(g.as_graph_def())
    assert ep.train_op == "step" and ep.loss == loss.op.name


def test_summed_loss_terms_and_made_up_init():
    """A loss whose gradient passes through (AddN) is found as the sum; without an init op one is made up."""
    g = tf.Graph()
    with g.as_default():
        _, y, (w1, _), logits = _model()
        total = tf.add_n([_xent(y, logits), 1e-3 * tf.nn.l2_loss(w1)], name="total")
        v1.train.MomentumOptimizer(0.1, 0.9).minimize(total)
    gd = g.as_graph_def()
    ep = find_entry_points(gd)
    assert ep.train_op == "Momentum" and ep.loss == "total"
    assert ep.init == "tag_init" and [n.name for n in ep.added] == ["tag_init"]
    assert len(ep.added[0].input) == 4                 # w1, w2 and their momentum slots
    out = ep.apply(gd)
    assert out is not gd and "tag_init" in {n.name for n in out.node} and "tag_init" not in {n.name for n in gd.node}
    assert ep.apply(out) is out                        # idempotent
    _run_init(out, "tag_init")


def test_vector_loss_with_unknown_batch():
    """gradients/Shape is a Shape op of the loss when the loss's shape is not static."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w = v1.get_variable("w", [4, 3])
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w))
        v1.train.GradientDescentOptimizer(0.1).minimize(per_example)
        v1.global_variables_initializer()
    gd = g.as_graph_def()
    assert next(n for n in gd.node if n.name == "gradients/Shape").op == "Shape"
    ep = find_entry_points(gd)
    assert ep.loss == per_example.op.name and ep.train_op == "GradientDescent"


def test_apply_ops_without_grouping_get_a_made_up_train_op():
    g = tf.Graph()
    with g.as_default():
        _, y, (w1, w2), logits = _model()
        loss = _xent(y, logits)
        g1, g2 = tf.gradients(loss, [w1, w2])
        tf.raw_ops.ResourceApplyGradientDescent(var=w1.handle, alpha=0.1, delta=g1, name="upd1")
        tf.raw_ops.ResourceApplyGradientDescent(var=w2.handle, alpha=0.1, delta=g2, name="upd2")
    gd = g.as_graph_def()
    ep = find_entry_points(gd)
    assert ep.train_op == "tag_train_op" and ep.loss == loss.op.name
    made = {n.name: n for n in ep.added}
    assert sorted(made["tag_train_op"].input) == ["^upd1", "^upd2"]
    assert "made up" in ep.notes[0]


def test_one_apply_op_is_the_step():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [8, 4], name="x")
        w = v1.get_variable("w", [4, 1])
        loss = tf.reduce_mean(tf.matmul(x, w))
        (gw,) = tf.gradients(loss, [w])
        tf.raw_ops.ResourceApplyGradientDescent(var=w.handle, alpha=0.1, delta=gw, name="upd")
    ep = find_entry_points(g.as_graph_def())
    assert ep.train_op == "upd" and ep.init == "w/Assign" and ep.added == ()


def test_zoo_names_and_errors():
    from tag import zoo
    gd = zoo.training_graph("mlp", batch_size=8, input_dim=20, hidden=(32, 16), num_classes=5)
    ep = find_entry_points(gd)
    assert (ep.train_op, ep.loss, ep.init) == ("train_op", "loss", "init")
    with pytest.raises(GraphError, match="did you mean 'train_op'"):
        find_entry_points(gd, train_op="train_ops")
    g = tf.Graph()
    with g.as_default():
        tf.matmul(v1.placeholder(tf.float32, [2, 2]), tf.ones([2, 2]))
    with pytest.raises(GraphError, match="no optimizer"):
        find_entry_points(g.as_graph_def())


def _run_init(gd, init):
    g = tf.Graph()
    with g.as_default():
        tf.import_graph_def(gd, name="")
        with v1.Session(graph=g) as sess:
            sess.run(init)
            assert sess.run(v1.report_uninitialized_variables()).size == 0
