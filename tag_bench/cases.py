"""The heterogeneous testbed that bench_e2e and bench_fidelity measure on, built from one recipe file.

``testbed_recipe.json`` (beside this file) fixes the calibration (model, batch, steps) and the testbed
configurations: per host a CPU quota (cores, CFS) and per host pair a link bandwidth. The topology's
device speeds are *profiled*, not declared, each inside a cgroup of its quota and pinned to one core:
``tag-profile --sustained`` traces the calibration models on the largest quota, and ``tag-profile --like``
times every quota in a few rounds; each quota is the traced profile scaled by its median share
of the largest quota's sustained step (kernels cannot be traced under a quota: the fastest run between
throttled slices). The profile holds one
device type per quota (``CPUq50`` = half a core). Network costs of TensorFlow's runtime come from
``tag.calibration.profile_network`` (two local one-thread workers).

Usage::

    from tag_bench.cases import load_recipe, calibrate_testbed, testbed_topology
    recipe = load_recipe()
    profile = calibrate_testbed(recipe, workdir)                 # every quota of every configuration
    text, topo = testbed_topology(recipe, "A", profile)          # .pbtxt text and the parsed Topology
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tag.cost.model import Profile

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_recipe.json")
HOST_PAIRS = (("h0", "h1"), ("h0", "h2"), ("h1", "h2"))   # order of a configuration's links_gbps


def load_recipe(path: str = RECIPE) -> dict:
    with open(path) as f:
        return json.load(f)


def heldout(recipe: dict) -> tuple[list[str], list[str]]:
    """(configurations, model specs) of the recipe's frozen held-out part (``"heldout"``): measured by
    bench_fidelity and reported apart, never used to choose or tune anything."""
    part = recipe.get("heldout") or {}
    return list(part.get("configs", [])), list(part.get("models", []))


def main_configs(recipe: dict) -> list[str]:
    """The recipe's configurations that are not held out (what other benchmarks run by default)."""
    return [c for c in recipe["configs"] if c not in heldout(recipe)[0]]


def device_type(quota: float) -> str:
    """The topology's device type for a host of QUOTA cores (``CPUq25`` = a quarter of a core)."""
    return f"CPUq{int(round(quota * 100))}"


def all_quotas(recipe: dict, configs=None) -> list[float]:
    names = configs or list(recipe["configs"])
    return sorted({float(q) for n in names for q in recipe["configs"][n]["quotas"]}, reverse=True)


def calibration_graph(spec: str, batch: int):
    """The training GraphDef of a recipe model SPEC: ``mwms:NAME[,width=W][,depth=D][,vocab=V]``
    (``tag_bench.mwms.tf1_graph``) or a ``tag.zoo`` spec."""
    if spec.startswith("mwms:"):
        from tag_bench.mwms import tf1_graph
        name, *opts = spec[len("mwms:"):].split(",")
        knobs = {k: int(v) for k, v in (o.split("=", 1) for o in opts)}
        unknown = set(knobs) - {"width", "depth", "vocab"}
        if unknown:
            raise ValueError(f"model spec {spec!r}: unknown option(s) {', '.join(sorted(unknown))} "
                             f"(known: width, depth, vocab)")
        return tf1_graph(name, batch, **knobs)
    from tag import zoo
    return zoo.resolve_model(spec, batch)[1]


def saved_testbed(prefix: str, config: str, run: int = 1):
    """(Profile, Topology) that bench_fidelity saved for configuration CONFIG of run RUN beside its JSON (PREFIX:
    the ``--json`` path without ``.json``): ``PREFIX.runN.testbed-C.profile.json`` and ``.pbtxt``."""
    from tag.cluster.topology import parse_topology
    from tag.cost.model import Profile
    stem = f"{prefix}.run{run}.testbed-{config}"
    with open(f"{stem}.pbtxt") as f:
        topology = parse_topology(f.read())
    return Profile.load(f"{stem}.profile.json"), topology


def split_steps(total: int, rounds: int) -> list[int]:
    """TOTAL steps over ROUNDS rounds, as evenly as they go (the first rounds take the remainder)."""
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


def steps_for(predicted_s: float, budget_s: float) -> tuple[int, int]:
    """(timed steps, warm-up steps) of a case predicted at PREDICTED_S given BUDGET_S of timed steps: 5-40
    timed (more when steps are short, so that a 10 ms step's median is not a handful of samples), 2-3 warm-up."""
    return int(min(max(round(budget_s / max(predicted_s, 1e-3)), 5), 40)), 2 if predicted_s > 1.0 else 3


def measure_on_testbed(tb, runnable, predicted_s: float, budget_s: float) -> float:
    """Median step of RUNNABLE (a ``tag.rewrite`` result) on the running testbed TB, as many steps as
    ``steps_for`` gives."""
    import numpy as np

    from tag.backend.runtime.measure import run_on
    timed, warmup = steps_for(predicted_s, budget_s)
    r = run_on(tb, runnable, steps=warmup + timed, warmup=warmup)
    return float(np.median(r.step_times[warmup:]))


