"""Profiler: calibrate the cost model on the local device from TensorFlow's own step statistics.

The cost model times an op with a roofline, ``launch + max(FLOPs / (peak * efficiency), bytes /
memory_bandwidth)``. This module measures the local device's peak FLOP/s (a large MatMul) and memory
bandwidth (a large elementwise add), runs a training step with random inputs of the right shapes
under ``RunOptions(trace_level=FULL_TRACE)``, reads every op's kernel time from
``RunMetadata.step_stats``, and fits per-op-type efficiencies and a per-op launch overhead. The
result is a ``tag.cost.Profile`` (JSON) that later calls pick up; other device types reuse the
efficiencies with their own spec-sheet peak and bandwidth (the cost model does that).

Usage::

    import tag
    from tag.calibration import profile_graph

    prof = profile_graph(graph_def, tag.analyze(graph_def), steps=10)   # graph_def: a training GraphDef
    prof.save("profile.json")

Not part of ``tag.cost``: it runs models through the runtime (``tag.backend.runtime``), which sits above the
cost model. How the measurements become efficiencies and a launch overhead: ``tag.cost.fitting`` (numpy only).
Where profiles are stored by default: ``tag.cost.profile_store``. The command line: ``tag.cli.profile``.
"""
from __future__ import annotations

import math
import os
import platform
import time
from typing import TYPE_CHECKING, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tag.backend.runtime import LocalCluster, free_ports, run_steps  # noqa: E402
from tag.backend.runtime.guard import RunControl  # noqa: E402
from tag.backend.runtime.inputs import random_input  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.cost.fitting import Fit, StepMeasurement, fit_line, fit_profile  # noqa: E402,F401 - re-exported
from tag.cost.matmul_table import DEFAULT_SIDES, VARIANTS, grid_shapes, table_from_rates  # noqa: E402
from tag.cost.model import NetworkProfile, Profile  # noqa: E402
from tag.cost.profile_store import PROFILE_ENV, default_profile_path, load_default_profile  # noqa: E402,F401
from tag.cuda_noise import init_devices  # noqa: E402
from tag.errors import GraphError, TagError  # noqa: E402
from tag.ir.op_types import INITIALIZER_TYPES, VARIABLE_TYPES  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from tag.cost.matmul_table import MatmulTable
    from tag.ir.types import TrainingGraph

v1 = tf.compat.v1

_MIN_WALL_SAMPLES = 20               # untraced default-settings steps timed at least (unless > 10 s)

init_devices()      # the sessions below: no cuInit error line on a machine without a GPU driver


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

def _kernel_times(md: "v1.RunMetadata", index: dict[str, int]) -> dict[int, float]:
    """{IR op index: kernel seconds in this traced step} from MD's step stats (INDEX: op name -> op index)."""
    per_step: dict[int, float] = {}
    for dev in md.step_stats.dev_stats:
        this_dev: dict[int, float] = {}
        for ns in dev.node_stats:
            i = index.get(ns.node_name)
            if i is not None:
                this_dev[i] = this_dev.get(i, 0.0) + (ns.op_end_rel_micros - ns.op_start_rel_micros) * 1e-6
        for i, t in this_dev.items():   # GPU: launch and stream rows; keep the longer
            per_step[i] = max(per_step.get(i, 0.0), t)
    return per_step


