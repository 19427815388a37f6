"""SM occupancy of GEMM-like kernels: how full a GPU's waves of thread blocks are for a MatMul or convolution.

A GPU GEMM (cuBLAS, or cuDNN's implicit-GEMM convolutions) splits its M x N output into thread-block
tiles that run in waves of (SMs x blocks per SM); a problem with few tiles leaves SMs idle in its last
(or only) wave. A MatMul of BERT-large at per-GPU batch 2 (768 x 1024 outputs) issues 48 tiles of
128 x 128 to an 80-SM V100, one wave 60% full; at batch 10 it fills three waves. The same layer on a
108-SM A100 fills its waves differently. The shipped GPU profiles' efficiencies (``tag.cost.gpu_defaults``)
are fractions of peak at full waves; ``occupancy`` gives each op's busy fraction (<= 1), by which the cost
model divides its compute time.

Nothing here is fitted: the SM count comes from the device's spec sheet (its class's ``spec.sms``, from
the architecture whitepapers) and the tiles are CUTLASS's GEMM thread-block tiles (``TILES``: tile M,
tile N, blocks per SM as shared memory allows), of which the library is taken to pick the one whose
waves are fullest.

Tile quantization (``tensor``): a tensor-core kernel computes whole tiles, so an N side (a convolution's
output channels, a MatMul's output features) that is not a multiple of the tile's N wastes the rest of
the last tile (NVIDIA's Matrix Multiplication Background guide, "Tile Quantization"; its Convolutional
Layers guide maps a forward convolution to an N*P*Q x K x C*R*S GEMM, so the channel count K is that
side). Inception-v3's 48, 80, 96 and 160 channels fill 75%, 62.5%, 75% and 83% of 64-wide tiles; the
powers of two of ResNet-50, VGG-16 and BERT fill them exactly. For the ops the caller marks as running on
tensor cores, each tile's busy fraction is charged together with its waves (the library picks the tile
that wastes least), and a weight gradient (M x N = the kernel's input side x its output channels, split-K
over the batch, so no wave loss) is charged its padding in both sides. The M side of a forward or input
gradient (batch x pixels, or tokens) is not charged: it is thousands of rows, and for a few rows libraries
run narrow kernels instead. Ops on the FP32 units are not charged: their kernels (Winograd and FFT
convolutions among them) tile differently, and the fitted FP32 efficiencies stay as they were. GEMM
extents come from the IR's output shapes (NHWC):

- Conv2D: M = batch x output pixels, N = output channels; Conv2DBackpropInput: M = batch x input
  pixels, N = input channels;
- MatMul: its output's M x N; BatchMatMul / Einsum: the last two axes, the leading axes as independent
  matrices sharing the waves;
- weight gradients (Conv2DBackpropFilter, a MatMul whose output has no batch axis) reduce over the
  batch, which libraries split across the SMs (split-K): full waves, factor 1 (on tensor cores: their
  tile padding).

Convolutions reading fewer than 8 channels, depthwise convolutions and MatMuls with a side below 128 keep
their own fitted classes (``tag.cost.op_classes``) and are not counted (factor 1).

Example::

    from tag.cost.occupancy import gemm_extents, occupancy
    ext = gemm_extents(training_graph)              # once per graph
    factor = occupancy(ext, batch=64, sms=80)       # one float per op, 1.0 where not a counted GEMM
    factor = occupancy(ext, 64, 80, tensor=mask)    # MASK: ops on tensor cores, charged their tile padding
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tag.cost.op_classes import op_classes

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.ir.types import TrainingGraph

#: (tile M, tile N, blocks per SM) of CUTLASS's tensor-core and SIMT GEMM thread-block tiles
TILES = ((128, 256, 1), (256, 128, 1), (128, 128, 1), (128, 64, 2), (64, 128, 2), (64, 64, 4))
CONV_FWD = frozenset({"Conv2D", "_FusedConv2D"})
MATMULS = frozenset({"MatMul", "_FusedMatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
#: op classes that keep their own fitted efficiency (their shapes are far from a tiled GEMM's)
UNCOUNTED = frozenset({"conv:thin", "conv:depthwise", "matmul:small"})


@dataclass(frozen=True)
class GemmExtents:
    """Per counted op (``ops``): output rows M and matrix count at the graph's reference batch, columns N,
    whether the batch scales M (else the matrix count, else neither) and whether the op reduces over the
    batch (a weight gradient, split across the SMs: not charged)."""

    n_ops: int
    ops: np.ndarray
    m: np.ndarray
    n: np.ndarray
    count: np.ndarray
    batch_scales_m: np.ndarray
    batch_scales_count: np.ndarray
    split_k: np.ndarray
    ref_batch: float


def gemm_extents(graph: "TrainingGraph") -> GemmExtents:
    """The GEMM extents of GRAPH's counted MatMuls and convolutions (see the module docstring)."""
    classes = op_classes(graph)
    rows = []
    for i, op in enumerate(graph.ops):
        if classes[i] is None and op.type not in MATMULS or classes[i] in UNCOUNTED:
            continue
        out = op.outputs[0] if op.outputs else None
        if out is None or out.shape is None or any(not isinstance(d, int) or d <= 0 for d in out.shape):
            continue
        shape, ax = list(out.shape), out.batch_axis
        if op.type == "Conv2DBackpropFilter" and len(shape) == 4:       # [kh, kw, cin, cout]
            rows.append((i, shape[0] * shape[1] * shape[2], shape[3], 1, False, False, True))
        elif (op.type in CONV_FWD or op.type == "Conv2DBackpropInput") and len(shape) == 4:
            rows.append((i, shape[0] * shape[1] * shape[2], shape[3], 1, ax in (0, 1, 2), False, False))
        elif op.type in MATMULS and len(shape) >= 2:
            count = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
            lead = ax is not None and ax < len(shape) - 2
            over_batch = ax is None and op.flops.per_example > 0        # a weight gradient: K = the batch
            rows.append((i, shape[-2], shape[-1], count, ax == len(shape) - 2, lead, over_batch))
    cols = list(zip(*rows, strict=True)) if rows else [()] * 7
    return GemmExtents(len(graph.ops), np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.float64),
                       np.array(cols[2], dtype=np.float64), np.array(cols[3], dtype=np.float64),
                       np.array(cols[4], dtype=bool), np.array(cols[5], dtype=bool), np.array(cols[6], dtype=bool),
                       float(max(graph.batch_size, 1)))


