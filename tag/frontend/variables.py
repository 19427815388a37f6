"""Variables: which variables the step trains, which are optimizer slots, which are other state.

Why: memory per device and the synchronisation a strategy needs depend on the variables: trainable
weights are updated from gradients (and replicated or partitioned), their slots follow them, state
(batch-norm moving statistics, beta powers, global step) is only read and assigned.

* ``trainable``: the ``var`` input of an apply op, with the tensor feeding its ``grad``/``delta``
  argument and its per-variable slots (other variable inputs of the same apply op with the variable's
  shape: Adam m/v, momentum accumulators).
* ``slot``: those slots.
* A weight that an optimizer updates with scatter/assign ops instead of an apply op (TF1 SGD and Adam
  on an ``IndexedSlices`` gradient) is ``trainable`` too: a variable whose value feeds the backward
  pass and that a write fed by gradients updates (:func:`tag.frontend.graph_import.gradient_writers`).
  That write is its ``apply_op``; its gradient is the first floating-point backward tensor its update
  is computed from; its slots are the other variables TensorFlow colocates with it (``loc:@var``,
  as ``slot_creator`` does) with its shape. Beta powers, slots and BatchNorm statistics do not
  qualify: the first two are read only by the update, the last is not written from gradients.
* ``state``: any other variable the step uses.

Example::

    import tag
    from tag.frontend.graph_import import pruned_graph_def, step_graph
    from tag.frontend.shapes import find_batch, infer_shapes
    from tag.frontend.variables import step_variables
    sg = step_graph(tag.zoo.training_graph("mlp", batch_size=8))
    inferred = infer_shapes(pruned_graph_def(sg.graph_def, sg.step), find_batch(sg.nodes, sg.step, None))
    sv = step_variables(sg, inferred)
    [(v.name, v.kind) for v in sv.variables][:2]
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tag.frontend.graph_import import Node, StepGraph
from tag.frontend.op_rules import grad_arg_index
from tag.frontend.phases import backward_ops
from tag.frontend.shapes import InferredShapes
from tag.ir.op_types import VARIABLE_TYPES
from tag.ir.types import VariableInfo

__all__ = ["StepVariables", "source_variable", "step_variables"]

#: ops through which a variable is read
_READ_TYPES = frozenset({"ReadVariableOp", "Identity"})
#: ops a variable passes through unchanged on the way to an apply op (TF1 ref variables, loop frames)
_PASS_THROUGH_TYPES = ("Identity", "Enter", "RefEnter", "RefIdentity")


@dataclass
class StepVariables:
    """The step's variables and what the op costs need of them."""

    variables: list[VariableInfo]              # every variable op of the step, in IR order
    apply_grad_index: dict[str, int | None]    # apply op -> input index of its gradient (None: unknown)
    read_ops: dict[str, list[str]]             # variable -> its read ops in the step, in IR order


@dataclass
class _Roles:
    """Per variable: its kind and, for trainable ones, its apply op, gradient and slots."""

    kind: dict[str, str]                       # variable -> "trainable" | "slot" | "state"
    apply_op: dict[str, str]                   # trainable variable -> the apply op that updates it
    gradient: dict[str, str]                   # trainable variable -> "op:index" of its gradient tensor
    slots: dict[str, list[str]]                # trainable variable -> its slot variables


def source_variable(nodes: dict[str, Node], src: str, depth: int = 0) -> str | None:
    """The variable op behind tensor producer SRC (through Identity/Enter ops), or None."""
    n = nodes[src]
    if n.type in VARIABLE_TYPES:
        return src
    if n.type in _PASS_THROUGH_TYPES and n.data_in and depth < 8:
        return source_variable(nodes, n.data_in[0][0], depth + 1)
    return None


def _variable_shape(vn: str, nodes: dict[str, Node], shapes: dict[str, list]) -> tuple[int, ...] | None:
    """The declared shape; failing that, what shape inference says of the variable or its reads."""
    sh = nodes[vn].nd.attr["shape"].shape
    if not sh.unknown_rank and all(d.size >= 0 for d in sh.dim):
        return tuple(int(d.size) for d in sh.dim)
    sources = [vn] if nodes[vn].type != "VarHandleOp" else []
    sources += [c for c in nodes[vn].consumers if nodes[c].type == "ReadVariableOp" and c in shapes]
    for src in sources:
        s = shapes.get(src, [None])[0]
        if s is not None and all(d is not None for d in s):
            return tuple(s)
    return None


def step_variables(sg: StepGraph, inferred: InferredShapes) -> StepVariables:
    """Classify the step's variables and describe each as a VariableInfo."""
    nodes, index, shapes = sg.nodes, sg.index, inferred.shapes
    var_names = [nm for nm in sg.order if nodes[nm].type in VARIABLE_TYPES]
    apply_grad_index: dict[str, int | None] = {}
    roles = _variable_roles(sg, inferred, var_names, apply_grad_index)

    def var_bytes(vn: str) -> int:
        s = _variable_shape(vn, nodes, shapes)
        dt = tf.as_dtype(nodes[vn].nd.attr["dtype"].type)
        return int(np.prod(s, dtype=np.int64)) * dt.size if s is not None else 0

    read_ops: dict[str, list[str]] = {
        v: sorted((c for c in nodes[v].consumers if c in sg.step and nodes[c].type in _READ_TYPES),
                  key=lambda c: index[c]) for v in var_names}
    variables: list[VariableInfo] = []
    for v in var_names:
        s = _variable_shape(v, nodes, shapes)
        slots = roles.slots.get(v, [])
        variables.append(VariableInfo(
            name=v, op=index[v], shape=s if s is not None else (),
            dtype=tf.as_dtype(nodes[v].nd.attr["dtype"].type).name,
            nbytes=var_bytes(v), kind=roles.kind[v], apply_op=roles.apply_op.get(v),
            gradient=roles.gradient.get(v), slots=list(slots), slot_bytes=sum(var_bytes(sv) for sv in slots),
            read_ops=read_ops[v]))
    return StepVariables(variables=variables, apply_grad_index=apply_grad_index, read_ops=read_ops)


