"""Shipped GPU profiles: they load, device types find their class, op classes shape the cost, reports name them."""
import dataclasses
import json
import math

import numpy as np
import pytest

from tag.cluster.topology import parse_topology
from tag.cost.gpu_defaults import (
    DATA_PATH,
    HALF_RATE_CAP,
    describe_device_type,
    gpu_profiles,
    load_gpu_profiles,
    normalise,
    resolve,
)
from tag.cost.model import CostModel, DeviceProfile, Profile, device_profiles
from tag.cost.op_classes import op_classes
from tag.errors import TagError
from tiny import GraphBuilder

REQUIRED = ("V100", "A100", "H100", "P100", "T4", "GTX1080Ti", "RTX2080Ti", "RTX3090")


def _topo(device_type: str, n: int = 1, tflops: float = 15.7, gbs: float = 900, kind: str = "NVLINK") -> object:
    link = f"interconnect {{ kind: {kind} bandwidth_gbs: 100 latency_us: 2 }}" if n > 1 else ""
    return parse_topology(f'name: "t" host {{ name: "h" address: "10.0.0.1" port: 2222 device {{ type: "{device_type}" '
                          f'kind: GPU count: {n} memory_gib: 16 peak_tflops: {tflops} memory_bandwidth_gbs: {gbs} }} '
                          f'{link} }}')


def _conv_graph():
    """Two convolutions with the same FLOPs: a 3x3 stride-1 and a 1x1 (shapes as the frontend records them)."""
    b = GraphBuilder(batch_size=8)
    shapes = {}
    for name, typ, inputs, flops_pe, shape in (("x", "Placeholder", (), 0.0, (8, 56, 56, 64)),
                                               ("w3", "VarHandleOp", (), 0.0, (3, 3, 64, 64)),
                                               ("w1", "VarHandleOp", (), 0.0, (1, 1, 64, 576)),
                                               ("c3", "Conv2D", ("x", "w3"), 1e9, (8, 56, 56, 64)),
                                               ("c1", "Conv2D", ("x", "w1"), 1e9, (8, 56, 56, 576))):
        b.op(name, typ, inputs=inputs, flops_pe=flops_pe, out_pe=1e3 if typ != "VarHandleOp" else 0.0)
        shapes[name] = shape
    g = b.build()
    for op in g.ops:
        op.outputs[0].shape = shapes[op.name]
    return g


def test_shipped_profiles_load_with_every_required_class():
    prof = load_gpu_profiles()
    assert set(REQUIRED) <= set(prof.classes)
    for name in REQUIRED:
        c = prof.classes[name]
        assert c.basis and 0 < c.memory_efficiency <= 1 and 0 < c.launch_overhead_s < 1e-3
        assert {"conv:3x3s1", "conv:1x1", "matmul", "default"} <= set(c.efficiency)
    for kind in ("NVLINK", "PCIE", "NETWORK", "INTERCONNECT_UNSPECIFIED"):
        assert 0 < prof.collective(kind).bandwidth_efficiency <= 1
    assert 0 <= prof.lockstep_per_doubling < 0.2
    with open(DATA_PATH, encoding="utf-8") as f:
        assert json.load(f)["precision"] == "fp32"


@pytest.mark.parametrize("name, cls, exact", [
    ("V100", "V100", True), ("Tesla V100-SXM2-16GB", "V100", True), ("A100-80G", "A100", True),
    ("H100", "H100", True), ("P100-SXM2", "P100", True), ("Tesla T4", "T4", True), ("GTX1080Ti", "GTX1080Ti", True),
    ("RTX 2080 Ti", "RTX2080Ti", True), ("RTX3090", "RTX3090", True),
    ("Titan V", "V100", False), ("RTX A6000", "RTX3090", False), ("Quadro RTX 8000", "RTX2080Ti", False),
    ("A10G", "RTX3090", False), ("GTX 1080", "GTX1080Ti", False), ("H800", "H100", True),
])
def test_device_types_find_their_class(name, cls, exact):
    r = resolve(name)
    assert r is not None and r.cls.name == cls and r.exact is exact


