"""Train a real data set with tag's searched plan on three hosts, and compare with one device.

The data: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes; the file
``sklearn/datasets/data/digits.csv.gz`` ships with scikit-learn, nothing is downloaded). The first 1500
rows train, the last 297 are held out. Each worker host reads the file itself with
``tf.data.experimental.CsvDataset`` -- its own shard of the training rows, shuffled, batched at its share
of the global batch -- so no example passes through the client. The model: a TF1-style MLP (64-512-512-10,
Adam). ``tag.optimize`` searches a plan for the cluster and ``tag.train`` trains it, evaluating held-out
accuracy every ``--eval-every`` steps from the weights (one copy per original variable); then the same
graph trains on one device (one pipeline, the same steps and seed) and the two curves are printed.

Usage (from the repository root; ``pip install -e ".[examples]"`` adds scikit-learn)::

    python examples/train_digits.py --testbed          # 3 network-namespace hosts (needs root)
    python examples/train_digits.py                    # 3 local TF servers on loopback
    python examples/train_digits.py --write-graph digits.pb   # then: tag-deploy ... --input train_digits:train_set

``train_set`` is also a ``tag-deploy --run --input`` function (run from this directory, or with it on
``PYTHONPATH``).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

TRAIN_ROWS = 1500
BATCH = 128
HIDDEN = 512
SEED = 0
TOPOLOGY = """name: "digits-3"
# three CPU hosts, the first twice as fast as the others (the testbed gives them 1, 0.5 and 0.5 cores)
host { name: "cpu0" address: "127.0.0.1" port: 23461
       device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 } }
host { name: "cpu1" address: "127.0.0.1" port: 23462
       device { type: "CPUhalf" kind: CPU memory_gib: 2 peak_tflops: 0.025 memory_bandwidth_gbs: 10 } }
host { name: "cpu2" address: "127.0.0.1" port: 23463
       device { type: "CPUhalf" kind: CPU memory_gib: 2 peak_tflops: 0.025 memory_bandwidth_gbs: 10 } }
fabric { bandwidth_gbps: 10 latency_us: 50 }
"""
QUOTAS = [1.0, 0.5, 0.5]


def digits_file() -> str:
    """The path of scikit-learn's bundled digits CSV (64 pixel columns, then the label)."""
    import sklearn.datasets
    path = os.path.join(os.path.dirname(sklearn.datasets.__file__), "data", "digits.csv.gz")
    if not os.path.exists(path):
        raise SystemExit(f"scikit-learn's digits file is missing ({path})")
    return path


def _rows(path: str):
    import tensorflow as tf
    return tf.data.experimental.CsvDataset(path, [tf.float32] * 65, compression_type="GZIP")


def _example(*cols):
    import tensorflow as tf
    return {"x": tf.stack(cols[:64]) / 16.0, "y": tf.cast(cols[64], tf.int64)}


def train_set(ctx):
    """dataset_fn for tag.train / ``tag-deploy --input``: this host's shard of the training rows, shuffled,
    repeated, as single examples (tag batches them at this host's share)."""
    ds = _rows(digits_file()).take(TRAIN_ROWS).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.map(_example).cache().shuffle(TRAIN_ROWS, seed=SEED * 1000 + ctx.input_pipeline_id).repeat()


