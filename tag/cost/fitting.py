"""Fit a cost profile to measurements: per-op-type efficiencies, launch overhead, network lines (numpy only).

``tag.calibration`` measures with TensorFlow (kernel times from step stats, peak FLOP/s,
memory bandwidth, runtime costs between two workers); this module turns those numbers into the
``tag.cost.Profile`` parameters, with no TensorFlow import, so fits can be tested on hand-made
measurements.

Example::

    import tag
    from tag.calibration import measure_memory_bandwidth, measure_peak_flops, measure_step
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
- ``memory_bandwidth``: the memory-bound ops (at ``e = 1`` their bytes take longer than their FLOPs)
  large enough to fit run at ``sum_i B_i / sum_i (t_i - kernel_floor)``, within a factor 4 of the
  streaming benchmark's ``bw``: a ReLU or an addition inside a step finds much of its tensor still in
  cache (on one CPU core, 2-4x faster than streaming). Which ops are memory-bound is decided at that
  fitted bandwidth, refitted until the set stops changing (``fitted_bandwidth``), so that the noise of the
  streaming benchmark does not pick the set. The efficiencies below use that bandwidth.
- A convolution that oneDNN merged with its BiasAdd (``tag.cost.op_classes.cpu_fused_bias_adds``) shows
  its time under the BiasAdd's name: that time is charged to the convolution, and the BiasAdd to nothing.
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
from tag.cost.op_classes import cpu_fused_bias_adds
from tag.errors import GraphError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cost.matmul_table import MatmulTable
    from tag.ir.types import TrainingGraph

_STEP_STATS_RESOLUTION_S = 1e-6      # step stats count whole microseconds
_MIN_FIT_S = 20e-6                   # ops faster than this even at the roofline: fixed costs, not efficiency
_MAX_MATMUL_SCALE = 4.0              # in-graph MatMuls at most this much faster than the table's lone products
_MAX_BANDWIDTH_GAIN = 4.0            # in-step memory-bound ops at most this much faster (or slower) than streaming
_BANDWIDTH_ROUNDS = 10               # ``fitted_bandwidth``: at most this many refits of the memory-bound set


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
    wall_sustained_s: float | None = None   # median default-settings step over a long window (``sustain_s``)


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
    memory_bandwidth: float = 0.0   # bytes/s memory-bound ops reach in the step (fitted; 0: not fitted)


def fit_profile(graph: "TrainingGraph | Sequence[TrainingGraph]", m: "StepMeasurement | Sequence[StepMeasurement]",
                peak: float, bw: float, matmul_table: "MatmulTable | None" = None) -> Fit:
    """Per-op-type efficiencies and the launch overhead from a step measurement (see module docstring).

    GRAPH and M may be sequences (several calibration graphs measured on the same device): their ops are
    fitted together, and the launch overhead spreads the sum of their steps' unexplained time over all ops.
    Matches ``tag.cost.CostModel.op_times``: ops of ``tag.cost.ZERO_COST_TYPES`` cost nothing there,
    so their measured time is folded into the launch overhead of the others. With a MATMUL_TABLE, the MatMul
    ops whose shapes it covers take their efficiency from it in the step's roofline (as ``CostModel.op_times``
    does), times one scale fitted over them like an efficiency (``Fit.matmul_scale``: the table times lone
    products, a training step runs them among other ops); the per-type fits stay for the ops the table cannot
    place (MatMuls of unknown shapes, Einsums that are a batch of products) and are fitted over those ops
    where the type has any.
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
    for g, start in zip(graphs, np.cumsum([0, *(len(g.ops) for g in graphs[:-1])]), strict=True):
        if matmul_table is not None:
            dims = matmul_dims(g)
            tabled[start + dims.ops] = matmul_table.lookup(dims.variant, *dims.at(float(g.batch_size)))
        # a Conv2D merged with its BiasAdd (oneDNN, ``cpu_fused_bias_adds``) shows its kernel under the
        # BiasAdd's name: the time is the convolution's, the BiasAdd costs nothing (as CostModel.op_times has it)
        for bias, conv in cpu_fused_bias_adds(g).items():
            b, c = start + bias, start + conv
            if np.isnan(op_times[c]) and not np.isnan(op_times[b]):
                op_times[c], op_times[b] = op_times[b], np.nan
                costed[b] = False
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
    bw = fitted_bandwidth(flops, mem, busy, seen & costed, peak, bw, threshold)
    ideal = np.maximum(flops / peak, mem / bw)
    fitted = candidates & (ideal >= threshold)
    eff: dict[str, float] = {}
    for t in sorted(set(types[fitted])):
        sel = fitted & (types == t)
        # the per-type efficiency serves the ops the table cannot place: fitted over those where the type has
        # any (attention's Einsums, batches of small products, ran at 0.11-0.24 of peak on one core where a dense
        # layer's Einsum ran near 0.9: one efficiency fitted over both fits neither)
        if (sel & np.isnan(tabled)).any():
            sel &= np.isnan(tabled)
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
    return Fit(eff, float(launch), floor, float(scale), float(bw))