def test_unknown_names_keep_the_builtin_defaults():
    assert resolve("GPU-A") is None and resolve("CPU") is None and resolve("") is None
    assert normalise("Tesla V100-SXM2_16GB") == "v100sxm216gb"


def test_gpu_without_own_profile_gets_nearest_class_scaled_by_its_spec_sheet():
    g = _conv_graph()
    titan = CostModel(g, _topo("TitanV", tflops=14.9, gbs=652))      # no class of its own: V100's, scaled
    v100 = CostModel(g, _topo("V100"))
    rt, rv = titan.rates(0), v100.rates(0)
    assert rt.efficiency == rv.efficiency                               # the nearest class's efficiencies
    assert rt.peak_flops == pytest.approx(14.9e12) and rv.peak_flops == pytest.approx(15.7e12)   # own spec sheet
    assert rt.memory_bandwidth / 652e9 == pytest.approx(rv.memory_bandwidth / 900e9)
    c1 = g.op_index["c1"]
    assert titan.op_times(0, 8)[c1] > v100.op_times(0, 8)[c1]           # slower peak, slower op
    assert "nearest class for Titan V" in titan.profile_source(0)
    assert "scaled by its spec sheet" in titan.profile_source(0)
    assert v100.profile_source(0) == "shipped GPU profile V100"


def test_conv3x3_costs_less_per_flop_than_1x1_under_gpu_defaults():
    g = _conv_graph()
    keys = op_classes(g)
    c3, c1 = g.op_index["c3"], g.op_index["c1"]
    assert keys[c3] == "conv:3x3s1" and keys[c1] == "conv:1x1"
    for gpu in ("V100", "A100", "GTX1080Ti", "T4"):
        t = CostModel(g, _topo(gpu)).op_times(0, 8)
        flops = g.arrays().flops(8)
        assert flops[c3] == flops[c1]
        assert t[c3] / flops[c3] < t[c1] / flops[c1], gpu


def test_exact_profile_entry_still_wins_and_cpu_keeps_builtin():
    g = _conv_graph()
    prof = Profile({"V100": DeviceProfile(efficiency={"Conv2D": 0.5, "default": 0.5}, launch_overhead_s=0.0)})
    cm = CostModel(g, _topo("V100"), prof)
    assert cm.rates(0).efficiency_for("Conv2D", "conv:3x3s1") == 0.5
    assert cm.profile_source(0) == "profile entry V100"
    cpu = parse_topology('name: "c" host { name: "h" address: "127.0.0.1" port: 1 device { type: "CPU" kind: CPU '
                         'count: 1 memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 } }')
    assert CostModel(g, cpu).rates(0).efficiency_of("Conv2D") == 0.5
    assert describe_device_type("CPU", "CPU") == "built-in CPU defaults"


def test_nccl_defaults_slow_collectives_of_known_gpus_only():
    g = _conv_graph()
    known = CostModel(g, _topo("V100", n=8, kind="NVLINK"))
    (a, b), _ = known.allreduce_coeffs(range(8))
    eff = gpu_profiles().collective("NVLINK").bandwidth_efficiency
    assert b == pytest.approx(2 * 7 / 8 / (100e9 * eff))
    plain = CostModel(g, _topo("GPU-A", n=8, kind="NVLINK"))
    (a2, b2), _ = plain.allreduce_coeffs(range(8))
    assert b2 == pytest.approx(2 * 7 / 8 / 100e9) and a2 == pytest.approx(14 * 2e-6)