class _StopBackground(Exception):
    """Raised from a background run's progress callback to end its session."""


class BackgroundSteps:
    """Context manager: GRAPH_DEF's training step run without pause on TARGET in a thread (``run_steps``,
    synthetic inputs, one session) from ``__enter__`` (after its first step) until ``__exit__``; ``steps``
    counts the steps it ran. Keeps hosts busy while another host is timed (``runtime_levels(under_load=True)``,
    ``bench_transfers`` ``contention``)."""

    def __init__(self, graph_def, target: str, *, train_op: str = "train_op", loss: str | None = "loss",
                 init: str | None = "init", timeout_s: float = 120.0):
        import threading
        self.graph_def, self.target, self.timeout_s = graph_def, target, timeout_s
        self.names = {"train_op": train_op, "loss": loss, "init": init}
        self.stop, self.ready, self.steps, self.error = threading.Event(), threading.Event(), 0, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _progress(self, event) -> None:
        if event.kind == "step":
            self.steps = event.step
            self.ready.set()
            if self.stop.is_set():
                raise _StopBackground()

    def _run(self) -> None:
        from tag.backend.runtime import run_steps
        from tag.backend.runtime.guard import RunControl
        ctl = RunControl(progress=self._progress, step_timeout_s=self.timeout_s, setup_timeout_s=self.timeout_s)
        try:
            run_steps(self.graph_def, self.target, steps=10 ** 9, warmup=0, synthetic=True, control=ctl,
                      **self.names)
        except _StopBackground:
            pass
        except Exception as err:  # noqa: BLE001 - reported by __exit__, never lost in the thread
            self.error = err
        finally:
            self.ready.set()

    def __enter__(self) -> "BackgroundSteps":
        self.thread.start()
        if not self.ready.wait(self.timeout_s):
            self.stop.set()
            raise RuntimeError(f"background steps on {self.target}: no step within {self.timeout_s:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(self.timeout_s)
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"background steps failed: {self.error}") from self.error


INTERLEAVED_ROUNDS = 3     # rounds of measure_interleaved


def measure_interleaved(tb, cases: dict, budget_s: float, rounds: int = INTERLEAVED_ROUNDS) -> dict:
    """{key: median step} of every CASES value (key -> (runnable, predicted seconds); runnable a ``tag.rewrite``
    result or a Plan) on the running testbed TB, timed side by side: ROUNDS rounds that run every case in turn
    (the order reversed every other round), each case's timed steps (as many as ``measure_on_testbed`` takes,
    5-40) spread over the rounds, 2-3 warm-up steps before its first round and 1 before each later one (a new
    session's first step). Why: on this shared machine one program timed a few minutes apart measured 58 and
    50 ms (bench_fidelity run 5, B/cnn), more than the gaps between the cases being ranked; interleaving puts
    the drift on every case alike."""
    import numpy as np

    from tag.backend.runtime.measure import run_on
    samples: dict = {k: [] for k in cases}
    keys = list(cases)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            runnable, predicted_s = cases[k]
            timed, first_warmup = steps_for(predicted_s, budget_s)
            timed = max(timed, rounds)
            share = split_steps(timed, rounds)[r]
            warmup = first_warmup if r == 0 else 1
            res = run_on(tb, runnable, steps=warmup + share, warmup=warmup)
            samples[k] += list(res.step_times[warmup:])
    return {k: float(np.median(v)) for k, v in samples.items()}


def levelled(entry, scales: dict, overhead_s: float, fade_s: float | None = None):
    """ENTRY (a DeviceProfile) with each family's scale multiplied by SCALES[family] and OVERHEAD_S added to its
    launch overhead: a runtime_levels fit applied. FADE_S (seconds): the scales fade for longer kernels
    (``DeviceProfile.level_fade_s``); None keeps ENTRY's."""
    import dataclasses
    return dataclasses.replace(
        entry, family_scale={**entry.family_scale,
                             **{f: entry.family_scale.get(f, 1.0) * s for f, s in scales.items()}},
        launch_overhead_s=(entry.launch_overhead_s or 0.0) + overhead_s,
        level_fade_s=entry.level_fade_s if fade_s is None else fade_s)


