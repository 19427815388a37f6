"""SM occupancy of GEMM-like ops: wave fill, GEMM extents from IR shapes, SM counts, the cost model's charge."""
import numpy as np
import pytest

from tag.cluster.topology import parse_topology
from tag.cost.gpu_defaults import resolve
from tag.cost.model import CostModel
from tag.cost.occupancy import gemm_extents, occupancy, tile_fill, wave_fill
from tiny import GraphBuilder


def _topo(device_type: str, tflops: float = 15.7) -> object:
    return parse_topology(f'name: "t" host {{ name: "h" address: "10.0.0.1" port: 2222 device {{ type: "{device_type}" '
                          f'kind: GPU count: 1 memory_gib: 16 peak_tflops: {tflops} memory_bandwidth_gbs: 900 }} }}')


def _bert_like_graph():
    """A BERT-large MatMul at reference batch 8 x 384 tokens (rows grow with the batch), its weight gradient
    (no batch axis: reduces over the batch) and a 1x1 convolution (NHWC)."""
    b = GraphBuilder(batch_size=8)
    b.op("x", "Placeholder", out_pe=1e3)
    b.op("w", "VarHandleOp")
    b.op("mm", "MatMul", inputs=("x", "w"), flops_pe=2 * 384 * 1024 * 1024, out_pe=1e3)
    b.op("dw", "MatMul", "backward", inputs=("x", "mm"), flops_pe=2 * 384 * 1024 * 1024, out_bytes=4e6)
    b.op("img", "Placeholder", out_pe=1e3)
    b.op("k", "VarHandleOp")
    b.op("conv", "Conv2D", inputs=("img", "k"), flops_pe=2 * 49 * 2048 * 512, out_pe=1e3)
    g = b.build()
    shapes = {"x": ((8 * 384, 1024), 0), "w": ((1024, 1024), None), "mm": ((8 * 384, 1024), 0),
              "dw": ((1024, 1024), None), "img": ((8, 7, 7, 512), 0), "k": ((1, 1, 512, 2048), None),
              "conv": ((8, 7, 7, 2048), 0)}
    for op in g.ops:
        op.outputs[0].shape, op.outputs[0].batch_axis = shapes[op.name]
    return g


def test_wave_fill_counts_idle_slots_of_the_last_wave():
    # BERT-large at batch 2: 768 x 1024 outputs = 48 tiles of 128 x 128 on 80 SMs: one wave, 60% busy
    assert wave_fill(np.array([768.0]), np.array([1024.0]), np.array([1.0]), 80)[0] == pytest.approx(0.6)
    # three full waves at batch 10 (3840 rows: 240 tiles of 128 x 128)
    assert wave_fill(np.array([3840.0]), np.array([1024.0]), np.array([1.0]), 80)[0] == pytest.approx(1.0)
    # more SMs, same problem: emptier waves
    assert wave_fill(np.array([3840.0]), np.array([1024.0]), np.array([1.0]), 108)[0] < 0.9
    # independent matrices (attention heads) share the waves
    assert wave_fill(np.array([128.0]), np.array([128.0]), np.array([80.0]), 80)[0] == pytest.approx(1.0)


def test_gemm_extents_scale_rows_with_the_batch_and_skip_weight_gradients():
    g = _bert_like_graph()
    ext = gemm_extents(g)
    index = {op.name: i for i, op in enumerate(g.ops)}
    at2, at10 = occupancy(ext, 2, 80), occupancy(ext, 10, 80)
    assert at2[index["mm"]] == pytest.approx(0.6) and at10[index["mm"]] == pytest.approx(1.0)
    assert at2[index["dw"]] == 1.0                     # split-K over the batch: full waves
    assert at2[index["x"]] == 1.0                      # not a GEMM
    assert at2[index["conv"]] < at10[index["conv"]] <= 1.0     # 2 x 49 rows x 2048 channels
    assert np.all(occupancy(ext, 2, 0) == 1.0)         # SMs unknown: nothing charged


def test_sm_counts_come_from_the_spec_sheets():
    assert resolve("Tesla V100-SXM2-16GB").sm_count(15.7e12) == 80
    assert resolve("A100-SXM4-40GB").sm_count(19.5e12) == 108
    assert resolve("Quadro RTX 8000").sm_count(16.3e12) == 72          # the family's reference card
    assert resolve("Quadro RTX 4000").sm_count(7.1e12) == 31           # scaled by FP32 peak (36 in fact)
    assert resolve("RTX A6000").sm_count(38.7e12) == 84
    assert resolve("RTX 2080").sm_count(10.1e12) == round(68 * 10.1 / 13.4)   # the class's count, scaled


def test_cost_model_charges_occupancy_on_shipped_gpu_classes_only():
    g = _bert_like_graph()
    mm = next(i for i, op in enumerate(g.ops) if op.name == "mm")
    v100 = CostModel(g, _topo("V100"))
    # compute-bound: the same per-example time at batch 10, 1/0.6 of it at batch 2 (one wave 60% busy)
    per_example = [v100.op_times(0, b)[mm] - v100.rates(0).launch_overhead_s for b in (2, 10)]
    assert per_example[0] / 2 == pytest.approx(per_example[1] / 10 / 0.6, rel=1e-6)
    unknown = CostModel(g, _topo("MysteryGPU"))
    assert unknown.rates(0).sms == 0
    t = [unknown.op_times(0, b)[mm] - unknown.rates(0).launch_overhead_s for b in (2, 10)]
    assert t[0] / 2 == pytest.approx(t[1] / 10, rel=1e-6)


