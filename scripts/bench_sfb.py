"""Sufficient-factor broadcasting: bytes on the wire and step time with and without SFB.

Three parts:
  1. predicted (simulator, default cost model): for each zoo model at a small and a large per-device
     batch on a cluster file, data parallelism without SFB, with every eligible gradient as factors, and
     with the MILP's selection (``tag.compress.select_sfb``): bytes on the wire per step and step time;
  2. exactness: an MLP, a VGG19-like classifier head and a transformer feed-forward block trained 3 steps
     on three in-process TF servers (uneven batch shares), with and without SFB: the largest relative
     difference of any weight copy;
  3. measured: an FC-heavy MLP on the network-namespace testbed (two one-core hosts behind a slow
     shaped link, ``tag_bench.testbed``), dp_allreduce with and without the selected SFB gradients;
     median step times with the load averages of this (shared) machine beside them. Needs root.

Usage::

    python scripts/bench_sfb.py                  # every zoo model, 2 and 64 examples per device
    python scripts/bench_sfb.py --quick          # mlp and transformer only, fewer measured steps
    python scripts/bench_sfb.py --json sfb.json  # {"max_rel_weight_diff", "max_bytes_saved_fraction",
                                                 #  "measured_speedup_sfb", "rows"}
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from tag import zoo  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.runtime import run_steps  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.compress import eligible_gradients, select_sfb  # noqa: E402
from tag.sim.simulator import Simulator  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402
from tag_bench.exactness import in_process_servers, train_copies  # noqa: E402
from tag_bench.machine import load_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.stats import figure_text  # noqa: E402

tf1 = tf.compat.v1
ZOO = [("mlp", {}), ("vgg19", {}), ("resnet50", {}), ("transformer", {}), ("bert_base", {})]
QUICK_ZOO = [("mlp", {}), ("transformer", dict(num_layers=2))]
PER_DEVICE_BATCHES = (2, 64)
MEASURED_MODEL = ("mlp-1024x3", "zoo:mlp,hidden=1024x1024x1024", 16)
SLOW_LINK_GBPS = 0.5


# ------------------------------------------------------------------------------------------------ predicted
def predicted_rows(topology_path: str, models, per_device_batches) -> list[dict]:
    """Bytes on the wire and predicted step time of dp_allreduce without SFB, with all eligible gradients
    and with the MILP's selection."""
    topo = tag.load_topology(topology_path)
    rows = []
    for name, options in models:
        for per_device in per_device_batches:
            batch = per_device * topo.num_devices
            ir = tag.analyze(zoo.training_graph(name, batch_size=batch, **options))
            grouping = group_ops(ir, 64)
            sim = Simulator(ir, topo, grouping)
            dp = builtin_strategy("dp_allreduce", ir, topo, grouping)
            plain, every = sim.evaluate(dp), sim.evaluate(dataclasses.replace(dp, sfb=list(sim.sfb.factors)))
            t0 = time.perf_counter()
            chosen = select_sfb(sim, dp)
            seconds = time.perf_counter() - t0
            row = {"part": "predicted", "model": name, "topology": topo.name, "per_device_batch": per_device,
                   "eligible": len(sim.sfb.factors), "chosen": len(chosen.chosen),
                   "bytes_plain": plain.comm_bytes, "bytes_all_sfb": every.comm_bytes,
                   "bytes_selected": chosen.result.comm_bytes,
                   "step_plain_s": plain.step_time, "step_all_sfb_s": every.step_time,
                   "step_selected_s": chosen.step_time, "selection_s": seconds,
                   "bytes_saved_fraction": 1.0 - chosen.result.comm_bytes / plain.comm_bytes
                   if plain.comm_bytes > 0 else 0.0}
            rows.append(row)
            print(f"{name:<12} {per_device:>4}/dev  bytes {plain.comm_bytes / 2**20:10.1f} -> all "
                  f"{every.comm_bytes / 2**20:10.1f} / chosen {chosen.result.comm_bytes / 2**20:10.1f} MiB  "
                  f"step {plain.step_time * 1e3:9.2f} -> all {every.step_time * 1e3:9.2f} / chosen "
                  f"{chosen.step_time * 1e3:9.2f} ms  ({len(chosen.chosen)}/{len(sim.sfb.factors)} chosen, "
                  f"saved {row['bytes_saved_fraction'] * 100:.0f}%)", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ exactness
def _dense_head(batch: int = 8):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, 32], name="input")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        h = x
        for i, width in enumerate((24, 24, 5)):
            w = tf1.get_variable(f"fc{i}/kernel", [h.shape[1], width],
                                 initializer=tf1.glorot_uniform_initializer(seed=i))
            h = tf.matmul(h, w) + tf1.get_variable(f"fc{i}/bias", [width], initializer=tf1.zeros_initializer())
            h = tf.nn.relu(h) if i < 2 else h
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        tf1.train.MomentumOptimizer(0.05, 0.9).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