def one_host_split(analysis, profile, batch: int, devices) -> list[tuple[float, float, list[float]]]:
    """(predicted step, ops, per-family parts) of ANALYSIS's graph run whole on each of DEVICES, costed with
    PROFILE. ``parts[f]``: the seconds of the step that family f's scale multiplies (``FAMILIES`` order), found
    by doubling that scale; ``ops``: the ops that pay a launch overhead, found by adding a probe overhead. The
    rest of the step (launch overheads, the runtime's step overhead) is ``predicted - sum(parts)``."""
    import dataclasses

    from tag.cost.model import CostModel, Profile
    from tag.cost.op_classes import FAMILIES
    from tag.sim import Simulator
    from tag.strategy.baselines import on_one_device
    probe = 1e-4                                        # extra launch overhead that counts the charged ops

    def changed(change) -> Profile:
        return Profile({t: change(d) for t, d in profile.devices.items()}, network=profile.network)

    probes = {"ops": changed(lambda d: dataclasses.replace(d, launch_overhead_s=(d.launch_overhead_s or 0.0) + probe)),
              **{f: changed(lambda d, f=f: dataclasses.replace(
                  d, family_scale={**d.family_scale, f: 2.0 * d.family_scale.get(f, 1.0)})) for f in FAMILIES}}
    # the same analysis costed with each probe (graph analysis is the expensive part)
    sims = {k: Simulator(analysis.graph, analysis.topology, analysis.grouping,
                         CostModel(analysis.graph, analysis.topology, p)) for k, p in probes.items()}
    base = Simulator(analysis.graph, analysis.topology, analysis.grouping,
                     CostModel(analysis.graph, analysis.topology, profile))
    out = []
    for device in devices:
        whole = on_one_device(analysis.grouping, analysis.topology, len(analysis.graph.ops), device)
        predicted = base.evaluate(whole, batch_size=batch).step_time
        ops = (sims["ops"].evaluate(whole, batch_size=batch).step_time - predicted) / probe
        out.append((predicted, ops, [sims[f].evaluate(whole, batch_size=batch).step_time - predicted
                                     for f in FAMILIES]))
    return out


def one_host_rooflines(analysis, profile, batch: int, devices) -> list:
    """Per device of DEVICES: the roofline seconds of every op of ANALYSIS's graph run whole on it (PROFILE's
    efficiencies, no family scale, no launch overhead), the times ``tag.cost.fitting.fit_faded_level`` fades
    by length. Their sum is ``sum(one_host_split(...)[i][2])`` when PROFILE has no family scales."""
    import dataclasses

    import numpy as np

    from tag.cost.model import CostModel, Profile
    bare = Profile({t: dataclasses.replace(d, family_scale={}, launch_overhead_s=0.0, level_fade_s=None)
                    for t, d in profile.devices.items()}, network=profile.network)
    model = CostModel(analysis.graph, analysis.topology, bare)
    return [np.array(model.op_times(analysis.topology.devices[d].group, batch)) for d in devices]


UNDER_LOAD_ROUNDS = 2      # runtime_levels(under_load=True): alone / loaded pairs per calibration step


def paired_load_ratio(alone: list[float], loaded: list[float]) -> float:
    """How much slower a step ran with the other hosts busy: the median of LOADED[i] / ALONE[i], each pair timed
    one right after the other (``runtime_levels``). Why paired: timed once each, alone first, the
    calibration CNN's steps came out 0.85x alone's under load in bench_fidelity run 14's calibration (and
    0.81-0.91 against 0.81-0.84 of their prediction in runs 13-14), where alternating three pairs on A's
    full-core host (ad hoc, after run 15) measured it 1.05-1.07x slower, the benchmark CNN 1.10-1.16x, the
    calibration MLP 1.13-1.32x and the transformer 1.01-1.31x."""
    import numpy as np
    return float(np.median(np.asarray(loaded, dtype=float) / np.asarray(alone, dtype=float)))


