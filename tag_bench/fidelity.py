"""bench_fidelity's models and figures: errors split by class, per-group ranking, regret with and without the
measured tuning step, the held-out split, targets (from its rows: numpy and scipy, no testbed); the random mixed
strategies of a group (``random_mixes``) and a saved run's group predicted again (``repredict_group``: what
``fidelity_repredict`` and ``refit_levels`` check today's cost model with).

A row is one case: ``{"config", "model", "strategy", "class", "heldout", "predicted_s", "measured_s"}`` and
optionally ``"tuned_pick": True`` on the row of the strategy the tuning step kept and ``"confirm_s"`` (the
row's program timed again side by side with its group's picks and best: ``rows_to_confirm``). Classes
(``CLASSES``):
``uniform`` (the built-ins), ``searched`` (tag's plan), ``random`` (a random mixed strategy) and ``tuned``
(the tuning step's pick when it was none of the group's other cases). Mixed = searched + random.

Usage::

    from tag_bench.fidelity import split_heldout, summary
    rest, held = split_heldout(rows)
    figures = summary(rest)           # {"cases", "median_abs_rel_error", ..., "groups": [...]}
    predicted = repredict_group("run12", "B", "mwms:cnn", 48, "cnn", seed=0, randoms=3)   # {case: seconds}
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np
from scipy.stats import kendalltau, spearmanr

from tag.strategy.baselines import BUILTIN_STRATEGIES

CLASSES = ("uniform", "searched", "random", "tuned")
MIXED = ("searched", "random")
# the issue's targets: key -> (comparison, bound); the held-out keys must each lie within HELDOUT_GAP of the rest
TARGETS = {"median_abs_rel_error": ("<=", 0.10), "median_abs_rel_error_mixed": ("<=", 0.12),
           "max_abs_rel_error_mixed": ("<=", 0.30), "mean_kendall_tau": (">=", 0.85),
           "max_regret": ("<=", 1.10), "max_regret_tuned": ("<=", 1.03), "cases": (">=", 60),
           "mixed_cases": (">=", 20)}
HELDOUT_KEYS = ("median_abs_rel_error", "median_abs_rel_error_mixed", "max_abs_rel_error_mixed",
                "mean_kendall_tau", "max_regret", "max_regret_tuned")
HELDOUT_GAP = 0.03
HIGHER_IS_BETTER = {"mean_kendall_tau", "spearman", "top1_agreement", "cases", "mixed_cases", "tuned_groups"}


# (label, graph source, global batch): the tf.distribute comparison's three models, two plain MLPs and the
# recipe's held-out models (a VGG-style CNN with a large head, a 4-layer transformer with a large vocabulary)
MODELS = [
    ("mlp", "mwms:mlp", 96),
    ("cnn", "mwms:cnn", 48),
    ("transformer", "mwms:transformer", 48),
    ("mlp-512", "zoo:mlp,hidden=512x512", 96),
    ("mlp-1024x3", "zoo:mlp,hidden=1024x1024x1024", 96),
    ("vgg", "mwms:vgg", 48),
    ("transformer-4x16k", "mwms:transformer,depth=4,vocab=16384", 48),
]


def case_class(strategy: str) -> str:
    """The class of a case named STRATEGY as bench_fidelity names them (a built-in, ``plan:...``,
    ``randomN``, ``tuned:...``)."""
    if strategy in BUILTIN_STRATEGIES:
        return "uniform"
    if strategy.startswith("plan:"):
        return "searched"
    if strategy.startswith("random"):
        return "random"
    if strategy.startswith("tuned:"):
        return "tuned"
    raise ValueError(f"case {strategy!r} has no class")


def _abs_errors(rows: Iterable[dict]) -> np.ndarray:
    return np.array([abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows], dtype=float)


def _median(x: np.ndarray) -> float | None:
    return float(np.median(x)) if len(x) else None


def _max(x: np.ndarray) -> float | None:
    return float(np.max(x)) if len(x) else None


def group_key(row: dict) -> tuple[str, str]:
    return row["config"], row["model"]


def groups_of(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """ROWS by (config, model), in the order they first appear."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault(group_key(r), []).append(r)
    return out


