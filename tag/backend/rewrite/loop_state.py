"""Loop state built at a static batch: copies of loop bodies whose TensorList element shapes follow a
replica's share.

A recurrent layer built on placeholders of fixed shape (a tf_keras LSTM language model with a fixed
batch) runs a ``While`` loop whose state holds TensorLists of ``[batch, units]`` elements, and the loop's
body functions (and their gradients) carry that batch in the element shapes they pass to
``TensorListGetItem`` and its kin. The function library is shared by every instance, so a replica on
fewer examples gets its own copy of each such function (``<name>_tag_b<size>``, nested calls followed),
with the first entry of those element shapes (and the rows of constant items set into the lists, a
gradient's folded ``zeros_like``) rescaled, and its loop op calls the copy. The main graph's
element-shape constants are rescaled with the other batch constants (``batch_split``).

Example::

    import tag
    topo = tag.load_topology("topologies/localhost.pbtxt")
    res = tag.rewrite(lstm_graph_def, topo, "dp_allreduce")    # static-batch tf_keras LSTM
    [f.signature.name for f in res.graph_def.library.function if "_tag_b" in f.signature.name]
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import function_pb2, node_def_pb2

from . import batch_split
from .context import RewriteState

# TensorList op type -> input index of the item it stores
_LIST_ITEM_OPERAND = {"TensorListSetItem": 2, "TensorListPushBack": 1}


def begin_function_copies(st: RewriteState) -> None:
    """The function library by name (``function_table``), no copies yet (``function_copies``,
    ``added_functions``)."""
    st.function_table = {f.signature.name: f for f in st.graph_def.library.function}
    st.function_copies = {}
    st.added_functions = []


def rescale_function_attrs(st: RewriteState, node: node_def_pb2.NodeDef, size: int) -> None:
    """Point NODE's function attributes (loop bodies, conditions, calls) at copies for SIZE examples
    where the functions hold batch-sized element shapes."""
    if size == st.ref_batch or not st.graph_def.library.function:
        return
    for key in list(node.attr):
        value = node.attr[key]
        if value.HasField("func"):
            value.func.name = _function_for(st, value.func.name, size)
        elif value.HasField("list") and value.list.func:
            for f in value.list.func:
                f.name = _function_for(st, f.name, size)


def _function_for(st: RewriteState, name: str, size: int) -> str:
    """NAME, or the name of its copy for SIZE examples when it (or a function it calls) holds a
    TensorList element shape whose first entry is the graph's batch."""
    table = st.function_table
    if name not in table:
        return name
    key = (name, size)
    if key in st.function_copies:
        return st.function_copies[key]
    st.function_copies[key] = name          # recursion guard: a function calling itself stays as it is
    copy = function_pb2.FunctionDef()
    copy.CopyFrom(table[name])
    changed = False
    consumers: dict[str, list[tuple[str, int]]] = {}
    readers: dict[str, list[tuple[node_def_pb2.NodeDef, int]]] = {}
    for n in copy.node_def:
        data = [i for i in n.input if not i.startswith("^")]
        for slot, i in enumerate(data):
            consumers.setdefault(i.split(":")[0], []).append((n.op, slot))
            readers.setdefault(i.split(":")[0], []).append((n, slot))
    made = {n.name: n for n in copy.node_def}
    for n in copy.node_def:
        if n.op == "Const" and (_element_shape_const(st, n, consumers.get(n.name, []), size)
                                or _list_item_const(st, n, consumers.get(n.name, []), size)
                                or _sliced_element_shape_const(st, n, readers, made, size)):
            changed = True
        if rescale_element_shape_attr(st, n, size):
            changed = True
        for value in n.attr.values():
            funcs = ([value.func] if value.HasField("func")
                     else list(value.list.func) if value.HasField("list") else [])
            for f in funcs:
                new = _function_for(st, f.name, size)
                if new != f.name:
                    f.name = new
                    changed = True
    if not changed:
        return name
    new_name = f"{name}_tag_b{size}"
    copy.signature.name = new_name
    st.added_functions.append(copy)
    st.function_copies[key] = new_name
    return new_name


