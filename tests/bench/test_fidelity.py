"""tag_bench.fidelity, bench_fidelity's figure code, on given rows: the class split, the held-out split, regret
with and without the tuning step, targets. No testbed."""
import pytest

from tag_bench.fidelity import case_class, check_targets, class_table, group_figures, split_heldout, summary, worst_of


def row(config, model, strategy, predicted_ms, measured_ms, heldout=False, **kw):
    return {"config": config, "model": model, "strategy": strategy, "class": case_class(strategy),
            "heldout": heldout, "predicted_s": predicted_ms / 1e3, "measured_s": measured_ms / 1e3, **kw}


def test_case_classes():
    assert [case_class(n) for n in ("dp_allreduce", "ps", "single", "partition", "plan:refine", "random2",
                                    "tuned:best_uniform")] == ["uniform"] * 4 + ["searched", "random", "tuned"]
    with pytest.raises(ValueError):
        case_class("mystery")


def test_errors_split_by_class_and_mixed():
    rows = [row("A", "m", "single", 110, 100),          # +10%
            row("A", "m", "dp_allreduce", 150, 200),    # -25%
            row("A", "m", "plan:refine", 80, 100),      # -20%
            row("A", "m", "random0", 330, 300),         # +10%
            row("A", "m", "random1", 400, 500)]         # -20%
    s = summary(rows)
    assert s["cases"] == 5 and s["mixed_cases"] == 3
    assert s["cases_uniform"] == 2 and s["cases_searched"] == 1 and s["cases_random"] == 2 and s["cases_tuned"] == 0
    assert s["median_abs_rel_error"] == pytest.approx(0.20)
    assert s["median_abs_rel_error_mixed"] == pytest.approx(0.20)
    assert s["max_abs_rel_error_mixed"] == pytest.approx(0.20)
    assert s["median_abs_rel_error_uniform"] == pytest.approx(0.175)
    assert s["max_abs_rel_error_uniform"] == pytest.approx(0.25)
    assert s["median_abs_rel_error_random"] == pytest.approx(0.15)
    assert s["median_abs_rel_error_tuned"] is None and s["max_regret_tuned"] is None
    table = class_table(s, "t")
    assert "\n  searched " in table and "\n  tuned " not in table


def test_regret_and_tuned_regret_from_rows():
    # predicted best: plan (80) which measures 130; measured best: single (100) -> regret 1.3
    g = [row("A", "m", "single", 120, 100), row("A", "m", "ps", 150, 160),
         row("A", "m", "plan:refine", 80, 130), row("A", "m", "random0", 200, 250, tuned_pick=True)]
    f = group_figures(g)
    assert f["regret"] == pytest.approx(1.3) and f["regret_tuned"] == pytest.approx(2.5)
    assert f["predicted_best"] == "plan:refine" and f["measured_best"] == "single" and not f["top1"]
    # the tuning step kept a strategy none of the cases is: its row (class tuned) is the best measured, which
    # moves the untuned regret's denominator but not the predicted best or Kendall's tau
    g2 = [dict(r, tuned_pick=False) for r in g] + [row("A", "m", "tuned:best_uniform", 90, 95, tuned_pick=True)]
    f2 = group_figures(g2)
    assert f2["regret_tuned"] == pytest.approx(1.0) and f2["regret"] == pytest.approx(130 / 95)
    assert f2["predicted_best"] == "plan:refine" and f2["kendall_tau"] == pytest.approx(f["kendall_tau"])
    assert f2["cases"] == 5 and f2["tuned_pick"] == "tuned:best_uniform"
    with pytest.raises(ValueError):
        group_figures([dict(r, tuned_pick=True) for r in g])