def runtime_levels(tb, recipe: dict, profile, budget_s: float = 2.0, verbose: bool = True,
                   record: dict | None = None, per_family: bool | None = None, under_load: bool | None = None,
                   fade: bool | None = None):
    """PROFILE with every device type of the running testbed TB at the speed tag's runtime gets from it.

    Each calibration model runs whole on the first host of each device type, through tag's runtime (a TF
    server per host, a client session: the path every measured case takes), at the calibration batch, at
    a quarter of it (``runtime_levels_batch_fraction``) and, when the recipe's ``runtime_levels_large_factor``
    is set, at that multiple of it (``levels_batches``). Each predicted step is split into the parts a family
    scale multiplies (``tag.cost.op_classes.FAMILIES``: convolutions, MatMuls, the rest; each part found by
    doubling that family's scale) and the launch overheads of its ``ops``. Per device type, the measured steps
    are fitted as ``overheads + sum_f a_f * part_f + c * ops`` (``tag.cost.fitting.fit_levels``: a Huber loss
    on the log-ratios over every batch of every model, non-negative, families tied where apart they are not sane):
    each family's scale in the entry is multiplied by its ``a_f`` and ``c`` is added to its launch overhead.
    The one-scale fit (every family tied) is printed beside it.
    Why per family: on the servers the same one-host steps ran 8-19% slower than in the profiling processes
    (their own session, pinned to one core), but not every family alike: one scale left the calibration CNN
    at 0.67-0.79 of its prediction and the MLP at 1.15-1.21 on the same device type (e.g. ``CPUq100 x0.854 +
    13 us/op, fit within 17%``). On configuration A (``scripts/bench_levels.py``, four runs at load 0.7-5) one
    scale fitted the calibration steps within 27-50% per device type, per family within 12-39%, the
    convolutions' scale at 0.41-0.68 in every run. Why the overhead: a quarter of the batch took 0.25-0.50 of
    the whole batch's step where the traced profile predicted 0.26-0.44 (scripts/bench_transfers.py,
    ``batch_share``): the executor's cost per op, which a replica's share of the batch and every micro-batch
    of a pipeline pay again in full. RECORD (a dict), when given, receives per device type the points and both
    fits as plain data. PER_FAMILY: apply the per-family fit (True) or the one-scale fit (False); None: the
    recipe's ``calibration.levels_per_family`` (default True). Both are fitted and printed either way. The
    recipe sets it False for now: on the benchmark models' one-host steps, out of sample, the per-family fit
    cut the largest error in three of four runs and the median in two, and raised both in the quiet run
    (``scripts/bench_levels.py``; README). UNDER_LOAD: also time each step while every other group of the
    testbed runs its own copy of the same model without pause (``BackgroundSteps``): ``UNDER_LOAD_ROUNDS``
    pairs, alone then loaded, each timed for BUDGET_S / rounds; the alone point is their alone steps' median,
    the loaded point that times ``paired_load_ratio``. Fit those points the same way, and return them as the
    profile's ``devices_under_load`` (each scale and overhead at least the alone fit's), which the simulator
    applies to steps that keep other hosts busy (``tag.sim.simulator``, "Hosts that share one machine");
    RECORD's key ``under_load`` holds their points and fits. None: the recipe's
    ``calibration.levels_under_load`` (default False; the shipped recipe sets it True). Why: the testbed's
    hosts share one machine, and a host's kernels ran up to 1.9x slower while the others computed
    (``bench_transfers.py --only contention``), so levels measured alone cost multi-host plans too fast.
    FADE: apply the one-scale fit as a scale that fades for long kernels (``tag.cost.fitting.fit_faded_level``:
    the fade length fitted on the alone points, the loaded points fitted at the same length), in place of the
    one-scale fit; None: the recipe's ``calibration.levels_fade`` (default False; the shipped recipe sets it
    True). Ignored with PER_FAMILY. Why: one scale fitted on the calibration models (x1.21-1.29 in
    bench_pipeline runs 30-31) charged the benchmark models' one-host steps 21-38% too much, where the profile
    without it was within 8% of them: the calibration models' short kernels lose more to the runtime."""
    from contextlib import ExitStack

    import numpy as np

    from tag.api import prepare
    from tag.cost.model import Profile
    from tag.strategy.baselines import on_one_device
    batches = levels_batches(recipe)
    if per_family is None:
        per_family = bool(recipe["calibration"].get("levels_per_family", True))
    if fade is None:
        fade = bool(recipe["calibration"].get("levels_fade", False))
    if under_load is None:
        under_load = bool(recipe["calibration"].get("levels_under_load", False))
    first_group = first_group_per_type(tb.topology)
    # device type -> (predicted, ops, per-family parts, measured, per-op rooflines) per calibration step;
    # alone and under load
    points: dict[str, list[tuple]] = {t: [] for t in first_group}
    loaded_points: dict[str, list[tuple]] = {t: [] for t in first_group}
    load_ratios: dict[str, list[float]] = {t: [] for t in first_group}     # loaded / alone per step, paired
    for spec in recipe["calibration"]["models"]:
        for b in batches:
            analysis = prepare(calibration_graph(spec, b), tb.topology, batch_size=b, profile=profile,
                               name="calibration")
            firsts = [g.devices[0] for g in first_group.values()]
            splits = one_host_split(analysis, profile, b, firsts)
            rooflines = one_host_rooflines(analysis, profile, b, firsts)
            whole = {g.name: analysis.rewrite(on_one_device(analysis.grouping, analysis.topology,
                                                            len(analysis.graph.ops), g.devices[0]))
                     for g in (tb.topology.groups if under_load else first_group.values())}
            for (dtype, group), (predicted, ops, parts), roof in zip(first_group.items(), splits, rooflines,
                                                                     strict=True):
                if not under_load:
                    measured = measure_on_testbed(tb, whole[group.name], predicted, budget_s)
                    points[dtype].append((predicted, ops, parts, measured, roof))
                    continue
                alone, loaded = [], []
                for _ in range(UNDER_LOAD_ROUNDS):      # alone and loaded in turn: the drift falls on both
                    alone.append(measure_on_testbed(tb, whole[group.name], predicted, budget_s / UNDER_LOAD_ROUNDS))
                    with ExitStack() as busy:
                        for name, other in whole.items():
                            if name != group.name:
                                busy.enter_context(BackgroundSteps(other.graph_def, tb.target,
                                                                   train_op=other.train_op, loss=other.loss,
                                                                   init=other.init))
                        loaded.append(measure_on_testbed(tb, whole[group.name], predicted,
                                                         budget_s / UNDER_LOAD_ROUNDS))
                measured, ratio = float(np.median(alone)), paired_load_ratio(alone, loaded)
                points[dtype].append((predicted, ops, parts, measured, roof))
                loaded_points[dtype].append((predicted, ops, parts, measured * ratio, roof))
                load_ratios[dtype].append(ratio)
    devices, loaded_devices, notes = fit_alone_and_loaded(points, loaded_points, profile.devices, per_family, record,
                                                          fade=fade and not per_family)
    text = ", ".join(notes)
    applied = "per family" if per_family else "one fading scale" if fade else "one scale"
    if under_load:
        notes += [f"{t} loaded / alone per step (paired, {UNDER_LOAD_ROUNDS} rounds): "
                  + "/".join(f"{x:.2f}" for x in r) for t, r in load_ratios.items()]
    if verbose:
        print(f"runtime levels (batches {' and '.join(str(b) for b in batches)}; applied: {applied}):"
              f"\n  " + "\n  ".join(notes), flush=True)
    network = sync_on_testbed(tb, profile, record, verbose)
    return Profile(devices, source=f"{profile.source}; runtime levels on the testbed "
                                   f"({applied} applied): {text}",
                   network=network, devices_under_load=loaded_devices)