def rescale_element_shape_attr(st: RewriteState, node: node_def_pb2.NodeDef, size: int) -> bool:
    """Rescale in place the element shape that NODE (a TensorList or TensorArray op) holds in an attr
    (``batch_split.ELEMENT_SHAPE_ATTR``) when its first entry is the graph's batch: time-major elements
    ``[batch, ...]`` of a list built at a static batch, for an instance on SIZE examples."""
    key = batch_split.ELEMENT_SHAPE_ATTR.get(node.op)
    if key is None or key not in node.attr or size == st.ref_batch:
        return False
    dims = node.attr[key].shape.dim
    if node.attr[key].shape.unknown_rank or not dims or dims[0].size != st.ref_batch:
        return False
    dims[0].size = size
    return True


def _list_item_const(st: RewriteState, n: node_def_pb2.NodeDef, uses: list[tuple[str, int]], size: int) -> bool:
    """Rescale Const N in place when it is an item set into a TensorList (a gradient's folded
    ``zeros_like`` of a ``[batch, units]`` element) of the graph's batch, the same for every example."""
    if not uses or not all(op.startswith("TensorList") and slot == _LIST_ITEM_OPERAND.get(op) for op, slot in uses):
        return False
    value = tf.make_ndarray(n.attr["value"].tensor)
    if value.ndim == 0 or value.shape[0] != st.ref_batch or not np.all(value == value[:1]):
        return False
    n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.repeat(value[:1], size, axis=0)))
    return True


def _sliced_element_shape_const(st: RewriteState, n: node_def_pb2.NodeDef,
                                readers: dict[str, list[tuple[node_def_pb2.NodeDef, int]]],
                                made: dict[str, node_def_pb2.NodeDef], size: int) -> bool:
    """Rescale Const N in place when it is a folded shape whose only use is a constant ``Slice`` that is the
    element shape of TensorList ops (a gradient's ``slice(shape(t), [1], [-1])`` inside a loop body), and the
    slice starts at an entry equal to the batch."""
    uses = readers.get(n.name, [])
    if not uses or not all(c.op == "Slice" and slot == 0 for c, slot in uses):
        return False
    dtype = tf.as_dtype(n.attr["dtype"].type)
    value = tf.make_ndarray(n.attr["value"].tensor)
    if dtype not in (tf.int32, tf.int64) or value.ndim != 1:
        return False
    begins = set()
    for c, _ in uses:
        bound = made.get(c.input[1].split(":")[0]) if len(c.input) > 2 else None
        lists = readers.get(c.name, [])
        if bound is None or bound.op != "Const" or not lists or not all(
                batch_split.ELEMENT_SHAPE_OPERAND.get(o.op) == slot for o, slot in lists):
            return False
        begins.add(int(tf.make_ndarray(bound.attr["value"].tensor).reshape(-1)[0]))
    begin = begins.pop() if len(begins) == 1 else -1
    if not 0 <= begin < value.size or value[begin] != st.ref_batch or \
            tuple(int(x) for x in value[begin:]) in {tuple(v.shape) for v in st.ir.variables}:
        return False
    flat = value.copy()
    flat[begin] = size
    n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(flat.astype(np.dtype(dtype.as_numpy_dtype))))
    return True


def _element_shape_const(st: RewriteState, n: node_def_pb2.NodeDef, uses: list[tuple[str, int]], size: int) -> bool:
    """Rescale Const N in place when it is the element shape of a TensorList op and starts with the batch."""
    if not uses or not all(batch_split.ELEMENT_SHAPE_OPERAND.get(op) == slot for op, slot in uses):
        return False
    dtype = tf.as_dtype(n.attr["dtype"].type)
    if dtype not in (tf.int32, tf.int64):
        return False
    value = tf.make_ndarray(n.attr["value"].tensor)
    if value.ndim != 1 or value.size == 0 or value[0] != st.ref_batch:
        return False
    if tuple(int(x) for x in value) in {tuple(v.shape) for v in st.ir.variables}:
        return False       # a weight's shape (a kernel accumulated per step), not a batch of rows
    flat = value.copy()
    flat[0] = size
    n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(flat.astype(np.dtype(dtype.as_numpy_dtype))))
    return True
