"""bench_fidelity's figure code (scripts/_fidelity_figures.py) on given rows: the class split, the held-out
split, regret with and without the tuning step, targets. No testbed."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from _fidelity_figures import (case_class, check_targets, class_table, group_figures, split_heldout,  # noqa: E402
                               summary, worst_of)


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
    from _fidelity_figures import rows_to_confirm, summary
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


def test_recipe_heldout_part_is_frozen_apart_from_the_calibration():
    from _testbed_cases import heldout, load_recipe, main_configs
    recipe = load_recipe()
    configs, models = heldout(recipe)
    assert configs == ["H"] and len(models) == 2 and "about" in recipe["heldout"]
    assert recipe["configs"]["H"]["quotas"] == [0.75, 0.5, 0.25]
    assert "H" not in main_configs(recipe) and {"A", "B"} <= set(main_configs(recipe))
    assert not set(models) & set(recipe["calibration"]["models"])       # the calibration never sees them


def test_transformer_vocabulary_knob_and_model_spec_options():
    from _testbed_cases import calibration_graph
    gd = calibration_graph("mwms:transformer,width=16,depth=1,vocab=300", 4)
    shapes = [[d.size for d in n.attr["shape"].shape.dim] for n in gd.node if n.op in ("VarHandleOp", "VariableV2")]
    assert [300, 16] in shapes and [1000, 16] not in shapes
    with pytest.raises(ValueError, match="unknown option"):
        calibration_graph("mwms:transformer,heads=2", 4)


def test_one_host_split_adds_up_to_the_prediction_and_levelled_applies_a_fit():
    """runtime_levels' split of a predicted one-host step: the family parts plus the launch overheads of the
    charged ops plus the runtime's step overhead are the simulated step; a fit applied with ``levelled``
    moves the prediction exactly as the fitted line says."""
    from _testbed_cases import calibration_graph, levelled, one_host_split
    from tag.api import prepare
    from tag.cluster.topology import parse_topology
    from tag.cost.model import DeviceProfile, NetworkProfile, Profile
    from tag.strategy.baselines import on_one_device
    topo = parse_topology('host { name: "h0" address: "127.0.0.1" port: 1 device { type: "CPU" kind: CPU '
                          'count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 } }\n', path="<t>")
    prof = Profile({"CPU": DeviceProfile(5e10, 1e10, 2e-5, {"default": 0.3}, family_scale={"conv": 0.5})},
                   network=NetworkProfile(step_overhead_s=1e-3))
    an = prepare(calibration_graph("mwms:cnn,width=4", 4), topo, batch_size=4, profile=prof, name="t")
    [(predicted, ops, parts)] = one_host_split(an, prof, 4, [0])
    assert parts[0] > 0 and parts[2] > 0 and ops > 10
    assert predicted == pytest.approx(sum(parts) + ops * 2e-5 + 1e-3, rel=1e-6)
    scales = {"conv": 0.8, "matmul": 1.0, "other": 1.5}
    after = Profile({"CPU": levelled(prof.devices["CPU"], scales, 5e-6)}, network=prof.network)
    assert after.devices["CPU"].family_scale == pytest.approx({"conv": 0.4, "matmul": 1.0, "other": 1.5})
    [(moved, _, _)] = one_host_split(an, after, 4, [0])
    expected = predicted + (0.8 - 1) * parts[0] + (1.5 - 1) * parts[2] + 5e-6 * ops
    assert moved == pytest.approx(expected, rel=1e-6)


def test_levels_under_load_are_fitted_per_type_and_never_faster_than_alone():
    """runtime_levels(under_load=True)'s second fit: points timed with the other hosts busy, fitted as the alone
    points are; a family scale or overhead that came out below the alone fit's is raised to it."""
    from _testbed_cases import _fit_levels_per_type, _no_faster
    from tag.cost.model import DeviceProfile
    base = {"CPU": DeviceProfile(5e10, 1e10, 2e-5, {"default": 0.3})}
    # three predicted steps (conv, matmul, other parts; charged ops), measured at 1.5x the parts + 10 us/op more
    parts = [[2e-3, 3e-3, 1e-3], [8e-3, 12e-3, 4e-3], [1e-3, 1e-3, 1e-3]]
    ops = [100.0, 400.0, 900.0]
    fixed = [2e-5 * n + 1e-3 for n in ops]                       # launch overheads and the step overhead
    pts = {"CPU": [(sum(p) + f, n, p, 1.5 * sum(p) + f + 1e-5 * n) for p, n, f in zip(parts, ops, fixed)]}
    out, record = {}, {}
    notes = _fit_levels_per_type(pts, base, out, False, record, "under load")
    assert "CPU (under load)" in notes[0] and record["CPU"]["measured_s"] == [x[3] for x in pts["CPU"]]
    assert out["CPU"].family_scale == pytest.approx({"conv": 1.5, "matmul": 1.5, "other": 1.5}, rel=0.02)
    assert out["CPU"].launch_overhead_s == pytest.approx(2e-5 + 1e-5, rel=0.05)
    alone = DeviceProfile(5e10, 1e10, 4e-5, {"default": 0.3}, family_scale={"conv": 2.0, "matmul": 1.0})
    floored = _no_faster(out["CPU"], alone)
    assert floored.family_scale == pytest.approx({"conv": 2.0, "matmul": 1.5, "other": 1.5}, rel=0.02)
    assert floored.launch_overhead_s == 4e-5


