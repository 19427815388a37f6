"""Training GraphDefs from tf_keras models, so Keras users need not write TF1 code.

Why: ``tag.analyze`` and the rewriter read a TF1 training step (placeholders, loss, gradients,
optimizer update). A Keras 2 (``tf_keras``) model has all of it but the step; this module builds the
step in a fresh ``tf.Graph`` (Keras 2's TF1 graph mode; Keras 3 cannot build TF1 graphs): the model's
inputs become placeholders, the loss compares the model's output with a ``labels`` placeholder, a
``tf.compat.v1.train`` optimizer minimises it.

The graph is built with an unknown batch dimension (nothing batch-sized is baked into constants or
loop bodies); the placeholders then declare ``batch_size`` as their first dimension, which is the
global batch ``tag.analyze`` reads and the rewriter splits.

Names (as in ``tag.zoo``): placeholders ``input`` (``input_0``, ``input_1``, ... for several
inputs) and ``labels``; ``loss`` (the scalar loss), ``train_op`` (one step: the update and the
layers' own updates such as BatchNorm statistics), ``init`` (every variable).

Example::

    import tf_keras
    from tag.frontend.keras import training_graph_def

    def build():
        return tf_keras.Sequential([tf_keras.Input((10,)), tf_keras.layers.Dense(3)])
    gd = training_graph_def(build, "sparse_categorical_crossentropy", "adam", batch_size=32,
                            label_shape=(), label_dtype="int32")
    # a built model works too: it is cloned (same architecture, fresh initial weights)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from tag.errors import GraphError

v1 = tf.compat.v1

__all__ = ["OPTIMIZERS", "training_graph_def"]

#: every ``tf.compat.v1.train`` optimizer, by short name (small learning rates: 3 steps stay tame)
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.05, 0.9),
    "adam": lambda: v1.train.AdamOptimizer(0.01),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.01, momentum=0.5),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.05, l1_regularization_strength=0.001),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
}


def training_graph_def(model: Any, loss: Any, optimizer: Any, batch_size: int, *,
                       label_shape: Sequence[int] | None = None, label_dtype: Any = None,
                       seed: int = 0) -> "tf.compat.v1.GraphDef":
    """The TF1 training GraphDef of MODEL under LOSS and OPTIMIZER at global batch BATCH_SIZE.

    ``model``: a ``tf_keras.Model`` (cloned into the new graph: same layers, fresh initial weights) or
    a function of no arguments that builds one (called inside the new graph).
    ``loss``: a tf_keras loss object or name, or a function ``(y_true, y_pred)``; values per example
    are averaged over the batch.
    ``optimizer``: a ``tf.compat.v1.train.Optimizer`` or one of the names in
    ``OPTIMIZERS`` ("adam", "sgd", "momentum", ...).
    ``label_shape`` / ``label_dtype``: one label per example (without the batch); by default the
    model output's shape and float32, or the output's shape without its last axis and int32 for a
    sparse categorical loss.
    Raises GraphError (one line) for a model, loss or optimizer this cannot use.
    """
    import tf_keras

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GraphError(f"batch_size must be a positive integer, got {batch_size!r}")
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(seed)
        keras_model = _model_in_graph(model, tf_keras)
        inputs = _input_placeholders(keras_model)
        outputs = keras_model(inputs[0] if len(inputs) == 1 else inputs, training=True)
        if isinstance(outputs, (list, tuple)):
            raise GraphError("training_graph_def: the model has several outputs; give it one output")
        loss_fn = _loss_function(loss, tf_keras)
        shape, dtype = _label_spec(outputs, loss, label_shape, label_dtype)
        labels = v1.placeholder(dtype, [None, *shape], name="labels")
        per_example = loss_fn(labels, outputs)
        if per_example.shape.rank is None:
            raise GraphError("training_graph_def: the loss has an unknown rank; it must be a scalar or per example")
        # a loss function (not a Loss object) gives one value per example: average them, as Keras does
        mean = per_example if per_example.shape.rank == 0 else tf.reduce_mean(per_example)
        loss_value = tf.identity(mean, name="loss")
        opt = _optimizer(optimizer)
        updates = list(getattr(keras_model, "updates", []) or [])
        step = opt.minimize(loss_value, var_list=keras_model.trainable_weights, name="apply_gradients")
        tf.group(step, *updates, name="train_op")
        v1.variables_initializer(v1.global_variables(), name="init")
    gd = g.as_graph_def()
    placeholders = {p.op.name for p in inputs} | {"labels"}
    for node in gd.node:
        if node.name in placeholders:
            node.attr["shape"].shape.dim[0].size = batch_size
    return gd


def _model_in_graph(model: Any, tf_keras: Any) -> Any:
    """The Keras model built in the current graph: MODEL cloned, or MODEL() called."""
    if isinstance(model, tf_keras.Model):
        try:
            return tf_keras.models.clone_model(model)
        except Exception as err:  # noqa: BLE001 - Keras raises many types for unclonable models
            raise GraphError(f"training_graph_def: cannot clone the model ({str(err).splitlines()[0]}); "
                             "pass a function that builds it instead") from None
    if callable(model):
        built = model()
        if not isinstance(built, tf_keras.Model):
            raise GraphError(f"training_graph_def: the model function returned {type(built).__name__}, "
                             "not a tf_keras.Model")
        return built
    raise GraphError(f"training_graph_def: model must be a tf_keras.Model or a function building one, "
                     f"got {type(model).__name__}")


def _input_placeholders(keras_model: Any) -> list:
    """One placeholder per model input, first dimension unknown, named input / input_<i>."""
    out = []
    for i, t in enumerate(keras_model.inputs):
        name = "input" if len(keras_model.inputs) == 1 else f"input_{i}"
        out.append(v1.placeholder(t.dtype, [None, *t.shape.as_list()[1:]], name=name))
    return out


def _loss_function(loss: Any, tf_keras: Any) -> Callable:
    if isinstance(loss, str):
        try:
            return tf_keras.losses.get(loss)
        except ValueError:
            raise GraphError(f"training_graph_def: unknown Keras loss {loss!r}") from None
    if callable(loss):
        return loss
    raise GraphError("training_graph_def: loss must be a Keras loss, its name or a function, "
                     f"got {type(loss).__name__}")


def _is_sparse_loss(loss: Any) -> bool:
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", "")
    return "sparse" in str(name).lower()


def _label_spec(outputs: tf.Tensor, loss: Any, label_shape: Sequence[int] | None, label_dtype: Any) -> tuple:
    """(label shape without the batch, label dtype)."""
    out_shape = outputs.shape.as_list()[1:]
    sparse = _is_sparse_loss(loss)
    if label_shape is None:
        label_shape = out_shape[:-1] if sparse else out_shape
    if any(d is None for d in label_shape):
        raise GraphError(f"training_graph_def: the label shape {list(label_shape)} is not static; pass label_shape=")
    dtype = tf.as_dtype(label_dtype) if label_dtype is not None else (tf.int32 if sparse else tf.float32)
    return [int(d) for d in label_shape], dtype


def _optimizer(optimizer: Any) -> Any:
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise GraphError(f"training_graph_def: unknown optimizer {optimizer!r}; "
                             f"use one of {', '.join(sorted(OPTIMIZERS))} or a tf.compat.v1.train optimizer")
        return OPTIMIZERS[optimizer.lower()]()
    if isinstance(optimizer, v1.train.Optimizer):
        return optimizer
    raise GraphError(f"training_graph_def: optimizer must be a tf.compat.v1.train optimizer or a name, got "
                     f"{type(optimizer).__name__} (Keras optimizers run eagerly)")