def measure_step(graph_def, graph: "TrainingGraph", steps: int = 10, device_type: str = "CPU",
                 warmup: int = 3, seed: int = 0, sustain_s: float = 0.0) -> StepMeasurement:
    """Run the training step and read each op's kernel time from TensorFlow's step stats.

    Two sessions on the graph are open together: ops one at a time (traced and untraced steps) and
    TensorFlow's default settings (untraced), and their steps alternate, so that every figure sees the same
    machine load. The launch overhead is fitted from the default-settings step minus the traced kernels
    (``tag.cost.fitting``): a residual of a few percent of the step, which a drift of the machine between the
    two measurements moves several-fold. Taken one after the other, the default-settings walls of the three
    testbed calibration graphs ran 0.85-1.30x the ops-one-at-a-time walls in three calibrations in a row; taken
    alternately, 0.99-1.04x (``scripts/bench_calibration_spread.py``).

    ``sustain_s`` > 0: also time default-settings steps back to back for that many seconds and record
    their median (``StepMeasurement.wall_sustained_s``), the speed a time-sliced device keeps up."""
    if steps < 1:
        raise TagError(f"steps must be at least 1, got {steps}")
    g = _import(graph_def, device_type)
    rng = np.random.default_rng(seed)
    targets = _step_targets(graph)
    init = _init_ops(graph_def, graph)
    index = graph.op_index
    samples: list[list[float]] = [[] for _ in graph.ops]    # per IR op: its kernel time in each traced step
    with g.as_default():
        feeds = _random_feeds(g, graph, rng)

    def timed(sess) -> float:
        t0 = time.perf_counter()
        sess.run(targets, feed_dict=feeds)
        return time.perf_counter() - t0

    with v1.Session(graph=g, config=_session_config(serial=True)) as serial, \
            v1.Session(graph=g, config=_session_config(serial=False)) as default:
        try:
            for sess in (serial, default):
                if init:
                    _initialise(sess, init, feeds)
                for _ in range(warmup):
                    sess.run(targets, feed_dict=feeds)
        except tf.errors.OpError as err:
            raise GraphError(f"the training step fails on random inputs: {' '.join(err.message.split())[:300]}") \
                from None
        walls: list[float] = []
        par: list[float] = []
        wanted = max(steps, _MIN_WALL_SAMPLES)   # default-settings samples: cheap, untraced; fewer past 10 s
        opts = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
        for k in range(steps):    # per round: untraced, traced, then this round's share of default-settings steps
            walls.append(timed(serial))
            md = v1.RunMetadata()
            serial.run(targets, feed_dict=feeds, options=opts, run_metadata=md)
            for i, t in _kernel_times(md, index).items():
                samples[i].append(t)
            share = 1 if sum(par) > 10.0 else max(1, math.ceil((wanted - len(par)) / (steps - k)))
            par.extend(timed(default) for _ in range(share))
        sustained = _sustained_step(default, targets, feeds, sustain_s) if sustain_s > 0 else None
    op_times = np.array([np.median(s) if s else np.nan for s in samples], dtype=np.float64)
    return StepMeasurement(op_times, float(np.median(walls)), float(np.median(par)), steps, sustained)


