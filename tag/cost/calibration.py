"""Profiler: calibrate the cost model on the local device from TensorFlow's own step statistics.

The cost model times an op with a roofline, ``launch + max(FLOPs / (peak * efficiency), bytes /
memory_bandwidth)``. This module measures the local device's peak FLOP/s (a large MatMul) and memory
bandwidth (a large elementwise add), runs a training step with random inputs of the right shapes
under ``RunOptions(trace_level=FULL_TRACE)``, reads every op's kernel time from
``RunMetadata.step_stats``, and fits per-op-type efficiencies and a per-op launch overhead. The
result is a ``tag.cost.Profile`` (JSON) that later calls pick up; other device types reuse the
efficiencies with their own spec-sheet peak and bandwidth (the cost model does that).

Usage::

    tag-profile --model zoo:mlp --out profile.json      # then tag-deploy --profile profile.json
    tag-profile --model zoo:mlp                         # writes default_profile_path()
    tag-profile --model zoo:mlp --network               # + TF runtime costs between two workers

    from tag.cost.calibration import profile_graph
    prof = profile_graph(graph_def, tag.analyze(graph_def), steps=10)
    prof.save("profile.json")

How the fit works (one device type, one graph):

- Profiling runs ops one at a time (``inter_op_parallelism_threads=1``; each kernel still uses all
  intra-op threads) with grappler's graph rewrites off, so each IR op is one kernel with its own
  name and the per-device sequential schedule the simulator assumes is what is measured.
- ``kernel_floor``: the median kernel time of the zero-FLOP ops (a kernel's fixed cost; at least
  the step stats' resolution of 1 us).
- Per op type with FLOPs, the efficiency ``e`` solves ``sum_i max(F_i / (peak * e), B_i / bw) =
  sum_i max(t_i - kernel_floor, 0)`` over that type's ops (``t_i`` the fastest kernel time), so the
  memory-bound ops are charged to bandwidth, not to efficiency; ``e`` is clipped to (0, 1]. Only
  ops whose roofline at ``e = 1`` is at least 20 us take part: a tiny op's time is its fixed cost,
  and fitting it as an efficiency would make the same op type absurdly slow on large tensors in
  other graphs (their time goes to the launch overhead instead). The ``default`` efficiency is the
  same fit over all those ops together (used for op types the profile does not list). In a toy graph
  with no op that large, the ops within 2x of its largest roofline take part.
- ``launch_overhead_s``: the executor's per-op cost beyond the kernels, ``(wall - sum_i roofline_i)
  / n_ops``, where ``wall`` is an untraced step with TensorFlow's default session settings (what
  users and tag's runtime run), never below ``kernel_floor``; the sum and the count run over the
  ops the cost model charges (not ``tag.cost.ZERO_COST_TYPES``, whose time is folded in here). The
  cost model's op times summed over the graph then reproduce the measured step (when the kernels
  alone do not already exceed it: TF overlaps independent ops, the simulator's device does not).
- Every time is the fastest of the steps (peak and bandwidth: the fastest of several runs), the
  figure closest to the device's own speed on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tag.errors import GraphError, TagError  # noqa: E402
from tag.ir.op_types import INITIALIZER_TYPES, VARIABLE_TYPES  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from tag.cost.model import NetworkProfile, Profile
    from tag.ir.types import TrainingGraph

v1 = tf.compat.v1

PROFILE_ENV = "TAG_PROFILE"
_STEP_STATS_RESOLUTION_S = 1e-6      # step stats count whole microseconds
_MIN_WALL_SAMPLES = 20
_MIN_FIT_S = 20e-6                   # ops faster than this even at the roofline: fixed costs, not efficiency


def default_profile_path() -> str:
    """Where profiles are written and read by default: ``$TAG_PROFILE``, else the user cache directory
    (``$XDG_CACHE_HOME/tag/profile.json``, ``~/.cache/tag/profile.json`` when that is unset)."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tag", "profile.json")


def load_default_profile() -> "Profile | None":
    """The profile at ``default_profile_path()``, or None when there is none.

    ``$TAG_PROFILE`` naming a missing or bad file is an error (the user asked for it); a missing
    file at the cache location just means "not profiled yet".
    """
    from tag.cost.model import Profile
    path = default_profile_path()
    if not os.path.exists(path):
        if os.environ.get(PROFILE_ENV):
            raise TagError(f"{path}: profile named by ${PROFILE_ENV} does not exist")
        return None
    return Profile.load(path)


