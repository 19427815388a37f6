"""Runtime levels per op family against one scale: the fit on the calibration models, and one-host steps of the
benchmark models predicted with each, on one testbed configuration.

``runtime_levels`` (``tag_bench.cases``) times the recipe's calibration models whole on one host of each
device type through tag's runtime and fits the profile to them: per op family (convolutions, MatMuls, the rest;
``tag.cost.fitting.fit_levels``) and, for comparison, with one scale for every op. This script prints both
fits' residuals on those calibration points (in-sample), then checks them out of sample: the main benchmark
models of ``bench_fidelity`` (never used by the calibration) run whole on one host of each device type, each
predicted with the unlevelled profile, the one-scale profile and the per-family one. Needs root (namespaces,
cgroup v1 cpu); the load average is printed beside each table (figures taken under load are noisy).

Usage::

    python scripts/bench_levels.py                       # configuration A, calibrated here; ~8 min
    python scripts/bench_levels.py --config B --json F   # F: the points, both fits and the check rows
    python scripts/bench_levels.py --profile P           # skip the calibration (P: a testbed calibration)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag.api import prepare  # noqa: E402
from tag.cost.fitting import LEVEL_GROUPINGS, fit_levels  # noqa: E402
from tag.cost.model import CostModel, Profile  # noqa: E402
from tag.cost.op_classes import FAMILIES  # noqa: E402
from tag.sim import Simulator  # noqa: E402
from tag.strategy.baselines import on_one_device  # noqa: E402
from tag_bench.cases import (  # noqa: E402
    calibrate_testbed,
    calibration_graph,
    first_group_per_type,
    levelled,
    load_recipe,
    measure_on_testbed,
    one_host_split,
    runtime_levels,
    testbed_topology,
)
from tag_bench.machine import load1  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.testbed import Testbed  # noqa: E402

# the main (not held-out) models of bench_fidelity, at its global batches
CHECK_MODELS = (("mlp", "mwms:mlp", 96), ("cnn", "mwms:cnn", 48), ("transformer", "mwms:transformer", 48),
                ("mlp-512", "zoo:mlp,hidden=512x512", 96))


def one_scale_profile(base: Profile, record: dict) -> Profile:
    """BASE levelled with RECORD's one-scale fits (what runtime_levels did before per-family scales)."""
    devices = dict(base.devices)
    for dtype, r in record.items():
        devices[dtype] = levelled(devices[dtype], r["one_scale"]["scales"], r["one_scale"]["overhead_s"])
    return Profile(devices, source=base.source + "; one-scale levels", network=base.network)


def check(tb, profiles: dict, budget_s: float) -> list[dict]:
    """One-host steps of CHECK_MODELS on the first host of each device type: measured, predicted by each of
    PROFILES (name -> Profile; "unlevelled" first), and the unlevelled prediction split per family
    (``one_host_split``), so that any fit of the levels can be evaluated on them afterwards."""
    first = first_group_per_type(tb.topology)
    rows = []
    for label, spec, batch in CHECK_MODELS:
        an = prepare(calibration_graph(spec, batch), tb.topology, batch_size=batch, profile=profiles["unlevelled"],
                     name=label)
        # one analysis costed with each profile (graph analysis is the expensive part)
        sims = {k: Simulator(an.graph, an.topology, an.grouping, CostModel(an.graph, an.topology, p))
                for k, p in profiles.items()}
        splits = one_host_split(an, profiles["unlevelled"], batch, [g.devices[0] for g in first.values()])
        for (dtype, g), (_, ops, parts) in zip(first.items(), splits, strict=True):
            whole = on_one_device(an.grouping, an.topology, len(an.graph.ops), g.devices[0])
            preds = {k: sim.evaluate(whole, batch_size=batch).step_time for k, sim in sims.items()}
            measured = measure_on_testbed(tb, an.rewrite(whole), preds["per_family"], budget_s)
            row = {"model": label, "device_type": dtype, "measured_s": measured,
                   **{f"predicted_{k}_s": v for k, v in preds.items()}, "ops": ops, "parts_s": parts,
                   "load1": load1()}
            rows.append(row)
            print(f"  {label:12s} {dtype:8s} measured {measured * 1e3:8.1f} ms  " + "  ".join(
                f"{k} {v * 1e3:7.1f} ({v / measured - 1:+.0%})" for k, v in preds.items())
                + f"  load {row['load1']:.1f}", flush=True)
    return rows


