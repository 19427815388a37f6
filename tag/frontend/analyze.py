"""Build the training-graph IR (:class:`tag.ir.TrainingGraph`) from a TensorFlow training-step GraphDef.

Example::

    import tag
    from tag.frontend.analyze import analyze

    tg = analyze(tag.zoo.training_graph("resnet50", batch_size=32))
    print(len(tg.ops), tg.num_parameters, tg.total_flops(batch=8, phases=("forward", "backward")))
    tg16 = analyze(my_graph_def, batch_size=16)   # a user's graph whose inputs are [None, ...]

How the IR is derived (the rules later stages rely on):

* **Step ops.** The optimizer's apply ops (types ``Apply*``, ``ResourceApply*``, ``SparseApply*``,
  ``ResourceSparseApply*``), every op they reach (the ops grouping them, e.g. ``train_op``, and the
  optimizer's bookkeeping such as Adam's beta-power updates), and all data and control ancestors of
  those. Initializers, savers and summaries are left out. ``ops`` is in topological order.
* **Shapes** come from TensorFlow's own shape inference: the step is imported into a fresh
  ``tf.Graph``. Inputs with an unknown batch are declared at ``batch_size`` first. A graph built at
  another batch than ``batch_size`` is analysed at its own batch and every size is rescaled to
  ``batch_size`` (shapes along their batch axis; ``Linear`` sizes need nothing): TF1 graphs have their
  batch baked into constants (the gradient code uses static shapes), so re-declaring only the inputs
  would give an inconsistent graph.
* **Batch axes.** Batch-carrying inputs are the Placeholders / iterator outputs of rank >= 1 whose first
  dimension is the batch (the most common first dimension among them, or unknown). A second import
  declares their first dimension unknown (and, for that import only, turns ``If``/``Case`` ops into
  calls of a branch so shape inference runs through the function body); a dimension that is known in
  the first import and unknown in the second scales with the batch. Where the graph has the batch
  baked into constants (TF1 gradient code uses static shapes, users write ``reshape(x, [B*S, H])``),
  the unknown dimension stops there, so per-op rules, applied in topological order, carry the batch
  on: an output with a batch-carrying input's shape, its element count (a reshape: the batch goes to
  the first axis that spans it, so ``[B*S, H]`` and ``[B, S, H]`` both scale), or a dimension equal
  to that input's batch dimension; explicit rules for ops that reduce the batch away (weight
  gradients of MatMul/Conv2D, ``BiasAddGrad``, reductions over the batch axis, batch-norm
  statistics) and for MatMul/BatchMatMul/Gather; outputs of functional ops only by exact shape. A
  gradient op built from constants alone (``Fill``/``Tile`` of a static shape) takes the batch axis
  of the same-shaped tensor of the forward op it differentiates (``gradients/<op>_grad/...``).
  A tensor with a batch axis has ``nbytes = Linear(0, bytes / batch)``; others are fixed. Tensors with
  an unknown shape count 0 bytes and are counted in ``TrainingGraph.unknown_shape_tensors``.
* **Phases.** ``update``: the apply ops, the ops they reach, and ops whose consumers are all update
  ops (learning rate, beta powers, slot variables). ``backward``: ops under a ``gradients`` or
  ``gradients_N`` name scope (what ``tf.gradients`` uses); failing that, under any scope that holds
  ``<op>_grad`` scopes (``tf.gradients(name=...)``); failing that, ops whose type contains ``Grad``
  or ``Backprop`` and the ops they feed. ``forward``: the rest. The loss op itself is not in the IR
  when nothing in the update reads it (TF1's gradient of a mean does not).
* **Variables.** ``trainable``: the ``var`` input of an apply op, with the tensor feeding its
  ``grad``/``delta`` argument and its per-variable slots (other variable inputs of the same apply op
  with the variable's shape: Adam m/v, momentum accumulators). ``slot``: those. ``state``: any other
  variable the step uses (batch-norm moving statistics, beta powers, global step). A weight that an
  optimizer updates with scatter/assign ops instead of an apply op (TF1 Adam on an ``IndexedSlices``
  gradient) counts as state: densify such gradients first (``tag.zoo`` does).
* **Colocation.** A variable op with its read ops (``ReadVariableOp``/``Identity``), its apply op and
  its slots, merged with TensorFlow's ``_class: loc:@...`` attributes. Only groups of two or more ops.
* **FLOPs** per op as ``Linear`` in the batch (a multiply-add is 2 FLOPs). Rules cover matmuls, convs
  and their backprops, pooling, elementwise ops, reductions, softmax, batch norm, einsum, optimizer
  applies, and functional ops (``If``, ``PartitionedCall``, ...: the cost of the body, the dearer
  branch of a conditional, one trip of a loop). Data-movement ops cost 0 FLOPs. Any other op type
  gets 1 FLOP per output element, ``has_flop_rule=False``, is counted in
  ``TrainingGraph.unknown_op_types`` and logged once per analysis. An op whose inputs or outputs carry
  the batch has all its FLOPs per example, others fixed. ``mem_bytes`` = bytes of inputs + outputs.
"""
from __future__ import annotations

import gc
import heapq
import logging
import math
import os
import re
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tag.errors import GraphError  # noqa: E402
from tag.ir.op_types import (CALL_TYPES, CASE_TYPES, FUNCTION_CALL_TYPES, IF_TYPES, ITERATOR_TYPES,  # noqa: E402
                              PLACEHOLDER_TYPES, VARIABLE_TYPES, WHILE_TYPES)
from tag.ir.types import Edge, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo  # noqa: E402

__all__ = ["analyze", "is_apply_op", "FLOP_RULE_TYPES", "ZERO_FLOP_TYPES"]

log = logging.getLogger("tag")

Shape = tuple  # tuple[int | None, ...]

_APPLY_RE = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]")
_GRAD_SCOPE_RE = re.compile(r"^gradients(_\d+)?$")
_READ_TYPES = frozenset({"ReadVariableOp", "Identity"})


def is_apply_op(op_type: str) -> bool:
    """True for an optimizer update op type (ApplyAdam, ResourceApplyAdam, ResourceSparseApplyAdagrad, ...)."""
    return bool(_APPLY_RE.match(op_type))


# ---------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------