def rows_to_confirm(rows: list[dict]) -> list[dict]:
    """The rows of one group whose regret a confirmation measurement decides: the best measured, the
    predicted-best case and the tuning step's pick, when either pick is not the best measured; else none."""
    own = [r for r in rows if r["class"] != "tuned"]
    best = min(rows, key=lambda r: r["measured_s"])
    picks = [min(own, key=lambda r: r["predicted_s"])] + [r for r in rows if r.get("tuned_pick")]
    if all(p is best for p in picks):
        return []
    out = [best]
    for p in picks:
        if all(p is not r for r in out):
            out.append(p)
    return out


def group_figures(rows: list[dict]) -> dict:
    """Ranking figures of one group's ROWS. Kendall's tau, top-1 and the regret are over the group's own
    cases (not the ``tuned`` row, which exists only because the tuning step picked it); every measured
    row, tuned included, counts for the best measured time. ``regret``: measured time of the predicted-best
    case / the best measured; ``regret_tuned``: that of the tuning step's pick (None without one). When rows
    carry ``confirm_s`` (the picks and the best measured again side by side, ``rows_to_confirm``), both
    regrets are ratios of those; ``regret_raw`` and ``regret_tuned_raw`` keep the first measurement's."""
    own = [r for r in rows if r["class"] != "tuned"]
    pred = np.array([r["predicted_s"] for r in own], dtype=float)
    meas = np.array([r["measured_s"] for r in own], dtype=float)
    best_all = min(r["measured_s"] for r in rows)
    best_pred = int(np.argmin(pred))
    tau = float(kendalltau(pred, meas).statistic) if len(own) > 1 else 1.0
    picks = [r for r in rows if r.get("tuned_pick")]
    if len(picks) > 1:
        raise ValueError(f"group {group_key(rows[0])}: {len(picks)} rows are marked as the tuning step's pick")
    measured_best = min(rows, key=lambda r: r["measured_s"])
    confirmed = [r["confirm_s"] for r in rows if r.get("confirm_s") is not None]

    def regret(row: dict) -> float:
        if confirmed and row.get("confirm_s") is not None:
            return float(row["confirm_s"] / min(confirmed))
        return float(row["measured_s"] / best_all)

    return {"config": rows[0]["config"], "model": rows[0]["model"], "heldout": bool(rows[0].get("heldout")),
            "cases": len(rows), "top1": own[best_pred] is min(own, key=lambda r: r["measured_s"]),
            "kendall_tau": tau, "regret": regret(own[best_pred]),
            "regret_tuned": regret(picks[0]) if picks else None,
            "regret_raw": float(meas[best_pred] / best_all),
            "regret_tuned_raw": float(picks[0]["measured_s"] / best_all) if picks else None,
            "confirmed": bool(confirmed),
            "predicted_best": own[best_pred]["strategy"], "measured_best": measured_best["strategy"],
            "tuned_pick": picks[0]["strategy"] if picks else None}