def _ffn_block(batch: int = 8, seq: int = 4, d: int = 8, d_ff: int = 16):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, seq, d], name="input")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        flat = tf.reshape(x, [batch * seq, d])
        w_in = tf1.get_variable("ffn_in/kernel", [d, d_ff], initializer=tf1.glorot_uniform_initializer(seed=1))
        w_out = tf1.get_variable("ffn_out/kernel", [d_ff, d], initializer=tf1.glorot_uniform_initializer(seed=2))
        h = tf.matmul(tf.nn.relu(tf.matmul(flat, w_in)), w_out) + flat
        pooled = tf.reduce_mean(tf.reshape(h, [batch, seq, d]), axis=1)
        w_cls = tf1.get_variable("cls/kernel", [d, 3], initializer=tf1.glorot_uniform_initializer(seed=3))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pooled @ w_cls))
        tf1.train.AdamOptimizer(1e-2).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


def exactness_rows() -> list[dict]:
    """Largest relative weight difference with and without SFB on three in-process servers (shares 4:2:2)."""
    ports, servers = in_process_servers(3)
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                      f'memory_gib: 2 peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}'
                      for i, (p, f) in enumerate(zip(ports, (0.1, 0.05, 0.05), strict=True)))
    topo = parse_topology(f'name: "exact"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n')
    models = {"mlp": zoo.training_graph("mlp", batch_size=8, hidden=(16, 16)), "vgg19_head": _dense_head(),
              "ffn_block": _ffn_block()}
    rng = np.random.RandomState(0)
    rows = []
    for name, gd in models.items():
        ir = tag.analyze(gd)
        grouping = group_ops(ir, 8)
        dp = Strategy(grouping, [Action((0, 1, 2), "allreduce")] * grouping.num_groups)
        sfb = [f.variable for f in eligible_gradients(ir)]
        nodes = {n.name: n for n in gd.node}
        batches = [{f"{i}:0": (rng.randint(0, 3, [d.size for d in nodes[i].attr["shape"].shape.dim]).astype(np.int32)
                               if nodes[i].attr["dtype"].type == tf.int32.as_datatype_enum else
                               rng.randn(*[d.size for d in nodes[i].attr["shape"].shape.dim]).astype(np.float32))
                    for i in ir.inputs} for _ in range(3)]
        want = train_copies(rewrite(gd, ir, dp, topo), ir, batches)
        got = train_copies(rewrite(gd, ir, dataclasses.replace(dp, sfb=sfb), topo), ir, batches)
        worst = max(float(np.max(np.abs(c - w[v][0]))) / (float(np.max(np.abs(w[v][0]))) or 1.0)
                    for w, s in zip(want, got, strict=True) for v in w for c in s[v])
        rows.append({"part": "exactness", "model": name, "sfb_gradients": sfb, "max_rel_weight_diff": worst})
        print(f"{name:<12} {len(sfb)} gradients by SFB, 3 steps: max relative weight difference {worst:.2e}",
              flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ measured
def two_host_topology(bandwidth_gbps: float) -> str:
    hosts = "\n".join(
        f'host {{ name: "cpu{i}" address: "127.0.0.1" port: {24561 + i}\n'
        f'  device {{ type: "CPU" kind: CPU count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}'
        for i in range(2))
    return (f'name: "testbed-{bandwidth_gbps:g}gbps"\n{hosts}\n'
            f'link {{ a: "cpu0" b: "cpu1" bandwidth_gbps: {bandwidth_gbps} latency_us: 50 }}\n')


def measured_rows(steps: int) -> list[dict]:
    """dp_allreduce with and without the selected SFB gradients on the testbed behind a slow link."""
    from tag_bench.testbed import Testbed, testbed_available
    ok, why = testbed_available()
    if not ok:
        print(f"measured: skipped, the testbed is not available here: {why}", flush=True)
        return []
    label, spec, batch = MEASURED_MODEL
    topo = parse_topology(two_host_topology(SLOW_LINK_GBPS), path="<bench_sfb testbed>")
    _, gd = zoo.resolve_model(spec, batch)
    ir = tag.analyze(gd, batch_size=batch)
    grouping = group_ops(ir)
    sim = Simulator(ir, topo, grouping)
    dp = builtin_strategy("dp_allreduce", ir, topo, grouping)
    chosen = select_sfb(sim, dp, batch)
    rows = []
    with Testbed(topo) as tb:
        tb.start_workers(threads_per_worker=1)
        for name, st, predicted in (("dp_allreduce", dp, chosen.base_step_time),
                                    ("dp_allreduce+sfb", chosen.strategy, chosen.step_time)):
            res = rewrite(gd, ir, st, tb.topology, batch_size=batch)
            before = load_text(2)
            run = run_steps(res.graph_def, tb.target, train_op=res.train_op, loss=res.loss, init=res.init,
                            steps=steps, warmup=3, synthetic=True)
            measured = float(np.median(run.step_times[3:]))
            rows.append({"part": "measured", "model": label, "strategy": name, "bandwidth_gbps": SLOW_LINK_GBPS,
                         "sfb_gradients": list(st.sfb), "predicted_s": predicted, "measured_s": measured,
                         "load_before": before, "load_after": load_text(2)})
            print(f"{label} {name:<17} {SLOW_LINK_GBPS} Gbit/s  predicted {predicted * 1e3:8.2f} ms  measured "
                  f"{measured * 1e3:8.2f} ms  (load {before} -> {load_text(2)})", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two zoo models, fewer measured steps")
    p.add_argument("--topo", default="topologies/consumer-lab-4host.pbtxt", help="cluster for the predictions")
    p.add_argument("--steps", type=int, default=None, help="measured steps per case (default 15, quick 8)")
    p.add_argument("--json", help="write the figures as JSON to this file")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    steps = args.steps or (8 if args.quick else 15)
    t0 = time.time()
    print(f"== predicted on {args.topo} (load {load_text(2)})", flush=True)
    rows = predicted_rows(args.topo, QUICK_ZOO if args.quick else ZOO, PER_DEVICE_BATCHES)
    print(f"== exactness (load {load_text(2)})", flush=True)
    rows += exactness_rows()
    print(f"== measured on the testbed (load {load_text(2)})", flush=True)
    rows += measured_rows(steps)
    diff = max(r["max_rel_weight_diff"] for r in rows if r["part"] == "exactness")
    saved = max(r["bytes_saved_fraction"] for r in rows if r["part"] == "predicted")
    measured = {r["strategy"]: r["measured_s"] for r in rows if r["part"] == "measured"}
    speedup = measured["dp_allreduce"] / measured["dp_allreduce+sfb"] if len(measured) == 2 else None
    print(f"\nmax relative weight difference {diff:.2e}; largest fraction of bytes saved {saved:.3f}; measured "
          f"speedup with SFB {figure_text(speedup, '.2f', 'x')} ({time.time() - t0:.0f} s, load {load_text(2)})")
    write_json(args.json, {"max_rel_weight_diff": diff, "max_bytes_saved_fraction": saved,
                           "measured_speedup_sfb": speedup, "rows": rows}, this_run, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
