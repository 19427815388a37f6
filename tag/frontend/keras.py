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
    # a built model works too: it is cloned, its variables starting from the model's current weights
    step = training_step(model, "mse", tf_keras.optimizers.SGD(0.01), batch_size=32)
    step.weight_names        # the graph's variable name of each of model.weights, e.g. ('dense/kernel', ...)

A built model's current weights (BatchNorm statistics included) travel into the graph as the values its
variables' initial assignments (``<var>/Assign``, grouped by ``init``) take, so a pretrained model trains on from
where it is (the GraphDef grows by the weights' size: TensorFlow caps a GraphDef at 2 GB). tf_keras optimizers map
to the ``tf.compat.v1.train`` optimizer of the same update rule and hyperparameters (``tf1_optimizer``); what has
no TF1 equivalent is a one-line GraphError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tag.errors import GraphError

v1 = tf.compat.v1

__all__ = ["OPTIMIZERS", "KerasStep", "tf1_optimizer", "training_graph_def", "training_step"]

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


@dataclass(frozen=True)
class KerasStep:
    """A tf_keras model's TF1 training step: the GraphDef, and the graph's variable name of each of the model's
    weights in ``model.weights`` order (empty for a model given as a function), to carry trained values back."""

    graph_def: Any
    weight_names: tuple[str, ...]


def training_graph_def(model: Any, loss: Any, optimizer: Any, batch_size: int, *,
                       label_shape: Sequence[int] | None = None, label_dtype: Any = None,
                       seed: int = 0, keep_weights: bool = True) -> "tf.compat.v1.GraphDef":
    """The TF1 training GraphDef of MODEL under LOSS and OPTIMIZER at global batch BATCH_SIZE
    (``training_step(...).graph_def``).

    ``model``: a ``tf_keras.Model`` (cloned into the new graph: same layers; its variables start from the
    model's current weights, or from fresh initial values when KEEP_WEIGHTS is False) or a function of no
    arguments that builds one (called inside the new graph).
    ``loss``: a tf_keras loss object or name, or a function ``(y_true, y_pred)``; values per example
    are averaged over the batch.
    ``optimizer``: a ``tf.compat.v1.train.Optimizer``, a tf_keras optimizer (``tf1_optimizer``) or one of the
    names in ``OPTIMIZERS`` ("adam", "sgd", "momentum", ...: small fixed learning rates for tests).
    ``label_shape`` / ``label_dtype``: one label per example (without the batch); by default the
    model output's shape and float32, or the output's shape without its last axis and int32 for a
    sparse categorical loss.
    Raises GraphError (one line) for a model, loss or optimizer this cannot use.
    """
    return training_step(model, loss, optimizer, batch_size, label_shape=label_shape, label_dtype=label_dtype,
                         seed=seed, keep_weights=keep_weights).graph_def


def training_step(model: Any, loss: Any, optimizer: Any, batch_size: int, *,
                  label_shape: Sequence[int] | None = None, label_dtype: Any = None,
                  seed: int = 0, keep_weights: bool = True) -> KerasStep:
    """``training_graph_def``'s step with the graph's name of each model weight (``KerasStep``)."""
    import tf_keras

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GraphError(f"batch_size must be a positive integer, got {batch_size!r}")
    current = _current_weights(model) if keep_weights and isinstance(model, tf_keras.Model) else None
    opt = _optimizer(optimizer)               # a tf_keras optimizer's settings read eagerly, outside the graph
    made: list = list(model._flatten_layers(include_self=True)) if isinstance(model, tf_keras.Model) else []
    try:
        gd, inputs, names = _build_step(model, loss, opt, seed, label_shape, label_dtype, current, made, tf_keras)
    finally:
        _restore_eager_classes({type(layer) for layer in made})
    placeholders = {p.op.name for p in inputs} | {"labels"}
    for node in gd.node:
        if node.name in placeholders:
            node.attr["shape"].shape.dim[0].size = batch_size
    return KerasStep(gd, names)


def _build_step(model: Any, loss: Any, opt: Any, seed: int, label_shape: Sequence[int] | None, label_dtype: Any,
                current: list[np.ndarray] | None, made: list, tf_keras: Any) -> tuple[Any, list, tuple[str, ...]]:
    """(GraphDef, input placeholders, the graph's name of each model weight) of the step, built in a fresh graph;
    MADE gets the layers built there."""
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(seed)
        keras_model = _model_in_graph(model, tf_keras)
        made.extend(keras_model._flatten_layers(include_self=True))
        inputs = _input_placeholders(keras_model)
        # only the updates of this call: building the model on its own Input adds some that read that Input
        earlier = {_op_name(u) for u in getattr(keras_model, "updates", []) or []}
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
        updates = [u for u in getattr(keras_model, "updates", []) or [] if _op_name(u) not in earlier]
        step = opt.minimize(loss_value, var_list=keras_model.trainable_weights, name="apply_gradients")
        tf.group(step, *updates, name="train_op")
        names = tuple(v.op.name for v in keras_model.weights) if isinstance(model, tf_keras.Model) else ()
        assigns = _current_values(keras_model.weights, current) if current is not None else {}
        v1.variables_initializer(v1.global_variables(), name="init")
    return _assigning(g.as_graph_def(), assigns), inputs, names


def _restore_eager_classes(classes: set[type]) -> None:
    """Undo what making CLASSES' layers in a TF1 graph did to them: tf_keras swaps a layer class's base classes
    for their TF1 versions then, so that layers and models already made eagerly (the user's model) fail
    (``model.predict``: "Your Layer or Model is in an invalid state"); swap the eager ones back."""
    from tf_keras.src.engine import base_layer, base_layer_v1, training, training_v1
    from tf_keras.src.utils.version_utils import swap_class
    for cls in classes:
        if issubclass(cls, (training.Model, training_v1.Model)):
            swap_class(cls, training.Model, training_v1.Model, True)
        swap_class(cls, base_layer.Layer, base_layer_v1.Layer, True)


def _op_name(update: Any) -> str:
    return getattr(update, "op", update).name


def _current_weights(model: Any) -> list[np.ndarray]:
    """MODEL's weights now (read eagerly, before tag's graph is entered)."""
    try:
        return [np.asarray(w.numpy()) for w in model.weights]
    except Exception as err:  # noqa: BLE001 - graph-mode variables have no value outside their session
        raise GraphError(f"training_graph_def: cannot read the model's weights ({str(err).splitlines()[0]}); "
                         "build the model eagerly, or pass keep_weights=False") from None


def _current_values(weights: Sequence[Any], values: Sequence[np.ndarray]) -> dict[str, str]:
    """Constants holding VALUES (the model's, in WEIGHTS' order) beside WEIGHTS (the clone's variables); returns
    {each variable's initial assignment op: the constant it is to assign}."""
    if len(weights) != len(values) or any(tuple(w.shape) != v.shape for w, v in zip(weights, values, strict=True)):
        raise GraphError("training_graph_def: the clone's weights do not match the model's "
                         f"({len(weights)} against {len(values)}); pass keep_weights=False or a function")
    out = {}
    for w, value in zip(weights, values, strict=True):
        with tf.name_scope(f"{w.op.name}/"):
            out[w.initializer.name] = tf.constant(value, dtype=w.dtype.base_dtype, name="current_value").op.name
    return out


def _assigning(gd: Any, current: dict[str, str]) -> Any:
    """GD with each initial assignment of CURRENT assigning its constant (so whatever finds a variable's
    initial value by its ``<var>/Assign`` op finds the model's), the initialisers no longer read dropped."""
    if not current:
        return gd
    for node in gd.node:
        if node.name in current:
            node.input[1] = current[node.name]
    dropped = tuple(name.rsplit("/", 1)[0] + "/Initializer/" for name in current)
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in gd.node}
    keep: set[str] = set()
    stack = [n.name for n in gd.node if not n.name.startswith(dropped)]
    while stack:
        name = stack.pop()
        if name not in keep:
            keep.add(name)
            stack.extend(inputs.get(name, ()))
    kept = [n for n in gd.node if n.name in keep]
    del gd.node[:]
    gd.node.extend(kept)
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
    return tf1_optimizer(optimizer)


