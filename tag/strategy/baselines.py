"""Built-in strategies: the plans people run today, as ``Strategy`` objects the simulator can score.

Example::

    from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
    from tag.strategy.grouping import group_ops
    from tag.sim.simulator import Simulator
    grouping = group_ops(tg, target_groups=64)
    for name in BUILTIN_STRATEGIES:
        s = builtin_strategy(name, tg, topo, grouping)
        print(name, Simulator(tg, topo, grouping).evaluate(s).step_time)

The four strategies:

- ``dp_allreduce``: every op group replicated on every device, gradients combined by all-reduce
  (what Horovod and MirroredStrategy do).
- ``ps``: every op group replicated on every device, variables and their updates on one parameter
  server: the best-connected device (largest total bandwidth to the other devices; ties go to the
  lowest device index).
- ``single``: the whole step on the fastest device (highest peak FLOP/s; ties to the lowest index).
  A placement names device *groups*, so one device is written as mode ``partition`` with placement
  ``(its device group,)`` and every op mapped to that device in ``Strategy.partition``; the
  simulator and the rewriter therefore see exactly one device, even when its device group has more.
- ``partition``: model parallelism over all devices. Op groups are put in step order
  (``group_order``: phase, then depth below the batch inputs) and cut into contiguous stages, one per
  device (devices in index order, so neighbouring stages mostly share a host). A linear-partition
  dynamic programme minimises the slowest stage, where a stage costs its groups' compute time on its
  device (cost-model op times at the full batch) plus the time to send the tensors crossing its
  outgoing cut to the next device; ties go to the smaller total, which prefers cuts with few bytes.
  A stage whose rough memory (variables, trainable ones twice for their gradients, plus the forward
  activations at the full batch) exceeds its device's memory is ruled out, unless no split fits at
  all. Stages are non-empty and fill the first devices in order; fewer than all devices are used
  when there are fewer op groups than devices or when that is no slower. Colocation sets are never
  split (a set split by the grouping goes to its first op's device).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tag.cost.model import ZERO_COST_TYPES, CostModel
from tag.errors import StrategyError
from tag.ir.algorithms import op_levels, op_stages, topological_order
from tag.strategy.types import Action, Grouping, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph
    from tag.strategy.pipeline import PipelineStage

BUILTIN_STRATEGIES: tuple[str, ...] = ("dp_allreduce", "ps", "single", "partition")


def builtin_strategy(name: str, graph: "TrainingGraph", topology: "Topology", grouping: Grouping,
                     cost_model=None, device_speeds=()) -> Strategy:
    """The built-in strategy NAME for GRAPH on TOPOLOGY with op groups GROUPING.

    ``cost_model`` (a ``tag.cost.CostModel``) is used by ``partition`` to balance stages; one is
    built from the graph and topology when it is not given. ``device_speeds`` (examples/s per device,
    ``tag.cost.speeds.device_speeds``) is what replicated batch shares follow; empty: peak FLOP/s.
    Unknown names raise StrategyError.
    """
    strategy = _builtin(name, graph, topology, grouping, cost_model)
    strategy.device_speeds = tuple(float(x) for x in device_speeds)
    return strategy


def _builtin(name: str, graph: "TrainingGraph", topology: "Topology", grouping: Grouping, cost_model) -> Strategy:
    if name not in BUILTIN_STRATEGIES:
        raise StrategyError(f"unknown strategy {name!r} (known: {', '.join(BUILTIN_STRATEGIES)})")
    if len(grouping.group_of_op) != len(graph.ops):
        raise StrategyError(f"grouping covers {len(grouping.group_of_op)} ops but the graph has {len(graph.ops)}")
    if topology.num_devices == 0:
        raise StrategyError("the topology has no devices")
    n_groups = grouping.num_groups
    all_groups = tuple(g.index for g in topology.groups)
    if name == "dp_allreduce":
        return Strategy(grouping, [Action(all_groups, "allreduce")] * n_groups, name=name)
    if name == "ps":
        ps = best_connected_device(topology)
        return Strategy(grouping, [Action(all_groups, "ps", ps_device=ps)] * n_groups, name=name)
    if name == "single":
        return on_one_device(grouping, topology, len(graph.ops), fastest_device(topology), name=name)
    if cost_model is None:
        cost_model = CostModel(graph, topology)
    device_of_op = balanced_partition(graph, topology, grouping, cost_model)
    return Strategy(grouping, [Action(all_groups, "partition")] * n_groups,
                    partition={i: int(d) for i, d in enumerate(device_of_op)}, name=name)


def on_one_device(grouping: "Grouping", topology: "Topology", n_ops: int, device: int, name: str = "") -> Strategy:
    """Every op of the graph on DEVICE (a global device index), even when its group holds other devices."""
    return Strategy(grouping, [Action((topology.devices[device].group,), "partition")] * grouping.num_groups,
                    partition={i: device for i in range(n_ops)}, name=name or f"on device {device}")


def action_devices(action: "Action | PipelineStage", topology: "Topology") -> tuple[int, ...]:
    """The devices ACTION (or a pipeline stage) runs on: its device groups' devices, then its parameter server."""
    devices = [d for g in action.placement for d in topology.groups[g].devices]
    if action.ps_device is not None and int(action.ps_device) not in devices:
        devices.append(int(action.ps_device))
    return tuple(devices)


