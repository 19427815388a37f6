"""Lanes and layouts: where each task of one evaluation runs, cached across evaluations.

A *lane* is the devices of one device group that behave identically (same speed, same work); a device
that holds partitioned ops or a parameter server gets a lane of its own (``Lanes``). A *layout* is
where one task runs: its lanes with their per-replica batch and durations, and which devices hold which
examples of its outputs (``Layout``). ``LayoutCache`` builds layouts for replicated tasks, single-device
tasks and partition tasks split over devices, and keeps them (and the per-task time tables) across
evaluations, so the search pays for each distinct placement once. ``partition_plan`` turns a partition
op group's per-op devices into per-task layouts.

Example::

    import tag
    from tag.cost.model import CostModel
    from tag.strategy.grouping import group_ops
    from tag.sim.layouts import LayoutCache
    from tag.sim.task_graph import TaskGraph
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    cache = LayoutCache(topo, CostModel(tg, topo), TaskGraph(tg, group_ops(tg, target_groups=8)), [])
    lanes = cache.lanes(frozenset())
    layout = cache.replicated_layout(tuple(range(len(topo.groups))), lanes, 32)
    layout.lanes, layout.holdings[:2]
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tag.cluster.topology import Topology
from tag.cost.model import CostModel
from tag.errors import StrategyError
from tag.ir.types import TrainingGraph
from tag.sim.task_graph import TaskGraph
from tag.strategy.types import Action, batch_shares


class Layout:
    """Where one task runs in one evaluation: lanes with their per-replica batch, and which devices hold
    which examples of its outputs."""

    __slots__ = ("id", "kind", "insts", "holdings", "devices", "lanes", "key", "lane_idx", "durations", "batch",
                 "lane_slice")

    def __init__(self, id_: int, kind: str, insts: list, holdings: list, devices: tuple, key: tuple):
        self.id = id_
        self.kind = kind            # "rep" (replicated), "dev" (one device), "split" (partition sub-tasks)
        self.insts = insts          # [(lane, durations per task (list; a float for split), batch, array)]
        self.holdings = holdings    # [(device, first example, end example, lane)]
        self.devices = devices
        self.lanes = tuple(dict.fromkeys(i[0] for i in insts))
        self.key = key
        self.lane_idx = np.array([i[0] for i in insts], dtype=np.int64)
        batch_of_lane = np.array([i[2] for i in insts], dtype=np.float64)
        # durations and batch per lane (rows) and task (columns), for runs simulated with numpy
        self.durations = np.stack([i[3] for i in insts]) if kind != "split" else None
        self.batch = np.repeat(batch_of_lane[:, None], len(insts[0][3]), axis=1) if kind != "split" else None
        li = self.lane_idx
        self.lane_slice = slice(int(li[0]), int(li[0]) + len(li)) if len(li) and np.array_equal(
            li, np.arange(li[0], li[0] + len(li))) else None


class Lanes:
    """Lane assignment for one set of devices that need their own lane."""

    __slots__ = ("key", "lanes", "lane_dg", "lane_of_device", "by_group")

    def __init__(self, topology: Topology, special: frozenset):
        self.key = special
        self.lanes: list[tuple[int, ...]] = []       # lane -> its devices
        self.lane_dg: list[int] = []                 # lane -> its device group
        self.lane_of_device = np.zeros(topology.num_devices, dtype=np.int64)
        self.by_group: list[list[int]] = []          # device group -> its lanes
        for g in topology.groups:
            mine = []
            normal = tuple(d for d in g.devices if d not in special)
            if normal:
                mine.append(len(self.lanes))
                self.lanes.append(normal)
                self.lane_dg.append(g.index)
                self.lane_of_device[list(normal)] = len(self.lanes) - 1
            for d in g.devices:
                if d in special:
                    mine.append(len(self.lanes))
                    self.lanes.append((d,))
                    self.lane_dg.append(g.index)
                    self.lane_of_device[d] = len(self.lanes) - 1
            self.by_group.append(mine)


class LayoutCache:
    """Builds and keeps lanes, layouts and per-task time tables across evaluations.

    ``dependent_caches`` are dicts keyed by layout ids (the movement caches): they are cleared with the
    layouts when the cache is bounded (ids keep counting, so they never repeat)."""

    def __init__(self, topology: Topology, cost: CostModel, tasks: TaskGraph, dependent_caches: list[dict]):
        self.topology, self.cost, self.tasks = topology, cost, tasks
        self._dependent_caches = dependent_caches
        self._device_group = [d.group for d in topology.devices]
        self._peak_speeds = tuple(float(d.peak_flops) for d in topology.devices)
        self._speeds_in_use = self._peak_speeds
        self._device_speed = list(self._peak_speeds)   # what batch shares follow (use_speeds)
        self._tables: dict[tuple[int, float], tuple] = {}       # (device group, batch) -> (list, array)
        # device group -> the first device group with the same device type, spec and size: their task
        # times are equal (the cost model reads nothing else), so a cluster of identical hosts costs once
        self._same_costs: list[int] = []
        first_of: dict[tuple, int] = {}
        for g in topology.groups:
            key = (g.device_type, g.tf_device_type, float(g.peak_flops), float(g.memory_bandwidth), len(g.devices))
            self._same_costs.append(first_of.setdefault(key, g.index))
        self._lanes: dict[frozenset, Lanes] = {}
        self._layouts: dict[tuple, Layout] = {}
        self._shares: dict[tuple[tuple[int, ...], int], list[int]] = {}   # (placement, batch) -> shares
        self._next_layout_id = 0

    def table(self, dg: int, batch: float, ops: np.ndarray | None = None) -> tuple[list[float], np.ndarray]:
        """Seconds per task on one device of device group DG at per-replica BATCH (as list and array); with
        OPS (a boolean mask over the ops, the same array every call), of those ops only."""
        k = (self.cost_class(dg), float(batch), ops is not None)
        t = self._tables.get(k)
        if t is None:
            if len(self._tables) > 4096:
                self._tables.clear()
            times = self.cost.op_times(k[0], batch)
            if ops is not None:
                times = np.where(ops, times, 0.0)
            arr = np.bincount(self.tasks.task_of_op, weights=times, minlength=self.tasks.num_tasks)
            t = (arr.tolist(), arr)
            self._tables[k] = t
        return t

    def cost_class(self, dg: int) -> int:
        """The first device group whose task times equal device group DG's (same type, spec and size)."""
        return self._same_costs[dg]

    def lanes(self, special: frozenset) -> Lanes:
        """The lanes when the devices SPECIAL need lanes of their own."""
        ln = self._lanes.get(special)
        if ln is None:
            ln = Lanes(self.topology, special)
            self._lanes[special] = ln
        return ln

    def devices_of(self, placement: tuple[int, ...]) -> list[int]:
        """The devices of the device groups PLACEMENT, in order."""
        return [d for g in placement for d in self.topology.groups[g].devices]

    def use_speeds(self, speeds: tuple[float, ...]) -> None:
        """Batch shares follow SPEEDS (examples/s per device; empty: peak FLOP/s). A change drops the
        layouts built with the old shares."""
        speeds = tuple(speeds) or self._peak_speeds
        if speeds is self._speeds_in_use or speeds == self._speeds_in_use:
            return
        self._speeds_in_use = speeds
        self._device_speed = list(speeds)
        self._shares.clear()
        self._layouts.clear()
        for cache in self._dependent_caches:
            cache.clear()

    def shares_of(self, placement: tuple[int, ...], batch: int) -> list[int]:
        """Examples of BATCH per device of PLACEMENT (``batch_shares`` by device speed)."""
        k = (placement, batch)
        s = self._shares.get(k)
        if s is None:
            devs = self.devices_of(placement)
            s = batch_shares([self._device_speed[d] for d in devs], batch)
            self._shares[k] = s
        return s

    def _new_layout(self, key: tuple, kind: str, insts: list, holdings: list, devices: tuple) -> Layout:
        if len(self._layouts) > 20000:   # bound the caches; ids keep counting so they never repeat
            self._layouts.clear()
            for cache in self._dependent_caches:
                cache.clear()
        self._next_layout_id += 1
        lay = Layout(self._next_layout_id, kind, insts, holdings, devices, key)
        self._layouts[key] = lay
        return lay

    def replicated_layout(self, placement: tuple[int, ...], lanes: Lanes, batch: int) -> Layout:
        """Every device of PLACEMENT runs the task on its share of BATCH."""
        key = ("r", placement, lanes.key, batch)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        devs = self.devices_of(placement)
        shares = self.shares_of(placement, batch)
        share_of = dict(zip(devs, shares, strict=True))
        holdings, lo = [], 0
        for d, s in zip(devs, shares, strict=True):
            holdings.append((d, lo, lo + s, int(lanes.lane_of_device[d])))
            lo += s
        insts = []
        for g in placement:
            for lane in lanes.by_group[g]:
                b = max(share_of[d] for d in lanes.lanes[lane])
                tl, ta = self.table(g, b)
                insts.append((lane, tl, b, ta))
        return self._new_layout(key, "rep", insts, holdings, tuple(devs))

    def device_layout(self, device: int, lanes: Lanes, batch: int) -> Layout:
        """DEVICE runs the task on the whole BATCH."""
        key = ("d", device, lanes.key, batch)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        lane = int(lanes.lane_of_device[device])
        tl, ta = self.table(self._device_group[device], batch)
        insts = [(lane, tl, batch, ta)]
        return self._new_layout(key, "dev", insts, [(device, 0, batch, lane)], (device,))

    def split_layout(self, t: int, parts: list, lanes: Lanes, batch: int) -> Layout:
        """Partition task T split into one sub-task per device: PARTS = [(device, its ops)] in run order."""
        key = ("s", t, tuple((d, o.tobytes()) for d, o in parts), lanes.key, batch)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        insts = []
        for d, ops in parts:
            times = self.cost.op_times(self._device_group[d], batch)
            insts.append((int(lanes.lane_of_device[d]), float(times[ops].sum()), batch, None))
        holdings = [(d, 0, batch, int(lanes.lane_of_device[d])) for d, _ in parts]
        return self._new_layout(key, "split", insts, holdings, tuple(d for d, _ in parts))

    def partition_layouts(self, plan: dict, lanes: Lanes, batch: int) -> dict[int, Layout]:
        """Task -> layout of a partition group's PLAN (cached in the plan per lanes and batch)."""
        lk = (lanes.key, batch)
        lays = plan["layouts"].get(lk)
        if lays is None:
            lays = {}
            for t, (kind, what) in plan["tasks"].items():
                lays[t] = (self.device_layout(what, lanes, batch) if kind == "dev"
                           else self.split_layout(t, what, lanes, batch))
            if len(plan["layouts"]) > 64:
                plan["layouts"].clear()
            plan["layouts"][lk] = lays
        return lays


