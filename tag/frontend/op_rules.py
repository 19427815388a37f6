"""Per-op cost rules: FLOPs of each TensorFlow op type as a function of its input and output shapes.

Why a table: the cost model and the simulator need every op's FLOPs, and TensorFlow has no FLOP
count for most op types; each rule below encodes what one op type computes (a multiply-add is 2
FLOPs). Data-movement and bookkeeping ops (``ZERO_FLOP_TYPES``) cost 0. Functional ops (``If``,
``PartitionedCall``, ``While``, ...) are costed by :mod:`tag.frontend.function_cost`.

No TensorFlow import here: rules read the op's ``attr`` map (protobuf ``AttrValue``s) and plain shape
tuples.

Example::

    from tag.frontend.op_rules import flops_of, is_apply_op
    class _B:   # a stand-in for an AttrValue with a bool
        b = False
    flops_of("MatMul", {"transpose_a": _B(), "transpose_b": _B()}, [(8, 784), (784, 256)], [(8, 256)],
             ["float32"], {})         # (3211264.0, True): 2 * 8 * 256 * 784
    is_apply_op("ResourceApplyAdam")  # True
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable

import numpy as np

from tag.ir.op_types import FUNCTION_CALL_TYPES, TENSOR_LIST_TYPES

__all__ = ["ELEMENTWISE_TYPES", "FLOP_RULE_TYPES", "REDUCTION_TYPES", "ZERO_FLOP_TYPES", "Shape", "fallback_flops",
           "flops_of", "grad_arg_index", "is_apply_op", "numel", "prod"]

Shape = tuple  # tuple[int | None, ...]: a tensor's dims, None where unknown

_APPLY_RE = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]")


def is_apply_op(op_type: str) -> bool:
    """True for an optimizer update op type (ApplyAdam, ResourceApplyAdam, ResourceSparseApplyAdagrad, ...)."""
    return bool(_APPLY_RE.match(op_type))


def grad_arg_index(op_def: Any) -> int | None:
    """Input index of the gradient ("grad" or "delta") argument of an apply op's OpDef."""
    idx = 0
    for arg in op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            return None
        if arg.name in ("grad", "delta"):
            return idx
        idx += 1
    return None


def numel(shape: Shape | None) -> int | None:
    """Element count of a fully known shape; None when the rank or a dim is unknown."""
    if shape is None or any(d is None or d < 0 for d in shape):
        return None
    return math.prod(shape)


def prod(dims: Iterable[int | None]) -> int | None:
    """Product of DIMS; None when one is unknown."""
    p = 1
    for d in dims:
        if d is None or d < 0:
            return None
        p *= int(d)
    return p


# ---------------------------------------------------------------------------------------------------------
# FLOP rules. Each takes (attrs, input shapes, output shapes, extra) and returns FLOPs at the shapes given,
# or None when the shapes it needs are unknown. ``extra`` carries the op-def-derived grad index for applies.
# ---------------------------------------------------------------------------------------------------------

FlopRule = Callable[[Any, list, list, dict], "float | None"]

_UNARY_1 = """Abs Neg Sign Reciprocal Inv Square Sqrt Rsqrt Exp Expm1 Log Log1p Sin Cos Tan Asin Acos Atan
Sinh Cosh Tanh Sigmoid Relu Relu6 Elu Selu Softplus Softsign LeakyRelu Erf Erfc Floor Ceil Round Rint IsFinite
IsNan IsInf LogicalNot Cast Invert Gelu Mish Swish""".split()
_BINARY_1 = """Add AddV2 Sub Mul MulNoNan Div DivNoNan RealDiv FloorDiv FloorMod TruncateDiv TruncateMod Mod Maximum
Minimum Pow SquaredDifference Equal NotEqual Less LessEqual Greater GreaterEqual LogicalAnd LogicalOr Atan2 Xlogy
Xdivy Xlog1py BitwiseAnd BitwiseOr BitwiseXor LeftShift RightShift ApproximateEqual Select SelectV2
RandomUniform RandomStandardNormal TruncatedNormal RandomUniformInt StatelessRandomUniform
StatelessRandomNormal StatelessTruncatedNormal StatelessRandomUniformV2 StatelessRandomNormalV2
StatelessTruncatedNormalV2 StatelessRandomUniformIntV2 StatelessRandomUniformFullIntV2 RandomShuffle
CheckNumerics CheckNumericsV2""".split()
_ELEMENTWISE_FACTOR: dict[str, float] = {t: 1.0 for t in _UNARY_1 + _BINARY_1}
_ELEMENTWISE_FACTOR.update({
    "ClipByValue": 2.0, "ReluGrad": 1.0, "Relu6Grad": 1.0, "LeakyReluGrad": 2.0, "EluGrad": 2.0,
    "SeluGrad": 3.0, "SoftplusGrad": 4.0, "SoftsignGrad": 4.0, "SigmoidGrad": 3.0, "TanhGrad": 3.0,
    "RsqrtGrad": 4.0, "SqrtGrad": 2.0, "ReciprocalGrad": 3.0, "InvGrad": 3.0, "GeluGrad": 8.0,
})
#: elementwise op types (unary and binary; binary ones broadcast their operands against each other)
ELEMENTWISE_TYPES = frozenset(_ELEMENTWISE_FACTOR) | {"BiasAdd", "BiasAddV1", "AddN"}
REDUCTION_TYPES = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin",
                             "EuclideanNorm"})
