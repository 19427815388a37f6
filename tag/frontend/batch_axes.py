"""Batch axes: which axis of each tensor scales with the batch.

Why: every per-example size in the IR (tensor bytes, FLOPs) hangs on knowing which tensors carry the
batch and along which axis. Shape inference gives the first verdict (a dim known at the reference
batch and unknown when the inputs' batch is unknown, :mod:`tag.frontend.shapes`); where the graph has
the batch baked into constants, per-op rules applied in topological order carry it on: an output with
a batch-carrying input's shape, its element count (a reshape: the batch goes to the first axis that
spans it), or a dimension equal to that input's batch dim; explicit rules for ops that reduce the
batch away (weight gradients, ``BiasAddGrad``, reductions over the batch axis, batch-norm statistics)
and for MatMul/BatchMatMul/Gather. A gradient op built from constants alone (``Fill``/``Tile`` of a
static shape) *mirrors* the batch axis of the same-shaped tensor of the forward op it differentiates.

Example::

    from tag.frontend.batch_axes import generic_axes
    # input [32, 8] with the batch on axis 0; outputs [32, 8] (same shape) and [256] (a reshape)
    generic_axes([((32, 8), 0)], [(32, 8), (256,)])      # [0, 0]
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tag.frontend.graph_import import Node, StepGraph
from tag.frontend.op_rules import ELEMENTWISE_TYPES, REDUCTION_TYPES, Shape, is_apply_op, numel, prod
from tag.frontend.phases import forward_op_of
from tag.frontend.shapes import BatchSpec, InferredShapes
from tag.ir.op_types import FUNCTION_CALL_TYPES, ITERATOR_TYPES, PLACEHOLDER_TYPES, VARIABLE_TYPES

__all__ = ["batch_axes", "const_ints", "generic_axes", "rule_axes"]

# An op's inputs as the axis rules see them: (shape, batch axis or None) per data input.
ShapedInputs = list  # list[tuple[Shape | None, int | None]]

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
    before = prod(in_shape[:in_axis])
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


def _same_shape_axes(ins: ShapedInputs, outs: list) -> list:
    """Batch axis of each output that has exactly the shape of a batch-carrying input."""
    res = []
    for o in outs:
        res.append(next((ax for s, ax in ins if ax is not None and s is not None and o and s == o), None))
    return res


def _completed(shape: Shape, total: int | None) -> Shape:
    """SHAPE with its one unknown dim solved from the element count TOTAL of a reshape's output (a loop's
    stacked outputs have an unknown length); SHAPE as it is otherwise."""
    unknown = [j for j, d in enumerate(shape) if d is None]
    known = prod([d for d in shape if d is not None])
    if len(unknown) != 1 or total is None or not known or total % known:
        return shape
    return tuple(total // known if d is None else d for d in shape)


def generic_axes(ins: ShapedInputs, outs: list) -> list:
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
            n_o = numel(o)
            for s, ax in batch_ins:
                s = _completed(s, n_o)
                if n_o is not None and n_o == numel(s) and s[ax] != 1:
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


def const_ints(node: Any) -> list[int] | None:
    """The values of a Const NodeDef as a flat list of ints; None for anything else."""
    if node is None or node.op != "Const":
        return None
    try:
        return [int(v) for v in np.asarray(tf.make_ndarray(node.attr["value"].tensor)).reshape(-1)]
    except Exception:  # noqa: BLE001
        return None


def rule_axes(op_type: str, attrs: Any, ins: ShapedInputs, outs: list,
              const_input: Callable[[int], Any]) -> list:
    """Batch axes of an op's outputs from its inputs' batch axes (used where shape inference cannot tell).

    CONST_INPUT(k) is the NodeDef feeding input k (to read constant reduction axes, gather axes)."""
    if not any(ax is not None for _, ax in ins):
        return [None] * len(outs)
    if op_type in _BATCH_REDUCING or is_apply_op(op_type):
        return [None] * len(outs)
    special = None   # an op-specific verdict; None falls through to the generic rule
    if op_type.startswith("FusedBatchNorm"):
        special = _fused_batch_norm_axes(op_type, ins, outs)
    elif op_type == "MatMul" and len(ins) >= 2:
        special = _matmul_axes(attrs, ins)
    elif op_type.startswith("BatchMatMul") and len(ins) >= 2 and outs and outs[0] is not None:
        special = _batch_matmul_axes(attrs, ins, outs)
    elif op_type in REDUCTION_TYPES and ins and ins[0][0] is not None:
        special = _reduction_axes(op_type, attrs, ins, outs, const_input)
    elif op_type in ("SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits") and ins:
        if ins[0][1] == 0:
            special = [0, 0][: len(outs)]
    elif op_type == "Einsum":
        special = _einsum_axes(attrs, ins, outs)
    elif op_type in ("GatherV2", "ResourceGather", "Gather") and len(ins) >= 2:
        special = _gather_axes(op_type, ins, const_input)
    elif op_type in _TRANSPOSES and len(ins) >= 2:
        special = _transpose_axes(ins, outs, const_input)
    return special if special is not None else generic_axes(ins, outs)


_TRANSPOSES = frozenset({"Transpose", "ConjugateTranspose"})


def _transpose_axes(ins: ShapedInputs, outs: list, const_input: Callable[[int], Any],
                    inverted: Callable[[Any], Any] | None = None) -> list | None:
    """A transpose by a constant permutation (or, given INVERTED(node) -> the Const an
    ``InvertPermutation`` NODE inverts, by the inverse of one: a transpose's gradient) moves the batch
    where the permutation puts it."""
    node = const_input(1)
    perm = const_ints(node) if node is not None and node.op == "Const" else None
    if node is not None and node.op == "InvertPermutation" and inverted is not None:
        src = inverted(node)
        forward = const_ints(src) if src is not None and src.op == "Const" else None
        perm = [int(i) for i in np.argsort(forward)] if forward is not None else None
    if perm is None or ins[0][1] is None or ins[0][1] not in perm:
        return None
    return [perm.index(ins[0][1])] + [None] * (len(outs) - 1)


def _fused_batch_norm_axes(op_type: str, ins: ShapedInputs, outs: list) -> list:
    """y (or the input gradient) keeps x's batch axis; the statistics have none."""
    rest = [None] * (len(outs) - 1)
    s0, a0 = ins[0] if ins else (None, None)
    if a0 is None and op_type.startswith("FusedBatchNormGrad"):
        s0, a0 = ins[1] if len(ins) > 1 else (None, None)
    return [a0 if outs and s0 == outs[0] else generic_axes(ins[:2], outs[:1])[0]] + rest


def _matmul_axes(attrs: Any, ins: ShapedInputs) -> list:
    """The batch stays only where it is a row of a or a column of b (a weight gradient reduces it away)."""
    (_, aa), (_, ab) = ins[0], ins[1]
    ta, tb = attrs["transpose_a"].b, attrs["transpose_b"].b
    if aa is not None and aa == (1 if ta else 0):
        return [0]
    if ab is not None and ab == (0 if tb else 1):
        return [1]
    return [None]


def _batch_matmul_axes(attrs: Any, ins: ShapedInputs, outs: list) -> list:
    """A batch in the leading (broadcast) dims, or in the rows of x / columns of y, survives."""
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


def _reduction_axes(op_type: str, attrs: Any, ins: ShapedInputs, outs: list,
                    const_input: Callable[[int], Any]) -> list | None:
    """None over the batch axis; else the batch axis shifted by the reduced axes before it. None (fall
    through) when the reduced axes are not constant and the output shape does not tell."""
    s, a = ins[0]
    axes = const_ints(const_input(1))
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
    return None


def _einsum_axes(attrs: Any, ins: ShapedInputs, outs: list) -> list | None:
    """The label at an operand's batch axis: where it is in the output, or None if summed away (a weight
    gradient). None (fall through) for equations with ellipses."""
    eq = attrs["equation"].s.decode() if "equation" in attrs else ""
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->", 1)
    terms = lhs.split(",")
    if len(terms) != len(ins):
        return None
    for term, (s, ax) in zip(terms, ins, strict=True):
        if ax is not None and s is not None and len(term) == len(s) and ax < len(term):
            label = term[ax]
            return [out.index(label) if label in out else None]
    return None


def _gather_axes(op_type: str, ins: ShapedInputs, const_input: Callable[[int], Any]) -> list | None:
    """Gathering batch-carrying indices from a parameter: the batch lands at the gather axis."""
    (_, ap), (_, ai) = ins[0], ins[1]
    if ai is not None and ap is None:
        axis = 0
        if op_type == "GatherV2":
            c = const_ints(const_input(2))
            axis = c[0] if c else 0
        return [axis + ai]
    return None


def _mirror_axes(name: str, outs: list, out_dtypes: list, nodes: dict[str, Node], shapes: dict[str, list],
                 axes: dict[str, list]) -> list:
    """Batch axes of a gradient op with no batch-carrying input: those of a same-shaped input or output
    of the forward op it differentiates (gradients have their forward tensor's shape)."""
    fwd = forward_op_of(name, nodes)
    if fwd is None:
        return [None] * len(outs)
    n = nodes[fwd]
    cands = [(shapes[s][i], axes[s][i]) for s, i in n.data_in
             if s in shapes and i < len(shapes[s]) and s in axes and i < len(axes[s])]
    cands += list(zip(shapes.get(fwd, []), axes.get(fwd, []), strict=True))
    res = []
    for o, dt in zip(outs, out_dtypes, strict=True):
        hit = None
        if o and dt in _FLOAT_DTYPES:
            same = [ax for s, ax in cands if s == o]
            if same and all(ax is not None for ax in same):
                hit = same[0]
        res.append(hit)
    return res


def batch_axes(sg: StepGraph, inferred: InferredShapes, batch: BatchSpec,
               context: list[str] | None = None) -> dict[str, list[int | None]]:
    """Op name -> the batch axis of each of its outputs (None: does not scale with the batch).

    Pass 1: shape inference's verdict, completed by the per-op rules. Pass 2: ops that build a batch-
    sized tensor from constants only (TF1 gradient code: Fill/Tile with static shapes) take the batch
    axis of the forward op they differentiate; their consumers are then re-derived.
    """
    axes: dict[str, list[int | None]] = {}
    input_tensors = {(nm, i) for nm, i, _ in batch.inputs}   # (op, output index) fed with a batch
    order = list(sg.order) + list(context or [])   # CONTEXT: forward ops outside the step (the loss's tail)
    graph_batch = batch.graph_batch or batch.batch
    distrusted: set[str] = set()
    for nm in order:
        axes[nm] = _op_axes(nm, sg, inferred, axes, input_tensors, False, distrusted)
        if sg.nodes[nm].type in _LIST_READS and all(a is None for a in axes[nm]):
            axes[nm] = _tensor_list_axes(sg.nodes[nm], inferred.shapes.get(nm, []), sg.nodes, graph_batch) \
                or axes[nm]
    for _ in range(3):   # pass 2, again while the sibling rule finds batch-sized constants
        adopted = False
        for nm in order:
            adopted |= _sibling_axes(nm, sg, inferred, axes)
            axes[nm] = _op_axes(nm, sg, inferred, axes, input_tensors, True)
        if not adopted:
            break
    return axes


#: ops that never take a batch axis from a sibling (variables and their reads, batch sources)
_NO_SIBLING_TYPES = VARIABLE_TYPES | PLACEHOLDER_TYPES | ITERATOR_TYPES | {"ReadVariableOp", "ResourceGather",
                                                                           "VariableShape"}


def _no_batch_input(n: Node, axes: dict[str, list]) -> bool:
    return all(axes.get(s, [None] * (i + 1))[i] is None for s, i in n.data_in)


def _sibling_axes(nm: str, sg: StepGraph, inferred: InferredShapes, axes: dict[str, list]) -> bool:
    """A batch-sized tensor TensorFlow built from constants alone (``zeros_like``/``ones_like``/``fill`` of
    a static batch shape folded into a Const; a mean's gradient tiled to the batch) takes the batch axis
    of the tensor it meets: an operand of the same elementwise op with exactly its shape. (An
    exact-shape operand of a replica's smaller batch must be split with it, or the op would not run.)
    The axis then goes up to the same-shaped producers it was computed from. True if AXES changed."""
    n = sg.nodes[nm]
    ss = inferred.shapes.get(nm, [])
    if len(ss) != 1 or not ss[0] or axes[nm][0] is not None or n.type in _NO_SIBLING_TYPES \
            or not _no_batch_input(n, axes):
        return False
    for c in n.consumers:
        cn = sg.nodes[c]
        if c not in axes or cn.type not in ELEMENTWISE_TYPES:
            continue
        for s, i in cn.data_in:
            if s == nm or s not in axes or i >= len(axes[s]):
                continue
            ax = axes[s][i]
            if ax is not None and inferred.shapes[s][i] == ss[0]:
                axes[nm] = [ax]
                _adopt_upward(nm, ax, sg, inferred, axes)
                return True
    return False


def _adopt_upward(nm: str, ax: int, sg: StepGraph, inferred: InferredShapes, axes: dict[str, list]) -> None:
    """Give batch axis AX to the producers NM was computed from that have its shape and no batch axis."""
    shape = inferred.shapes[nm][0]
    stack = [nm]
    while stack:
        for s, i in sg.nodes[stack.pop()].data_in:
            ps = sg.nodes[s]
            if s in axes and i < len(axes[s]) and axes[s][i] is None and inferred.shapes[s][i] == shape \
                    and ps.type not in _NO_SIBLING_TYPES and _no_batch_input(ps, axes):
                axes[s][i] = ax
                stack.append(s)


def _op_axes(nm: str, sg: StepGraph, inferred: InferredShapes, axes: dict[str, list],
             input_tensors: set[tuple[str, int]], second: bool, distrusted: set[str] | None = None) -> list:
    """One op's output batch axes in pass 1 (SECOND false) or pass 2, given its predecessors' AXES.
    DISTRUSTED (pass 1): ops whose probe verdict was found wrong, and the ops computed from them, which
    take the per-op rules instead of the probe."""
    nodes, shapes = sg.nodes, inferred.shapes
    n = nodes[nm]
    ss = shapes.get(nm, [])
    if n.type in PLACEHOLDER_TYPES or n.type in ITERATOR_TYPES:
        return [0 if (nm, i) in input_tensors and ss[i] else None for i in range(len(ss))]
    if n.type in VARIABLE_TYPES or (n.type == "Const" and not second):
        return [None] * len(ss)
    res = list(axes[nm]) if second else list(inferred.probe_axes.get(nm, [None] * len(ss)))
    ins = [(shapes[s][i] if i < len(shapes[s]) else None,
            axes[s][i] if s in axes and i < len(axes[s]) else None) for s, i in n.data_in]
    if n.type in _TRANSPOSES and len(ins) >= 2:
        # unambiguous, and shape inference's verdict is not: a loop's stacked outputs have an unknown
        # length, which a probe at an unknown batch would take for the batch
        moved = _transpose_axes(ins, ss, lambda k: _const_input_node(nodes, n, k),
                                lambda inv: _const_input_node(nodes, nodes[inv.name], 0))
        if moved is not None:
            return moved
    if not second and distrusted is not None:
        if any(s in distrusted for s, _ in n.data_in):
            distrusted.add(nm)          # the probe's verdicts downstream of a wrong one are wrong too
            res = [None] * len(ss)
        elif n.type == "Reshape" and ins and ins[0][1] is not None:
            # a shape constant that spells the batch out ([24, -1]) leaves the *other* axis unknown in the
            # probe; the element count of static shapes says where the batch went
            rule = rule_axes(n.type, n.nd.attr, ins[:1], ss, lambda k: _const_input_node(nodes, n, k))
            if rule and rule[0] is not None and res and res[0] != rule[0]:
                distrusted.add(nm)
                return rule
    if all(a is not None for a in res):
        return res
    if any(a is not None for _, a in ins) and n.type in FUNCTION_CALL_TYPES:
        rule = _same_shape_axes(ins, ss)   # opaque bodies: only an input's exact shape tells
    elif any(a is not None for _, a in ins):
        rule = rule_axes(n.type, n.nd.attr, ins, ss, lambda k: _const_input_node(nodes, n, k))
    elif second and n.type not in _BATCH_REDUCING:
        rule = _mirror_axes(nm, ss, inferred.dtypes[nm], nodes, shapes, axes)
    else:
        rule = [None] * len(ss)
    return [a if a is not None else r for a, r in zip(res, rule, strict=True)]


# TensorList reads -> (input index of the element shape, output axis of the element's first entry)
_LIST_READS = {"TensorListStack": (1, 1), "TensorListGather": (2, 1), "TensorListGetItem": (2, 0)}


def _tensor_list_axes(n: Node, ss: list, nodes: dict[str, Node], graph_batch: int) -> list | None:
    """The batch axis of a tensor read from a TensorList whose constant element shape starts with the batch
    the graph was built at (a recurrent layer's time-major loop state, ``[batch, units]`` per step): the
    list itself is a variant without a shape, so no input carries the batch to it."""
    k, out_axis = _LIST_READS[n.type]
    node = _const_input_node(nodes, n, k)
    vals = const_ints(node) if node is not None and node.op == "Const" else None
    if not vals or vals[0] != graph_batch or not ss or ss[0] is None:
        return None
    if out_axis < len(ss[0]) and ss[0][out_axis] == graph_batch:
        return [out_axis] + [None] * (len(ss) - 1)
    return None


def _const_input_node(nodes: dict[str, Node], n: Node, k: int) -> Any:
    """The NodeDef feeding data input K of N (None past its inputs)."""
    return nodes[n.data_in[k][0]].nd if k < len(n.data_in) else None
