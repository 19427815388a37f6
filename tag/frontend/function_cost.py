"""FLOPs of functional ops (``If``/``Case``/``PartitionedCall``/``While``): the cost of their function bodies.

Why: TF2-style graphs hide whole layers inside FunctionDefs of the graph's library; the op that calls
one has no FLOP rule of its own. Each body is rebuilt with TensorFlow's function importer at the
caller's input shapes and its ops are costed with :func:`tag.frontend.op_rules.flops_of` (the dearer
branch of a conditional, one trip of a loop; :func:`trip_count` says how many trips a loop makes).
Structurally identical bodies share one cache entry.

Example::

    import tag
    from tag.frontend.function_cost import FunctionCoster
    gd = tag.zoo.training_graph("mlp", batch_size=8)
    coster = FunctionCoster({f.signature.name: f for f in gd.library.function})
    flops, unknown_types = coster.cost("no_such_function", [(8, 784)])   # not in the library: 0.0, Counter()
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tag.frontend.graph_import import Node, first_line
from tag.frontend.op_rules import flops_of, grad_arg_index, is_apply_op
from tag.frontend.shapes import to_shape
from tag.ir.op_types import CALL_TYPES, CASE_TYPES, FUNCTION_CALL_TYPES, IF_TYPES, WHILE_TYPES

__all__ = ["FunctionCoster", "HandleSpec", "handle_specs", "trip_count"]


class HandleSpec(NamedTuple):
    """What a resource (variable) or variant (TensorList) input holds: dtype enum and shape (element
    shape for a list); None where unknown."""

    dtype: int
    shape: tuple | None


def handle_specs(op: "tf.Operation") -> list:
    """Per input of OP: a HandleSpec for resource/variant inputs with known handle data, else None."""
    from tensorflow.python.ops import handle_data_util

    specs = []
    for t in op.inputs:
        spec = None
        if t.dtype in (tf.resource, tf.variant):
            try:
                data = handle_data_util.get_resource_handle_data(t)
            except Exception:  # noqa: BLE001 - no handle data recorded
                data = None
            if data is not None and data.is_set and data.shape_and_type:
                st = data.shape_and_type[0]
                shape = None if st.shape.unknown_rank else tuple(d.size if d.size >= 0 else None for d in st.shape.dim)
                spec = HandleSpec(int(st.dtype), shape)
        specs.append(spec)
    return specs


def _const_node(name: str, value: np.ndarray) -> Any:
    nd = tf.compat.v1.NodeDef(name=name, op="Const")
    nd.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    nd.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return nd


def _library_of(functions: Any) -> Any:
    lib = tf.compat.v1.GraphDef().library
    lib.function.extend(functions)
    return lib

log = logging.getLogger("tag")


class FunctionCoster:
    """Costs function bodies with TensorFlow's shape inference; caches structurally identical bodies."""

    def __init__(self, library: dict[str, Any]):
        self.library = library          # function name -> FunctionDef
        # (structural key of the body, input shapes) -> (FLOPs, unknown op type -> count)
        self.cache: dict[tuple, tuple[float, Counter]] = {}
        self._keys: dict[str, tuple] = {}  # function name -> structural key: (op type, attrs) per node

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
        """(FLOPs, unknown op types) of one call of function FNAME with inputs of IN_SHAPES (a shape per
        input; a :class:`HandleSpec` for a resource or TensorList input whose contents are known)."""
        if fname not in self.library or depth > 6:
            return 0.0, Counter()
        key = (self._struct_key(fname), tuple(in_shapes))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        result: tuple[float, Counter] = (0.0, Counter())
        try:
            fg = self._body_graph(fname, in_shapes)
        except Exception as err:  # noqa: BLE001 - a body TF cannot rebuild costs nothing, never crashes
            log.debug("cannot rebuild function %s for costing: %s", fname, first_line(err))
            self.cache[key] = result
            return result
        total, unknown = 0.0, Counter()
        for op in fg.get_operations():
            if op.type in ("Placeholder", "NoOp", "Identity"):
                continue
            nd = op.node_def
            ins = [to_shape(t.shape) for t in op.inputs]
            outs = [to_shape(t.shape) for t in op.outputs]
            if op.type in FUNCTION_CALL_TYPES:
                f, unk = self.cost_functional(op.type, nd.attr, ins, depth + 1)
                total += f
                unknown.update(unk)
                continue
            extra = {}
            if is_apply_op(op.type):
                extra["grad_index"] = grad_arg_index(op.op_def)
            f, known = flops_of(op.type, nd.attr, ins, outs, [t.dtype.name for t in op.outputs], extra)
            total += f
            if not known:
                unknown[op.type] += 1
        result = (total, unknown)
        self.cache[key] = result
        return result

    def _body_graph(self, fname: str, in_shapes: list) -> tf.Graph:
        """Function FNAME imported at IN_SHAPES. A resource argument becomes a ``VarHandleOp`` of the
        caller's variable and a TensorList argument an ``EmptyTensorList`` of its element shape, so that
        shape inference sees the variables' and list elements' shapes inside the body."""
        from tensorflow.python.framework import function_def_to_graph as f2g  # TF's own function importer

        fdef = self.library[fname]
        shapes = [tf.TensorShape([]) if isinstance(s, HandleSpec) else tf.TensorShape(None if s is None else list(s))
                  for s in in_shapes]
        body, _ = f2g.function_def_to_graph_def(fdef, input_shapes=shapes)
        args = {a.name: (a, s) for a, s in zip(fdef.signature.input_arg, in_shapes, strict=True)}
        extra = []
        for nd in body.node:
            arg, spec = args.get(nd.name, (None, None))
            if not isinstance(spec, HandleSpec) or spec.shape is None:
                continue
            element = tf.TensorShape(list(spec.shape)).as_proto()
            if arg.type == tf.resource.as_datatype_enum:
                nd.op = "VarHandleOp"
                nd.ClearField("attr")
                nd.attr["dtype"].type = spec.dtype
                nd.attr["shape"].shape.CopyFrom(element)
                nd.attr["shared_name"].s = nd.name.encode()
            elif arg.type == tf.variant.as_datatype_enum:
                nd.op = "EmptyTensorList"
                nd.ClearField("attr")
                nd.attr["element_dtype"].type = spec.dtype
                nd.attr["shape_type"].type = tf.int32.as_datatype_enum
                dims = [-1 if d is None else int(d) for d in spec.shape]
                extra.append(_const_node(nd.name + "/tag_element_shape", np.array(dims, np.int32)))
                extra.append(_const_node(nd.name + "/tag_max_elements", np.array(-1, np.int32)))
                nd.input.extend([extra[-2].name, extra[-1].name])
        body.node.extend(extra)
        if any(nd.op in FUNCTION_CALL_TYPES or nd.op in self.library for nd in body.node):
            body.library.CopyFrom(_library_of(self.library.values()))
        g = tf.Graph()
        with g.as_default():
            tf.compat.v1.import_graph_def(body, name="")
        return g

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