def _parse_input(s: str) -> tuple[str, int, bool]:
    """GraphDef input string -> (producer op, output index, is_control)."""
    if s.startswith("^"):
        return s[1:], -1, True
    name, sep, idx = s.rpartition(":")
    if sep and idx.isdigit():
        return name, int(idx), False
    return s, 0, False


def _numel(shape: Shape | None) -> int | None:
    if shape is None or any(d is None or d < 0 for d in shape):
        return None
    return math.prod(shape)


def _prod(dims: Iterable[int | None]) -> int | None:
    p = 1
    for d in dims:
        if d is None or d < 0:
            return None
        p *= int(d)
    return p


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:400] if text else type(err).__name__


_DTYPE_SIZES: dict[str, int] = {}


def _dtype_size(name: str) -> int:
    """Bytes per element of a dtype name; 0 for handles, variants and strings."""
    size = _DTYPE_SIZES.get(name)
    if size is None:
        size = 0 if name in ("resource", "variant", "string") else tf.as_dtype(name).size
        _DTYPE_SIZES[name] = size
    return size


def _to_shape(ts: tf.TensorShape) -> Shape | None:
    if ts.rank is None:
        return None
    return tuple(ts.as_list())


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
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin", "EuclideanNorm"})
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
TensorScatterUpdate ScatterNd ResizeNearestNeighbor""".split())


def _in(shapes: list, i: int) -> Shape | None:
    return shapes[i] if i < len(shapes) else None


def _r_elementwise(factor: float) -> FlopRule:
    def rule(a, ins, outs, ex):
        n = _numel(_in(outs, 0))
        return None if n is None else factor * n
    return rule


def _r_addn(a, ins, outs, ex):
    n = _numel(_in(outs, 0))
    return None if n is None else max(len(ins) - 1, 1) * n


def _r_bias_grad(a, ins, outs, ex):
    return _numel(_in(ins, 0))


def _r_reduction(a, ins, outs, ex):
    n = _numel(_in(ins, 0))
    if n is None:
        return None
    return float(n + (_numel(_in(outs, 0)) or 0) if ex.get("type") == "Mean" else n)


def _r_matmul(a, ins, outs, ex):
    x, out = _in(ins, 0), _in(outs, 0)
    if x is None or out is None or len(x) != 2:
        return None
    k = x[0] if a["transpose_a"].b else x[1]
    p = _prod(list(out) + [k])
    return None if p is None else 2.0 * p


def _r_batch_matmul(a, ins, outs, ex):
    x, out = _in(ins, 0), _in(outs, 0)
    if x is None or out is None or len(x) < 2:
        return None
    k = x[-2] if a["adj_x"].b else x[-1]
    p = _prod(list(out) + [k])
    return None if p is None else 2.0 * p


def _conv_rule(out_of: Callable, filt_of: Callable, window_dims: int | None) -> FlopRule:
    """2 * (elements of the conv's output side) * (window size * input channels, or window for depthwise)."""
    def rule(a, ins, outs, ex):
        big, filt = out_of(ins, outs), filt_of(ins, outs)
        if big is None or filt is None:
            return None
        per = _prod(filt[:window_dims] if window_dims is not None else filt[:-1])
        n = _numel(big)
        return None if per is None or n is None else 2.0 * n * per
    return rule


def _r_pool(big_of: Callable) -> FlopRule:
    def rule(a, ins, outs, ex):
        big = big_of(ins, outs)
        n = _numel(big)
        k = _prod(a["ksize"].list.i) if "ksize" in a else None
        if n is None:
            return None
        return float(n * (k or 1))
    return rule


def _r_fused_bn(a, ins, outs, ex):
    n = _numel(_in(ins, 0))
    if n is None:
        return None
    training = a["is_training"].b if "is_training" in a else True
    return (8.0 if training else 2.0) * n


def _r_fused_bn_grad(a, ins, outs, ex):
    n = _numel(_in(ins, 0))
    if n is None:
        return None
    training = a["is_training"].b if "is_training" in a else True
    return (10.0 if training else 3.0) * n


def _r_softmax(factor: float) -> FlopRule:
    def rule(a, ins, outs, ex):
        n = _numel(_in(ins, 0))
        return None if n is None else factor * n
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
    for term, shape in zip(terms, ins):
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
        for lab, d in zip(labels, shape):
            if d is None:
                return None
            sizes[lab] = max(sizes.get(lab, 1), int(d))
    p = float(np.prod(list(sizes.values()), dtype=np.float64)) if sizes else 1.0
    return (2.0 if len(ins) > 1 else 1.0) * p


def _r_apply(factor: float) -> FlopRule:
    def rule(a, ins, outs, ex):
        gi = ex.get("grad_index")
        n = _numel(_in(ins, gi)) if gi is not None else None
        return None if n is None else factor * n
    return rule


def _r_by_input(i: int, factor: float = 1.0) -> FlopRule:
    def rule(a, ins, outs, ex):
        n = _numel(_in(ins, i))
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
    for t in _REDUCTIONS:
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
        r[t] = _r_fused_bn
    for t in ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"):
        r[t] = _r_fused_bn_grad
    r["Softmax"] = r["LogSoftmax"] = _r_softmax(5.0)
    r["SoftmaxCrossEntropyWithLogits"] = r["SparseSoftmaxCrossEntropyWithLogits"] = _r_softmax(8.0)
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


def _flops_of(op_type: str, attrs, ins: list, outs: list, out_dtypes: list, extra: dict) -> tuple[float, bool]:
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
        return _fallback_flops(outs, out_dtypes), True
    return _fallback_flops(outs, out_dtypes), False


def _fallback_flops(outs: list, out_dtypes: list) -> float:
    total = 0.0
    for s, dt in zip(outs, out_dtypes):
        if dt in ("resource", "variant", "string"):
            continue
        n = _numel(s)
        total += n or 0
    return total


# ---------------------------------------------------------------------------------------------------------
# Functional ops (If / Case / PartitionedCall / While): cost of the body, via TF's function shape inference
# ---------------------------------------------------------------------------------------------------------

class _FunctionCoster:
    """Costs function bodies with TensorFlow's shape inference; caches structurally identical bodies."""

    def __init__(self, library: dict[str, Any]):
        self.library = library
        self.cache: dict[tuple, tuple[float, Counter]] = {}
        self._keys: dict[str, tuple] = {}

    def _struct_key(self, fname: str) -> tuple:
        k = self._keys.get(fname)
        if k is None:
            fdef = self.library[fname]
            k = tuple((n.op, tuple(sorted((a, v.SerializeToString(deterministic=True))
                                          for a, v in n.attr.items() if not a.startswith("_"))))
                      for n in fdef.node_def)
            self._keys[fname] = k
        return k

    def cost(self, fname: str, in_shapes: list, depth: int = 0) -> tuple[float, Counter]:
        """(FLOPs, unknown op types) of one call of function FNAME with inputs of IN_SHAPES."""
        if fname not in self.library or depth > 6:
            return 0.0, Counter()
        key = (self._struct_key(fname), tuple(in_shapes))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        from tensorflow.python.framework import function_def_to_graph as f2g  # TF's own function importer

        result: tuple[float, Counter] = (0.0, Counter())
        try:
            shapes = [tf.TensorShape(None if s is None else list(s)) for s in in_shapes]
            fg = f2g.function_def_to_graph(self.library[fname], input_shapes=shapes)
        except Exception as err:  # noqa: BLE001 - a body TF cannot rebuild costs nothing, never crashes
            log.debug("cannot rebuild function %s for costing: %s", fname, _first_line(err))
            self.cache[key] = result
            return result
        total, unknown = 0.0, Counter()
        for op in fg.get_operations():
            if op.type in ("Placeholder", "NoOp", "Identity"):
                continue
            nd = op.node_def
            ins = [_to_shape(t.shape) for t in op.inputs]
            outs = [_to_shape(t.shape) for t in op.outputs]
            if op.type in FUNCTION_CALL_TYPES:
                f, unk = self.cost_functional(op.type, nd.attr, ins, depth + 1)
                total += f
                unknown.update(unk)
                continue
            extra = {}
            if is_apply_op(op.type):
                extra["grad_index"] = _grad_arg_index(op.op_def)
            f, known = _flops_of(op.type, nd.attr, ins, outs, [t.dtype.name for t in op.outputs], extra)
            total += f
            if not known:
                unknown[op.type] += 1
        result = (total, unknown)
        self.cache[key] = result
        return result

    def cost_functional(self, op_type: str, attrs, in_shapes: list, depth: int = 0,
                        const_cond: Any = None) -> tuple[float, Counter]:
        """Cost of a functional op: the dearer branch of If/Case, one trip of While, the callee of a call."""
        if op_type in IF_TYPES:
            args = in_shapes[1:]
            names = [attrs["then_branch"].func.name, attrs["else_branch"].func.name]
            if const_cond is not None:
                names = [names[0] if const_cond else names[1]]
            return self._max(names, args, depth)
        if op_type in CASE_TYPES:
            args = in_shapes[1:]
            names = [f.name for f in attrs["branches"].list.func]
            if const_cond is not None and 0 <= int(const_cond) < len(names):
                names = [names[int(const_cond)]]
            return self._max(names, args, depth)
        if op_type in CALL_TYPES:
            return self.cost(attrs["f"].func.name, in_shapes, depth)
        if op_type in WHILE_TYPES:
            fb, ub = self.cost(attrs["body"].func.name, in_shapes, depth)
            fc, uc = self.cost(attrs["cond"].func.name, in_shapes, depth)
            return fb + fc, ub + uc
        return 0.0, Counter()

    def _max(self, names: list[str], args: list, depth: int) -> tuple[float, Counter]:
        best = (0.0, Counter())
        for n in names:
            c = self.cost(n, args, depth)
            if c[0] >= best[0]:
                best = c
        return best


def _grad_arg_index(op_def) -> int | None:
    """Input index of the gradient ("grad" or "delta") argument of an apply op's OpDef."""
    idx = 0
    for arg in op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            return None
        if arg.name in ("grad", "delta"):
            return idx
        idx += 1
    return None


# ---------------------------------------------------------------------------------------------------------
# Batch-axis propagation rules (complement TF's shape inference where the batch is baked into constants)
# ---------------------------------------------------------------------------------------------------------

_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})
_BATCH_REDUCING = frozenset("""Shape ShapeN Size Rank BroadcastGradientArgs L2Loss BiasAddGrad Conv2DBackpropFilter
Conv3DBackpropFilter Conv3DBackpropFilterV2 DepthwiseConv2dNativeBackpropFilter VarIsInitializedOp
UnsortedSegmentSum UnsortedSegmentMax UnsortedSegmentMin SegmentSum SegmentMean SparseSegmentSum SparseSegmentMean
SparseSegmentSqrtN AssignVariableOp AssignAddVariableOp AssignSubVariableOp Assign AssignAdd AssignSub
ResourceScatterAdd ResourceScatterSub ResourceScatterUpdate ConcatOffset InvertPermutation""".split())


