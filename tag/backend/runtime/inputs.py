"""Random inputs for training steps: fed batches (``random_input``) and on-device synthetic batches.

Floats are standard normal; integers and booleans are 0 or 1, so class ids and token ids are valid
for any model. ``random_input`` is shared by ``run_steps`` and the profiler (``tag.calibration``);
``synthetic_input`` builds the variable that replaces a placeholder in ``run_steps(synthetic=True)``,
``synthetic_share`` a host program's share of one.

A synthetic input is a pool of K batches, drawn once into a variable on its device before any step is timed;
step T reads batch T mod K (a gather on that device, indexed by a step counter on the same host: no feed, no
transfer). K (``pool_size``) is ``SYNTHETIC_POOL`` (64), fewer where K global batches of one input would pass
``SYNTHETIC_POOL_BYTES`` (256 MiB; at least 1), so the pool costs at most that much memory per input, or one
batch where a batch alone is larger. With one batch, a model memorised it (``zoo:mlp`` showed a loss of 0
after ten steps, which users read as a bug); with 64, a run of up to 64 steps sees new examples every step
(``zoo:mlp``: the loss settles near ln 2, the labels being 0 or 1) and longer runs revisit each batch every
64 steps. A step costs what it did plus the copy of one batch out of the pool. Every host and strategy reads
the same batch at the same step: each counter starts at 0 (at the checkpoint's step when resuming,
``start_synthetic_at``) and counts the session runs that read it, one per step.

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


SYNTHETIC_POOL = 64                     # synthetic batches per input at most; step T reads batch T mod K
SYNTHETIC_POOL_BYTES = 256 << 20        # ... fewer where K global batches of one input would pass this
STEP_COUNTERS = "tag_synthetic_step_counters"   # graph collection of the per-device step counters


def pool_size(batch_bytes: int) -> int:
    """How many synthetic batches of BATCH_BYTES (one input's global batch) to draw: ``SYNTHETIC_POOL``, fewer
    where that would pass ``SYNTHETIC_POOL_BYTES``, at least 1. A function of the global batch alone, so every
    host and strategy agrees."""
    return max(1, min(SYNTHETIC_POOL, SYNTHETIC_POOL_BYTES // max(1, int(batch_bytes))))


def _step_counter(tf: Any, device: str) -> Any:
    """The graph's step counter for DEVICE (a variable on that host's CPU, one per device and graph, in the
    ``STEP_COUNTERS`` collection); its ``tag_step`` is this session run's step (0, 1, ...): it counts up once
    per run that reads a synthetic batch on DEVICE, whatever number of that device's pools read it."""
    graph = tf.compat.v1.get_default_graph()
    cpu = tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string() if device else ""
    for var in graph.get_collection(STEP_COUNTERS):
        if var.tag_device == cpu:
            return var
    with tf.device(cpu), tf.name_scope("tag_synthetic/step/"):
        var = tf.compat.v1.Variable(tf.constant(0, tf.int64), trainable=False, use_resource=True, collections=[],
                                    name="counter")
        var.tag_device, var.tag_step = cpu, var.assign_add(1, read_value=True) - 1
    graph.add_to_collection(STEP_COUNTERS, var)
    return var


def _pooled(tf: Any, device: str, value: Any) -> tuple[Any, Any]:
    """(initializer, per-step value) of the pool VALUE ([K, ...batch]) held in a variable on DEVICE: the
    value is batch (step mod K)."""
    var = tf.compat.v1.Variable(value, trainable=False, use_resource=True, collections=[], name="batch")
    counter = _step_counter(tf, device)
    read = var.sparse_read(tf.math.floormod(counter.tag_step, int(value.shape[0])))
    return tf.group(var.initializer, counter.initializer), read


def start_synthetic_at(sess: Any, graph: Any, step: int) -> None:
    """Set GRAPH's synthetic step counters to STEP (a resumed run reads the batches the uninterrupted one would)."""
    counters = graph.get_collection(STEP_COUNTERS)
    if counters:        # the counters' initializers, their initial value fed: no op added to the graph
        with graph.as_default():
            sess.run([v.initializer for v in counters], {v.initial_value: int(step) for v in counters})


def _batch_bytes(dims: Sequence[int], dtype: Any) -> int:
    return int(np.prod(dims, dtype=np.int64)) * max(1, dtype.size)


def synthetic_input(node: Any, initial: Callable[[], Any] | None = None) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device pool of synthetic batches standing in for placeholder NODE
    (a NodeDef): step T reads batch T mod K (module docstring).

    Call inside the graph's ``as_default()``; the variable lives on NODE's device, under ``tag_synthetic/``.
    INITIAL() (called on that device) gives the pool ([K, ...NODE's shape], its own K) instead of random batches.
    """
    tf = import_tf()
    dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    dims = shape.as_list() if shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        raise _unknown_dimension(node.name, dims, "pass feeds= for it")
    k = pool_size(_batch_bytes(dims, dtype))
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        if initial is not None:
            value = initial()
        elif dtype.is_floating:
            value = tf.random.normal([k] + dims, dtype=dtype)
        elif dtype.is_integer or dtype.is_bool:
            value = tf.random.uniform([k] + dims, 0, 2, dtype=tf.int64 if dtype == tf.int64 else tf.int32)
            value = tf.cast(value, dtype) if value.dtype != dtype else value
        else:
            raise GraphError(f"placeholder {node.name!r} has dtype {dtype.name}, which tag cannot fill with random "
                             "data; pass feeds= for it")
        return _pooled(tf, node.device, value)


SYNTHETIC_BLOCK = 16     # examples drawn together (from the same seed) in a synthetic batch


def synthetic_share(node: Any, source: str, lo: int, hi: int, batch: int, seed: int) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device pool of synthetic batches standing in for placeholder
    NODE, which holds examples LO..HI-1 (axis 0) of each global batch (BATCH examples) of batch input SOURCE.
    The examples are drawn in blocks of ``SYNTHETIC_BLOCK``, each from SEED, SOURCE and its position alone
    (stateless): every host that holds some of SOURCE's examples holds the same values for them, whichever
    strategy split the batch, and
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
    pool = pool_size(_batch_bytes([batch] + dims[1:], dtype))     # from the global batch: every host agrees
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        blocks = []
        for k in range(first, end):         # block k of all POOL batches at once: [POOL, rows, ...]
            rows = min(SYNTHETIC_BLOCK, batch - k * SYNTHETIC_BLOCK)
            seed_k = [int(seed) * 1_000_003 + k, source_seed]
            if dtype.is_floating:
                blocks.append(tf.random.stateless_normal([pool, rows] + dims[1:], seed=seed_k, dtype=dtype))
            else:
                block = tf.random.stateless_uniform([pool, rows] + dims[1:], seed=seed_k, minval=0, maxval=2,
                                                    dtype=tf.int32)
                blocks.append(tf.cast(block, dtype) if dtype != tf.int32 else block)
        value = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=1)
        start = lo - first * SYNTHETIC_BLOCK
        return _pooled(tf, node.device, value[:, start:start + hi - lo])


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