def summary(rows: list[dict], extras: dict[tuple[str, str], dict] | None = None) -> dict:
    """The figures of ROWS (see the module docstring) and their per-group figures under ``groups`` (each
    merged with EXTRAS[(config, model)], e.g. seconds and load average). Keys: ``cases``, ``mixed_cases``,
    ``median_abs_rel_error`` (all rows), ``median_abs_rel_error_mixed`` and ``max_abs_rel_error_mixed``
    (searched + random), ``median_abs_rel_error_<class>``, ``max_abs_rel_error_<class>`` and
    ``cases_<class>`` per class, ``spearman`` (pooled), ``mean_kendall_tau``, ``top1_agreement``,
    ``max_regret``, ``max_regret_tuned`` (over the ``tuned_groups`` groups with a pick; from the confirmation
    measurement where a group has one), ``max_regret_raw`` and ``max_regret_tuned_raw`` (from the first
    measurement only), ``tune_seconds`` (summed over EXTRAS' ``tune_seconds``).
    Figures of an empty selection are None."""
    extras = extras or {}
    groups = [{**group_figures(g), **extras.get(k, {})} for k, g in groups_of(rows).items()]
    mixed = [r for r in rows if r["class"] in MIXED]
    out: dict = {"cases": len(rows), "mixed_cases": len(mixed),
                 "median_abs_rel_error": _median(_abs_errors(rows)),
                 "median_abs_rel_error_mixed": _median(_abs_errors(mixed)),
                 "max_abs_rel_error_mixed": _max(_abs_errors(mixed))}
    for cls in CLASSES:
        errs = _abs_errors(r for r in rows if r["class"] == cls)
        out[f"cases_{cls}"] = len(errs)
        out[f"median_abs_rel_error_{cls}"] = _median(errs)
        out[f"max_abs_rel_error_{cls}"] = _max(errs)
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    out["spearman"] = float(spearmanr(pred, meas).statistic) if len(rows) > 2 else None
    taus = [g["kendall_tau"] for g in groups if not math.isnan(g["kendall_tau"])]
    out["mean_kendall_tau"] = float(np.mean(taus)) if taus else None
    out["top1_agreement"] = float(np.mean([g["top1"] for g in groups])) if groups else None
    out["max_regret"] = max((g["regret"] for g in groups), default=None)
    tuned = [g["regret_tuned"] for g in groups if g["regret_tuned"] is not None]
    out["max_regret_tuned"] = max(tuned) if tuned else None
    out["max_regret_raw"] = max((g["regret_raw"] for g in groups), default=None)
    tuned_raw = [g["regret_tuned_raw"] for g in groups if g["regret_tuned_raw"] is not None]
    out["max_regret_tuned_raw"] = max(tuned_raw) if tuned_raw else None
    out["group_count"] = len(groups)
    out["tuned_groups"] = len(tuned)       # groups whose tuning step picked a strategy (all, unless one failed)
    out["tune_seconds"] = float(sum(g.get("tune_seconds", 0.0) for g in groups))
    out["groups"] = groups
    return out