# --------------------------------------------------------------------------------------------
# Sessions and inputs
# --------------------------------------------------------------------------------------------

def _tf_device(device_type: str) -> str:
    return "/device:CPU:0" if device_type.upper() == "CPU" else "/device:GPU:0"


def _session_config(serial: bool) -> "v1.ConfigProto":
    """Profiling sessions: ops one at a time, no graph rewrites (``serial``); otherwise TF's defaults."""
    cfg = v1.ConfigProto(allow_soft_placement=True)
    if serial:
        cfg.inter_op_parallelism_threads = 1
        cfg.graph_options.rewrite_options.disable_meta_optimizer = True
        cfg.graph_options.optimizer_options.opt_level = v1.OptimizerOptions.L0
    return cfg


def _import(graph_def, device_type: str) -> tf.Graph:
    gd = v1.GraphDef()
    gd.CopyFrom(graph_def)
    for node in gd.node:
        node.device = ""
    g = tf.Graph()
    with g.as_default(), tf.device(_tf_device(device_type)):
        try:
            tf.graph_util.import_graph_def(gd, name="")
        except (ValueError, tf.errors.OpError) as err:
            raise GraphError(f"cannot import the GraphDef to profile it: {' '.join(str(err).split())[:300]}") from None
    return g


def _step_targets(graph: "TrainingGraph") -> list[str]:
    """Ops nothing else in the step consumes: running them runs the whole training step."""
    consumed = np.zeros(len(graph.ops), dtype=bool)
    for e in graph.edges:
        consumed[e.src] = True
    for src, _ in graph.control_edges:
        consumed[src] = True
    return [graph.ops[i].name for i in np.flatnonzero(~consumed)]


def _init_ops(graph_def, graph: "TrainingGraph") -> list[str]:
    """The variable initialisers: ``init`` when the graph has one (zoo graphs do), else every
    assignment to a variable that is not part of the training step."""
    names = {n.name: n for n in graph_def.node}
    if "init" in names and names["init"].op == "NoOp":
        return ["init"]
    step = set(graph.op_index)
    out = []
    for n in graph_def.node:
        if n.op in INITIALIZER_TYPES and n.name not in step and n.input:
            src = n.input[0].lstrip("^").split(":")[0]
            if src in names and names[src].op in VARIABLE_TYPES:
                out.append(n.name)
    return out


def _random_feeds(g: tf.Graph, graph: "TrainingGraph", rng: np.random.Generator) -> dict:
    """Random values for every Placeholder of the step: floats ~ N(0, 1), integers in {0, 1}
    (valid class ids and token ids for any model), the batch axis at the graph's batch size."""
    from tag.backend.runtime import random_input
    feeds = {}
    for op in graph.ops:
        if op.type != "Placeholder":
            continue
        t = g.get_tensor_by_name(op.name + ":0")
        info = op.outputs[0] if op.outputs else None
        if t.shape.rank is None and (info is None or info.shape is None):
            raise GraphError(f"placeholder {op.name} has an unknown shape; cannot make a random input for it")
        dims = list(t.shape.as_list()) if t.shape.rank is not None else list(info.shape)
        batch_axis = info.batch_axis if info is not None else None
        for ax, d in enumerate(dims):
            if d is None or d < 0:
                dims[ax] = int(graph.batch_size) if (batch_axis is None or ax == batch_axis) else 1
        feeds[t] = random_input(op.name, dims, t.dtype.base_dtype, rng, hint="cannot profile this graph")
    return feeds


def _initialise(sess, init: list[str], feeds: dict) -> None:
    try:
        sess.run(init, feed_dict=feeds)
        return
    except tf.errors.OpError:
        pass
    pending = list(init)   # initialisers that read other variables: retry until nothing moves
    while pending:
        left = []
        for name in pending:
            try:
                sess.run(name, feed_dict=feeds)
            except tf.errors.OpError:
                left.append(name)
        if len(left) == len(pending):
            raise GraphError(f"cannot initialise the variables to profile the graph (stuck at {left[0]})")
        pending = left


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------

