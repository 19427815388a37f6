"""Fit tag's shipped GPU profiles (``tag/cost/data/gpu_profiles.json``) on the fit rows of the published data.

What is fitted (everything in log space, least squares on log(predicted / published) of the *fit* rows of
``data/published_throughput.csv``, with weak priors so parameters the rows barely see stay plausible):

- shared efficiencies per op class (``tag.cost.op_classes``: 3x3 stride-1 / 1x1 / strided / other-kernel /
  thin-input convolutions, large and small MatMuls, batched matmuls) and for all other ops (``default``),
  the memory-bandwidth efficiency and the per-kernel launch overhead;
- one compute scale per GPU with fit rows (P100, GTX 1080 Ti, RTX 2080 Ti; V100 is the reference, 1.0).

Those come from the FP32 fit rows. Then the tensor-core efficiencies per op class (the fraction of the
FP16 / TF32 / BF16 tensor-core peak that MatMuls, batched matmuls and convolutions reach) are fitted the
same way on the one-GPU mixed-precision fit rows, which are all V100 rows (the FP32 efficiencies fixed);
every class gets those values for every tensor-core precision, times its tensor scale (the part of its
FP32 compute scale that tensor cores share: the sustained clock; ``DERIVED``): no other GPU's mixed or
TF32 row is fitted on (they are the validation rows). XLA rows are costed as ``CostModel(xla=True)`` costs them.
MatMuls and convolutions are charged their SM occupancy at each row's per-GPU batch on its class's SM count
(``tag.cost.occupancy``, as the cost model charges it; nothing in it is fitted), so the efficiencies are
fractions of peak at full waves of thread blocks; ops on tensor cores are also charged their tile padding in
the channel dimension (tile quantization), so the tensor-core efficiencies are fractions of peak at full tiles.

One-GPU step time is the sum of the cost model's op times (the simulator's single device runs its ops
back to back), so the compute fit evaluates that sum directly. The collective defaults (bus bandwidth as
a fraction of the declared link, fixed cost per NCCL call) are then chosen on the multi-GPU fit rows with
the full simulator: the lockstep slowdown of replicated GPUs (``tag.cost.gpu_defaults``) on the NVLink
rows (their all-reduce hides under the backward pass), then the PCIe all-reduce efficiency on the PCIe
rows (VGG-16's 528 MB of gradients do not hide); the NVLink efficiency comes from NCCL's published
protocol overhead. Classes without FP32 TensorFlow rows are derived from the nearest
fitted class (``DERIVED``), and say so in their ``basis``.

Usage::

    python scripts/fit_gpu_defaults.py [--cache DIR] [--out tag/cost/data/gpu_profiles.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np

from tag_bench import published

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OUT = os.path.join(ROOT, "tag", "cost", "data", "gpu_profiles.json")
SHARED = ("conv:3x3s1", "conv:1x1", "conv:strided", "conv:kxk", "conv:thin", "matmul", "matmul:small", "bmm",
          "default")
#: prior (centre, log-space standard deviation) of each shared parameter
PRIOR = {"conv:3x3s1": (1.0, 0.7), "conv:1x1": (0.6, 0.5), "conv:strided": (0.5, 0.4), "conv:kxk": (0.6, 0.5),
         "conv:thin": (0.3, 0.5), "matmul": (0.7, 0.5), "matmul:small": (0.2, 0.5), "bmm": (0.4, 0.5),
         "default": (0.5, 0.5), "memory_efficiency": (0.8, 0.15), "launch_overhead_s": (8e-6, 0.7)}
FITTED_GPUS = ("P100", "GTX1080Ti", "RTX2080Ti")          # per-GPU compute scale; V100 = 1
CLASS_OF_TYPE = {"P100-SXM2": "P100", "GTX1080Ti": "GTX1080Ti", "RTX2080Ti": "RTX2080Ti"}
PRIOR_WEIGHT = 0.3
NVLINK_CALL = 2e-5        # s per NCCL call (launch + a few protocol steps); the rows barely see it

CLASSES = {   # name: (patterns on tag.cost.gpu_defaults.normalise(name), spec sheet; sms: streaming
    # multiprocessors from the architecture whitepapers (Pascal, Volta, Turing, Ampere GA100 / GA102, Hopper))
    "V100": ([r"v100"], dict(peak_tflops=15.7, memory_bandwidth_gbs=900, sms=80)),
    "A100": ([r"a100", r"a800"], dict(peak_tflops=19.5, memory_bandwidth_gbs=1555, sms=108)),
    "H100": ([r"h100", r"h800", r"h200"], dict(peak_tflops=67.0, memory_bandwidth_gbs=3350, sms=132)),
    "P100": ([r"p100"], dict(peak_tflops=10.6, memory_bandwidth_gbs=732, sms=56)),
    "T4": ([r"^t4(?![0-9]{3})"], dict(peak_tflops=8.1, memory_bandwidth_gbs=320, sms=40)),
    "GTX1080Ti": ([r"1080ti"], dict(peak_tflops=11.3, memory_bandwidth_gbs=484, sms=28)),
    "RTX2080Ti": ([r"2080ti"], dict(peak_tflops=13.4, memory_bandwidth_gbs=616, sms=68)),
    "RTX3090": ([r"3090"], dict(peak_tflops=35.6, memory_bandwidth_gbs=936, sms=82)),
}
#: spec-sheet peaks in TFLOP/s by precision: FP32 (CUDA cores) and dense tensor-core TF32, FP16 with FP32
#: accumulation, BF16 (NVIDIA's V100, A100, H100 SXM, P100 SXM2, T4 data sheets; the Turing and GA102
#: architecture whitepapers for GeForce cards, whose FP16-with-FP32-accumulate rate is half the Quadro
#: rate). A precision a GPU has no tensor cores for is absent (its MatMuls run at the FP32 peak), except
#: P100's double-rate FP16 units; the GTX 1080 Ti runs half MatMuls with FP32 arithmetic (cuBLAS's FP32
#: compute type), at its FP32 peak.
PEAKS = {
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "P100": {"fp32": 10.6, "fp16": 21.2},
    "T4": {"fp32": 8.1, "fp16": 65.0},
    "GTX1080Ti": {"fp32": 11.3, "fp16": 11.3},
    "RTX2080Ti": {"fp32": 13.4, "fp16": 53.8},
    # GA102 whitepaper, RTX 3090 dense: 142 FP16 with FP16 accumulation, 71 FP16 / BF16 with FP32
    # accumulation (the GeForce half rate), 35.6 TF32 (half the A40's / RTX A6000's 2x FP32 ratio)
    "RTX3090": {"fp32": 35.6, "tf32": 35.6, "fp16": 71.2, "bf16": 71.2},
}
#: GeForce classes whose tensor cores run FP32 accumulation (``PEAKS``) at half their datapath's rate: that
#: rate, dense TFLOP/s (Turing whitepaper appendix, RTX 2080 Ti reference card: FP16 with FP16 accumulation
#: 107.6; GA102 whitepaper, RTX 3090: FP16 with FP16 accumulation 142; BF16 at the FP16 rate and TF32 at half
#: of it, the full-rate GA102 parts' ratios (RTX A6000 / A40 data sheets)). The cost model lets a tensor-core
#: kernel reach the V100-fitted fraction of this rate, up to what the half-rate math allows
#: (``tag.cost.gpu_defaults.Resolution.tensor_efficiency``)
FULL_RATE_PEAKS = {
    "RTX2080Ti": {"fp16": 107.6},
    "RTX3090": {"tf32": 71.2, "fp16": 142.3, "bf16": 142.3},
}
#: GPUs without tensor cores: their half-precision MatMuls and convolutions run on the ordinary units, at
#: their FP32 efficiencies (P100 at its double FP16 rate, the GTX 1080 Ti at its FP32 rate)
NO_TENSOR_CORES = ("P100", "GTX1080Ti")
#: classes without FP32 TensorFlow rows: (source class, compute factor, basis, tensor-core factor). The
#: tensor-core factor is the part of the compute factor that also holds for tensor cores: sustained clocks
#: (the T4's power cap) do, GA102's two FP32 issues per clock (the RTX 3090's 0.65) do not
DERIVED = {
    "A100": ("V100", 1.0, "derived from V100 (datacenter SXM part of the next generation); no FP32 TensorFlow "
                          "rows published without TF32; FP32 peak from the topology", 1.0),
    "H100": ("V100", 1.0, "derived from V100 (datacenter SXM part); no FP32 TensorFlow rows; FP32 peak from the "
                          "topology", 1.0),
    "T4": ("RTX2080Ti", 0.8, "derived from RTX2080Ti (same Turing architecture) x 0.8: the 70 W T4 sustains "
                             "clocks below the boost clock its 8.1 TFLOP/s assumes", 0.8),
    "RTX3090": ("RTX2080Ti", 0.65, "derived from RTX2080Ti x 0.65: GA102's 35.6 TFLOP/s counts two FP32 issues "
                                   "per clock; Lambda's RTX 3090 ResNet-50 row (precision unconfirmed, TF32 "
                                   "possible) is 1.73x the RTX 2080 Ti at 2.66x the peak; its tensor cores "
                                   "keep the RTX 2080 Ti's scale (the dual issue is FP32 only)", 1.0),
}
RELATED = {   # GPUs without a class of their own -> nearest class (by architecture and market segment)
    "Titan V": ([r"^titanv"], "V100"),
    "A30": ([r"^a30(?![0-9])"], "A100"),
    "Turing GeForce (RTX 20xx)": ([r"20[6-8]0"], "RTX2080Ti"),
    "Ampere / Ada GeForce and L40 (RTX 30xx, 40xx, A10G, L40)":
        ([r"30[5-8]0", r"40[6-9]0", r"^a10g", r"^l40"], "RTX3090"),
    "Pascal (GTX 10xx, Titan X/Xp, P4, P40, P6000)": ([r"10[67]0", r"1080(?!ti)", r"titanx", r"^p4(?![0-9]{2})",
                                                        r"^p40(?![0-9])", r"p6000"], "GTX1080Ti"),
    "Kepler / Maxwell datacenter (K40, K80, M40, M60)": ([r"^k[48]0", r"^m[46]0"], "P100"),
}
#: related families whose tensor cores run FP16 with FP32 accumulation at full rate, unlike the GeForce class
#: that serves them: a reference card's spec-sheet peaks (TFLOP/s, dense), whose ratios to FP32 replace the
#: class's. Turing: the Turing whitepaper's Titan RTX / Quadro RTX 6000 column and the Quadro RTX 8000 data
#: sheet (16.3 FP32, 130.5 FP16 tensor with FP32 accumulation; Quadro RTX 4000 and 5000 the same 8x). Ampere
#: / Ada professional: the RTX A6000 data sheet (38.7 FP32; 309.7 tensor TFLOPS with sparsity, so 154.8 dense
#: FP16 / BF16 and 77.4 TF32), the same 2x / 4x on the A40 (37.4 / 74.8 / 149.7), A10 (31.2 / 62.5 / 125),
#: RTX A4000 and A5000 and L4 (30.3; 120 TF32 and 242 FP16 with sparsity) data sheets. The GeForce classes
#: run 4x (Turing) and 1x / 2x (GA102) by the whitepapers' FP32-accumulate columns; the L40 (90.5 / 90.5 /
#: 181 dense) and the AWS A10G (no NVIDIA data sheet) stay with the GeForce ratios, and so with the GeForce
#: half-rate rule of FULL_RATE_PEAKS (for the L40, whose data sheet does not split the accumulation rates, an
#: assumption).
RELATED_FULL_RATE = {
    "Turing Titan / Quadro (Titan RTX, Quadro RTX 4000-8000)":
        ([r"titanrtx", r"^rtx[4568]000"], "RTX2080Ti", {"fp32": 16.3, "fp16": 130.5}, 72),
    "Ampere / Ada professional (RTX A4000-A6000, A10, A40, L4)":
        ([r"^a10(?![0-9g])", r"^a40(?![0-9])", r"^rtxa[456]000", r"^a[456]000", r"^l4(?![0-9])"], "RTX3090",
         {"fp32": 38.7, "tf32": 77.4, "fp16": 154.8, "bf16": 154.8}, 84),
}
COLLECTIVE_NOTES = {
    "NVLINK": "0.8 of the declared NVLink bandwidth: NCCL's protocol overhead is ~20% (NCCL maintainer, "
              "NVIDIA/nccl-tests issue 212: ~370 GB/s effective of 450 GB/s on H100)",
    "PCIE": "fitted on the 8x RTX 2080 Ti PCIe server's VGG-16 row (a ring over PCIe 3.0 x16 that crosses "
            "the CPU sockets)",
    "NETWORK": "InfiniBand / Ethernet: ~0.85 of line rate (not validated: no multi-host rows)",
    "INTERCONNECT_UNSPECIFIED": "as PCIe",
}


TENSOR = ("conv:3x3s1", "conv:1x1", "conv:strided", "conv:kxk", "conv:thin", "matmul", "matmul:small", "bmm")
#: prior (centre, log-space standard deviation) of each tensor-core efficiency
TENSOR_PRIOR = {"conv:3x3s1": (0.35, 0.7), "conv:1x1": (0.35, 0.7), "conv:strided": (0.3, 0.7),
                "conv:kxk": (0.3, 0.7), "conv:thin": (0.1, 0.7), "matmul": (0.5, 0.7), "matmul:small": (0.1, 0.7),
                "bmm": (0.2, 0.7)}


def row_sms(row) -> int:
    """SMs of ROW's GPU (its class's spec sheet), as the cost model charges occupancy with."""
    from tag.cost.gpu_defaults import normalise
    key = normalise(published.SYSTEMS[row["system"]]["type"])
    return next(spec["sms"] for patterns, spec in CLASSES.values() if any(re.search(p, key) for p in patterns))


def op_arrays(graph, batch: int, xla: bool = False, sms: int = 0):
    """(flops, bytes, parameter index per op, charged mask, fused mask, tensor-core index or -1, occupancy)
    at BATCH on a GPU of SMS SMs (``tag.cost.occupancy``; 0: none charged)."""
    from tag.cost.model import ZERO_COST_TYPES
    from tag.cost.occupancy import gemm_extents, occupancy
    from tag.cost.op_classes import op_classes
    from tag.cost.precision import fusion_bytes, op_precisions
    a = graph.arrays()
    cls = op_classes(graph)
    idx = np.array([SHARED.index(c) if c in SHARED else SHARED.index("default") for c in cls], dtype=np.int64)
    charged = np.array([op.type not in ZERO_COST_TYPES for op in graph.ops])
    if xla:
        mf, mp, fused = fusion_bytes(graph)
        mem = mf + mp * batch
    else:
        mem, fused = a.mem_bytes(batch), np.zeros(len(graph.ops), dtype=bool)
    tensor = np.array([TENSOR.index(c) if c in TENSOR and p in ("fp16", "bf16") else -1
                       for c, p in zip(cls, op_precisions(graph), strict=True)], dtype=np.int64)
    occ = occupancy(gemm_extents(graph), batch, sms, tensor >= 0)     # tensor cores: tile padding too
    return a.flops(batch), mem, idx, charged, fused, tensor, occ


def unpack(x: np.ndarray) -> tuple[np.ndarray, float, float, dict[str, float]]:
    e = np.exp(x[:len(SHARED)])
    mem, launch = math.exp(x[len(SHARED)]), math.exp(x[len(SHARED) + 1])
    scales = {g: math.exp(v) for g, v in zip(FITTED_GPUS, x[len(SHARED) + 2:], strict=True)}
    return e, mem, launch, scales


def step_time(arr, spec, e, mem, launch, scale, tensor_e=None, tensor_peak: float = 0.0) -> float:
    """One-GPU step: the cost model's roofline summed over ops (tensor-core ops at TENSOR_PEAK x TENSOR_E)."""
    flops, mbytes, idx, charged, fused, tensor, occ = arr
    rate = spec["tflops"] * 1e12 * e[idx] * scale
    if tensor_e is not None:
        on_tc = tensor >= 0
        rate = np.where(on_tc, tensor_peak * tensor_e[np.maximum(tensor, 0)], rate)
    rate = rate * occ
    t = np.maximum(flops / rate, mbytes / (spec["gbs"] * 1e9 * mem)) + np.where(fused, 0.0, launch)
    return float(t[charged].sum())


