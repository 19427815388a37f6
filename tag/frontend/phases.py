"""Phases: classify each step op as ``forward``, ``backward`` or ``update``; gradient name scopes.

Why: the strategies treat the three phases differently (data parallelism replicates forward and
backward but synchronises before the update), and the simulator orders ops by phase.

* ``update``: the optimizer's apply ops, the ops they reach, and ops whose consumers are all update ops
  (learning rate, beta powers, slot variables).
* ``backward``: ops under a ``gradients`` or ``gradients_N`` name scope (what ``tf.gradients`` uses);
  failing that, under any scope that holds ``<op>_grad`` scopes (``tf.gradients(name=...)``); failing
  that, ops whose type contains ``Grad`` or ``Backprop`` and the ops they feed.
* ``forward``: the rest.

Example::

    import tag
    from tag.frontend.graph_import import step_graph
    from tag.frontend.phases import forward_op_of, op_phases
    sg = step_graph(tag.zoo.training_graph("mlp", batch_size=8))
    phase = op_phases(sg)                    # op name -> "forward" | "backward" | "update"
    forward_op_of("gradients/dense/MatMul_grad/MatMul", {"dense/MatMul": None})   # "dense/MatMul"
"""
from __future__ import annotations

from typing import Any

from tag.frontend.graph_import import GRAD_SCOPE_RE, StepGraph, in_grad_scope
from tag.frontend.op_rules import is_apply_op

__all__ = ["GRAD_SCOPE_RE", "backward_ops", "context_ops", "forward_op_of", "in_grad_scope", "op_phases"]

def forward_op_of(name: str, nodes: dict[str, Any]) -> str | None:
    """The forward op a ``gradients/<op>_grad/...`` op differentiates, if it is in NODES."""
    parts = name.split("/")
    for i, p in enumerate(parts[:-1]):
        if GRAD_SCOPE_RE.match(p):
            rest = parts[i + 1:-1]
            for j, q in enumerate(rest):
                if q.endswith("_grad"):
                    cand = "/".join(rest[:j] + [q[: -len("_grad")]])
                    if cand in nodes:
                        return cand
            return None
    return None


def context_ops(sg: StepGraph) -> list[str]:
    """Forward ops outside the step whose gradients are in it (the loss's tail: TF1's gradient of a mean
    or a sum reads static shapes, not the op), with their ancestors outside the step, in topological
    order. Their shapes and batch axes tell those gradient ops' batch axes."""
    nodes, step = sg.nodes, sg.step
    seeds = set()
    for nm in sg.order:
        if in_grad_scope(nm):
            fwd = forward_op_of(nm, nodes)
            if fwd is not None and fwd not in step:
                seeds.add(fwd)
    closure: set[str] = set()
    stack = list(seeds)
    while stack:
        nm = stack.pop()
        if nm in closure or nm in step:
            continue
        closure.add(nm)
        stack.extend(s for s, _ in nodes[nm].data_in)
        stack.extend(nodes[nm].ctrl_in)
    order: list[str] = []
    placed: set[str] = set()
    for nm in [nd.name for nd in sg.graph_def.node if nd.name in closure]:   # depth-first, producers first
        _place(nm, nodes, closure, placed, order)
    return order


def _place(nm: str, nodes: dict[str, Any], closure: set[str], placed: set[str], order: list[str]) -> None:
    stack = [(nm, False)]
    while stack:
        x, done = stack.pop()
        if done:
            if x not in placed:
                placed.add(x)
                order.append(x)
            continue
        if x in placed:
            continue
        stack.append((x, True))
        stack.extend((s, False) for s in [s for s, _ in nodes[x].data_in] + nodes[x].ctrl_in
                     if s in closure and s not in placed)


def op_phases(sg: StepGraph) -> dict[str, str]:
    """Op name -> "update", "backward" or "forward" for every step op."""
    backward = backward_ops(sg)
    update = _update_ops(sg, backward)
    return {nm: ("update" if nm in update else "backward" if nm in backward else "forward") for nm in sg.order}


def backward_ops(sg: StepGraph) -> set[str]:
    """The step's backward ops: by gradient scope, else by ``<op>_grad`` scopes, else by op type."""
    order, after = sg.order, sg.after_apply
    backward = {nm for nm in order if in_grad_scope(nm)}
    if not backward:
        backward = _under_grad_op_scopes(order, after)
    if not backward:
        backward = _fed_by_grad_types(sg)
    return backward


def _under_grad_op_scopes(order: list[str], after: set[str]) -> set[str]:
    """tf.gradients(name=...) under another scope: its ops are "<scope>/<forward op>_grad/...";
    every op under such a scope is backward."""
    scopes = set()
    for nm in order:
        parts = nm.split("/")
        for i, p in enumerate(parts[:-1]):
            if p.endswith("_grad") and i > 0:
                scopes.add("/".join(parts[:i]) + "/")
                break
    if not scopes:
        return set()
    return {nm for nm in order if nm not in after and any(nm.startswith(sc) for sc in scopes)}


def _fed_by_grad_types(sg: StepGraph) -> set[str]:
    """Ops of a ``*Grad*``/``*Backprop*`` type (not applies) and every non-update op they feed."""
    nodes, order, after = sg.nodes, sg.order, sg.after_apply
    seeds = [nm for nm in order if ("Grad" in nodes[nm].type or "Backprop" in nodes[nm].type)
             and not is_apply_op(nodes[nm].type) and nm not in after]
    backward = set(seeds)
    for nm in order:
        if nm in backward or nm in after:
            continue
        if any(s in backward for s, _ in nodes[nm].data_in):
            backward.add(nm)
    return backward


def _update_ops(sg: StepGraph, backward: set[str]) -> set[str]:
    """The apply ops, what they reach, and (walking back) ops all of whose step consumers are update ops."""
    update = set(sg.after_apply)
    for nm in reversed(sg.order):
        if nm in update or nm in backward:
            continue
        cons = [c for c in sg.nodes[nm].consumers if c in sg.step]
        if cons and all(c in update for c in cons):
            update.add(nm)
    return update
