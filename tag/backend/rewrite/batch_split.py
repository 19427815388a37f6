"""Batch split: tensors with a batch axis move between instances as slices and concatenations, and
constants that hold the batch size follow each instance's share.

A tensor with a batch axis (IR ``TensorInfo.batch_axis``) crossing between instances whose ranges
differ is sliced where it is produced and concatenated where it is consumed -- only the examples that
change device move. Graphs built with a concrete batch dimension (``Placeholder [32, 784]``) carry
that number in constants (``Reshape`` shapes, ``Tile`` multiples, a mean gradient's divisor, ...);
those constants are found from the IR's batch axes and rescaled for each instance's share (and for
``batch_size=``).

Example::

    import tag
    from tag.strategy.types import Action, Grouping, Strategy
    from tag.backend.rewrite import rewrite
    import numpy as np

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    one = Strategy(Grouping(np.zeros(len(tg.ops), np.int64), ["all"]), [Action((0,), "partition")],
                   partition={i: 0 for i in range(len(tg.ops))})
    res = rewrite(gd, tg, one, topo, batch_size=64)   # constants rescaled as if built at 64
"""
from __future__ import annotations

import functools
import re

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tag.errors import RewriteError
from tag.frontend.batch_axes import rule_axes
from tag.ir.types import Linear, TensorInfo

from .context import RewriteState
from .graph_edit import (
    FLOAT_TYPES,
    Instance,
    Range,
    attr_type,
    canonical,
    fill_defaults,
    pick_instance,
    split_tensor,
    tensor_name,
)

# op type -> input index that is a shape whose entries follow the op's output shape
_SHAPE_OPERAND = {
    "Reshape": 1, "Fill": 0, "BroadcastTo": 1, "StridedSliceGrad": 0, "Slice": 2, "RandomUniform": 0,
    "RandomStandardNormal": 0, "TruncatedNormal": 0, "StatelessRandomUniformV2": 0,
    "StatelessRandomNormalV2": 0, "Conv2DBackpropInput": 0, "Conv3DBackpropInputV2": 0,
    "DepthwiseConv2dNativeBackpropInput": 0, "AvgPoolGrad": 0, "AvgPool3DGrad": 0, "Empty": 0,
    "ScatterNd": 2,
}
# TensorList op type -> input index of its element_shape. Loops built with a static batch (a tf_keras LSTM on
# placeholders of fixed shape) keep that batch in the element shapes of their loop state: the time-major
# lists of a recurrent layer hold [batch, units] elements.
ELEMENT_SHAPE_OPERAND = {
    "TensorListFromTensor": 1, "TensorListReserve": 0, "EmptyTensorList": 0, "TensorListStack": 1,
    "TensorListGather": 2, "TensorListGetItem": 2, "TensorListPopBack": 1, "TensorListConcatV2": 1,
    "TensorListSplit": 1, "TensorListScatter": 2, "TensorListScatterV2": 2,
}
# TensorList / TensorArray op type -> its attr holding an element shape (TF's op registry: every op whose
# element shape is an attr of type shape rather than an input)
ELEMENT_SHAPE_ATTR = {
    "TensorListConcat": "element_shape", "TensorArrayV3": "element_shape", "TensorArrayV2": "element_shape",
    "TensorArray": "element_shape", "TensorArrayGatherV3": "element_shape", "TensorArrayGatherV2": "element_shape",
    "TensorArrayGather": "element_shape", "TensorArrayPack": "element_shape",
    "TensorArrayConcatV3": "element_shape_except0", "TensorArrayConcatV2": "element_shape_except0",
    "TensorArrayConcat": "element_shape_except0",
}
# list ops made from a tensor (its input 0, listed along axis 0): the element's batch axis is the tensor's minus one
_LISTED_TENSOR_OPS = ("TensorListFromTensor", "TensorListScatter", "TensorListScatterV2")
_GRAD_SCOPE_RE = re.compile(r"(?:^|/)gradients(?:_\d+)?/(.+?)_grad/")
_FOLDED_SHAPE_RE = re.compile(r"^Shape(_\d+)?$")   # tf.shape of a static shape, folded into a Const


def _is_scalar(node: node_def_pb2.NodeDef) -> bool:
    return len(node.attr["value"].tensor.tensor_shape.dim) == 0


