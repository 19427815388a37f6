"""Input pipelines on the workers against synthetic on-device batches, for the same plan.

Writes a data set file (fixed-length records: 784 float32 features and a label, 3140 bytes an example;
``--examples`` of them), searches a plan for the zoo MLP (784-wide input) on the loopback cluster
(``topologies/localhost.pbtxt``, or ``--testbed``: three network-namespace hosts), then alternates two
kinds of run of the same rewritten graph on one cluster start: synthetic batches stored on the devices
(``run_steps(synthetic=True)``, what ``tag-deploy --run`` times) and ``tag.train``'s per-host pipelines
reading the file (``FixedLengthRecordDataset``, sharded per host, batched at each host's share, decoded,
prefetched). Prints examples per second of each (global batch / median step time, first step of a run
not counted) and their ratio (target >= 0.9), and the bytes the client sent while training from the
file: the graph (once), the feeds (none) and the step requests (fetch names), against the bytes of the
data set (target < 1%) and of the examples the run consumed.

Usage::

    python scripts/bench_input.py [--quick] [--testbed] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag_bench.machine import load1  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

FEATURES = 784
RECORD = (FEATURES + 1) * 4


def write_data(path: str, examples: int, seed: int = 0) -> int:
    """EXAMPLES records of FEATURES float32 features and a float32 label in 0..9; returns the file's bytes."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, examples, 4096):
            n = min(4096, examples - start)
            block = np.empty((n, FEATURES + 1), np.float32)
            block[:, :FEATURES] = rng.standard_normal((n, FEATURES))
            block[:, FEATURES] = rng.integers(0, 10, n)
            f.write(block.tobytes())
    return os.path.getsize(path)


def dataset_fn_for(path: str):
    import tensorflow as tf

    def dataset_fn(ctx):
        share = ctx.batch_size

        def decode(records):
            raw = tf.reshape(tf.io.decode_raw(records, tf.uint8), [share, FEATURES + 1, 4])
            values = tf.bitcast(raw, tf.float32)
            return values[:, :FEATURES], tf.cast(values[:, FEATURES], tf.int32)

        ds = tf.data.FixedLengthRecordDataset(path, RECORD).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(share, drop_remainder=True).map(decode)
    return dataset_fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, a smaller file")
    p.add_argument("--testbed", action="store_true", help="three network-namespace hosts (needs root)")
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--examples", type=int, default=None, help="examples in the data set file")
    p.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    steps = args.steps or (15 if args.quick else 40)
    examples = args.examples or (8000 if args.quick else 20000)
    import tag
    from tag.backend.runtime import run_steps
    from tag.backend.runtime.measure import open_cluster
    from tag.backend.runtime.training import train_graph

    topo = tag.load_topology(os.path.join(REPO, "topologies", "localhost.pbtxt"))
    graph_def = tag.zoo.training_graph("mlp", batch_size=args.batch)
    tmp = tempfile.mkdtemp(prefix="tag-bench-input-")
    path = os.path.join(tmp, "train.records")
    data_bytes = write_data(path, examples)
    synthetic, piped, results = [], [], []

    def measure(topology, target, watchdog):
        from tag.backend.runtime.guard import RunControl
        plan = tag.optimize(graph_def, topology, budget_s=10 if args.quick else 20)
        for _ in range(args.rounds):
            s = run_steps(plan.graph_def, target, train_op=plan.train_op, loss=plan.loss, init=plan.init,
                          steps=steps, warmup=1, synthetic=True, control=RunControl(watchdog=watchdog))
            synthetic.append((float(np.median(s.step_times[1:])), load1()))
            r = train_graph(plan.graph_def, target, dataset_fn_for(path), inputs=plan.inputs,
                            batch_size=plan.batch_size, steps=steps, train_op=plan.train_op, loss=plan.loss,
                            init=plan.init, progress=False, control=RunControl(watchdog=watchdog))
            piped.append((float(np.median(r.step_times[1:])), load1()))
            results.append(r)
        return plan

    t0 = time.perf_counter()
    if args.testbed:
        from tag_bench.testbed import Testbed
        with Testbed(topo) as tb:
            target = tb.start_workers(threads_per_worker=1)
            plan = measure(tb.topology, target, tb.cluster.dead_worker)
    else:
        with open_cluster(topo) as cluster:
            plan = measure(topo, cluster.target, cluster.watchdog)
    os.remove(path)
    os.rmdir(tmp)
    syn_s = float(np.median([t for t, _ in synthetic]))
    pipe_s = float(np.median([t for t, _ in piped]))
    last = results[-1]
    fetch_names = len(plan.train_op) + len(plan.loss or "") + 8
    client = last.client_bytes["graph"] + last.client_bytes["feeds"] + fetch_names * last.steps_done
    consumed = last.steps_done * args.batch * RECORD
    out = {
        "plan": plan.method, "batch": args.batch, "steps": steps, "rounds": args.rounds,
        "testbed": args.testbed, "pipelines": [[s.task, s.lo, s.hi] for s in last.pipelines],
        "examples_per_s_synthetic": args.batch / syn_s, "examples_per_s_input": args.batch / pipe_s,
        "input_vs_synthetic": syn_s / pipe_s,
        "client_bytes": client, "client_graph_bytes": last.client_bytes["graph"],
        "client_feed_bytes": last.client_bytes["feeds"], "dataset_bytes": data_bytes,
        "client_fraction_of_dataset": client / data_bytes, "consumed_bytes": consumed,
        "synthetic_step_s": [t for t, _ in synthetic], "input_step_s": [t for t, _ in piped],
        "load_average": [la for _, la in synthetic + piped], "seconds": time.perf_counter() - t0,
    }
    print(f"plan {plan.method} on {'the testbed' if args.testbed else 'loopback'}: batch {args.batch}, "
          f"{steps} steps x {args.rounds} rounds, {len(last.pipelines)} input pipelines "
          f"({', '.join(f'task {t}: {hi - lo}' for t, lo, hi in out['pipelines'])})")
    print(f"{'batches':<22} {'step (median)':>14} {'examples/s':>11} {'load avg':>9}")
    for name, runs in (("synthetic on device", synthetic), ("input pipelines", piped)):
        for t, la in runs:
            print(f"{name:<22} {t * 1e3:>11.1f} ms {args.batch / t:>11,.0f} {la:>9.1f}")
    print(f"input pipelines / synthetic: {out['input_vs_synthetic']:.3f} (target >= 0.9)")
    print(f"client sent {client:,} bytes (graph {last.client_bytes['graph']:,}, feeds {last.client_bytes['feeds']}, "
          f"step requests ~{fetch_names * last.steps_done:,}) = {out['client_fraction_of_dataset'] * 100:.3f}% of the "
          f"data set's {data_bytes:,} bytes (target < 1%); the run consumed {consumed:,} bytes of examples")
    write_json(args.json, out, this_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