def fitted_bandwidth(flops: np.ndarray, mem: np.ndarray, busy: np.ndarray, usable: np.ndarray, peak: float,
                     stream_bw: float, threshold: float) -> float:
    """The bandwidth memory-bound ops reach inside a step (their tensors are often still in cache), not the
    streaming benchmark's STREAM_BW: ``sum(bytes) / sum(busy)`` over the USABLE ops that are memory-bound at
    that bandwidth and whose roofline there is at least THRESHOLD, within a factor ``_MAX_BANDWIDTH_GAIN`` of
    STREAM_BW. Which ops are memory-bound is decided at the fitted bandwidth itself (a fixed point, from the
    streaming one): decided at the streaming figure, one measurement of the calibration graphs fitted 34.7 GB/s
    with any streaming figure up to 24 GB/s and 55.5 GB/s from 30 GB/s up (Adam's updates, BiasAdd, Mean and
    Sub left the memory-bound set), and the streaming benchmark read 24-38 GB/s in six calibrations in a row
    on one machine, moving the fitted launch overhead between 1 and 17 us per op with it. The refits start
    at the top of the allowed range (the fewest ops memory-bound): where several sets are self-consistent,
    the same one is found whatever the streaming figure."""
    lo, hi = stream_bw / _MAX_BANDWIDTH_GAIN, stream_bw * _MAX_BANDWIDTH_GAIN
    bw = hi     # from the top: the fewest ops memory-bound first (where several sets are self-consistent, the highest)
    for _ in range(_BANDWIDTH_ROUNDS):
        membound = usable & (mem / bw > flops / peak) & (np.maximum(flops / peak, mem / bw) >= threshold)
        if not membound.any() or busy[membound].sum() <= 0:
            break
        new = float(np.clip(mem[membound].sum() / busy[membound].sum(), lo, hi))
        if abs(new - bw) <= 1e-9 * bw:
            break
        bw = new
    return bw