def _axis_by_prefix(in_shape: Shape, in_axis: int, out_shape: Shape) -> int | None:
    """Output axis that holds the (outer part of the) batch after a reshape of IN_SHAPE to OUT_SHAPE.

    The batch is the outermost factor of the input's batch dimension, so it lands in the first output
    axis whose prefix product exceeds the product of the input dims before the batch axis."""
    before = _prod(in_shape[:in_axis])
    if before is None:
        return None
    p = 1
    for j, d in enumerate(out_shape):
        if d is None:
            return None
        p *= d
        if p > before:
            return j
    return None


def _same_shape_axes(ins: list, outs: list) -> list:
    """Batch axis of each output that has exactly the shape of a batch-carrying input."""
    res = []
    for o in outs:
        res.append(next((ax for s, ax in ins if ax is not None and s is not None and o and s == o), None))
    return res


def _generic_axes(ins: list, outs: list) -> list:
    """Batch axis of each output: same shape, same element count, or a dim equal to an input's batch dim."""
    batch_ins = [(s, ax) for s, ax in ins if ax is not None and s is not None]
    res = []
    for o in outs:
        if o is None or len(o) == 0:
            res.append(None)
            continue
        found = None
        for s, ax in batch_ins:
            if s == o:
                found = ax
                break
        if found is None:
            n_o = _numel(o)
            for s, ax in batch_ins:
                if n_o is not None and n_o == _numel(s) and s[ax] != 1:
                    found = _axis_by_prefix(s, ax, o)
                    if found is not None:
                        break
        if found is None:
            for s, ax in batch_ins:
                d = s[ax]
                if d is None or d <= 1:
                    continue
                if ax < len(o) and o[ax] == d:
                    found = ax
                    break
                cands = [j for j, x in enumerate(o) if x == d]
                if cands:
                    found = cands[0]
                    break
        res.append(found)
    return res