# -------------------------------------------------------------------------------- constants
def _outside_axes(st: RewriteState) -> None:
    """Batch axes of the kept ops outside the analysed step (the loss's tail, metrics): the frontend's
    per-op rules applied to TensorFlow's static shapes, in topological order; recorded in
    ``tensor_info`` so their batch-sized constants are rescaled like the step's."""
    outside = [n for n in st.order if n not in st.ir_index and st.nodes[n].op != "Const"]
    if not any(st.nodes[split_tensor(i)[0]].op != "Const" for n in outside for i in st.nodes[n].input
               if not i.startswith("^") and split_tensor(i)[0] in st.ir_index):
        return
    for n in outside:
        node = st.nodes[n]
        data_inputs = [i for i in node.input if not i.startswith("^")]
        ins = []
        for i in data_inputs:
            info = st.tensor_info.get(canonical(i))
            ins.append((None if info is None or info.shape is None else tuple(info.shape),
                        None if info is None else info.batch_axis))
        op = st.tfg.get_operation_by_name(n)
        outs = [None if t.shape.rank is None else tuple(t.shape.as_list()) for t in op.outputs]
        axes = rule_axes(node.op, node.attr, ins, outs, functools.partial(_input_node, st, data_inputs))
        for k, (t, ax) in enumerate(zip(op.outputs, axes, strict=True)):
            st.tensor_info[tensor_name(n, k)] = TensorInfo(tensor_name(n, k), t.dtype.base_dtype.name,
                                                             outs[k], ax, Linear())


def _input_node(st: RewriteState, data_inputs: list[str], k: int) -> node_def_pb2.NodeDef | None:
    """The NodeDef feeding data input K of DATA_INPUTS (None past the last): ``rule_axes``'s const_input."""
    return st.nodes[split_tensor(data_inputs[k])[0]] if k < len(data_inputs) else None


def const_rules(st: RewriteState) -> None:
    """For each batch-dependent constant: the flat positions that scale with the batch."""
    _outside_axes(st)
    st.const_scale = {}
    for n in st.order:
        node = st.nodes[n]
        if node.op != "Const":
            continue
        dtype = tf.as_dtype(node.attr["dtype"].type)
        if dtype not in (tf.int32, tf.int64) and not (dtype in FLOAT_TYPES and _is_scalar(node)):
            continue
        value = tf.make_ndarray(node.attr["value"].tensor)
        if value.ndim > 1 or value.size > 16:
            continue
        pos = _scaled_positions(st, n, value.reshape(-1), dtype)
        if pos:
            st.const_scale[n] = sorted(pos)


def _scaled_positions(st: RewriteState, n: str, v: np.ndarray, dtype: "tf.DType") -> set[int]:
    """Positions of the flat value V of Const N that hold (a multiple of) the reference batch."""
    is_int = dtype in (tf.int32, tf.int64)
    pos = _shape_operand_positions(st, n, v, is_int)
    if is_int:
        pos |= _element_shape_positions(st, n, v)
    if is_int and "/" in n and _FOLDED_SHAPE_RE.match(n.rsplit("/", 1)[1]):
        pos |= _folded_shape_positions(st, n, v)
    m = _GRAD_SCOPE_RE.search(n)
    if m:
        fwd = _forward_op(st, m.group(1))
        if fwd is not None:
            pos |= _gradient_constant_positions(st, n, v, is_int, fwd)
    return pos


def _shape_operand_positions(st: RewriteState, n: str, v: np.ndarray, is_int: bool) -> set[int]:
    """R1: the batch entry of a shape operand of an op whose output has a batch axis, and the batch
    entry of the multiples of a Tile that broadcasts a batch-free tensor over the batch."""
    pos: set[int] = set()
    ref_batch = st.ref_batch
    for c, _, slot in st.consumers[n]:
        cop = st.nodes[c].op
        if _SHAPE_OPERAND.get(cop) != slot or not is_int or v.size == 0:
            continue
        if cop == "Tile":
            continue
        ax = st.batch_axis(c)
        shape = st.ref_shape(c) if ax is not None else None
        if ax is not None and shape is not None and ax < v.size and shape[ax] is not None \
                and v[ax] == shape[ax] and v[ax] % ref_batch == 0:
            pos.add(ax)
    for c, _, slot in st.consumers[n]:
        if st.nodes[c].op == "Tile" and slot == 1 and is_int:
            ax = st.batch_axis(c)
            src = st.nodes[c].input[0]
            if ax is not None and ax < v.size and st.batch_axis(src) is None and v[ax] % ref_batch == 0 \
                    and v[ax] > 0:
                pos.add(ax)
    return pos


