"""FLOPs of functional ops (``If``/``Case``/``PartitionedCall``/``While``): the cost of their function bodies.

Why: TF2-style graphs hide whole layers inside FunctionDefs of the graph's library; the op that calls
one has no FLOP rule of its own. Each body is rebuilt with TensorFlow's function importer at the
caller's input shapes and its ops are costed with :func:`tag.frontend.op_rules.flops_of` (the dearer
branch of a conditional, one trip of a loop). Structurally identical bodies share one cache entry.

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
from typing import Any

import tensorflow as tf

from tag.frontend.graph_import import first_line
from tag.frontend.op_rules import flops_of, grad_arg_index, is_apply_op
from tag.frontend.shapes import to_shape
from tag.ir.op_types import CALL_TYPES, CASE_TYPES, FUNCTION_CALL_TYPES, IF_TYPES, WHILE_TYPES

__all__ = ["FunctionCoster"]

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
