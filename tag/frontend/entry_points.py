"""Find what to run in a training GraphDef: the step op, the loss and the initialiser.

The rewriter and the runtime need three names: the op that runs one optimizer step, the loss tensor
(for reporting and for weighting the replicas' gradient seeds), and the op that initialises every
variable. The zoo names them ``train_op``, ``loss`` and ``init``; a user's graph usually does not
(``tf.compat.v1.train.AdamOptimizer(...).minimize(loss)`` returns a NoOp named ``Adam``). This module
finds them in any TF1 training graph; names given explicitly always win.

Example::

    from tag.frontend.entry_points import find_entry_points
    ep = find_entry_points(graph_def)                  # EntryPoints(train_op='Adam', loss='Mean', init='init')
    ep = find_entry_points(graph_def, loss="my_loss")  # explicit names win (checked to exist)
    graph_def = ep.apply(graph_def)                    # adds the NoOps it had to make up, if any

The rules:

* **Step op.** The optimizer's apply ops (``ApplyAdam``, ``ResourceApplyGradientDescent``, ...) and
  the ops that group them: ``NoOp`` (``minimize()``/``apply_gradients()``/``tf.group``), ``AssignAdd``
  and ``AssignAddVariableOp`` (``minimize(global_step=...)`` returns the global-step increment). A
  grouping op that no other grouping op depends on and that depends on every apply op is the step op.
  Two or more of them, or several that each run only part of the updates (two optimizers), are
  ambiguous: GraphError lists them and says to pass ``train_op=``. A graph with one apply op and no
  grouping op runs that apply op. A graph with one apply op per variable and nothing grouping them
  gets a made-up ``NoOp`` named ``tag_train_op`` that depends on every update op no other update op
  depends on (``EntryPoints.added``; ``apply`` puts it into a graph).
* **Loss.** A TF1 gradient starts from a seed: ``gradients/grad_ys_N`` (older TF: ``gradients/Fill``),
  a Fill of ones shaped like the loss. Where that shape is computed (``gradients/Shape`` is a ``Shape``
  op), its input is the loss. Otherwise the seed's consumers sit in ``gradients/<op>_grad/`` scopes,
  which name the forward ops the seed flows into (more than one where gradients pass through, e.g. an
  ``AddN`` of loss terms); the loss is their first common forward descendant, followed through
  ``Identity`` ops (``tf.identity(mean, name="loss")``). Without a seed (``grad_ys`` given by the
  user) the last forward op with a gradient scope is taken. Only seeds the step op depends on count;
  two different losses raise GraphError asking for ``loss=``. No gradient at all: ``loss`` is None.
* **Initialiser.** The variables the step uses and their initial assignments (``Assign`` /
  ``AssignVariableOp`` on the variable that the step does not run and that do not restore a checkpoint;
  ``<var>/Assign`` preferred). A ``NoOp`` depending on all of them and on no optimizer update
  (``init`` preferred, then one no other such NoOp depends on) is the initialiser; else a single
  initial assignment is; else a made-up ``NoOp`` named ``tag_init`` groups them. No variables:
  ``init`` is None.
"""
from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from tag.errors import GraphError
from tag.frontend.graph_import import coerce_graph_def, step_order, wire_nodes
from tag.frontend.op_rules import is_apply_op
from tag.ir.op_types import INITIALIZER_TYPES, VARIABLE_TYPES

__all__ = ["EntryPoints", "find_entry_points"]

#: op types that group optimizer updates (minimize() returns a NoOp, or the global-step increment)
GROUPING_TYPES = frozenset({"NoOp", "AssignAdd", "AssignAddVariableOp"})
#: op types a loss may pass through unchanged after its last op with a gradient
_PASSTHROUGH_TYPES = frozenset({"Identity", "Snapshot"})
_RESTORE_TYPES = frozenset({"RestoreV2", "Restore", "RestoreSlice"})
_SEED_RE = re.compile(r"(?:^|/)(?:grad_ys_\d+|gradients(?:_\d+)?/Fill)$")
_GRAD_SCOPE_RE = re.compile(r"(?:^|/)gradients(?:_\d+)?/(.+?)_grad/")
_IN_GRADIENTS_RE = re.compile(r"(?:^|/)gradients(?:_\d+)?/")
MADE_UP_TRAIN_OP = "tag_train_op"
MADE_UP_INIT = "tag_init"


