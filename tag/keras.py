"""``tag.fit``: a tf_keras model planned, trained on a cluster from its current weights, and given the result.

Why: ``tag.frontend.keras`` builds a model's TF1 training step, but a Keras user also wants what ``model.fit``
gives: training that starts from the model's weights (a pretrained model stays pretrained), the optimizer they
configured, labels as their data set has them, and the trained weights back in the model. ``fit`` does each:
the step's variables start from the model's current weights; a tf_keras optimizer (or its name, with Keras's
defaults) becomes the ``tf.compat.v1.train`` optimizer of the same rule and hyperparameters
(``tag.frontend.keras.tf1_optimizer``; one line naming what has no TF1 equivalent); the labels' dtype and shape
come from the data set's elements; the plan is searched (``tag.optimize``) or given (``strategy=``) and trained by
``tag.train``; every trained variable, BatchNorm statistics included, is assigned back to the model by the
graph's variable name.

The data set: ``dataset_fn(ctx)`` as for ``tag.train`` (called once per worker host, ``ctx.num_input_pipelines``
and ``ctx.input_pipeline_id`` for sharding), with Keras's elements: ``(features, labels)`` pairs of single
examples or of batches of ``ctx.batch_size``; features a tensor, a tuple in the model's input order, or a dict
keyed by its input names, cast to the inputs' dtypes as ``model.fit`` does.

Example::

    import tensorflow as tf
    import tf_keras
    import tag

    model = tf_keras.Sequential([tf_keras.Input((64,)), tf_keras.layers.Dense(10)])   # pretrained or not

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).shuffle(1000).repeat()

    result = tag.fit(model, "topologies/localhost.pbtxt", dataset_fn, steps=300, batch_size=64,
                     loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     optimizer=tf_keras.optimizers.Adam(1e-3))
    (model.predict(x_test).argmax(axis=1) == y_test).mean()     # the trained weights are in the model
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from tag.errors import GraphError, TagError

__all__ = ["fit"]


def fit(model: Any, topology: Any, dataset_fn: Callable[[Any], Any], *, loss: Any, optimizer: Any, steps: int,
        batch_size: int, strategy: Any = None, options: Any = None,
        checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int = 0,
        eval_fn: Callable[[dict, int], Mapping[str, float]] | None = None, eval_every: int = 0,
        logdir: str | os.PathLike | None = None, progress: Any = True, step_timeout_s: float | None = 600.0,
        seed: int = 0, **search_options: Any) -> Any:
    """Train MODEL (a built ``tf_keras.Model``, one output) for STEPS steps of global batch BATCH_SIZE on
    TOPOLOGY (a ``tag.Topology`` or a cluster file) from its current weights, then write the trained weights
    into MODEL; returns ``tag.train``'s ``TrainResult``.

    LOSS: a tf_keras loss, its name or a function ``(y_true, y_pred)``. OPTIMIZER: a tf_keras optimizer, its
    name (``"adam"``, ``"sgd"``, ... with Keras's default hyperparameters) or a ``tf.compat.v1.train``
    optimizer. STRATEGY: a built-in name (``"dp_allreduce"``, ...), a ``tag.Strategy`` or a saved plan, used
    instead of searching; otherwise ``tag.optimize`` searches with OPTIONS / SEARCH_OPTIONS. The other
    keywords are ``tag.train``'s (EVAL_FN gets the weights by graph variable name). Raises TagError (one line)
    for a model, loss, optimizer or data set this cannot use.
    """
    import tf_keras

    from tag.api import optimize, rewrite
    from tag.backend.runtime.input_pipeline import element_spec
    from tag.frontend.keras import training_step
    from tag.training import train
    if not isinstance(model, tf_keras.Model):
        raise TagError(f"tag.fit takes a tf_keras.Model, got {type(model).__name__}")
    if not model.built or not getattr(model, "inputs", None):
        raise TagError("tag.fit: the model has no inputs yet; build it on tf_keras.Input(...) first")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TagError(f"tag.fit: batch_size must be a positive integer, got {batch_size!r}")
    input_names = ["input"] if len(model.inputs) == 1 else [f"input_{i}" for i in range(len(model.inputs))]
    label_shape, label_dtype = _labels(model, element_spec(dataset_fn, batch_size))
    step = training_step(model, loss, _keras_optimizer(optimizer), batch_size, label_shape=label_shape,
                         label_dtype=label_dtype, seed=seed)
    if strategy is not None:
        plan = rewrite(step.graph_def, topology, strategy)
    else:
        plan = optimize(step.graph_def, topology, options=options, name=model.name, **search_options)
    final: dict[str, Any] = {}

    def keep_weights(weights: dict, done: int) -> Mapping[str, float]:
        final.clear()
        final.update(weights)
        return eval_fn(weights, done) if eval_fn is not None else {}

    result = train(plan, _keras_elements(dataset_fn, model, input_names), steps=steps,
                   checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, eval_fn=keep_weights,
                   eval_every=eval_every if eval_fn is not None else 0, logdir=logdir, topology=topology,
                   progress=progress, step_timeout_s=step_timeout_s, seed=seed)
    if eval_fn is None:
        result.evals = []
    missing = [n for n in step.weight_names if n not in final]
    if missing:
        raise TagError(f"tag.fit: the trained weights lack {missing[0]!r}; the model was not updated")
    for name, weight in zip(step.weight_names, model.weights, strict=True):
        weight.assign(final[name])
    return result


def _keras_optimizer(optimizer: Any) -> Any:
    """OPTIMIZER as ``training_step`` takes it: a name becomes tf_keras's optimizer with Keras's defaults."""
    if not isinstance(optimizer, str):
        return optimizer
    import tf_keras
    try:
        return tf_keras.optimizers.get(optimizer)
    except ValueError:
        raise GraphError(f"tag.fit: unknown tf_keras optimizer {optimizer!r}; use sgd, adam, rmsprop, adagrad, "
                         f"adadelta or ftrl, or an optimizer object") from None


def _features_and_labels(spec: Any) -> tuple[Any, Any]:
    """The (features, labels) parts of a data set's element spec; TagError for any other element."""
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return spec[0], spec[1]
    raise GraphError("tag.fit: the data set's elements must be (features, labels) pairs, got "
                     f"{type(spec).__name__}" + (f" of {len(spec)}" if isinstance(spec, (tuple, list)) else ""))


def _labels(model: Any, spec: Any) -> tuple[Any, Any]:
    """(label shape without the batch or None for the loss's default, label dtype) from the data set's elements:
    they are batches when the first feature has the model input's rank with the batch, else single examples."""
    features, labels = _features_and_labels(spec)
    import tensorflow as tf
    if not isinstance(labels, tf.TensorSpec):
        raise GraphError(f"tag.fit: the data set's labels must be one dense tensor, got {type(labels).__name__}")
    first = features
    if isinstance(features, dict):
        first = features.get(model.input_names[0])
    elif isinstance(features, (tuple, list)):
        first = features[0] if features else None
    if not isinstance(first, tf.TensorSpec) or first.shape.rank is None:
        raise GraphError("tag.fit: the data set's features must be dense tensors of known rank, "
                         f"matching the model's inputs {list(model.input_names)}")
    if labels.shape.rank is None:
        return None, labels.dtype
    batched = first.shape.rank == model.inputs[0].shape.rank
    shape = labels.shape.as_list()[1:] if batched else labels.shape.as_list()
    return (None if None in shape else shape), labels.dtype


def _keras_elements(dataset_fn: Callable[[Any], Any], model: Any, input_names: list[str]) -> Callable[[Any], Any]:
    """DATASET_FN with its (features, labels) elements keyed by the step's placeholders (``input``..., ``labels``)."""
    import tensorflow as tf
    keras_names = list(model.input_names)

    def keyed(features: Any, labels: Any) -> dict:
        if isinstance(features, dict):
            parts = [features[k] for k in keras_names]
        elif isinstance(features, (tuple, list)):
            parts = list(features)
        else:
            parts = [features]
        if len(parts) != len(input_names):
            raise GraphError(f"tag.fit: the data set gives {len(parts)} features, the model has "
                             f"{len(input_names)} inputs")
        parts = [tf.cast(p, t.dtype) for p, t in zip(parts, model.inputs, strict=True)]   # as model.fit casts
        return {**dict(zip(input_names, parts, strict=True)), "labels": labels}

    def keras_dataset_fn(ctx: Any) -> Any:
        return dataset_fn(ctx).map(keyed)

    return keras_dataset_fn