def _element_shape_positions(st: RewriteState, n: str, v: np.ndarray) -> set[int]:
    """R5: the batch entry of the element shape of a TensorList (the loop state of a recurrent layer
    built at a static batch). The element's batch axis is the listed tensor's minus one (lists run over
    axis 0, time) where the IR knows that tensor (``TensorListFromTensor``'s input, ``TensorListStack``'s
    output); a list made empty or reserved (``EmptyTensorList``, ``TensorListReserve``: gradient
    accumulators and outputs of a loop) has no such tensor -- nor has a list whose tensor's batch axis
    the IR could not tell -- and then its element's first entry is the batch when it equals the batch
    the graph was built for (time-major elements ``[batch, units]``). A folded ``tf.shape`` whose constant
    slice is the element shape (a gradient's ``slice(shape(t), [1], [-1])``) has those positions, shifted."""
    pos: set[int] = set()
    ref_batch = st.ref_batch
    for c, _, slot in st.consumers[n]:
        cop = st.nodes[c].op
        if cop in ("Slice", "StridedSlice") and slot == 0 and v.ndim == 1:
            part = _constant_slice(st, c, v.size)      # a gradient's slice(shape(t), [1], [-1]), shape folded
            if part is not None:
                pos |= {p + part[0] for p in _element_shape_positions(st, c, v[part[0]:part[1]])}
            continue
        if ELEMENT_SHAPE_OPERAND.get(cop) != slot or v.ndim != 1 or v.size == 0:
            continue
        if cop in _LISTED_TENSOR_OPS:
            ax = st.batch_axis(st.nodes[c].input[0])
            p = ax - 1 if ax is not None and ax >= 1 else None
        elif cop in ("TensorListStack", "TensorListGather", "TensorListConcatV2"):
            ax = st.batch_axis(tensor_name(c, 0))
            p = (ax - 1 if cop != "TensorListConcatV2" else ax) if ax is not None and ax >= 1 else None
        elif cop == "TensorListGetItem":
            p = st.batch_axis(tensor_name(c, 0))
        else:
            p = None
        if p is None and v[0] == ref_batch and not _list_holds_weights(st, c):
            p = 0                               # no tensor tells: time-major elements [batch, ...]
        if p is not None and p < v.size and v[p] > 0 and v[p] % ref_batch == 0:
            pos.add(p)
    return pos