def test_tensor_core_efficiencies_share_the_class_clock_scale_not_the_fp32_dual_issue():
    """Tensor-core efficiencies are the V100-fitted ones x the class's tensor scale: the RTX 2080 Ti's fitted
    FP32 scale (sustained clock), the RTX 3090 the same (its 0.65 FP32 factor is GA102's dual issue), A100 1."""
    prof = gpu_profiles()
    v100, ti, rtx3090, a100 = (prof.classes[n] for n in ("V100", "RTX2080Ti", "RTX3090", "A100"))
    with open(DATA_PATH, encoding="utf-8") as f:
        raw = json.load(f)["classes"]
    ti_scale = raw["RTX2080Ti"]["tensor_scale"]
    assert ti_scale == pytest.approx(ti.efficiency["conv:1x1"] / v100.efficiency["conv:1x1"], rel=1e-3)
    assert raw["RTX3090"]["tensor_scale"] == pytest.approx(ti_scale)
    assert raw["RTX3090"]["compute_scale"] < 0.8 * ti_scale
    # dense spec-sheet peaks over FP32: GA102 GeForce runs FP16 / BF16 with FP32 accumulation at 2x its FP32
    # peak and TF32 at 1x (whitepaper), Turing GeForce FP16 at 4x, A100 TF32 8x / FP16 16x
    assert rtx3090.peak_ratio("fp16") == pytest.approx(2.0, rel=0.01)
    assert rtx3090.peak_ratio("tf32") == pytest.approx(1.0)
    assert ti.peak_ratio("fp16") == pytest.approx(4.0, rel=0.01) and ti.peak_ratio("tf32") is None
    assert a100.peak_ratio("tf32") == pytest.approx(8.0) and a100.peak_ratio("fp16") == pytest.approx(16.0)
    for cls, scale in ((ti, ti_scale), (rtx3090, ti_scale), (a100, 1.0)):
        for table in cls.tensor_efficiency.values():
            for k, v in table.items():
                assert v == pytest.approx(min(v100.tensor_efficiency["fp16"][k] * scale, 1.0), abs=2e-4), (cls.name, k)


def test_geforce_half_rate_tensor_cores_reach_the_fitted_fraction_of_their_datapath():
    """GeForce Turing / GA102 run FP32 accumulation at half their tensor datapath's rate (whitepapers): a
    convolution the V100 holds to ~0.43 of its full-rate peak by operand feed reaches that fraction of the
    datapath's rate, i.e. twice the fraction of the half-rate peak, capped at the half-rate peak itself (not at
    a fitted efficiency: refitting the MatMul table must not change what a 3x3 convolution reaches)."""
    ti, quadro, a6000, v100 = (resolve(n) for n in ("RTX2080Ti", "Quadro-RTX-8000", "RTX-A6000", "V100"))
    raw = ti.cls.tensor_efficiency["fp16"]
    ratio = ti.cls.full_rate_peaks["fp16"] / ti.cls.peaks["fp16"]
    assert ratio == pytest.approx(2.0, rel=0.01)
    eff = ti.tensor_efficiency()["fp16"]
    for k, v in raw.items():
        assert eff[k] == pytest.approx(min(v * ratio, HALF_RATE_CAP)), k
    assert eff["conv:3x3s1"] > 1.9 * raw["conv:3x3s1"] and max(eff.values()) <= HALF_RATE_CAP
    # a lower fitted MatMul efficiency does not lower the convolutions' fraction
    low = dataclasses.replace(ti.cls, tensor_efficiency={"fp16": {**raw, "matmul": 0.3}})
    refitted = dataclasses.replace(ti, cls=low).tensor_efficiency()["fp16"]
    assert refitted["conv:3x3s1"] == pytest.approx(eff["conv:3x3s1"])
    assert set(resolve("RTX3090").tensor_efficiency()) == {"tf32", "fp16", "bf16"}
    # full-rate parts the same classes serve, and the V100, keep the fitted fractions of their own peaks
    for r in (quadro, a6000, v100):
        assert r.tensor_efficiency() == r.cls.tensor_efficiency, r.via
    # end to end: a half-precision 3x3 convolution on a 2080 Ti runs at twice the fitted fraction of 53.8 TFLOP/s
    g = _conv_graph()
    for op in g.ops:
        op.outputs[0].dtype = "half"
    c3 = g.op_index["c3"]
    rates = CostModel(g, _topo("RTX2080Ti", tflops=13.4, gbs=616)).rates(0)
    assert rates.peak_for("fp16") == pytest.approx(53.8e12, rel=0.01)
    assert rates.efficiency_for("Conv2D", op_classes(g)[c3], "fp16") == pytest.approx(eff["conv:3x3s1"])