_APPLY_FACTOR = {  # FLOPs per updated parameter, by optimizer (the part after "Apply")
    "GradientDescent": 2, "ProximalGradientDescent": 6, "Momentum": 4, "KerasMomentum": 4, "Adagrad": 5,
    "AdagradV2": 6, "AdagradDA": 10, "ProximalAdagrad": 10, "Adam": 12, "AdamWithAmsgrad": 14, "AdaMax": 10,
    "Adadelta": 12, "RMSProp": 8, "CenteredRMSProp": 11, "Ftrl": 15, "FtrlV2": 16, "AddSign": 8,
    "PowerSign": 10,
}

# Ops that move or view data, bookkeeping and control: 0 FLOPs (their cost is the memory term).
ZERO_FLOP_TYPES = frozenset("""Identity IdentityN Const HostConst Reshape Squeeze ExpandDims Shape ShapeN Size Rank
NoOp ReadVariableOp VarHandleOp VariableV2 Variable VarIsInitializedOp IsVariableInitialized Placeholder PlaceholderV2
PlaceholderWithDefault StopGradient PreventGradient Snapshot BroadcastGradientArgs ConcatV2 Concat ConcatOffset Pack
Unpack Split SplitV Slice StridedSlice StridedSliceGrad TensorStridedSliceUpdate ResourceStridedSliceAssign Tile Pad
PadV2 MirrorPad Transpose ConjugateTranspose GatherV2 Gather GatherNd ResourceGather ResourceGatherNd Fill ZerosLike
OnesLike Range BroadcastTo BroadcastArgs Bitcast EnsureShape Assert Print PrintV2 StringFormat Switch Merge Enter Exit
RefEnter RefExit RefMerge RefSwitch NextIteration RefNextIteration LoopCond ControlTrigger Empty InvertPermutation
DynamicStitch ParallelDynamicStitch Reverse ReverseV2 OneHot AssignVariableOp Assign ResourceScatterUpdate
ScatterUpdate IteratorGetNext IteratorGetNextSync IteratorV2 Iterator OptionalFromValue OptionalGetValue OptionalNone
OptionalHasValue StatelessRandomGetKeyCounter StatelessRandomGetAlg StatelessRandomGetKeyCounterAlg DeviceIndex Where
Unique DestroyResourceOp SaveV2 RestoreV2 MergeV2Checkpoints DepthToSpace SpaceToDepth BatchToSpaceND SpaceToBatchND
DiagPart Diag MatrixDiag MatrixDiagPart MatrixDiagV3 MatrixDiagPartV3 MatrixBandPart MatrixSetDiagV3 Roll
CollectiveReduceV2 CollectiveGatherV2 CollectiveReduce CollectiveGather CollectiveBcastSend CollectiveBcastRecv
CollectiveBcastSendV2 CollectiveBcastRecvV2 NcclAllReduce _Send _Recv _HostSend _HostRecv Cross
TensorScatterUpdate ScatterNd ResizeNearestNeighbor VariableShape""".split()) | TENSOR_LIST_TYPES


def _in(shapes: list, i: int) -> Shape | None:
    return shapes[i] if i < len(shapes) else None


def _r_elementwise(factor: float) -> FlopRule:
    def rule(a, ins, outs, ex):
        n = numel(_in(outs, 0))
        return None if n is None else factor * n
    return rule


def _r_addn(a, ins, outs, ex):
    n = numel(_in(outs, 0))
    return None if n is None else max(len(ins) - 1, 1) * n