def test_regret_from_the_confirmation_measurement_when_a_pick_is_not_the_best():
    """The picks and the best measured are timed again side by side (``confirm_s``); the regret is their ratio,
    the first measurement's kept as ``regret_raw``. No confirmation when both picks are the best measured."""
    from tag_bench.fidelity import rows_to_confirm
    g = [row("B", "cnn", "single", 106, 107), row("B", "cnn", "dp_allreduce", 102, 121),
         row("B", "cnn", "plan:refine", 88, 141, tuned_pick=True), row("B", "cnn", "random0", 900, 990)]
    todo = rows_to_confirm(g)
    assert [r["strategy"] for r in todo] == ["single", "plan:refine"]
    confirmed = [dict(r, confirm_s={"single": 0.120, "plan:refine": 0.132}.get(r["strategy"])) for r in g]
    f = group_figures(confirmed)
    assert f["regret"] == pytest.approx(1.1) and f["regret_tuned"] == pytest.approx(1.1) and f["confirmed"]
    assert f["regret_raw"] == pytest.approx(141 / 107) and f["regret_tuned_raw"] == pytest.approx(141 / 107)
    # the first measurement's best was a low draw: the pick is confirmed as fast
    tie = [dict(r, confirm_s={"single": 0.125, "plan:refine": 0.124}.get(r["strategy"])) for r in g]
    assert group_figures(tie)["regret"] == pytest.approx(1.0)
    s = summary(confirmed)
    assert s["max_regret"] == pytest.approx(1.1) and s["max_regret_raw"] == pytest.approx(141 / 107)
    # the tuning step kept another case than the predicted best: all three are confirmed
    three = [dict(r, tuned_pick=r["strategy"] == "dp_allreduce") for r in g]
    assert [r["strategy"] for r in rows_to_confirm(three)] == ["single", "plan:refine", "dp_allreduce"]
    assert rows_to_confirm([dict(r, tuned_pick=r["strategy"] == "single") for r in g[:1]]) == []


def test_kendall_tau_mean_is_per_group():
    same = [row("A", "m", n, p, p) for n, p in (("single", 1), ("ps", 2), ("dp_allreduce", 3))]
    reversed_ = [row("B", "m", n, p, 4 - p) for n, p in (("single", 1), ("ps", 2), ("dp_allreduce", 3))]
    s = summary(same + reversed_, {("A", "m"): {"tune_seconds": 2.0}, ("B", "m"): {"tune_seconds": 3.0}})
    assert [g["kendall_tau"] for g in s["groups"]] == pytest.approx([1.0, -1.0])
    assert s["mean_kendall_tau"] == pytest.approx(0.0) and s["tune_seconds"] == pytest.approx(5.0)
    assert s["max_regret"] == pytest.approx(3.0) and s["top1_agreement"] == pytest.approx(0.5)


def test_heldout_split_and_targets():
    rest = [row("A", "m", n, p, m) for n, p, m in (("single", 100, 100), ("ps", 200, 190), ("plan:x", 50, 55),
                                                    ("random0", 300, 280))]
    rest[2]["tuned_pick"] = True                                       # the plan: measured best
    held = [row("H", "vgg", n, p, m, heldout=True) for n, p, m in (("single", 100, 100), ("ps", 250, 200),
                                                                   ("random0", 300, 200))]
    held[0]["tuned_pick"] = True
    r, h = split_heldout(rest + held)
    assert r == rest and h == held
    fr, fh = summary(r), summary(h)
    checks = {k: ok for k, _, _, ok in check_targets(fr, fh)}
    assert not checks["cases"] and not checks["mixed_cases"]           # 4 cases, 2 mixed
    assert checks["median_abs_rel_error"] and checks["max_regret_tuned"]
    assert not checks["heldout.max_abs_rel_error_mixed"]                # 50% against 9%
    assert checks["heldout.max_regret_tuned"]                           # 1.0 and 1.0
    assert checks["heldout.max_regret"]                                 # both groups' predicted best is measured best
    # a group whose tuning step failed (no pick): the tuned regret is not held, whatever the others say
    other = [row("B", "m", n, p, p) for n, p in (("single", 1), ("ps", 2))]
    assert not {k: ok for k, _, _, ok in check_targets(summary(r + other), None)}["max_regret_tuned"]


def test_worst_of_runs():
    runs = [{"cases": 60, "median_abs_rel_error": 0.08, "mean_kendall_tau": 0.9, "max_regret_tuned": None},
            {"cases": 58, "median_abs_rel_error": 0.11, "mean_kendall_tau": 0.8, "max_regret_tuned": None}]
    assert worst_of(runs) == {"cases": 58, "median_abs_rel_error": 0.11, "mean_kendall_tau": 0.8,
                              "max_regret_tuned": None}