def hosts_used(strategy: Strategy, topology: "Topology") -> frozenset[int]:
    """The hosts (indices) whose devices STRATEGY runs anything on: every action's and pipeline stage's
    devices and parameter servers (``action_devices``)."""
    units = list(strategy.actions) + (list(strategy.pipeline.stages) if strategy.pipeline is not None else [])
    return frozenset(topology.devices[d].host_index for u in units for d in action_devices(u, topology))


def one_device_placement(strategy: Strategy, topology: "Topology") -> tuple[int, ...] | None:
    """The device of every op group when each runs whole on one device (None otherwise): a one-device action,
    or a partition whose ops all map to one device. Two strategies with the same such placement run the same
    program, whatever their modes say (``partition`` choosing one device is ``single``). A pipeline of one
    micro-batch whose stages each run on one device is that placement too (the stages run one after the
    other, as a partition's do); with more micro-batches: None (micro-batches make another program)."""
    if strategy.pipeline is not None:
        return pipeline_device_placement(strategy, topology)
    where = []
    for g, a in enumerate(strategy.actions):
        device = single_device(a.placement, topology)
        if device is not None:
            where.append(device)
            continue
        if a.mode != "partition":
            return None
        devices = {strategy.partition.get(int(i)) for i in strategy.grouping.members(g)}
        if len(devices) != 1 or None in devices:
            return None
        where.append(devices.pop())
    return tuple(where)


def pipeline_device_placement(strategy: Strategy, topology: "Topology") -> tuple[int, ...] | None:
    """``one_device_placement`` of a pipelined STRATEGY: the device of every op group when it has one
    micro-batch and each stage runs on one device; None otherwise."""
    pipe = strategy.pipeline
    if pipe.micro_batches != 1:
        return None
    where = [None] * strategy.grouping.num_groups
    for stage in pipe.stages:
        device = single_device(stage.placement, topology)
        if device is None:
            return None
        for g in stage.groups:
            where[g] = device
    return None if None in where else tuple(where)


def single_device(placement: tuple[int, ...], topology: "Topology") -> int | None:
    """The device of PLACEMENT (device groups) when it is one group of one device, else None."""
    if len(placement) == 1 and len(topology.groups[placement[0]].devices) == 1:
        return topology.groups[placement[0]].devices[0]
    return None


def best_connected_device(topology: "Topology") -> int:
    """The device with the largest total bandwidth to all other devices (ties: lowest index)."""
    bw = np.array(topology.bandwidth, dtype=np.float64, copy=True)
    if bw.shape[0] <= 1:
        return 0
    np.fill_diagonal(bw, 0.0)
    total = bw.sum(axis=1)
    return int(np.flatnonzero(total == total.max())[0])


