"""Model zoo: one full TF1 training step (forward, loss, gradients, optimizer update) per model.

tag's later stages need real training graphs to plan for. This module builds them for eight
well-known models and reads a user's own GraphDef from a ``.pb`` / ``.pbtxt`` file.

Example::

    from tag import zoo
    zoo.names()                                    # ['mlp', 'vgg19', 'resnet50', ...]
    gd = zoo.training_graph("resnet50", batch_size=64)                  # tf.compat.v1.GraphDef
    tiny = zoo.training_graph("bert_base", batch_size=2, num_layers=2, seq_len=16)
    zoo.model_info("bert_base")["published_parameters"]                 # 110000000
    name, gd = zoo.resolve_model("zoo:mlp,hidden=256x256", batch_size=8)  # what --model takes
    name, gd = zoo.resolve_model("my_model.pbtxt")

Conventions every zoo graph follows (other stages rely on them):

* Built in its own ``tf.Graph()`` (``with g.as_default():``); eager execution is never switched off
  globally. ``tf.compat.v1.set_random_seed(seed)`` (option ``seed``, default 0) is called first, and
  tf_keras' own initializer seeds are drawn from ``seed`` too, so the same options and batch size give
  the same GraphDef and the same initial weights on every build (the caller's random state is left
  alone). Builds at another batch size may initialise the Keras CNNs differently; to compare runs
  across batch sizes, assign the weights explicitly.
* Inputs are Placeholders with a concrete batch dimension ``batch_size``: ``input`` (images
  ``[B, H, W, 3]`` float32, MLP features ``[B, input_dim]`` float32, or token ids ``[B, S]`` int32),
  BERT also ``input_mask`` and ``segment_ids`` (``[B, S]`` int32), the Transformer also
  ``target_input`` (``[B, S]`` int32, the shifted decoder input), and ``labels`` (int32: ``[B]`` class
  ids, ``[B, S]`` token ids for the Transformer).
* ``loss`` is the scalar loss (mean cross-entropy over examples, over tokens for the Transformer),
  ``train_op`` runs one optimizer step, ``init`` initialises every variable (weights and optimizer
  slots).
* Gradients come from ``Optimizer.compute_gradients`` (``tf.gradients`` under the ``gradients`` name
  scope) and every trainable weight is updated by one ``ResourceApply*`` op (resource variables).
  Embedding gradients (IndexedSlices) are converted to dense tensors under ``gradients/`` before
  they are applied, so embeddings get a ``ResourceApplyAdam`` like every other weight; TF1's Adam
  updates every row on a sparse gradient too, so the step is mathematically the same.
* Optimizers: Momentum (lr 0.01, momentum 0.9) for the CNNs, Adam for the MLP (lr 1e-3), the
  Transformer (lr 1e-4, beta2 0.98, eps 1e-9, as in the paper) and BERT (lr 1e-4, eps 1e-6).
* No dropout, so one step is deterministic and a rewritten graph can be checked against it.
* CNNs are ``tf_keras.applications`` models (``weights=None``) built in Keras' TF1 graph mode under
  learning phase 1 (BatchNorm uses batch statistics, no ``cond`` in the graph). ``train_op`` is
  ``tf.group(apply_gradients, *model.updates)``: it runs the layers' moving-statistic updates too;
  only ``train_op`` waits for them (no control edges onto every gradient op).
* The Transformer and BERT are written here in raw TF ops (``get_variable``, ``MatMul``,
  ``BatchMatMulV2`` softmax attention, layer norm), dense layers on ``[B*S, H]`` matrices; their
  reshapes use -1 for the batch, so the forward ops hold no batch-sized constants. No padding mask
  or label smoothing in the Transformer (every token is real); BERT masks by ``input_mask``.
* Building takes seconds (see ``scripts/bench_zoo.py``), so the last 8 graphs built are kept in
  memory and ``training_graph`` returns a fresh copy on a repeat request (``cache=False`` rebuilds).

Default sizes and what the parameter counts contain (trainable weights only; optimizer slots and
BatchNorm moving statistics excluded):

============  =====================================================  ============  ===========
name          architecture / defaults                                parameters    published
============  =====================================================  ============  ===========
mlp           784-2048-2048-10, ReLU, 10 classes                       5,824,522   (ours)
vgg19         Keras VGG19, 224x224, 1000 classes                     143,667,240   143.7M
resnet50      Keras ResNet50, 224x224, 1000 classes                   25,583,592   25.6M
inception_v3  Keras InceptionV3 (no aux head), 299x299, 1000 classes  23,817,352   23.9M
mobilenet_v2  Keras MobileNetV2 alpha 1.0, 224x224, 1000 classes       3,504,872   3.5M
transformer   base: 6+6 layers, d 512, ff 2048, 8 heads, post-norm,   63,082,496   65M
              shared 37000-token vocab tied with the output softmax,
              sinusoidal positions, source and target length 64
bert_base     12 layers, hidden 768, 12 heads, ff 3072, vocab 30522,  109,483,778   110M
              512 positions, pooler + 2-class classification head,
              sequence length 128
bert_large    24 layers, hidden 1024, 16 heads, ff 4096, otherwise    335,143,938   340M
              as bert_base
============  =====================================================  ============  ===========

The Transformer count is 2.95% under the paper's rounded 65M: with a 37000-token vocabulary
tied between source, target and output the architecture has 63.08M weights (18.94M embedding,
18.91M encoder, 25.22M decoder). BERT uses the fine-tuning classification head (pooler +
``[hidden, num_classes]`` classifier) rather than the pre-training heads.

``--model`` specs (``resolve_model``): ``zoo:NAME`` or ``zoo:NAME,key=value,...`` (values are ints,
floats, or ``AxB`` int lists such as ``hidden=256x256``), or a path to a ``.pb`` / ``.pbtxt`` GraphDef.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import random
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from tag.errors import GraphError  # noqa: E402

__all__ = ["names", "training_graph", "model_info", "load_graph_def", "resolve_model", "DEFAULT_BATCH_SIZE"]

DEFAULT_BATCH_SIZE = 32

v1 = tf.compat.v1


# --------------------------------------------------------------------------------------------
# Shared pieces: placeholders, loss, optimizer step
# --------------------------------------------------------------------------------------------

def _finish(loss: tf.Tensor, optimizer: "v1.train.Optimizer", update_ops: list | None = None) -> None:
    """Name the loss, add the optimizer step ``train_op`` (dense gradients) and ``init``."""
    loss = tf.identity(loss, name="loss")
    grads_and_vars = optimizer.compute_gradients(loss)
    dense = []
    for grad, var in grads_and_vars:
        if grad is None:
            raise GraphError(f"internal: variable {var.op.name} gets no gradient from the loss")
        if isinstance(grad, tf.IndexedSlices):
            with v1.name_scope("gradients/"), v1.name_scope("densify"):
                grad = tf.convert_to_tensor(grad)
        dense.append((grad, var))
    if update_ops:
        # Only train_op waits for the moving statistics; wrapping the whole gradient computation in
        # control_dependencies would put one control edge per update on every root gradient op.
        apply = optimizer.apply_gradients(dense, name="apply_gradients")
        tf.group(apply, *update_ops, name="train_op")
    else:
        optimizer.apply_gradients(dense, name="train_op")
    v1.variables_initializer(v1.global_variables(), name="init")


def _xent(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean sparse softmax cross-entropy."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _dense(x: tf.Tensor, units: int, name: str, init: Any, activation: Callable | None = None) -> tf.Tensor:
    """x @ kernel + bias on a 2-D input, with variables ``name/kernel`` and ``name/bias``."""
    with v1.variable_scope(name):
        kernel = v1.get_variable("kernel", [int(x.shape[-1]), units], initializer=init)
        bias = v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
        y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
    return activation(y) if activation is not None else y


def _layer_norm(x: tf.Tensor, name: str, eps: float) -> tf.Tensor:
    """Layer normalisation over the last axis with learned ``gamma`` and ``beta``."""
    with v1.variable_scope(name):
        dim = int(x.shape[-1])
        gamma = v1.get_variable("gamma", [dim], initializer=tf.ones_initializer())
        beta = v1.get_variable("beta", [dim], initializer=tf.zeros_initializer())
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + eps) * gamma + beta


def _attention(q_in: tf.Tensor, kv_in: tf.Tensor, q_len: int, kv_len: int, heads: int,
               name: str, init: Any, bias: tf.Tensor | None) -> tf.Tensor:
    """Multi-head scaled dot-product attention on 2-D ``[B*len, H]`` inputs; returns ``[B*q_len, H]``.

    Shapes use -1 for the batch, so the forward ops carry no batch-sized constants.

    ``bias`` is added to the attention scores (broadcast to ``[B, heads, q_len, kv_len]``): -1e4 / -1e9
    where attention is not allowed (padding, future positions).
    """
    hidden = int(q_in.shape[-1])
    if hidden % heads:
        raise GraphError(f"hidden size {hidden} is not divisible by num_heads {heads}")
    d = hidden // heads
    with v1.variable_scope(name):
        def split(t: tf.Tensor, length: int) -> tf.Tensor:
            return tf.transpose(tf.reshape(t, [-1, length, heads, d]), [0, 2, 1, 3])

        q = split(_dense(q_in, hidden, "query", init), q_len)
        k = split(_dense(kv_in, hidden, "key", init), kv_len)
        v = split(_dense(kv_in, hidden, "value", init), kv_len)
        scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d))
        if bias is not None:
            scores = scores + bias
        probs = tf.nn.softmax(scores)
        ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [-1, hidden])
        return _dense(ctx, hidden, "output", init)


# --------------------------------------------------------------------------------------------
# Builders: each runs inside the caller's graph and creates input/labels/loss/train_op/init
# --------------------------------------------------------------------------------------------

def _build_mlp(batch_size: int, *, input_dim: int = 784, hidden: tuple[int, ...] = (2048, 2048),
               num_classes: int = 10, learning_rate: float = 1e-3) -> None:
    x = v1.placeholder(tf.float32, [batch_size, input_dim], name="input")
    labels = v1.placeholder(tf.int32, [batch_size], name="labels")
    init = v1.glorot_uniform_initializer()
    h = x
    with v1.variable_scope("mlp"):
        for i, units in enumerate(hidden):
            h = _dense(h, int(units), f"dense_{i}", init, tf.nn.relu)
        logits = _dense(h, num_classes, "logits", init)
    _finish(_xent(logits, labels), v1.train.AdamOptimizer(learning_rate))


_KERAS_APPS = {
    "vgg19": ("VGG19", 224, 32),
    "resnet50": ("ResNet50", 224, 32),
    "inception_v3": ("InceptionV3", 299, 75),
    "mobilenet_v2": ("MobileNetV2", 224, 32),
}


@contextlib.contextmanager
def _keras_seeds(seed: int) -> Iterator[None]:
    """Make tf_keras draw its initializers' seeds from SEED while a model is built, then restore.

    tf_keras gives every unseeded initializer a seed from a thread-local generator (set by
    ``tf_keras.utils.set_random_seed``) or, failing that, from Python's ``random``; the graph-level
    seed alone does not fix them. Both are swapped in for the build and put back after, so the
    caller's random state is untouched.
    """
    try:
        from tf_keras.src import backend as keras_backend
        holder = getattr(keras_backend, "_SEED_GENERATOR", None)
    except ImportError:   # a tf_keras without that module: Python's random is still pinned
        holder = None
    saved_generator = getattr(holder, "generator", None)
    saved_state = random.getstate()
    random.seed(seed)
    if holder is not None:
        holder.generator = random.Random(seed)
    try:
        yield
    finally:
        random.setstate(saved_state)
        if holder is not None:
            holder.generator = saved_generator


def _build_keras_cnn(name: str, batch_size: int, *, image_size: int | None = None, num_classes: int = 1000,
                     learning_rate: float = 0.01, momentum: float = 0.9, seed: int = 0) -> None:
    import tf_keras  # the Keras 2 package: builds TF1 graph-mode models (Keras 3 cannot)

    app, default_size, min_size = _KERAS_APPS[name]
    size = default_size if image_size is None else _positive_int("image_size", image_size)
    if size < min_size:
        raise GraphError(f"model '{name}': image_size {size} is below its minimum {min_size}")
    x = v1.placeholder(tf.float32, [batch_size, size, size, 3], name="input")
    labels = v1.placeholder(tf.int32, [batch_size], name="labels")
    # Learning phase 1 while the model is built on our placeholder: BatchNorm in training mode with
    # no learning-phase cond. (Keras calls the scope deprecated in favour of training=True, which
    # would need a second, unused copy of the model graph built on Keras' own Input placeholder.)
    with warnings.catch_warnings(), _keras_seeds(seed):
        warnings.filterwarnings("ignore", message=".*learning_phase_scope.*")
        with tf_keras.backend.learning_phase_scope(1):
            model = getattr(tf_keras.applications, app)(weights=None, input_tensor=x, classes=num_classes,
                                                        classifier_activation=None)
    updates = list(model.updates)
    _finish(_xent(model.output, labels), v1.train.MomentumOptimizer(learning_rate, momentum), updates)


def _sinusoid(length: int, dim: int) -> np.ndarray:
    """The Transformer's fixed sinusoidal position encodings, ``[length, dim]``."""
    pos = np.arange(length)[:, None].astype(np.float64)
    i = np.arange(dim // 2)[None, :].astype(np.float64)
    angle = pos / np.power(10000.0, 2.0 * i / dim)
    enc = np.zeros((length, dim), dtype=np.float32)
    enc[:, 0::2] = np.sin(angle)
    enc[:, 1::2] = np.cos(angle)
    return enc


def _build_transformer(batch_size: int, *, seq_len: int = 64, vocab_size: int = 37000, num_layers: int = 6,
                       d_model: int = 512, d_ff: int = 2048, num_heads: int = 8,
                       learning_rate: float = 1e-4) -> None:
    b, s, d = batch_size, seq_len, d_model
    if d % 2:
        raise GraphError(f"d_model must be even (sinusoidal position encodings), got {d}")
    src = v1.placeholder(tf.int32, [b, s], name="input")
    tgt = v1.placeholder(tf.int32, [b, s], name="target_input")
    labels = v1.placeholder(tf.int32, [b, s], name="labels")
    init = v1.glorot_uniform_initializer()
    eps = 1e-6
    with v1.variable_scope("transformer"):
        emb = v1.get_variable("shared_embedding", [vocab_size, d],
                              initializer=tf.random_normal_initializer(stddev=d ** -0.5))
        pos = tf.constant(_sinusoid(s, d), name="position_encoding")

        def embed(ids: tf.Tensor) -> tf.Tensor:
            return tf.reshape(tf.gather(emb, ids) * math.sqrt(d) + pos, [-1, d])

        causal = tf.constant(np.triu(np.full((s, s), -1e9, dtype=np.float32), k=1)[None, None],
                             name="causal_bias")
        with v1.variable_scope("encoder"):
            h = embed(src)
            for i in range(num_layers):
                with v1.variable_scope(f"layer_{i}"):
                    h = _layer_norm(h + _attention(h, h, s, s, num_heads, "self_attention", init, None),
                                    "attention_norm", eps)
                    ff = _dense(_dense(h, d_ff, "ffn_in", init, tf.nn.relu), d, "ffn_out", init)
                    h = _layer_norm(h + ff, "ffn_norm", eps)
            memory = h
        with v1.variable_scope("decoder"):
            h = embed(tgt)
            for i in range(num_layers):
                with v1.variable_scope(f"layer_{i}"):
                    h = _layer_norm(h + _attention(h, h, s, s, num_heads, "self_attention", init, causal),
                                    "self_attention_norm", eps)
                    h = _layer_norm(h + _attention(h, memory, s, s, num_heads, "cross_attention", init, None),
                                    "cross_attention_norm", eps)
                    ff = _dense(_dense(h, d_ff, "ffn_in", init, tf.nn.relu), d, "ffn_out", init)
                    h = _layer_norm(h + ff, "ffn_norm", eps)
        logits = tf.matmul(h, emb, transpose_b=True, name="logits")   # tied output projection
    loss = _xent(logits, tf.reshape(labels, [-1]))
    _finish(loss, v1.train.AdamOptimizer(learning_rate, beta1=0.9, beta2=0.98, epsilon=1e-9))


def _gelu(x: tf.Tensor) -> tf.Tensor:
    return tf.nn.gelu(x, approximate=True)


def _build_bert(batch_size: int, *, seq_len: int = 128, vocab_size: int = 30522, num_layers: int = 12,
                hidden_size: int = 768, num_heads: int = 12, intermediate_size: int = 3072,
                max_position: int = 512, type_vocab_size: int = 2, num_classes: int = 2,
                learning_rate: float = 1e-4) -> None:
    b, s, h_dim = batch_size, seq_len, hidden_size
    if s > max_position:
        raise GraphError(f"seq_len {s} exceeds max_position {max_position}")
    ids = v1.placeholder(tf.int32, [b, s], name="input")
    mask = v1.placeholder(tf.int32, [b, s], name="input_mask")
    segments = v1.placeholder(tf.int32, [b, s], name="segment_ids")
    labels = v1.placeholder(tf.int32, [b], name="labels")
    init = tf.compat.v1.truncated_normal_initializer(stddev=0.02)
    eps = 1e-12
    with v1.variable_scope("bert"):
        with v1.variable_scope("embeddings"):
            words = v1.get_variable("word_embeddings", [vocab_size, h_dim], initializer=init)
            types = v1.get_variable("token_type_embeddings", [type_vocab_size, h_dim], initializer=init)
            positions = v1.get_variable("position_embeddings", [max_position, h_dim], initializer=init)
            x = tf.gather(words, tf.reshape(ids, [-1]))
            # Token types as a one-hot matmul (as BERT does): a small vocabulary, dense gradient.
            x = x + tf.matmul(tf.one_hot(tf.reshape(segments, [-1]), type_vocab_size), types)
            x = tf.reshape(x, [-1, s, h_dim]) + tf.slice(positions, [0, 0], [s, h_dim])
            x = _layer_norm(tf.reshape(x, [-1, h_dim]), "LayerNorm", eps)
        # Additive attention bias: 0 where input_mask is 1, -10000 on padding.
        bias = (1.0 - tf.cast(tf.reshape(mask, [-1, 1, 1, s]), tf.float32)) * -10000.0
        with v1.variable_scope("encoder"):
            for i in range(num_layers):
                with v1.variable_scope(f"layer_{i}"):
                    att = _attention(x, x, s, s, num_heads, "attention", init, bias)
                    x = _layer_norm(x + att, "attention_norm", eps)
                    inter = _dense(x, intermediate_size, "intermediate", init, _gelu)
                    x = _layer_norm(x + _dense(inter, h_dim, "output", init), "output_norm", eps)
        with v1.variable_scope("pooler"):
            first = tf.reshape(x, [-1, s, h_dim])[:, 0, :]
            pooled = _dense(first, h_dim, "dense", init, tf.tanh)
    with v1.variable_scope("classifier"):
        logits = _dense(pooled, num_classes, "dense", init)
    _finish(_xent(logits, labels), v1.train.AdamOptimizer(learning_rate, epsilon=1e-6))


def _bert_large(batch_size: int, *, num_layers: int = 24, hidden_size: int = 1024, num_heads: int = 16,
                intermediate_size: int = 4096, **options: Any) -> None:
    _build_bert(batch_size, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                intermediate_size=intermediate_size, **options)


def _keras(name: str) -> Callable[..., None]:
    def build(batch_size: int, *, image_size: int | None = None, num_classes: int = 1000,
              learning_rate: float = 0.01, momentum: float = 0.9, seed: int = 0) -> None:
        _build_keras_cnn(name, batch_size, image_size=image_size, num_classes=num_classes,
                         learning_rate=learning_rate, momentum=momentum, seed=seed)
    return build


_BUILDERS: dict[str, Callable[..., None]] = {
    "mlp": _build_mlp,
    "vgg19": _keras("vgg19"),
    "resnet50": _keras("resnet50"),
    "inception_v3": _keras("inception_v3"),
    "mobilenet_v2": _keras("mobilenet_v2"),
    "transformer": _build_transformer,
    "bert_base": _build_bert,
    "bert_large": _bert_large,
}

_BERT_OPTIONS = ("seq_len", "vocab_size", "num_layers", "hidden_size", "num_heads", "intermediate_size",
                 "max_position", "type_vocab_size", "num_classes", "learning_rate")

_INFO: dict[str, dict[str, Any]] = {
    "mlp": dict(
        description="Multi-layer perceptron 784-2048-2048-10 with ReLU (an MNIST-sized classifier), Adam",
        published_parameters=5_824_522, parameters=5_824_522, reference="tag's own small model"),
    "vgg19": dict(
        description="VGG-19: 16 3x3 conv layers + 3 fully connected layers, 224x224 images, Momentum",
        published_parameters=143_700_000, parameters=143_667_240,
        reference="Simonyan & Zisserman 2014; tf_keras.applications.VGG19"),
    "resnet50": dict(
        description="ResNet-50: bottleneck residual network with BatchNorm, 224x224 images, Momentum",
        published_parameters=25_600_000, parameters=25_583_592,
        reference="He et al. 2015; tf_keras.applications.ResNet50"),
    "inception_v3": dict(
        description="Inception-v3 (no auxiliary head) with BatchNorm, 299x299 images, Momentum",
        published_parameters=23_900_000, parameters=23_817_352,
        reference="Szegedy et al. 2015; tf_keras.applications.InceptionV3"),
    "mobilenet_v2": dict(
        description="MobileNetV2 (alpha 1.0): inverted residuals, depthwise convs, 224x224 images, Momentum",
        published_parameters=3_500_000, parameters=3_504_872,
        reference="Sandler et al. 2018; tf_keras.applications.MobileNetV2"),
    "transformer": dict(
        description="Transformer-base encoder-decoder (6+6 layers, d_model 512, 8 heads), tied 37000-token "
                    "vocabulary, sequence length 64, Adam",
        published_parameters=65_000_000, parameters=63_082_496,
        reference="Vaswani et al. 2017, Table 3 (base)"),
    "bert_base": dict(
        description="BERT-base encoder (12 layers, hidden 768, 12 heads) with pooler and a 2-class "
                    "classification head, sequence length 128, Adam",
        published_parameters=110_000_000, parameters=109_483_778,
        reference="Devlin et al. 2018 (BERT-base)"),
    "bert_large": dict(
        description="BERT-large encoder (24 layers, hidden 1024, 16 heads) with pooler and a 2-class "
                    "classification head, sequence length 128, Adam",
        published_parameters=340_000_000, parameters=335_143_938,
        reference="Devlin et al. 2018 (BERT-large)"),
}


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def names() -> list[str]:
    """The zoo's model names, in a fixed order."""
    return list(_BUILDERS)


def _check_name(name: str) -> str:
    if name not in _BUILDERS:
        raise GraphError(f"unknown model {name!r} (known: {', '.join(_BUILDERS)})")
    return name


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise GraphError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _options_of(name: str) -> dict[str, Any]:
    """Option name -> default value for model NAME (seed included)."""
    builder = _BUILDERS[name]
    params = inspect.signature(builder).parameters
    opts = {p.name: p.default for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if name == "bert_large":   # the remaining options pass through to the BERT builder
        base = inspect.signature(_build_bert).parameters
        for key in _BERT_OPTIONS:
            opts.setdefault(key, base[key].default)
    opts["seed"] = 0
    return opts


def _check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    known = _options_of(name)
    for key, value in options.items():
        if key not in known:
            raise GraphError(f"unknown option {key!r} for model '{name}' (known: {', '.join(sorted(known))})")
        if key == "hidden":
            if isinstance(value, (int, np.integer)):
                value = (value,)
            if not isinstance(value, (tuple, list)) or not value:
                raise GraphError(f"option 'hidden' must be a list of layer widths, got {value!r}")
            options[key] = tuple(_positive_int("hidden layer width", v) for v in value)
        elif key in ("learning_rate", "momentum"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise GraphError(f"option {key!r} must be a non-negative number, got {value!r}")
        elif key == "seed":
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise GraphError(f"option 'seed' must be an integer, got {value!r}")
        elif key == "image_size" and value is None:
            pass
        else:
            _positive_int(f"option {key!r}", value)
    return options


def training_graph(name: str, batch_size: int = DEFAULT_BATCH_SIZE, *, cache: bool = True,
                   **options: Any) -> "tf.compat.v1.GraphDef":
    """Build one training step of zoo model NAME at global batch BATCH_SIZE and return its GraphDef.

    Options (all optional; see ``model_info(name)["options"]`` for a model's defaults): ``seed``;
    CNNs: ``image_size``, ``num_classes``, ``learning_rate``, ``momentum``; mlp: ``input_dim``,
    ``hidden`` (tuple of widths), ``num_classes``; transformer: ``seq_len``, ``vocab_size``,
    ``num_layers``, ``d_model``, ``d_ff``, ``num_heads``; BERT: ``seq_len``, ``vocab_size``,
    ``num_layers``, ``hidden_size``, ``num_heads``, ``intermediate_size``, ``max_position``,
    ``type_vocab_size``, ``num_classes``. Bad names or values raise GraphError.

    Building takes seconds (BERT-large ~15 s), so the last few graphs are kept in memory and a
    repeated request returns a fresh copy of the stored one; ``cache=False`` always builds.
    """
    _check_name(name)
    batch_size = _positive_int("batch_size", batch_size)
    options = {**_options_of(name), **_check_options(name, dict(options))}
    key = (name, batch_size, tuple(sorted(options.items())))
    if cache and key in _CACHE:
        _CACHE.move_to_end(key)
        return _copy(_CACHE[key])
    seed = int(options["seed"])
    if "seed" not in inspect.signature(_BUILDERS[name]).parameters:   # only Keras builders need it
        del options["seed"]
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(seed)
        try:
            _BUILDERS[name](batch_size, **options)
        except GraphError:
            raise
        except (ValueError, TypeError) as err:   # e.g. Keras rejecting a size; still one line
            raise GraphError(f"model '{name}': {' '.join(str(err).split())}") from err
    gd = g.as_graph_def()
    if cache:
        _CACHE[key] = _copy(gd)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return gd


_CACHE_SIZE = 8
_CACHE: "OrderedDict[tuple, tf.compat.v1.GraphDef]" = OrderedDict()


def _copy(gd: "tf.compat.v1.GraphDef") -> "tf.compat.v1.GraphDef":
    out = v1.GraphDef()
    out.CopyFrom(gd)
    return out


def model_info(name: str) -> dict[str, Any]:
    """Facts about zoo model NAME: description, published and exact parameter counts, options.

    ``parameters`` is the exact trainable-weight count of ``training_graph(name)`` at default options;
    ``published_parameters`` is the figure the literature quotes (within 3% of it).
    """
    _check_name(name)
    info = {"name": name, **_INFO[name], "options": _options_of(name)}
    if name in _KERAS_APPS:
        info["options"]["image_size"] = _KERAS_APPS[name][1]
    return info


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


MAX_GRAPH_FILE_BYTES = 2 << 30   # protobuf messages cannot be larger than 2 GiB


def load_graph_def(path: str | os.PathLike) -> "tf.compat.v1.GraphDef":
    """Read a user's GraphDef: binary (``.pb``) or text format (``.pbtxt``/``.txt``).

    The format the file name suggests is tried first (binary for unknown names), then the other one.
    Any problem (missing, unreadable, empty, truncated, garbage, not a GraphDef) raises GraphError
    with a one-line message starting ``PATH:`` (``PATH:LINE:`` for text-format syntax errors); when
    neither format parses, text-looking content gets the text-format error, anything else the binary one.
    """
    from tag.files import read_input_file
    p = Path(path)
    where = str(path)
    data = read_input_file(where, what="GraphDef file", limit=MAX_GRAPH_FILE_BYTES, error=GraphError)
    if not data.strip():
        raise GraphError(f"{where}: empty file")
    text_first = p.suffix.lower() in (".pbtxt", ".txt", ".pbtext", ".prototxt")
    errors: dict[Callable, GraphError] = {}
    for parse in ([_parse_text, _parse_binary] if text_first else [_parse_binary, _parse_text]):
        try:
            gd = parse(where, data)
            _check_graph_def(where, gd, data, binary=parse is _parse_binary)
            return gd
        except GraphError as err:
            errors[parse] = err
    # Neither format worked: report the text error for text-looking content (it has a line number).
    raise errors[_parse_text] if _looks_like_text(data) else errors[_parse_binary]


_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\v")


def _looks_like_text(data: bytes) -> bool:
    """UTF-8 without control characters other than whitespace (binary protobufs are full of them)."""
    if data.translate(None, _CONTROL_BYTES) != data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parse_text(where: str, data: bytes) -> "tf.compat.v1.GraphDef":
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise GraphError(f"{where}: not a GraphDef: binary data that is not UTF-8 text (byte {err.start})") from None
    gd = v1.GraphDef()
    try:
        text_format.Parse(text, gd)
    except text_format.ParseError as err:
        line = getattr(err, "GetLine", lambda: None)()
        col = getattr(err, "GetColumn", lambda: None)()
        msg = _first_line(err)
        if line is not None:
            prefix = f"{line}:{col} : " if col is not None else f"{line} : "
            if msg.startswith(prefix.strip()):
                msg = msg[len(prefix.strip()):].lstrip(" :")
            raise GraphError(f"{where}:{line}: not a text GraphDef: {msg}") from None
        raise GraphError(f"{where}: not a text GraphDef: {msg}") from None
    except RecursionError:
        raise GraphError(f"{where}: not a text GraphDef: nesting too deep") from None
    except Exception as err:  # noqa: BLE001 - any other parser complaint is still bad input
        raise GraphError(f"{where}: not a text GraphDef: {_first_line(err)}") from None
    return gd


def _parse_binary(where: str, data: bytes) -> "tf.compat.v1.GraphDef":
    gd = v1.GraphDef()
    try:
        gd.ParseFromString(data)
    except Exception as err:  # noqa: BLE001 - DecodeError, RecursionError, ...: all bad input
        raise GraphError(f"{where}: truncated or not a GraphDef: {_first_line(err)}") from None
    return gd


def _check_graph_def(where: str, gd: "tf.compat.v1.GraphDef", data: bytes, binary: bool) -> None:
    """Reject parses that are protobuf-valid but are not a whole TensorFlow graph."""
    if not gd.node:
        hint = ""
        if binary:
            from tensorflow.core.protobuf import saved_model_pb2
            sm = saved_model_pb2.SavedModel()
            try:
                sm.ParseFromString(data)
                if sm.meta_graphs and sm.meta_graphs[0].graph_def.node:
                    hint = " (this looks like a SavedModel; export its training GraphDef instead)"
            except Exception:  # noqa: BLE001 - only a hint
                pass
        raise GraphError(f"{where}: no nodes: not a TensorFlow GraphDef{hint}")
    if binary and gd.versions.producer == 0:
        raise GraphError(f"{where}: no 'versions' field: the file is truncated or not a TensorFlow GraphDef")
    seen: set[str] = set()
    for node in gd.node:
        if not node.name or not node.op:
            raise GraphError(f"{where}: a node without a name or op: not a TensorFlow GraphDef "
                             f"(after node {len(seen)})")
        if node.name in seen:
            raise GraphError(f"{where}: node name {node.name!r} appears twice")
        seen.add(node.name)
    for node in gd.node:
        for inp in node.input:
            src = inp[1:] if inp.startswith("^") else inp.split(":")[0]
            if src not in seen:
                raise GraphError(f"{where}: node {node.name!r} reads {inp!r}, which is not in the graph "
                                 f"(truncated file?)")


def _parse_option_value(key: str, text: str) -> Any:
    if "x" in text and all(part.strip().isdigit() for part in text.split("x")):
        return tuple(int(part) for part in text.split("x"))
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    raise GraphError(f"option {key}={text!r}: expected a number or AxB list")


def resolve_model(spec: str, batch_size: int | None = None) -> tuple[str, "tf.compat.v1.GraphDef"]:
    """Turn a ``--model`` argument into ``(name, GraphDef)``.

    ``zoo:NAME`` or ``zoo:NAME,key=value,...`` builds a zoo graph at BATCH_SIZE (default 32);
    anything else is a path read by ``load_graph_def`` (BATCH_SIZE is then left to ``tag.analyze``);
    the name is the file name without its extension.
    """
    spec = str(spec).strip()
    if not spec:
        raise GraphError("empty --model: give zoo:NAME or a path to a .pb/.pbtxt GraphDef")
    if spec.startswith("zoo:"):
        name, *pairs = spec[len("zoo:"):].split(",")
        name = name.strip()
        _check_name(name)
        options: dict[str, Any] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise GraphError(f"bad option {pair!r} in {spec!r}: expected key=value")
            options[key.strip()] = _parse_option_value(key.strip(), value.strip())
        return name, training_graph(name, DEFAULT_BATCH_SIZE if batch_size is None else batch_size, **options)
    p = Path(spec)
    name = p.name
    for suffix in (".pbtxt", ".pbtext", ".prototxt", ".txt", ".pb", ".graphdef"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name or spec, load_graph_def(p)