def _r_bias_grad(a, ins, outs, ex):
    return numel(_in(ins, 0))


def _r_reduction(a, ins, outs, ex):
    n = numel(_in(ins, 0))
    if n is None:
        return None
    return float(n + (numel(_in(outs, 0)) or 0) if ex.get("type") == "Mean" else n)


def _r_matmul(a, ins, outs, ex):
    x, out = _in(ins, 0), _in(outs, 0)
    if x is None or out is None or len(x) != 2:
        return None
    k = x[0] if a["transpose_a"].b else x[1]
    p = prod(list(out) + [k])
    return None if p is None else 2.0 * p


def _r_batch_matmul(a, ins, outs, ex):
    x, out = _in(ins, 0), _in(outs, 0)
    if x is None or out is None or len(x) < 2:
        return None
    k = x[-2] if a["adj_x"].b else x[-1]
    p = prod(list(out) + [k])
    return None if p is None else 2.0 * p


def _conv_rule(out_of: Callable, filt_of: Callable, window_dims: int | None) -> FlopRule:
    """2 * (elements of the conv's output side) * (window size * input channels, or window for depthwise)."""
    def rule(a, ins, outs, ex):
        big, filt = out_of(ins, outs), filt_of(ins, outs)
        if big is None or filt is None:
            return None
        per = prod(filt[:window_dims] if window_dims is not None else filt[:-1])
        n = numel(big)
        return None if per is None or n is None else 2.0 * n * per
    return rule


def _r_pool(big_of: Callable) -> FlopRule:
    def rule(a, ins, outs, ex):
        big = big_of(ins, outs)
        n = numel(big)
        k = prod(a["ksize"].list.i) if "ksize" in a else None
        if n is None:
            return None
        return float(n * (k or 1))
    return rule


def _r_fused_bn(training_factor: float, inference_factor: float) -> FlopRule:
    """Batch norm (or its gradient): FLOPs per input element, more when it computes batch statistics."""
    def rule(a, ins, outs, ex):
        n = numel(_in(ins, 0))
        if n is None:
            return None
        training = a["is_training"].b if "is_training" in a else True
        return (training_factor if training else inference_factor) * n
    return rule


def _r_einsum(a, ins, outs, ex):
    eq = a["equation"].s.decode() if "equation" in a else ""
    if "->" not in eq:
        return None
    lhs, _ = eq.replace(" ", "").split("->", 1)
    terms = lhs.split(",")
    if len(terms) != len(ins):
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, ins, strict=True):
        if shape is None:
            return None
        if "..." in term:
            pre, post = term.split("...", 1)
            n_ell = len(shape) - len(pre) - len(post)
            # broadcast ellipsis dims align from the right across operands
            labels = list(pre) + [f"...{n_ell - i}" for i in range(n_ell)] + list(post)
        else:
            labels = list(term)
        if len(labels) != len(shape):
            return None
        for lab, d in zip(labels, shape, strict=True):
            if d is None:
                return None
            sizes[lab] = max(sizes.get(lab, 1), int(d))
    p = float(np.prod(list(sizes.values()), dtype=np.float64)) if sizes else 1.0
    return (2.0 if len(ins) > 1 else 1.0) * p


def _r_apply(factor: float) -> FlopRule:
    def rule(a, ins, outs, ex):
        gi = ex.get("grad_index")
        n = numel(_in(ins, gi)) if gi is not None else None
        return None if n is None else factor * n
    return rule


def _r_by_input(i: int, factor: float = 1.0) -> FlopRule:
    def rule(a, ins, outs, ex):
        n = numel(_in(ins, i))
        return None if n is None else factor * n
    return rule


def _r_zero(a, ins, outs, ex):
    return 0.0