def _variable_roles(sg: StepGraph, inferred: InferredShapes, var_names: list[str],
                    apply_grad_index: dict[str, int | None]) -> _Roles:
    """Walk the apply ops (in IR order): each marks its ``var`` input trainable, with its gradient and its
    same-shaped variable inputs as slots. Fills APPLY_GRAD_INDEX on the way."""
    nodes, shapes = sg.nodes, inferred.shapes
    roles = _Roles(kind={v: "state" for v in var_names}, apply_op={}, gradient={}, slots=defaultdict(list))
    for an in sorted(sg.apply_ops, key=lambda x: sg.index.get(x, 0)):
        op_def = inferred.tf_ops[an].op_def
        apply_grad_index[an] = grad_arg_index(op_def)
        n = nodes[an]
        var_arg_idx = _variable_arg_indices(op_def)
        if not n.data_in:
            continue
        v = source_variable(nodes, n.data_in[0][0])
        if v is None or v in roles.apply_op:
            continue
        roles.kind[v] = "trainable"
        roles.apply_op[v] = an
        gi = apply_grad_index[an]
        if gi is not None and gi < len(n.data_in):
            s, i = n.data_in[gi]
            roles.gradient[v] = f"{s}:{i}"
        vshape = _variable_shape(v, nodes, shapes)
        for k in var_arg_idx:
            if k == 0 or k >= len(n.data_in):
                continue
            sv = source_variable(nodes, n.data_in[k][0])
            if sv is None or sv == v:
                continue
            if _variable_shape(sv, nodes, shapes) == vshape:
                roles.slots[v].append(sv)
    _writer_updated_roles(sg, inferred, roles)
    for slots in roles.slots.values():
        for sv in slots:
            if roles.kind.get(sv) != "trainable":
                roles.kind[sv] = "slot"
    return roles


def _writer_updated_roles(sg: StepGraph, inferred: InferredShapes, roles: _Roles) -> None:
    """Trainable weights updated by assign/scatter ops fed by gradients (sparse updates, no apply op)."""
    if not sg.gradient_writers:
        return
    nodes, shapes = sg.nodes, inferred.shapes
    backward = backward_ops(sg)
    feeds_backward = _data_ancestors(nodes, backward)
    claimed = set(roles.apply_op) | {sv for slots in roles.slots.values() for sv in slots}
    writers_of: dict[str, list[str]] = defaultdict(list)
    for w in sorted(sg.gradient_writers, key=lambda x: sg.index.get(x, 0)):
        v = source_variable(nodes, nodes[w].data_in[0][0])
        if v is not None and w in sg.step:
            writers_of[v].append(w)
    for v, writers in writers_of.items():
        if v in claimed or v not in feeds_backward:
            continue
        roles.kind[v] = "trainable"
        roles.apply_op[v] = writers[-1]
        grad = _first_backward_tensor(nodes, writers[-1], backward, inferred)
        if grad is not None:
            roles.gradient[v] = grad
        vshape = _variable_shape(v, nodes, shapes)
        for sv in writers_of:
            if sv == v or sv in claimed or sv in roles.apply_op or sv in feeds_backward:
                continue
            n = nodes[sv].nd
            colocated = "_class" in n.attr and f"loc:@{v}".encode() in n.attr["_class"].list.s
            if (colocated or sv.startswith(v + "/")) and _variable_shape(sv, nodes, shapes) == vshape:
                roles.slots[v].append(sv)
                claimed.add(sv)


def _data_ancestors(nodes: dict[str, Node], ops: set[str]) -> set[str]:
    """Every op whose output reaches one of OPS by data edges (OPS excluded unless reached)."""
    seen: set[str] = set()
    stack = [s for nm in ops for s, _ in nodes[nm].data_in]
    while stack:
        nm = stack.pop()
        if nm not in seen:
            seen.add(nm)
            stack.extend(s for s, _ in nodes[nm].data_in)
    return seen


def _first_backward_tensor(nodes: dict[str, Node], writer: str, backward: set[str],
                           inferred: InferredShapes) -> str | None:
    """Breadth-first from WRITER's inputs (data, and control inputs that order reads after scatters): the
    first floating-point output of a backward op, as "op:index"."""
    seen = {writer}
    frontier = [writer]
    while frontier:
        nxt = []
        for nm in frontier:
            n = nodes[nm]
            for s, i in n.data_in:
                if s in backward and inferred.dtypes.get(s, [""])[i:i + 1] in (["float32"], ["float64"],
                                                                               ["float16"], ["bfloat16"]):
                    return f"{s}:{i}"
            for s in [s for s, _ in n.data_in] + n.ctrl_in:
                if s not in seen:
                    seen.add(s)
                    nxt.append(s)
        frontier = nxt
    return None


def _variable_arg_indices(op_def: Any) -> list[int]:
    """Input indices of an apply op's variable arguments (ref or resource), up to its first list argument."""
    var_arg_idx = []
    idx = 0
    for arg in op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            break
        if arg.is_ref or arg.type == tf.resource.as_datatype_enum:
            var_arg_idx.append(idx)
        idx += 1
    return var_arg_idx