def _const_ints(node) -> list[int] | None:
    if node is None or node.op != "Const":
        return None
    try:
        return [int(v) for v in np.asarray(tf.make_ndarray(node.attr["value"].tensor)).reshape(-1)]
    except Exception:  # noqa: BLE001
        return None


def _rule_axes(op_type: str, attrs, ins: list, outs: list, const_input: Callable[[int], Any]) -> list:
    """Batch axes of an op's outputs from its inputs' batch axes (used where shape inference cannot tell)."""
    if not any(ax is not None for _, ax in ins):
        return [None] * len(outs)
    if op_type in _BATCH_REDUCING or is_apply_op(op_type):
        return [None] * len(outs)
    if op_type.startswith("FusedBatchNorm"):
        rest = [None] * (len(outs) - 1)
        s0, a0 = ins[0] if ins else (None, None)
        if a0 is None and op_type.startswith("FusedBatchNormGrad"):
            s0, a0 = ins[1] if len(ins) > 1 else (None, None)
        return [a0 if outs and s0 == outs[0] else _generic_axes(ins[:2], outs[:1])[0]] + rest
    if op_type == "MatMul" and len(ins) >= 2:
        (sa, aa), (sb, ab) = ins[0], ins[1]
        ta, tb = attrs["transpose_a"].b, attrs["transpose_b"].b
        if aa is not None and aa == (1 if ta else 0):
            return [0]
        if ab is not None and ab == (0 if tb else 1):
            return [1]
        return [None]
    if op_type.startswith("BatchMatMul") and len(ins) >= 2 and outs and outs[0] is not None:
        ro = len(outs[0])
        (sx, ax), (sy, ay) = ins[0], ins[1]
        adj_x = attrs["adj_x"].b if "adj_x" in attrs else False
        adj_y = attrs["adj_y"].b if "adj_y" in attrs else False
        for s, a, row_axis_from_end in ((sx, ax, 2 if not adj_x else 1), (sy, ay, 1 if not adj_y else 2)):
            if s is None or a is None:
                continue
            r = len(s)
            if a < r - 2:
                return [a + ro - r]
            if a == r - row_axis_from_end:
                return [ro - 2 if s is sx else ro - 1]
        return [None]
    if op_type in _REDUCTIONS and ins and ins[0][0] is not None:
        s, a = ins[0]
        axes = _const_ints(const_input(1))
        keep = attrs["keep_dims"].b if "keep_dims" in attrs else False
        if op_type in ("ArgMax", "ArgMin"):
            keep = False
        if a is None:
            return [None] * len(outs)
        if axes is not None:
            r = len(s)
            axes = {x % r for x in axes} if r else set()
            if a in axes:
                return [None]
            return [a if keep else a - sum(1 for x in axes if x < a)]
        o = outs[0] if outs else None
        if o is not None and (tuple(s[:a]) + tuple(s[a + 1:]) == tuple(o) or
                              tuple(s[:a]) + (1,) + tuple(s[a + 1:]) == tuple(o) and s[a] != 1):
            return [None]
    if op_type in ("SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits") and ins:
        s, a = ins[0]
        if a == 0:
            return [0, 0][: len(outs)]
    if op_type in ("GatherV2", "ResourceGather", "Gather") and len(ins) >= 2:
        (sp, ap), (si, ai) = ins[0], ins[1]
        if ai is not None and ap is None:
            axis = 0
            if op_type == "GatherV2":
                c = _const_ints(const_input(2))
                axis = c[0] if c else 0
            return [axis + ai]
    return _generic_axes(ins, outs)


def _forward_op_of(name: str, nodes: dict) -> str | None:
    """The forward op a ``gradients/<op>_grad/...`` op differentiates, if it is in the graph."""
    parts = name.split("/")
    for i, p in enumerate(parts[:-1]):
        if _GRAD_SCOPE_RE.match(p):
            rest = parts[i + 1:-1]
            for j, q in enumerate(rest):
                if q.endswith("_grad"):
                    cand = "/".join(rest[:j] + [q[: -len("_grad")]])
                    if cand in nodes:
                        return cand
            return None
    return None


def _mirror_axes(name: str, outs: list, out_dtypes: list, nodes: dict, shapes: dict, axes: dict) -> list:
    """Batch axes of a gradient op with no batch-carrying input: those of a same-shaped input or output
    of the forward op it differentiates (gradients have their forward tensor's shape)."""
    fwd = _forward_op_of(name, nodes)
    if fwd is None:
        return [None] * len(outs)
    n = nodes[fwd]
    cands = [(shapes[s][i], axes[s][i]) for s, i in n.data_in
             if s in shapes and i < len(shapes[s]) and s in axes and i < len(axes[s])]
    cands += list(zip(shapes.get(fwd, []), axes.get(fwd, [])))
    res = []
    for o, dt in zip(outs, out_dtypes):
        hit = None
        if o and dt in _FLOAT_DTYPES:
            same = [ax for s, ax in cands if s == o]
            if same and all(ax is not None for ax in same):
                hit = same[0]
        res.append(hit)
    return res


# ---------------------------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------------------------

class _Node:
    __slots__ = ("nd", "name", "type", "data_in", "ctrl_in", "consumers")

    def __init__(self, nd):
        self.nd = nd
        self.name = nd.name
        self.type = nd.op
        self.data_in: list[tuple[str, int]] = []
        self.ctrl_in: list[str] = []
        self.consumers: set[str] = set()


def _coerce_graph_def(graph_def: Any):
    if isinstance(graph_def, tf.Graph):
        return graph_def.as_graph_def()
    if isinstance(graph_def, tf.compat.v1.GraphDef):
        return graph_def
    if isinstance(graph_def, (bytes, bytearray)):
        gd = tf.compat.v1.GraphDef()
        try:
            gd.ParseFromString(bytes(graph_def))
        except Exception as err:  # noqa: BLE001
            raise GraphError(f"cannot parse the GraphDef bytes: {_first_line(err)}") from None
        return gd
    raise GraphError(f"analyze() needs a tf.compat.v1.GraphDef (or tf.Graph), got {type(graph_def).__name__}")