def sync_on_testbed(tb, profile, record: dict | None = None, verbose: bool = True):
    """PROFILE's network costs with ``sync_serial_allreduce`` / ``sync_serial_ps`` measured on the running testbed
    TB (``tag.calibration.measure_sync_serial`` over one device per host, chains sized by each device type's
    calibrated FLOP/s): how much a gradient all-reduce or push and the hosts' compute lose to each other there.
    RECORD's key ``sync_serial`` receives the rows. Unchanged when PROFILE has no network costs or TB one host."""
    import dataclasses

    from tag.calibration import measure_sync_serial
    topo = tb.topology
    if profile.network is None or len(topo.hosts) < 2:
        return profile.network
    firsts = [next(d for d in topo.devices if d.host_index == h) for h in range(len(topo.hosts))]
    serial_ar, serial_ps, rows = measure_sync_serial(tb.target, [topo.tf_device(d.index) for d in firsts],
                                                     [d.peak_flops for d in firsts])
    if record is not None:
        record["sync_serial"] = rows
    if verbose:
        print("synchronisation beside compute (256 KB to 4 MB over every host): " + ", ".join(
            f"{r['kind']} {r['bytes'] >> 10} KB overlap {r['overlap']:+.2f}" for r in rows)
              + f"\n  -> fractions that do not overlap: all-reduce {serial_ar:.2f}, ps {serial_ps:.2f}", flush=True)
    return dataclasses.replace(profile.network, sync_serial_allreduce=serial_ar, sync_serial_ps=serial_ps)


def levels_batches(recipe: dict) -> tuple[int, ...]:
    """The batches ``runtime_levels`` times each calibration model at: the recipe's calibration batch,
    ``runtime_levels_batch_fraction`` (default a quarter) of it and, if the recipe sets
    ``runtime_levels_large_factor``, that multiple of it (longer kernels, for the fade of the levels)."""
    cal = recipe["calibration"]
    batch = int(cal["batch"])
    out = (batch, max(1, int(round(batch * float(cal.get("runtime_levels_batch_fraction", 0.25))))))
    if cal.get("runtime_levels_large_factor"):
        out += (max(1, int(round(batch * float(cal["runtime_levels_large_factor"])))),)
    return out


def first_group_per_type(topology) -> dict:
    """{device type: its first device group} of TOPOLOGY (one host per type on the testbed)."""
    first = {}
    for group in topology.groups:
        first.setdefault(group.device_type, group)
    return first


def fit_alone_and_loaded(points: dict, loaded_points: dict, base: dict, per_family: bool,
                         record: dict | None = None, fade: bool = False) -> tuple[dict, dict, list[str]]:
    """(devices, devices under load, printed notes): BASE's entries levelled by the alone POINTS, and by
    LOADED_POINTS where a type has any (``runtime_levels``), each loaded scale and overhead raised to at least
    the alone fit's: another host's work can only take this one's cores, caches and bandwidth. FADE: apply
    one scale that fades for long kernels (points need their per-op rooflines), the loaded fit at the alone
    fit's fade length."""
    devices, loaded = dict(base), {}
    fades: dict | None = {} if fade else None
    notes = _fit_levels_per_type(points, base, devices, per_family, record, "alone", fades)
    under = {t: p for t, p in loaded_points.items() if p}
    if under:
        notes += _fit_levels_per_type(under, base, loaded, per_family,
                                      None if record is None else record.setdefault("under_load", {}), "under load",
                                      fades, refit_fade=False)
        loaded = {t: _no_faster(e, devices[t]) for t, e in loaded.items()}
    return devices, loaded, notes