def fit_compute(rows, graphs):
    from scipy.optimize import least_squares
    one = [r for r in rows if r["split"] == "fit" and r["gpu_count"] == 1 and r["precision"] == "fp32"]
    data = [(r, op_arrays(graphs[published.model_key(r)], r["per_gpu_batch"], r["xla"], row_sms(r)),
             published.SYSTEMS[r["system"]])
            for r in one]
    prior = np.log([PRIOR[k][0] for k in SHARED] + [PRIOR["memory_efficiency"][0], PRIOR["launch_overhead_s"][0]]
                   + [1.0] * len(FITTED_GPUS))
    sd = np.array([PRIOR[k][1] for k in SHARED] + [PRIOR["memory_efficiency"][1], PRIOR["launch_overhead_s"][1]]
                  + [0.5] * len(FITTED_GPUS))

    def residuals(x):
        e, mem, launch, scales = unpack(x)
        res = []
        for r, arr, spec in data:
            s = scales.get(CLASS_OF_TYPE.get(r["gpu"], ""), 1.0)
            pred = r["per_gpu_batch"] / step_time(arr, spec, e, mem, launch, s)
            res.append(math.log(pred / r["throughput"]))
        return np.concatenate([res, PRIOR_WEIGHT * (x - prior) / sd])

    sol = least_squares(residuals, prior, method="trf")
    return unpack(sol.x)