def _constant_slice(st: RewriteState, op: str, size: int) -> tuple[int, int] | None:
    """(begin, end) of the 1-D ``Slice`` or ``StridedSlice`` OP of a vector of SIZE entries when its bounds are
    constants (stride 1, no masks but begin/end); None otherwise."""
    node = st.nodes[op]
    bounds = []
    for i in node.input[1:]:
        src = st.nodes.get(split_tensor(i)[0]) if not i.startswith("^") else None
        if src is None or src.op != "Const":
            return None
        value = tf.make_ndarray(src.attr["value"].tensor).reshape(-1)
        if value.size != 1:
            return None
        bounds.append(int(value[0]))
    if node.op == "Slice" and len(bounds) == 2:
        begin, length = bounds
        end = size if length == -1 else begin + length
    elif node.op == "StridedSlice" and len(bounds) == 3 and bounds[2] == 1 and not any(
            node.attr[m].i for m in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")):
        begin = 0 if node.attr["begin_mask"].i & 1 else bounds[0]
        end = size if node.attr["end_mask"].i & 1 else bounds[1]
        begin, end = (b + size if b < 0 else b for b in (begin, end))
    else:
        return None
    return (begin, end) if 0 <= begin <= end <= size else None


def _list_holds_weights(st: RewriteState, list_op: str) -> bool:
    """Does the TensorList LIST_OP makes hold a weight in each element? (a loop's gradient accumulator of
    a kernel it reads: ``[input_dim, 4 * units]`` elements whose first entry may equal the batch). Found
    in the body of the loop the list enters: what is pushed into it is a ``ReadVariableOp``."""
    fdefs = {f.signature.name: f for f in st.graph_def.library.function}
    for c, _k, slot in st.consumers.get(list_op, []):
        node = st.nodes[c]
        body = fdefs.get(node.attr["body"].func.name) if "body" in node.attr else None
        if body is None or slot >= len(body.signature.input_arg):
            continue
        arg = body.signature.input_arg[slot].name
        made = {n.name: n for n in body.node_def}
        for n in body.node_def:
            item = {"TensorListPushBack": 1, "TensorListSetItem": 2}.get(n.op)
            if item is None or n.input[0].split(":")[0] != arg or item >= len(n.input):
                continue
            src = made.get(n.input[item].split(":")[0])
            while src is not None and src.op == "Identity":
                src = made.get(src.input[0].split(":")[0])
            if src is not None and src.op == "ReadVariableOp":
                return True
    return False


def _folded_shape_positions(st: RewriteState, n: str, v: np.ndarray) -> set[int]:
    """R4: ``tf.shape(x)`` of a static x folded into Const N (``<scope>/Shape_k``): the batch entry, when
    V is the shape of a batch-axis tensor that an op of the same name scope takes."""
    scope = n.rsplit("/", 1)[0] + "/"
    pos: set[int] = set()
    for op in st.order:
        if not op.startswith(scope) or "/" in op[len(scope):]:
            continue
        for t in st.nodes[op].input:
            if t.startswith("^"):
                continue
            ax, shape = st.batch_axis(t), st.ref_shape(t)
            if ax is not None and shape is not None and _shape_matches(shape, v, ax) and v[ax] % st.ref_batch == 0:
                pos.add(ax)
    return pos


def _shape_matches(shape: tuple, v: np.ndarray, ax: int) -> bool:
    """Is V the value of static SHAPE, whose batch entry (AX) is known? Entries TensorFlow's Python shapes
    leave unknown (a loop's time steps, after a TensorList is stacked) match any value: the C++ importer
    infers them and folds ``tf.shape`` of the tensor into a constant all the same."""
    return len(shape) == v.size and ax < len(shape) and shape[ax] is not None and all(
        s is None or s == x for s, x in zip(shape, v, strict=True))


def _gradient_constant_positions(st: RewriteState, n: str, v: np.ndarray, is_int: bool, fwd: str) -> set[int]:
    """R2/R3: a constant made by the gradient function of forward op FWD from FWD's static shapes
    (a shape, an element count, a mean's divisor)."""
    pos: set[int] = set()
    ref_batch = st.ref_batch
    scalar = _is_scalar(st.nodes[n])
    tensors = [i for i in st.nodes[fwd].input if not i.startswith("^")]
    if fwd in st.ir_index:
        tensors += [t.name for t in st.ir.ops[st.ir_index[fwd]].outputs]
    for t in tensors:
        ax = st.batch_axis(t)
        shape = st.ref_shape(t) if ax is not None else None
        if shape is None:
            continue
        if is_int and v.size > 0 and _shape_matches(shape, v, ax):
            pos.add(ax)
            continue
        if any(s is None for s in shape):
            continue
        numel = int(np.prod(shape)) if shape else 1
        if v.size == 1 and scalar and numel % ref_batch == 0 and v[0] == numel and (
                # the element count of a batch tensor (tf.size folded)
                is_int and n.rsplit("/", 1)[-1].startswith("Size")):
            pos.add(0)
    # a mean's divisor: the count of the reduced elements, batch-proportional only where the mean reduces
    # the batch axis (a mean over the features, such as LayerNorm's moments, keeps its divisor even when
    # that count happens to equal the element count of a batch tensor)
    if st.nodes[fwd].op == "Mean" and v.size == 1 and scalar:
        tin, tout = st.nodes[fwd].input[0], tensor_name(fwd, 0)
        ok = st.batch_axis(tin) is not None and tout in st.tensor_info and st.batch_axis(tout) is None
        sin, sout = (st.ref_shape(tin), st.ref_shape(tout)) if ok else (None, None)
        if ok and sin and sout is not None and None not in sin and None not in sout:
            factor = int(np.prod(sin)) // max(int(np.prod(sout)) if sout else 1, 1)
            if v[0] == factor and factor % ref_batch == 0:
                pos.add(0)
    return pos


def _forward_op(st: RewriteState, scoped: str) -> str | None:
    """The forward op whose gradient scope is SCOPED ('a/b' for 'gradients/a/b_grad/...')."""
    cand = scoped
    while True:
        if cand in st.nodes:
            return cand
        m = _GRAD_SCOPE_RE.search(cand + "/")
        if not m:
            return None
        cand = m.group(1)


def const_value(st: RewriteState, n: str, size: int) -> node_def_pb2.NodeDef | None:
    """A copy of Const N rescaled for an instance on SIZE examples (None: unchanged)."""
    pos = st.const_scale.get(n)
    if not pos or size == st.ref_batch:
        return None
    node = st.nodes[n]
    value = tf.make_ndarray(node.attr["value"].tensor)
    flat = value.reshape(-1).copy()
    for p in pos:
        if np.issubdtype(flat.dtype, np.integer):
            if (int(flat[p]) * size) % st.ref_batch:
                raise RewriteError(f"constant {n!r} ({flat[p]}) cannot be split to {size} of "
                                   f"{st.ref_batch} examples")
            flat[p] = int(flat[p]) * size // st.ref_batch
        else:
            flat[p] = flat[p] * size / st.ref_batch
    new = node_def_pb2.NodeDef()
    new.CopyFrom(node)
    new.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(flat.reshape(value.shape)))
    return new


