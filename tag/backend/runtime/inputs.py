"""Random inputs for training steps: fed batches (``random_input``) and on-device synthetic batches.

Floats are standard normal; integers and booleans are 0 or 1, so class ids and token ids are valid
for any model. ``random_input`` is shared by ``run_steps`` and the profiler (``tag.cost.calibration``);
``synthetic_input`` builds the variable that replaces a placeholder in ``run_steps(synthetic=True)``.

Example::

    import numpy as np
    import tensorflow as tf
    from tag.backend.runtime.inputs import random_input

    x = random_input("x", [4, 3], tf.float32, np.random.default_rng(0))    # shape (4, 3), N(0, 1)
"""
from __future__ import annotations

from typing import Any, Sequence

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


def random_feed(op: Any, rng: np.random.Generator) -> np.ndarray:
    """A random batch for Placeholder OP (a tf.Operation of fully known shape), as ``random_input`` makes it."""
    shape = op.get_attr("shape")
    dims = None if shape.unknown_rank else [d.size for d in shape.dim]
    if dims is None or any(d < 0 for d in dims):
        raise GraphError(f"placeholder {op.name!r} has an unknown dimension (shape {dims if dims is not None else '?'}); "
                         "pass feeds= or input_fn= for it")
    return random_input(op.name, dims, op.get_attr("dtype"), rng)


def synthetic_input(node: Any) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device variable standing in for placeholder NODE (a NodeDef).

    Call inside the graph's ``as_default()``; the variable lives on NODE's device, under ``tag_synthetic/``.
    """
    tf = import_tf()
    dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    dims = shape.as_list() if shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        raise GraphError(f"placeholder {node.name!r} has an unknown dimension (shape {dims if dims is not None else '?'}); "
                         "pass feeds= for it")
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        if dtype.is_floating:
            value = tf.random.normal(dims, dtype=dtype)
        elif dtype.is_integer or dtype.is_bool:
            value = tf.random.uniform(dims, 0, 2, dtype=tf.int64 if dtype == tf.int64 else tf.int32)
            value = tf.cast(value, dtype) if value.dtype != dtype else value
        else:
            raise GraphError(f"placeholder {node.name!r} has dtype {dtype.name}, which tag cannot fill with random "
                             "data; pass feeds= for it")
        var = tf.compat.v1.Variable(value, trainable=False, use_resource=True, collections=[], name="batch")
        return var.initializer, var.value()
