"""Fit a cost profile to measurements: per-op-type efficiencies, launch overhead, network lines (numpy only).

``tag.cost.calibration`` measures with TensorFlow (kernel times from step stats, peak FLOP/s,
memory bandwidth, runtime costs between two workers); this module turns those numbers into the
``tag.cost.Profile`` parameters, with no TensorFlow import, so fits can be tested on hand-made
measurements.

Example::

    import tag
    from tag.cost.calibration import measure_memory_bandwidth, measure_peak_flops, measure_step
    from tag.cost.fitting import fit_profile

    graph = tag.analyze(graph_def)
    m = measure_step(graph_def, graph)           # a StepMeasurement: median kernel time per op
    fit = fit_profile(graph, m, peak=measure_peak_flops(), bw=measure_memory_bandwidth())
    fit.efficiency["MatMul"], fit.launch_overhead_s, fit.kernel_floor_s

How the fit works (one device type, one graph):

- Profiling runs ops one at a time (``inter_op_parallelism_threads=1``; each kernel still uses all
  intra-op threads) with grappler's graph rewrites off, so each IR op is one kernel with its own
  name and the per-device sequential schedule the simulator assumes is what is measured.
- ``kernel_floor``: the median kernel time of the zero-FLOP ops (a kernel's fixed cost; at least
  the step stats' resolution of 1 us).
- Per op type with FLOPs, the efficiency ``e`` solves ``sum_i max(F_i / (peak * e), B_i / bw) =
  sum_i max(t_i - kernel_floor, 0)`` over that type's ops (``t_i`` the median kernel time), so the
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
- Every kernel time and step wall is the median of the steps, the statistic step times are reported
  and benchmarked in: the fastest of each op taken separately add up to less than any real step, and a
  noisy machine moves them more (peak and bandwidth are the fastest of several runs: they only set the
  scale the efficiencies are fitted against).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.cost.matmul_table import matmul_dims
from tag.cost.model import ZERO_COST_TYPES
from tag.errors import GraphError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cost.matmul_table import MatmulTable
    from tag.ir.types import TrainingGraph

_STEP_STATS_RESOLUTION_S = 1e-6      # step stats count whole microseconds
_MIN_FIT_S = 20e-6                   # ops faster than this even at the roofline: fixed costs, not efficiency
_MAX_MATMUL_SCALE = 4.0              # in-graph MatMuls at most this much faster than the table's lone products


@dataclass
class StepMeasurement:
    """Kernel time per IR op (seconds; NaN where the step stats did not show the op) and step walls.

    Every figure is the median of the steps: what a step takes as step times are reported (medians), and
    steadier on a shared machine than the fastest of each op taken separately.
    """

    op_times: np.ndarray
    wall_s: float                   # wall time of an untraced step, ops one at a time
    wall_parallel_s: float          # the same with TensorFlow's default session settings
    steps: int
    wall_sustained_s: float | None = None   # mean default-settings step over a long window (``sustain_s``)


def fit_efficiency(flops: np.ndarray, mem: np.ndarray, target_s: float, peak: float, bw: float,
                   upper: float = 1.0) -> float:
    """The e in (0, UPPER] with sum max(flops / (peak e), mem / bw) = target_s (UPPER when even that is slower)."""
    def model(e: float) -> float:
        return float(np.maximum(flops / (peak * e), mem / bw).sum())
    if model(upper) >= target_s:
        return float(upper)
    lo, hi = -12.0, math.log10(upper)   # log10(e): model(10**lo) is huge, model(10**hi) too small
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
    matmul_scale: float = 1.0       # in-graph MatMul speed over the MatMul table's (1 without a table)


def fit_profile(graph: "TrainingGraph | Sequence[TrainingGraph]", m: "StepMeasurement | Sequence[StepMeasurement]",
                peak: float, bw: float, matmul_table: "MatmulTable | None" = None) -> Fit:
    """Per-op-type efficiencies and the launch overhead from a step measurement (see module docstring).

    GRAPH and M may be sequences (several calibration graphs measured on the same device): their ops are
    fitted together, and the launch overhead spreads the sum of their steps' unexplained time over all ops.
    Matches ``tag.cost.CostModel.op_times``: ops of ``tag.cost.ZERO_COST_TYPES`` cost nothing there,
    so their measured time is folded into the launch overhead of the others. With a MATMUL_TABLE, the MatMul
    ops whose shapes it covers take their efficiency from it in the step's roofline (as ``CostModel.op_times``
    does), times one scale fitted over them like an efficiency (``Fit.matmul_scale``: the table times lone
    products, a training step runs them among other ops); the per-type MatMul fit stays, for MatMul ops the
    table cannot place (unknown shapes).
    """
    graphs = [graph] if not isinstance(graph, (list, tuple)) else list(graph)
    measurements = [m] if not isinstance(m, (list, tuple)) else list(m)
    if len(graphs) != len(measurements) or not graphs:
        raise ValueError("fit_profile needs one measurement per graph")
    # per-op arrays over every graph's ops: FLOPs and bytes at its batch, op type, charged by the cost model?
    flops = np.concatenate([[op.flops.at(float(g.batch_size)) for op in g.ops] for g in graphs]).astype(np.float64)
    mem = np.concatenate([[op.mem_bytes.at(float(g.batch_size)) for op in g.ops] for g in graphs]).astype(np.float64)
    types = np.concatenate([[op.type for op in g.ops] for g in graphs]).astype(str)
    op_times = np.concatenate([x.op_times for x in measurements]).astype(np.float64)
    wall_parallel = float(sum(x.wall_parallel_s for x in measurements))
    costed = np.array([t not in ZERO_COST_TYPES for t in types], dtype=bool)
    tabled = np.full(len(types), np.nan)               # per op: its MatMul table efficiency (NaN: none)
    if matmul_table is not None:
        start = 0
        for g in graphs:
            dims = matmul_dims(g)
            tabled[start + dims.ops] = matmul_table.lookup(dims.variant, *dims.at(float(g.batch_size)))
            start += len(g.ops)
    seen = ~np.isnan(op_times)                        # per op: did the step stats show it?
    if not (seen & costed).any():
        raise GraphError("TensorFlow's step stats named none of the graph's ops; nothing to fit")
    zero = seen & (flops <= 0)
    floor = float(np.median(op_times[zero])) if zero.any() else float(np.min(op_times[seen]))
    floor = max(floor, _STEP_STATS_RESOLUTION_S)
    busy = np.where(seen, np.maximum(op_times - floor, 0.0), 0.0)
    ideal = np.maximum(flops / peak, mem / bw)        # the roofline at efficiency 1
    candidates = seen & costed & (flops > 0)
    # a toy graph whose ops are all tiny: fit its largest ops (within 2x of the largest)
    threshold = min(_MIN_FIT_S, 0.5 * float(ideal[candidates].max())) if candidates.any() else _MIN_FIT_S
    fitted = candidates & (ideal >= threshold)
    eff: dict[str, float] = {}
    for t in sorted(set(types[fitted])):
        sel = fitted & (types == t)
        eff[str(t)] = fit_efficiency(flops[sel], mem[sel], float(busy[sel].sum()), peak, bw)
    eff["default"] = (fit_efficiency(flops[fitted], mem[fitted], float(busy[fitted].sum()), peak, bw)
                      if fitted.any() else 0.5)
    # the table's shape dependence is measured on lone products; its level inside a training step is fitted here
    in_table = fitted & ~np.isnan(tabled)
    scale = (fit_efficiency(flops[in_table] / tabled[in_table], mem[in_table], float(busy[in_table].sum()), peak, bw,
                            upper=_MAX_MATMUL_SCALE) if in_table.any() else 1.0)
    tabled = np.minimum(tabled * scale, 1.0)
    e_op = np.where(np.isnan(tabled), [eff.get(t, eff["default"]) for t in types], tabled)
    roofline = np.where(costed, np.maximum(flops / (peak * e_op), mem / bw), 0.0)
    launch = max(floor, (wall_parallel - float(roofline.sum())) / max(int(costed.sum()), 1))
    return Fit(eff, float(launch), floor, float(scale))


def fit_line(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed seconds >= 0, bytes per second) of ``seconds = fixed + sizes / rate``."""
    slope, intercept = np.polyfit(sizes, np.maximum(seconds, 0.0), 1)
    return float(max(intercept, 0.0)), (1.0 / slope if slope > 0 else float("inf"))