def split_heldout(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the rest, the held-out rows): a row is held out when its ``heldout`` flag is set (bench_fidelity
    sets it for every case on a held-out configuration or of a held-out model)."""
    return [r for r in rows if not r.get("heldout")], [r for r in rows if r.get("heldout")]


def is_heldout(config: str, model_spec: str, heldout_configs: Iterable[str], heldout_models: Iterable[str]) -> bool:
    return config in set(heldout_configs) or model_spec in set(heldout_models)


def worst_of(runs: list[dict]) -> dict:
    """Per key of the runs' summaries, the worst value of any run (the lowest where higher is better, else
    the highest); keys that are None in every run stay None."""
    out = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        if key == "groups" or any(isinstance(v, (dict, list, bool)) for v in values):
            continue
        present = [v for v in values if v is not None]
        out[key] = (min(present) if key in HIGHER_IS_BETTER else max(present)) if present else None
    return out


def check_targets(rest: dict, heldout: dict | None) -> list[tuple[str, float | None, str, bool]]:
    """(key, value, what the target asks, held) for every target: REST's keys against TARGETS, and each of
    HELDOUT's HELDOUT_KEYS within HELDOUT_GAP of REST's (a missing figure is not held; nor is the tuned
    regret when a group has no tuning pick)."""
    out = []
    for key, (op, bound) in TARGETS.items():
        v = rest.get(key)
        held = v is not None and (v <= bound if op == "<=" else v >= bound)
        if key == "max_regret_tuned" and rest.get("tuned_groups", 0) < rest.get("group_count", 0):
            held = False                   # a group without a tuning pick: the tuned figure is incomplete
        out.append((key, v, f"{op} {bound:g}", held))
    if heldout is not None:
        for key in HELDOUT_KEYS:
            v, r = heldout.get(key), rest.get(key)
            held = v is not None and r is not None and abs(v - r) <= HELDOUT_GAP + 1e-12
            out.append((f"heldout.{key}", v, f"within {HELDOUT_GAP:g} of {r:.3g}" if r is not None else "(no rest)",
                        held))
    return out


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{x * 100:5.1f}%"


def class_table(figures: dict, title: str) -> str:
    """A small text table of FIGURES (``summary``'s) split by class."""
    lines = [f"{title}: {figures['cases']} cases ({figures['mixed_cases']} mixed), "
             f"{len(figures['groups'])} groups",
             f"  {'class':<9} {'cases':>5}  {'median |err|':>12}  {'max |err|':>9}"]
    for cls in CLASSES:
        if figures[f"cases_{cls}"]:
            lines.append(f"  {cls:<9} {figures[f'cases_{cls}']:>5}  {_pct(figures[f'median_abs_rel_error_{cls}']):>12}"
                         f"  {_pct(figures[f'max_abs_rel_error_{cls}']):>9}")
    lines.append(f"  {'mixed':<9} {figures['mixed_cases']:>5}  {_pct(figures['median_abs_rel_error_mixed']):>12}"
                 f"  {_pct(figures['max_abs_rel_error_mixed']):>9}")
    lines.append(f"  {'all':<9} {figures['cases']:>5}  {_pct(figures['median_abs_rel_error']):>12}")

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)
    lines.append(f"  mean Kendall tau {num(figures['mean_kendall_tau'], '.2f')}, max regret "
                 f"{num(figures['max_regret'], '.3f')}, max regret tuned {num(figures['max_regret_tuned'], '.3f')} "
                 f"(tuning {figures['tune_seconds']:.0f} s), top-1 {num(figures['top1_agreement'], '.0%')}, "
                 f"Spearman {num(figures['spearman'], '.3f')}")
    return "\n".join(lines)


def targets_text(checks: list[tuple[str, float | None, str, bool]]) -> str:
    return "\n".join(f"  {'held    ' if held else 'NOT held'}  {key:<36} "
                     f"{'-' if v is None else format(v, '.4g'):>8}  (target {what})" for key, v, what, held in checks)


def random_mixes(analysis, randoms: int, seed: int) -> list[tuple]:
    """(name, strategy, predicted seconds) of RANDOMS random mixed strategies (one random candidate per op
    group), the same for the same SEED."""
    from tag.search.env import SearchEnv
    from tag.search.random_search import random_choice
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(randoms):
        choice = random_choice(env, rng)
        out.append((f"random{k}", env.strategy(choice, name=f"random{k}"), env.evaluate(choice).step_time))
    return out


def repredict_group(prefix: str, config: str, spec: str, batch: int, label: str, seed: int,
                    randoms: int, run: int = 1, profile=None,
                    network: dict[str, float] | None = None) -> dict[str, float]:
    """{case name: predicted seconds} of the built-ins and the first RANDOMS random mixes of one group, with the
    topology the run saved under PREFIX (run RUN) and PROFILE (None: the profile saved beside it), its
    NetworkProfile fields in NETWORK replaced."""
    from tag.api import prepare
    from tag_bench.cases import calibration_graph, saved_testbed
    saved, topology = saved_testbed(prefix, config, run)
    profile = saved if profile is None else profile
    if network:
        profile = dataclasses.replace(profile, network=dataclasses.replace(profile.network, **network))
    analysis = prepare(calibration_graph(spec, batch), topology, batch_size=batch, profile=profile, name=label)
    sim = analysis.simulator()
    out = {n: sim.evaluate(analysis.builtin(n), batch_size=batch).step_time for n in BUILTIN_STRATEGIES}
    out.update((name, predicted) for name, _, predicted in random_mixes(analysis, randoms, seed))
    return out