def fastest_device(topology: "Topology") -> int:
    """The device with the highest peak FLOP/s (ties: lowest index)."""
    speeds = np.array([d.peak_flops for d in topology.devices], dtype=np.float64)
    return int(np.flatnonzero(speeds == speeds.max())[0])


def topological_op_order(graph: "TrainingGraph") -> np.ndarray:
    """Position of each op in ``tag.ir.algorithms.topological_order`` (deterministic; data and control edges)."""
    order = topological_order(graph)
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    return pos


def group_order(graph: "TrainingGraph", grouping: Grouping) -> np.ndarray:
    """Op groups in the order the step reaches them: by (earliest phase stage of their ops, shallowest
    depth below the batch inputs of their working ops in that stage, group index).

    Depth, not topological position, decides: variables, constants and labels are sources that a
    topological order may list first, and they must not pull their layer to the front (ops of
    ``tag.cost.ZERO_COST_TYPES`` count only for a group that has nothing else).
    """
    order = topological_order(graph)
    stage = np.asarray(op_stages(graph, order), dtype=np.int64)
    level = np.asarray(op_levels(graph, order), dtype=np.int64)
    gof = np.asarray(grouping.group_of_op, dtype=np.int64)
    k = grouping.num_groups
    big = np.iinfo(np.int64).max
    first_stage = np.full(k, big, dtype=np.int64)
    np.minimum.at(first_stage, gof, stage)
    in_first = stage == first_stage[gof]
    working = np.array([op.type not in ZERO_COST_TYPES for op in graph.ops], dtype=bool)
    depth = np.full(k, big, dtype=np.int64)          # ops that do work decide ...
    reached = in_first & (level >= 0) & working
    np.minimum.at(depth, gof[reached], level[reached])
    fallback = np.full(k, big, dtype=np.int64)       # ... else any op the inputs reach
    reached = in_first & (level >= 0)
    np.minimum.at(fallback, gof[reached], level[reached])
    depth = np.where(depth == big, fallback, depth)
    return np.lexsort((np.arange(k), depth, first_stage))


def _op_times(cost_model, topology: "Topology", device_group: int, batch: int) -> np.ndarray:
    return np.asarray(cost_model.op_times(device_group, batch), dtype=np.float64)


def balanced_partition(graph: "TrainingGraph", topology: "Topology", grouping: Grouping,
                       cost_model) -> np.ndarray:
    """Device of every op for the ``partition`` strategy (see the module docstring)."""
    n_ops = len(graph.ops)
    gof = np.asarray(grouping.group_of_op, dtype=np.int64)
    order = group_order(graph, grouping)            # order[k] = group at position k
    k_groups = len(order)
    pos_of_group = np.empty(k_groups, dtype=np.int64)
    pos_of_group[order] = np.arange(k_groups)
    batch = int(graph.batch_size)

    # Compute time of each group (in position order) on each device group, as prefix sums.
    prefix = {}
    for dg in {d.group for d in topology.devices}:
        per_group = np.bincount(gof, weights=_op_times(cost_model, topology, dg, batch), minlength=k_groups)
        prefix[dg] = np.concatenate([[0.0], np.cumsum(per_group[order])])

    # Rough bytes each group keeps on its device: variables (trainable ones twice: weight + gradient),
    # and the forward activations held for the backward pass. Stages that exceed a device's memory
    # are ruled out (unless nothing fits; the simulator has the exact memory model).
    held = np.zeros(k_groups)
    for v in graph.variables:
        held[gof[v.op]] += v.nbytes * (2 if v.kind == "trainable" else 1)
    for i, op in enumerate(graph.ops):
        if op.phase == "forward":
            held[gof[i]] += sum(t.nbytes.at(batch) for t in op.outputs)
    held_prefix = np.concatenate([[0.0], np.cumsum(held[order])])

    # Bytes crossing the cut after position p (edges in either direction, at the full batch).
    diff = np.zeros(k_groups + 1)
    for e in graph.edges:
        a, b = pos_of_group[gof[e.src]], pos_of_group[gof[e.dst]]
        if a != b:
            lo, hi = min(a, b), max(a, b)
            nbytes = e.nbytes.at(batch)
            diff[lo] += nbytes
            diff[hi] -= nbytes
    cut_bytes = np.cumsum(diff)[:k_groups]           # cut_bytes[p]: between positions p and p+1

    devices = list(range(topology.num_devices))
    if k_groups == 0:
        return np.zeros(n_ops, dtype=np.int64)
    device_of_pos = linear_partition(topology, devices, k_groups, prefix, cut_bytes, held_prefix, True)
    if device_of_pos is None:     # no split fits in memory: balance time alone
        device_of_pos = linear_partition(topology, devices, k_groups, prefix, cut_bytes, held_prefix, False)
    device_of_op = device_of_pos[pos_of_group[gof]]

    # Colocation sets stay together: a set the grouping split goes to its first op's device.
    index = graph.op_index
    for names in graph.colocation:
        members = [index[n] for n in names if n in index]
        if members:
            device_of_op[members] = device_of_op[members[0]]
    assert len(device_of_op) == n_ops
    return device_of_op