def _sustained_step(sess, targets, feeds, seconds: float) -> float:
    """Median time of steps run back to back for SECONDS (at least 5 steps; the median, not the mean, so
    that a burst of another process's work on a shared machine does not count)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        sess.run(targets, feed_dict=feeds)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_sustained_step(graph_def, graph: "TrainingGraph", seconds: float = 4.0, device_type: str = "CPU",
                           warmup: int = 3, seed: int = 0) -> float:
    """Median wall time of the training step (TensorFlow's default session settings) over SECONDS of steps
    run back to back: the speed a time-sliced device keeps up, throttled slices included."""
    g = _import(graph_def, device_type)
    targets, init = _step_targets(graph), _init_ops(graph_def, graph)
    with g.as_default():
        feeds = _random_feeds(g, graph, np.random.default_rng(seed))
    with v1.Session(graph=g, config=_session_config(serial=False)) as sess:
        if init:
            _initialise(sess, init, feeds)
        for _ in range(warmup):
            sess.run(targets, feed_dict=feeds)
        return _sustained_step(sess, targets, feeds, seconds)


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


def measure_peak_flops(device_type: str = "CPU", n: int = 1024, reps: int = 20, threads: int | None = None) -> float:
    """FLOP/s of an n x n x n float32 MatMul (fastest of REPS), the device's attainable peak (THREADS: run
    with that many intra- and inter-op threads, as a worker of that many threads does; default TF's)."""
    g = tf.Graph()
    with g.as_default(), tf.device(_tf_device(device_type)):
        a = tf.Variable(tf.random.normal([n, n], seed=1))
        b = tf.Variable(tf.random.normal([n, n], seed=2))
        mm = tf.matmul(a, b)
        init = v1.global_variables_initializer()
    config = _session_config(serial=False)
    if threads:
        config.intra_op_parallelism_threads = config.inter_op_parallelism_threads = int(threads)
    with v1.Session(graph=g, config=config) as sess:
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


def measure_matmul_rates(shapes: Sequence[tuple[str, int, int, int]], peak: float, device_type: str = "CPU",
                         target_s: float = 0.003, runs: int = 3) -> dict[tuple[str, int, int, int], float]:
    """FLOP/s of each (variant, m, k, n) MatMul (``tag.cost.matmul_table``), timed as the runtime runs it: copies
    of the product grouped into one session run of about TARGET_S seconds at half of PEAK (so a small product's
    time is its kernels, not the session's), ops one at a time, the median of RUNS runs after one warm-up.
    One graph per (variant, m)."""
    by_group: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for v, m, k, n in shapes:
        if v not in VARIANTS:
            raise TagError(f"unknown MatMul variant {v!r} (expected one of {', '.join(VARIANTS)})")
        by_group.setdefault((v, m), []).append((k, n))
    rates: dict[tuple[str, int, int, int], float] = {}
    for (v, m), kns in by_group.items():
        ta, tb = v == "tn", v == "nt"
        g = tf.Graph()
        with g.as_default(), tf.device(_tf_device(device_type)):
            a_of = {k: tf.Variable(tf.random.normal([k, m] if ta else [m, k], seed=1)) for k in {k for k, _ in kns}}
            groups = {}
            for k, n in kns:
                b = tf.Variable(tf.random.normal([n, k] if tb else [k, n], seed=2))
                copies = int(np.clip(target_s * 0.5 * peak / (2.0 * m * k * n), 1, 16))
                groups[(k, n)] = (copies, tf.group(*[tf.matmul(a_of[k], b, transpose_a=ta, transpose_b=tb)
                                                    for _ in range(copies)]))
            init = v1.global_variables_initializer()
        with v1.Session(graph=g, config=_session_config(serial=True)) as sess:
            sess.run(init)
            for (k, n), (copies, group) in groups.items():
                sess.run(group)                                   # warm-up (first-run allocations)
                times = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    sess.run(group)
                    times.append((time.perf_counter() - t0) / copies)
                rates[(v, m, k, n)] = 2.0 * m * k * n / float(np.median(times))
    return rates


def measure_matmul_table(peak: float, device_type: str = "CPU", sides: Sequence[int] | None = None) -> "MatmulTable":
    """The MatMul efficiency table of this device (``tag.cost.matmul_table``): every variant on the grid of
    SIDES (default ``DEFAULT_SIDES``) up to ``GRID_MAX_FLOPS`` (2^32) FLOPs per product, as fractions of PEAK.
    About three minutes on one CPU core."""
    sides = tuple(sides or DEFAULT_SIDES)
    return table_from_rates(measure_matmul_rates(grid_shapes(sides), peak, device_type), peak, sides)


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
                  seed: int = 0, model: str | None = None, sustain_s: float = 0.0,
                  more: Sequence[tuple[object, "TrainingGraph", str]] = (), matmul_table: bool = False,
                  matmul_sides: Sequence[int] | None = None) -> "Profile":
    """Profile one training step on the local device and return the calibrated ``tag.cost.Profile``.

    ``graph`` is ``tag.analyze(graph_def)``; ``device_type`` names the entry in the profile (the
    topology's device type for this machine, "CPU" on a CPU host); ``steps`` traced steps are taken
    after a short warm-up; each op's median time is used. ``model`` names the graph in the profile's source.
    ``more``: further (graph_def, graph, name) calibration graphs measured the same way and fitted together
    with the first (e.g. a CNN and a transformer beside an MLP, so that each op family has its own fit).

    ``sustain_s`` > 0: also record the first graph's median step over SUSTAIN_S seconds of steps
    (``sustained_step_s``), which ``profile_like`` scales other devices from.

    ``matmul_table``: also time MatMul products on a grid of shapes (``measure_matmul_table``, MATMUL_SIDES)
    and cost MatMul ops by their shape (``tag.cost.matmul_table``), at the level the calibration graphs'
    MatMuls run at (``Fit.matmul_scale``).
    """
    items = [(graph_def, graph, model or graph.name or "graph"), *more]
    ms = [measure_step(gd, g, steps=steps, device_type=device_type, seed=seed, sustain_s=sustain_s if i == 0 else 0.0)
          for i, (gd, g, _) in enumerate(items)]
    peak = measure_peak_flops(device_type)
    bw = measure_memory_bandwidth(device_type)
    table = measure_matmul_table(peak, device_type, matmul_sides) if matmul_table else None
    fit = fit_profile([g for _, g, _ in items], ms, peak, bw, matmul_table=table)
    steps_text = "; ".join(f"{name} at batch {g.batch_size}: step {m.wall_s * 1e3:.2f} ms ops one at a time, "
                           f"{m.wall_parallel_s * 1e3:.2f} ms with default settings"
                           for (_, g, name), m in zip(items, ms, strict=True))
    source = (f"tag.profile: {steps} traced steps on {_cpu_name()} ({os.cpu_count()} cores, TensorFlow "
              f"{tf.__version__}); {steps_text}; kernel floor {fit.kernel_floor_s * 1e6:.1f} us")
    source += f"; memory-bound ops at {fit.memory_bandwidth / 1e9:.1f} GB/s (streaming {bw / 1e9:.1f} GB/s)"
    entry = {"peak_flops": peak, "memory_bandwidth": fit.memory_bandwidth, "launch_overhead_s": fit.launch_overhead_s,
             "efficiency": fit.efficiency}
    if table is not None:
        entry["matmul_table"] = table.scaled(fit.matmul_scale).to_dict()
        source += (f"; MatMul table on sides {'/'.join(map(str, table.sides))}, a training step's MatMuls "
                   f"{fit.matmul_scale:.2f}x as fast as lone products")
    if ms[0].wall_sustained_s:
        source += f"; sustained step of {items[0][2]} {ms[0].wall_sustained_s * 1e3:.2f} ms over {sustain_s:g} s"
        entry["sustained_step_s"] = ms[0].wall_sustained_s
    return Profile.from_dict({"version": 1, "devices": {device_type: entry}, "source": source})


