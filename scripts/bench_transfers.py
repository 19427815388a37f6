"""What a training step pays for cross-host tensors and for a replica's slice of the batch, measured on the
testbed and printed beside the simulator's model of the same pattern.

Three measurements, each on a running testbed (``tag_bench.testbed``: hosts in network namespaces, CFS CPU
quotas, shaped links), every figure the median of the timed steps, the load average beside each row:

1. ``transfers``: N tensors of S bytes each (N = 1..512, S = 1 KB..64 MB, N x S <= ``--max-bytes``) held by
   the sender host and summed on the receiver, optionally in W waves (the sender produces wave w+1 only after
   the receiver consumed wave w, so N / W tensors are in flight). The transfer's cost is the step minus the
   same step with the tensors held by the receiver. ``model`` is the simulator's cost of the pattern over the
   same link: one flow of N x S bytes (``latency + bytes / bandwidth``, the link's latency once, as TF's
   concurrent requests overlap) per wave; with a network calibration (``--profile``) the link carries the
   runtime's measured per-transfer latency and byte rate, as ``tag.cost.model.NetworkProfile.calibrate`` does,
   and every tensor its ``per_tensor_s``.
2. ``overlap``: does the runtime's work on tensors compete with a host's compute? The receiver (or the
   sender) runs a MatMul chain in the same step as 64 transfers: ``overlap`` = (C + T - both) / min(C, T),
   1 when the two run side by side as the simulator assumes (separate compute and network lanes), 0 when
   they serialise.
2b. ``sync_overlap``: the same question for gradient synchronisation over every host (quotas as given): a
   ring all-reduce or a parameter-server push of 256 KB to 4 MB beside a MatMul chain on each host
   (``tag.calibration.measure_sync_serial``, which ``runtime_levels`` runs on every testbed to set the
   profile's ``sync_serial_*``).
3. ``batch_share``: a model's step on one host at a fraction of the batch (a data-parallel replica's share,
   or a pipeline's micro-batch) relative to the whole batch, measured and as the cost model predicts it
   (``--profile``: a testbed calibration, e.g. bench_e2e's ``--json F`` writes one beside F).
4. ``contention``: does a host's kernel slow down while the other hosts compute? Each kernel class
   (``CONTENTION_KERNELS``: a convolution, a convolution's filter gradient, a large MatMul, a memory-bound
   element-wise add) as a chain on each host, timed alone and again while every other host runs the same
   chain without pause (a session per host in a background thread). ``slowdown`` = loaded / alone. The
   testbed's hosts share one machine (cores, caches, memory), a cluster's hosts do not: the
   calibration measures each device type alone, so a kernel class that slows down here is costed too fast in
   every plan that keeps several hosts busy at once.

Needs root (namespaces, tc, cgroup v1 cpu). Keep the machine otherwise idle: CFS quotas are upper bounds.

Usage::

    python scripts/bench_transfers.py                     # all five, ~9 min
    python scripts/bench_transfers.py --quick             # fewer sizes and shares
    python scripts/bench_transfers.py --only transfers --quotas 1.0,0.5 --link-gbps 1.0 --json F
    python scripts/bench_transfers.py --calibrate --save-profile P   # predictions from a fresh calibration
    python scripts/bench_transfers.py --only contention --quotas 1.0,0.5,0.5 --json F
    python scripts/bench_transfers.py --only sync_overlap --quotas 1.0,0.25,0.25 --link-gbps 0.3 --json F
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag.backend.runtime import run_steps  # noqa: E402
from tag.calibration import median_step  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag_bench.cases import device_type  # noqa: E402
from tag_bench.machine import load1, load_averages, load_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.testbed import Testbed, testbed_missing  # noqa: E402

SIZES = (1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20)
COUNTS = (1, 8, 64, 512)
SHARES = (1.0, 0.5, 1 / 3, 0.25, 0.125)
SHARE_MODELS = (("mlp-2048", "zoo:mlp,input_dim=2048,hidden=2048x2048x2048x2048,num_classes=16"),
                ("cnn", "mwms:cnn,width=32"),
                ("transformer", "mwms:transformer,width=128"))


def topology_text(quotas: list[float], link_gbps: float, latency_us: float) -> str:
    """One one-CPU host per quota, device type ``CPUq<percent>`` as the testbed calibration names them."""
    lines = []
    for i, q in enumerate(quotas):
        lines.append(f'host {{ name: "h{i}" address: "127.0.0.1" port: {24561 + i} device {{ type: "{device_type(q)}" '
                     f'kind: CPU count: 1 memory_gib: 4 peak_tflops: 0.02 memory_bandwidth_gbs: 10 }} }}')
    lines.append(f"fabric {{ bandwidth_gbps: {link_gbps} latency_us: {latency_us} }}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- graphs
def transfer_graph(count: int, nbytes: int, holder: str, reader: str, waves: int = 1, compute: tuple | None = None):
    """COUNT variables of NBYTES on HOLDER, each summed on READER, in WAVES waves; COMPUTE = (device, side, depth):
    an independent MatMul chain of DEPTH products of SIDE x SIDE matrices on that device in the same step."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        variables, outs = [], []
        per_wave = -(-count // waves)
        previous = None
        for w in range(waves):
            wave_sums = []
            for i in range(w * per_wave, min(count, (w + 1) * per_wave)):
                with tf.device(holder):
                    var = tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name=f"payload_{i}")
                    variables.append(var)
                    deps = [previous] if previous is not None else []
                    with tf.control_dependencies(deps):
                        x = tf.identity(var.read_value())
                with tf.device(reader):
                    wave_sums.append(tf.reduce_sum(x))
            if wave_sums:
                with tf.device(reader):
                    # into a variable: ops that only feed control edges are pruned by Grappler
                    sink = tf.Variable(0.0, name=f"sink_{w}")
                    variables.append(sink)
                    previous = sink.assign_add(tf.add_n(wave_sums) if len(wave_sums) > 1 else wave_sums[0])
                    outs.append(previous)
        if compute is not None:
            dev, side, depth = compute
            with tf.device(dev):
                m = tf.Variable(tf.random.normal([side, side], stddev=1.0 / np.sqrt(side)), name="chain_w")
                variables.append(m)
                y = m.read_value()
                for _ in range(depth):
                    y = tf.matmul(y, m)
                sink = tf.Variable(0.0, name="chain_sink")
                variables.append(sink)
                outs.append(sink.assign_add(tf.reduce_sum(y)))
        tf.group(*outs, name="step")
        v1.variables_initializer(variables, name="init")
    return g.as_graph_def()