def _conv_graph(dtype: str, channels: int):
    """A 3x3 convolution at reference batch 8 on 17x17 maps, 192 input and CHANNELS output channels (NHWC),
    its input gradient and its weight gradient, in DTYPE."""
    size = 2 if dtype == "half" else 4
    b = GraphBuilder(batch_size=8)
    b.op("img", "Placeholder", out_pe=17 * 17 * 192 * size, dtype=dtype)
    b.op("k", "VarHandleOp", dtype=dtype)
    flops_pe = 2 * 17 * 17 * channels * 9 * 192
    b.op("conv", "Conv2D", inputs=("img", "k"), flops_pe=flops_pe, out_pe=17 * 17 * channels * size, dtype=dtype)
    b.op("dx", "Conv2DBackpropInput", "backward", inputs=("k", "conv"), flops_pe=flops_pe,
         out_pe=17 * 17 * 192 * size, dtype=dtype)
    b.op("dk", "Conv2DBackpropFilter", "backward", inputs=("img", "conv"), flops_pe=flops_pe,
         out_bytes=9 * 192 * channels * size, dtype=dtype)
    g = b.build()
    shapes = {"img": ((8, 17, 17, 192), 0), "k": ((3, 3, 192, channels), None), "conv": ((8, 17, 17, channels), 0),
              "dx": ((8, 17, 17, 192), 0), "dk": ((3, 3, 192, channels), None)}
    for op in g.ops:
        op.outputs[0].shape, op.outputs[0].batch_axis = shapes[op.name]
    return g


def test_tile_quantization_charges_the_unfilled_part_of_the_last_tile_along_n():
    rows = np.array([256.0 * 80 * 4 * 64])       # whole waves of every tile
    # 48 channels: the best tiles are 64 wide, 3/4 busy; 64 and 192 fill them exactly; 80 needs two (5/8)
    for n, fill in ((48, 0.75), (64, 1.0), (192, 1.0), (80, 0.625), (160, 160 / 192)):
        padded = wave_fill(rows, np.array([float(n)]), np.array([1.0]), 80, pad_n=np.array([True]))[0]
        assert padded == pytest.approx(fill)
        assert wave_fill(rows, np.array([float(n)]), np.array([1.0]), 80)[0] == pytest.approx(1.0)
    # a weight gradient's output (kernel input side x output channels): padding in both sides, no waves
    assert tile_fill(np.array([9 * 192.0]), np.array([48.0]))[0] == pytest.approx(0.75)
    assert tile_fill(np.array([896.0]), np.array([128.0]))[0] == pytest.approx(1.0)


def test_occupancy_charges_tile_padding_only_on_ops_marked_as_tensor_core_ops():
    g = _conv_graph("half", 48)
    ext = gemm_extents(g)
    index = {op.name: i for i, op in enumerate(g.ops)}
    on_tc = np.ones(len(g.ops), dtype=bool)
    plain, padded = occupancy(ext, 8192, 80), occupancy(ext, 8192, 80, tensor=on_tc)     # nearly whole waves
    assert padded[index["conv"]] == pytest.approx(0.75, rel=1e-2)         # 48 of 64 channels per tile
    assert plain[index["conv"]] == pytest.approx(1.0, rel=1e-2)
    assert padded[index["dx"]] == pytest.approx(1.0, rel=1e-2)            # 192 input channels: full tiles
    assert padded[index["dk"]] == pytest.approx(0.75) and plain[index["dk"]] == 1.0


def test_cost_model_charges_tile_padding_on_tensor_cores_only():
    conv = 2
    half, fp32 = _conv_graph("half", 48), _conv_graph("float32", 48)
    half64 = _conv_graph("half", 64)

    def per_channel(g, topo, **kw) -> float:
        cm = CostModel(g, topo, **kw)
        return (cm.op_times(0, 256)[conv] - cm.rates(0).launch_overhead_s) / g.ops[conv].outputs[0].shape[-1]

    v100 = _topo("V100")
    # in half precision (tensor cores) 48 channels cost what 64 do; in FP32 they cost 48/64 of them
    assert per_channel(half, v100) == pytest.approx(per_channel(half64, v100) * 64 / 48, rel=1e-2)
    assert per_channel(fp32, v100) == pytest.approx(per_channel(_conv_graph("float32", 64), v100), rel=1e-2)
    # TF32 runs FP32 convolutions on an A100's tensor cores: charged there, not on the FP32 units
    a100 = _topo("A100-SXM4-40GB", 19.5)
    tf32 = per_channel(fp32, a100, tf32=True) / per_channel(_conv_graph("float32", 64), a100, tf32=True)
    assert tf32 == pytest.approx(64 / 48, rel=1e-2)
    # a GPU without tensor cores (P100) runs half convolutions on its ordinary units: no tile padding
    p100 = _topo("P100-SXM2", 10.6)
    assert per_channel(half, p100) == pytest.approx(per_channel(half64, p100), rel=1e-2)
