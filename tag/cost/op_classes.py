"""Op classes: what kind of GPU kernel an IR op becomes, from the shapes the IR already holds.

GPUs run ops of one TensorFlow type at very different speeds per FLOP: cuDNN runs a 3x3 stride-1
convolution with Winograd or FFT algorithms that do fewer multiplications than the direct-convolution
FLOP count the IR charges, a 1x1 convolution is a plain GEMM, a strided or 7x7 convolution uses
implicit-GEMM kernels, a convolution with 3 input channels (the first layer) cannot fill the tensor
of a GEMM tile, and a MatMul with one small side is far from peak. The shipped GPU profiles
(``tag.cost.gpu_defaults``) therefore give efficiencies per *op class*, a finer key than the op type.
This module computes that key per op; no TensorFlow, numpy only.

Kernel size and stride are not IR attributes: they are read from tensor shapes. A Conv2D's filter
input is ``[kh, kw, cin, cout]``; its stride is the ratio of input to output height. The backprop ops
carry the same shapes on other inputs (``Conv2DBackpropInput``: filter = input 1, output gradient =
input 2, result = the input's shape; ``Conv2DBackpropFilter``: input = input 0, output gradient =
input 2, result = the filter's shape).

Classes (``None``: no class, the op type is the key):

=================  ==========================================================================
``conv:3x3s1``     3x3 stride-1 convolution with at least 8 input channels (Winograd-eligible)
``conv:1x1``       1x1 convolution, any stride (a GEMM)
``conv:strided``   a larger kernel with stride > 1
``conv:kxk``       any other stride-1 kernel (5x5, 7x7, 1x7, 7x1, ...)
``conv:thin``      a convolution reading fewer than 8 channels (the image layer)
``conv:depthwise`` depthwise convolutions (and their gradients)
``matmul``         MatMul / fused MatMul whose sides are all >= 128 (rows that grow with the
                   batch count as large)
``matmul:small``   MatMul with a fixed side below 128 (e.g. a 2-class classifier head)
``bmm``            BatchMatMul / Einsum (attention score and context products)
=================  ==========================================================================

Op *families* are coarser: ``conv`` (convolutions and their backprop ops, depthwise and 3-D included),
``matmul`` (MatMul, fused MatMul, BatchMatMul, Einsum) and ``other`` (everything else). A profile entry may
carry one time scale per family (``DeviceProfile.family_scale``), fitted where one scale for every op does not
fit a runtime (``tag_bench.cases.runtime_levels``).

On CPU, oneDNN's graph pass merges a Conv2D with the BiasAdd that consumes it into one kernel, whatever
the session's optimizer settings, and TensorFlow's step stats report that kernel under the BiasAdd's name
(the Conv2D shows no time of its own). ``cpu_fused_bias_adds`` finds those pairs: the calibration charges
the pair's time to the convolution and the cost model charges such a BiasAdd nothing on CPU devices.

Example::

    from tag.cost.op_classes import op_classes
    keys = op_classes(training_graph)          # one str or None per IR op
    keys[training_graph.op_index["conv1/Conv2D"]]    # e.g. 'conv:kxk'
    op_family("Conv2DBackpropFilter")          # 'conv'
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.ir.types import OpInfo, TrainingGraph

Shape = Optional[tuple]

CONV_TYPES = frozenset({"Conv2D", "_FusedConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"})
DEPTHWISE_TYPES = frozenset({"DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                             "DepthwiseConv2dNativeBackpropFilter"})
MATMUL_TYPES = frozenset({"MatMul", "_FusedMatMul"})
BMM_TYPES = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
#: every class key this module can return
CLASS_KEYS = ("conv:3x3s1", "conv:1x1", "conv:strided", "conv:kxk", "conv:thin", "conv:depthwise",
              "matmul", "matmul:small", "bmm")

CONV3D_TYPES = frozenset({"Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"})
#: op families with their own time scale in a profile entry (``DeviceProfile.family_scale``)
FAMILIES = ("conv", "matmul", "other")
_FAMILY_OF = {**{t: "conv" for t in CONV_TYPES | DEPTHWISE_TYPES | CONV3D_TYPES},
              **{t: "matmul" for t in MATMUL_TYPES | BMM_TYPES}}

_THIN_CHANNELS = 8
_SMALL_SIDE = 128


def op_classes(graph: "TrainingGraph") -> list[str | None]:
    """The op class of every op of GRAPH (``None`` where the op type itself is the key)."""
    shapes: dict[str, Shape] = {}
    for op in graph.ops:
        for t in op.outputs:
            shapes[t.name] = t.shape
    return [op_class(op, shapes) for op in graph.ops]


def op_class(op: "OpInfo", shapes: dict[str, Shape]) -> str | None:
    """The class of one op; SHAPES maps tensor names to shapes (at the IR's reference batch)."""
    if op.type in DEPTHWISE_TYPES:
        return "conv:depthwise"
    if op.type in CONV_TYPES:
        return _conv_class(op, shapes)
    if op.type in MATMUL_TYPES:
        return _matmul_class(op, shapes)
    if op.type in BMM_TYPES:
        return "bmm"
    return None


#: op types oneDNN merges with a BiasAdd consuming their output (its MergeConv2DWithBiasAdd rewrite)
_BIAS_MERGED_PRODUCERS = frozenset({"Conv2D"})


def cpu_fused_bias_adds(graph: "TrainingGraph") -> dict[int, int]:
    """{BiasAdd op index: the Conv2D op index it runs inside on CPU} for every BiasAdd that is the only
    data consumer of a Conv2D's output (the pattern oneDNN merges into one kernel; see module docstring)."""
    consumers: dict[int, set[int]] = {}
    for e in graph.edges:
        consumers.setdefault(e.src, set()).add(e.dst)
    fused: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        users = consumers.get(i, set())
        if op.type in _BIAS_MERGED_PRODUCERS and len(users) == 1:
            j = next(iter(users))
            bias = graph.ops[j]
            if bias.type == "BiasAdd" and bias.inputs and bias.inputs[0].split(":")[0] == op.name:   # the value
                fused[j] = i
    return fused


def op_family(op_type: str) -> str:
    """The family of an op type: ``conv``, ``matmul`` or ``other`` (see ``FAMILIES``)."""
    return _FAMILY_OF.get(op_type, "other")


def _in(op: "OpInfo", shapes: dict[str, Shape], i: int) -> Shape:
    return shapes.get(op.inputs[i]) if i < len(op.inputs) else None


def _out(op: "OpInfo") -> Shape:
    return op.outputs[0].shape if op.outputs else None


def _conv_class(op: "OpInfo", shapes: dict[str, Shape]) -> str | None:
    if op.type == "Conv2DBackpropInput":        # (input_sizes, filter, out_backprop) -> input gradient
        filt, small, big = _in(op, shapes, 1), _in(op, shapes, 2), _out(op)
    elif op.type == "Conv2DBackpropFilter":     # (input, filter_sizes, out_backprop) -> filter gradient
        filt, small, big = _out(op), _in(op, shapes, 2), _in(op, shapes, 0)
    else:                                       # Conv2D / _FusedConv2D: (input, filter, ...) -> output
        filt, small, big = _in(op, shapes, 1), _out(op), _in(op, shapes, 0)
    if not _known(filt, 4):
        return None
    kh, kw, cin = int(filt[0]), int(filt[1]), int(filt[2])
    if cin < _THIN_CHANNELS:
        return "conv:thin"
    if kh == 1 and kw == 1:
        return "conv:1x1"
    stride = 1
    if _known(small, 4) and _known(big, 4) and small[1] > 0:
        stride = max(1, int(round(big[1] / small[1])))   # NHWC: input height / output height
    if stride > 1:
        return "conv:strided"
    return "conv:3x3s1" if (kh, kw) == (3, 3) else "conv:kxk"


def _matmul_class(op: "OpInfo", shapes: dict[str, Shape]) -> str | None:
    a, out = _in(op, shapes, 0), _out(op)
    if not (_known(a, 2) and _known(out, 2)):
        return None
    m, n = int(out[0]), int(out[1])
    sides = [n, int(a[0]) * int(a[1]) // max(m, 1)]      # n and the contracted side k
    if op.outputs[0].batch_axis != 0:                    # rows that grow with the batch are not "small"
        sides.append(m)
    return "matmul:small" if min(sides) < _SMALL_SIDE else "matmul"


def _known(shape: Shape, rank: int) -> bool:
    return shape is not None and len(shape) == rank and all(isinstance(d, int) and d > 0 for d in shape)