def _fit_levels_per_type(points: dict, base: dict, out: dict, per_family: bool, record: dict | None,
                         label: str, fades: dict | None = None, refit_fade: bool = True) -> list[str]:
    """Fit ``runtime_levels``' POINTS per device type, put each BASE entry levelled into OUT (the per-family or
    one-scale fit, by PER_FAMILY, or with FADES a dict the one fading scale of ``fit_faded_level``), its points
    and fits into RECORD; the printed note per type. With FADES and REFIT_FADE, each type's fade length is
    fitted and put into FADES; without REFIT_FADE, FADES' length for the type is used."""
    import numpy as np

    from tag.cost.fitting import fit_faded_level, fit_levels
    from tag.cost.op_classes import FAMILIES
    notes = []
    for dtype, pts in points.items():
        p_ = np.array([x[0] for x in pts])
        n_ = np.array([x[1] for x in pts])
        parts_ = np.array([x[2] for x in pts])
        m_ = np.array([x[3] for x in pts])
        fixed_ = p_ - parts_.sum(axis=1)
        one = fit_levels(parts_, fixed_, n_, m_, FAMILIES, groupings=[(tuple(FAMILIES),)])
        fit = fit_levels(parts_, fixed_, n_, m_, FAMILIES)
        faded = None
        if fades is not None and not per_family:
            rooflines = [x[4] for x in pts]
            faded = (fit_faded_level(rooflines, fixed_, n_, m_, FAMILIES) if refit_fade else
                     fit_faded_level(rooflines, fixed_, n_, m_, FAMILIES, fades=(fades.get(dtype),)))
            fades[dtype] = faded.fade_s
        applied = fit if per_family else faded or one
        out[dtype] = levelled(base[dtype], applied.scales, applied.overhead_s, applied.fade_s)
        if record is not None:
            record[dtype] = {"predicted_s": p_.tolist(), "ops": n_.tolist(), "parts_s": parts_.tolist(),
                             "measured_s": m_.tolist(), "families": list(FAMILIES),
                             **{k: {"scales": f.scales, "overhead_s": f.overhead_s,
                                    "groups": [list(g) for g in f.groups], "ratio": f.ratio.tolist(),
                                    "max_error": f.max_error, "note": f.note}
                                for k, f in (("per_family", fit), ("one_scale", one))}}
            if faded is not None:
                record[dtype]["faded"] = {"scale": faded.scales[FAMILIES[0]], "fade_s": faded.fade_s,
                                          "overhead_s": faded.overhead_s, "ratio": faded.ratio.tolist(),
                                          "max_error": faded.max_error}
        shares = "/".join(":".join(f"{100 * x / p:.0f}" for x in row) for row, p in zip(parts_, p_, strict=True))
        fading = (f"one fading scale: {faded.describe()}, residuals "
                  f"{'/'.join(f'{x - 1:+.2f}' for x in faded.ratio)}; " if faded is not None else "")
        notes.append(f"{dtype} ({label}) {fading}{fit.describe()}{f' [{fit.note}]' if fit.note else ''}; one scale: "
                     f"{one.describe()}; measured/predicted {'/'.join(f'{x:.2f}' for x in m_ / p_)}; residuals per "
                     f"family {'/'.join(f'{x - 1:+.2f}' for x in fit.ratio)}, one scale "
                     f"{'/'.join(f'{x - 1:+.2f}' for x in one.ratio)}; conv:matmul:other % of predicted {shares}")
    return notes


def _no_faster(loaded, alone):
    """LOADED (a DeviceProfile) with each family scale and the launch overhead at least ALONE's."""
    import dataclasses

    from tag.cost.op_classes import FAMILIES
    return dataclasses.replace(
        loaded, family_scale={f: max(loaded.family_scale.get(f, 1.0), alone.family_scale.get(f, 1.0))
                              for f in FAMILIES},
        launch_overhead_s=max(loaded.launch_overhead_s or 0.0, alone.launch_overhead_s or 0.0))


def model_file(spec: str, batch: int, workdir: str) -> str:
    """A ``tag-profile --model`` argument for SPEC: zoo specs as they are; ``mwms:NAME[,width=W]`` written as a
    GraphDef file (``tag_bench.mwms.tf1_graph``) into WORKDIR."""
    if not spec.startswith("mwms:"):
        return spec
    path = os.path.join(workdir, spec[len("mwms:"):].replace(",", "-").replace("=", "") + ".pb")
    with open(path, "wb") as f:
        f.write(calibration_graph(spec, batch).SerializeToString())
    return path


def rounds_disagree(shares: dict, limit: float) -> bool:
    """Whether any quota's share rounds (SHARES: quota index -> shares) spread by more than LIMIT of their median:
    (largest - smallest) / median."""
    import numpy as np
    return any(len(v) > 1 and (max(v) - min(v)) > limit * float(np.median(v)) for v in shares.values())