def held_out() -> tuple[np.ndarray, np.ndarray]:
    """The last 297 rows (never trained on), read in this process for evaluation."""
    import gzip
    with gzip.open(digits_file(), "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    test = data[TRAIN_ROWS:]
    return test[:, :64] / 16.0, test[:, 64].astype(np.int64)


def build_graph(seed: int = SEED):
    """The training GraphDef: x [128, 64] float32, y [128] int64, an MLP (64-512-512-10) and Adam
    (op names train_op/loss/init)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(seed)
        x = tf1.placeholder(tf.float32, [BATCH, 64], name="x")
        y = tf1.placeholder(tf.int64, [BATCH], name="y")
        w1 = tf1.get_variable("hidden1/w", [64, HIDDEN])
        b1 = tf1.get_variable("hidden1/b", [HIDDEN], initializer=tf1.zeros_initializer())
        w2 = tf1.get_variable("hidden2/w", [HIDDEN, HIDDEN])
        b2 = tf1.get_variable("hidden2/b", [HIDDEN], initializer=tf1.zeros_initializer())
        w3 = tf1.get_variable("logits/w", [HIDDEN, 10])
        b3 = tf1.get_variable("logits/b", [10], initializer=tf1.zeros_initializer())
        h = tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2)
        logits = tf.matmul(h, w3) + b3
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.AdamOptimizer(1e-3).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def evaluator(x: np.ndarray, y: np.ndarray):
    """eval_fn(weights, step) -> held-out loss and accuracy, the MLP's forward pass on the weights."""
    def eval_fn(w: dict, step: int) -> dict:
        h = np.maximum(x @ w["hidden1/w"] + w["hidden1/b"], 0.0)
        h = np.maximum(h @ w["hidden2/w"] + w["hidden2/b"], 0.0)
        logits = h @ w["logits/w"] + w["logits/b"]
        logits = logits - logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return {"loss": float(-logp[np.arange(len(y)), y].mean()),
                "accuracy": float((logits.argmax(axis=1) == y).mean())}
    return eval_fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--budget", type=float, default=20.0, help="search seconds")
    p.add_argument("--testbed", action="store_true", help="three network-namespace hosts with CPU quotas (root)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--json", default=None, help="write the curves and the final accuracies here")
    p.add_argument("--write-graph", default=None, metavar="FILE", help="only write the training GraphDef")
    args = p.parse_args(argv)
    import tag
    from tag.backend.runtime.training import train_graph
    from tag.cluster.topology import parse_topology

    graph_def = build_graph()
    if args.write_graph:
        with open(args.write_graph, "wb") as f:
            f.write(graph_def.SerializeToString())
        print(f"wrote {args.write_graph}")
        return 0
    x_test, y_test = held_out()
    eval_fn = evaluator(x_test, y_test)
    topo = parse_topology(TOPOLOGY, path="<digits-3>")
    t0 = time.perf_counter()
    results = {}

    def run_tag(topology, target):
        plan = tag.optimize(graph_def, topology, budget_s=args.budget, seed=SEED)
        print(f"plan: {plan.method}, predicted {plan.predicted_step_time * 1e3:.1f} ms/step "
              f"({plan.report()['speedup_vs_dp']:.2f}x dp_allreduce predicted)")
        return plan, tag.train(plan, train_set, steps=args.steps, eval_fn=eval_fn, eval_every=args.eval_every,
                               checkpoint_dir=args.checkpoint_dir, target=target, seed=SEED)

    if args.testbed:
        from tag_bench.testbed import Testbed
        with Testbed(topo, cpu_quota=QUOTAS) as tb:
            target = tb.start_workers(threads_per_worker=1)
            plan, results["tag"] = run_tag(tb.topology, target)
    else:
        from tag.backend.runtime import free_ports
        ports = free_ports(3)
        text = TOPOLOGY
        for old, new in zip((23461, 23462, 23463), ports, strict=True):
            text = text.replace(f"port: {old}", f"port: {new}")
        plan, results["tag"] = run_tag(parse_topology(text, path="<digits-3>"), None)
    # the same graph on one device: one pipeline, the same steps, seed and evaluation
    results["single"] = train_graph(graph_def, "", train_set, inputs=["x", "y"], batch_size=BATCH, steps=args.steps,
                                    eval_fn=eval_fn, eval_every=args.eval_every, seed=SEED)
    tag_acc = dict(results["tag"].evals)
    one_acc = dict(results["single"].evals)
    print(f"\nheld-out accuracy (297 digits), {plan.method} plan on 3 hosts vs one device, batch {BATCH}:")
    print(f"{'step':>6} {'tag':>8} {'single':>8}")
    for step in sorted(tag_acc):
        single = one_acc.get(step, {}).get("accuracy", float("nan"))
        print(f"{step:>6} {tag_acc[step]['accuracy'] * 100:>7.1f}% {single * 100:>7.1f}%")
    last = max(tag_acc)
    diff = (tag_acc[last]["accuracy"] - one_acc[last]["accuracy"]) * 100
    print(f"final: tag {tag_acc[last]['accuracy'] * 100:.1f}%, single device {one_acc[last]['accuracy'] * 100:.1f}% "
          f"(difference {diff:+.1f} points); tag {results['tag'].examples_per_s:,.0f} examples/s on "
          f"{len(results['tag'].pipelines)} input pipelines; {time.perf_counter() - t0:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.method, "steps": args.steps, "batch": BATCH, "testbed": args.testbed,
                       "tag": results["tag"].to_dict(), "single": results["single"].to_dict(),
                       "accuracy_difference_points": diff}, f, indent=1)
    return 0 if abs(diff) <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
