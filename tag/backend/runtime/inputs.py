"""Random inputs for training steps: fed batches (``random_input``) and on-device synthetic batches.

Floats are standard normal; integers and booleans are 0 or 1, so class ids and token ids are valid
for any model. ``random_input`` is shared by ``run_steps`` and the profiler (``tag.calibration``);
``synthetic_input`` builds the variable that replaces a placeholder in ``run_steps(synthetic=True)``.

Example::

    import numpy as np
    import tensorflow as tf
    from tag.backend.runtime.inputs import random_input

    x = random_input("x", [4, 3], tf.float32, np.random.default_rng(0))    # shape (4, 3), N(0, 1)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from tag.backend.runtime.cluster_spec import import_tf
from tag.errors import GraphError


def random_input(name: str, dims: Sequence[int], dtype: Any, rng: np.random.Generator,
                 hint: str = "pass feeds= or input_fn= for it") -> np.ndarray:
    """A random batch for input NAME: floats ~ N(0, 1), integers and booleans in {0, 1} (valid class ids
    and token ids for any model). DTYPE is a tf.DType; HINT ends the error for an unsupported dtype."""
    np_dtype = dtype.as_numpy_dtype
    if dtype.is_floating:
        return rng.standard_normal(list(dims)).astype(np_dtype)
    if dtype.is_integer:
        return rng.integers(0, 2, size=list(dims)).astype(np_dtype)
    if dtype.is_bool:
        return rng.integers(0, 2, size=list(dims)).astype(bool)
    raise GraphError(f"placeholder {name!r} has dtype {dtype.name}, which tag cannot fill with random data; {hint}")


def _unknown_dimension(name: str, dims: Any, hint: str) -> GraphError:
    """The error for placeholder NAME, whose shape DIMS (None: unknown rank) tag cannot fill; HINT: what to pass."""
    shown = dims if dims is not None else "?"
    return GraphError(f"placeholder {name!r} has an unknown dimension (shape {shown}); {hint}")


def random_feed(op: Any, rng: np.random.Generator) -> np.ndarray:
    """A random batch for Placeholder OP (a tf.Operation of fully known shape), as ``random_input`` makes it."""
    shape = op.get_attr("shape")
    dims = None if shape.unknown_rank else [d.size for d in shape.dim]
    if dims is None or any(d < 0 for d in dims):
        raise _unknown_dimension(op.name, dims, "pass feeds= or input_fn= for it")
    return random_input(op.name, dims, op.get_attr("dtype"), rng)


def synthetic_input(node: Any, initial: Callable[[], Any] | None = None) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device variable standing in for placeholder NODE (a NodeDef).

    Call inside the graph's ``as_default()``; the variable lives on NODE's device, under ``tag_synthetic/``.
    INITIAL() (called on that device) gives its value instead of a random batch.
    """
    tf = import_tf()
    dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    dims = shape.as_list() if shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        raise _unknown_dimension(node.name, dims, "pass feeds= for it")
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        if initial is not None:
            value = initial()
        elif dtype.is_floating:
            value = tf.random.normal(dims, dtype=dtype)
        elif dtype.is_integer or dtype.is_bool:
            value = tf.random.uniform(dims, 0, 2, dtype=tf.int64 if dtype == tf.int64 else tf.int32)
            value = tf.cast(value, dtype) if value.dtype != dtype else value
        else:
            raise GraphError(f"placeholder {node.name!r} has dtype {dtype.name}, which tag cannot fill with random "
                             "data; pass feeds= for it")
        var = tf.compat.v1.Variable(value, trainable=False, use_resource=True, collections=[], name="batch")
        return var.initializer, var.value()


SYNTHETIC_BLOCK = 16     # examples drawn together (from the same seed) in a synthetic batch


