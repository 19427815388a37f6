"""Per-group model parallelism: split ONE op group's ops over the devices of a placement.

``GroupPartitioner.split(group, devices)`` returns the op -> device map that ``Strategy.partition`` needs
for a group whose action is ``mode="partition"``. How the split is made:

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

    from tag.strategy.partition import GroupPartitioner
    partitioner = GroupPartitioner(tg, topo, cost_model, grouping.group_of_op)
    device_of_op = partitioner.split(7, devices=[0, 1, 2, 3])   # {op index: device} for every op of group 7
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.ir.algorithms import UnionFind, topological_order
from tag.strategy.baselines import linear_partition

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.cost.model import CostModel
    from tag.ir.types import TrainingGraph

_GRADIENT_OF = re.compile(r"^gradients(?:_\d+)?/(.+?)_grad/")


class GroupPartitioner:
    """Per-group partition maps for one graph, grouping and batch; what does not depend on the devices
    (units, internal edges, held bytes) is computed once per group and cached."""

    def __init__(self, graph: "TrainingGraph", topology: "Topology", cost_model: "CostModel",
                 group_of_op: Sequence[int], batch: int | None = None):
        self.graph, self.topology, self.cost_model = graph, topology, cost_model
        self.batch = int(graph.batch_size if batch is None else batch)
        self.group_of_op = np.asarray(group_of_op, dtype=np.int64)
        order = topological_order(graph)
        self.op_position = np.empty(len(order), dtype=np.int64)
        self.op_position[order] = np.arange(len(order))
        # group -> [(src op, dst op, bytes)] of the data edges inside the group
        self._internal_edges: dict[int, list[tuple[int, int, float]]] = {}
        for e in graph.edges:
            g = int(self.group_of_op[e.src])
            if g == int(self.group_of_op[e.dst]):
                self._internal_edges.setdefault(g, []).append((e.src, e.dst, e.nbytes.at(self.batch)))
        # op -> index of its colocation set
        index = graph.op_index
        self._colocation_of: dict[int, int] = {}
        for s, names in enumerate(graph.colocation):
            for n in names:
                if n in index:
                    self._colocation_of[index[n]] = s
        self._units_cache: dict[int, tuple] = {}

    def _group_units(self, group: int) -> tuple:
        """(ops in topological order, {op: unit}, unit index per op, held bytes per unit, cut bytes)."""
        cached = self._units_cache.get(group)
        if cached is not None:
            return cached
        graph = self.graph
        ops = sorted((int(i) for i in np.flatnonzero(self.group_of_op == group)),
                     key=lambda i: int(self.op_position[i]))
        edges = self._internal_edges.get(group, [])
        unit_of_op, n_units = _units(graph, ops, edges, self._colocation_of)
        held = np.zeros(n_units)           # rough bytes a unit keeps on its device (variables, activations)
        for v in graph.variables:
            if v.op in unit_of_op:
                held[unit_of_op[v.op]] += v.nbytes * (2 if v.kind == "trainable" else 1) + v.slot_bytes
        for i in ops:
            if graph.ops[i].phase == "forward":
                held[unit_of_op[i]] += sum(t.nbytes.at(self.batch) for t in graph.ops[i].outputs)
        diff = np.zeros(n_units + 1)       # bytes crossing the cut after each unit position
        for src, dst, nbytes in edges:
            a, b = unit_of_op[src], unit_of_op[dst]
            if a != b:
                diff[min(a, b)] += nbytes
                diff[max(a, b)] -= nbytes
        unit_index = np.array([unit_of_op[i] for i in ops], dtype=np.int64)
        cached = (ops, unit_of_op, unit_index, np.concatenate([[0.0], np.cumsum(held)]), np.cumsum(diff)[:n_units])
        self._units_cache[group] = cached
        return cached

    def split(self, group: int, devices: Sequence[int]) -> dict[int, int]:
        """Device of every op of GROUP when the group is partitioned over DEVICES: {op index: device}."""
        ops, unit_of_op, unit_index, held_prefix, cut_bytes = self._group_units(group)
        devices = [int(d) for d in devices]
        n_units = len(cut_bytes)
        if not ops:
            return {}
        if len(devices) == 1 or n_units == 1:
            return {i: devices[0] for i in ops}
        op_array = np.array(ops, dtype=np.int64)
        prefix = {}                        # device group -> prefix sums of unit compute time
        for dg in {self.topology.devices[d].group for d in devices}:
            times = np.asarray(self.cost_model.op_times(dg, self.batch))[op_array]
            prefix[dg] = np.concatenate([[0.0], np.cumsum(np.bincount(unit_index, weights=times,
                                                                      minlength=n_units))])
        device_of_unit = linear_partition(self.topology, devices, n_units, prefix, cut_bytes, held_prefix, True)
        if device_of_unit is None:
            device_of_unit = linear_partition(self.topology, devices, n_units, prefix, cut_bytes, held_prefix,
                                              False)
        return {i: int(device_of_unit[unit_of_op[i]]) for i in ops}


def partition_group(graph: "TrainingGraph", topology: "Topology", cost_model: "CostModel",
                    group_of_op: Sequence[int], group: int, devices: Sequence[int],
                    batch: int | None = None) -> dict[int, int]:
    """Device of every op of GROUP when it is partitioned over DEVICES (one-off; searches keep a
    ``GroupPartitioner``)."""
    return GroupPartitioner(graph, topology, cost_model, group_of_op, batch).split(group, devices)


def _units(graph: "TrainingGraph", ops: list[int], edges: list[tuple[int, int, float]],
           colocation_of: dict[int, int]) -> tuple[dict[int, int], int]:
    """Anchor OPS (topologically sorted) to forward ops and merge colocated anchors.

    Returns ({op: unit index}, number of units), units numbered in order of their first op.
    """
    index = graph.op_index
    anchor: dict[int, int] = {}        # op -> the forward op it follows
    forward = [i for i in ops if graph.ops[i].phase == "forward"]
    first_forward = forward[0] if forward else ops[0]
    for i in forward:
        anchor[i] = i
    producers: dict[int, list[int]] = {}   # op -> its producers inside the group
    for src, dst, _ in edges:
        producers.setdefault(dst, []).append(src)
    for i in ops:
        if i in anchor:
            continue
        m = _GRADIENT_OF.match(graph.ops[i].name)
        fwd = index.get(m.group(1)) if m else None
        if fwd is not None and anchor.get(fwd) == fwd:
            anchor[i] = fwd
            continue
        anchored = [anchor[p] for p in producers.get(i, []) if p in anchor]
        anchor[i] = anchored[0] if anchored else first_forward
    # colocation: every op of a set follows the set's first anchor (by position)
    position = {op: k for k, op in enumerate(ops)}
    sets = UnionFind(len(ops))
    first_of_set: dict[int, int] = {}  # colocation set -> position of the first anchor seen
    for i in ops:
        s = colocation_of.get(i)
        if s is None:
            continue
        p = position[anchor[i]]
        if s in first_of_set:
            sets.union(first_of_set[s], p)
        else:
            first_of_set[s] = p
    unit_first: dict[int, int] = {}    # root position -> unit index
    unit_of_op: dict[int, int] = {}
    for i in ops:                       # topological order, so units are numbered by first appearance
        root = sets.find(position[anchor[i]])
        u = unit_first.get(root)
        if u is None:
            u = unit_first[root] = len(unit_first)
        unit_of_op[i] = u
    return unit_of_op, len(unit_first)