def _import(gd) -> tf.Graph:
    """Import GD into a fresh graph: TensorFlow's shape inference runs on every op."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(gd, name="")
    return g


def _batch_inputs(nodes: dict[str, _Node], step: set[str]) -> list[tuple[str, int, list[int] | None]]:
    """Candidate batch inputs: (op name, output index, declared dims or None for unknown rank)."""
    cands = []
    for name in step:
        n = nodes[name]
        if n.type in PLACEHOLDER_TYPES:
            sh = n.nd.attr["shape"].shape
            if not sh.unknown_rank and len(sh.dim) >= 1:
                cands.append((name, 0, [d.size for d in sh.dim]))
        elif n.type in ITERATOR_TYPES:
            for i, sh in enumerate(n.nd.attr["output_shapes"].list.shape):
                if not sh.unknown_rank and len(sh.dim) >= 1:
                    cands.append((name, i, [d.size for d in sh.dim]))
    cands.sort()
    return cands


def _set_batch_dims(gd, targets: dict[str, set[int]], value: int) -> None:
    """Set the first dim of the given inputs' declared shapes to VALUE (-1 = unknown), in place."""
    for nd in gd.node:
        idxs = targets.get(nd.name)
        if not idxs:
            continue
        if nd.op in PLACEHOLDER_TYPES:
            nd.attr["shape"].shape.dim[0].size = value
        else:
            shapes = nd.attr["output_shapes"].list.shape
            for i in idxs:
                shapes[i].dim[0].size = value


def _calls_instead_of_ifs(gd) -> int:
    """For the shape-only import: turn If/Case ops into PartitionedCalls of a branch so that shape
    inference runs through the function (If ops otherwise trust their stored output_shapes)."""
    n_rewritten = 0
    for nd in gd.node:
        if nd.op in IF_TYPES or nd.op in CASE_TYPES:
            if nd.op in IF_TYPES:
                f = nd.attr["then_branch"].func
            else:
                fl = nd.attr["branches"].list.func
                if not fl:
                    continue
                f = fl[0]
            fcopy = type(f)()
            fcopy.CopyFrom(f)
            tin, tout = nd.attr["Tin"], nd.attr["Tout"]
            tin_c, tout_c = type(tin)(), type(tout)()
            tin_c.CopyFrom(tin)
            tout_c.CopyFrom(tout)
            inputs = list(nd.input)
            data = [i for i in inputs if not i.startswith("^")][1:]
            ctrl = [i for i in inputs if i.startswith("^")]
            del nd.input[:]
            nd.input.extend(data + ctrl)
            nd.op = "PartitionedCall"
            for k in list(nd.attr.keys()):
                del nd.attr[k]
            nd.attr["Tin"].CopyFrom(tin_c)
            nd.attr["Tout"].CopyFrom(tout_c)
            nd.attr["f"].func.CopyFrom(fcopy)
            n_rewritten += 1
    return n_rewritten


class _Union:
    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        p = self.parent.setdefault(x, x)
        while p != self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        self.parent[x] = p
        return p

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def analyze(graph_def: Any, batch_size: int | None = None, name: str = "") -> TrainingGraph:
    """Build the TrainingGraph IR of a training-step GraphDef.

    ``batch_size``: the (global) batch to analyse at. Required when the inputs declare an unknown first
    dimension; when it differs from a declared batch the inputs are re-declared at this batch.
    Raises :class:`tag.GraphError` (one line) for a graph without optimizer apply ops or whose batch
    dimension cannot be found or fixed.
    """
    # Building the IR creates many small objects; the cyclic collector's passes over them cost more than
    # the analysis itself on large graphs, and nothing here creates garbage cycles worth collecting early.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyze(graph_def, batch_size, name)
    finally:
        if was_enabled:
            gc.enable()