@dataclass
class StepMeasurement:
    """Kernel time per IR op (seconds; NaN where the step stats did not show the op) and step walls.

    Every figure is the fastest of the steps: on a shared machine that is the closest to the device's
    own speed, and it matches how the peak FLOP/s and bandwidth are measured (fastest of several runs).
    """

    op_times: np.ndarray
    wall_s: float                   # wall time of an untraced step, ops one at a time
    wall_parallel_s: float          # the same with TensorFlow's default session settings
    steps: int


def measure_step(graph_def, graph: "TrainingGraph", steps: int = 10, device_type: str = "CPU",
                 warmup: int = 3, seed: int = 0) -> StepMeasurement:
    """Run the training step and read each op's kernel time from TensorFlow's step stats."""
    if steps < 1:
        raise TagError(f"steps must be at least 1, got {steps}")
    g = _import(graph_def, device_type)
    rng = np.random.default_rng(seed)
    targets = _step_targets(graph)
    init = _init_ops(graph_def, graph)
    index = graph.op_index
    samples: list[list[float]] = [[] for _ in graph.ops]
    with g.as_default():
        feeds = _random_feeds(g, graph, rng)
    with v1.Session(graph=g, config=_session_config(serial=True)) as sess:
        if init:
            _initialise(sess, init, feeds)
        try:
            for _ in range(warmup):
                sess.run(targets, feed_dict=feeds)
        except tf.errors.OpError as err:
            raise GraphError(f"the training step fails on random inputs: {' '.join(err.message.split())[:300]}") \
                from None
        walls = []
        opts = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
        for _ in range(steps):   # untraced and traced runs alternate, so both see the same machine load
            t0 = time.perf_counter()
            sess.run(targets, feed_dict=feeds)
            walls.append(time.perf_counter() - t0)
            md = v1.RunMetadata()
            sess.run(targets, feed_dict=feeds, options=opts, run_metadata=md)
            per_step: dict[int, float] = {}
            for dev in md.step_stats.dev_stats:
                this_dev: dict[int, float] = {}
                for ns in dev.node_stats:
                    i = index.get(ns.node_name)
                    if i is not None:
                        this_dev[i] = this_dev.get(i, 0.0) + (ns.op_end_rel_micros - ns.op_start_rel_micros) * 1e-6
                for i, t in this_dev.items():   # GPU: launch and stream rows; keep the longer
                    per_step[i] = max(per_step.get(i, 0.0), t)
            for i, t in per_step.items():
                samples[i].append(t)
    with v1.Session(graph=g, config=_session_config(serial=False)) as sess:
        if init:
            _initialise(sess, init, feeds)
        for _ in range(warmup):
            sess.run(targets, feed_dict=feeds)
        par: list[float] = []
        start = time.perf_counter()   # at least 20 samples (cheap, untraced) unless that takes > 10 s
        while len(par) < steps or (len(par) < _MIN_WALL_SAMPLES and time.perf_counter() - start < 10.0):
            t0 = time.perf_counter()
            sess.run(targets, feed_dict=feeds)
            par.append(time.perf_counter() - t0)
    op_times = np.array([np.min(s) if s else np.nan for s in samples], dtype=np.float64)
    return StepMeasurement(op_times, float(np.min(walls)), float(np.min(par)), steps)


def _best_kernel_time(sess, op, reps: int) -> float:
    """Shortest kernel time of OP over REPS traced runs (step stats: no session overhead)."""
    sess.run(op)
    opts = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
    best = np.inf
    for _ in range(reps):
        md = v1.RunMetadata()
        t0 = time.perf_counter()
        sess.run(op, options=opts, run_metadata=md)
        wall = time.perf_counter() - t0
        kernel = [ns.op_end_rel_micros - ns.op_start_rel_micros for dev in md.step_stats.dev_stats
                  for ns in dev.node_stats if ns.node_name == op.name]
        best = min(best, max(kernel) * 1e-6 if kernel and max(kernel) > 0 else wall)
    return float(best)


def measure_peak_flops(device_type: str = "CPU", n: int = 1024, reps: int = 20) -> float:
    """FLOP/s of an n x n x n float32 MatMul (fastest of REPS), the device's attainable peak."""
    g = tf.Graph()
    with g.as_default(), tf.device(_tf_device(device_type)):
        a = tf.Variable(tf.random.normal([n, n], seed=1))
        b = tf.Variable(tf.random.normal([n, n], seed=2))
        mm = tf.matmul(a, b)
        init = v1.global_variables_initializer()
    with v1.Session(graph=g, config=_session_config(serial=False)) as sess:
        sess.run(init)
        return 2.0 * n ** 3 / _best_kernel_time(sess, mm.op, reps)