@dataclass(frozen=True)
class EntryPoints:
    """Op names to run a training step by (module docstring).

    ``train_op``: one optimizer step. ``loss``: the loss op (output 0), or None when the graph has no
    gradient. ``init``: initialises every variable the step uses, or None without variables.
    ``added``: NodeDefs this search made up (a NoOp grouping updates or initialisers) that the graph
    needs before those names run; ``apply(graph_def)`` adds them. ``notes``: how each name was found.
    """

    train_op: str
    loss: str | None
    init: str | None
    added: tuple[Any, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def apply(self, graph_def: Any) -> Any:
        """GRAPH_DEF with the made-up nodes added (a copy), or GRAPH_DEF itself when there are none."""
        have = {n.name for n in graph_def.node}
        missing = [n for n in self.added if n.name not in have]
        if not missing:
            return graph_def
        out = copy.deepcopy(graph_def)
        out.node.extend(missing)
        return out


class _Index:
    """A GraphDef's nodes (``graph_import.wire_nodes``) with data consumers and a topological order."""

    def __init__(self, graph_def: Any):
        wired = wire_nodes(graph_def)
        self.nodes: dict[str, Any] = {name: n.nd for name, n in wired.items()}
        self.data_in: dict[str, list[tuple[str, int]]] = {name: n.data_in for name, n in wired.items()}
        self.all_in: dict[str, list[str]] = {name: [s for s, _ in n.data_in] + n.ctrl_in
                                              for name, n in wired.items()}
        self.consumers: dict[str, list[str]] = {name: [] for name in wired}     # by data edges
        for name, n in wired.items():
            for src in dict.fromkeys(s for s, _ in n.data_in):
                self.consumers[src].append(name)
        self.order = step_order(graph_def, wired, set(wired))    # TF1 loops' back edges are skipped
        self.position = {name: i for i, name in enumerate(self.order)}

    def ancestor_masks(self, targets: list[str]) -> dict[str, int]:
        """Per node, a bit mask of the TARGETS it depends on (itself included), data and control edges."""
        bit = {t: 1 << i for i, t in enumerate(targets)}
        masks: dict[str, int] = {}
        for name in self.order:
            m = bit.get(name, 0)
            for s in self.all_in[name]:
                m |= masks.get(s, 0)
            masks[name] = m
        return masks

    def ancestors(self, name: str) -> set[str]:
        """NAME and every node it depends on (data and control)."""
        seen, stack = {name}, [name]
        while stack:
            for s in self.all_in[stack.pop()]:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return seen

    def update_masks(self) -> tuple[list[str], dict[str, int]]:
        """(the optimizer's apply ops, per node the mask of those it depends on); computed once."""
        if not hasattr(self, "_updates"):
            applies = [n for n in self.order if is_apply_op(self.nodes[n].op)]
            self._updates = (applies, self.ancestor_masks(applies))
        return self._updates

    def fresh_name(self, base: str) -> str:
        name, k = base, 0
        while name in self.nodes:
            k += 1
            name = f"{base}_{k}"
        return name


def _sinks(index: _Index, names: list[str]) -> list[str]:
    """The NAMES no other of NAMES depends on (graph order)."""
    masks = index.ancestor_masks(names)
    covered = 0
    for i, n in enumerate(names):
        covered |= masks[n] & ~(1 << i)
    return [n for i, n in enumerate(names) if not covered >> i & 1]


def _no_op(name: str, control: Iterable[str]) -> Any:
    from tensorflow.core.framework import node_def_pb2
    node = node_def_pb2.NodeDef(name=name, op="NoOp")
    node.input.extend("^" + c for c in control)
    return node


def _check_name(index: _Index, param: str, name: str) -> str:
    """NAME (an op, or 'op:0') checked to exist; GraphError with close matches otherwise."""
    op = name[:-2] if name.endswith(":0") else name
    if op not in index.nodes:
        close = difflib.get_close_matches(op, list(index.nodes), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise GraphError(f"{param}={name!r} is not an op of the graph{hint}")
    return op


# ------------------------------------------------------------------------------------------------ step op
def _find_train_op(index: _Index) -> tuple[str, list[Any], str]:
    """(step op name, made-up nodes, note)."""
    applies, masks = index.update_masks()
    if not applies:
        raise GraphError("graph has no optimizer: no Apply*/ResourceApply* op found (is this a training step?)")
    every = (1 << len(applies)) - 1
    grouping = [n for n in index.order if index.nodes[n].op in GROUPING_TYPES and masks[n]]
    sinks = _sinks(index, grouping)
    complete = [n for n in sinks if masks[n] == every]
    if len(complete) == 1 and len(sinks) == 1:
        return complete[0], [], f"train_op {complete[0]!r}: the op grouping every optimizer update"
    if sinks:
        parts = ", ".join(f"{n!r} ({bin(masks[n]).count('1')} of {len(applies)} updates)" for n in sinks)
        raise GraphError(f"the graph has {len(sinks)} candidate train ops: {parts}; pass train_op=NAME "
                         f"(tag-deploy --train-op NAME) to say which one runs a training step")
    update_sinks = _sinks(index, [n for n in index.order if masks[n]])
    if len(update_sinks) == 1:
        return update_sinks[0], [], f"train_op {update_sinks[0]!r}: the only optimizer update"
    name = index.fresh_name(MADE_UP_TRAIN_OP)
    return name, [_no_op(name, update_sinks)], (
        f"train_op {name!r}: made up, a NoOp grouping the graph's {len(update_sinks)} update ops (nothing "
        f"grouped them)")


# ------------------------------------------------------------------------------------------------ loss
def _forward_descendants(index: _Index, start: str) -> set[str]:
    """START and the ops its outputs reach by data edges outside gradient scopes."""
    seen, stack = {start}, [start]
    while stack:
        for c in index.consumers[stack.pop()]:
            if c not in seen and not _IN_GRADIENTS_RE.search(c) and not is_apply_op(index.nodes[c].op):
                seen.add(c)
                stack.append(c)
    return seen


def _follow_identities(index: _Index, name: str) -> str:
    """Follow NAME through Identity ops while it is their only forward consumer's input."""
    for _ in range(64):
        forward = [c for c in index.consumers[name] if not _IN_GRADIENTS_RE.search(c)]
        if len(forward) != 1 or index.nodes[forward[0]].op not in _PASSTHROUGH_TYPES:
            return name
        name = forward[0]
    return name


def _scoped_op(index: _Index, name: str) -> str | None:
    """The forward op whose gradient NAME belongs to (``gradients/<op>_grad/...``), if in the graph."""
    m = _GRAD_SCOPE_RE.search(name)
    return m.group(1) if m is not None and m.group(1) in index.nodes else None


def _loss_of_seed(index: _Index, seed: str) -> str | None:
    """The loss op a gradient seed (a Fill of ones) was made for."""
    shape_src = index.data_in[seed][0][0] if index.data_in[seed] else None
    if shape_src is not None and index.nodes[shape_src].op == "Shape" and index.data_in[shape_src]:
        return _follow_identities(index, index.data_in[shape_src][0][0])
    heads = sorted({op for c in index.consumers[seed] if (op := _scoped_op(index, c)) is not None},
                   key=index.position.get)
    if not heads:
        return None
    common = _forward_descendants(index, heads[0])
    for h in heads[1:]:
        common &= _forward_descendants(index, h)
    if not common:
        return None
    return _follow_identities(index, min(common, key=index.position.get))


def _find_loss(index: _Index, step: set[str]) -> tuple[str | None, str]:
    """(loss op or None, note), from the gradient seeds the step op depends on."""
    seeds = [n for n in index.order if n in step and index.nodes[n].op == "Fill" and _SEED_RE.search(n)]
    losses = []
    for s in seeds:
        loss = _loss_of_seed(index, s)
        if loss is not None and loss not in losses:
            losses.append(loss)
    if len(losses) > 1:
        raise GraphError(f"the train op follows the gradients of {len(losses)} losses: "
                         f"{', '.join(repr(x) for x in losses)}; pass loss=NAME "
                         f"(tag-deploy --loss NAME) to say which one to report")
    if losses:
        return losses[0], f"loss {losses[0]!r}: where the gradient seed {seeds[0]!r} starts"
    heads = {op for n in step if (op := _scoped_op(index, n)) is not None and not _IN_GRADIENTS_RE.search(op)}
    if heads:
        last = max(heads, key=index.position.get)
        loss = _follow_identities(index, last)
        return loss, f"loss {loss!r}: no gradient seed found, the last op with a gradient"
    return None, "no loss: the step computes no gradient (tf.gradients) the search could find"


# ------------------------------------------------------------------------------------------------ init
def _initializers(index: _Index, step: set[str]) -> tuple[list[str], list[str]]:
    """(initial assignments of the step's variables, variables without one)."""
    restoring = {n for n in index.nodes if index.nodes[n].op in _RESTORE_TYPES}
    restored = index.ancestor_masks(sorted(restoring)) if restoring else {}
    found, missing = [], []
    for var in (n for n in index.order if n in step and index.nodes[n].op in VARIABLE_TYPES):
        assigns = [c for c in index.consumers[var]
                   if index.nodes[c].op in INITIALIZER_TYPES and c not in step and not restored.get(c, 0)
                   and index.data_in[c] and index.data_in[c][0][0] == var]
        if not assigns:
            missing.append(var)
            continue
        preferred = [a for a in assigns if a == f"{var}/Assign"]
        found.append((preferred or assigns)[0])
    return found, missing


def _find_init(index: _Index, step: set[str]) -> tuple[str | None, list[Any], str]:
    """(initialiser op or None, made-up nodes, note)."""
    inits, missing = _initializers(index, step)
    gap = f"; no initial value found for {', '.join(repr(v) for v in missing[:3])}" if missing else ""
    if not inits:
        return None, [], "no init: the step uses no variable with an initial assignment" + gap
    masks = index.ancestor_masks(inits)
    every = (1 << len(inits)) - 1
    _, updates = index.update_masks()        # an initialiser must not run an optimizer step
    groups = [n for n in index.order if index.nodes[n].op == "NoOp" and masks[n] == every and not updates[n]]
    if groups:
        pick = "init" if "init" in groups else _sinks(index, groups)[0]
        return pick, [], f"init {pick!r}: groups the initial values of the step's {len(inits)} variables" + gap
    if len(inits) == 1:
        return inits[0], [], f"init {inits[0]!r}: the initial value of the step's only variable" + gap
    name = index.fresh_name(MADE_UP_INIT)
    return name, [_no_op(name, inits)], (
        f"init {name!r}: made up, a NoOp grouping the initial values of {len(inits)} variables" + gap)


def find_entry_points(graph_def: Any, *, train_op: str | None = None, loss: str | None = None,
                      init: str | None = None) -> EntryPoints:
    """The step op, loss and initialiser of GRAPH_DEF (a GraphDef, tf.Graph or its bytes; rules in the
    module docstring).

    Names given explicitly win (checked to exist; ``"op:0"`` is accepted for an op). Raises GraphError
    for a graph without optimizer, with two candidate step ops or two losses (the message lists the
    candidates and the parameter to pass), or naming an op that is not in the graph.
    """
    index = _Index(coerce_graph_def(graph_def))
    added: list[Any] = []
    notes: list[str] = []
    if train_op is not None:
        train_op = _check_name(index, "train_op", train_op)
        notes.append(f"train_op {train_op!r}: given")
    else:
        train_op, made, note = _find_train_op(index)
        added += made
        notes.append(note)
    step = set()
    for root in ([train_op] if not added else [s.lstrip("^") for s in added[0].input]):
        step |= index.ancestors(root)
    if loss is not None:
        loss = _check_name(index, "loss", loss)
        notes.append(f"loss {loss!r}: given")
    else:
        loss, note = _find_loss(index, step)
        notes.append(note)
    if init is not None:
        init = _check_name(index, "init", init)
        notes.append(f"init {init!r}: given")
    else:
        init, made, note = _find_init(index, step)
        added += made
        notes.append(note)
    return EntryPoints(train_op, loss, init, tuple(added), tuple(notes))