def chain_graph(device: str, side: int, depth: int):
    return transfer_graph(0, 4, device, device, compute=(device, side, depth))


# kernel class -> (inputs' shapes, depth of the chain)
CONTENTION_KERNELS = {"conv": ([64, 32, 32, 16], 8), "conv_filter_grad": ([64, 32, 32, 16], 8),
                      "matmul": ([384, 2048], 4), "elementwise": ([1 << 24], 8)}


def kernel_chain_graph(kind: str, device: str):
    """DEPTH kernels of class KIND on DEVICE, each after the previous one (control edges), into a sink."""
    import tensorflow as tf
    v1 = tf.compat.v1
    shape, depth = CONTENTION_KERNELS[kind]
    g = tf.Graph()
    with g.as_default(), tf.device(device):
        x = tf.Variable(tf.random.normal(shape), name="x")
        if kind in ("conv", "conv_filter_grad"):
            w = tf.Variable(tf.random.normal([3, 3, shape[-1], shape[-1]], stddev=0.1), name="w")
        elif kind == "matmul":
            w = tf.Variable(tf.random.normal([shape[1], shape[1]], stddev=0.02), name="w")
        else:
            w = tf.Variable(tf.random.normal(shape), name="w")
        xs, ws, prev, outs = x.read_value(), w.read_value(), None, []
        for _ in range(depth):
            with tf.control_dependencies([prev] if prev is not None else []):
                if kind == "conv":
                    y = tf.nn.conv2d(xs, ws, 1, "SAME")
                elif kind == "conv_filter_grad":
                    y = v1.nn.conv2d_backprop_filter(xs, [3, 3, shape[-1], shape[-1]], xs, [1, 1, 1, 1], "SAME")
                elif kind == "matmul":
                    y = tf.matmul(xs, ws)
                else:
                    y = xs + ws
            prev = y
            outs.append(tf.reduce_sum(y[..., :1]))
        sink = tf.Variable(0.0, name="sink")
        sink.assign_add(tf.add_n(outs), name="step")
        v1.variables_initializer([x, w, sink], name="init")
    return g.as_graph_def()