def fit_tensor(rows, graphs, e, mem, launch) -> np.ndarray:
    """Tensor-core efficiency per TENSOR class from the one-GPU mixed-precision fit rows (V100 only)."""
    from scipy.optimize import least_squares
    one = [r for r in rows if r["split"] == "fit" and r["gpu_count"] == 1 and r["precision"] == "mixed"]
    assert all(r["gpu"].startswith("V100") for r in one), "mixed fit rows must be V100 rows (held out by GPU type)"
    data = [(r, op_arrays(graphs[published.model_key(r)], r["per_gpu_batch"], r["xla"], row_sms(r)),
             published.SYSTEMS[r["system"]])
            for r in one]
    prior = np.log([TENSOR_PRIOR[k][0] for k in TENSOR])
    sd = np.array([TENSOR_PRIOR[k][1] for k in TENSOR])

    def residuals(x):
        te = np.exp(x)
        res = []
        for r, arr, spec in data:
            peak = PEAKS["V100"]["fp16"] / PEAKS["V100"]["fp32"] * spec["tflops"] * 1e12
            pred = r["per_gpu_batch"] / step_time(arr, spec, e, mem, launch, 1.0, te, peak)
            res.append(math.log(pred / r["throughput"]))
        return np.concatenate([res, PRIOR_WEIGHT * (x - prior) / sd])

    sol = least_squares(residuals, prior, method="trf", bounds=(np.log(1e-3), 0.0))
    fitted = residuals(sol.x)[:len(data)]           # one per row; the prior's terms follow
    print("  mixed fit rows:", {r["id"]: round(float(v), 3) for (r, _, _), v in zip(data, fitted, strict=True)})
    return np.exp(sol.x)


