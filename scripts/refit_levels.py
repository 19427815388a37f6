"""Refit a saved bench_fidelity run's runtime levels with today's ``fit_levels`` and re-predict its cases.

A change to how ``runtime_levels`` fits the testbed's levels can be checked on runs already measured, without
the testbed. Per run and configuration of a saved ``bench_fidelity --json F`` run, every calibration step is
rebuilt: its prediction and per-family split from the run's base profile and topology (``F.runN.profile.json``,
``F.runN.testbed-C.pbtxt``, via ``one_host_split``), its measured time from the measured/predicted ratios the
run's log printed (``F.log``, two decimals). Those points are fitted again, alone and under load, as
``runtime_levels`` does; then the built-ins and random mixes of every group (the same seed, so the same
strategies) are predicted again and compared with the run's measurements. The searched plans and the tuning
step's picks are left out (the search may choose differently today). Prints and writes (``--json``) the error
per row, new and as measured, and medians per class and part (the rest, the held-out part).

Usage::

    python scripts/refit_levels.py F --json OUT     # F: a bench_fidelity --json F.json run (F.log, its files beside it)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # saved runs are named relative to it

import numpy as np  # noqa: E402

from tag.api import prepare  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag_bench.cases import (  # noqa: E402
    calibration_graph,
    first_group_per_type,
    fit_alone_and_loaded,
    heldout,
    levels_batches,
    load_recipe,
    one_host_rooflines,
    one_host_split,
)
from tag_bench.fidelity import MODELS, repredict_group  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

LEVELS_LINE = re.compile(r"\s+(\S+) \((alone|under load)\).*measured/predicted ([\d./]+);")


def logged_ratios(log: str) -> list[list[dict]]:
    """Per run, per configuration (in the order run), {(device type, 'alone' | 'under load'): measured /
    predicted of each calibration step} as the log printed them."""
    runs = []
    for run_text in log.split("=== run ")[1:]:
        configs = []
        for block in run_text.split("runtime levels (batches")[1:]:
            ratios = {}
            for line in block.split("\n")[1:]:
                m = LEVELS_LINE.match(line)
                if not m:
                    break
                ratios[(m.group(1), m.group(2))] = [float(x) for x in m.group(3).split("/")]
            configs.append(ratios)
        runs.append(configs)
    return runs


def refitted_profile(recipe: dict, base: Profile, topology, ratios: dict) -> Profile:
    """BASE with levels fitted again to the calibration steps rebuilt from TOPOLOGY and RATIOS."""
    first = first_group_per_type(topology)
    models = recipe["calibration"]["models"]
    logged = max(len(r) for r in ratios.values())         # the run's batches, which the recipe may since have grown
    batches = levels_batches(recipe)[:logged // len(models)]
    points = {label: {t: [] for t in first} for label in ("alone", "under load")}
    i = 0
    for spec in models:
        for b in batches:
            an = prepare(calibration_graph(spec, b), topology, batch_size=b, profile=base, name="calibration")
            firsts = [g.devices[0] for g in first.values()]
            splits = one_host_split(an, base, b, firsts)
            rooflines = one_host_rooflines(an, base, b, firsts)
            for t, (predicted, ops, parts), roof in zip(first, splits, rooflines, strict=True):
                for label in points:
                    if (t, label) in ratios:
                        points[label][t].append((predicted, ops, parts, predicted * ratios[(t, label)][i], roof))
            i += 1
    per_family = bool(recipe["calibration"].get("levels_per_family", True))
    fade = bool(recipe["calibration"].get("levels_fade", False)) and not per_family
    devices, loaded, _ = fit_alone_and_loaded(points["alone"], points["under load"], base.devices, per_family,
                                              fade=fade)
    return Profile(devices, source=base.source + "; levels refitted", network=base.network,
                   devices_under_load=loaded)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("saved", help="a bench_fidelity --json F path without .json (its log, profiles, topologies)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)
    recipe = load_recipe()
    held_configs, held_models = heldout(recipe)
    with open(f"{args.saved}.json") as f:
        saved = json.load(f)
    with open(f"{args.saved}.log") as f:
        ratios = logged_ratios(f.read())
    runs = saved.get("runs") or [saved]
    rows = []
    for r, run in enumerate(runs):
        configs = list(dict.fromkeys(row["config"] for row in run["rows"]))
        base = Profile.load(f"{args.saved}.run{r + 1}.profile.json")
        for c, config in enumerate(configs):
            with open(f"{args.saved}.run{r + 1}.testbed-{config}.pbtxt") as f:
                topology = parse_topology(f.read())
            profile = refitted_profile(recipe, base, topology, ratios[r][c])
            for label, spec, batch in MODELS:
                measured = {x["strategy"]: x for x in run["rows"] if x["config"] == config and x["model"] == label}
                if not measured:
                    continue
                predicted = repredict_group(args.saved, config, spec, batch, label, saved.get("seed", 0),
                                            saved.get("randoms", 3), run=r + 1, profile=profile)
                for name, p in predicted.items():
                    if name in measured:
                        x = measured[name]
                        rows.append({"run": r + 1, "config": config, "model": label, "strategy": name,
                                     "class": x["class"], "heldout": config in held_configs or spec in held_models,
                                     "predicted_s": p, "measured_s": x["measured_s"],
                                     "rel_error": p / x["measured_s"] - 1, "rel_error_as_run": x["rel_error"]})
    summary = {}
    for part, held in (("rest", False), ("heldout", True)):
        for what, keep in (("one_host", lambda x: x["strategy"] == "single"),
                           ("builtin", lambda x: x["class"] == "uniform"),
                           ("random", lambda x: x["class"] == "random")):
            for r in [None] + list(range(1, len(runs) + 1)):
                sel = [x for x in rows if x["heldout"] == held and keep(x) and (r is None or x["run"] == r)]
                if not sel:
                    continue
                key = f"{part}.{what}" + ("" if r is None else f".run{r}")
                summary[key] = {k: float(np.median([abs(x[f]) for x in sel]))
                                for k, f in (("median_now", "rel_error"), ("median_as_run", "rel_error_as_run"))}
                summary[key]["max_now"] = float(max(abs(x["rel_error"]) for x in sel))
                summary[key]["max_as_run"] = float(max(abs(x["rel_error_as_run"]) for x in sel))
                print(f"{key:28s} median |error| {summary[key]['median_as_run']:6.1%} as run -> "
                      f"{summary[key]['median_now']:6.1%} refitted (max {summary[key]['max_as_run']:.1%} -> "
                      f"{summary[key]['max_now']:.1%}; {len(sel)} rows)")
    write_json(args.json, {"saved": os.path.relpath(args.saved, REPO), "summary": summary, "rows": rows}, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