def fit_line(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(fixed seconds >= 0, bytes per second) of ``seconds = fixed + sizes / rate``."""
    slope, intercept = np.polyfit(sizes, np.maximum(seconds, 0.0), 1)
    return float(max(intercept, 0.0)), (1.0 / slope if slope > 0 else float("inf"))


# ------------------------------------------------------------------ runtime levels per op family
#: how the families may be tied together, most families first (``fit_levels`` takes the first that is sane)
LEVEL_GROUPINGS = (
    (("conv",), ("matmul",), ("other",)),
    (("conv",), ("matmul", "other")),
    (("matmul",), ("conv", "other")),
    (("conv", "matmul"), ("other",)),
    (("conv", "matmul", "other"),),
)


@dataclass
class LevelFit:
    """Per-family time scales and an added per-op overhead fitted to measured steps (``fit_levels``).

    ``scales``: family -> the factor its predicted (roofline) time is multiplied by (tied families share
    one); ``overhead_s``: seconds added to every charged op's launch overhead; ``groups``: the families
    fitted together; ``ratio``: modelled / measured per point; ``note``: why families were tied, if they were.
    """

    scales: dict[str, float]
    overhead_s: float
    groups: tuple[tuple[str, ...], ...]
    ratio: np.ndarray
    note: str = ""
    #: seconds over which the scales fade for long kernels (``fit_faded_level``); None: applied in full
    fade_s: float | None = None

    @property
    def max_error(self) -> float:
        """The largest relative error of the fit over its points (0.17 = 17%)."""
        return float(np.max(np.abs(self.ratio - 1.0))) if len(self.ratio) else 0.0

    def describe(self) -> str:
        scales = ", ".join(f"{'+'.join(g)} x{self.scales[g[0]]:.3f}" for g in self.groups)
        fade = f" fading over {self.fade_s * 1e3:.3g} ms" if self.fade_s is not None else ""
        return f"{scales}{fade} + {self.overhead_s * 1e6:.0f} us/op (fit within {self.max_error * 100:.0f}%)"


def nonnegative_l1(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The x >= 0 that minimises ``sum |design @ x - target|`` (a linear program: one slack per row)."""
    from scipy.optimize import linprog
    n, k = design.shape
    eye = np.eye(n)
    res = linprog(np.concatenate([np.zeros(k), np.ones(n)]),
                  A_ub=np.block([[design, -eye], [-design, -eye]]), b_ub=np.concatenate([target, -target]),
                  bounds=[(0, None)] * (k + n), method="highs")
    if not res.success:
        raise ValueError(f"fit_levels: the least-absolute-deviation fit failed ({res.message})")
    return np.asarray(res.x[:k])


LEVEL_HUBER_DELTA = 0.25  # ``fit_levels``: log-ratios beyond +-0.25 (about 28%) count linearly (see there)


def log_huber(ratio: np.ndarray, delta: float = LEVEL_HUBER_DELTA) -> float:
    """``sum huber_delta(log(ratio))``: each modelled / measured RATIO's log counts squared up to DELTA and
    linearly beyond (the loss of ``fit_levels`` and ``fit_faded_level``)."""
    r = np.log(np.maximum(ratio, 1e-9))
    return float(np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum())


def nonnegative_log_huber(design: np.ndarray, offset: np.ndarray, delta: float = LEVEL_HUBER_DELTA) -> np.ndarray:
    """The x >= 0 that minimises ``sum huber_delta(log(offset + design @ x))``: each point's modelled / measured
    ratio is ``offset + design @ x``; its log counts squared up to DELTA and linearly beyond (L-BFGS-B on columns
    scaled to unit norm, started from the least-absolute-deviation solution, which it never ends worse than)."""
    from scipy.optimize import minimize
    norms = np.linalg.norm(design, axis=0)
    norms = np.where(norms > 0, norms, 1.0)
    scaled = design / norms

    def loss(z: np.ndarray) -> tuple[float, np.ndarray]:
        ratio = np.maximum(offset + scaled @ z, 1e-9)
        r = np.log(ratio)
        small = np.abs(r) <= delta
        return log_huber(ratio, delta), scaled.T @ (np.where(small, r, delta * np.sign(r)) / ratio)

    start = nonnegative_l1(design, 1.0 - offset) * norms
    res = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=[(0, None)] * design.shape[1],
                   options={"maxiter": 1000, "ftol": 1e-15, "gtol": 1e-12})
    z = res.x if np.all(np.isfinite(res.x)) and res.fun <= loss(start)[0] else start
    return np.asarray(z) / norms