def trip_count(nodes: dict[str, Node], name: str, shapes: dict[str, list], tf_ops: dict[str, Any] | None = None,
               library: dict[str, Any] | None = None, depth: int = 0) -> int | None:
    """Iterations of While op NAME, when they can be told statically (None otherwise).

    ``while_v2`` passes ``maximum_iterations`` as the loop's second input; a gradient loop takes the
    forward loop's counter (its output 0) and runs as often; a loop whose condition compares a loop
    variable with a loop-invariant bound (Keras RNNs: ``time < timesteps``) runs bound - start times when
    both are constants (folded by TensorFlow from the shapes that drive them); failing those, the length
    of a TensorList the loop is given (``TensorListFromTensor`` of a tensor, ``TensorListReserve`` of a
    constant size).
    """
    from tag.frontend.batch_axes import const_ints

    n = nodes[name]
    ins = n.data_in
    if len(ins) >= 2:
        c = const_ints(nodes[ins[1][0]].nd)
        if c and c[0] >= 0:
            return int(c[0])
    for s, i in ins:
        if nodes[s].type in WHILE_TYPES and i == 0 and depth < 4:
            return trip_count(nodes, s, shapes, tf_ops, library, depth + 1)
    if tf_ops is not None and library is not None and name in tf_ops:
        trips = _trips_from_condition(tf_ops[name], library.get(n.nd.attr["cond"].func.name))
        if trips is not None:
            return trips
    for s, _ in ins:
        src = nodes[s]
        if src.type == "TensorListFromTensor" and src.data_in:
            t, k = src.data_in[0]
            shape = shapes.get(t, [None] * (k + 1))[k]
            if shape and shape[0] is not None:
                return int(shape[0])
        if src.type == "TensorListReserve" and len(src.data_in) >= 2:
            c = const_ints(nodes[src.data_in[1][0]].nd)
            if c and c[0] >= 0:
                return int(c[0])
    return None