def profile_command(cal: dict, how: list[str], device_type_name: str, out: str) -> list[str]:
    """The ``tag-profile`` command of one calibration run, pinned to core 0 (CAL: the recipe's calibration, which
    sets the batch and the sustained window; HOW: what to profile, e.g. ``traced_args``), writing OUT."""
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    return pin + [sys.executable, "-m", "tag.cli.profile", "--batch-size", str(cal["batch"]), "--sustained",
                  str(cal["sustained_s"]), *how, "--device-type", device_type_name, "--json", out]


def traced_args(cal: dict, models: list[str]) -> list[str]:
    """``tag-profile`` options that trace the calibration MODELS (files) as the largest quota's profile is taken."""
    return ["--model", *models, "--steps", str(cal["traced_steps"]),
            *(["--matmul-table"] if cal.get("matmul_table") else [])]


def calibrate_testbed(recipe: dict, workdir: str, configs=None, verbose: bool = True):
    """A Profile with one device type per quota and the runtime's network costs.

    The largest quota is traced (``tag-profile --sustained``, inside its cgroup, pinned to core 0 as every
    calibration process is). Every quota, the largest included, is then timed ``share_rounds`` times in
    turn with ``tag-profile --like`` against that profile; each quota's profile is the traced one scaled by the
    median of its rounds (the largest quota's too: its rounds, not the traced run, set the level). One
    sustained window per quota moved the quarter-core host's share between 0.19 and 0.27 on this shared
    machine: the load drifts between windows, and timing every quota in each round, the reference included,
    spreads the drift over all. While some quota's rounds still disagree by more than ``share_spread`` of their
    median (``rounds_disagree``), more rounds run, up to ``share_rounds_max`` in all: bench_pipeline run 26's two
    rounds put the full core at 0.93 and 1.26 of its traced step, and the median of two is their mean."""
    import numpy as np

    from tag.calibration import profile_network
    from tag.cluster.topology import parse_topology
    from tag.cost.model import Profile
    from tag_bench.testbed import Testbed
    cal = recipe["calibration"]
    quotas = all_quotas(recipe, configs)
    rounds = int(cal.get("share_rounds", 2))
    max_rounds = max(rounds, int(cal.get("share_rounds_max", rounds)))
    spread_limit = float(cal.get("share_spread", math.inf))
    hosts = "\n".join(f'host {{ name: "cal{i}" address: "127.0.0.1" port: {25461 + i} device {{ type: "CPU" '
                      f'kind: CPU count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}'
                      for i in range(len(quotas)))
    topo = parse_topology(hosts + "\nfabric { bandwidth_gbps: 10 latency_us: 10 }\n", path="<calibration>")
    models = [model_file(spec, cal["batch"], workdir) for spec in cal["models"]]

    def profile(i: int, how: list, out: str) -> Profile:
        cmd = tb.launch_prefix(i) + profile_command(cal, how, device_type(quotas[i]), out)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return Profile.load(out)

    # the quotas are timed one at a time, each profiler pinned by taskset: the testbed need not pack them
    with Testbed(topo, shape_links=False, cpu_quota=quotas, cpu_pinning="off") as tb:
        base_path = os.path.join(workdir, f"profile-{device_type(quotas[0])}.json")
        base = profile(0, traced_args(cal, models), base_path)
        ref = base.devices[device_type(quotas[0])]
        shares: dict[int, list[float]] = {i: [] for i in range(len(quotas))}
        r = 0
        while r < rounds or (r < max_rounds and rounds_disagree(shares, spread_limit)):
            order = range(len(quotas)) if r % 2 == 0 else reversed(range(len(quotas)))
            for i in order:
                like = profile(i, ["--model", models[0], "--like", base_path],
                               os.path.join(workdir, f"like-{device_type(quotas[i])}-{r}.json"))
                shares[i].append(like.devices[device_type(quotas[i])].peak_flops / ref.peak_flops)
            r += 1
    # every quota, the full one included, at the speed it sustained in the rounds: the largest quota's rounds
    # ran at 0.89-1.02 of the traced run's own sustained step in eight calibrations, and the hosts run like the rounds
    devices = {device_type(q): ref.scaled(float(np.median(shares[i]))) for i, q in enumerate(quotas)}
    profile_out = Profile(devices, network=profile_network(steps=int(cal["network_steps"])))
    rounds_text = "; ".join(f"{device_type(q)} {', '.join(f'{x:.3f}' for x in shares[i])}"
                            for i, q in enumerate(quotas))
    profile_out.source = (f"testbed calibration ({', '.join(cal['models'])} at batch {cal['batch']}; one device "
                          f"type per quota; shares of {device_type(quotas[0])}'s sustained step in {len(shares[0])} "
                          f"rounds: {rounds_text})")
    if verbose:
        n = profile_out.network
        parts = [f"{t} {d.peak_flops / 1e9:.1f} GFLOP/s" for t, d in sorted(devices.items(), reverse=True)]
        print(f"calibration: {', '.join(parts)} (share rounds: {rounds_text}); runtime step overhead "
              f"{n.step_overhead_s * 1e3:.2f} ms, transfer latency {n.transfer_latency_s * 1e6:.0f} us", flush=True)
    return profile_out