def linear_partition(topology: "Topology", devices: list[int], k_groups: int, prefix: dict,
                      cut_bytes: np.ndarray, held_prefix: np.ndarray, fit_memory: bool) -> np.ndarray | None:
    """Minimax linear partition of K positions over the first devices (see balanced_partition)."""
    n_use = min(len(devices), k_groups)              # every stage holds at least one group
    # after device j: best_max[e], best_sum[e] = (slowest stage, total) of positions [0, e) on devices 0..j
    best_max = np.full(k_groups + 1, np.inf)
    best_sum = np.full(k_groups + 1, np.inf)
    best_max[0] = best_sum[0] = 0.0
    choice = np.zeros((n_use, k_groups + 1), dtype=np.int64)   # start position of device j's stage
    s_idx, e_idx = np.meshgrid(np.arange(k_groups + 1), np.arange(k_groups + 1), indexing="ij")
    valid = s_idx < e_idx
    cols = np.arange(k_groups + 1)
    finished: list[tuple[float, float, int]] = []    # (slowest stage, total, devices used) covering all
    for j in range(n_use):
        d = devices[j]
        p = prefix[topology.devices[d].group]
        stage = p[e_idx] - p[s_idx]
        if fit_memory:
            over = held_prefix[e_idx] - held_prefix[s_idx] > topology.devices[d].memory_bytes
            stage = np.where(over, np.inf, stage)
        if j + 1 < len(devices):
            nxt = devices[j + 1]
            bw, lat = float(topology.bandwidth[d, nxt]), float(topology.latency[d, nxt])
            # a stage [s, e) with e < K sends the bytes crossing the cut after position e-1 to the next device
            send = np.zeros(k_groups + 1)
            send[1:k_groups] = cut_bytes[: k_groups - 1] / bw + lat
            stage = stage + send[e_idx]
        m = np.where(valid, np.maximum(best_max[s_idx], stage), np.inf)
        t = np.where(valid, best_sum[s_idx] + stage, np.inf)
        col_min = m.min(axis=0)
        t_masked = np.where(m <= col_min + np.abs(col_min) * 1e-9 + 1e-15, t, np.inf)
        start = np.argmin(t_masked, axis=0)
        choice[j] = start
        best_max, best_sum = m[start, cols], t[start, cols]
        if np.isfinite(best_max[k_groups]):
            finished.append((float(best_max[k_groups]), float(best_sum[k_groups]), j + 1))
    if not finished:
        return None
    lowest = min(f[0] for f in finished)
    near = [f for f in finished if f[0] <= lowest * (1 + 1e-9) + 1e-15]
    used = min(near, key=lambda f: (f[1], f[2]))[2]

    # Walk back: device of each position.
    device_of_pos = np.empty(k_groups, dtype=np.int64)
    e = k_groups
    for j in range(used - 1, -1, -1):
        s = int(choice[j, e])
        device_of_pos[s:e] = devices[j]
        e = s
    return device_of_pos