def profile_like(base: "Profile", graph_def, graph: "TrainingGraph", *, device_type: str,
                 base_type: str | None = None, sustain_s: float = 4.0, model: str | None = None) -> "Profile":
    """Profile a device that runs the same kernels as BASE's device at another speed (a CPU quota, a lower
    clock, a GPU shared with other jobs): time the same model's sustained step here and scale BASE's entry
    (``sustained_step_s``, from ``profile_graph(..., sustain_s=...)``) by the ratio of the two steps.

    Kernel times cannot be traced on a time-sliced device: its fastest kernels run at full speed between
    the slices it is denied, while its steps do not. The ratio of sustained steps is the speed it keeps up.
    """
    types = [base_type] if base_type else list(base.devices)
    if len(types) != 1 or types[0] not in base.devices:
        raise TagError(f"the base profile describes {', '.join(sorted(base.devices)) or 'no device'}: name the "
                       f"one to scale from")
    ref = base.devices[types[0]]
    if not ref.sustained_step_s:
        raise TagError(f"the base profile's {types[0]!r} entry has no sustained step (profile it with --sustained)")
    step = measure_sustained_step(graph_def, graph, seconds=sustain_s, device_type=device_type)
    share = ref.sustained_step_s / step
    entry = ref.scaled(share, sustained_step_s=step)
    source = (f"tag.profile: {model or graph.name or 'graph'} at batch {graph.batch_size}: {types[0]} of "
              f"[{base.source}] scaled by {share:.3f} (sustained step {step * 1e3:.2f} ms here, "
              f"{ref.sustained_step_s * 1e3:.2f} ms there, over {sustain_s:g} s)")
    return Profile({device_type: entry}, source)


# --------------------------------------------------------------------------------------------
# The distributed runtime between hosts
# --------------------------------------------------------------------------------------------

