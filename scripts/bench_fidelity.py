"""Fidelity that tells mixed plans from uniform ones: does the simulator predict and order strategies the way
real runs on a heterogeneous testbed do, and what would tag's measured tuning step deploy?

For every case group (one model on one testbed configuration) the script predicts and measures, each case
with its class:

- ``uniform``: every built-in strategy (dp_allreduce, ps, single, partition; built with the calibrated cost
  model);
- ``searched``: the plan ``tag.optimize`` finds (search + SFB), when it is not one of the built-ins;
- ``random``: random mixed strategies (one random candidate per op group);
- ``tuned``: what tag's measured tuning step (``tag.tune.tune_plan``, K=4, as ``tag-deploy --run --tune 4``)
  keeps, when it is none of the group's other cases (a strategy it keeps that is one of them counts with
  that case's measurement).

The testbed (``tag_bench.testbed``): three hosts in network namespaces with CPU quotas (CFS) and shaped links
(each NIC one shared HTB egress), configurations and calibration from ``tag_bench/testbed_recipe.json``
(``tag_bench.cases``). The prediction uses one profile per run: ``tag-profile --sustained`` on the recipe's
calibration models (which share no layer width with the cases) inside each quota's cgroup, plus the
runtime's network costs (``profile_network``); each configuration's device speeds are then set to the speed
the same calibration models run at on its hosts through tag's runtime (``runtime_levels``). The measurement:
the strategy rewritten by ``tag.rewrite`` and run on TF servers inside the namespaces, one one-thread worker
per host; the median of at least 5 steps after warm-up. A group's cases are timed side by side, in
interleaved rounds (``measure_interleaved``), and a program two cases share is measured once.

The held-out part (the recipe's ``"heldout"``: configuration H and two models, never used to choose or tune
anything): every case on a held-out configuration or of a held-out model is reported apart, under the JSON
key ``heldout``, with the same keys as the rest (the top-level keys). A default run measures every main model
on A and B, the held-out models on A and H, and the CNN on H (``default_groups``).

Figures (``tag_bench.fidelity``): median and largest absolute relative error per class and over the mixed
cases (searched + random), per-group Kendall tau and its mean, the regret (measured time of the
predicted-best case / the best measured in its group) without and with the tuning step, and whether the
issue's targets hold. When a pick is not its group's best measured, the pick and the best are timed again side
by side, ``CONFIRM_FACTOR`` times longer (``confirm_picks``), and the regret is their ratio: the smallest of a
group's noisy medians is biased low (``max_regret_raw`` and ``max_regret_tuned_raw`` keep the first
measurement's). The issue's targets hold (``TARGETS``; the held-out figures must lie within 0.03 of the
rest's). Needs root (namespaces, tc, cgroup v1 cpu). The machine may be shared: the load average is printed
per group.

Usage::

    python scripts/bench_fidelity.py                       # 15 groups, about 107 cases; 26 min at load 1-7
    python scripts/bench_fidelity.py --quick               # A: mlp-512 and the held-out vgg, one random;
                                                           # ~6 min (5 of them the calibration)
    python scripts/bench_fidelity.py --runs 3 --json F     # three runs in a row; F's figures are the worst
                                                           # run's, F.run1.profile.json ... their profiles
    python scripts/bench_fidelity.py --configs A,H --models cnn,vgg   # every named model on every named config

JSON: the rest's figures (``cases``, ``mixed_cases``, ``median_abs_rel_error``, ``median_abs_rel_error_mixed``,
``max_abs_rel_error_mixed``, ``median_abs_rel_error_<class>`` / ``max_abs_rel_error_<class>`` per class,
``mean_kendall_tau``, ``max_regret``, ``max_regret_tuned`` (and their ``_raw`` forms), ``tune_seconds``,
``spearman``, ``top1_agreement``;
the worst of the runs), ``heldout`` (the same keys), ``rows`` (every case), ``groups`` and ``heldout_groups``
(the last run), ``runs`` (each run's figures, rows and groups; ``heldout`` within), ``targets``,
``targets_checked``, ``targets_held``, ``provenance``.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag.api import prepare, search_plan  # noqa: E402
from tag.errors import TagError  # noqa: E402
from tag.strategy.baselines import BUILTIN_STRATEGIES, one_device_placement  # noqa: E402
from tag.tune import strategy_key, tune_plan  # noqa: E402
from tag_bench.cases import (  # noqa: E402
    calibrate_testbed,
    calibration_graph,
    heldout,
    load_recipe,
    measure_interleaved,
    measure_on_testbed,
    runtime_levels,
    testbed_topology,
)
from tag_bench.fidelity import (  # noqa: E402
    HELDOUT_GAP,
    MODELS,
    TARGETS,
    case_class,
    check_targets,
    class_table,
    random_mixes,
    rows_to_confirm,
    split_heldout,
    summary,
    targets_text,
    worst_of,
)
from tag_bench.machine import load1, load_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.testbed import Testbed, testbed_missing  # noqa: E402

HELDOUT_CONFIG_MAIN_MODELS = ("cnn",)   # the main models that also run on a held-out configuration
QUICK = (["A"], ["mlp-512", "vgg"], 1)  # --quick: configurations, models, random mixes per group
QUICK_BUDGET_S, QUICK_CASE_S = 5.0, 2.0 # --quick: search budget per group, timed seconds per case
TUNE_K = 4                              # as ``tag-deploy --run --tune 4``
CONFIRM_FACTOR = 3                      # confirm_picks times each program this many times --case-seconds


def default_groups(recipe: dict, configs: list[str], models: list[tuple]) -> list[tuple[str, tuple]]:
    """(configuration, model) of every group a default run measures: every main model on every main
    configuration; the held-out models on the first main configuration and on the held-out ones; on a
    held-out configuration also HELDOUT_CONFIG_MAIN_MODELS (a held-out configuration seen with a main model)."""
    held_configs, held_models = heldout(recipe)
    main = [c for c in configs if c not in held_configs]
    out = []
    for config in configs:
        for m in models:
            if m[1] in held_models:
                keep = config in held_configs or config in main[:1]
            elif config in held_configs:
                keep = m[0] in HELDOUT_CONFIG_MAIN_MODELS
            else:
                keep = True
            if keep:
                out.append((config, m))
    return out


def program_id(strategy, topology) -> str:
    """What makes two strategies the same measured program (``tag.tune.strategy_key`` with the topology)."""
    return strategy_key(strategy, topology)


def group_cases(analysis, budget_s: float, randoms: int, seed: int):
    """(name, strategy, runnable, predicted seconds) of every distinct strategy of one group, and the plan;
    runnable has graph_def etc. A built-in that runs every op where an earlier one does (e.g. ``partition``
    choosing one device, as ``single``) is the same case and is measured once: otherwise measurement noise
    between two runs of one program would count as ranking error."""
    sim, batch = analysis.simulator(), analysis.batch
    cases, seen = [], {}
    for name in BUILTIN_STRATEGIES:
        s = analysis.builtin(name)
        where = one_device_placement(s, analysis.topology)
        if where is not None and where in seen:
            print(f"  ({name} runs as {seen[where]})", flush=True)
            continue
        if where is not None:
            seen[where] = name
        cases.append((name, s, analysis.rewrite(s), sim.evaluate(s, batch_size=batch).step_time))
    plan = search_plan(analysis, budget_s=budget_s, seed=seed)
    if plan.method in BUILTIN_STRATEGIES and not plan.report().get("sfb_gradients"):
        print(f"  (the plan is the built-in {plan.method})", flush=True)
    else:
        cases.append((f"plan:{plan.method}", plan.strategy, plan, plan.predicted_step_time))
    for name, s, predicted in random_mixes(analysis, randoms, seed):
        cases.append((name, s, analysis.rewrite(s), predicted))
    return cases, plan


def measure_group(tb, config: str, label: str, source: str, batch: int, held: bool, profile, args):
    """The rows of one group (every case predicted and measured, then the tuning step's pick) and its
    extras (seconds, tuning seconds, load average)."""
    t0 = time.time()
    analysis = prepare(calibration_graph(source, batch), tb.topology, batch_size=batch, profile=profile, name=label)
    rows, ids = [], {}

    def record(strategy_name: str, predicted: float, measured: float) -> dict:
        row = {"config": config, "model": label, "batch": batch, "strategy": strategy_name,
               "class": case_class(strategy_name), "heldout": held, "predicted_s": float(predicted),
               "measured_s": float(measured), "rel_error": (predicted - measured) / measured,
               "load1": load1()}
        rows.append(row)
        print(f"{config:<2} {label:<17} {strategy_name:<24} {row['class']:<8} predicted {predicted * 1e3:8.1f} ms  "
              f"measured {measured * 1e3:8.1f} ms  error {row['rel_error'] * 100:+6.1f}%  "
              f"(load {row['load1']:.1f})", flush=True)
        return row

    cases, plan = group_cases(analysis, args.budget, args.randoms, args.seed)
    # every distinct program once, all of them side by side in interleaved rounds
    programs = {}
    for _name, strategy, runnable, predicted in cases:
        programs.setdefault(program_id(strategy, analysis.topology), (runnable, predicted))
    measured = measure_interleaved(tb, programs, args.case_seconds)
    row_keys: dict[int, str] = {}
    for name, strategy, _runnable, predicted in cases:
        key = program_id(strategy, analysis.topology)
        row = record(name, predicted, measured[key])
        row_keys[id(row)] = key
        ids.setdefault(key, row)
    extras = {"search_seconds": float(plan.report().get("search_seconds", 0.0))}
    tuned = None
    if args.tune_k:
        t1 = time.perf_counter()
        try:
            tuned = tune_plan(plan, tb, k=args.tune_k)
        except TagError as e:   # reported in the group (no tuned regret), the run goes on
            extras["tune_error"] = str(e)
            print(f"   tuning step failed: {e}", flush=True)
        extras["tune_seconds"] = time.perf_counter() - t1
    if tuned is not None:
        fields = tuned.report()["tune"]
        extras["tune_candidates"] = [{k: c[k] for k in ("name", "predicted_ms", "measured_ms", "mad_ms", "steps")}
                                     for c in fields["candidates"]]
        extras["tune_extra_rounds"] = fields.get("extra_rounds", 0)
        tuned_key = program_id(tuned.strategy, analysis.topology)
        pick = ids.get(tuned_key)
        if pick is None:   # none of the group's cases: measured like them
            predicted = tuned.predicted_step_time
            pick = record(f"tuned:{fields['kept']}", predicted,
                          measure_on_testbed(tb, tuned, predicted, args.case_seconds))
            row_keys[id(pick)] = tuned_key
            programs[tuned_key] = (tuned, predicted)
        pick["tuned_pick"] = True
        print(f"   tuning step (K={args.tune_k}, {extras['tune_seconds']:.0f} s, "
              f"+{fields.get('extra_rounds', 0)} rounds within the noise) kept {fields['kept']} = case "
              f"{pick['strategy']}: " + ", ".join(f"{c['name']} {c['measured_ms']:.1f}+-{c['mad_ms']:.1f} ms"
                                                   for c in fields["candidates"]), flush=True)
    confirm_picks(tb, rows, row_keys, programs, args.case_seconds * CONFIRM_FACTOR)
    extras.update(seconds=time.time() - t0, load1=load1())
    return rows, extras


def confirm_picks(tb, rows: list[dict], row_keys: dict[int, str], programs: dict, seconds: float) -> None:
    """When the predicted-best case or the tuning step's pick is not the group's best measured, time those
    programs again side by side for SECONDS each (``measure_interleaved``) and store the medians as each
    row's ``confirm_s``, which the regret is computed from (``tag_bench.fidelity.group_figures``): the best of
    a group's noisy medians is biased low (B/cnn's one-host step: 107, 136 and 116 ms in three side-by-side
    measurements a minute apart), so a pick as fast as the best could count as a loss."""
    todo = rows_to_confirm(rows)
    if not todo:
        return
    keys = list(dict.fromkeys(row_keys[id(r)] for r in todo))
    again = measure_interleaved(tb, {k: programs[k] for k in keys}, seconds)
    for r in rows:
        if row_keys.get(id(r)) in again:
            r["confirm_s"] = again[row_keys[id(r)]]
    print("   confirmed side by side: " + ", ".join(
        f"{r['strategy']} {r['measured_s'] * 1e3:.1f} -> {r['confirm_s'] * 1e3:.1f} ms" for r in rows
        if "confirm_s" in r), flush=True)


def run_config(recipe: dict, name: str, profile, group_models, args, audit: str | None):
    """Rows and group extras of every model of GROUP_MODELS on configuration NAME (one testbed)."""
    cfg = recipe["configs"][name]
    held_configs, held_models = heldout(recipe)
    _, topo = testbed_topology(recipe, name, profile)
    rows, extras = [], {}
    with Testbed(topo, cpu_quota=cfg["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            profile = runtime_levels(tb, recipe, profile)
            if audit:
                profile.save(f"{audit}.testbed-{name}.profile.json")
            for label, source, batch in group_models:
                held = name in held_configs or source in held_models
                r, e = measure_group(tb, name, label, source, batch, held, profile, args)
                rows += r
                extras[(name, label)] = e
                g = summary(r, {(name, label): e})["groups"][0]
                tuned = "-" if g["regret_tuned"] is None else f"{g['regret_tuned']:.3f} ({g['tuned_pick']})"
                print(f"   -> predicted best {g['predicted_best']}, measured best {g['measured_best']}, regret "
                      f"{g['regret']:.3f}, tuned regret {tuned}, Kendall tau {g['kendall_tau']:+.2f}  "
                      f"({e['seconds']:.0f} s, load {e['load1']:.1f})", flush=True)
        finally:
            tb.stop_workers()
    return rows, extras


def one_run(recipe: dict, groups, args, tag_out: str | None) -> dict:
    t0 = time.time()
    configs = list(dict.fromkeys(c for c, _ in groups))
    with tempfile.TemporaryDirectory() as workdir:
        profile = calibrate_testbed(recipe, workdir, configs)
    if tag_out:   # the profile and topologies this run predicted with, for auditing
        profile.save(f"{tag_out}.profile.json")
        for name in configs:
            with open(f"{tag_out}.testbed-{name}.pbtxt", "w") as f:
                f.write(testbed_topology(recipe, name, profile)[0])
    rows, extras = [], {}
    for name in configs:
        r, e = run_config(recipe, name, profile, [m for c, m in groups if c == name], args, tag_out)
        rows += r
        extras.update(e)
    rest, held = split_heldout(rows)
    out = summary(rest, extras)
    out["heldout"] = summary(held, extras) if held else None
    out["seconds"] = time.time() - t0
    print(f"\n{len(rows)} cases in {out['seconds']:.0f} s (load {load1():.1f})")
    print(class_table(out, "the rest"))
    if held:
        print(class_table(out["heldout"], "held out (frozen configuration / models)"))
    out["rows"] = rows
    return out


def figures_only(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("groups", "rows", "heldout")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="configuration A, mlp-512 and the held-out vgg, one random")
    p.add_argument("--runs", type=int, default=1, help="independent runs in a row, each calibrated anew")
    p.add_argument("--models", help="comma-separated subset of " + ",".join(m for m, _, _ in MODELS))
    p.add_argument("--configs", help="comma-separated subset of the recipe's configurations")
    p.add_argument("--randoms", type=int, default=None, help="random mixed strategies per group (default 3)")
    p.add_argument("--tune-k", type=int, default=TUNE_K, help=f"the tuning step's K (default {TUNE_K}; 0: none)")
    p.add_argument("--budget", type=float, default=None, help="search budget per group (s; default 10, --quick 5)")
    p.add_argument("--case-seconds", type=float, default=None,
                   help="timed seconds per case (5-40 steps; default 3, --quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default=None, help="testbed recipe (default tag_bench/testbed_recipe.json)")
    p.add_argument("--json", help="write the figures here (and each run's profile and topologies beside it)")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    if testbed_missing("bench_fidelity"):
        return 2
    recipe = load_recipe(args.recipe) if args.recipe else load_recipe()
    configs, models = list(recipe["configs"]), MODELS
    if args.quick:
        configs, names, randoms = QUICK
        models = [m for m in MODELS if m[0] in names]
        args.randoms = randoms if args.randoms is None else args.randoms
        args.budget = QUICK_BUDGET_S if args.budget is None else args.budget
        args.case_seconds = QUICK_CASE_S if args.case_seconds is None else args.case_seconds
    args.randoms = 3 if args.randoms is None else args.randoms
    args.budget = 10.0 if args.budget is None else args.budget
    args.case_seconds = 3.0 if args.case_seconds is None else args.case_seconds
    if args.models:
        models = [m for m in MODELS if m[0] in args.models.split(",")]
    if args.configs:
        configs = [c for c in recipe["configs"] if c in args.configs.split(",")]
    if args.quick or args.models or args.configs:
        groups = [(c, m) for c in configs for m in models]
    else:
        groups = default_groups(recipe, configs, models)
    if not groups:
        p.error("no group to measure: check --models and --configs")
    stem = os.path.splitext(args.json)[0] if args.json else None
    print(f"commit {this_run.commit}; {len(groups)} groups: {', '.join(f'{c}/{m[0]}' for c, m in groups)}; "
          f"load {load_text()}", flush=True)
    runs = []
    for k in range(args.runs):
        print(f"=== run {k + 1} of {args.runs} ===", flush=True)
        runs.append(one_run(recipe, groups, args, f"{stem}.run{k + 1}" if stem else None))
    worst = worst_of([figures_only(r) for r in runs])
    worst_held = worst_of([figures_only(r["heldout"]) for r in runs]) if runs[0]["heldout"] else None
    checks = check_targets(worst, worst_held)
    held = all(ok for _, _, _, ok in checks)
    what = "worst of the runs" if args.runs > 1 else "this run"
    print(f"\ntargets ({what}; held-out figures within {HELDOUT_GAP:g} of the rest's):\n{targets_text(checks)}")
    print(f"targets {'held' if held else 'NOT held'} in {'every run' if args.runs > 1 else 'this run'}")
    last_held = runs[-1]["heldout"]
    write_json(args.json, {**worst, "heldout": worst_held, "rows": runs[-1]["rows"], "groups": runs[-1]["groups"],
                           "heldout_groups": last_held["groups"] if last_held else [],
                           "targets": {k: list(v) for k, v in TARGETS.items()}, "heldout_within": HELDOUT_GAP,
                           "targets_checked": [{"key": k, "value": v, "target": w, "held": ok}
                                               for k, v, w, ok in checks],
                           "targets_held": held, "tune_k": args.tune_k, "randoms": args.randoms,
                           "budget_s": args.budget, "case_seconds": args.case_seconds, "runs": runs}, this_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
