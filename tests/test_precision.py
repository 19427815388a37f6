"""Precision in the cost model (tag.cost.precision) and the mixed-precision graph rewrite
(tag.frontend.precision): tensor-core peaks by dtype, TF32, XLA fusion, the rewritten graph's step."""
from __future__ import annotations

import numpy as np
import pytest

from tag.cost.model import CostModel
from tag.cost.precision import fusion_bytes, op_precisions

from tiny import DeviceSpec, GraphBuilder, make_topology


def _graph(dtype: str):
    """x -> MatMul (256x256x256) -> BiasAdd -> Relu -> Identity, all in DTYPE."""
    size = 2 if dtype in ("half", "bfloat16") else 4
    b = GraphBuilder(batch_size=256)
    b.op("x", "Placeholder", out_pe=256 * size, dtype=dtype)
    b.op("mm", "MatMul", inputs=("x",), flops=2e11, out_pe=256 * size, dtype=dtype)
    b.op("bias", "BiasAdd", inputs=("mm",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    b.op("relu", "Relu", inputs=("bias",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    b.op("out", "Square", inputs=("relu",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    tg = b.build()
    for op in tg.ops[:2]:
        op.outputs[0].shape = (256, 256)
    return tg


def _topo(device_type: str = "A100", peak: float = 19.5e12):
    return make_topology([("h0", [(device_type, 1)])],
                         specs={device_type: DeviceSpec(peak_flops=peak, memory_bandwidth=1555e9)})


def test_half_matmuls_run_at_the_tensor_core_peak_and_tf32_only_where_enabled():
    fp32, half = _graph("float32"), _graph("half")
    assert op_precisions(half)[1] == "fp16" and op_precisions(fp32)[1] == "fp32"
    topo = _topo()
    t32 = CostModel(fp32, topo).op_times(0, 256)
    t16 = CostModel(half, topo).op_times(0, 256)
    ttf = CostModel(fp32, topo, tf32=True).op_times(0, 256)
    r = CostModel(half, topo).rates(0)
    assert r.peak_for("fp16") == pytest.approx(312e12) and r.peak_for("tf32") == pytest.approx(156e12)
    # the MatMul: FP32 peak x class efficiency vs the FP16 tensor-core peak x its efficiency
    assert t16[1] < t32[1] / 4 and t32[1] / 8 < ttf[1] < t32[1] / 2
    # memory-bound ops at the bytes of their dtype: half the bytes of FP32
    assert (t32[3] - r.launch_overhead_s) == pytest.approx(2 * (t16[3] - r.launch_overhead_s))
    # a GPU with no TF32 (V100) keeps its FP32 time with tf32=True
    v100 = _topo("V100", 15.7e12)
    assert CostModel(fp32, v100, tf32=True).op_times(0, 256)[1] == pytest.approx(CostModel(fp32, v100).op_times(0, 256)[1])


def test_xla_fuses_elementwise_chains_into_one_pass_over_memory():
    tg = _graph("float32")
    fixed, per, fused = fusion_bytes(tg)
    # BiasAdd reads the MatMul output (not fusible: paid) and hands on to Relu (not written);
    # Relu reads and writes nothing outside; Square writes the chain's output
    assert list(fused) == [False, False, False, True, True]
    assert per[2] == pytest.approx(256 * 4) and per[3] == 0.0 and per[4] == pytest.approx(256 * 4)
    topo = _topo()
    plain = CostModel(tg, topo).op_times(0, 256)
    xla = CostModel(tg, topo, xla=True).op_times(0, 256)
    assert xla[1] == plain[1]                      # the MatMul is untouched
    assert xla[2:].sum() < plain[2:].sum() / 2     # three passes and launches become one