def testbed_topology(recipe: dict, name: str, profile):
    """(pbtxt text, Topology) of configuration NAME: one one-CPU host per quota, links as the recipe says;
    each device's peak FLOP/s and memory bandwidth are its quota's profiled ones."""
    from tag.cluster.topology import parse_topology
    cfg = recipe["configs"][name]
    lines = [f'name: "testbed-{name}"']
    for i, q in enumerate(cfg["quotas"]):
        d = profile.devices[device_type(q)]
        lines.append(f'host {{ name: "h{i}" address: "127.0.0.1" port: {24461 + i}\n'
                     f'  device {{ type: "{device_type(q)}" kind: CPU count: 1 memory_gib: 4 '
                     f'peak_tflops: {d.peak_flops / 1e12:.6g} '
                     f'memory_bandwidth_gbs: {d.memory_bandwidth / 1e9:.4g} }} }}')
    latency = recipe.get("link_latency_us", 50)
    for (a, b), bw in zip(HOST_PAIRS, cfg["links_gbps"], strict=True):
        lines.append(f'link {{ a: "{a}" b: "{b}" bandwidth_gbps: {bw} latency_us: {latency} }}')
    text = "\n".join(lines) + "\n"
    return text, parse_topology(text, path=f"<testbed {name}>")


GPU_FLOPS = 15e12   # a V100's sustained FLOP/s (fp32 and tensor-core mix)


def gpu_ratio_link_gbps(profile, quota: float, gpu_gbps: float = 25.0, gpu_flops: float = GPU_FLOPS) -> float:
    """The link rate (Gbit/s) that gives a host of QUOTA (its calibrated FLOP/s in PROFILE) the bytes per FLOP
    of a V100-class GPU (GPU_FLOPS) on GPU_GBPS Ethernet: ``gpu_gbps * flops / gpu_flops`` (25 Gbit/s and
    20 GFLOP/s -> 33 Mbit/s; 8.3e-5 to 2.1e-4 bytes per FLOP at 10 to 25 Gbit/s)."""
    return float(gpu_gbps) * profile.devices[device_type(quota)].peak_flops / float(gpu_flops)


# (label, tag_bench.mwms model, global batch: divisible by 1, 2 and 3 hosts, width, depth)
# vgg, deep-mlp and deep-transformer at bench_pipeline's sizes with --batch-scale 4 (that bench's CASES says how
# they were sized: so that using every host must pay); at batch 192 the simulator predicted the VGG's best
# mixed plan 1.01x faster than one host, at 384 1.49x; the deep MLP at 384 x 4 = 1536 since bench_pipeline run 27
# (at 96 x 4 = 384 an 8-micro-batch pipeline's 48-row micro-batches ran below the MatMuls' full rate); the
# 2-layer transformer at 96 x 4 = 384 since bench_e2e's G run of November 29 (on that run's G calibration,
# e2e_g_scale4_xeon_buckets.profile.json, in git history before c5e4afc, the simulator predicted one host best at 192,
# 408 ms against 424 ms for dp over the three hosts: a case where using every host cannot pay; at 384 it
# predicted a mixed plan 1.26x faster than one host); the deep transformer at 24 x 4 = 96 since the G run of
# December 1 (at 48 its pipeline measured 1.15x over one host in one run and 0.97x in the next, within the noise
# of 2.5 s steps; on the same calibration the simulator predicted the pipeline 1.23x faster than one host at 48
# and 1.34x at 96: more rows per micro-batch, the same weights to move)
E2E_CASES = [
    ("vgg", "vgg", 96, None, None),
    ("deep-mlp", "mlp", 384, 2048, 20),
    ("deep-transformer", "transformer", 24, 384, 8),
    ("transformer", "transformer", 96, None, None),
    ("cnn", "cnn", 48, None, None),
    ("mlp", "mlp", 96, None, None),
]
GPU_CONFIG = "G"             # bench_e2e's configuration of a GPU cluster's bytes per FLOP
GPU_QUOTAS = [1.0, 0.5, 0.5]


def config_recipe(recipe: dict, profile: Profile, gpu_gbps: float) -> dict:
    """RECIPE with configuration G: GPU_QUOTAS and links at a V100 cluster's bytes per FLOP."""
    link = round(gpu_ratio_link_gbps(profile, max(GPU_QUOTAS), gpu_gbps), 6)
    out = dict(recipe)
    out["configs"] = {**recipe["configs"], GPU_CONFIG: {"quotas": GPU_QUOTAS, "links_gbps": [link] * 3,
                                                         "gpu_gbps": gpu_gbps}}
    return out