def measure_memory_bandwidth(device_type: str = "CPU", n: int = 1 << 22, reps: int = 20) -> float:
    """Bytes/s of a float32 ``a + b`` over N elements (reads 2N, writes N floats; fastest of REPS).

    The default 16 MiB operands are larger than the caches but, unlike much larger ones, do not
    measure the page faults of freshly allocated outputs instead of the memory.
    """
    g = tf.Graph()
    with g.as_default(), tf.device(_tf_device(device_type)):
        a = tf.Variable(tf.random.normal([n], seed=1))
        b = tf.Variable(tf.random.normal([n], seed=2))
        s = tf.add(a, b)
        init = v1.global_variables_initializer()
    with v1.Session(graph=g, config=_session_config(serial=False)) as sess:
        sess.run(init)
        return 12.0 * n / _best_kernel_time(sess, s.op, reps)


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------

def _fit_efficiency(flops: np.ndarray, mem: np.ndarray, target_s: float, peak: float, bw: float) -> float:
    """The e in (0, 1] with sum max(flops / (peak e), mem / bw) = target_s (1 when even e = 1 is slower)."""
    def model(e: float) -> float:
        return float(np.maximum(flops / (peak * e), mem / bw).sum())
    if model(1.0) >= target_s:
        return 1.0
    lo, hi = -12.0, 0.0          # log10(e): model(10**lo) is huge, model(10**hi) too small
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if model(10.0 ** mid) > target_s:
            lo = mid
        else:
            hi = mid
    return float(max(10.0 ** hi, 1e-12))


@dataclass
class Fit:
    """What profile_graph fitted for one device type."""

    efficiency: dict[str, float]
    launch_overhead_s: float
    kernel_floor_s: float


def fit_profile(graph: "TrainingGraph", m: StepMeasurement, peak: float, bw: float) -> Fit:
    """Per-op-type efficiencies and the launch overhead from a step measurement (see module docstring).

    Matches ``tag.cost.CostModel.op_times``: ops of ``tag.cost.ZERO_COST_TYPES`` cost nothing there,
    so their measured time is folded into the launch overhead of the others.
    """
    from tag.cost.model import ZERO_COST_TYPES
    batch = float(graph.batch_size)
    flops = np.array([op.flops.at(batch) for op in graph.ops], dtype=np.float64)
    mem = np.array([op.mem_bytes.at(batch) for op in graph.ops], dtype=np.float64)
    types = np.array([op.type for op in graph.ops])
    costed = np.array([t not in ZERO_COST_TYPES for t in types], dtype=bool)
    seen = ~np.isnan(m.op_times)
    if not (seen & costed).any():
        raise GraphError("TensorFlow's step stats named none of the graph's ops; nothing to fit")
    zero = seen & (flops <= 0)
    floor = float(np.median(m.op_times[zero])) if zero.any() else float(np.min(m.op_times[seen]))
    floor = max(floor, _STEP_STATS_RESOLUTION_S)
    busy = np.where(seen, np.maximum(m.op_times - floor, 0.0), 0.0)
    ideal = np.maximum(flops / peak, mem / bw)        # the roofline at efficiency 1
    candidates = seen & costed & (flops > 0)
    # a toy graph whose ops are all tiny: fit its largest ops (within 2x of the largest)
    threshold = min(_MIN_FIT_S, 0.5 * float(ideal[candidates].max())) if candidates.any() else _MIN_FIT_S
    fitted = candidates & (ideal >= threshold)
    eff: dict[str, float] = {}
    for t in sorted(set(types[fitted])):
        sel = fitted & (types == t)
        eff[str(t)] = _fit_efficiency(flops[sel], mem[sel], float(busy[sel].sum()), peak, bw)
    eff["default"] = (_fit_efficiency(flops[fitted], mem[fitted], float(busy[fitted].sum()), peak, bw)
                      if fitted.any() else 0.5)
    e_op = np.array([eff.get(t, eff["default"]) for t in types])
    roofline = np.where(costed, np.maximum(flops / (peak * e_op), mem / bw), 0.0)
    launch = max(floor, (m.wall_parallel_s - float(roofline.sum())) / max(int(costed.sum()), 1))
    return Fit(eff, float(launch), floor)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_graph(graph_def, graph: "TrainingGraph", steps: int = 10, device_type: str = "CPU",
                  seed: int = 0, model: str | None = None) -> "Profile":
    """Profile one training step on the local device and return the calibrated ``tag.cost.Profile``.

    ``graph`` is ``tag.analyze(graph_def)``; ``device_type`` names the entry in the profile (the
    topology's device type for this machine, "CPU" on a CPU host); ``steps`` traced steps are taken
    after a short warm-up; each op's fastest time is used. ``model`` names the graph in the profile's source.
    """
    from tag.cost.model import Profile
    m = measure_step(graph_def, graph, steps=steps, device_type=device_type, seed=seed)
    peak = measure_peak_flops(device_type)
    bw = measure_memory_bandwidth(device_type)
    fit = fit_profile(graph, m, peak, bw)
    name = model or graph.name or "graph"
    source = (f"tag.profile: {name} at batch {graph.batch_size}, {steps} traced steps on {_cpu_name()} "
              f"({os.cpu_count()} cores, TensorFlow {tf.__version__}); step {m.wall_s * 1e3:.2f} ms ops one at a "
              f"time, {m.wall_parallel_s * 1e3:.2f} ms with default settings; kernel floor "
              f"{fit.kernel_floor_s * 1e6:.1f} us")
    return Profile.from_dict({
        "version": 1,
        "devices": {device_type: {"peak_flops": peak, "memory_bandwidth": bw,
                                  "launch_overhead_s": fit.launch_overhead_s, "efficiency": fit.efficiency}},
        "source": source})


