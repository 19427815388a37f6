"""Per-group model parallelism: split ONE op group's ops over the devices of a placement.

``partition_group(...)`` returns the op -> device map that ``Strategy.partition`` needs for a group whose
action is ``mode="partition"``. How the split is made:

1. Every op of the group is *anchored* to a forward op of the group: a forward op to itself, a gradient op
   (``gradients/<fwd>_grad/...``) to the forward op it differentiates, anything else (optimizer updates,
   their slots, unnamed gradient plumbing) to the anchor of its first producer inside the group, else to the
   first forward op. A forward op's backward work therefore runs where its activations already are.
2. Anchors that share a colocation set (a variable with its reads and updates) become one unit, so the
   rewriter's colocation constraints hold.
3. Units, in topological order of their first op, are cut into contiguous stages, one per device of the
   placement (devices in index order, so neighbouring stages mostly share a host), by the same minimax
   linear partition the whole-graph ``partition`` baseline uses: a stage costs its units' compute time on
   its device (cost-model op times at the full batch, forward + backward + update) plus the time to send
   the bytes that cross its outgoing cut. Ties go to the smaller total, which prefers cutting few bytes.
   Stages that would not fit their device's memory are ruled out unless no split fits.

Example::

    from tag.strategy.partition import partition_group
    device_of_op = partition_group(tg, topo, cost_model, grouping.members(7), devices=[0, 1, 2, 3])
    # {op index: device index} for every op of group 7
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.ir.algorithms import UnionFind, topological_order

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.cost.model import CostModel
    from tag.ir.types import TrainingGraph

_GRADIENT_OF = re.compile(r"^gradients(?:_\d+)?/(.+?)_grad/")


def partition_group(graph: "TrainingGraph", topology: "Topology", cost_model: "CostModel",
                    ops: Sequence[int], devices: Sequence[int], batch: int | None = None,
                    op_position: np.ndarray | None = None) -> dict[int, int]:
    """Device of every op in OPS (one op group) when the group is partitioned over DEVICES.

    ``op_position`` (position of each op in ``topological_order(graph)``) may be passed to save its
    computation when many groups are partitioned. Returns {op index: device index}.
    """
    ops = [int(i) for i in ops]
    devices = [int(d) for d in devices]
    if not ops:
        return {}
    if len(devices) == 1:
        return {i: devices[0] for i in ops}
    if op_position is None:
        order = topological_order(graph)
        op_position = np.empty(len(order), dtype=np.int64)
        op_position[order] = np.arange(len(order))
    batch = int(graph.batch_size if batch is None else batch)
    ops.sort(key=lambda i: int(op_position[i]))
    unit_of_op, units = _units(graph, ops)
    n_units = len(units)
    if n_units == 1:
        return {i: devices[0] for i in ops}

    # compute time of each unit (in unit order) on each device group, as prefix sums
    unit_index = np.array([unit_of_op[i] for i in ops], dtype=np.int64)
    op_array = np.array(ops, dtype=np.int64)
    prefix = {}
    for dg in {topology.devices[d].group for d in devices}:
        per_unit = np.bincount(unit_index, weights=np.asarray(cost_model.op_times(dg, batch))[op_array],
                               minlength=n_units)
        prefix[dg] = np.concatenate([[0.0], np.cumsum(per_unit)])
    held = np.zeros(n_units)           # rough bytes a unit keeps on its device (variables, activations)
    for v in graph.variables:
        if v.op in unit_of_op:
            held[unit_of_op[v.op]] += v.nbytes * (2 if v.kind == "trainable" else 1) + v.slot_bytes
    for i in ops:
        if graph.ops[i].phase == "forward":
            held[unit_of_op[i]] += sum(t.nbytes.at(batch) for t in graph.ops[i].outputs)
    held_prefix = np.concatenate([[0.0], np.cumsum(held)])
    diff = np.zeros(n_units + 1)       # bytes crossing the cut after each unit position
    for e in graph.edges:
        a, b = unit_of_op.get(e.src), unit_of_op.get(e.dst)
        if a is not None and b is not None and a != b:
            nbytes = e.nbytes.at(batch)
            diff[min(a, b)] += nbytes
            diff[max(a, b)] -= nbytes
    cut_bytes = np.cumsum(diff)[:n_units]

    from tag.strategy.baselines import linear_partition
    device_of_unit = linear_partition(topology, devices, n_units, prefix, cut_bytes, held_prefix, True)
    if device_of_unit is None:
        device_of_unit = linear_partition(topology, devices, n_units, prefix, cut_bytes, held_prefix, False)
    return {i: int(device_of_unit[unit_of_op[i]]) for i in ops}


def _units(graph: "TrainingGraph", ops: list[int]) -> tuple[dict[int, int], list[int]]:
    """Anchor OPS (topologically sorted) to forward ops and merge colocated anchors.

    Returns ({op: unit index}, [first op of each unit]), units numbered in order of their first op.
    """
    index = graph.op_index
    members = set(ops)
    anchor: dict[int, int] = {}        # op -> the forward op it follows
    forward = [i for i in ops if graph.ops[i].phase == "forward"]
    first_forward = forward[0] if forward else ops[0]
    for i in forward:
        anchor[i] = i
    producers: dict[int, list[int]] = {}
    for e in graph.edges:
        if e.dst in members and e.src in members:
            producers.setdefault(e.dst, []).append(e.src)
    for i in ops:
        if i in anchor:
            continue
        m = _GRADIENT_OF.match(graph.ops[i].name)
        fwd = index.get(m.group(1)) if m else None
        if fwd is not None and fwd in anchor and anchor[fwd] == fwd:
            anchor[i] = fwd
            continue
        anchored = [anchor[p] for p in producers.get(i, []) if p in anchor]
        anchor[i] = anchored[0] if anchored else first_forward
    # colocation: every op of a set follows the set's first anchor (by position)
    position = {op: k for k, op in enumerate(ops)}
    sets = UnionFind(len(ops))
    for names in graph.colocation:
        inside = [position[anchor[index[n]]] for n in names if n in index and index[n] in members]
        for k in inside[1:]:
            sets.union(inside[0], k)
    unit_first: dict[int, int] = {}    # root position -> unit index
    unit_of_op: dict[int, int] = {}
    units: list[int] = []
    for i in ops:                       # topological order, so units are numbered by first appearance
        root = sets.find(position[anchor[i]])
        u = unit_first.get(root)
        if u is None:
            u = unit_first[root] = len(units)
            units.append(i)
        unit_of_op[i] = u
    return unit_of_op, units