def class_table(e, mem, launch, scales, tensor_e=None) -> dict:
    """Every class's profile. FP32 efficiencies: the shared ones x the class's compute scale (fitted, or its
    source class's x the derived factor). Tensor-core efficiencies: the V100-fitted ones x the class's
    tensor scale, the part of its compute scale that tensor cores share (sustained clock against the boost
    clock the spec-sheet peaks assume, fitted on the class's FP32 rows), capped at 1."""
    shared = {k: float(v) for k, v in zip(SHARED, e, strict=True)}
    shared["conv:depthwise"] = 0.2           # no rows: memory-bound in practice; the built-in value
    out = {}
    for name, (patterns, spec) in CLASSES.items():
        if name in DERIVED:
            src, factor, basis, tensor_factor = DERIVED[name]
            scale = (scales.get(src, 1.0)) * factor
            tensor_scale = scales.get(src, 1.0) * tensor_factor
        else:
            scale, basis = scales.get(name, 1.0), f"fitted on the {name} fit rows"
            tensor_scale = scale
            if name == "V100":
                basis = "fitted on the V100 fit rows (reference scale 1.0)"
        eff = {k: round(min(v * scale, 8.0), 4) if k not in ("default",) else round(min(v * scale, 1.0), 4)
               for k, v in shared.items()}
        tensor = {}
        if tensor_e is not None:
            table = {k: round(float(min(v * tensor_scale, 1.0)), 4) for k, v in zip(TENSOR, tensor_e, strict=True)}
            tensor = {p: dict(table) for p in ("tf32", "fp16", "bf16") if p in PEAKS[name]
                      and name not in NO_TENSOR_CORES}
        out[name] = {"patterns": patterns, "spec": spec, "peaks": PEAKS[name],
                     **({"full_rate_peaks": FULL_RATE_PEAKS[name]} if name in FULL_RATE_PEAKS else {}),
                     "efficiency": eff,
                     "tensor_efficiency": tensor, "memory_efficiency": round(mem, 4),
                     "launch_overhead_s": float(f"{launch:.3g}"), "compute_scale": round(scale, 4), "basis": basis}
        if tensor:
            out[name]["tensor_scale"] = round(tensor_scale, 4)
    return out


