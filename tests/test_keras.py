"""tag.fit: a tf_keras model trained on a loopback cluster from its current weights, the trained weights back in the
model (BatchNorm statistics included), the labels as the data set has them, accuracy as model.fit's; bad input is
one line before anything starts.

The cluster runs (three loopback hosts on free ports, each a process beside its server) are ``slow``."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tag  # noqa: E402
from helpers import load_script  # noqa: E402
from tag.errors import TagError  # noqa: E402

BATCH = 12


def bench():
    return load_script("bench_keras_fit")


def pretrained_model(batchnorm_momentum: float = 0.99, seed: int = 0):
    """An MLP with BatchNorm, every weight (moving statistics too) set far from its initial value."""
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([tf_keras.Input((6,)), tf_keras.layers.Dense(8, activation="relu"),
                                 tf_keras.layers.BatchNormalization(momentum=batchnorm_momentum),
                                 tf_keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    for w in model.weights:
        w.assign(rng.uniform(0.5, 1.5, w.shape).astype(np.float32))
    return model


def examples(n: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Single examples: 6 float64 features (cast to the model's float32 as model.fit does), an int64 label."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :3], axis=1).astype(np.int64)


def dataset_fn_of(x, y):
    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines,
                                                                ctx.input_pipeline_id).repeat()
    return dataset_fn


LOSS = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.slow
def test_training_starts_from_the_pretrained_weights(tmp_path):
    """A zero learning rate and BatchNorm momentum 1: nothing may move, so every weight after fit (and in the
    checkpoint) is the pretrained one; a fresh start would show its initial values instead."""
    model = pretrained_model(batchnorm_momentum=1.0)
    pretrained = {w.name: w.numpy() for w in model.weights}
    result = tag.fit(model, bench().loopback_topology(), dataset_fn_of(*examples()), loss=LOSS,
                     optimizer=tf_keras.optimizers.SGD(0.0), steps=2, batch_size=BATCH, strategy="dp_allreduce",
                     checkpoint_dir=tmp_path, progress=False)
    assert result.steps_done == 2 and result.evals == []
    saved = tf.train.load_checkpoint(result.checkpoint)
    for w in model.weights:
        np.testing.assert_array_equal(w.numpy(), pretrained[w.name])
        np.testing.assert_array_equal(saved.get_tensor(w.name.split(":")[0]), pretrained[w.name])


@pytest.mark.slow
def test_trained_weights_and_batchnorm_statistics_come_back_into_the_model(tmp_path):
    model = pretrained_model()
    pretrained = [w.numpy() for w in model.weights]
    steps_seen = []
    result = tag.fit(model, bench().loopback_topology(), dataset_fn_of(*examples()), loss=LOSS, optimizer="adam",
                     steps=3, batch_size=BATCH, strategy="dp_allreduce", checkpoint_dir=tmp_path, progress=False,
                     eval_fn=lambda weights, step: steps_seen.append(step) or {"n": len(weights)})
    assert result.steps_done == 3 and steps_seen == [3] and result.evals[-1][1]["n"] > len(pretrained)
    saved = tf.train.load_checkpoint(result.checkpoint)
    for w, before in zip(model.weights, pretrained, strict=True):
        assert not np.allclose(w.numpy(), before), f"{w.name} did not change"      # moving statistics too
        np.testing.assert_array_equal(w.numpy(), saved.get_tensor(w.name.split(":")[0]))
    assert model.predict(examples(4)[0], verbose=0).shape == (4, 3)                # still an eager model


@pytest.mark.slow
def test_accuracy_matches_model_fit_on_one_device():
    """scripts/bench_keras_fit.py's comparison, short: the same batches, Adam's same hyperparameters, a
    data-parallel plan over three hosts against model.fit; held-out accuracy within 1 point, after learning."""
    row = bench().compare(steps=40, batch=60, optimizer="adam", lr=3e-3, strategy="dp_allreduce", batchnorm=False)
    assert row["steps_done"] == 40 and row["input_pipelines"] == 3
    assert row["keras_accuracy"] > 0.5, row                    # 40 steps learn digits well beyond chance (0.1)
    assert abs(row["difference_points"]) <= 1.0, row


def test_bad_input_is_one_line_before_anything_starts():
    model = pretrained_model()
    data = dataset_fn_of(*examples())
    topo = "topologies/does-not-exist.pbtxt"            # never read: each error comes first
    cases = [
        (dict(optimizer=tf_keras.optimizers.Nadam()), "cannot map the tf_keras optimizer Nadam"),
        (dict(optimizer=tf_keras.optimizers.Adam(amsgrad=True)), "Adam's amsgrad=True"),
        (dict(optimizer="adamish"), "unknown tf_keras optimizer 'adamish'"),
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(dataset=lambda ctx: tf.data.Dataset.from_tensor_slices(examples()[0])), "(features, labels) pairs"),
        (dict(dataset=lambda ctx: [1, 2]), "not a tf.data.Dataset"),
        (dict(model=lambda: model), "takes a tf_keras.Model"),
    ]
    for change, says in cases:
        kwargs = dict(loss=LOSS, optimizer="sgd", steps=2, batch_size=BATCH, progress=False)
        kwargs.update({k: v for k, v in change.items() if k not in ("dataset", "model")})
        with pytest.raises(TagError) as err:
            tag.fit(change.get("model", model), topo, change.get("dataset", data), **kwargs)
        assert says in str(err.value) and "\n" not in str(err.value), (says, str(err.value))