def test_fading_levels_are_fitted_alone_and_applied_under_load_at_the_same_length():
    """fit_alone_and_loaded(fade=True): one scale that fades for long kernels, its length fitted on the alone
    points (from each step's per-op rooflines, ``one_host_rooflines``) and reused for the loaded points."""
    from _testbed_cases import calibration_graph, fit_alone_and_loaded, one_host_rooflines, one_host_split
    from tag.api import prepare
    from tag.cluster.topology import parse_topology
    from tag.cost.fitting import faded_part
    from tag.cost.model import DeviceProfile, NetworkProfile, Profile
    topo = parse_topology('host { name: "h0" address: "127.0.0.1" port: 1 device { type: "CPU" kind: CPU '
                          'count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 } }\n', path="<t>")
    prof = Profile({"CPU": DeviceProfile(5e10, 1e10, 2e-5, {"default": 0.3})},
                   network=NetworkProfile(step_overhead_s=1e-3))
    alone, loaded = {"CPU": []}, {"CPU": []}
    for spec in ("mwms:cnn,width=4", "zoo:mlp,input_dim=30,hidden=64x512,num_classes=4"):
        for b in (2, 8, 64):
            an = prepare(calibration_graph(spec, b), topo, batch_size=b, profile=prof, name="t")
            [(predicted, ops, parts)] = one_host_split(an, prof, b, [0])
            [roof] = one_host_rooflines(an, prof, b, [0])
            assert roof.sum() == pytest.approx(sum(parts), rel=1e-6)
            alone["CPU"].append((predicted, ops, parts, predicted + 0.5 * faded_part(roof, 3e-4), roof))
            loaded["CPU"].append((predicted, ops, parts, predicted + 1.0 * faded_part(roof, 3e-4), roof))
    record = {}
    devices, under, notes = fit_alone_and_loaded(alone, loaded, prof.devices, False, record, fade=True)
    assert devices["CPU"].level_fade_s == under["CPU"].level_fade_s == 3e-4
    assert devices["CPU"].family_scale["matmul"] == pytest.approx(1.5, rel=0.01)
    assert under["CPU"].family_scale["conv"] == pytest.approx(2.0, rel=0.01)
    assert record["CPU"]["faded"]["fade_s"] == 3e-4 and "one fading scale" in notes[0]
    # without fade the same points give one full scale and no fade length
    devices, _, _ = fit_alone_and_loaded(alone, loaded, prof.devices, False)
    assert devices["CPU"].level_fade_s is None


def test_the_load_ratio_is_the_median_of_each_pair_s_loaded_over_alone():
    """Each loaded step is divided by the alone step timed just before it; one disturbed pair does not move
    the median."""
    from _testbed_cases import paired_load_ratio
    assert paired_load_ratio([0.100, 0.150, 0.120], [0.110, 0.165, 0.500]) == pytest.approx(1.10)
    assert paired_load_ratio([0.2, 0.1], [0.1, 0.2]) == pytest.approx(1.25)      # the median of 0.5 and 2.0


def test_repredict_network_overrides_name_known_fields_only():
    """``fidelity_repredict --network KEY=VALUE``: known NetworkProfile fields become floats; an unknown field,
    a missing '=' or a value that is not a number is refused with the option named."""
    from fidelity_repredict import network_overrides
    assert network_overrides(["collective_latency_s=0.00105", "per_tensor_s=7e-5"]) == {
        "collective_latency_s": 0.00105, "per_tensor_s": 7e-5}
    assert network_overrides([]) == {}
    for bad in ("latency=1", "collective_latency_s", "collective_latency_s=fast"):
        with pytest.raises(ValueError, match="--network"):
            network_overrides([bad])