def write(path: str, classes: dict, collectives: dict, lockstep: float) -> None:
    data = {"version": 1, "precision": "fp32", "lockstep_per_doubling": lockstep,
            "source": "scripts/fit_gpu_defaults.py on the fit rows of data/published_throughput.csv",
            "classes": classes,
            "related": {**{n: {"patterns": p, "class": c} for n, (p, c) in RELATED.items()},
                        **{n: {"patterns": p, "class": c, "peaks": k, "sms": m}
                           for n, (p, c, k, m) in RELATED_FULL_RATE.items()}},
            "collectives": collectives}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def collectives_table(nvlink_call: float, pcie_eff: float, pcie_call: float) -> dict:
    return {"NVLINK": {"bandwidth_efficiency": 0.8, "call_latency_s": nvlink_call, "basis": COLLECTIVE_NOTES["NVLINK"]},
            "PCIE": {"bandwidth_efficiency": pcie_eff, "call_latency_s": pcie_call, "basis": COLLECTIVE_NOTES["PCIE"]},
            "NETWORK": {"bandwidth_efficiency": 0.85, "call_latency_s": 5e-5, "basis": COLLECTIVE_NOTES["NETWORK"]},
            "INTERCONNECT_UNSPECIFIED": {"bandwidth_efficiency": pcie_eff, "call_latency_s": pcie_call,
                                         "basis": COLLECTIVE_NOTES["INTERCONNECT_UNSPECIFIED"]}}


