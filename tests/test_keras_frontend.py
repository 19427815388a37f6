"""tag.frontend.keras with built models and tf_keras optimizers: the step starts from the model's current weights,
each mapped optimizer updates as its tf_keras original does, and what cannot map is a one-line GraphError.

Fast: one process, no cluster (tag.fit's cluster runs are in test_keras.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tag.errors import GraphError  # noqa: E402
from tag.frontend.entry_points import find_entry_points  # noqa: E402
from tag.frontend.keras import tf1_optimizer, training_step  # noqa: E402

v1 = tf.compat.v1
K = tf_keras.optimizers


def pretrained_model(seed: int = 0):
    """A small MLP with BatchNorm whose every weight (moving statistics too) is far from its initial value."""
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([tf_keras.Input((6,)), tf_keras.layers.Dense(8, activation="relu"),
                                 tf_keras.layers.BatchNormalization(), tf_keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    for w in model.weights:
        w.assign(rng.uniform(0.5, 1.5, w.shape).astype(np.float32))
    return model


def graph_values(step, fetch: str | None = None, feeds: dict | None = None) -> dict[str, np.ndarray]:
    """The step's variables by name after its init (and one FETCH with FEEDS), in a local session."""
    g = tf.Graph()
    with g.as_default():
        v1.import_graph_def(step.graph_def, name="")
        reads = {n: tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(f"{n}:0"), dtype=tf.float32)
                 for n in step.weight_names}
        with v1.Session(graph=g) as sess:
            sess.run("init")
            if fetch:
                sess.run(fetch, feeds)
            return sess.run(reads)


def test_a_built_model_starts_from_its_current_weights_and_stays_usable():
    model = pretrained_model()
    before = [w.numpy() for w in model.weights]
    step = training_step(model, "sparse_categorical_crossentropy", "sgd", 4)
    assert step.weight_names == tuple(w.name.split(":")[0] for w in model.weights)
    values = graph_values(step)
    for name, want in zip(step.weight_names, before, strict=True):
        np.testing.assert_array_equal(values[name], want)
    assert find_entry_points(step.graph_def).init == "init"      # tag finds the init that assigns them
    assert not any("/Initializer/" in n.name for n in step.graph_def.node)   # the fresh initial values are gone
    fresh = graph_values(training_step(model, "sparse_categorical_crossentropy", "sgd", 4, keep_weights=False))
    assert not np.allclose(fresh[step.weight_names[0]], before[0])
    model.predict(np.ones((2, 6), np.float32), verbose=0)       # the eager model still works after the graph


def test_the_step_updates_batchnorm_statistics_from_its_own_inputs_only():
    """The model's BatchNorm updates read the step's ``input`` placeholder, not the model's own Input."""
    model = pretrained_model()
    step = training_step(model, "sparse_categorical_crossentropy", "sgd", 4)
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    after = graph_values(step, "train_op", {"input:0": x, "labels:0": np.zeros(4, np.int32)})
    moving_mean = step.weight_names[4]
    assert moving_mean.endswith("/moving_mean")
    assert not np.allclose(after[moving_mean], model.weights[4].numpy())


MAPPED = {
    "sgd": lambda: K.SGD(0.1),
    "sgd-nesterov": lambda: K.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: K.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6),
    "rmsprop-centered": lambda: K.RMSprop(0.01, rho=0.8, momentum=0.5, epsilon=1e-6, centered=True),
    "adagrad": lambda: K.Adagrad(0.1, initial_accumulator_value=0.2),
    "adadelta": lambda: K.Adadelta(1.0, rho=0.9, epsilon=1e-6),
    "ftrl": lambda: K.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02),
    "legacy-adam": lambda: K.legacy.Adam(0.01, beta_1=0.8),
    "legacy-rmsprop": lambda: K.legacy.RMSprop(0.01, momentum=0.3),
}


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_each_mapped_optimizer_updates_as_its_keras_original(name):
    """Four steps of the same gradients: the Keras optimizer eagerly, its TF1 mapping in a graph."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((3, 4)).astype(np.float32)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4)]
    var, keras_opt = tf.Variable(w0), MAPPED[name]()
    for grad in grads:
        keras_opt.apply_gradients([(tf.constant(grad), var)])
    mapped = tf1_optimizer(MAPPED[name]())
    g = tf.Graph()
    with g.as_default():
        w = v1.get_variable("w", initializer=w0, use_resource=True)
        fed = v1.placeholder(tf.float32, w0.shape)
        apply = mapped.apply_gradients([(fed, w)])
        init = v1.global_variables_initializer()
        with v1.Session(graph=g) as sess:
            sess.run(init)
            for grad in grads:
                sess.run(apply, {fed: grad})
            got = sess.run(w)
    assert not np.allclose(got, w0)
    np.testing.assert_allclose(got, var.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer, says", [
    (lambda: K.Nadam(), "cannot map the tf_keras optimizer Nadam"),
    (lambda: K.Adam(amsgrad=True), "Adam's amsgrad=True"),
    (lambda: K.SGD(clipnorm=1.0), "SGD's clipnorm=1.0"),
    (lambda: K.AdamW(), "optimizer AdamW"),
    (lambda: K.Adagrad(epsilon=1e-3), "Adagrad's epsilon=0.001"),
    (lambda: K.legacy.SGD(0.1, decay=0.01), "SGD's decay=0.01"),
    (lambda: K.SGD(K.schedules.ExponentialDecay(0.1, 10, 0.9)), "SGD's learning-rate schedule"),
    (lambda: "adam-ish", None),
])
def test_what_cannot_map_is_one_line_naming_it(optimizer, says):
    with pytest.raises(GraphError) as err:
        tf1_optimizer(optimizer())
    assert "\n" not in str(err.value)
    assert (says or "must be a tf_keras optimizer") in str(err.value)
