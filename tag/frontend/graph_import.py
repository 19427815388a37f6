"""GraphDef intake: coerce the user's graph, wire its nodes, find the ops of one training step, order them.

Why a module of its own: everything later (shapes, batch axes, phases, costs) works on the same
name-keyed view of the GraphDef built here -- every node with its data inputs, control inputs and
consumers -- restricted to the *step*: the optimizer's apply ops, every op they reach, and all data
and control ancestors of those (initializers, savers and summaries fall away).

Example::

    import tag
    from tag.frontend.graph_import import coerce_graph_def, step_graph
    gd = coerce_graph_def(tag.zoo.training_graph("mlp", batch_size=8))
    sg = step_graph(gd)
    sg.order[:3], len(sg.step), sg.apply_ops[:1]
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from tag.errors import GraphError
from tag.frontend.op_rules import is_apply_op
from tag.ir.op_types import VARIABLE_TYPES, VARIABLE_WRITE_TYPES

__all__ = ["GRAD_SCOPE_RE", "Node", "StepGraph", "coerce_graph_def", "first_line", "gradient_writers",
           "import_graph_def", "in_grad_scope", "parse_input", "pruned_graph_def", "step_graph", "wire_nodes"]

#: the name scope tf.gradients puts gradient ops under: "gradients", "gradients_1", ...
GRAD_SCOPE_RE = re.compile(r"^gradients(_\d+)?$")
#: ops a variable passes through unchanged (TF1 ref variables, loop frames)
_VARIABLE_PASS_THROUGH = ("Identity", "Enter", "RefEnter", "RefIdentity")


def in_grad_scope(name: str) -> bool:
    """True when op NAME sits under a ``gradients``/``gradients_N`` name scope."""
    parts = name.split("/")[:-1]
    return any(GRAD_SCOPE_RE.match(p) for p in parts)

#: NextIteration ops close TF1 while loops; their out-edges are ignored when ordering the step
_BACK_EDGE_TYPES = ("NextIteration", "RefNextIteration")


def first_line(err: BaseException) -> str:
    """The first line of an error's message (at most 400 characters), for one-line GraphErrors."""
    text = str(err).strip().splitlines()
    return text[0][:400] if text else type(err).__name__


def parse_input(s: str) -> tuple[str, int, bool]:
    """GraphDef input string -> (producer op, output index, is_control)."""
    if s.startswith("^"):
        return s[1:], -1, True
    name, sep, idx = s.rpartition(":")
    if sep and idx.isdigit():
        return name, int(idx), False
    return s, 0, False


class Node:
    """One GraphDef node with its wiring by name."""

    __slots__ = ("nd", "name", "type", "data_in", "ctrl_in", "consumers")

    def __init__(self, nd: Any):
        self.nd = nd                                 # the NodeDef
        self.name: str = nd.name
        self.type: str = nd.op
        self.data_in: list[tuple[str, int]] = []     # (producer op, output index) per data input
        self.ctrl_in: list[str] = []                 # control-input producers
        self.consumers: set[str] = set()             # ops that read any output of this one (data or control)


def coerce_graph_def(graph_def: Any) -> Any:
    """A tf.compat.v1.GraphDef from a GraphDef, a tf.Graph or serialized GraphDef bytes."""
    if isinstance(graph_def, tf.Graph):
        return graph_def.as_graph_def()
    if isinstance(graph_def, tf.compat.v1.GraphDef):
        return graph_def
    if isinstance(graph_def, (bytes, bytearray)):
        gd = tf.compat.v1.GraphDef()
        try:
            gd.ParseFromString(bytes(graph_def))
        except Exception as err:  # noqa: BLE001
            raise GraphError(f"cannot parse the GraphDef bytes: {first_line(err)}") from None
        return gd
    raise GraphError(f"tag needs a tf.compat.v1.GraphDef (or a tf.Graph, or serialized GraphDef bytes), "
                     f"got {type(graph_def).__name__}")


def wire_nodes(gd: Any) -> dict[str, Node]:
    """Every node of GD by name, with its data inputs, control inputs and consumers."""
    nodes: dict[str, Node] = {}
    for nd in gd.node:
        if nd.name in nodes:
            raise GraphError(f"graph has two nodes named '{nd.name}'")
        nodes[nd.name] = Node(nd)
    for n in nodes.values():
        for s in n.nd.input:
            src, idx, ctrl = parse_input(s)
            if src not in nodes:
                raise GraphError(f"node '{n.name}' has input '{s}' that is not in the graph")
            if ctrl:
                n.ctrl_in.append(src)
            else:
                n.data_in.append((src, idx))
            nodes[src].consumers.add(n.name)
    return nodes


@dataclass
class StepGraph:
    """The wired GraphDef and the ops of one training step, in topological order."""

    graph_def: Any                  # the GraphDef analysed
    nodes: dict[str, Node]          # every node of the GraphDef by name
    apply_ops: list[str]            # the optimizer's apply ops, in GraphDef order
    after_apply: set[str]           # the apply ops and every op they reach (train_op, beta-power updates)
    step: set[str]                  # after_apply and all their data and control ancestors
    # variable writes (assign/scatter) that gradients feed: sparse updates without an apply op, and the
    # slot and bookkeeping updates around them, in GraphDef order
    gradient_writers: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)      # the step's ops in topological order
    index: dict[str, int] = field(default_factory=dict)  # op name -> position in ``order`` (its IR index)