def fit_lockstep(path, rows, graphs, classes, pcie_eff: float) -> float:
    """The lockstep slowdown per doubling of replicas that best explains the multi-GPU fit rows.

    One simulator pass without it gives each row's log error e (gradients are all-reduced while the
    backward pass runs, so the step is compute-bound); the slowdown multiplies compute by
    ``1 + s log2(n)``, so s minimises sum (e - log(1 + s log2 n))^2."""
    from scipy.optimize import minimize_scalar

    import tag.cost.gpu_defaults as gd
    multi = [r for r in rows if r["split"] == "fit" and r["gpu_count"] > 1 and r["precision"] == "fp32"
             and published.SYSTEMS[r["system"]]["link"] == "NVLINK"]
    write(path, classes, collectives_table(NVLINK_CALL, pcie_eff, NVLINK_CALL), 0.0)
    gd.gpu_profiles.cache_clear()
    errs = np.array([math.log(published.predict(r, graphs[published.model_key(r)])["predicted"] / r["throughput"])
                     for r in multi])
    doublings = np.array([math.log2(r["gpu_count"]) for r in multi])
    print("  multi-GPU fit rows without lockstep slowdown:",
          {r["id"]: round(float(e), 3) for r, e in zip(multi, errs, strict=True)})
    res = minimize_scalar(lambda x: float(np.sum((errs - np.log1p(x * doublings)) ** 2)), bounds=(0.0, 0.2),
                          method="bounded")
    return round(float(res.x), 4)