def synthetic_share(node: Any, source: str, lo: int, hi: int, batch: int, seed: int) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device variable standing in for placeholder NODE, which holds
    examples LO..HI-1 (axis 0) of the global batch (BATCH examples) of batch input SOURCE. The examples are drawn
    in blocks of ``SYNTHETIC_BLOCK``, each from SEED, SOURCE and its position alone (stateless): every host that
    holds some of SOURCE's examples holds the same values for them, whichever strategy split the batch, and
    draws only the blocks its own examples are in."""
    import zlib
    tf = import_tf()
    dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    dims = shape.as_list() if shape.rank is not None else None
    if dims is None or any(d is None for d in dims[1:]) or not dims:
        raise _unknown_dimension(node.name, dims, "pass feeds= for it")
    if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
        raise GraphError(f"placeholder {node.name!r} has dtype {dtype.name}, which tag cannot fill with random "
                         "data; pass feeds= for it")
    first, end = lo // SYNTHETIC_BLOCK, -(-hi // SYNTHETIC_BLOCK)
    source_seed = zlib.crc32(source.encode()) & 0x7FFFFFFF
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        blocks = []
        for k in range(first, end):
            rows = min(SYNTHETIC_BLOCK, batch - k * SYNTHETIC_BLOCK)
            seed_k = [int(seed) * 1_000_003 + k, source_seed]
            if dtype.is_floating:
                blocks.append(tf.random.stateless_normal([rows] + dims[1:], seed=seed_k, dtype=dtype))
            else:
                block = tf.random.stateless_uniform([rows] + dims[1:], seed=seed_k, minval=0, maxval=2, dtype=tf.int32)
                blocks.append(tf.cast(block, dtype) if dtype != tf.int32 else block)
        value = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=0)
        start = lo - first * SYNTHETIC_BLOCK
        var = tf.compat.v1.Variable(value[start:start + hi - lo], trainable=False, use_resource=True, collections=[],
                                    name="batch")
        return var.initializer, var.value()


SLICE_PREFIX = "tag/slice/"     # the rewrite's batch slices (tag.backend.rewrite.batch_split)


def remote_input_slices(graph_def: Any, placeholders: dict) -> dict:
    """Slices of PLACEHOLDERS (name -> NodeDef) that a rewritten GRAPH_DEF sends to another device:
    slice name -> (a Placeholder NodeDef of the slice's shape on the device that reads it, the sliced
    placeholder's name, begin, end) with BEGIN/END the slice's bounds (arrays, as StridedSlice takes them).

    The rewrite runs a batch source once, whole batch, and slices it for the replicas on the source's
    device; every replica elsewhere receives its slice over the network. ``run_steps(synthetic=True)``
    keeps such a slice on the reading device instead (copied there once, when the input batches are made:
    each host holds its own share of the same batch), so these stand-in nodes carry what
    ``synthetic_input`` needs. A slice read on several devices, or on its own device, is left alone."""
    tf = import_tf()
    from tensorflow.core.framework import node_def_pb2
    nodes = {n.name: n for n in graph_def.node}
    readers: dict[str, set] = {}
    for n in graph_def.node:
        for i in n.input:
            if not i.startswith("^"):
                readers.setdefault(i.split(":")[0], set()).add(n.device)
    out = {}
    for n in graph_def.node:
        if (n.op != "StridedSlice" or not n.name.startswith(SLICE_PREFIX)
                or n.input[0].split(":")[0] not in placeholders):
            continue
        devices = readers.get(n.name, set())
        if len(devices) != 1 or n.device in devices:
            continue
        bounds = [nodes.get(i.split(":")[0]) for i in n.input[1:3]]
        if any(b is None or b.op != "Const" for b in bounds):
            continue
        begin, end = (tf.make_ndarray(b.attr["value"].tensor) for b in bounds)
        source = placeholders[n.input[0].split(":")[0]]
        dims = [d.size for d in source.attr["shape"].shape.dim]
        ax = len(begin) - 1
        if ax >= len(dims):
            continue
        dims[ax] = int(end[ax]) - int(begin[ax])
        stand_in = node_def_pb2.NodeDef(name=n.name, op="Placeholder", device=next(iter(devices)))
        stand_in.attr["dtype"].CopyFrom(source.attr["dtype"])
        stand_in.attr["shape"].shape.CopyFrom(tf.TensorShape(dims).as_proto())
        out[n.name] = (stand_in, n.input[0].split(":")[0], begin, end)
    return out
