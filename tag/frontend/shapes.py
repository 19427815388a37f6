"""Shapes: find the batch inputs, run TensorFlow's shape inference twice, tabulate every output's shape.

Why two imports: the *concrete* import declares the batch inputs at the reference batch and gives
every tensor its static shape; the *probe* import declares their first dimension unknown (and turns
``If``/``Case`` ops into calls of a branch so inference runs through the function body). A dimension
known in the first and unknown in the second scales with the batch -- the first verdict on batch axes,
which :mod:`tag.frontend.batch_axes` completes where the batch is baked into constants.

Example::

    import tag
    from tag.frontend.graph_import import pruned_graph_def, step_graph
    from tag.frontend.shapes import find_batch, infer_shapes
    sg = step_graph(tag.zoo.training_graph("mlp", batch_size=8))
    spec = find_batch(sg.nodes, sg.step, batch_size=None)       # spec.batch == 8
    inferred = infer_shapes(pruned_graph_def(sg.graph_def, sg.step), spec)
    inferred.shapes["input"], inferred.probe_axes["input"]      # [(8, 784)], [0]
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tag.errors import GraphError
from tag.frontend.graph_import import Node, first_line, import_graph_def
from tag.frontend.op_rules import Shape
from tag.ir.op_types import CASE_TYPES, IF_TYPES, ITERATOR_TYPES, PLACEHOLDER_TYPES

__all__ = ["BatchSpec", "InferredShapes", "batch_inputs", "dtype_size", "find_batch", "infer_shapes",
           "to_shape"]

log = logging.getLogger("tag")

_DTYPE_SIZES: dict[str, int] = {}   # dtype name -> bytes per element (a cache of tf.as_dtype)


def dtype_size(name: str) -> int:
    """Bytes per element of a dtype name; 0 for handles, variants and strings."""
    size = _DTYPE_SIZES.get(name)
    if size is None:
        size = 0 if name in ("resource", "variant", "string") else tf.as_dtype(name).size
        _DTYPE_SIZES[name] = size
    return size


def to_shape(ts: tf.TensorShape) -> Shape | None:
    """A TensorShape as a tuple (None for unknown dims); None for an unknown rank."""
    if ts.rank is None:
        return None
    return tuple(ts.as_list())


# ---------------------------------------------------------------------------------------------------------
# The batch inputs
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchSpec:
    """Which inputs carry the batch, and the batch sizes the analysis works at."""

    inputs: list[tuple[str, int, list[int]]]  # (op, output index, declared dims) of each batch-carrying input
    unknown: list[tuple[str, int]]            # (op, output index) of those declared with an unknown batch
    batch: int                                # the batch the IR reports (batch_size=, else the graph's own)
    graph_batch: int | None                   # the batch the graph declares (most common first dim), if any

    @property
    def rescale(self) -> tuple[int, int] | None:
        """(graph's batch, reported batch) when they differ: sizes are inferred at the first, then rescaled."""
        if self.graph_batch is not None and self.batch != self.graph_batch:
            return self.graph_batch, self.batch
        return None

    @property
    def ref_batch(self) -> int:
        """The batch shape inference runs at (the graph's own when rescaling)."""
        return self.graph_batch if self.rescale else self.batch   # type: ignore[return-value]

    def targets(self) -> dict[str, set[int]]:
        """Input op -> output indices whose first dim is the batch."""
        targets: dict[str, set[int]] = defaultdict(set)
        for nm, i, _ in self.inputs:
            targets[nm].add(i)
        return targets


def batch_inputs(nodes: dict[str, Node], step: set[str]) -> list[tuple[str, int, list[int] | None]]:
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



def find_batch(nodes: dict[str, Node], step: set[str], batch_size: int | None) -> BatchSpec:
    """The batch-carrying inputs of STEP (rank >= 1, first dim the graph's batch or unknown) and the batch.

    Raises GraphError when no input can carry a batch, or one has an unknown batch and no batch_size is given.
    """
    cands = batch_inputs(nodes, step)
    if not cands:
        raise GraphError("cannot find the batch dimension: no Placeholder or iterator output of rank >= 1 "
                         "feeds the training step")
    declared = Counter(d[0] for _, _, d in cands if d[0] >= 0)
    graph_batch = None
    if declared:
        top = max(declared.values())
        graph_batch = max(b for b, c in declared.items() if c == top)
    inputs = [(nm, i, d) for nm, i, d in cands if d[0] < 0 or d[0] == graph_batch]
    unknown = [(nm, i) for nm, i, d in inputs if d[0] < 0]
    if unknown and batch_size is None:
        nm, i = unknown[0]
        label = nm if i == 0 else f"{nm}:{i}"
        raise GraphError(f"cannot find the batch size: input '{label}' has unknown first dimension; "
                         "pass batch_size= (tag.optimize) or --batch-size (tag-deploy)")
    batch = batch_size if batch_size is not None else graph_batch
    assert batch is not None
    return BatchSpec(inputs=inputs, unknown=unknown, batch=batch, graph_batch=graph_batch)


def _set_batch_dims(gd: Any, targets: dict[str, set[int]], value: int) -> None:
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


def _calls_instead_of_ifs(gd: Any) -> int:
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



# ---------------------------------------------------------------------------------------------------------
# The two imports
# ---------------------------------------------------------------------------------------------------------

@dataclass
class InferredShapes:
    """What TensorFlow's shape inference says of every op's outputs."""

    tf_ops: dict[str, tf.Operation]           # op name -> the op in the concrete import (OpDef, outputs)
    shapes: dict[str, list[Shape | None]]     # op name -> shape of each output at the reference batch
    dtypes: dict[str, list[str]]              # op name -> dtype name of each output
    # op name -> per output: the first axis known in the concrete import and unknown in the probe (scales
    # with the batch), else None
    probe_axes: dict[str, list[int | None]]


def infer_shapes(base: Any, batch: BatchSpec) -> InferredShapes:
    """Import the pruned step BASE at the reference batch and with an unknown batch; tabulate the shapes."""
    g1 = _concrete_import(base, batch)
    g2 = _probe_import(base, batch.targets())
    probe_ops = {} if g2 is None else {op.name: op for op in g2.get_operations()}
    tf_ops = {op.name: op for op in g1.get_operations()}
    inferred = InferredShapes(tf_ops=tf_ops, shapes={}, dtypes={}, probe_axes={})
    for nm, op in tf_ops.items():
        outs = op.outputs
        concrete_shapes = [to_shape(t.shape) for t in outs]
        inferred.shapes[nm] = concrete_shapes
        inferred.dtypes[nm] = [t.dtype.name for t in outs]
        axes: list[int | None] = [None] * len(outs)
        probe = probe_ops.get(nm)
        if probe is not None and len(probe.outputs) == len(outs):
            probe_shapes = [to_shape(t.shape) for t in probe.outputs]
            for k, (s1, s2) in enumerate(zip(concrete_shapes, probe_shapes, strict=True)):
                if s1 is None or s2 is None or len(s2) != len(s1):
                    continue
                for j, d in enumerate(s1):
                    if d is not None and s2[j] is None:
                        axes[k] = j
                        break
        inferred.probe_axes[nm] = axes
    return inferred


def _concrete_import(base: Any, batch: BatchSpec) -> tf.Graph:
    """BASE imported with its unknown-batch inputs declared at the reference batch.

    A graph built at another batch than the one asked for is analysed at its own batch and rescaled:
    TF1 graphs have their batch baked into constants (static shapes in the gradient code), so
    re-declaring only the inputs would give an inconsistent graph.
    """
    concrete = base
    if batch.unknown:
        concrete = tf.compat.v1.GraphDef()
        concrete.CopyFrom(base)
        # a no-op for the inputs declared at the reference batch already
        _set_batch_dims(concrete, batch.targets(), batch.ref_batch)
    try:
        g1 = import_graph_def(concrete)
    except Exception as err:  # noqa: BLE001
        raise GraphError(f"TensorFlow cannot import the graph at batch {batch.ref_batch}: "
                         f"{first_line(err)}") from None
    if batch.rescale:
        log.info("analysing at the graph's own batch %d; sizes rescaled to batch %d", batch.graph_batch,
                 batch.batch)
    return g1


def _probe_import(base: Any, targets: dict[str, set[int]]) -> tf.Graph | None:
    """BASE imported with the batch inputs' first dim unknown (If/Case as calls first); None if TF refuses."""
    for rewrite_ifs in (True, False):
        probe = tf.compat.v1.GraphDef()
        probe.CopyFrom(base)
        _set_batch_dims(probe, targets, -1)
        if rewrite_ifs and not _calls_instead_of_ifs(probe):
            continue
        try:
            return import_graph_def(probe)
        except Exception as err:  # noqa: BLE001
            log.debug("unknown-batch import failed (rewrite_ifs=%s): %s", rewrite_ifs, first_line(err))
    return None
