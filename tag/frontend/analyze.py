"""Build the training-graph IR (:class:`tag.ir.TrainingGraph`) from a TensorFlow training-step GraphDef.

Example::

    import tag
    from tag.frontend.analyze import analyze

    tg = analyze(tag.zoo.training_graph("resnet50", batch_size=32))
    print(len(tg.ops), tg.num_parameters, tg.total_flops(batch=8, phases=("forward", "backward")))
    tg16 = analyze(my_graph_def, batch_size=16)   # a user's graph whose inputs are [None, ...]

How the IR is derived (the rules later stages rely on):

* **Step ops.** The optimizer's apply ops (types ``Apply*``, ``ResourceApply*``, ``SparseApply*``,
  ``ResourceSparseApply*``) and the variable writes (assign/scatter ops) downstream of gradient ops
  (TF1 SGD and Adam update a weight with a sparse gradient that way, with no apply op), every op they
  reach (the ops grouping them, e.g. ``train_op``, and the optimizer's bookkeeping such as Adam's beta-power updates),
  and all data and control ancestors of those. Initializers, savers and summaries are left out. ``ops`` is in
  topological order.
* **Shapes** come from TensorFlow's own shape inference: the step is imported into a fresh
  ``tf.Graph``. Inputs with an unknown batch are declared at ``batch_size`` first. A graph built at
  another batch than ``batch_size`` is analysed at its own batch and every size is rescaled to
  ``batch_size`` (shapes along their batch axis; ``Linear`` sizes need nothing): TF1 graphs have their
  batch baked into constants (the gradient code uses static shapes), so re-declaring only the inputs
  would give an inconsistent graph.
* **Batch axes.** Batch-carrying inputs are the Placeholders / iterator outputs of rank >= 1 whose first
  dimension is the batch (the most common first dimension among them, or unknown). A second import
  declares their first dimension unknown (and, for that import only, turns ``If``/``Case`` ops into
  calls of a branch so shape inference runs through the function body); a dimension that is known in
  the first import and unknown in the second scales with the batch. Where the graph has the batch
  baked into constants (TF1 gradient code uses static shapes, users write ``reshape(x, [B*S, H])``),
  the unknown dimension stops there, so per-op rules, applied in topological order, carry the batch
  on: an output with a batch-carrying input's shape, its element count (a reshape: the batch goes to
  the first axis that spans it, so ``[B*S, H]`` and ``[B, S, H]`` both scale), or a dimension equal
  to that input's batch dimension; explicit rules for ops that reduce the batch away (weight
  gradients of MatMul/Conv2D, ``BiasAddGrad``, reductions over the batch axis, batch-norm
  statistics) and for MatMul/BatchMatMul/Gather; outputs of functional ops only by exact shape. A
  gradient op built from constants alone (``Fill``/``Tile`` of a static shape) takes the batch axis
  of the same-shaped tensor of the forward op it differentiates (``gradients/<op>_grad/...``; forward
  ops outside the step, the loss's tail, are imported for this). A tensor TensorFlow built from
  constants alone (``zeros_like``/``ones_like``/``fill`` of a static batch, folded into a ``Const``)
  takes the batch axis of an exact-shape operand of the same elementwise op, and passes it up to the
  same-shaped ops it was computed from. ``Einsum`` keeps the batch where its label survives.
  A tensor with a batch axis has ``nbytes = Linear(0, bytes / batch)``; others are fixed. Tensors with
  an unknown shape count 0 bytes and are counted in ``TrainingGraph.unknown_shape_tensors``.
* **Phases.** ``update``: the apply ops, the ops they reach, and ops whose consumers are all update
  ops (learning rate, beta powers, slot variables). ``backward``: ops under a ``gradients`` or
  ``gradients_N`` name scope (what ``tf.gradients`` uses); failing that, under any scope that holds
  ``<op>_grad`` scopes (``tf.gradients(name=...)``); failing that, ops whose type contains ``Grad``
  or ``Backprop`` and the ops they feed. ``forward``: the rest. The loss op itself is not in the IR
  when nothing in the update reads it (TF1's gradient of a mean does not).
* **Variables.** ``trainable``: the ``var`` input of an apply op, with the tensor feeding its
  ``grad``/``delta`` argument and its per-variable slots (other variable inputs of the same apply op
  with the variable's shape: Adam m/v, momentum accumulators). ``slot``: those. ``state``: any other
  variable the step uses (batch-norm moving statistics, beta powers, global step). A weight that an
  optimizer updates with scatter/assign ops instead of an apply op (TF1 SGD and Adam on an
  ``IndexedSlices`` gradient) is trainable too: it feeds the backward pass and a write fed by gradients
  updates it; that write is its apply op, its slots are the variables TF colocates with it.
* **Colocation.** A variable op with its read ops (``ReadVariableOp``/``Identity``), its apply op and
  its slots, merged with TensorFlow's ``_class: loc:@...`` attributes; a While loop with its gradient
  loop and the TensorList ops between them (one unit). Only groups of two or more ops.
* **FLOPs** per op as ``Linear`` in the batch (a multiply-add is 2 FLOPs). Rules cover matmuls, convs
  and their backprops, pooling, elementwise ops, reductions, softmax, batch norm, einsum, optimizer
  applies, and functional ops (``If``, ``PartitionedCall``, ...: the cost of the body, the dearer
  branch of a conditional, a loop's body times its trip count: ``maximum_iterations``, the forward
  loop's counter for a gradient loop, a constant bound in its condition, or a TensorList's length;
  variables and TensorLists passed in keep their shapes inside the body). Data-movement ops (TensorList
  ops included) cost 0 FLOPs. Any other op type
  gets 1 FLOP per output element, ``has_flop_rule=False``, is counted in
  ``TrainingGraph.unknown_op_types`` and logged once per analysis. An op whose inputs or outputs carry
  the batch has all its FLOPs per example, others fixed. ``mem_bytes`` = bytes of inputs + outputs.

The analysis runs as named steps, each in a module of this package: :mod:`~tag.frontend.graph_import`
(the step ops and their order), :mod:`~tag.frontend.shapes` (batch inputs, the two imports),
:mod:`~tag.frontend.batch_axes`, :mod:`~tag.frontend.variables`, :mod:`~tag.frontend.phases`,
:mod:`~tag.frontend.op_rules` and :mod:`~tag.frontend.function_cost` (FLOPs), and
:mod:`~tag.frontend.assemble` (the IR records).
"""
from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag.errors import GraphError  # noqa: E402
from tag.frontend.assemble import colocation_groups, dependency_edges, op_infos, tensor_infos  # noqa: E402
from tag.frontend.batch_axes import batch_axes  # noqa: E402
from tag.frontend.graph_import import coerce_graph_def, pruned_graph_def, step_graph  # noqa: E402
from tag.frontend.op_rules import FLOP_RULE_TYPES, ZERO_FLOP_TYPES, is_apply_op  # noqa: E402
from tag.frontend.phases import context_ops, op_phases  # noqa: E402
from tag.frontend.shapes import find_batch, infer_shapes  # noqa: E402
from tag.frontend.variables import step_variables  # noqa: E402
from tag.ir.types import TrainingGraph  # noqa: E402

