"""tag_bench.cases without a testbed: the background runner that keeps hosts busy (``BackgroundSteps``, on
in-process sessions), the calibration's share rounds, the recipe's configurations as topologies, the held-out
part, the calibration models and the runtime levels' fits."""
import time

import pytest

from tag.cost.model import DeviceProfile, Profile
from tag_bench.cases import BackgroundSteps


def counter_graph():
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        v = tf.Variable(0.0, name="v")
        v.assign_add(1.0, name="step")
        tf.compat.v1.variables_initializer([v], name="init")
    return g.as_graph_def()


def test_background_steps_run_until_exit():
    with BackgroundSteps(counter_graph(), "", train_op="step", loss=None, timeout_s=60) as busy:
        assert busy.steps >= 1
        time.sleep(0.3)
    done = busy.steps
    assert done > 1 and not busy.thread.is_alive()
    time.sleep(0.1)
    assert busy.steps == done


def test_background_steps_report_a_failed_run():
    with pytest.raises(RuntimeError, match="background steps failed"):
        with BackgroundSteps(counter_graph(), "", train_op="no_such_op", loss=None, timeout_s=60):
            pass


def test_rounds_disagree_when_a_quota_spreads_beyond_the_limit():
    from tag_bench.cases import rounds_disagree
    assert rounds_disagree({0: [0.93, 1.26], 1: [0.49, 0.49]}, 0.15)          # run 26's full core: 30% apart
    assert not rounds_disagree({0: [0.98, 1.01], 1: [0.49, 0.486]}, 0.15)
    assert not rounds_disagree({0: [0.5]}, 0.0)                               # one round cannot disagree
    assert not rounds_disagree({0: [0.93, 1.26]}, float("inf"))               # no limit set: never


def test_recipe_heldout_part_is_frozen_apart_from_the_calibration():
    from tag_bench.cases import heldout, load_recipe, main_configs
    recipe = load_recipe()
    configs, models = heldout(recipe)
    assert configs == ["H"] and len(models) == 2 and "about" in recipe["heldout"]
    assert recipe["configs"]["H"]["quotas"] == [0.75, 0.5, 0.25]
    assert "H" not in main_configs(recipe) and {"A", "B"} <= set(main_configs(recipe))
    assert not set(models) & set(recipe["calibration"]["models"])       # the calibration never sees them


def test_transformer_vocabulary_knob_and_model_spec_options():
    from tag_bench.cases import calibration_graph
    gd = calibration_graph("mwms:transformer,width=16,depth=1,vocab=300", 4)
    shapes = [[d.size for d in n.attr["shape"].shape.dim] for n in gd.node if n.op in ("VarHandleOp", "VariableV2")]
    assert [300, 16] in shapes and [1000, 16] not in shapes
    with pytest.raises(ValueError, match="unknown option"):
        calibration_graph("mwms:transformer,heads=2", 4)


def test_one_host_split_adds_up_to_the_prediction_and_levelled_applies_a_fit():
    """runtime_levels' split of a predicted one-host step: the family parts plus the launch overheads of the
    charged ops plus the runtime's step overhead are the simulated step; a fit applied with ``levelled``
    moves the prediction exactly as the fitted line says."""
    from tag.api import prepare
    from tag.cluster.topology import parse_topology
    from tag.cost.model import DeviceProfile, NetworkProfile, Profile
    from tag_bench.cases import calibration_graph, levelled, one_host_split
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
    from tag.cost.model import DeviceProfile
    from tag_bench.cases import _fit_levels_per_type, _no_faster
    base = {"CPU": DeviceProfile(5e10, 1e10, 2e-5, {"default": 0.3})}
    # three predicted steps (conv, matmul, other parts; charged ops), measured at 1.5x the parts + 10 us/op more
    parts = [[2e-3, 3e-3, 1e-3], [8e-3, 12e-3, 4e-3], [1e-3, 1e-3, 1e-3]]
    ops = [100.0, 400.0, 900.0]
    fixed = [2e-5 * n + 1e-3 for n in ops]                       # launch overheads and the step overhead
    pts = {"CPU": [(sum(p) + f, n, p, 1.5 * sum(p) + f + 1e-5 * n) for p, n, f in zip(parts, ops, fixed, strict=True)]}
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
    from tag.api import prepare
    from tag.cluster.topology import parse_topology
    from tag.cost.fitting import faded_part
    from tag.cost.model import DeviceProfile, NetworkProfile, Profile
    from tag_bench.cases import calibration_graph, fit_alone_and_loaded, one_host_rooflines, one_host_split
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
    from tag_bench.cases import paired_load_ratio
    assert paired_load_ratio([0.100, 0.150, 0.120], [0.110, 0.165, 0.500]) == pytest.approx(1.10)
    assert paired_load_ratio([0.2, 0.1], [0.1, 0.2]) == pytest.approx(1.25)      # the median of 0.5 and 2.0


def test_testbed_recipe_and_topology_from_profiled_quotas():
    """The recipe's configurations become three-host topologies whose device speeds are the profile's."""
    from tag_bench.cases import all_quotas, device_type, load_recipe, testbed_topology
    recipe = load_recipe()
    quotas = all_quotas(recipe)
    prof = Profile(devices={device_type(q): DeviceProfile(4e10 * q, 1e10 * q, 1e-5, {}) for q in quotas})
    _, topo = testbed_topology(recipe, "A", prof)
    assert len(topo.hosts) == 3 and [d.device_type for d in topo.devices] == ["CPUq100", "CPUq50", "CPUq25"]
    assert [g.peak_flops for g in topo.groups] == pytest.approx([4e10, 2e10, 1e10])
    assert topo.host_bandwidth[0, 1] == pytest.approx(1e9 / 8) and topo.host_bandwidth[1, 2] == pytest.approx(0.2e9 / 8)




def test_gpu_ratio_links_keep_a_v100s_bytes_per_flop():
    """Configuration G's links: 25 Gbit/s per 15 TFLOP/s, scaled to the full-core host's calibrated FLOP/s."""
    from tag_bench.cases import gpu_ratio_link_gbps
    prof = Profile(devices={"CPUq100": DeviceProfile(20e9, 1e10, 1e-5, {})})
    assert gpu_ratio_link_gbps(prof, 1.0, 25.0) == pytest.approx(25.0 * 20e9 / 15e12)