# ----------------------------------------------------------------------------------------- model of a pattern
def modelled_transfer_s(count: int, nbytes: int, waves: int, link_gbps: float, latency_us: float, network) -> float:
    """The simulator's cost of the pattern: one flow per wave over the link (``tag.sim.schedule``: bytes hold the
    link, the latency is paid once per flow, concurrent tensors of one flow share it); with a network
    calibration the link carries the runtime's per-transfer latency and byte rate, and each tensor its cost."""
    bw = link_gbps * 1e9 / 8
    lat = latency_us * 1e-6
    if network is not None:
        bw = 1.0 / (1.0 / bw + 1.0 / network.transfer_bytes_per_s)
        lat += network.transfer_latency_s
    per_tensor = network.per_tensor_s if network is not None else 0.0
    per_wave = -(-count // waves)
    total = 0.0
    for w in range(waves):
        n = min(count, (w + 1) * per_wave) - w * per_wave
        total += lat + n * nbytes / bw + n * per_tensor
    return total


# ----------------------------------------------------------------------------------------- measurements
def measure_transfers(tb, topo, args, network) -> list[dict]:
    sender, receiver = topo.tf_device(1), topo.tf_device(0)
    rows = []
    sizes = SIZES[::2] if args.quick else SIZES
    for nbytes in sizes:
        for count in COUNTS:
            if count * nbytes > args.max_bytes:
                continue
            for waves in ((1,) if count < 8 else (1, 8) if count < 64 else (1, 8, 64)):
                if waves > 1 and count * nbytes > args.max_bytes // 4:
                    continue
                local = median_step(transfer_graph(count, nbytes, receiver, receiver, waves), tb.target, args.steps)
                remote = median_step(transfer_graph(count, nbytes, sender, receiver, waves), tb.target, args.steps)
                model = modelled_transfer_s(count, nbytes, waves, args.link_gbps, args.latency_us, network)
                row = {"count": count, "bytes": nbytes, "waves": waves, "in_flight": -(-count // waves),
                       "measured_s": remote - local, "model_s": model, "local_step_s": local,
                       "wire_s": count * nbytes * 8 / (args.link_gbps * 1e9), "load": load_averages()}
                rows.append(row)
                print(f"  {count:4d} x {nbytes / 1024:8.0f} KB  waves {waves:3d}: "
                      f"measured {row['measured_s'] * 1e3:9.2f} ms"
                      f"  model {model * 1e3:9.2f} ms  wire {row['wire_s'] * 1e3:9.2f} ms"
                      f"  (local step {local * 1e3:.2f} ms)  load {row['load'][0]}", flush=True)
    return rows


def measure_overlap(tb, topo, args) -> list[dict]:
    sender, receiver = topo.tf_device(1), topo.tf_device(0)
    rows = []
    count, nbytes = 64, 256 << 10
    for side_name, dev in (("receiver", receiver), ("sender", sender)):
        for side, depth in ((256, 64), (1024, 8)):
            compute = median_step(chain_graph(dev, side, depth), tb.target, args.steps)
            local = median_step(transfer_graph(count, nbytes, receiver, receiver), tb.target, args.steps)
            transfer = median_step(transfer_graph(count, nbytes, sender, receiver), tb.target, args.steps)
            both = median_step(transfer_graph(count, nbytes, sender, receiver, compute=(dev, side, depth)),
                               tb.target, args.steps)
            c, t = compute, transfer - local
            overlap = (c + transfer - both) / max(min(c, t), 1e-9)
            row = {"compute_on": side_name, "matmul_side": side, "depth": depth, "compute_s": c, "transfer_s": t,
                   "both_s": both, "overlap": overlap, "load": load_averages()}
            rows.append(row)
            print(f"  compute on {side_name:8s} ({depth} x {side}^2 MatMul): compute {c * 1e3:7.1f} ms, "
                  f"64 x 256 KB transfer {t * 1e3:7.1f} ms, both {both * 1e3:7.1f} ms -> overlap {overlap:.2f}"
                  f"  load {row['load'][0]}", flush=True)
    return rows


def measure_sync_overlap(tb, topo, quotas, args) -> list[dict]:
    """Does gradient synchronisation across hosts overlap the hosts' compute? ``measure_sync_serial`` (the
    calibration the testbed benchmarks run in ``runtime_levels``): on every host a MatMul chain whose length
    follows the host's quota (so all finish together, as a data-parallel step's shares do), and in the same
    step a ring all-reduce (or a parameter-server push to h0) of S bytes over all hosts. ``overlap`` = (C + T -
    both) / min(C, T), the empty step's time taken off each: 1 when they run side by side (the simulator's
    separate lanes without ``sync_serial_*``), 0 when they serialise."""
    from tag.calibration import SYNC_BYTES, measure_sync_serial
    devices = [topo.tf_device(h) for h in range(len(quotas))]
    sizes = SYNC_BYTES if not args.quick else SYNC_BYTES[1:2]
    serial_ar, serial_ps, rows = measure_sync_serial(tb.target, devices, quotas, sizes_bytes=sizes, steps=args.steps)
    for row in rows:
        row.update(quotas=quotas, load=load_averages())
        print(f"  {row['kind']:9s} {row['bytes'] >> 10:5d} KB over {len(devices)} hosts: compute "
              f"{row['compute_s'] * 1e3:6.1f} ms, sync {row['sync_s'] * 1e3:6.1f} ms, "
              f"both {row['both_s'] * 1e3:6.1f} ms"
              f" -> overlap {row['overlap']:+.2f}", flush=True)
    print(f"  fractions that do not overlap (median over sizes, clipped to [0, 1]): all-reduce {serial_ar:.2f}, "
          f"ps {serial_ps:.2f}  load {load1():.2f}", flush=True)
    return rows


def measure_batch_share(tb, topo, quotas, args, profile) -> list[dict]:
    """Each model's one-host step at fractions of its batch, on every host, measured and predicted."""
    import tag
    from tag.backend.rewrite import rewrite
    from tag.cost.model import CostModel
    from tag.sim import Simulator
    from tag.strategy.grouping import group_ops
    from tag.strategy.types import Action, Strategy
    from tag_bench.cases import calibration_graph
    rows = []
    shares = SHARES[::2] if args.quick else SHARES
    hosts = sorted(set(range(len(quotas))), key=lambda i: -quotas[i])
    hosts = [hosts[0], hosts[-1]] if len(hosts) > 1 else hosts
    for name, spec in SHARE_MODELS[:1] if args.quick else SHARE_MODELS:
        for h in hosts:
            dtype = device_type(quotas[h])
            one = parse_topology(topology_text([quotas[h]], args.link_gbps, args.latency_us), path="<one host>")
            base_measured = base_predicted = None
            for share in shares:
                batch = max(1, int(round(args.batch * share)))
                gd = calibration_graph(spec, batch)
                analysis = tag.analyze(gd)
                grouping = group_ops(analysis, target_groups=8)
                predicted = None
                if profile is not None and dtype in profile.devices:
                    sim = Simulator(analysis, one, grouping, CostModel(analysis, one, profile))
                    whole = Strategy(grouping, [Action((0,), "allreduce")] * grouping.num_groups, name="one")
                    predicted = sim.evaluate(whole).step_time
                on_h = Strategy(grouping, [Action((h,), "allreduce")] * grouping.num_groups, name=f"h{h}")
                res = rewrite(gd, analysis, on_h, topo)
                r = run_steps(res.graph_def, tb.target, train_op=res.train_op, loss=res.loss, init=res.init,
                              steps=args.steps + 2, warmup=2, synthetic=True)
                measured = float(np.median(r.step_times[2:]))
                if base_measured is None:
                    base_measured, base_predicted = measured, predicted
                row = {"model": name, "quota": quotas[h], "batch": batch, "share": share, "measured_s": measured,
                       "predicted_s": predicted, "measured_rel": measured / base_measured,
                       "predicted_rel": None if predicted is None else predicted / base_predicted,
                       "load": load_averages()}
                rows.append(row)
                pr = "" if predicted is None else (f"  predicted {predicted * 1e3:8.1f} ms"
                                                   f" ({row['predicted_rel']:.3f} of whole batch)")
                print(f"  {name:12s} quota {quotas[h]:.2f} batch {batch:3d}: measured {measured * 1e3:8.1f} ms"
                      f" ({row['measured_rel']:.3f} of whole batch){pr}  load {row['load'][0]}", flush=True)
    return rows


def measure_contention(tb, topo, quotas, args) -> list[dict]:
    """Each kernel class's chain on each host, alone and while every other host runs its own copy."""
    from contextlib import ExitStack

    from tag_bench.cases import BackgroundSteps
    rows = []
    hosts = range(len(quotas))
    print(f"  pinning: {tb.cpu_pinning}", flush=True)
    for kind in CONTENTION_KERNELS:
        graphs = [kernel_chain_graph(kind, topo.tf_device(h)) for h in hosts]
        for h in hosts:
            alone = median_step(graphs[h], tb.target, args.steps)
            with ExitStack() as stack:
                others = [stack.enter_context(BackgroundSteps(graphs[o], tb.target, train_op="step", loss=None))
                          for o in hosts if o != h]
                loaded = median_step(graphs[h], tb.target, args.steps)
                background = sum(b.steps for b in others)
            row = {"kernel": kind, "host": h, "quota": quotas[h], "alone_s": alone, "loaded_s": loaded,
                   "slowdown": loaded / alone, "background_steps": background, "load": load_averages()}
            rows.append(row)
            print(f"  {kind:17s} on h{h} (quota {quotas[h]:.2f}): alone {alone * 1e3:7.1f} ms, others busy "
                  f"{loaded * 1e3:7.1f} ms -> x{row['slowdown']:.2f} ({background} background steps)"
                  f"  load {row['load'][0]}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, shares and models")
    p.add_argument("--only", choices=("transfers", "overlap", "sync_overlap", "batch_share", "contention"),
                   help="one measurement")
    p.add_argument("--quotas", default="1.0,0.5", help="CPU quota (cores) of the receiver, then the sender")
    p.add_argument("--link-gbps", type=float, default=1.0)
    p.add_argument("--latency-us", type=float, default=50.0)
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest N x S of one transfer pattern")
    p.add_argument("--steps", type=int, default=8, help="timed steps per figure")
    p.add_argument("--batch", type=int, default=48, help="whole batch of the batch-share models")
    p.add_argument("--profile", help="a testbed calibration (Profile JSON): the model column and predictions")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate these quotas first, as the testbed benchmarks do (tag-profile per quota, the "
                        "runtime's network costs, runtime_levels on the running testbed); --save-profile keeps it")
    p.add_argument("--save-profile", help="write the calibration here")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    if testbed_missing("bench_transfers"):
        return 2
    from tag.cost.model import Profile
    profile = Profile.load(args.profile) if args.profile else None
    quotas = [float(q) for q in args.quotas.split(",")]
    topo = parse_topology(topology_text(quotas, args.link_gbps, args.latency_us), path="<bench_transfers>")
    if args.calibrate and profile is None:
        import tempfile

        from tag_bench.cases import calibrate_testbed, load_recipe, runtime_levels
        recipe = load_recipe()
        recipe["configs"] = {"T": {"quotas": quotas, "links_gbps": [args.link_gbps] * 3}}
        with tempfile.TemporaryDirectory() as workdir:
            profile = calibrate_testbed(recipe, workdir, ["T"])
        with Testbed(topo, cpu_quota=quotas) as tb:
            tb.start_workers(threads_per_worker=1)
            try:
                profile = runtime_levels(tb, recipe, profile)
            finally:
                tb.stop_workers()
        if args.save_profile:
            profile.save(args.save_profile)
    network = profile.network if profile is not None else None
    out = {"quotas": quotas, "link_gbps": args.link_gbps, "latency_us": args.latency_us,
           "network": None if network is None else network.to_dict(), "load_start": load_averages()}
    t0 = time.time()
    print(f"testbed: quotas {quotas}, links {args.link_gbps} Gbit/s, {args.latency_us} us; load {load_text(2)}",
          flush=True)
    with Testbed(topo, cpu_quota=quotas) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            if args.only in (None, "transfers"):
                print("transfers (sender h1 -> receiver h0):", flush=True)
                out["transfers"] = measure_transfers(tb, topo, args, network)
            if args.only in (None, "overlap"):
                print("overlap of transfers with compute:", flush=True)
                out["overlap"] = measure_overlap(tb, topo, args)
            if args.only in (None, "sync_overlap"):
                print("overlap of gradient synchronisation (all-reduce, ps) with every host's compute:", flush=True)
                out["sync_overlap"] = measure_sync_overlap(tb, topo, quotas, args)
            if args.only in (None, "batch_share"):
                print("one-host step at a share of the batch:", flush=True)
                out["batch_share"] = measure_batch_share(tb, topo, quotas, args, profile)
            if args.only in (None, "contention"):
                print("kernels alone and while the other hosts compute:", flush=True)
                out["contention"] = measure_contention(tb, topo, quotas, args)
        finally:
            tb.stop_workers()
    out["seconds"] = time.time() - t0
    out["load_end"] = load_averages()
    write_json(args.json, out, this_run)
    print(f"done in {out['seconds']:.0f} s; load {load_text(2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