def fit_levels(parts: np.ndarray, fixed: np.ndarray, ops: np.ndarray, measured: np.ndarray,
               families: Sequence[str] = ("conv", "matmul", "other"), *,
               groupings: Sequence[tuple[tuple[str, ...], ...]] | None = None, min_share: float = 0.05,
               max_condition: float = 1e3, scale_range: tuple[float, float] = (0.1, 10.0),
               max_spread: float = 2.0) -> LevelFit:
    """Fit ``measured = fixed + sum_f a_f * parts[:, f] + c * ops`` with every ``a_f`` and ``c`` >= 0, by a
    Huber loss on each point's log(modelled / measured) (``nonnegative_log_huber``; squared within
    ``LEVEL_HUBER_DELTA`` = 0.25, linear beyond; each point counts alike).
    Why this loss: the calibration models disagree with each other by more than the noise (in bench_fidelity
    run 12 the MLP ran 1.10-1.70 of its prediction and the CNN 0.72-0.86 on the same host type). Least
    absolute deviations, used until then, fitted two of the six points exactly, so the level jumped between
    the models' levels from one calibration to the next (the full-core host x0.71 / 0.98 / 0.86 in run 12's three
    runs) and the benchmark models' one-host steps followed (median error 18 / 14 / 6%, all too fast). Refitted
    on the same points offline, the Huber fit put those steps at 7 / 7 / 3% (held-out part: 22 / 10 / 17% ->
    7 / 15 / 11%). Not least squares: one step that the model cannot explain must not drag the rest. In
    bench_fidelity run 8's calibration one step measured 0.40 of its prediction and five of six sat at
    0.74-1.09; least squares scaled the full-core host by 0.66 and every one-host step came out 15-36% too fast.

    One row per measured step: PARTS the predicted time of each of FAMILIES' ops (the part a family scale
    multiplies), FIXED the rest of the prediction (launch overheads, which no scale touches), OPS the ops that pay a
    launch overhead. Families are tied (one shared scale) when fitting them apart is not sane: a group whose
    predicted share is below MIN_SHARE in every point, a design matrix whose condition number (columns normalised)
    exceeds MAX_CONDITION, a scale outside SCALE_RANGE, or a scale more than MAX_SPREAD times above or below the
    one-scale fit's (a few noisy steps can make the groups trade time absurdly, e.g. one family x0.25 and another
    x2.3 where one scale is x0.83). GROUPINGS lists the ways to tie them, most families first (default
    ``LEVEL_GROUPINGS``: all apart, then each pair tied, then one scale); of the sane ones with the most groups, the
    smallest sum of absolute relative errors is kept. When none is sane, one scale for everything from the geometric
    mean of ``(measured - fixed) / sum(parts)`` (clipped to SCALE_RANGE), no added overhead."""
    parts = np.atleast_2d(np.asarray(parts, dtype=np.float64))
    fixed, ops, measured = (np.asarray(x, dtype=np.float64).ravel() for x in (fixed, ops, measured))
    families = tuple(families)
    n = len(measured)
    if parts.shape != (n, len(families)) or fixed.shape != (n,) or ops.shape != (n,):
        raise ValueError(f"fit_levels: parts must be (points, families) = ({n}, {len(families)}), "
                         f"fixed and ops one value per point")
    if n == 0 or np.any(measured <= 0) or np.any(parts < 0) or not np.all(np.isfinite(parts)):
        raise ValueError("fit_levels: needs at least one point, measured steps > 0 and parts >= 0")
    if groupings is None:
        groupings = [g for g in LEVEL_GROUPINGS if sorted(f for grp in g for f in grp) == sorted(families)]
        if not groupings:
            groupings = [(families,)]
    column = {f: i for i, f in enumerate(families)}
    predicted = fixed + parts.sum(axis=1)
    target = (measured - fixed) / measured
    use_ops = bool(np.any(ops > 0))
    lo, hi = scale_range

    def solve(grouping) -> tuple[np.ndarray | None, float, str]:
        """(coefficients, absolute error, why not sane) of one way of tying the families."""
        name = "/".join("+".join(g) for g in grouping)
        cols = np.stack([parts[:, [column[f] for f in grp]].sum(axis=1) for grp in grouping], axis=1)
        share = cols / predicted[:, None]
        light = [i for i in range(len(grouping)) if np.max(share[:, i]) < min_share]
        if light:
            return None, math.inf, f"{'+'.join(grouping[light[0]])} under {min_share:.0%} of every step"
        design = np.concatenate([cols, ops[:, None]], axis=1) if use_ops else cols
        design = design / measured[:, None]
        norms = np.linalg.norm(design, axis=0)
        cond = float(np.linalg.cond(design / norms)) if np.all(norms > 0) and n >= design.shape[1] else math.inf
        if cond > max_condition:
            return None, math.inf, f"{name} ill-conditioned ({cond:.0f})"
        x = nonnegative_log_huber(design, 1.0 - target)
        scales = x[:len(grouping)]
        worst = float(scales[np.argmax(np.abs(np.log(np.maximum(scales, 1e-12))))])
        if np.any(scales < lo) or np.any(scales > hi):
            return None, math.inf, f"{name} scale {worst:.2f}"
        return x, float(np.sum(np.abs(design @ x - target))), ""

    one, _, _ = solve((families,)) if len(groupings[0]) > 1 else (None, 0.0, "")
    best, reasons = None, []
    for grouping in groupings:
        if best is not None and len(grouping) < len(best[1]):
            break                                           # a sane fit with more groups was found
        x, err, why = solve(grouping)
        if x is not None and one is not None and len(grouping) > 1:
            ratio = x[:len(grouping)] / one[0]
            if np.any(ratio > max_spread) or np.any(ratio < 1.0 / max_spread):
                x, why = None, (f"{'/'.join('+'.join(g) for g in grouping)} scales "
                                f"{'/'.join(f'{v:.2f}' for v in x[:len(grouping)])} beyond {max_spread:g}x "
                                f"the one scale {one[0]:.2f}")
        if x is None:
            reasons.append(why)
        elif best is None or err < best[0]:
            best = (err, grouping, x)
    if best is None:
        total = parts.sum(axis=1)
        ok = total > 0
        ratio = np.maximum((measured - fixed)[ok], 1e-12) / total[ok] if ok.any() else np.ones(1)
        a = float(np.clip(np.exp(np.mean(np.log(ratio))), lo, hi))
        model = fixed + a * total
        return LevelFit({f: a for f in families}, 0.0, (families,), model / measured,
                        "no sane fit (" + "; ".join(reasons) + "): one scale, geometric mean")
    _, grouping, x = best
    scales = {f: float(x[i]) for i, grp in enumerate(grouping) for f in grp}
    c = float(x[len(grouping)]) if use_ops else 0.0
    model = fixed + parts @ np.array([scales[f] for f in families]) + c * ops
    note = "; ".join(reasons) if len(grouping) < len(groupings[0]) else ""
    return LevelFit(scales, c, tuple(grouping), model / measured, note)