# ------------------------------------------------------------------------------------------------ tf_keras optimizers
class _RMSPropFromZero(v1.train.RMSPropOptimizer):
    """TF1's RMSProp with its mean square starting at 0, as tf_keras's RMSprop (TF1's starts at 1)."""

    def _create_slots(self, var_list):
        for v in var_list:
            self._zeros_slot(v, "rms", self._name)
            if self._centered:
                self._zeros_slot(v, "mg", self._name)
            self._zeros_slot(v, "momentum", self._name)


def _sgd(lr: float, c: dict) -> Any:
    if not c.get("momentum") and not c.get("nesterov"):
        return v1.train.GradientDescentOptimizer(lr)
    return v1.train.MomentumOptimizer(lr, float(c["momentum"]), use_nesterov=bool(c.get("nesterov")))


def _adagrad(lr: float, c: dict) -> Any:
    # TF1's Adagrad has no epsilon; it only guards an accumulator that starts at initial_accumulator_value > 0
    if float(c.get("epsilon", 0.0)) > 1e-7:
        raise GraphError(f"cannot map tf_keras Adagrad's epsilon={c['epsilon']} to tf.compat.v1.train.Adagrad"
                         f"Optimizer, which has none (epsilon <= 1e-7 maps)")
    return v1.train.AdagradOptimizer(lr, initial_accumulator_value=float(c["initial_accumulator_value"]))