class PartitionPlans:
    """Per-task placement of partition op groups, from ``strategy.partition`` (cached by the groups' devices)."""

    def __init__(self, graph: TrainingGraph, tasks: TaskGraph, partition_vars: list,
                 devices_of: Callable[[tuple[int, ...]], list[int]]):
        self.graph, self.tasks = graph, tasks
        self._partition_vars = partition_vars        # group -> (variable ops, bytes each holds)
        self._devices_of = devices_of
        self._plans: dict[tuple, dict] = {}          # (group, placement, its ops' devices) -> plan

    def device_array(self, partition: dict) -> np.ndarray:
        """strategy.partition as an array over ops (-1: not listed)."""
        n = len(self.tasks.group_of_op)
        out = np.full(n, -1, dtype=np.int64)
        if partition:
            keys = np.fromiter(partition.keys(), dtype=np.int64, count=len(partition))
            vals = np.fromiter(partition.values(), dtype=np.int64, count=len(partition))
            ok = (keys >= 0) & (keys < n)
            if not ok.all():
                raise StrategyError(f"strategy.partition names op index {int(keys[~ok][0])}, but the graph has "
                                    f"ops 0..{n - 1}")
            out[keys] = vals
        return out

    def plan(self, g: int, device_of_op: np.ndarray, action: Action, lanes_needed: set) -> dict:
        """Plan of partition group G: {"tasks": {task: ("dev", device) or ("split", [(device, ops)...])},
        "dev_of": {op: device}, "devices", "layouts" (cache), "var_dev", "var_bytes"}. Adds its devices to
        LANES_NEEDED (they get lanes of their own)."""
        members = self.tasks.members_list[g]
        devs = device_of_op[self.tasks.members[g]]
        k = (g, action.placement, devs.tobytes())
        plan = self._plans.get(k)
        if plan is None:
            allowed = np.array(self._devices_of(action.placement), dtype=np.int64)
            bad = ~np.isin(devs, allowed)
            if bad.any():
                i = members[int(np.flatnonzero(bad)[0])]
                raise StrategyError(f"op {self.graph.ops[i].name!r} of op group {g} is partitioned onto device "
                                    f"{int(devs[np.flatnonzero(bad)[0]])}, outside the group's placement "
                                    f"{list(action.placement)}")
            dev_of = dict(zip(members, devs.tolist(), strict=True))
            plan_tasks = {}
            position = self.tasks.op_position
            for t in self.tasks.tasks_of_group[g]:
                on: dict[int, list[int]] = {}      # device -> the task's ops on it
                for i in self.tasks.task_ops[t].tolist():
                    on.setdefault(dev_of[i], []).append(i)
                if len(on) == 1:
                    plan_tasks[t] = ("dev", next(iter(on)))
                else:
                    parts = sorted(on.items(), key=lambda kv: min(position[i] for i in kv[1]))
                    plan_tasks[t] = ("split", [(d, np.asarray(o, dtype=np.int64)) for d, o in parts])
            var_ops, var_bytes = self._partition_vars[g]
            plan = {"tasks": plan_tasks, "dev_of": dev_of, "devices": sorted(set(devs.tolist())), "layouts": {},
                    "var_dev": np.array([dev_of[int(o)] for o in var_ops], dtype=np.int64), "var_bytes": var_bytes}
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[k] = plan
        lanes_needed.update(plan["devices"])
        return plan