#: ``fit_faded_level``'s candidate fade lengths (seconds of an op's roofline time); None: no fade
LEVEL_FADES_S: tuple[float | None, ...] = (None, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0003)


def faded_part(roofline: np.ndarray, fade_s: float | None) -> float:
    """The seconds of a step whose ops take ROOFLINE seconds each that a fading scale multiplies:
    ``sum(t * fade / (t + fade))`` (all of it without a fade). An op of ``t`` is charged
    ``t + (scale - 1) * t * fade / (t + fade)`` (``tag.cost.model``, ``level_fade_s``)."""
    t = np.asarray(roofline, dtype=np.float64)
    return float(t.sum() if fade_s is None else (t * fade_s / (t + fade_s)).sum())


def fit_faded_level(rooflines: Sequence[np.ndarray], fixed: np.ndarray, ops: np.ndarray, measured: np.ndarray,
                    families: Sequence[str] = ("conv", "matmul", "other"), *,
                    fades: Sequence[float | None] = LEVEL_FADES_S,
                    scale_range: tuple[float, float] = (0.1, 10.0)) -> LevelFit:
    """One time scale for every op that fades for long kernels, and an added per-op overhead, fitted to
    measured steps: ``measured = fixed + sum_ops(t + (a - 1) * t * fade / (t + fade)) + c * ops``.

    ROOFLINES: per point, the roofline seconds of every op the step runs (no scale, no launch overhead);
    FIXED, OPS, MEASURED as ``fit_levels``. For each candidate FADES length, ``a`` and ``c`` >= 0 are fitted
    by ``fit_levels``' Huber loss on the log-ratios (``nonnegative_log_huber``); the fade with the smallest
    loss is kept (ties: the earlier one, so no fade when a fade does not help). Why: the calibration models'
    steps ran 5-63% over their prediction on the testbed's runtime, the most at the smallest batch, while the
    benchmark models' kernels of tens of milliseconds ran within 8% of it (bench_pipeline runs 30-31): a
    scale applied in full extrapolates what short kernels lose to long ones. Fitted at calibration batches
    that span short and long kernels, the fade says how far the loss reaches."""
    fixed, ops, measured = (np.asarray(x, dtype=np.float64).ravel() for x in (fixed, ops, measured))
    n = len(measured)
    if len(rooflines) != n or fixed.shape != (n,) or ops.shape != (n,) or n == 0 or np.any(measured <= 0):
        raise ValueError("fit_faded_level: needs one roofline array, fixed time, op count and measured step > 0 "
                         "per point")
    total = np.array([float(np.sum(t)) for t in rooflines])
    use_ops = bool(np.any(ops > 0))
    lo, hi = scale_range
    best = None
    for fade in fades:
        part = np.array([faded_part(t, fade) for t in rooflines])
        offset = (fixed + total - part) / measured
        design = np.stack([part, ops], axis=1) if use_ops else part[:, None]
        design = design / measured[:, None]
        x = nonnegative_log_huber(design, offset)
        if not lo <= x[0] <= hi:
            continue
        ratio = offset + design @ x
        loss = log_huber(ratio)
        if best is None or loss < best[0] - 1e-12:
            best = (loss, fade, x, ratio)
    if best is None:
        raise ValueError(f"fit_faded_level: no fade gives a scale within {lo:g}-{hi:g}")
    _, fade, x, ratio = best
    families = tuple(families)
    return LevelFit({f: float(x[0]) for f in families}, float(x[1]) if use_ops else 0.0, (families,), ratio,
                    fade_s=fade)