# --------------------------------------------------------------------------------------------
# The distributed runtime between hosts
# --------------------------------------------------------------------------------------------

def _read_graph(nbytes: int, reader: str, holder: str) -> "v1.GraphDef":
    """A step in which HOLDER's variable of NBYTES is read and summed on READER (a device string)."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(holder):
            var = tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name="payload")
        with tf.device(reader):
            total = tf.reduce_sum(var.read_value())
            tf.group(total, name="step")
        v1.variables_initializer([var], name="init")
    return g.as_graph_def()


def _collective_graph(nbytes: int, devices: Sequence[str], reduce: bool) -> "v1.GraphDef":
    """A step in which every device sums its own variable of NBYTES, all-reduced first when REDUCE."""
    g = tf.Graph()
    with g.as_default():
        sums, variables = [], []
        for i, dev in enumerate(devices):
            with tf.device(dev):
                var = tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name=f"payload_{i}")
                variables.append(var)
                x = var.read_value()
                if reduce:
                    x = tf.raw_ops.CollectiveReduceV2(input=x, group_size=len(devices), group_key=1, instance_key=1,
                                                      ordering_token=[], merge_op="Add", final_op="Id",
                                                      communication_hint="ring")
                sums.append(tf.reduce_sum(x))
        with tf.device(devices[0]):
            tf.group(*sums, name="step")
        v1.variables_initializer(variables, name="init")
    return g.as_graph_def()


def _fit_line(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed seconds >= 0, bytes per second) of ``seconds = fixed + sizes / rate``."""
    slope, intercept = np.polyfit(sizes, np.maximum(seconds, 0.0), 1)
    return float(max(intercept, 0.0)), (1.0 / slope if slope > 0 else float("inf"))