__all__ = ["analyze", "is_apply_op", "FLOP_RULE_TYPES", "ZERO_FLOP_TYPES"]

log = logging.getLogger("tag")


def analyze(graph_def: Any, batch_size: int | None = None, name: str = "") -> TrainingGraph:
    """Build the TrainingGraph IR of a training-step GraphDef.

    ``batch_size``: the (global) batch to analyse at. Required when the inputs declare an unknown first
    dimension; when it differs from a declared batch the inputs are re-declared at this batch.
    Raises :class:`tag.GraphError` (one line) for a graph without optimizer apply ops or whose batch
    dimension cannot be found or fixed.
    """
    # Building the IR creates many small objects; the cyclic collector's passes over them cost more than
    # the analysis itself on large graphs, and nothing here creates garbage cycles worth collecting early.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyze(graph_def, batch_size, name)
    finally:
        if was_enabled:
            gc.enable()


class _Timings:
    """Seconds per analysis step, logged at debug level."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}   # step name -> seconds since the previous mark
        self._last = time.perf_counter()

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self._last
        self._last = now


def _check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise GraphError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def _analyze(graph_def: Any, batch_size: int | None, name: str) -> TrainingGraph:
    timings = _Timings()
    gd = coerce_graph_def(graph_def)
    batch_size = _check_batch_size(batch_size)
    sg = step_graph(gd)                                   # the step's ops, wired and in topological order
    timings.mark("step ops")
    batch = find_batch(sg.nodes, sg.step, batch_size)     # which inputs carry the batch; at which batch
    timings.mark("batch inputs")
    context = context_ops(sg)                             # the loss's tail: tells its gradients' batch axes
    inferred = infer_shapes(pruned_graph_def(gd, sg.step | set(context)), batch)   # TF's shape inference, twice
    timings.mark("shapes")
    axes = batch_axes(sg, inferred, batch, context)
    timings.mark("batch axes")
    tensors, unknown_shape = tensor_infos(sg, inferred, axes, batch)
    timings.mark("tensor infos")
    step_vars = step_variables(sg, inferred)
    timings.mark("variables")
    phase = op_phases(sg)
    timings.mark("phases")
    ops, unknown_types = op_infos(sg, inferred, tensors, step_vars, phase, batch)
    if unknown_types:
        log.warning("no FLOP rule for op types %s; counted 1 FLOP per output element",
                    ", ".join(f"{t} (x{c})" for t, c in sorted(unknown_types.items())))
    timings.mark("flops")
    edges, control_edges = dependency_edges(sg, tensors)
    colocation = colocation_groups(sg, step_vars, ops)
    timings.mark("edges and colocation")
    log.debug("analyze timings: %s", ", ".join(f"{k} {v:.3f}s" for k, v in timings.seconds.items()))
    tg = TrainingGraph(
        ops=ops, edges=edges, control_edges=control_edges, variables=step_vars.variables,
        batch_size=batch.batch, inputs=sorted({nm for nm, _, _ in batch.inputs}, key=lambda x: sg.index[x]),
        colocation=colocation, unknown_op_types=dict(unknown_types), name=name,
        unknown_shape_tensors=unknown_shape)
    if unknown_shape:
        log.info("%d tensors of %s have an unknown shape; counted as 0 bytes", unknown_shape, name or "the graph")
    return tg
