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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.cost.model import ZERO_COST_TYPES
from tag.errors import GraphError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.ir.types import TrainingGraph

_STEP_STATS_RESOLUTION_S = 1e-6      # step stats count whole microseconds
_MIN_FIT_S = 20e-6                   # ops faster than this even at the roofline: fixed costs, not efficiency


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


def fit_efficiency(flops: np.ndarray, mem: np.ndarray, target_s: float, peak: float, bw: float) -> float:
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


def fit_profile(graph: "TrainingGraph | Sequence[TrainingGraph]", m: "StepMeasurement | Sequence[StepMeasurement]",
                peak: float, bw: float) -> Fit:
    """Per-op-type efficiencies and the launch overhead from a step measurement (see module docstring).

    GRAPH and M may be sequences (several calibration graphs measured on the same device): their ops are
    fitted together, and the launch overhead spreads the sum of their steps' unexplained time over all ops.
    Matches ``tag.cost.CostModel.op_times``: ops of ``tag.cost.ZERO_COST_TYPES`` cost nothing there,
    so their measured time is folded into the launch overhead of the others.
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
    e_op = np.array([eff.get(t, eff["default"]) for t in types])
    roofline = np.where(costed, np.maximum(flops / (peak * e_op), mem / bw), 0.0)
    launch = max(floor, (wall_parallel - float(roofline.sum())) / max(int(costed.sum()), 1))
    return Fit(eff, float(launch), floor)


def fit_line(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed seconds >= 0, bytes per second) of ``seconds = fixed + sizes / rate``."""
    slope, intercept = np.polyfit(sizes, np.maximum(seconds, 0.0), 1)
    return float(max(intercept, 0.0)), (1.0 / slope if slope > 0 else float("inf"))