def batch_const_value(st: RewriteState, n: str, rng: Range) -> node_def_pb2.NodeDef | None:
    """A copy of Const N (a tensor with a batch axis that TensorFlow folded into a constant, such as
    ``zeros_like`` of a static batch) holding examples RNG: its rows of the batch axis, or, for a
    value that is the same along that axis, that value repeated for any batch."""
    if rng == (0, st.ref_batch) and st.batch == st.ref_batch:
        return None
    node = st.nodes[n]
    value = tf.make_ndarray(node.attr["value"].tensor)
    ax = st.batch_axis(n)
    rows = value.shape[ax] // st.ref_batch if ax < value.ndim else 0
    if not rows or value.shape[ax] % st.ref_batch:
        raise RewriteError(f"constant {n!r}: its batch axis {ax} ({value.shape}) is not a multiple of the "
                           f"batch {st.ref_batch}, so it cannot be split between devices")
    first = np.take(value, [0], axis=ax)
    if np.all(value == first):
        new_value = np.repeat(first, (rng[1] - rng[0]) * rows, axis=ax)
    elif rng[1] <= st.ref_batch:
        new_value = np.take(value, np.arange(rng[0] * rows, rng[1] * rows), axis=ax)
    else:
        raise RewriteError(f"constant {n!r} holds per-example values for {st.ref_batch} examples; it cannot "
                           f"serve examples {rng[0]}..{rng[1] - 1} (build the graph at the batch to run)")
    new = node_def_pb2.NodeDef()
    new.CopyFrom(node)
    new.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(new_value))
    return new


def rescale_placeholder(st: RewriteState, n: str, node: node_def_pb2.NodeDef) -> None:
    """Set the batch dimension of placeholder NODE (a copy of N) to the batch to run."""
    if st.batch != st.ref_batch and "shape" in node.attr:
        ax = st.batch_axis(n)
        dims = node.attr["shape"].shape.dim
        if ax is not None and ax < len(dims) and dims[ax].size > 0:
            dims[ax].size = dims[ax].size // st.ref_batch * st.batch


# -------------------------------------------------------------------------------- re-splitting
def _rows_per_example(st: RewriteState, t: str) -> int:
    ax = st.batch_axis(t)
    shape = st.ref_shape(t)
    if shape is None or ax is None or ax >= len(shape) or shape[ax] is None or shape[ax] % st.ref_batch:
        raise RewriteError(f"tensor {t!r}: its batch axis {ax} has no static size that is a multiple of "
                           f"the batch {st.ref_batch}, so it cannot be split between devices; give its "
                           f"op static shapes (or keep it in one op group run on the whole batch)")
    return shape[ax] // st.ref_batch


def _cover(st: RewriteState, p: str, rng: Range, dev: int) -> list[Instance]:
    """Instances of P covering RNG: one that contains it (prefer DEV) or the primary tiling."""
    containing = [i for i in st.instances[p] if i.rng[0] <= rng[0] and rng[1] <= i.rng[1]]
    if containing:
        return [pick_instance(containing, dev)]
    prim = sorted((i for i in st.instances[p] if i.primary), key=lambda i: i.rng)
    chosen: dict[Range, Instance] = {}
    for i in prim:
        if i.rng not in chosen or i.dev == dev:
            chosen[i.rng] = i
    out = [chosen[r] for r in sorted(chosen) if r[0] < rng[1] and rng[0] < r[1]]
    at = rng[0]
    for i in out:
        if i.rng[0] > at:
            break
        at = max(at, i.rng[1])
    if at < rng[1]:
        raise RewriteError(f"op {p!r}: its instances do not cover examples {rng[0]}..{rng[1] - 1}")
    return out


