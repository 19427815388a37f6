"""A cheap lower bound on the simulated step time (and a memory check), for screening search candidates.

The list schedule of ``tag.sim.schedule`` costs milliseconds per strategy; a search mostly asks whether a
candidate beats the best strategy so far, and most candidates do not. ``StepBound.lower_bound`` answers in
tens of microseconds with a number that is never above what ``Simulator.evaluate`` would predict, so a
candidate whose bound is not below the best step time can be rejected without simulating it, and every
candidate that passes is simulated in full (the search keeps only simulated results). The bound is the
largest of four quantities, each a fact about every schedule the simulator can produce:

- *device busy time*: a lane runs its tasks one at a time, so the step lasts at least the summed
  durations of the tasks any one device runs (a task's duration on a device is taken at the smallest
  batch share the lanes of its device group can have, so it never exceeds what the lane is charged);
- *resource busy time*: every interconnect and NIC direction is a serialised resource, so the step lasts
  at least the summed durations of the collectives (all-reduce, parameter-server pull and push) that
  hold it (transfers between layouts, which also hold them, are left out; an all-reduce counts its bytes
  only, as the groups of one fusion bucket share one fixed cost);
- *critical path*: a task starts after the tasks it reads have finished somewhere (on the same lane for
  an unchanged layout, through a flow otherwise) and after the collectives it waits for, so its earliest
  finish is at least the longest chain of minimum task durations and collective durations into it; where
  a producer and its consumer run on places that share no device, the chain also holds the time the
  bundle's bytes need on the wire to reach the consumer's first device (the slowest route into each
  device with every device its own lane, the smallest over the devices: the simulator's lanes only
  gather more bytes per route). Dependencies into or out of a partition task split over several devices
  are not counted: their sub-tasks need not wait for every producer;
- the per-step overhead of the cost model's network profile is added, as the simulator adds it.

``StepBound.static_fits`` checks the static memory (weights, gradients, slots, state) exactly as the
simulator counts it: a strategy whose static bytes already exceed a device's memory is infeasible.

Per op group the terms depend only on its action (and its ops' devices when partitioned), so they are
cached per group and action; a bound is a sum of cached vectors and one pass over the task graph.

Example::

    import tag
    from tag.sim import Simulator
    from tag.sim.bound import StepBound
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/lab-v100-1080ti.pbtxt")
    grouping = group_ops(tg, target_groups=8)
    sim = Simulator(tg, topo, grouping)
    dp = builtin_strategy("dp_allreduce", tg, topo, grouping)
    StepBound(sim).lower_bound(dp) <= sim.evaluate(dp).step_time      # True
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import numpy as np

from tag.sim.memory import sparse_factor
from tag.sim.task_graph import UPDATE_STAGE
from tag.strategy.types import Action, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from tag.sim.simulator import Simulator


class GroupTerms:
    """What one op group under one action adds to the bound (see the module docstring)."""

    __slots__ = ("tasks", "weights", "busy", "resources", "static", "split", "collective_s", "pull_s", "places",
                 "ps")

    def __init__(self, tasks: np.ndarray, weights: np.ndarray, busy: np.ndarray, resources: np.ndarray,
                 static: np.ndarray, split: list[int], collective_s: float, pull_s: float,
                 places: np.ndarray, ps: bool):
        self.tasks = tasks                # the group's tasks
        self.weights = weights            # per task: its shortest duration on any lane it can run on
        self.busy = busy                  # per device: seconds of the group's tasks on it
        self.resources = resources        # per resource: seconds its collectives hold it
        self.static = static              # per device: bytes of the group's variables, gradients and slots
        self.split = split                # tasks split over several devices (partition)
        self.collective_s = collective_s  # all-reduce or push duration (the update tasks wait for it)
        self.pull_s = pull_s              # parameter-server pull duration (the forward tasks wait for it)
        self.places = places              # per task: where it runs (StepBound.place_id; -1: split)
        self.ps = ps                      # mode ps (its gradients travel in the push, not as transfers)


class StepBound:
    """Lower bounds on ``simulator``'s step time (module docstring). Cached per op group and action."""

    def __init__(self, simulator: "Simulator"):
        self.sim = simulator
        tasks = simulator.tasks
        self.num_tasks = tasks.num_tasks
        self.num_devices = simulator.topology.num_devices
        self.num_resources = len(simulator.routing.resource_names)
        self._group_tasks = [np.asarray(ts, dtype=np.int64) for ts in tasks.tasks_of_group]
        # producers each task waits for (bundles point forward in task order)
        preds: list[list[int]] = [[] for _ in range(self.num_tasks)]
        for a, b in zip(tasks.bundle_src, tasks.bundle_dst, strict=True):
            preds[b].append(a)
        self._preds = [tuple(sorted(set(p))) for p in preds]
        self._device_group = np.array([d.group for d in simulator.topology.devices], dtype=np.int64)
        self._capacity = np.array([d.memory_bytes for d in simulator.topology.devices], dtype=np.float64)
        self._terms: dict[Hashable, GroupTerms] = {}
        self._b_src = np.asarray(tasks.bundle_src, dtype=np.int64)
        self._b_dst = np.asarray(tasks.bundle_dst, dtype=np.int64)
        self._place_ids: dict[tuple, int] = {}     # ("r", placement) or ("d", device) -> id
        self._places: list[tuple] = []
        self._edge_floor: dict[tuple[int, int, int], float] = {}   # (bundle, src place, dst place) -> s
        self._context: tuple = ()        # (device speeds, batch) the cached terms were built for

    # ------------------------------------------------------------------ per-group terms
    def use(self, speeds: tuple, batch: int) -> None:
        """Bounds from now on are for batch shares following SPEEDS at global BATCH (the cached terms are
        dropped when either changes)."""
        self.sim.layouts.use_speeds(speeds)
        context = (tuple(speeds), int(batch))
        if context != self._context:
            self._terms.clear()
            self._edge_floor.clear()
            self._context = context

    def cached_terms(self, key: Hashable) -> "GroupTerms | None":
        """The terms ``terms`` cached under KEY, or None (lets a caller skip work that only a miss needs)."""
        return self._terms.get(key)

    def terms(self, group: int, action: Action, group_devices: np.ndarray | None, batch: int,
              sfb: bool = False, key: Hashable | None = None) -> GroupTerms:
        """The terms of GROUP under ACTION at global BATCH (cached under KEY, default (group, action, the
        devices)). GROUP_DEVICES: for a partition action, the device of each of the group's ops (in
        ``tasks.members[group]`` order). SFB: some of the group's gradients may travel as sufficient
        factors (its all-reduce is then left out of the bound)."""
        if key is None:
            key = (group, action, None if group_devices is None else group_devices.tobytes(), sfb)
        t = self._terms.get(key)
        if t is None:
            if len(self._terms) > 100_000:
                self._terms.clear()
            t = self._build(group, action, group_devices, batch, sfb)
            self._terms[key] = t
        return t

    def _build(self, g: int, a: Action, group_devices: np.ndarray | None, batch: int, sfb: bool) -> GroupTerms:
        sim = self.sim
        tasks, layouts, memory = sim.tasks, sim.layouts, sim.memory
        D, R = self.num_devices, self.num_resources
        mine = self._group_tasks[g]
        weights = np.zeros(len(mine))
        busy = np.zeros(D)
        resources = np.zeros(R)
        static = np.zeros(D)
        split: list[int] = []
        collective_s = pull_s = 0.0
        W = float(memory.weight_bytes_list[g])
        places = np.full(len(mine), -1, dtype=np.int64)
        if a.mode == "partition":
            device_of_op = np.full(len(tasks.group_of_op), -1, dtype=np.int64)
            device_of_op[tasks.members[g]] = group_devices
            plan = sim.partitions.plan(g, device_of_op, a, set())
            for i, t in enumerate(mine.tolist()):
                kind, what = plan["tasks"][t]
                if kind == "dev":
                    d = int(what)
                    x = float(layouts.table(int(self._device_group[d]), batch)[1][t])
                    weights[i] = x
                    busy[d] += x
                    places[i] = self.place_id(("d", d))
                else:
                    split.append(t)
                    for d, ops in what:
                        busy[d] += float(sim.cost.op_times(int(self._device_group[d]), batch)[ops].sum())
            if len(plan["var_dev"]):
                static += np.bincount(plan["var_dev"], weights=plan["var_bytes"], minlength=D)
            return GroupTerms(mine, weights, busy, resources, static, split, 0.0, 0.0, places, False)
        devs = layouts.devices_of(a.placement)
        shares = layouts.shares_of(a.placement, batch)
        # what its collective moves (sparse gradients as rows: MemoryModel.collective_bytes)
        W_coll = float(memory.collective_bytes(W, sparse_factor(a.mode, len(devs)), batch, groups=g,
                                               dense_ok=a.mode == "allreduce" and len(devs) > 1))
        stage = tasks.task_stage[mine]
        on_ps = (stage == UPDATE_STAGE) if a.mode == "ps" else np.zeros(len(mine), dtype=bool)
        replicated = ~on_ps
        places[replicated] = self.place_id(("r", a.placement))
        weights[:] = np.inf
        share_of = dict(zip(devs, shares, strict=True))
        shortest_of: dict[tuple, tuple[np.ndarray, float]] = {}    # (same costs, shares) -> (times, busy)
        for dg in a.placement:
            group_devs = sim.topology.groups[dg].devices
            key = (layouts.cost_class(dg), tuple(sorted({share_of[d] for d in group_devs})))
            found = shortest_of.get(key)
            if found is None:
                tables = [layouts.table(dg, b)[1][mine] for b in key[1]]
                shortest = np.minimum.reduce(tables) if len(tables) > 1 else tables[0]
                found = shortest_of[key] = (shortest, float(shortest[replicated].sum()))
                weights = np.where(replicated, np.minimum(weights, shortest), weights)
            busy[list(group_devs)] += found[1]
        weights[~np.isfinite(weights)] = 0.0
        slot_b, state_b = float(memory.slot_bytes[g]), float(memory.state_bytes[g])
        if a.mode == "ps":
            ps = int(a.ps_device)
            full = layouts.table(int(self._device_group[ps]), batch)[1][mine]
            weights[on_ps] = full[on_ps]
            places[on_ps] = self.place_id(("d", ps))
            busy[ps] += float(full[on_ps].sum())
            static[devs] += 2 * W + state_b
            static[ps] += 2 * W + slot_b
            if W_coll > 0:
                c = sim.routing.collective("ps", devs, a.placement, ps)
                if c[5] > 0:
                    collective_s = pull_s = c[0] + c[1] * W_coll
                    resources[list(c[4])] += collective_s       # the pull
                    resources[list(c[7])] += collective_s       # the push (the other direction of each NIC)
        else:
            static[devs] += 2 * W + slot_b + state_b
            if W_coll > 0 and len(devs) > 1 and not sfb:
                c = sim.routing.collective("allreduce", devs, a.placement, None)
                if c[5] > 0:
                    # per byte only: groups fused into one bucket (tag.strategy.fusion) share the fixed cost
                    collective_s = min(c[1], c[3]) * W_coll
                    resources[list(c[4])] += collective_s
        return GroupTerms(mine, weights, busy, resources, static, split, collective_s, pull_s, places,
                          a.mode == "ps")

    def place_id(self, place: tuple) -> int:
        """A number for PLACE: ("r", placement) for a replicated task, ("d", device) for one device."""
        i = self._place_ids.get(place)
        if i is None:
            i = self._place_ids[place] = len(self._places)
            self._places.append(place)
        return i

    def _transfer_floor(self, b: int, src: int, dst: int) -> float:
        """Seconds bundle B must spend on the wire before its consumer can start anywhere, when it moves
        from place SRC to place DST and no device of DST holds any of it (else 0): per device of DST, the
        slowest of its routes with every device its own lane (lanes that share devices only gather more
        bytes per route), the smallest over DST's devices."""
        sim = self.sim
        layouts, tasks = sim.layouts, sim.tasks
        batch = self._context[1]

        def devices(place: tuple) -> list[int]:
            return layouts.devices_of(place[1]) if place[0] == "r" else [place[1]]

        ps, pd = self._places[src], self._places[dst]
        if set(devices(ps)) & set(devices(pd)):
            return 0.0
        lanes = layouts.lanes(frozenset(range(self.num_devices)))

        def layout(place: tuple):
            return (layouts.replicated_layout(place[1], lanes, batch) if place[0] == "r"
                    else layouts.device_layout(place[1], lanes, batch))

        deps, routes = sim.routing.movement(layout(ps), layout(pd))
        per_example, fixed = tasks.bundle_own[b]
        for _, pe, fx in tasks.bundle_shared[b]:
            per_example += pe
            fixed += fx
        slowest: dict[int, float] = {}       # destination lane -> its slowest route
        for (_, dl, _, lat, ipb, ex, cnt) in routes:
            nb = per_example * ex + fixed * cnt
            if nb > 0:
                x = nb * ipb + lat
                if x > slowest.get(dl, 0.0):
                    slowest[dl] = x
        return min((slowest.get(dl, 0.0) for dl, _ in deps), default=0.0)

    # ------------------------------------------------------------------ bounds
    def strategy_terms(self, strategy: Strategy, batch: int | None = None) -> list[GroupTerms] | None:
        """The terms of every op group of STRATEGY (None when the bound does not cover it: pipelines)."""
        if getattr(strategy, "pipeline", None):
            return None
        sim = self.sim
        batch = int(sim.graph.batch_size if batch is None else batch)
        self.use(strategy.device_speeds, batch)
        device_of_op = None
        sfb_groups: set[int] = set()
        if strategy.sfb:
            for v in sim.graph.variables:
                if v.name in strategy.sfb:
                    sfb_groups.add(int(sim.tasks.group_of_op[v.op]))
            if not sfb_groups:
                sfb_groups = set(range(sim.num_groups))       # names not found: leave every all-reduce out
        out = []
        action_keys: dict[int, tuple] = {}     # id(action) -> its value as a tuple (hashes faster)
        cache = self._terms
        for g, a in enumerate(strategy.actions):
            akey = action_keys.get(id(a))
            if akey is None:
                akey = action_keys[id(a)] = (a.placement, a.mode, a.ps_device)
            devices = None
            if a.mode == "partition":
                if device_of_op is None:
                    device_of_op = sim.partitions.device_array(strategy.partition)
                devices = device_of_op[sim.tasks.members[g]]
                if (devices < 0).any():
                    return None                    # the simulator will say what is missing
                key = (g, akey, devices.tobytes(), g in sfb_groups)
            else:
                key = (g, akey, None, g in sfb_groups)
            t = cache.get(key)
            if t is None:
                t = self.terms(g, a, devices, batch, g in sfb_groups, key=key)
            out.append(t)
        return out

    def lower_bound(self, strategy: Strategy, batch: int | None = None, threshold: float | None = None) -> float:
        """A lower bound on ``simulator.evaluate(strategy, batch).step_time`` (0.0 where not covered). With
        THRESHOLD the work stops once the bound reaches it (``combine``)."""
        terms = self.strategy_terms(strategy, batch)
        return 0.0 if terms is None else self.combine(terms, threshold)

    def static_fits(self, terms: list[GroupTerms]) -> bool:
        """Whether the static memory of TERMS fits every device (False: the strategy is infeasible)."""
        static = np.add.reduce([t.static for t in terms])
        return bool((static <= self._capacity).all())

    def combine(self, terms: list[GroupTerms], threshold: float | None = None) -> float:
        """The bound of a strategy given the terms of each of its op groups. With THRESHOLD, stops as soon
        as a part of the bound reaches it (the value returned is then only known to be >= THRESHOLD)."""
        overhead = self.sim._step_overhead
        if not terms:
            return overhead
        best = float(np.add.reduce([t.busy for t in terms]).max())
        if self.num_resources:
            best = max(best, float(np.add.reduce([t.resources for t in terms]).max()))
        if threshold is not None and best + overhead >= threshold:
            return best + overhead
        return max(best, self._critical_path(terms)) + overhead

    def _critical_path(self, terms: list[GroupTerms]) -> float:
        """Longest chain of task durations and collective durations (module docstring)."""
        T = self.num_tasks
        if not T:
            return 0.0
        w = np.empty(T)
        place = np.empty(T, dtype=np.int64)
        release = [0.0] * T
        waits: list = [None] * T         # update task -> (tasks the collective waits for, its seconds)
        split: set[int] = set()
        tasks = self.sim.tasks
        collective_ends = []
        forward_tasks, coll_deps, update_tasks = tasks.forward_tasks, tasks.coll_deps, tasks.update_tasks
        for g, t in enumerate(terms):
            w[t.tasks] = t.weights
            place[t.tasks] = t.places
            if t.pull_s > 0:
                for f in forward_tasks[g]:
                    if t.pull_s > release[f]:
                        release[f] = t.pull_s
            if t.collective_s > 0:
                deps = coll_deps[g]
                collective_ends.append((deps, t.collective_s))
                for u in update_tasks[g]:
                    waits[u] = (deps, t.collective_s)
            if t.split:
                split.update(t.split)
        # bundles between places that share no device: their consumer waits for bytes on the wire
        src_place, dst_place = place[self._b_src], place[self._b_dst]
        extra: dict[int, list[tuple[int, float]]] = {}     # consumer task -> [(producer, transfer s)]
        cross = np.flatnonzero((src_place != dst_place) & (src_place >= 0) & (dst_place >= 0)).tolist()
        if cross:
            floors, b_src, b_dst = self._edge_floor, tasks.bundle_src, tasks.bundle_dst
            same, task_group = tasks.bundle_same_group, tasks.task_group_list
            sp, dp = src_place.tolist(), dst_place.tolist()
            for b in cross:
                if same[b] and terms[task_group[b_src[b]]].ps:
                    continue                  # gradients to the parameter server travel in the push
                key = (b, sp[b], dp[b])
                x = floors.get(key)
                if x is None:
                    x = floors[key] = self._transfer_floor(b, sp[b], dp[b])
                if x > 0:
                    extra.setdefault(b_dst[b], []).append((b_src[b], x))
        lb = w.tolist()
        preds = self._preds
        for k in split:
            lb[k] = 0.0
        for k in range(T):
            if split and k in split:
                continue
            r = release[k]
            for p in preds[k]:
                if lb[p] > r:
                    r = lb[p]
            if k in extra:
                for p, x in extra[k]:
                    if lb[p] + x > r:
                        r = lb[p] + x
            wt = waits[k]
            if wt is not None:
                x = max([lb[d] for d in wt[0]]) + wt[1]
                if x > r:
                    r = x
            lb[k] += r
        best = max(lb)
        for deps, dur in collective_ends:
            x = max([lb[d] for d in deps]) + dur
            if x > best:
                best = x
        return best
