"""GraphDef plumbing shared by every part of the rewriter: tensor names, NodeDef/TensorProto builders,
op instances, and the import check of the result through TF's C API.

The rewriter works on ``NodeDef`` protos directly (no ``tf.Graph`` per instance), so it needs a few
small, fast builders: constants from numpy arrays, a ``DType`` attr, default attrs filled from the op
registry. ``Instance`` is one copy of an original op in the output graph (its batch range and device).

Example::

    import numpy as np
    from tag.backend.rewrite.graph_edit import split_tensor, tensor_name, tensor_proto

    split_tensor("dense/MatMul:1")          # ('dense/MatMul', 1)
    tensor_name("dense/MatMul", 0)          # 'dense/MatMul'
    tensor_proto(np.array([4, 10], np.int32)).tensor_shape.dim[0].size   # 2
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, tensor_pb2, tensor_shape_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util, op_def_registry

from tag.errors import RewriteError

# A contiguous range [first example, end example) of the global batch.
Range = tuple[int, int]

FLOAT_TYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64})


def split_tensor(t: str) -> tuple[str, int]:
    """'op:1' -> ('op', 1); 'op' -> ('op', 0)."""
    if ":" in t:
        op, idx = t.rsplit(":", 1)
        return op, int(idx)
    return t, 0


def tensor_name(op: str, idx: int) -> str:
    """The GraphDef input name of output IDX of OP ('op' for output 0, else 'op:IDX')."""
    return op if idx == 0 else f"{op}:{idx}"


def canonical(t: str) -> str:
    """T with the ':0' of a first output dropped ('op:0' -> 'op')."""
    return tensor_name(*split_tensor(t))


def attr_type(dtype: "tf.DType") -> attr_value_pb2.AttrValue:
    """A ``type`` AttrValue for DTYPE."""
    return attr_value_pb2.AttrValue(type=dtype.as_datatype_enum)


def tensor_proto(value: np.ndarray) -> tensor_pb2.TensorProto:
    """A TensorProto for a small numpy array (faster than tf.make_tensor_proto)."""
    value = np.asarray(value)
    proto = tensor_pb2.TensorProto(dtype=tf.as_dtype(value.dtype).as_datatype_enum)
    proto.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in value.shape]))
    proto.tensor_content = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
    return proto


def fill_defaults(node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
    """NODE with the default value of every attr its op declares and it does not set."""
    op_def = op_def_registry.get(node.op)
    if op_def is not None:
        for a in op_def.attr:
            if a.name not in node.attr and a.HasField("default_value"):
                node.attr[a.name].CopyFrom(a.default_value)
    return node


def check_imports(graph_def: "tf.compat.v1.GraphDef") -> None:
    """Import GRAPH_DEF with TF's C++ importer (shape inference with constant folding of shapes);
    raises RewriteError with TF's message when it does not import."""
    g = tf.Graph()
    opts = c_api.TF_NewImportGraphDefOptions()
    try:
        c_api.TF_ImportGraphDefOptionsSetPrefix(opts, "")
        with c_api_util.tf_buffer(graph_def.SerializeToString()) as buf:
            with g._c_graph.get() as c_graph:  # noqa: SLF001 - the C graph is what TF's importer fills
                c_api.TF_GraphImportGraphDefWithResults(c_graph, buf, opts)
    except (ValueError, tf.errors.OpError) as err:
        first = " ".join(str(err).split())
        hint = ""
        if any(k in first for k in ("Dimension", "reshape", "Incompatible shapes", "must be equal")):
            m = re.search(r"\{\{node ([^}]+)\}\}", first)
            op = m.group(1).split("/replica_")[0].split("/tag_")[0] if m else "the op named above"
            hint = (f" (a batch-sized tensor at {op!r} whose batch axis tag could not decide: build the step "
                    f"with an unknown batch dimension -- [None, ...] placeholders, reshapes with -1 -- and pass "
                    f"batch_size= to tag.analyze)")
        raise RewriteError(f"the rewritten graph does not import: {first[:400]}{hint}") from None
    finally:
        c_api.TF_DeleteImportGraphDefOptions(opts)


@dataclass
class Instance:
    """One instance of an op in the output graph: its node name, batch range, requested device and
    actual device."""

    name: str
    rng: Range
    asked_dev: int    # the device its op group asked for
    dev: int          # where it runs (a variable's copy for ops that take a variable)
    primary: bool = True   # False for extra copies recomputed for one consumer (clones)


def pick_instance(insts: list[Instance], dev: int, asked_dev: int | None = None) -> Instance:
    """The instance on DEV, else the one asked on ASKED_DEV, else the first."""
    for i in insts:
        if i.dev == dev:
            return i
    if asked_dev is not None:
        for i in insts:
            if i.asked_dev == asked_dev:
                return i
    return insts[0]


class NodeBuilder:
    """Fresh names and new nodes of the output graph (``out_nodes``), on topology devices.

    Needs ``self.used_names`` (set of taken node names), ``self.out_nodes`` (list of NodeDef, in output
    order) and ``self.topo``; the rewriter's state (``tag.backend.rewrite.context.RewriteState``) provides them.
    """

    def fresh(self, base: str) -> str:
        """BASE, or BASE_1, BASE_2, ... : the first name not yet taken (and now taken)."""
        name, i = base, 1
        while name in self.used_names:
            name = f"{base}_{i}"
            i += 1
        self.used_names.add(name)
        return name

    def const(self, name: str, value: np.ndarray, dev: int) -> str:
        """A Const node holding VALUE on DEV (named NAME or a fresh variant); returns its name."""
        name = self.fresh(name)
        node = node_def_pb2.NodeDef(name=name, op="Const", device=self.topo.tf_device(dev))
        node.attr["dtype"].CopyFrom(attr_type(tf.as_dtype(value.dtype)))
        node.attr["value"].tensor.CopyFrom(tensor_proto(value))
        self.out_nodes.append(node)
        return name

    def concat_node(self, name: str, parts: list[str], axis: str, dtype: "tf.DType", dev: int) -> str:
        """A ConcatV2 node NAME on DEV joining PARTS along the int32 Const AXIS."""
        node = node_def_pb2.NodeDef(name=name, op="ConcatV2", device=self.topo.tf_device(dev))
        node.input.extend(parts + [axis])
        node.attr["N"].i = len(parts)
        node.attr["T"].CopyFrom(attr_type(dtype))
        node.attr["Tidx"].CopyFrom(attr_type(tf.int32))
        self.out_nodes.append(node)
        return name

    def reshape(self, name: str, tensor: str, shape, dtype: "tf.DType", dev: int, exact_name: bool = False) -> str:
        """A Reshape of TENSOR to SHAPE on DEV, named NAME (a fresh variant unless EXACT_NAME)."""
        if not exact_name:
            name = self.fresh(name)
        sh = self.const(f"{name}/shape", np.array(list(shape), np.int32), dev)
        return self.int32_indexed(name, "Reshape", [tensor, sh], dtype, "Tshape", dev)

    def int32_indexed(self, name: str, op: str, inputs: list[str], dtype: "tf.DType", index_attr: str,
                       dev: int) -> str:
        """A node NAME of OP on DEV over INPUTS: data of type DTYPE (attr ``T``), int32 indices (attr INDEX_ATTR)."""
        node = node_def_pb2.NodeDef(name=name, op=op, device=self.topo.tf_device(dev))
        node.input.extend(inputs)
        node.attr["T"].CopyFrom(attr_type(dtype))
        node.attr[index_attr].CopyFrom(attr_type(tf.int32))
        self.out_nodes.append(node)
        return name