def resplit(st: RewriteState, t: str, rng: Range, dev: int) -> str:
    """Batch-axis tensor T for examples RNG on DEV, sliced from and concatenated over its instances."""
    memo_key = ("resplit", t, rng, dev)
    if memo_key in st.memo:
        return st.memo[memo_key]
    p, k = split_tensor(t)
    ax = st.batch_axis(t)
    rows = _rows_per_example(st, t)
    parts = []
    for inst in _cover(st, p, rng, dev):
        lo, hi = max(rng[0], inst.rng[0]), min(rng[1], inst.rng[1])
        if (lo, hi) == inst.rng:
            parts.append(tensor_name(inst.name, k))
        else:
            parts.append(slice_rows(st, t, inst, (lo - inst.rng[0]) * rows, (hi - inst.rng[0]) * rows, ax))
    if len(parts) == 1:
        out = parts[0]
    else:
        out = _concat(st, t, parts, ax, dev, rng)
    st.memo[memo_key] = out
    return out


def send_remote_slices_first(st: RewriteState) -> None:
    """The batch inputs' slices for other devices run before the local replica starts computing.

    TF's executor runs a ready op's cheap successors inline, depth first: on a worker with one
    inter-op thread, the slices of the input batch cut for remote replicas wait until the local
    replica's chain yields, and the remote replicas idle meanwhile (measured on a 3-host CPU testbed:
    the other replicas of a small CNN started 145 ms into a 330 ms step). A control edge from each
    such slice to every local op that reads an input (or a local slice of one) sends them first."""
    inputs = set(st.inputs)
    readers: dict[str, list] = {}
    for n in st.out_nodes:
        for i in n.input:
            if not i.startswith("^"):
                readers.setdefault(i.split(":")[0], []).append(n)
    remote: dict[str, list] = {}      # device -> input slices on it read elsewhere
    local_sources: dict[str, set] = {}   # device -> inputs and input slices read only there
    for n in st.out_nodes:
        if n.op == "StridedSlice" and n.name.startswith("tag/slice/") and n.input[0].split(":")[0] in inputs:
            local_sources.setdefault(n.device, set()).add(n.input[0].split(":")[0])
            if any(r.device != n.device for r in readers.get(n.name, ())):
                remote.setdefault(n.device, []).append(n)
            else:
                local_sources[n.device].add(n.name)
    for dev, slices in remote.items():
        edges = [f"^{sl.name}" for sl in slices]
        for src in local_sources[dev]:
            for r in readers.get(src, ()):
                if r.device == dev and not r.name.startswith("tag/slice/"):
                    r.input.extend(e for e in edges if e not in r.input)


def slice_rows(st: RewriteState, t: str, inst: Instance, begin: int, end: int, ax: int) -> str:
    """Rows BEGIN..END (axis AX) of INST's T, sliced on INST's device."""
    memo_key = ("slice", t, inst.name, begin, end)
    if memo_key in st.memo:
        return st.memo[memo_key]
    p, k = split_tensor(t)
    base = f"tag/slice/{p}_{k}/{inst.dev}_{begin}_{end}"
    name = st.fresh(base)
    dev = inst.dev
    b = st.const(name + "/begin", np.array([0] * ax + [begin], np.int32), dev)
    e = st.const(name + "/end", np.array([0] * ax + [end], np.int32), dev)
    s = st.const(name + "/strides", np.ones(ax + 1, np.int32), dev)
    node = node_def_pb2.NodeDef(name=name, op="StridedSlice", device=st.topo.tf_device(dev))
    node.input.extend([tensor_name(inst.name, k), b, e, s])
    node.attr["T"].CopyFrom(attr_type(st.dtype(t)))
    node.attr["Index"].CopyFrom(attr_type(tf.int32))
    mask = (1 << ax) - 1
    node.attr["begin_mask"].i = mask
    node.attr["end_mask"].i = mask
    st.out_nodes.append(fill_defaults(node))
    st.counts["slices"] += 1
    st.memo[memo_key] = name
    return name


def _concat(st: RewriteState, t: str, parts: list[str], ax: int, dev: int, rng: Range) -> str:
    """PARTS of T (examples RNG, in order) concatenated along AX on DEV."""
    p, k = split_tensor(t)
    name = st.fresh(f"tag/concat/{p}_{k}/{dev}_{rng[0]}_{rng[1]}")
    axis = st.const(name + "/axis", np.array(ax, np.int32), dev)
    st.concat_node(name, parts, axis, st.dtype(t), dev)
    st.counts["concats"] += 1
    return name
