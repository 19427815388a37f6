"""How should one host's program hand a tensor to another's? The measurement behind tag's host programs.

Each host runs its own program in its own session (``tag.backend.rewrite.programs``); a tensor that crosses
hosts cannot ride TensorFlow's ``_Send``/``_Recv`` between the two, which live inside one session. Three ways
are timed side by side on a two-host testbed (network namespaces, a shaped link), each in a process per host
as tag runs them:

- ``one-graph``: today's baseline, one client graph over both hosts (``_Send``/``_Recv`` inside one session);
- ``collective``: a ``CollectiveBcastSendV2`` / ``CollectiveBcastRecvV2`` pair, a group of the two hosts,
  each host's session under the run's collective graph key (what tag's host programs use);
- ``queue``: a ``FIFOQueueV2`` on the receiving host, shared by name: the sender's session enqueues onto the
  receiver's device, the receiver's session dequeues. Timed without a collective graph key: with one (which
  every program that also all-reduces needs) both sessions run their partitions on the receiver under the same
  step id, and TensorFlow's per-step rendezvous of one is torn down under the other ("ValidateDevices called
  before initialization", or a hang) -- so a queue cannot carry tensors beside collectives.

Patterns: ``oneway`` (host 0 to host 1 every step) and ``roundtrip`` (0 to 1 and back, as a pipeline's activation
and its gradient). Sizes 4 KB, 1 MB and 16 MB. Prints the median step per case with the load average, and with
``--json FILE`` writes the rows (``provenance`` included).

Usage (root: network namespaces)::

    python scripts/bench_exchange.py --gbps 1 --json exchange.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

SIZES = (4096, 1 << 20, 16 << 20)
PATTERNS = ("oneway", "roundtrip")
MODES = ("one-graph", "collective", "queue")
TOPOLOGY = """name: "two"
host {{ name: "a" address: "127.0.0.1" port: 24001 device {{ type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05
  memory_bandwidth_gbs: 10 }} }}
host {{ name: "b" address: "127.0.0.1" port: 24002 device {{ type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05
  memory_bandwidth_gbs: 10 }} }}
fabric {{ bandwidth_gbps: {gbps} latency_us: 50 }}
"""


# ------------------------------------------------------------------------------------------------ one host
def host_main(cluster: dict, task: int, mode: str, pattern: str, nbytes: int, steps: int, barrier_dir: str) -> None:
    """One host: its TF server, and (but for the receiving host of one-graph) its own session timing STEPS
    steps; prints {"host", "median_ms"} as a JSON line."""
    import numpy as np
    import tensorflow as tf
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    config = v1.ConfigProto()
    config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
    config.intra_op_parallelism_threads, config.inter_op_parallelism_threads = 1, 2
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name="worker", task_index=task, config=config)
    n = nbytes // 4
    fetch = _exchange_graph(tf, mode, pattern, task, n)
    graph, ops = fetch
    times = []
    if ops:
        sess = v1.Session(server.target, graph=graph, config=config)
        sess.run(graph.get_operation_by_name("init"))
        options = v1.RunOptions()
        if mode == "collective":
            options.experimental.collective_graph_key = 777
        _touch(barrier_dir, f"ready{task}")
        if mode != "one-graph":
            _wait_for(barrier_dir, ["ready0", "ready1"])
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            sess.run(ops, options=options)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"host": task, "median_ms": 1e3 * float(np.median(times[3:]))}), flush=True)
        _touch(barrier_dir, f"done{task}")
    _wait_for(barrier_dir, ["done0"] + (["done1"] if mode != "one-graph" else []))   # keep serving till then


def _touch(directory: str, name: str) -> None:
    open(os.path.join(directory, name), "w").close()


def _wait_for(directory: str, names: list[str], timeout_s: float = 300.0) -> None:
    """Wait until every file of NAMES exists in DIRECTORY (the hosts' barrier); SystemExit after TIMEOUT_S."""
    start = time.monotonic()
    while not all(os.path.exists(os.path.join(directory, name)) for name in names):
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"the other host did not come within {timeout_s:.0f} s")
        time.sleep(0.01)