def _analyze(graph_def: Any, batch_size: int | None, name: str) -> TrainingGraph:
    timings: dict[str, float] = {}
    t_last = [time.perf_counter()]

    def _mark(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = now - t_last[0]
        t_last[0] = now

    gd = _coerce_graph_def(graph_def)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise GraphError(f"batch_size must be a positive integer, got {batch_size!r}")
        batch_size = int(batch_size)

    # --- 1. the GraphDef's nodes and their wiring -------------------------------------------------------
    nodes: dict[str, _Node] = {}
    for nd in gd.node:
        if nd.name in nodes:
            raise GraphError(f"graph has two nodes named '{nd.name}'")
        nodes[nd.name] = _Node(nd)
    for n in nodes.values():
        for s in n.nd.input:
            src, idx, ctrl = _parse_input(s)
            if src not in nodes:
                raise GraphError(f"node '{n.name}' has input '{s}' that is not in the graph")
            if ctrl:
                n.ctrl_in.append(src)
            else:
                n.data_in.append((src, idx))
            nodes[src].consumers.add(n.name)

    _mark("parse")
    # --- 2. step ops -------------------------------------------------------------------------------------
    apply_names = [n.name for n in nodes.values() if is_apply_op(n.type)]
    if not apply_names:
        raise GraphError("graph has no optimizer: no Apply*/ResourceApply* op found (is this a training step?)")
    after: set[str] = set(apply_names)
    stack = list(apply_names)
    while stack:
        for c in nodes[stack.pop()].consumers:
            if c not in after:
                after.add(c)
                stack.append(c)
    step: set[str] = set(after)
    stack = list(after)
    while stack:
        n = nodes[stack.pop()]
        for src in [s for s, _ in n.data_in] + n.ctrl_in:
            if src not in step:
                step.add(src)
                stack.append(src)

    _mark("step ops")
    # --- 3. batch inputs ---------------------------------------------------------------------------------
    cands = _batch_inputs(nodes, step)
    if not cands:
        raise GraphError("cannot find the batch dimension: no Placeholder or iterator output of rank >= 1 "
                         "feeds the training step")
    declared = Counter(d[0] for _, _, d in cands if d[0] >= 0)
    graph_batch = None
    if declared:
        top = max(declared.values())
        graph_batch = max(b for b, c in declared.items() if c == top)
    batch_cands = [(nm, i, d) for nm, i, d in cands if d[0] < 0 or d[0] == graph_batch]
    unknown = [(nm, i) for nm, i, d in batch_cands if d[0] < 0]
    if unknown and batch_size is None:
        nm, i = unknown[0]
        label = nm if i == 0 else f"{nm}:{i}"
        raise GraphError(f"cannot find the batch size: input '{label}' has unknown first dimension; "
                         "pass batch_size=")
    B = batch_size if batch_size is not None else graph_batch
    assert B is not None
    targets: dict[str, set[int]] = defaultdict(set)
    for nm, i, _ in batch_cands:
        targets[nm].add(i)

    _mark("batch inputs")
    # --- 4. pruned GraphDefs and the two imports ---------------------------------------------------------
    base = tf.compat.v1.GraphDef()
    base.versions.CopyFrom(gd.versions)
    base.library.CopyFrom(gd.library)
    base.node.extend(nd for nd in gd.node if nd.name in step)
    for nd in base.node:  # colocation with ops outside the step (e.g. the loss) would fail the import
        if "_class" in nd.attr:
            keep = [c for c in nd.attr["_class"].list.s
                    if not c.startswith(b"loc:@") or c[5:].decode(errors="replace") in step]
            if len(keep) != len(nd.attr["_class"].list.s):
                if keep:
                    del nd.attr["_class"].list.s[:]
                    nd.attr["_class"].list.s.extend(keep)
                else:
                    del nd.attr["_class"]

    # Inputs with an unknown batch are declared at B_ref. A graph built at another batch is analysed at its
    # own batch and rescaled: TF1 graphs have their batch baked into constants (static shapes in the
    # gradient code), so re-declaring only the inputs would give an inconsistent graph.
    rescale = (graph_batch, B) if graph_batch is not None and B != graph_batch else None
    B_ref = graph_batch if rescale else B
    concrete = base
    if unknown:
        concrete = tf.compat.v1.GraphDef()
        concrete.CopyFrom(base)
        _set_batch_dims(concrete, targets, B_ref)   # a no-op for the inputs declared at B_ref already
    try:
        g1 = _import(concrete)
    except Exception as err:  # noqa: BLE001
        raise GraphError(f"TensorFlow cannot import the graph at batch {B_ref}: {_first_line(err)}") from None
    if rescale:
        log.info("analysing at the graph's own batch %d; sizes rescaled to batch %d", graph_batch, B)

    g2 = None
    for rewrite_ifs in (True, False):
        probe = tf.compat.v1.GraphDef()
        probe.CopyFrom(base)
        _set_batch_dims(probe, targets, -1)
        if rewrite_ifs and not _calls_instead_of_ifs(probe):
            continue
        try:
            g2 = _import(probe)
            break
        except Exception as err:  # noqa: BLE001
            log.debug("unknown-batch import failed (rewrite_ifs=%s): %s", rewrite_ifs, _first_line(err))
    probe_ops = {} if g2 is None else {op.name: op for op in g2.get_operations()}

    _mark("imports")
    # --- 5. tensors: dtype, shape, probe shape -----------------------------------------------------------
    tf_ops = {op.name: op for op in g1.get_operations()}
    shapes: dict[str, list] = {}        # op -> [shape per output] (the concrete import)
    dtypes: dict[str, list] = {}
    probe_shapes: dict[str, list] = {}  # op -> [shape per output] (the unknown-batch import)
    trick_axes: dict[str, list] = {}    # op -> [axis known in the first import, unknown in the probe]
    for nm, op in tf_ops.items():
        outs = op.outputs
        ss = [_to_shape(t.shape) for t in outs]
        shapes[nm] = ss
        dtypes[nm] = [t.dtype.name for t in outs]
        p = probe_ops.get(nm)
        ax_list: list = [None] * len(outs)
        if p is not None and len(p.outputs) == len(outs):
            ps = [_to_shape(t.shape) for t in p.outputs]
            probe_shapes[nm] = ps
            for k, (s1, s2) in enumerate(zip(ss, ps)):
                if s1 is None or s2 is None or len(s2) != len(s1):
                    continue
                for j, d in enumerate(s1):
                    if d is not None and s2[j] is None:
                        ax_list[k] = j
                        break
        trick_axes[nm] = ax_list

    _mark("shapes")
    # --- 6. topological order ----------------------------------------------------------------------------
    indeg: dict[str, int] = {}
    for nm in step:
        n = nodes[nm]
        deps = {s for s, _ in n.data_in if nodes[s].type not in ("NextIteration", "RefNextIteration")}
        deps.update(n.ctrl_in)
        indeg[nm] = len(deps)
    # Kahn's algorithm, ties broken by GraphDef position (consumers is a set: each pair counts once)
    order: list[str] = []
    pos = {nd.name: i for i, nd in enumerate(gd.node)}
    heap = [(pos[nm], nm) for nm in step if indeg[nm] == 0]
    heapq.heapify(heap)
    back_edge_types = ("NextIteration", "RefNextIteration")
    while heap:
        _, nm = heapq.heappop(heap)
        order.append(nm)
        if nodes[nm].type in back_edge_types:
            continue
        for c in nodes[nm].consumers:
            if c in indeg:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, (pos[c], c))
    if len(order) < len(step):  # cycles (TF1 while loops): keep graph order for the rest
        placed = set(order)
        order.extend(nd.name for nd in gd.node if nd.name in step and nd.name not in placed)
    index = {nm: i for i, nm in enumerate(order)}

    _mark("topo order")
    # --- 7. batch axes -----------------------------------------------------------------------------------
    axes: dict[str, list] = {}
    input_tensors = {(nm, i) for nm, i, _ in batch_cands}

    def const_node(n: _Node, k: int):
        return nodes[n.data_in[k][0]].nd if k < len(n.data_in) else None

    # Pass 1: shape inference's verdict, completed by the per-op rules. Pass 2: ops that build a batch-
    # sized tensor from constants only (TF1 gradient code: Fill/Tile with static shapes) take the batch
    # axis of the forward op they differentiate; their consumers are then re-derived.
    for second in (False, True):
        for nm in order:
            n = nodes[nm]
            ss = shapes.get(nm, [])
            if n.type in PLACEHOLDER_TYPES or n.type in ITERATOR_TYPES:
                axes[nm] = [0 if (nm, i) in input_tensors and ss[i] else None for i in range(len(ss))]
                continue
            if n.type in VARIABLE_TYPES or (n.type == "Const" and not second):
                axes[nm] = [None] * len(ss)
                continue
            res = list(axes[nm]) if second else list(trick_axes.get(nm, [None] * len(ss)))
            if all(a is not None for a in res):
                axes[nm] = res
                continue
            ins = [(shapes[s][i] if i < len(shapes[s]) else None,
                    axes[s][i] if s in axes and i < len(axes[s]) else None) for s, i in n.data_in]
            if any(a is not None for _, a in ins) and n.type in FUNCTION_CALL_TYPES:
                rule = _same_shape_axes(ins, ss)   # opaque bodies: only an input's exact shape tells
            elif any(a is not None for _, a in ins):
                rule = _rule_axes(n.type, n.nd.attr, ins, ss, lambda k, _n=n: const_node(_n, k))
            elif second and n.type not in _BATCH_REDUCING:
                rule = _mirror_axes(nm, ss, dtypes[nm], nodes, shapes, axes)
            else:
                rule = [None] * len(ss)
            axes[nm] = [a if a is not None else r for a, r in zip(res, rule)]

    _mark("batch axes")
    # --- 8. tensors ----------------------------------------------------------------------------------------
    unknown_shape = 0
    tensors: dict[str, list[TensorInfo]] = {}
    for nm in order:
        infos = []
        for k, (s, dt) in enumerate(zip(shapes[nm], dtypes[nm])):
            ax = axes[nm][k]
            size = _dtype_size(dt)
            n_el = _numel(s)
            if n_el is None:
                if size:
                    unknown_shape += 1
                nbytes = Linear(0.0, 0.0)
            elif ax is not None:
                nbytes = Linear(0.0, n_el * size / B_ref)
            else:
                nbytes = Linear(float(n_el * size), 0.0)
            shp = s
            if rescale and s is not None and ax is not None and s[ax] is not None:
                old, new = rescale
                if (s[ax] * new) % old == 0:
                    shp = tuple(s[:ax]) + (s[ax] * new // old,) + tuple(s[ax + 1:])
            infos.append(TensorInfo(f"{nm}:{k}", dt, shp, ax, nbytes))
        tensors[nm] = infos

    _mark("tensor infos")
    # --- 9. variables --------------------------------------------------------------------------------------
    def source_var(src: str, depth: int = 0) -> str | None:
        n = nodes[src]
        if n.type in VARIABLE_TYPES:
            return src
        if n.type in ("Identity", "Enter", "RefEnter", "RefIdentity") and n.data_in and depth < 8:
            return source_var(n.data_in[0][0], depth + 1)
        return None

    def var_shape(vn: str) -> tuple[int, ...] | None:
        """The declared shape; failing that, what shape inference says of the variable or its reads."""
        sh = nodes[vn].nd.attr["shape"].shape
        if not sh.unknown_rank and all(d.size >= 0 for d in sh.dim):
            return tuple(int(d.size) for d in sh.dim)
        sources = [vn] if nodes[vn].type != "VarHandleOp" else []
        sources += [c for c in nodes[vn].consumers if nodes[c].type == "ReadVariableOp" and c in shapes]
        for src in sources:
            s = shapes.get(src, [None])[0]
            if s is not None and all(d is not None for d in s):
                return tuple(s)
        return None

    var_names = [nm for nm in order if nodes[nm].type in VARIABLE_TYPES]
    var_kind: dict[str, str] = {v: "state" for v in var_names}
    var_apply: dict[str, str] = {}
    var_grad: dict[str, str] = {}
    var_slots: dict[str, list[str]] = defaultdict(list)
    apply_grad_index: dict[str, int | None] = {}
    for an in sorted(apply_names, key=lambda x: index.get(x, 0)):
        op_def = tf_ops[an].op_def
        apply_grad_index[an] = _grad_arg_index(op_def)
        n = nodes[an]
        var_arg_idx = []
        idx = 0
        for arg in op_def.input_arg:
            if arg.number_attr or arg.type_list_attr:
                break
            if arg.is_ref or arg.type == tf.resource.as_datatype_enum:
                var_arg_idx.append(idx)
            idx += 1
        if not n.data_in:
            continue
        v = source_var(n.data_in[0][0])
        if v is None or v in var_apply:
            continue
        var_kind[v] = "trainable"
        var_apply[v] = an
        gi = apply_grad_index[an]
        if gi is not None and gi < len(n.data_in):
            s, i = n.data_in[gi]
            var_grad[v] = f"{s}:{i}"
        vshape = var_shape(v)
        for k in var_arg_idx:
            if k == 0 or k >= len(n.data_in):
                continue
            sv = source_var(n.data_in[k][0])
            if sv is None or sv == v:
                continue
            if var_shape(sv) == vshape:
                var_slots[v].append(sv)
    for v, slots in var_slots.items():
        for sv in slots:
            if var_kind.get(sv) != "trainable":
                var_kind[sv] = "slot"

    def var_bytes(vn: str) -> int:
        s = var_shape(vn)
        dt = tf.as_dtype(nodes[vn].nd.attr["dtype"].type)
        return int(np.prod(s, dtype=np.int64)) * dt.size if s is not None else 0

    read_ops: dict[str, list[str]] = {
        v: sorted((c for c in nodes[v].consumers if c in step and nodes[c].type in _READ_TYPES),
                  key=lambda c: index[c]) for v in var_names}
    variables: list[VariableInfo] = []
    for v in var_names:
        s = var_shape(v)
        variables.append(VariableInfo(
            name=v, op=index[v], shape=s if s is not None else (),
            dtype=tf.as_dtype(nodes[v].nd.attr["dtype"].type).name,
            nbytes=var_bytes(v), kind=var_kind[v], apply_op=var_apply.get(v), gradient=var_grad.get(v),
            slots=list(var_slots.get(v, [])), slot_bytes=sum(var_bytes(sv) for sv in var_slots.get(v, [])),
            read_ops=read_ops[v]))

    _mark("variables")
    # --- 10. phases ----------------------------------------------------------------------------------------
    def in_grad_scope(nm: str) -> bool:
        parts = nm.split("/")[:-1]
        return any(_GRAD_SCOPE_RE.match(p) for p in parts)

    backward = {nm for nm in order if in_grad_scope(nm)}
    if not backward:
        # tf.gradients(name=...) under another scope: its ops are "<scope>/<forward op>_grad/...";
        # every op under such a scope is backward.
        scopes = set()
        for nm in order:
            parts = nm.split("/")
            for i, p in enumerate(parts[:-1]):
                if p.endswith("_grad") and i > 0:
                    scopes.add("/".join(parts[:i]) + "/")
                    break
        if scopes:
            backward = {nm for nm in order if nm not in after and any(nm.startswith(sc) for sc in scopes)}
    if not backward:
        seeds = [nm for nm in order if ("Grad" in nodes[nm].type or "Backprop" in nodes[nm].type)
                 and not is_apply_op(nodes[nm].type) and nm not in after]
        backward = set(seeds)
        for nm in order:
            if nm in backward or nm in after:
                continue
            if any(s in backward for s, _ in nodes[nm].data_in):
                backward.add(nm)
    update = set(after)
    for nm in reversed(order):
        if nm in update or nm in backward:
            continue
        cons = [c for c in nodes[nm].consumers if c in step]
        if cons and all(c in update for c in cons):
            update.add(nm)
    phase = {nm: ("update" if nm in update else "backward" if nm in backward else "forward") for nm in order}

    _mark("phases")
    # --- 11. FLOPs and memory ------------------------------------------------------------------------------
    library = {f.signature.name: f for f in gd.library.function}
    coster = _FunctionCoster(library)
    var_bytes_cache = {v.name: v.nbytes for v in variables}
    unknown_types: Counter = Counter()
    ops: list[OpInfo] = []
    for nm in order:
        n = nodes[nm]
        outs = tensors[nm]
        in_infos = [tensors[s][i] for s, i in n.data_in if i < len(tensors[s])]
        in_shapes = [t.shape for t in in_infos]
        if rescale:  # FLOP rules work on the shapes TF inferred (at the declared batch)
            in_shapes = [shapes[s][i] for s, i in n.data_in if i < len(shapes[s])]
        out_shapes = shapes[nm]
        touches_batch = any(t.batch_axis is not None for t in in_infos) or any(
            t.batch_axis is not None for t in outs)
        if n.type in FUNCTION_CALL_TYPES:
            const_cond = None
            if n.type in IF_TYPES or n.type in CASE_TYPES:
                c = _const_ints(nodes[n.data_in[0][0]].nd) if n.data_in else None
                const_cond = c[0] if c else None
            f, unk = coster.cost_functional(n.type, n.nd.attr, in_shapes, const_cond=const_cond)
            known = not unk
            unknown_types.update(unk)
        else:
            extra = {"grad_index": apply_grad_index.get(nm)} if nm in apply_grad_index else {}
            f, known = _flops_of(n.type, n.nd.attr, in_shapes, out_shapes, dtypes[nm], extra)
            if not known:
                unknown_types[n.type] += 1
        flops = Linear(0.0, f / B_ref) if touches_batch else Linear(f, 0.0)
        mf = sum(t.nbytes.fixed for t in in_infos) + sum(t.nbytes.fixed for t in outs)
        mp = sum(t.nbytes.per_example for t in in_infos) + sum(t.nbytes.per_example for t in outs)
        if nm in apply_grad_index:  # optimizer applies read and write the variables they update
            for s, _ in n.data_in:
                sv = source_var(s)
                if sv is not None:
                    mf += 2 * var_bytes_cache.get(sv, 0)
        ops.append(OpInfo(
            name=nm, type=n.type, device=n.nd.device, phase=phase[nm],  # type: ignore[arg-type]
            inputs=[f"{s}:{i}" for s, i in n.data_in], control_inputs=list(n.ctrl_in), outputs=outs,
            flops=flops, mem_bytes=Linear(float(mf), float(mp)), has_flop_rule=known))
    if unknown_types:
        log.warning("no FLOP rule for op types %s; counted 1 FLOP per output element",
                    ", ".join(f"{t} (x{c})" for t, c in sorted(unknown_types.items())))

    _mark("flops")
    # --- 12. edges -----------------------------------------------------------------------------------------
    edges: list[Edge] = []
    control_edges: list[tuple[int, int]] = []
    for nm in order:
        n = nodes[nm]
        d = index[nm]
        for s, i in n.data_in:
            t = tensors[s][i] if i < len(tensors[s]) else None
            edges.append(Edge(index[s], d, f"{s}:{i}", t.nbytes if t is not None else Linear()))
        for s in n.ctrl_in:
            control_edges.append((index[s], d))

    _mark("edges")
    # --- 13. colocation ------------------------------------------------------------------------------------
    uf = _Union()
    for v in variables:
        for r in v.read_ops:
            uf.union(v.name, r)
        if v.apply_op:
            uf.union(v.name, v.apply_op)
        for sv in v.slots:
            uf.union(v.name, sv)
            for r in read_ops.get(sv, []):
                uf.union(v.name, r)
    for nm in order:
        cl = nodes[nm].nd.attr["_class"].list.s if "_class" in nodes[nm].nd.attr else []
        for entry in cl:
            e = entry.decode(errors="replace")
            if e.startswith("loc:@") and e[5:] in step:
                uf.union(e[5:], nm)
    groups: dict[str, list[str]] = defaultdict(list)
    for nm in order:
        if nm in uf.parent:
            groups[uf.find(nm)].append(nm)
    colocation = [members for members in groups.values() if len(members) >= 2]
    colocation.sort(key=lambda m: index[m[0]])
    for gi, members in enumerate(colocation):
        for m in members:
            ops[index[m]].colocation_group = gi

    _mark("colocation")
    log.debug("analyze timings: %s", ", ".join(f"{k} {v:.3f}s" for k, v in timings.items()))
    tg = TrainingGraph(
        ops=ops, edges=edges, control_edges=control_edges, variables=variables, batch_size=B,
        inputs=sorted({nm for nm, _, _ in batch_cands}, key=lambda x: index[x]), colocation=colocation,
        unknown_op_types=dict(unknown_types), name=name, unknown_shape_tensors=unknown_shape)
    if unknown_shape:
        log.info("%d tensors of %s have an unknown shape; counted as 0 bytes", unknown_shape, name or "the graph")
    return tg