#: tf_keras optimizer class -> (its TF1 optimizer from (learning rate, config), the config keys it maps)
_KERAS_OPTIMIZERS: dict[str, tuple[Callable[[float, dict], Any], frozenset]] = {
    "SGD": (_sgd, frozenset({"momentum", "nesterov"})),
    "Adam": (lambda lr, c: v1.train.AdamOptimizer(lr, beta1=float(c["beta_1"]), beta2=float(c["beta_2"]),
                                                  epsilon=float(c["epsilon"])),
             frozenset({"beta_1", "beta_2", "epsilon"})),
    "RMSprop": (lambda lr, c: _RMSPropFromZero(lr, decay=float(c["rho"]), momentum=float(c["momentum"]),
                                               epsilon=float(c["epsilon"]), centered=bool(c["centered"])),
                frozenset({"rho", "momentum", "epsilon", "centered"})),
    "Adagrad": (_adagrad, frozenset({"initial_accumulator_value", "epsilon"})),
    "Adadelta": (lambda lr, c: v1.train.AdadeltaOptimizer(lr, rho=float(c["rho"]), epsilon=float(c["epsilon"])),
                 frozenset({"rho", "epsilon"})),
    "Ftrl": (lambda lr, c: v1.train.FtrlOptimizer(
        lr, learning_rate_power=float(c["learning_rate_power"]),
        initial_accumulator_value=float(c["initial_accumulator_value"]),
        l1_regularization_strength=float(c["l1_regularization_strength"]),
        l2_regularization_strength=float(c["l2_regularization_strength"]),
        l2_shrinkage_regularization_strength=float(c["l2_shrinkage_regularization_strength"]), beta=float(c["beta"])),
             frozenset({"learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
                        "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta"})),
}
#: config keys that change nothing while off (their value when off), and keys that never change the update
_OFF = {"clipnorm": None, "global_clipnorm": None, "clipvalue": None, "weight_decay": (None, 0, 0.0),
        "use_ema": False, "decay": 0.0, "amsgrad": False}
_NEUTRAL = frozenset({"name", "jit_compile", "is_legacy_optimizer", "ema_momentum", "ema_overwrite_frequency"})


def tf1_optimizer(optimizer: Any) -> Any:
    """The ``tf.compat.v1.train`` optimizer with OPTIMIZER's update rule and hyperparameters.

    OPTIMIZER: a tf_keras optimizer (``tf_keras.optimizers.Adam(1e-3)``, a legacy one too): SGD (momentum,
    nesterov), Adam, RMSprop, Adagrad, Adadelta or Ftrl, with a constant learning rate. Raises GraphError (one
    line) naming the optimizer or the hyperparameter that has no TF1 equivalent (AMSGrad, weight decay, gradient
    clipping, EMA, learning-rate schedules and decay, other optimizer classes).

    Example::

        tf1_optimizer(tf_keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True))   # a MomentumOptimizer
    """
    import tf_keras
    kinds = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)
    if not isinstance(optimizer, kinds):
        raise GraphError(f"optimizer must be a tf_keras optimizer, its name or a tf.compat.v1.train optimizer, got "
                         f"{type(optimizer).__name__}")
    kind = type(optimizer).__name__
    if kind not in _KERAS_OPTIMIZERS:
        raise GraphError(f"cannot map the tf_keras optimizer {kind} to a tf.compat.v1.train optimizer; use one of "
                         f"{', '.join(_KERAS_OPTIMIZERS)}, or pass a tf.compat.v1.train optimizer")
    build, keys = _KERAS_OPTIMIZERS[kind]
    config = optimizer.get_config()
    for key, value in config.items():
        off = _OFF.get(key, ())
        if key in keys or key in _NEUTRAL or key == "learning_rate" or value == off or \
                (isinstance(off, tuple) and value in off):
            continue
        raise GraphError(f"cannot map tf_keras {kind}'s {key}={value!r} to a tf.compat.v1.train optimizer "
                         f"(TF1 has no equivalent); train without it or pass a tf.compat.v1.train optimizer")
    if getattr(optimizer, "adaptive_epsilon", False):
        raise GraphError(f"cannot map tf_keras {kind}'s adaptive_epsilon=True to a tf.compat.v1.train optimizer")
    lr = config.get("learning_rate")
    if not isinstance(lr, (int, float, np.floating, np.integer)):
        raise GraphError(f"cannot map tf_keras {kind}'s learning-rate schedule to a tf.compat.v1.train optimizer; "
                         f"give a constant learning rate")
    return build(float(lr), config)
