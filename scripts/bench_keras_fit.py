"""tag.fit against Keras's own model.fit: held-out accuracy for the same model, steps, batches and optimizer.

Loads scikit-learn's digits (1797 8x8 images, 10 classes; a stratified 25% held out), builds a small tf_keras
MLP (``--batchnorm`` adds a BatchNormalization layer) and copies its initial weights into two models. One trains
with ``model.fit`` on this process (one device), the other with ``tag.fit`` on the loopback cluster
(``topologies/localhost.pbtxt``'s three CPU hosts, on free ports), planned by ``tag.optimize`` or for
``--strategy``. Both see the same global batches in the same order (each tag input pipeline takes its slice of
every global batch, ``ctx.batch_range``) and a fresh optimizer of the same class and hyperparameters. Prints
both held-out accuracies, their difference (target: within 1 point), the plan, the times and the load average.

Usage::

    python scripts/bench_keras_fit.py [--steps 300] [--optimizer adam|sgd|rmsprop|adagrad] [--lr 0.001]
                                      [--strategy dp_allreduce] [--batchnorm] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag_bench.machine import load1  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/
OPTIMIZERS = {"adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad"}


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test): digits scaled to [0, 1], a stratified quarter held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return tuple(train_test_split(x, data.target.astype(np.int64), test_size=0.25, random_state=seed,
                                  stratify=data.target))


def loopback_topology() -> Any:
    """``topologies/localhost.pbtxt`` on free ports (two runs on one machine must not share its fixed ones)."""
    import tag
    from tag.backend.runtime import free_ports
    with open(os.path.join(REPO, "topologies", "localhost.pbtxt"), encoding="utf-8") as f:
        text = f.read()
    for old, new in zip(("23451", "23452", "23453"), free_ports(3), strict=True):
        text = text.replace(f"port: {old}", f"port: {new}")
    return tag.parse_topology(text)


def build_model(batchnorm: bool, seed: int) -> Any:
    import tf_keras
    tf_keras.utils.set_random_seed(seed)
    layers = [tf_keras.Input((64,)), tf_keras.layers.Dense(64, activation="relu")]
    if batchnorm:
        layers.append(tf_keras.layers.BatchNormalization())
    return tf_keras.Sequential([*layers, tf_keras.layers.Dense(10)])


def batch_order(n: int, steps: int, batch: int, seed: int) -> np.ndarray:
    """The example indices of STEPS global batches of BATCH: a fresh permutation of 0..N-1 per epoch."""
    rng = np.random.default_rng(seed)
    epochs = -(-steps * batch // n)
    return np.concatenate([rng.permutation(n) for _ in range(epochs)])[:steps * batch]


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y))


def compare(*, steps: int, batch: int, optimizer: str, lr: float, strategy: str | None, batchnorm: bool,
            seed: int = 0, topology: Any = None) -> dict:
    """Train the same initial model with model.fit (one device) and tag.fit (TOPOLOGY, default the loopback
    cluster) on the same batches; returns both held-out accuracies, the plan's strategy and the times."""
    import tensorflow as tf
    import tf_keras

    import tag
    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    x_train, x_test, y_train, y_test = digits(seed)
    order = batch_order(len(x_train), steps, batch, seed)
    xs, ys = x_train[order], y_train[order]
    keras_model, tag_model = build_model(batchnorm, seed), build_model(batchnorm, seed + 1)
    tag_model.set_weights(keras_model.get_weights())
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_optimizer():
        return getattr(tf_keras.optimizers, OPTIMIZERS[optimizer])(learning_rate=lr)

    keras_model.compile(optimizer=make_optimizer(), loss=loss)
    t0 = time.perf_counter()
    keras_model.fit(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch), epochs=1, verbose=0)
    keras_s = time.perf_counter() - t0

    def dataset_fn(ctx):               # this pipeline's slice of every global batch
        lo, hi = ctx.batch_range
        return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).map(lambda x, y: (x[lo:hi], y[lo:hi]))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-keras-fit-") as ckpt:
        result = tag.fit(tag_model, topology or loopback_topology(), dataset_fn, loss=loss,
                         optimizer=make_optimizer(), steps=steps, batch_size=batch, strategy=strategy,
                         progress=False, seed=seed, checkpoint_dir=ckpt)
        plan = read_checkpoint_meta(ckpt).get("strategy") or strategy      # a given strategy's name
    tag_s = time.perf_counter() - t0
    keras_acc, tag_acc = accuracy(keras_model, x_test, y_test), accuracy(tag_model, x_test, y_test)
    return {"steps": steps, "batch": batch, "optimizer": OPTIMIZERS[optimizer], "learning_rate": lr,
            "batchnorm": batchnorm, "strategy": plan, "searched": strategy is None, "steps_done": result.steps_done,
            "input_pipelines": len(result.pipelines),
            "keras_accuracy": keras_acc, "tag_accuracy": tag_acc, "difference_points": 100 * (tag_acc - keras_acc),
            "test_examples": int(len(y_test)), "tag_final_loss": result.losses[-1] if result.losses else None,
            "keras_s": keras_s, "tag_s": tag_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=60, help="global batch (default 60: 20 per loopback host)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--strategy", default=None, help="a built-in strategy instead of tag.optimize's search")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNormalization layer after the hidden layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    run = Run(__file__, argv)
    row = compare(steps=args.steps, batch=args.batch, optimizer=args.optimizer, lr=args.lr, strategy=args.strategy,
                  batchnorm=args.batchnorm, seed=args.seed)
    print(f"digits, {row['test_examples']} held out; {row['steps']} steps of {row['batch']}, {row['optimizer']} "
          f"lr {row['learning_rate']:g}{', batchnorm' if row['batchnorm'] else ''}; tag's plan "
          f"{row['strategy']} ({'searched' if row['searched'] else 'given'}, {row['input_pipelines']} input pipelines)")
    print(f"model.fit (one device): accuracy {row['keras_accuracy']:.4f}  ({row['keras_s']:.1f} s)")
    print(f"tag.fit (loopback cluster): accuracy {row['tag_accuracy']:.4f}  ({row['tag_s']:.1f} s, "
          f"{row['steps_done']} steps)")
    print(f"difference {row['difference_points']:+.2f} points (target within 1); load average {load1():.2f}")
    write_json(args.json, {"rows": [row]}, run)
    return 0 if abs(row["difference_points"]) <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