def _build_flop_rules() -> dict[str, FlopRule]:
    r: dict[str, FlopRule] = {t: _r_zero for t in ZERO_FLOP_TYPES}
    for t, f in _ELEMENTWISE_FACTOR.items():
        r[t] = _r_elementwise(f)
    r["BiasAdd"] = r["BiasAddV1"] = _r_elementwise(1.0)
    r["BiasAddGrad"] = _r_bias_grad
    r["AddN"] = r["AccumulateNV2"] = _r_addn
    for t in REDUCTION_TYPES:
        r[t] = _r_reduction
    r["MatMul"] = _r_matmul
    r["BatchMatMul"] = r["BatchMatMulV2"] = r["BatchMatMulV3"] = _r_batch_matmul
    r["Einsum"] = _r_einsum
    out0 = lambda ins, outs: _in(outs, 0)  # noqa: E731
    in1 = lambda ins, outs: _in(ins, 1)  # noqa: E731
    in2 = lambda ins, outs: _in(ins, 2)  # noqa: E731
    r["Conv2D"] = r["Conv3D"] = _conv_rule(out0, in1, None)
    r["Conv2DBackpropInput"] = r["Conv3DBackpropInputV2"] = r["Conv3DBackpropInput"] = _conv_rule(in2, in1, None)
    r["Conv2DBackpropFilter"] = r["Conv3DBackpropFilterV2"] = r["Conv3DBackpropFilter"] = _conv_rule(in2, out0, None)
    r["DepthwiseConv2dNative"] = _conv_rule(out0, in1, 2)
    r["DepthwiseConv2dNativeBackpropInput"] = _conv_rule(in2, in1, 2)
    r["DepthwiseConv2dNativeBackpropFilter"] = _conv_rule(in2, out0, 2)
    for t in ("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D", "MaxPoolWithArgmax"):
        r[t] = _r_pool(out0)
    for t in ("MaxPoolGrad", "MaxPool3DGrad", "MaxPoolGradGrad", "MaxPoolGradWithArgmax"):
        r[t] = _r_pool(in2 if t != "MaxPoolGradWithArgmax" else in1)
    r["AvgPoolGrad"] = r["AvgPool3DGrad"] = _r_pool(in1)
    r["MaxPoolV2"] = _r_elementwise(9.0)
    r["MaxPoolGradV2"] = _r_by_input(2, 9.0)
    for t in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        r[t] = _r_fused_bn(8.0, 2.0)
    for t in ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"):
        r[t] = _r_fused_bn(10.0, 3.0)
    r["Softmax"] = r["LogSoftmax"] = _r_by_input(0, 5.0)
    r["SoftmaxCrossEntropyWithLogits"] = r["SparseSoftmaxCrossEntropyWithLogits"] = _r_by_input(0, 8.0)
    r["L2Loss"] = _r_by_input(0, 2.0)
    r["InTopKV2"] = r["InTopK"] = _r_by_input(0, 1.0)
    for t in ("AssignAddVariableOp", "AssignSubVariableOp"):
        r[t] = _r_by_input(1, 1.0)
    for t in ("AssignAdd", "AssignSub"):
        r[t] = _r_by_input(1, 1.0)
    for t in ("UnsortedSegmentSum", "SegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin", "SegmentMean",
              "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN"):
        r[t] = _r_by_input(0, 1.0)
    for t in ("ResourceScatterAdd", "ResourceScatterSub", "ScatterAdd", "ScatterSub", "TensorScatterAdd",
              "TensorScatterSub", "ResourceScatterNdAdd", "ScatterNdAdd"):
        r[t] = _r_by_input(2, 1.0)
    for opt, f in _APPLY_FACTOR.items():
        for pre in ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply"):
            r[pre + opt] = _r_apply(float(f))
    return r


_FLOP_RULES = _build_flop_rules()
FLOP_RULE_TYPES = frozenset(_FLOP_RULES) | FUNCTION_CALL_TYPES


def flops_of(op_type: str, attrs: Any, ins: list, outs: list, out_dtypes: list,
             extra: dict) -> tuple[float, bool]:
    """FLOPs of one op at the given shapes, and whether a real rule (not the fallback) produced them."""
    rule = _FLOP_RULES.get(op_type)
    if rule is None and is_apply_op(op_type):
        rule = _r_apply(5.0)
    if rule is not None:
        extra = dict(extra, type=op_type)
        try:
            v = rule(attrs, ins, outs, extra)
        except (ValueError, IndexError, KeyError, TypeError):
            v = None
        if v is not None:
            return float(v), True
        # Shapes unknown: fall back to one FLOP per known output element, still a known type.
        return fallback_flops(outs, out_dtypes), True
    return fallback_flops(outs, out_dtypes), False


def fallback_flops(outs: list, out_dtypes: list) -> float:
    """One FLOP per element of the numeric outputs whose shape is known (the rule for unknown op types)."""
    total = 0.0
    for s, dt in zip(outs, out_dtypes, strict=True):
        if dt in ("resource", "variant", "string"):
            continue
        n = numel(s)
        total += n or 0
    return total