@pytest.mark.parametrize("name, tflops, ratios", [
    # full-rate parts served by a GeForce class: their own data sheets' dense ratios (FP16 with FP32 accumulation)
    ("Quadro-RTX-8000", 16.3, {"fp16": 8.0, "tf32": None, "bf16": None}),
    ("TitanRTX", 16.3, {"fp16": 8.0, "tf32": None, "bf16": None}),
    ("RTX-A6000", 38.7, {"tf32": 2.0, "fp16": 4.0, "bf16": 4.0}),
    ("A40", 37.4, {"tf32": 2.0, "fp16": 4.0, "bf16": 4.0}),
    ("A10", 31.2, {"tf32": 2.0, "fp16": 4.0, "bf16": 4.0}),
    # GeForce parts keep their class's half-rate ratios
    ("RTX2080", 10.1, {"fp16": 4.0, "tf32": None, "bf16": None}),
    ("RTX3080", 29.8, {"tf32": 1.0, "fp16": 2.0, "bf16": 2.0}),
    ("A10G", 31.2, {"tf32": 1.0, "fp16": 2.0, "bf16": 2.0}),
])
def test_related_full_rate_parts_get_their_own_spec_sheet_tensor_peaks(name, tflops, ratios):
    """A topology naming only the type and its FP32 peak: professional Turing / Ampere cards run FP16 tensor
    cores with FP32 accumulation at twice the GeForce rate of the class serving them (data sheets)."""
    from tag.cost.precision import device_peak
    group = _topo(name, tflops=tflops).groups[0]
    for prec, ratio in ratios.items():
        want = tflops * (ratio if ratio is not None else 1.0) * 1e12     # no tensor cores for it: the FP32 peak
        assert device_peak(group, prec) == pytest.approx(want, rel=0.01), (name, prec)
    assert resolve(name).exact is False


def test_lockstep_slows_replicated_gpus():
    g = _conv_graph()
    one, eight = CostModel(g, _topo("V100")), CostModel(g, _topo("V100", n=8))
    f = 1 + gpu_profiles().lockstep_per_doubling * math.log2(8)
    assert np.allclose(eight.op_times(0, 8), one.op_times(0, 8) * f)


def test_topo_show_and_report_name_the_profile_per_device_type():
    import os

    from tag.cli.topo import format_topology
    from tag.cluster.topology import load_topology
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    topo = load_topology(os.path.join(root, "topologies", "lab-v100-1080ti.pbtxt"))
    text = format_topology(topo)
    assert "shipped GPU profile V100" in text and "shipped GPU profile GTX1080Ti" in text
    assert device_profiles(topo) == {"V100": "shipped GPU profile V100", "P100": "shipped GPU profile P100",
                                     "GTX1080Ti": "shipped GPU profile GTX1080Ti"}
    local = load_topology(os.path.join(root, "topologies", "localhost.pbtxt"))
    assert "built-in CPU defaults" in format_topology(local)


def test_report_names_profiles():
    from tag.report import build_report, format_table, predict
    from tag.strategy.grouping import group_ops
    g = _conv_graph()
    topo = _topo("RTX3090", n=2, kind="PCIE")
    grouping = group_ops(g, 8)
    cm = CostModel(g, topo)
    pred = predict(topo, g, grouping, cm, batch=8)
    report = build_report("conv", topo, grouping, "dp_allreduce", pred["results"], batch=8, cost_model=cm)
    assert report["device_profiles"] == {"RTX3090": "shipped GPU profile RTX3090"}
    assert "shipped GPU profile RTX3090" in format_table(report, "conv")


def test_malformed_gpu_profile_data_is_a_one_line_tag_error(tmp_path):
    p = tmp_path / "g.json"
    p.write_text('{"version": 1, "classes": {"X": {"patterns": ["x"], "efficiency": {"default": -1}}}}')
    with pytest.raises(TagError) as err:
        load_gpu_profiles(p)
    assert str(err.value).startswith(str(p)) and "\n" not in str(err.value)
    with pytest.raises(TagError, match="not found"):
        load_gpu_profiles(tmp_path / "missing.json")