def _exchange_graph(tf, mode: str, pattern: str, task: int, n: int):
    """(graph, the ops host TASK runs each step) for MODE and PATTERN."""
    v1 = tf.compat.v1
    dev = lambda t: f"/job:worker/task:{t}/device:CPU:0"   # noqa: E731 - a one-line helper
    g = tf.Graph()
    ops = []
    with g.as_default():
        def source(t):
            with tf.device(dev(t)):
                v = v1.get_variable(f"x{t}", initializer=tf.random.uniform([n]), use_resource=True)
                return v.read_value() * 1.0001

        def send(x, src, dst, key):
            if mode == "collective":
                with tf.device(dev(src)):
                    return tf.raw_ops.CollectiveBcastSendV2(input=x, group_size=2, group_key=5, instance_key=key,
                                                            communication_hint="ring")
            with tf.device(dev(dst)):
                q = tf.queue.FIFOQueue(2, [tf.float32], shapes=[[n]], shared_name=f"ex{key}", name=f"q{key}")
                return q.enqueue([x])

        def recv(src, dst, key):
            with tf.device(dev(dst)):
                if mode == "collective":
                    return tf.raw_ops.CollectiveBcastRecvV2(group_size=2, group_key=5, instance_key=key, shape=[n],
                                                            T=tf.float32, communication_hint="ring")
                q = tf.queue.FIFOQueue(2, [tf.float32], shapes=[[n]], shared_name=f"ex{key}", name=f"q{key}")
                return q.dequeue()

        if mode == "one-graph":
            if task == 0:
                x = source(0)
                with tf.device(dev(1)):
                    y = tf.reduce_sum(x) if pattern == "oneway" else x * 2.0
                if pattern == "roundtrip":
                    with tf.device(dev(0)):
                        y = tf.reduce_sum(y)
                ops = [y]
        elif task == 0:
            ops.append(send(source(0), 0, 1, 101))
            if pattern == "roundtrip":
                with tf.device(dev(0)):
                    ops.append(tf.reduce_sum(recv(1, 0, 102)))
        else:
            y = recv(0, 1, 101)
            with tf.device(dev(1)):
                ops.append(send(y * 2.0, 1, 0, 102) if pattern == "roundtrip" else tf.reduce_sum(y))
        v1.variables_initializer(v1.global_variables(), name="init")
    return g, ops


# ------------------------------------------------------------------------------------------------ the benchmark
def measure(tb, mode: str, pattern: str, nbytes: int, steps: int) -> float | None:
    """The slower host's median step (ms) of one case on the testbed TB, or None when it failed."""
    cluster = tb.topology.cluster_spec()
    with tempfile.TemporaryDirectory(prefix="tag-exchange-") as barrier_dir:
        procs = [subprocess.Popen(tb.launch_prefix(i) + [sys.executable, os.path.abspath(__file__), "--host-child",
                                                         json.dumps([cluster, i, mode, pattern, nbytes, steps,
                                                                     barrier_dir])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return None
    medians = [json.loads(line)["median_ms"] for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    return max(medians) if medians else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gbps", type=float, default=1.0, help="the link between the two hosts (default 1 Gbit/s)")
    p.add_argument("--reps", type=int, default=2, help="rounds of every case, interleaved (default 2)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--host-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host_child:
        host_main(*json.loads(args.host_child))
        return 0
    import tag
    from tag_bench.machine import load1
    from tag_bench.records import Run, write_json
    from tag_bench.testbed import Testbed
    run = Run(__file__, argv)
    rows = []
    topo = tag.parse_topology(TOPOLOGY.format(gbps=args.gbps))
    with Testbed(topo, cpu_quota=[1.0, 1.0]) as tb:
        for pattern in PATTERNS:
            for nbytes in SIZES:
                for rep in range(args.reps):
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        steps = 20 if nbytes > (1 << 20) else 100
                        ms = measure(tb, mode, pattern, nbytes, steps)
                        row = {"pattern": pattern, "bytes": nbytes, "mode": mode, "rep": rep, "median_ms": ms,
                               "load": round(load1(), 2)}
                        rows.append(row)
                        print(f"{pattern:9s} {nbytes:>9d} B  {mode:10s}  rep {rep}  "
                              f"{'failed' if ms is None else f'{ms:8.2f} ms'}  load {row['load']}", flush=True)
                        write_json(args.json, {"gbps": args.gbps, "rows": rows}, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