def fit_pcie(path, rows, graphs, classes, lockstep: float) -> float:
    """The PCIe all-reduce efficiency that best explains the PCIe multi-GPU fit rows (bisection on log error)."""
    import tag.cost.gpu_defaults as gd
    pcie = [r for r in rows if r["split"] == "fit" and r["gpu_count"] > 1 and r["precision"] == "fp32"
            and published.SYSTEMS[r["system"]]["link"] == "PCIE"]

    def err(eff: float) -> float:
        write(path, classes, collectives_table(NVLINK_CALL, eff, NVLINK_CALL), lockstep)
        gd.gpu_profiles.cache_clear()
        e = float(np.mean([math.log(published.predict(r, graphs[published.model_key(r)])["predicted"] / r["throughput"])
                           for r in pcie]))
        print(f"  PCIe efficiency {eff:.3f}: mean log error {e:+.3f}", flush=True)
        return e

    lo, hi = 0.05, 1.0            # higher efficiency -> faster all-reduce -> higher prediction
    if err(lo) > 0:
        return lo
    if err(hi) < 0:
        return hi
    for _ in range(7):
        mid = math.sqrt(lo * hi)
        if err(mid) > 0:
            hi = mid
        else:
            lo = mid
    return round(math.sqrt(lo * hi), 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", metavar="DIR", help="IR cache (as scripts/bench_published.py --cache)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    rows = published.read_rows()
    fit_rows = [r for r in rows if r["split"] == "fit"]
    graphs = {}
    for r in fit_rows:
        graphs.setdefault(published.model_key(r), None)
        if graphs[published.model_key(r)] is None:
            graphs[published.model_key(r)] = published.build_ir(r, args.cache)
    e, mem, launch, scales = fit_compute(rows, graphs)
    print("shared:", {k: round(float(v), 3) for k, v in zip(SHARED, e, strict=True)}, "memory", round(mem, 3),
          "launch", f"{launch:.2e}", "scales", {k: round(v, 3) for k, v in scales.items()})
    tensor_e = fit_tensor(rows, graphs, e, mem, launch)
    print("tensor-core efficiencies:", {k: round(float(v), 3) for k, v in zip(TENSOR, tensor_e, strict=True)})
    classes = class_table(e, mem, launch, scales, tensor_e)
    # the lockstep and PCIe fits simulate with the candidate file: point tag's profile loader at --out
    import tag.cost.gpu_defaults as gd
    shipped, gd.DATA_PATH = gd.DATA_PATH, os.path.abspath(args.out)
    try:
        lockstep = fit_lockstep(args.out, rows, graphs, classes, 0.5)
        pcie_eff = fit_pcie(args.out, rows, graphs, classes, lockstep)
    finally:
        gd.DATA_PATH = shipped
        gd.gpu_profiles.cache_clear()
    write(args.out, classes, collectives_table(NVLINK_CALL, pcie_eff, NVLINK_CALL), lockstep)
    print(f"lockstep per doubling {lockstep}, PCIe efficiency {pcie_eff}, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