def measure_network(target: str, near: str, far: str, *, sizes_bytes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20, 16 << 20),
                    steps: int = 12) -> "NetworkProfile":
    """Measure TensorFlow's runtime costs between two tasks of a running cluster (TARGET, "grpc://...").

    NEAR and FAR are device strings of two tasks. Transfers: for each size, a variable on FAR (remote)
    or on NEAR (local) is read and summed on NEAR; the remote-minus-local step time is the transfer,
    fitted as ``latency + bytes / rate``. Collectives: a ring all-reduce (CollectiveReduceV2) of each
    size between the two tasks, minus the same step without it, fitted likewise (for two devices a ring
    all-reduce moves the full size each way). The step overhead is the local step of the smallest size.
    """
    from tag.cost.model import NetworkProfile
    from tag.backend.runtime import run_steps

    def step_time(graph_def) -> float:
        r = run_steps(graph_def, target, train_op="step", loss=None, init="init", steps=steps, warmup=2)
        return float(np.median(r.step_times[2:]))

    sizes = np.array(sorted(sizes_bytes), dtype=np.float64)
    local = np.array([step_time(_read_graph(int(n), near, near)) for n in sizes])
    remote = np.array([step_time(_read_graph(int(n), near, far)) for n in sizes])
    apart = np.array([step_time(_collective_graph(int(n), (near, far), reduce=False)) for n in sizes])
    reduced = np.array([step_time(_collective_graph(int(n), (near, far), reduce=True)) for n in sizes])
    t_lat, t_rate = _fit_line(sizes, remote - local)
    c_lat, c_rate = _fit_line(sizes, reduced - apart)
    return NetworkProfile(step_overhead_s=float(local[0]), transfer_latency_s=t_lat, transfer_bytes_per_s=t_rate,
                          collective_latency_s=c_lat, collective_bytes_per_s=c_rate)


def profile_network(*, threads_per_worker: int = 1, steps: int = 12) -> "NetworkProfile":
    """Start two local TF servers (one ``threads_per_worker``-thread worker each) and measure_network()."""
    from tag.backend.runtime import LocalCluster, free_ports
    from tag.cluster.topology import parse_topology
    ports = free_ports(2)
    text = "\n".join(f'host {{ name: "net{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                     f'count: 1 memory_gib: 1 peak_tflops: 0.01 memory_bandwidth_gbs: 1 }} }}'
                     for i, p in enumerate(ports)) + "\nfabric { bandwidth_gbps: 10 latency_us: 10 }\n"
    topo = parse_topology(text, path="<network profile>")
    with LocalCluster(topo, threads_per_worker=threads_per_worker) as cluster:
        return measure_network(cluster.target, topo.tf_device(0), topo.tf_device(1), steps=steps)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _body(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tag-profile",
                                description="Profile a training step on this machine and write a cost profile.")
    p.add_argument("--model", required=True, help="zoo:NAME[,key=value...] or a .pb/.pbtxt training GraphDef")
    p.add_argument("--batch", type=int, default=None, help="global batch size (default: the model's)")
    p.add_argument("--steps", type=int, default=10, help="traced steps (default 10)")
    p.add_argument("--device-type", default="CPU", help="device type the profile describes (default CPU)")
    p.add_argument("--out", default=None, help=f"output JSON (default: ${PROFILE_ENV} or the user cache)")
    p.add_argument("--network", action="store_true",
                   help="also measure TF's distributed runtime between two local one-thread workers "
                        "(step overhead, transfer latency and throughput)")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        raise TagError(f"--batch must be positive, got {args.batch}")
    if args.steps < 1:
        raise TagError(f"--steps must be positive, got {args.steps}")
    from tag import zoo
    from tag.frontend.analyze import analyze
    name, gd = zoo.resolve_model(args.model, args.batch)
    graph = analyze(gd, batch_size=args.batch)
    prof = profile_graph(gd, graph, steps=args.steps, device_type=args.device_type, model=args.model)
    if args.network:
        prof.network = profile_network()
        prof.source += "; network: two local one-thread TF workers over gRPC"
    out = args.out or default_profile_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    prof.save(out)              # atomic: temporary file + rename
    d = prof.to_dict()["devices"][args.device_type]
    print(f"wrote {out}")
    if prof.network is not None:
        n = prof.network
        print(f"  runtime: step overhead {n.step_overhead_s * 1e3:.2f} ms, transfer latency "
              f"{n.transfer_latency_s * 1e6:.0f} us, transfer throughput {n.transfer_bytes_per_s / 1e9:.2f} GB/s, "
              f"all-reduce latency {n.collective_latency_s * 1e6:.0f} us, throughput "
              f"{n.collective_bytes_per_s / 1e9:.2f} GB/s")
    print(f"  peak {d['peak_flops'] / 1e9:.1f} GFLOP/s, memory {d['memory_bandwidth'] / 1e9:.1f} GB/s, "
          f"launch {d['launch_overhead_s'] * 1e6:.1f} us")
    for t, e in sorted(d["efficiency"].items()):
        print(f"  {t:<36} efficiency {e:.3g}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tag-profile``: exit 0, or 2 with one line on bad input."""
    from tag.cli.common import run_cli
    return run_cli("tag-profile", _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
