"""Assemble the IR records: tensors (bytes per example or fixed), ops (FLOPs, memory), edges, colocation.

Why a module of its own: once shapes, batch axes, variables and phases are known, turning them into
the :mod:`tag.ir` dataclasses is bookkeeping that every rule above feeds into; keeping it apart keeps
the analysis steps free of IR construction details.

* A tensor with a batch axis has ``nbytes = Linear(0, bytes / batch)``; others are fixed. Tensors with
  an unknown shape count 0 bytes (and are counted). A graph analysed at its own batch and reported at
  another has its shapes rescaled along the batch axis.
* An op whose inputs or outputs carry the batch has all its FLOPs per example, others fixed.
  ``mem_bytes`` = bytes of inputs + outputs (applies also read and write their variables).
* Colocation: a variable op with its read ops, its apply op and its slots (and their reads), merged
  with TensorFlow's ``_class: loc:@...`` attributes; a functional loop with its gradient loop and the
  TensorList ops around them (one unit for grouping); only groups of two or more ops.
* A While loop costs its body (and condition) times its trip count
  (:func:`tag.frontend.function_cost.trip_count`).

Example::

    from tag.frontend.assemble import colocation_groups   # used by tag.frontend.analyze.analyze
    import tag
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=8))
    tg.colocation[0]      # a variable with its reads, apply op and slots
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from tag.frontend.batch_axes import const_ints
from tag.frontend.function_cost import FunctionCoster, HandleSpec, handle_specs, trip_count
from tag.frontend.graph_import import Node, StepGraph
from tag.frontend.op_rules import flops_of, numel
from tag.frontend.shapes import BatchSpec, InferredShapes, dtype_size
from tag.frontend.variables import StepVariables, source_variable
from tag.ir.algorithms import UnionFind
from tag.ir.op_types import CASE_TYPES, FUNCTION_CALL_TYPES, IF_TYPES, TENSOR_LIST_TYPES, WHILE_TYPES
from tag.ir.types import Edge, Linear, OpInfo, TensorInfo

__all__ = ["colocation_groups", "dependency_edges", "op_infos", "tensor_infos"]

log = logging.getLogger("tag")


def tensor_infos(sg: StepGraph, inferred: InferredShapes, axes: dict[str, list[int | None]],
                 batch: BatchSpec) -> tuple[dict[str, list[TensorInfo]], int]:
    """(op name -> a TensorInfo per output, number of numeric tensors of unknown shape)."""
    unknown_shape = 0
    rescale, ref_batch = batch.rescale, batch.ref_batch
    tensors: dict[str, list[TensorInfo]] = {}
    for nm in sg.order:
        infos = []
        for k, (s, dt) in enumerate(zip(inferred.shapes[nm], inferred.dtypes[nm], strict=True)):
            ax = axes[nm][k]
            size = dtype_size(dt)
            n_el = numel(s)
            if n_el is None:
                if size:
                    unknown_shape += 1
                nbytes = Linear(0.0, 0.0)
            elif ax is not None:
                nbytes = Linear(0.0, n_el * size / ref_batch)
            else:
                nbytes = Linear(float(n_el * size), 0.0)
            shp = s
            if rescale and s is not None and ax is not None and s[ax] is not None:
                old, new = rescale
                if (s[ax] * new) % old == 0:
                    shp = tuple(s[:ax]) + (s[ax] * new // old,) + tuple(s[ax + 1:])
            infos.append(TensorInfo(f"{nm}:{k}", dt, shp, ax, nbytes))
        tensors[nm] = infos
    return tensors, unknown_shape


def op_infos(sg: StepGraph, inferred: InferredShapes, tensors: dict[str, list[TensorInfo]],
             step_vars: StepVariables, phase: dict[str, str], batch: BatchSpec) -> tuple[list[OpInfo], Counter]:
    """(an OpInfo per step op in IR order, op types costed by the fallback rule -> count)."""
    coster = FunctionCoster({f.signature.name: f for f in sg.graph_def.library.function})
    var_bytes = {v.name: v.nbytes for v in step_vars.variables}   # variable -> bytes
    unknown_types: Counter = Counter()
    ops: list[OpInfo] = []
    for nm in sg.order:
        n = sg.nodes[nm]
        outs = tensors[nm]
        in_infos = [tensors[s][i] for s, i in n.data_in if i < len(tensors[s])]
        touches_batch = any(t.batch_axis is not None for t in in_infos) or any(
            t.batch_axis is not None for t in outs)
        f, known = _op_flops(n, sg, inferred, in_infos, step_vars, coster, unknown_types, batch)
        touches_batch = touches_batch or (n.type in WHILE_TYPES and any(
            t.shape and len(t.shape) >= 2 and t.shape[0] is None for t in in_infos))
        flops = Linear(0.0, f / batch.ref_batch) if touches_batch else Linear(f, 0.0)
        mf = sum(t.nbytes.fixed for t in in_infos) + sum(t.nbytes.fixed for t in outs)
        mp = sum(t.nbytes.per_example for t in in_infos) + sum(t.nbytes.per_example for t in outs)
        if nm in step_vars.apply_grad_index:  # optimizer applies read and write the variables they update
            for s, _ in n.data_in:
                sv = source_variable(sg.nodes, s)
                if sv is not None:
                    mf += 2 * var_bytes.get(sv, 0)
        ops.append(OpInfo(
            name=nm, type=n.type, device=n.nd.device, phase=phase[nm],  # type: ignore[arg-type]
            inputs=[f"{s}:{i}" for s, i in n.data_in], control_inputs=list(n.ctrl_in), outputs=outs,
            flops=flops, mem_bytes=Linear(float(mf), float(mp)), has_flop_rule=known, attrs=_cost_attrs(n)))
    return ops, unknown_types


_COST_ATTRS = {"MatMul": ("transpose_a", "transpose_b"), "_FusedMatMul": ("transpose_a", "transpose_b"),
               "Einsum": ("equation",)}


def _cost_attrs(n: Node) -> dict[str, bool | str]:
    """The attributes of N that change its speed at equal FLOPs (``tag.cost.matmul_table``: MatMul transposes,
    an Einsum's equation)."""
    out: dict[str, bool | str] = {}
    for a in _COST_ATTRS.get(n.type, ()):
        if a in n.nd.attr:
            value = n.nd.attr[a]
            out[a] = value.s.decode("utf-8", "replace") if value.WhichOneof("value") == "s" else bool(value.b)
    return out


def _op_flops(n: Node, sg: StepGraph, inferred: InferredShapes, in_infos: list[TensorInfo],
              step_vars: StepVariables, coster: FunctionCoster, unknown_types: Counter,
              batch: BatchSpec) -> tuple[float, bool]:
    """(FLOPs of op N at the reference batch, whether a rule covered it); counts fallbacks in UNKNOWN_TYPES."""
    shapes = inferred.shapes
    in_shapes = [t.shape for t in in_infos]
    if batch.rescale:  # FLOP rules work on the shapes TF inferred (at the declared batch)
        in_shapes = [shapes[s][i] for s, i in n.data_in if i < len(shapes[s])]
    if n.type in FUNCTION_CALL_TYPES:
        const_cond = None
        if n.type in IF_TYPES or n.type in CASE_TYPES:
            c = const_ints(sg.nodes[n.data_in[0][0]].nd) if n.data_in else None
            const_cond = c[0] if c else None
        specs = handle_specs(inferred.tf_ops[n.name]) if n.name in inferred.tf_ops else []
        # SPECS (one per TF input) may be fewer than IN_SHAPES: padded with None, IN_SHAPES sets the length
        padded = specs + [None] * len(in_shapes)
        in_shapes = [spec if spec is not None else s for s, spec in zip(in_shapes, padded, strict=False)]
        if n.type in WHILE_TYPES:
            in_shapes = [_batch_for_unknown_rows(s, batch.ref_batch) for s in in_shapes]
        f, unk = coster.cost_functional(n.type, n.nd.attr, in_shapes, const_cond=const_cond)
        if n.type in WHILE_TYPES:   # one trip of the body, times the trips the loop makes
            trips = trip_count(sg.nodes, n.name, shapes, inferred.tf_ops, coster.library)
            if trips is None:
                log.info("loop %s: trip count unknown; costed as one trip", n.name)
            f *= trips if trips is not None else 1
        unknown_types.update(unk)
        return f, not unk
    grad_index = step_vars.apply_grad_index
    extra = {"grad_index": grad_index.get(n.name)} if n.name in grad_index else {}
    f, known = flops_of(n.type, n.nd.attr, in_shapes, shapes[n.name], inferred.dtypes[n.name], extra)
    if not known:
        unknown_types[n.type] += 1
    return f, known


def _batch_for_unknown_rows(shape: Any, batch_size: int) -> Any:
    """A loop's state of unknown leading dimension (a graph built for any batch) is taken to hold the
    batch: costing its body needs the rows."""
    if isinstance(shape, HandleSpec):
        if shape.shape and shape.shape[0] is None:
            return HandleSpec(shape.dtype, (batch_size,) + tuple(shape.shape[1:]))
        return shape
    if shape and len(shape) >= 2 and shape[0] is None:
        return (batch_size,) + tuple(shape[1:])
    return shape


def dependency_edges(sg: StepGraph,
                     tensors: dict[str, list[TensorInfo]]) -> tuple[list[Edge], list[tuple[int, int]]]:
    """(a data Edge per consumed tensor, (src, dst) op indices per control dependency)."""
    index = sg.index
    edges: list[Edge] = []
    control_edges: list[tuple[int, int]] = []
    for nm in sg.order:
        n = sg.nodes[nm]
        d = index[nm]
        for s, i in n.data_in:
            t = tensors[s][i] if i < len(tensors[s]) else None
            edges.append(Edge(index[s], d, f"{s}:{i}", t.nbytes if t is not None else Linear()))
        for s in n.ctrl_in:
            control_edges.append((index[s], d))
    return edges, control_edges


def colocation_groups(sg: StepGraph, step_vars: StepVariables, ops: list[OpInfo]) -> list[list[str]]:
    """Op-name groups that must share a device, ordered by their first op; sets each op's colocation_group."""
    index, nodes = sg.index, sg.nodes
    uf = UnionFind(len(sg.order))   # over IR op indices
    for v in step_vars.variables:
        for r in v.read_ops:
            uf.union(index[v.name], index[r])
        if v.apply_op:
            uf.union(index[v.name], index[v.apply_op])
        for sv in v.slots:
            uf.union(index[v.name], index[sv])
            for r in step_vars.read_ops.get(sv, []):
                uf.union(index[v.name], index[r])
    for nm in sg.order:
        cl = nodes[nm].nd.attr["_class"].list.s if "_class" in nodes[nm].nd.attr else []
        for entry in cl:
            e = entry.decode(errors="replace")
            if e.startswith("loc:@") and e[5:] in sg.step:
                uf.union(index[e[5:]], index[nm])
    _loop_colocation(sg, uf)
    _variant_colocation(sg, ops, uf)
    members_by_root: dict[int, list[str]] = {}   # root op index -> member op names in IR order
    for i, nm in enumerate(sg.order):
        members_by_root.setdefault(uf.find(i), []).append(nm)
    colocation = [members for members in members_by_root.values() if len(members) >= 2]
    colocation.sort(key=lambda m: index[m[0]])
    for gi, members in enumerate(colocation):
        for m in members:
            ops[index[m]].colocation_group = gi
    return colocation


def _variant_colocation(sg: StepGraph, ops: list[OpInfo], uf: UnionFind) -> None:
    """An op that reads a ``variant`` tensor (a TensorList: a loop's state, an ``Identity`` of a While's list
    output) shares its producer's device: a variant cannot travel between hosts' programs (TensorFlow's
    collectives carry numbers only)."""
    index, nodes = sg.index, sg.nodes
    for nm in sg.order:
        for s, k in nodes[nm].data_in:
            if s in index and k < len(ops[index[s]].outputs) and ops[index[s]].outputs[k].dtype == "variant":
                uf.union(index[nm], index[s])


def _loop_colocation(sg: StepGraph, uf: UnionFind) -> None:
    """A functional loop is one unit: each While op with the loops that take its outputs (its gradient
    loop) and the TensorList ops that hand loop state (``variant`` tensors) to or from it."""
    index, nodes = sg.index, sg.nodes
    for nm in sg.order:
        n = nodes[nm]
        if n.type not in WHILE_TYPES:
            continue
        for s, _ in n.data_in:
            if nodes[s].type in TENSOR_LIST_TYPES or nodes[s].type in WHILE_TYPES:
                uf.union(index[nm], index[s])
        for c in n.consumers:
            if c in index and (nodes[c].type in TENSOR_LIST_TYPES or nodes[c].type in WHILE_TYPES):
                uf.union(index[nm], index[c])