def wave_fill(m: np.ndarray, n: np.ndarray, count: np.ndarray, sms: int, tiles=TILES,
              pad_n: np.ndarray | None = None) -> np.ndarray:
    """Busy fraction of the SMs' tile slots over the waves that COUNT independent M x N GEMMs take on SMS
    SMs, with the best of TILES per GEMM (tiles / (waves x slots)). Where PAD_N (a mask) is set, each tile
    is also only N / (tiles along N x tile N) busy (tile quantization in N); elsewhere a tile's padding is
    not counted."""
    m, n, count = (np.maximum(np.asarray(x, dtype=np.float64), 1.0) for x in (m, n, count))
    best = np.zeros(m.shape)
    for tm, tn, per_sm in tiles:
        along_n = np.ceil(n / tn)
        issued = count * np.ceil(m / tm) * along_n
        slots = float(sms * per_sm)
        fill = issued / (np.ceil(issued / slots) * slots)
        if pad_n is not None:
            fill = np.where(pad_n, fill * n / (along_n * tn), fill)
        best = np.maximum(best, fill)
    return best


def tile_fill(m: np.ndarray, n: np.ndarray, tiles=TILES) -> np.ndarray:
    """Busy fraction of the tiles covering an M x N output with the best of TILES, padding in both sides
    counted and waves not (a split-K weight gradient fills its waves by splitting the reduction)."""
    m, n = (np.maximum(np.asarray(x, dtype=np.float64), 1.0) for x in (m, n))
    best = np.zeros(m.shape)
    for tm, tn, _ in tiles:
        best = np.maximum(best, m / (np.ceil(m / tm) * tm) * n / (np.ceil(n / tn) * tn))
    return best


def occupancy(ext: GemmExtents, batch: float, sms: int, tensor: np.ndarray | None = None) -> np.ndarray:
    """Per op of the graph: the occupancy factor at per-device BATCH on a GPU of SMS SMs (1.0 where not a
    counted GEMM, or SMS <= 0). TENSOR (a mask over the graph's ops, optional): the ops that run on tensor
    cores, which are also charged their tile padding (tile quantization; see the module docstring)."""
    out = np.ones(ext.n_ops)
    if sms <= 0 or not len(ext.ops):
        return out
    scale = max(float(batch), 1e-9) / ext.ref_batch
    m = np.where(ext.batch_scales_m, ext.m * scale, ext.m)
    count = np.where(ext.batch_scales_count, ext.count * scale, ext.count)
    keep = ~ext.split_k
    on_tc = (np.asarray(tensor, dtype=bool)[ext.ops] if tensor is not None
             else np.zeros(len(ext.ops), dtype=bool))
    out[ext.ops[keep]] = wave_fill(m[keep], ext.n[keep], count[keep], sms, pad_n=on_tc[keep])
    padded = ext.split_k & on_tc
    if padded.any():
        out[ext.ops[padded]] = tile_fill(m[padded], ext.n[padded])
    return out
