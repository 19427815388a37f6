"""Real training graphs as users write them: every TF1 optimizer, sparse updates, language models, loops.

Why: the zoo (:mod:`tag.frontend.zoo`) builds clean graphs (dense gradients, ``ResourceApply*`` for
every weight, no loops). Users' graphs are messier: TF1 optimizers update embedding tables from
``IndexedSlices`` gradients with scatter/assign ops and no apply op, losses shift sequences and flatten
``batch x positions``, TensorFlow folds ``zeros_like`` of a static batch into a constant, and Keras
recurrent layers run as functional ``While`` loops over TensorLists. These builders make small,
deterministic examples of each, used by the tests and ``scripts/bench_ir.py``.

Every graph follows the zoo's naming: placeholders ``input`` (and ``labels``), ``loss``, ``train_op``,
``init``; its own ``tf.Graph``; graph-level seed 0.

Example::

    from tag.frontend import real_graphs as rg
    gd = rg.optimizer_graph("adam", sparse=True, resource=True, batch_size=8)
    gd = rg.causal_lm_graph(batch_size=4, seq_len=8, vocab_size=16)
    gd = rg.recommender_graph(batch_size=8, rows=50, dim=4)
    gd = rg.lstm_lm_graph(batch_size=4, seq_len=6, vocab_size=12, units=8)
    gd = rg.static_lstm_lm_graph(batch_size=8, seq_len=6, vocab_size=50, units=16, layers=2)
    sorted(rg.OPTIMIZERS)        # ['adadelta', 'adagrad', 'adam', 'ftrl', 'momentum', 'rmsprop', 'sgd']
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tag.frontend.keras import OPTIMIZERS, training_graph_def

v1 = tf.compat.v1

__all__ = ["OPTIMIZERS", "causal_lm_graph", "framework_parameters", "lstm_lm_graph", "optimizer_graph",
           "recommender_graph", "static_lstm_lm_graph"]

def framework_parameters(graph_def: tf.compat.v1.GraphDef) -> int:
    """Trainable parameters as TensorFlow counts them: the variables ``tf.compat.v1.trainable_variables()``
    held when the graph was built (recorded by these builders in the graph's ``tag_trainable_parameters``
    Const), for checking what ``tag.analyze`` reads."""
    for node in graph_def.node:
        if node.name == "tag_trainable_parameters":
            return int(tf.make_ndarray(node.attr["value"].tensor))
    raise KeyError("graph_def was not built by tag.frontend.real_graphs")


def _record_trainable_count(count: int | None = None) -> None:
    """A Const holding the number of trainable parameters (outside the training step)."""
    if count is None:
        count = sum(int(np.prod(v.shape.as_list())) for v in v1.trainable_variables())
    tf.constant(np.int64(count), name="tag_trainable_parameters")


def _finish(loss: tf.Tensor, optimizer: Any) -> None:
    """``loss``, ``train_op`` (gradients as TF gives them: IndexedSlices stay sparse) and ``init``."""
    loss = tf.identity(loss, name="loss")
    optimizer.minimize(loss, name="train_op")
    v1.variables_initializer(v1.global_variables(), name="init")
    _record_trainable_count()


def _xent(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def optimizer_graph(optimizer: str, *, sparse: bool, resource: bool, batch_size: int = 8,
                    optimizer_object: Any = None) -> tf.compat.v1.GraphDef:
    """A small classifier trained by OPTIMIZER (a key of ``OPTIMIZERS``).

    ``sparse``: token ids ``[B, 3]`` look up an embedding table ``[20, 6]`` (an ``IndexedSlices``
    gradient) before a dense layer; else float features ``[B, 6]`` go through two dense layers.
    ``resource``: resource variables (``VarHandleOp``) or TF1 reference variables (``VariableV2``).
    """
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        labels = v1.placeholder(tf.int32, [batch_size], name="labels")
        init = v1.glorot_uniform_initializer(seed=1)
        if sparse:
            ids = v1.placeholder(tf.int32, [batch_size, 3], name="input")
            table = v1.get_variable("emb", [20, 6], initializer=v1.random_normal_initializer(seed=2),
                                    use_resource=resource)
            h = tf.reduce_mean(tf.gather(table, ids), axis=1)
        else:
            x = v1.placeholder(tf.float32, [batch_size, 6], name="input")
            w0 = v1.get_variable("w0", [6, 6], initializer=init, use_resource=resource)
            h = tf.nn.tanh(tf.matmul(x, w0))
        w = v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=3), use_resource=resource)
        b = v1.get_variable("b", [3], initializer=v1.constant_initializer(0.1), use_resource=resource)
        logits = tf.matmul(h, w) + b
        _finish(_xent(logits, labels), optimizer_object or OPTIMIZERS[optimizer]())
    return g.as_graph_def()


def causal_lm_graph(*, batch_size: int = 4, seq_len: int = 8, vocab_size: int = 16, d_model: int = 8,
                    learning_rate: float = 0.01, loss_form: str = "flat") -> tf.compat.v1.GraphDef:
    """A GPT-style causal language model: token and position embeddings, one causal self-attention
    layer, an MLP; the loss is the mean cross-entropy of ``logits[:, :-1]`` against ``tokens[:, 1:]``,
    both flattened to ``batch x (seq_len - 1)`` positions (``loss_form="flat"``), or per sequence (summed
    over positions, averaged over the batch: ``"sequence"``). Adam."""
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        tokens = v1.placeholder(tf.int32, [batch_size, seq_len], name="input")
        init = v1.random_normal_initializer(stddev=0.2, seed=1)
        wte = v1.get_variable("wte", [vocab_size, d_model], initializer=init)
        wpe = v1.get_variable("wpe", [seq_len, d_model], initializer=v1.random_normal_initializer(0.0, 0.2, seed=2))
        h = tf.gather(wte, tokens) + wpe                                          # [B, S, D]
        qkv = tf.einsum("bsd,de->bse", h, v1.get_variable(
            "w_qkv", [d_model, 3 * d_model], initializer=v1.glorot_uniform_initializer(seed=3)))
        q, k, v = tf.split(qkv, 3, axis=2)
        scores = tf.matmul(q, k, transpose_b=True) / float(np.sqrt(d_model))    # [B, S, S]
        causal = tf.constant(np.tril(np.ones((seq_len, seq_len), np.float32)))
        scores = scores * causal - 1e9 * (1.0 - causal)
        h = h + tf.matmul(tf.nn.softmax(scores), v)
        w_mlp = v1.get_variable("w_mlp", [d_model, d_model], initializer=v1.glorot_uniform_initializer(seed=4))
        h = h + tf.nn.tanh(tf.einsum("bsd,de->bse", h, w_mlp))
        logits = tf.einsum("bsd,vd->bsv", h, wte)                                # tied output embedding
        if loss_form == "flat":
            shifted = tf.reshape(logits[:, :-1], [-1, vocab_size])               # [B*(S-1), V]
            targets = tf.reshape(tokens[:, 1:], [-1])                            # [B*(S-1)]
            loss = _xent(shifted, targets)
        else:   # TF flattens [B, S-1, V] itself and reshapes the loss back to the static [B, S-1]
            loss = tf.reduce_mean(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tokens[:, 1:], logits=logits[:, :-1]), axis=1)) / float(seq_len - 1)
        _finish(loss, v1.train.AdamOptimizer(learning_rate))
    return g.as_graph_def()


def recommender_graph(*, batch_size: int = 8, tables: int = 4, rows: int = 50, dim: int = 4, hidden: int = 8,
                      learning_rate: float = 0.01) -> tf.compat.v1.GraphDef:
    """A recommendation model: ``tables`` embedding tables ``[rows, dim]`` (resource variables from
    ``get_variable``) looked up by ``input`` ids ``[B, tables]``, a hidden layer, one logit per
    example and ``sigmoid_cross_entropy_with_logits`` (its ``zeros_like`` is folded to a constant of
    the batch shape) against float ``labels`` ``[B]``. TF1 Adam: the tables get sparse updates
    (scatter and assign ops, no apply op)."""
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        ids = v1.placeholder(tf.int32, [batch_size, tables], name="input")
        labels = v1.placeholder(tf.float32, [batch_size], name="labels")
        looked_up = []
        for t in range(tables):
            table = v1.get_variable(f"table_{t}", [rows, dim], use_resource=True,
                                    initializer=v1.random_normal_initializer(stddev=0.1, seed=10 + t))
            looked_up.append(tf.gather(table, ids[:, t]))
        h = tf.concat(looked_up, axis=1)
        w1 = v1.get_variable("w1", [tables * dim, hidden], initializer=v1.glorot_uniform_initializer(seed=1))
        w2 = v1.get_variable("w2", [hidden, 1], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.reshape(tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2), [batch_size])
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        _finish(loss, v1.train.AdamOptimizer(learning_rate))
    return g.as_graph_def()


def lstm_lm_model(*, seq_len: int = 6, vocab_size: int = 12, embed: int = 8, units: int = 8,
                  layers: int = 2, seed: int = 0) -> Any:
    """A tf_keras LSTM language model: embedding, LAYERS LSTM layers (sequences), a dense softmax head."""
    import tf_keras

    init = tf_keras.initializers
    inp = tf_keras.Input(shape=(seq_len,), dtype="int32")
    h = tf_keras.layers.Embedding(vocab_size, embed,
                                  embeddings_initializer=init.RandomUniform(-0.1, 0.1, seed=seed))(inp)
    for i in range(layers):
        h = tf_keras.layers.LSTM(units, return_sequences=True, kernel_initializer=init.GlorotUniform(seed=seed + 1 + i),
                                 recurrent_initializer=init.Orthogonal(seed=seed + 11 + i))(h)
    out = tf_keras.layers.Dense(vocab_size, kernel_initializer=init.GlorotUniform(seed=seed + 21))(h)
    return tf_keras.Model(inp, out)


def static_lstm_lm_graph(*, batch_size: int = 8, seq_len: int = 6, vocab_size: int = 50, embed: int = 16,
                         units: int = 16, layers: int = 2, dtype: str = "float32",
                         learning_rate: float = 0.5) -> tf.compat.v1.GraphDef:
    """A tf_keras LSTM language model as a TF1 script builds it: placeholders of a FIXED batch (``input``,
    ``labels``: ``[batch_size, seq_len]`` token ids), an embedding, LAYERS stacked LSTMs (``lstm0``, ``lstm1``,
    ...; ``return_sequences=True``) and a softmax head over the vocabulary, trained by SGD. Unlike
    :func:`lstm_lm_graph` (Keras' own build, batch unknown inside), the batch is static everywhere, so the
    recurrent loops' TensorList element shapes and their gradients' folded shapes hold it. DTYPE: the
    layers' float type ("float64" for exactness checks)."""
    import tf_keras

    init = tf_keras.initializers
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        tokens = v1.placeholder(tf.int32, [batch_size, seq_len], name="input")
        labels = v1.placeholder(tf.int32, [batch_size, seq_len], name="labels")
        h = tf_keras.layers.Embedding(vocab_size, embed, embeddings_initializer=init.RandomUniform(-0.5, 0.5, seed=0),
                                      dtype=dtype, name="embedding")(tokens)
        for i in range(layers):
            h = tf_keras.layers.LSTM(units, return_sequences=True, kernel_initializer=init.GlorotUniform(seed=1 + i),
                                     recurrent_initializer=init.Orthogonal(seed=11 + i), dtype=dtype,
                                     name=f"lstm{i}")(h)
        logits = tf_keras.layers.Dense(vocab_size, kernel_initializer=init.GlorotUniform(seed=21), dtype=dtype,
                                       name="softmax")(h)
        _finish(_xent(logits, labels), v1.train.GradientDescentOptimizer(learning_rate))
    return g.as_graph_def()


def lstm_lm_graph(*, batch_size: int = 4, seq_len: int = 6, vocab_size: int = 12, embed: int = 8, units: int = 8,
                  layers: int = 2, optimizer: str = "adam") -> tf.compat.v1.GraphDef:
    """:func:`lstm_lm_model` as a training GraphDef (via :func:`tag.frontend.keras.training_graph_def`):
    next-token loss, sparse categorical cross-entropy from logits, the labels ``[B, seq_len]``."""
    import tf_keras

    def build() -> Any:
        return lstm_lm_model(seq_len=seq_len, vocab_size=vocab_size, embed=embed, units=units, layers=layers)

    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    gd = training_graph_def(build, loss, optimizer, batch_size, label_shape=(seq_len,), label_dtype=tf.int32)
    with tf.Graph().as_default():   # a throwaway build of the model, for Keras' own count
        count = build().count_params()
    g = tf.Graph()
    with g.as_default():
        _record_trainable_count(count)
    gd.node.extend(g.as_graph_def().node)
    return gd