def _read_graph(nbytes: int, reader: str, holder: str, count: int = 1) -> "v1.GraphDef":
    """A step in which COUNT variables of NBYTES each, held by HOLDER, are read and summed on READER (a device
    string)."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(holder):
            payload = [tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name=f"payload_{i}")
                       for i in range(count)]
        with tf.device(reader):
            # the sum goes into a variable: a step whose ops only feed control edges is pruned by Grappler
            # (nothing would be read or sent)
            sink = tf.Variable(0.0, name="sink")
            total = tf.add_n([tf.reduce_sum(v.read_value()) for v in payload])
            tf.group(sink.assign_add(total), name="step")
        v1.variables_initializer([*payload, sink], name="init")
    return g.as_graph_def()


def _ring_allreduce(x, group_size: int, instance_key: int):
    """X summed over a group of GROUP_SIZE devices by a ring ``CollectiveReduceV2``, as the rewriter emits it."""
    return tf.raw_ops.CollectiveReduceV2(input=x, group_size=group_size, group_key=1, instance_key=instance_key,
                                         ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring")


def _sync_graph(nbytes: int, devices: Sequence[str], kind: str, chains: Sequence[int] = ()) -> "v1.GraphDef":
    """A step in which every device of DEVICES holds a gradient-like variable of NBYTES, synchronised as the
    rewriter does it (KIND ``allreduce``: a ring ``CollectiveReduceV2`` over all of them; ``ps``: each other
    device's payload read on DEVICES[0], a parameter-server push; ``local``: each summed where it is), and,
    when CHAINS (one depth per device) is given, an independent chain of that many 256 x 256 MatMuls on each
    device in the same step, as a replica's backward pass runs beside the synchronisation of gradients it has
    already produced."""
    g = tf.Graph()
    with g.as_default():
        variables, outs = [], []
        for i, dev in enumerate(devices):
            with tf.device(dev):
                var = tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name=f"payload_{i}")
                variables.append(var)
                x = var.read_value()
                if kind == "allreduce":
                    x = _ring_allreduce(x, len(devices), 1)
            with tf.device(devices[0] if kind == "ps" else dev):
                sink = tf.Variable(0.0, name=f"sink_{i}")      # used: see _read_graph
                variables.append(sink)
                outs.append(sink.assign_add(tf.reduce_sum(x)))
        chained = zip(devices, chains, strict=True) if chains else ()      # no chains, or one per device
        for i, (dev, depth) in enumerate(chained):
            with tf.device(dev):
                m = tf.Variable(tf.random.normal([SYNC_CHAIN_SIDE] * 2, stddev=SYNC_CHAIN_SIDE ** -0.5),
                                name=f"chain_{i}")
                variables.append(m)
                y = m.read_value()
                for _ in range(depth):
                    y = tf.matmul(y, m)
                sink = tf.Variable(0.0, name=f"chain_sink_{i}")
                variables.append(sink)
                outs.append(sink.assign_add(tf.reduce_sum(y)))
        with tf.device(devices[0]):
            tf.group(*outs, name="step")
        v1.variables_initializer(variables, name="init")
    return g.as_graph_def()


def median_step(graph_def, target: str, steps: int, init: str | None = "init") -> float:
    """The median of STEPS timed steps (after two warm-up steps) of a calibration graph whose step op is
    ``step`` (no loss), on TARGET."""
    r = run_steps(graph_def, target, train_op="step", loss=None, init=init, steps=steps + 2, warmup=2)
    return float(np.median(r.step_times[2:]))


#: measure_sync_serial: the MatMul side of each host's chain, the fastest host's chain length, the payloads
SYNC_CHAIN_SIDE = 256
SYNC_CHAIN_DEPTH = 48
SYNC_BYTES = (256 << 10, 1 << 20, 4 << 20)


def measure_sync_serial(target: str, devices: Sequence[str], speeds: Sequence[float], *,
                        sizes_bytes: Sequence[int] = SYNC_BYTES, steps: int = 10) -> tuple[float, float, list[dict]]:
    """How much gradient synchronisation and compute lose to each other on the hosts of DEVICES (one TF device
    string per host of a running cluster, TARGET ``grpc://...``; SPEEDS their relative FLOP/s): (all-reduce
    fraction, parameter-server push fraction, one row per payload and kind).

    For each payload in SIZES_BYTES the step is timed empty (``local``), with a MatMul chain on every device
    (C; each chain's length follows the device's speed, so all end together as a data-parallel step's shares
    do), with the synchronisation alone (T) and with both (B), each the median of STEPS steps after two
    warm-up steps, the empty step taken off each. The overlap is ``(C + T - B) / min(C, T)`` (1: side by side,
    0: one after the other); the fraction is the median over payloads of ``1 - overlap``, clipped to [0, 1]
    (``NetworkProfile.sync_serial_allreduce`` / ``sync_serial_ps``)."""
    fastest = max(speeds)
    chains = [max(1, round(SYNC_CHAIN_DEPTH * s / fastest)) for s in speeds]
    rows: list[dict] = []
    for nbytes in sizes_bytes:
        empty = median_step(_sync_graph(nbytes, devices, "local"), target, steps)
        compute = median_step(_sync_graph(nbytes, devices, "local", chains), target, steps) - empty
        for kind in ("allreduce", "ps"):
            sync = median_step(_sync_graph(nbytes, devices, kind), target, steps) - empty
            both = median_step(_sync_graph(nbytes, devices, kind, chains), target, steps) - empty
            overlap = (compute + sync - both) / max(min(compute, sync), 1e-9)
            rows.append({"kind": kind, "bytes": int(nbytes), "compute_s": compute, "sync_s": sync, "both_s": both,
                         "empty_s": empty, "overlap": overlap})

    def fraction(kind: str) -> float:
        return float(np.median([min(max(1.0 - r["overlap"], 0.0), 1.0) for r in rows if r["kind"] == kind]))
    return fraction("allreduce"), fraction("ps"), rows


#: how many small tensors measure_network sends in one step to find the cost of each extra tensor
PER_TENSOR_PROBE = 64


def _chain_graph(nbytes: int, devices: Sequence[str], hops: int) -> "v1.GraphDef":
    """A step of HOPS dependent multiplications of a tensor of NBYTES, the k-th on DEVICES[(k + 1) % len(DEVICES)]:
    with two devices on two tasks, each one waits for the tensor to arrive from the other task."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(devices[0]):
            payload = tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name="payload")
            x = payload.read_value()
        factors = []
        for k in range(hops):
            with tf.device(devices[(k + 1) % len(devices)]):
                # times a variable of this device: Grappler fuses chains of unary ops (one device) and folds
                # chains of constants, so neither would cross
                factors.append(tf.Variable(1.0, name=f"factor_{k}"))
                x = x * factors[-1].read_value()
        with tf.device(devices[0]):
            sink = tf.Variable(0.0, name="sink")      # used: see _read_graph
            tf.group(sink.assign_add(tf.reduce_sum(x)), name="step")
        v1.variables_initializer([payload, sink, *factors], name="init")
    return g.as_graph_def()