def _trips_from_condition(op: Any, cond: Any) -> int | None:
    """bound - start for a condition ``Less(arg_i, arg_j)`` whose While inputs i and j are constants."""
    if cond is None:
        return None
    arg_index = {a.name: k for k, a in enumerate(cond.signature.input_arg)}
    best = None
    for nd in cond.node_def:
        if nd.op not in ("Less", "LessEqual") or len(nd.input) < 2:
            continue
        i, j = (arg_index.get(x.split(":")[0]) for x in nd.input[:2])
        if i is None or j is None:
            continue
        start, bound = _static_value(op.inputs[i]), _static_value(op.inputs[j])
        if start is not None and bound is not None:
            trips = max(0, bound - start + (1 if nd.op == "LessEqual" else 0))
            best = trips if best is None else min(best, trips)
    return best


def _static_dim(x: Any, k: int, depth: int = 0) -> int | None:
    """Dimension K of tensor X when it is static or follows statically from what X is made of: a transpose
    with constant permutation, a TensorList stacked from a list of known length (a loop's output list has
    the length of the list it was given)."""
    from tensorflow.python.framework import tensor_util

    if x.shape.rank is not None and x.shape[k] is not None:
        return int(x.shape[k])
    if depth > 12:
        return None
    op = x.op
    if op.type in ("Identity", "StopGradient") and op.inputs:
        return _static_dim(op.inputs[0], k, depth + 1)
    if op.type in ("Transpose", "ConjugateTranspose"):
        perm = tensor_util.constant_value(op.inputs[1])
        return None if perm is None else _static_dim(op.inputs[0], int(np.reshape(perm, -1)[k]), depth + 1)
    if op.type == "TensorListStack" and k == 0:
        return _list_length(op.inputs[0], depth + 1)
    return None


def _list_length(lst: Any, depth: int) -> int | None:
    """Number of elements of TensorList LST, when static."""
    op = lst.op
    if depth > 12:
        return None
    if op.type == "Identity":
        return _list_length(op.inputs[0], depth + 1)
    if op.type in WHILE_TYPES:                      # a loop hands back the lists it was given, same length
        return _list_length(op.inputs[lst.value_index], depth + 1)
    if op.type == "TensorListReserve":
        return _static_value(op.inputs[1], depth + 1)
    if op.type == "TensorListFromTensor":
        return _static_dim(op.inputs[0], 0, depth + 1)
    return None


def _static_value(t: Any, depth: int = 0) -> int | None:
    """The value of scalar int tensor T when it is computed from constants only (else None)."""
    from tensorflow.python.framework import tensor_util

    v = tensor_util.constant_value(t)
    if v is None and t.op.type == "StridedSlice" and t.op.inputs[0].op.type == "Shape":
        # shape(x)[k] of an x whose dimension k is static (its batch dimension may not be)
        begin = tensor_util.constant_value(t.op.inputs[1])
        x = t.op.inputs[0].op.inputs[0]
        if begin is not None and np.size(begin) == 1 and x.shape.rank is not None and t.shape.rank == 0:
            k = int(np.reshape(begin, -1)[0]) % x.shape.rank
            return _static_dim(x, k, depth)
    if v is None:
        stack, seen = [t.op], set()
        while stack:
            o = stack.pop()
            if o.name in seen:
                continue
            seen.add(o.name)
            if o.type in ("Placeholder", "PlaceholderWithDefault", "VarHandleOp", "VariableV2") or o.type in \
                    FUNCTION_CALL_TYPES or o.op_def.is_stateful or len(seen) > 50:
                return None
            stack.extend(x.op for x in o.inputs)
        from tag.cuda_noise import init_devices
        init_devices()      # no cuInit error line on a machine without a GPU driver
        try:
            with tf.compat.v1.Session(graph=t.graph) as sess:
                v = sess.run(t)
        except Exception:  # noqa: BLE001
            return None
    v = np.asarray(v)
    return int(v) if v.size == 1 and np.issubdtype(v.dtype, np.integer) else None