def errors(rows: list[dict], key: str) -> tuple[float, float]:
    e = np.array([abs(r[f"predicted_{key}_s"] / r["measured_s"] - 1) for r in rows])
    return float(np.median(e)), float(np.max(e))


def groupings_table(record: dict, rows: list[dict]) -> list[dict]:
    """Every way fit_levels may tie the families, each forced: its fit on the calibration points (in sample)
    and its predictions of the check rows (out of sample), from the unlevelled splits of both."""
    out = []
    for grouping in LEVEL_GROUPINGS:
        fits, errs = {}, []
        for dtype, r in record.items():
            parts, p = np.array(r["parts_s"]), np.array(r["predicted_s"])
            fit = fit_levels(parts, p - parts.sum(axis=1), r["ops"], r["measured_s"], FAMILIES, groupings=[grouping])
            fits[dtype] = fit
            for row in rows:
                if row["device_type"] == dtype:
                    rp = np.array(row["parts_s"])
                    pred = (row["predicted_unlevelled_s"] - rp.sum() + rp @ np.array([fit.scales[f] for f in FAMILIES])
                            + fit.overhead_s * row["ops"])
                    errs.append(abs(pred / row["measured_s"] - 1))
        name = " | ".join("+".join(g) for g in grouping)
        out.append({"grouping": name, "in_sample_max": {t: f.max_error for t, f in fits.items()},
                    "fell_back": {t: f.note for t, f in fits.items() if f.note},
                    "out_of_sample_median": float(np.median(errs)), "out_of_sample_max": float(np.max(errs))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="A", help="the recipe's testbed configuration")
    p.add_argument("--profile", help="a testbed calibration (Profile JSON) instead of calibrating here")
    p.add_argument("--budget", type=float, default=2.0, help="timed seconds per measured step")
    p.add_argument("--json", help="write the points, both fits and the check rows here")
    p.add_argument("--save-profile", help="write the (unlevelled) calibration here")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    recipe = load_recipe()
    t0 = time.time()
    if args.profile:
        base = Profile.load(args.profile)
    else:
        with tempfile.TemporaryDirectory() as workdir:
            base = calibrate_testbed(recipe, workdir, [args.config])
    print(f"calibration {time.time() - t0:.0f} s, load {load1():.1f}", flush=True)
    if args.save_profile:
        base.save(args.save_profile)
    _, topo = testbed_topology(recipe, args.config, base)
    record: dict = {}
    with Testbed(topo, cpu_quota=recipe["configs"][args.config]["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            load_before = load1()
            per_family = runtime_levels(tb, recipe, base, args.budget, record=record, per_family=True,
                                        under_load=False)
            print(f"levels fitted (load {load_before:.1f} before, {load1():.1f} after)", flush=True)
            profiles = {"unlevelled": base, "one_scale": one_scale_profile(base, record), "per_family": per_family}
            print("out of sample: the benchmark models whole on one host", flush=True)
            rows = check(tb, profiles, args.budget)
        finally:
            tb.stop_workers()
    print("\nfit on the calibration points (in sample)    max |error|: one scale  per family")
    for dtype, r in record.items():
        print(f"  {dtype:8s} {' ' * 34}{r['one_scale']['max_error']:9.1%}  {r['per_family']['max_error']:10.1%}")
    print("one-host steps of the benchmark models (out of sample): median / max |error|")
    for k in profiles:
        med, mx = errors(rows, k)
        print(f"  {k:12s} {med:6.1%} / {mx:6.1%}")
    table = groupings_table(record, rows)
    print("each way of tying the families, forced     in-sample max |error| per type   out of sample median / max")
    for t in table:
        ins = " ".join(f"{x:5.1%}" for x in t["in_sample_max"].values())
        flag = " (fell back: " + "; ".join(t["fell_back"].values()) + ")" if t["fell_back"] else ""
        print(f"  {t['grouping']:38s} {ins:32s} {t['out_of_sample_median']:6.1%} / {t['out_of_sample_max']:6.1%}{flag}")
    print(f"total {time.time() - t0:.0f} s, load {load1():.1f}")
    write_json(args.json, {"config": args.config, "levels": record, "check": rows, "groupings": table,
                           "check_errors": {k: dict(zip(("median", "max"), errors(rows, k), strict=True))
                                            for k in profiles},
                           "load1_end": load1()}, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