#: dependent transfers (all-reduces) in measure_network's chains: the per-hop cost is the transfer (collective) latency
CHAIN_HOPS = 32
CHAIN_BYTES = 1 << 10


def _collective_chain_graph(nbytes: int, devices: Sequence[str], hops: int, reduce: bool = True) -> "v1.GraphDef":
    """A step of HOPS dependent ring all-reduces (``CollectiveReduceV2``, as the rewriter emits them) of a tensor
    of NBYTES over DEVICES: each device's input to the k-th is its result of the one before times a variable of
    its own, so each all-reduce starts when the last has finished everywhere. REDUCE=False: the same chain with
    every all-reduce left out (each device multiplies its own tensor), the baseline to take off."""
    g = tf.Graph()
    with g.as_default():
        variables, xs = [], []
        for i, dev in enumerate(devices):
            with tf.device(dev):
                variables.append(tf.Variable(tf.ones([max(1, nbytes // 4)], tf.float32), name=f"payload_{i}"))
                xs.append(variables[-1].read_value())
        for k in range(hops):
            step = []
            for i, dev in enumerate(devices):
                with tf.device(dev):
                    variables.append(tf.Variable(1.0, name=f"factor_{i}_{k}"))    # see _chain_graph
                    x = xs[i] * variables[-1].read_value()
                    if reduce:
                        x = _ring_allreduce(x, len(devices), k + 1)
                    step.append(x)
            xs = step
        outs = []
        for i, dev in enumerate(devices):
            with tf.device(dev):
                variables.append(tf.Variable(0.0, name=f"sink_{i}"))          # used: see _read_graph
                outs.append(variables[-1].assign_add(tf.reduce_sum(xs[i])))
        with tf.device(devices[0]):
            tf.group(*outs, name="step")
        v1.variables_initializer(variables, name="init")
    return g.as_graph_def()


def process_cpu_s(pid: int) -> float:
    """CPU seconds every live thread of process PID has run (``/proc/PID/task/*/schedstat``, nanoseconds);
    NaN where /proc cannot say (not Linux, or the process is gone)."""
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return math.nan
    total = 0
    for tid in tids:
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue              # a thread that ended between the listing and the read
    return total * 1e-9


def measure_network(target: str, near: str, far: str, *,
                    sizes_bytes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20, 16 << 20), steps: int = 12,
                    pids: Sequence[int] | None = None) -> "NetworkProfile":
    """Measure TensorFlow's runtime costs between two tasks of a running cluster (TARGET, "grpc://...").

    NEAR and FAR are device strings of two tasks. Transfers: for each size, a variable on FAR (remote)
    or on NEAR (local) is read and summed on NEAR; the remote-minus-local step time is the transfer, whose
    rate is the slope of ``latency + bytes / rate`` over the sizes. The latency is what one transfer that
    the next op waits for costs: a chain of CHAIN_HOPS multiplications of a 1 KB tensor alternating between
    the two tasks, minus the same chain on NEAR, per hop. (The intercept of the sizes' line is no such figure:
    a lone read overlaps the step's other work, and the intercept fitted on 64 KB-16 MB came out 0.9-1.3
    ms where a dependent hop cost about 0.3 ms on the testbed, ``scripts/bench_transfers.py``'s waves.)
    Collectives: the rate is the slope of a line fitted to a ring all-reduce (CollectiveReduceV2) of each size
    between the two tasks, minus the same step without it (for two devices a ring all-reduce moves the full
    size each way); the latency is what one all-reduce that the next op waits for costs: a chain of CHAIN_HOPS
    dependent all-reduces of a 1 KB tensor minus the same chain without them, per all-reduce, less its bytes at
    that rate. (The line's intercept is no such figure either: over bench_fidelity runs 18-24's calibrations it
    swung between 0.0 and 3.1 ms, where the chain measured 1.0-1.2 ms in six measurements on December 4.) The step
    overhead is the local step of the smallest size.

    PIDS (the processes of NEAR's and FAR's tasks, when they run on this machine): the runtime's own CPU work,
    from the CPU time of every thread of each process over the steps of a graph, remote minus local, per step:
    one tensor of the smallest size gives what taking part in a step from another host costs (FAR's side,
    ``worker_step_cpu_s``; NEAR's, the session's host, ``master_step_cpu_s``), PER_TENSOR_PROBE tensors of
    it what each further tensor costs at each end (``tensor_cpu_s``, the mean of both ends), the largest size
    what each byte costs at each end (``byte_cpu_s``); ``cpu_flops`` is a one-thread MatMul's FLOP/s here.
    """
    def step(graph_def) -> tuple[float, np.ndarray | None]:
        """The median timed step of GRAPH_DEF and, with PIDS, the CPU seconds per step of (near, far) over the
        timed steps (the processes' CPU time after the warm-up steps and after the last: setup not counted)."""
        control, marks = None, []
        if pids:
            def mark(event) -> None:
                if event.kind == "step" and event.step in (2, steps):
                    marks.append(np.array([process_cpu_s(p) for p in pids]))
            control = RunControl(progress=mark)
        r = run_steps(graph_def, target, train_op="step", loss=None, init="init", steps=steps, warmup=2,
                      control=control)
        return float(np.median(r.step_times[2:])), (marks[1] - marks[0]) / (steps - 2) if len(marks) == 2 else None

    def step_time(graph_def) -> float:
        return step(graph_def)[0]

    def cpu_minus(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        return a - b if a is not None and b is not None else None

    def remote_minus_local(nbytes: int, count: int = 1) -> tuple[float, np.ndarray | None]:
        """COUNT tensors of NBYTES read remotely minus locally: seconds per step, and runtime CPU per step of
        (near, far) with PIDS."""
        (t_r, cpu_r), (t_l, cpu_l) = (step(_read_graph(nbytes, near, far, count=count)),
                                      step(_read_graph(nbytes, near, near, count=count)))
        return t_r - t_l, cpu_minus(cpu_r, cpu_l)

    sizes = np.array(sorted(sizes_bytes), dtype=np.float64)
    local_runs = [step(_read_graph(int(n), near, near)) for n in sizes]
    remote_runs = [step(_read_graph(int(n), near, far)) for n in sizes]
    local, remote = (np.array([t for t, _ in runs]) for runs in (local_runs, remote_runs))
    apart = np.array([step_time(_sync_graph(int(n), (near, far), "local")) for n in sizes])
    reduced = np.array([step_time(_sync_graph(int(n), (near, far), "allreduce")) for n in sizes])
    _, t_rate = fit_line(sizes, remote - local)
    _, c_rate = fit_line(sizes, reduced - apart)
    hops = (step_time(_chain_graph(CHAIN_BYTES, (near, far), CHAIN_HOPS))
            - step_time(_chain_graph(CHAIN_BYTES, (near, near), CHAIN_HOPS))) / CHAIN_HOPS
    t_lat = max(hops - CHAIN_BYTES / t_rate, 0.0)
    reductions = (step_time(_collective_chain_graph(CHAIN_BYTES, (near, far), CHAIN_HOPS))
                  - step_time(_collective_chain_graph(CHAIN_BYTES, (near, far), CHAIN_HOPS, reduce=False))) / CHAIN_HOPS
    c_lat = max(reductions - CHAIN_BYTES / c_rate, 0.0)
    # many small tensors in one step against one tensor of their total size: what each extra tensor costs
    many = PER_TENSOR_PROBE
    small = max(4, int(sizes[0]) // many)
    many_s, many_cpu = remote_minus_local(small, count=many)
    one_s, _ = remote_minus_local(small * many)
    per_tensor = max((many_s - one_s) / (many - 1), 0.0)
    host_cpu = {}
    big, big_cpu = int(sizes[-1]), cpu_minus(remote_runs[-1][1], local_runs[-1][1])
    if many_cpu is not None and big_cpu is not None and np.all(np.isfinite([many_cpu, big_cpu])):
        one = remote_minus_local(small)[1]
        tensor_cpu = max(float(np.mean(many_cpu - one)) / (many - 1), 0.0)
        byte_cpu = max(float(np.mean(big_cpu - one)) / (big - small), 0.0)
        host_cpu = dict(master_step_cpu_s=max(float(one[0]) - tensor_cpu, 0.0),
                        worker_step_cpu_s=max(float(one[1]) - tensor_cpu, 0.0),
                        tensor_cpu_s=tensor_cpu, byte_cpu_s=byte_cpu, cpu_flops=measure_peak_flops(threads=1))
    return NetworkProfile(step_overhead_s=float(local[0]), transfer_latency_s=t_lat, transfer_bytes_per_s=t_rate,
                          collective_latency_s=c_lat, collective_bytes_per_s=c_rate, per_tensor_s=float(per_tensor),
                          **host_cpu)


def profile_network(*, threads_per_worker: int = 1, steps: int = 12) -> "NetworkProfile":
    """Start two local TF servers (one ``threads_per_worker``-thread worker each) and measure_network()."""
    ports = free_ports(2)
    text = "\n".join(f'host {{ name: "net{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU '
                     f'count: 1 memory_gib: 1 peak_tflops: 0.01 memory_bandwidth_gbs: 1 }} }}'
                     for i, p in enumerate(ports)) + "\nfabric { bandwidth_gbps: 10 latency_us: 10 }\n"
    topo = parse_topology(text, path="<network profile>")
    with LocalCluster(topo, threads_per_worker=threads_per_worker) as cluster:
        return measure_network(cluster.target, topo.tf_device(0), topo.tf_device(1), steps=steps, pids=cluster.pids)