def step_graph(gd: Any) -> StepGraph:
    """Wire GD and find its training step; raises GraphError when it has no optimizer apply op."""
    nodes = wire_nodes(gd)
    apply_ops = [n.name for n in nodes.values() if is_apply_op(n.type)]
    writers = gradient_writers(nodes)
    if not apply_ops and not writers:
        raise GraphError("graph has no optimizer: no Apply*/ResourceApply* op and no variable update fed by "
                         "gradients found (is this a training step?)")
    after = _reached_from(nodes, apply_ops + writers)
    step = _ancestors_of(nodes, after)
    sg = StepGraph(graph_def=gd, nodes=nodes, apply_ops=apply_ops, after_apply=after, step=step,
                   gradient_writers=writers)
    sg.order = step_order(gd, nodes, step)
    sg.index = {nm: i for i, nm in enumerate(sg.order)}
    return sg


def gradient_writers(nodes: dict[str, Node]) -> list[str]:
    """Variable writes (assign/scatter ops on a variable) downstream of a gradient op (data or control):
    how TF1 optimizers update weights from IndexedSlices gradients, with no apply op."""
    seeds = [nm for nm, n in nodes.items() if in_grad_scope(nm) or (
        ("Grad" in n.type or "Backprop" in n.type) and not is_apply_op(n.type))]
    reached = _reached_from(nodes, seeds)
    return [nm for nm, n in nodes.items() if nm in reached and n.type in VARIABLE_WRITE_TYPES and n.data_in
            and _writes_variable(nodes, n.data_in[0][0])]


def _writes_variable(nodes: dict[str, Node], src: str) -> bool:
    for _ in range(8):
        n = nodes[src]
        if n.type in VARIABLE_TYPES:
            return True
        if n.type not in _VARIABLE_PASS_THROUGH or not n.data_in:
            return False
        src = n.data_in[0][0]
    return False


def _reached_from(nodes: dict[str, Node], starts: list[str]) -> set[str]:
    """STARTS and every op downstream of them (data or control)."""
    reached: set[str] = set(starts)
    stack = list(starts)
    while stack:
        for c in nodes[stack.pop()].consumers:
            if c not in reached:
                reached.add(c)
                stack.append(c)
    return reached


def _ancestors_of(nodes: dict[str, Node], ops: set[str]) -> set[str]:
    """OPS and all their data and control ancestors."""
    closure: set[str] = set(ops)
    stack = list(ops)
    while stack:
        n = nodes[stack.pop()]
        for src in [s for s, _ in n.data_in] + n.ctrl_in:
            if src not in closure:
                closure.add(src)
                stack.append(src)
    return closure


def step_order(gd: Any, nodes: dict[str, Node], step: set[str]) -> list[str]:
    """The STEP ops in topological order, ties broken by GraphDef position; ops on a cycle (TF1 while
    loops) keep graph order at the end."""
    indeg: dict[str, int] = {}
    for nm in step:
        n = nodes[nm]
        deps = {s for s, _ in n.data_in if nodes[s].type not in _BACK_EDGE_TYPES}
        deps.update(n.ctrl_in)
        indeg[nm] = len(deps)
    # Kahn's algorithm, ties broken by GraphDef position (consumers is a set: each pair counts once)
    order: list[str] = []
    pos = {nd.name: i for i, nd in enumerate(gd.node)}
    heap = [(pos[nm], nm) for nm in step if indeg[nm] == 0]
    heapq.heapify(heap)
    while heap:
        _, nm = heapq.heappop(heap)
        order.append(nm)
        if nodes[nm].type in _BACK_EDGE_TYPES:
            continue
        for c in nodes[nm].consumers:
            if c in indeg:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, (pos[c], c))
    if len(order) < len(step):  # cycles (TF1 while loops): keep graph order for the rest
        placed = set(order)
        order.extend(nd.name for nd in gd.node if nd.name in step and nd.name not in placed)
    return order


def pruned_graph_def(gd: Any, step: set[str]) -> Any:
    """A GraphDef of the STEP ops only (same versions and function library)."""
    base = tf.compat.v1.GraphDef()
    base.versions.CopyFrom(gd.versions)
    base.library.CopyFrom(gd.library)
    base.node.extend(nd for nd in gd.node if nd.name in step)
    for nd in base.node:  # colocation with ops outside the step (e.g. the loss) would fail the import
        if "_class" in nd.attr:
            keep = [c for c in nd.attr["_class"].list.s
                    if not c.startswith(b"loc:@") or c[5:].decode(errors="replace") in step]
            if len(keep) != len(nd.attr["_class"].list.s):
                if keep:
                    del nd.attr["_class"].list.s[:]
                    nd.attr["_class"].list.s.extend(keep)
                else:
                    del nd.attr["_class"]
    return base


def import_graph_def(gd: Any) -> tf.Graph:
    """Import GD into a fresh graph: TensorFlow's shape inference runs on every op."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(gd, name="")
    return g
