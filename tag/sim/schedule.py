"""List scheduling of one step: tasks on lanes, transfers between layouts, collectives on shared resources.

Each lane runs its tasks in the fixed priority order, one at a time, as soon as its inputs have arrived
(an in-order list schedule). Tensors from one task to the tasks of one other layout travel together as
a *flow* (one transfer per route). Every bus and each direction of every NIC is one serialised resource
(``tag.sim.routing``): a transfer or collective starts when its inputs are ready and all its resources
are free (FIFO in issue order). A collective holds them for its whole duration; a transfer holds them
while its bytes are on the wire (bytes / bandwidth) and arrives its latency later, so the latencies of
concurrent transfers overlap, as TF's concurrent tensor requests do (measured on the 3-host testbed: with
latency holding the link, mixed strategies with many small transfers were predicted 20-70% too slow).
Consecutive tasks on one layout form a *run*: their release times are
all known when the run starts, so a run of several lanes is simulated with numpy at once.

``StepSchedule`` is the state of one simulated step; the simulator builds one per evaluation, adds the
flows and collectives of the strategy and calls ``run``. Its results are the [lane, task] matrices
``start``, ``finish`` (-1: the lane did not run the task) and ``batch`` (per-replica batch).

Example::

    import tag
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    from tag.sim import Simulator
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    grouping = group_ops(tg, target_groups=8)
    result = Simulator(tg, topo, grouping).evaluate(builtin_strategy("ps", tg, topo, grouping))
    result.step_time, result.comm_bytes             # from StepSchedule.run
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tag.sim.layouts import Layout
from tag.sim.routing import Routing
from tag.sim.task_graph import UPDATE_STAGE, TaskGraph
from tag.sim.trace import Recording
from tag.strategy.fusion import fusion_buckets
from tag.strategy.types import Action

_VECTOR_MIN = 8      # runs of at least this many task instances are simulated with numpy


def earliest_start(resource_free: list[float], resources: tuple, ready: float) -> float:
    """When RESOURCES are all free and READY has passed."""
    start = ready
    for r in resources:
        if resource_free[r] > start:
            start = resource_free[r]
    return start


def occupy(resource_free: list[float], resources: tuple, end: float) -> None:
    """Hold RESOURCES until END."""
    for r in resources:
        resource_free[r] = end


class StepSchedule:
    """The schedule of one step under one strategy (see the module docstring)."""

    def __init__(self, tasks: TaskGraph, routing: Routing, layout_of_task: list[Layout],
                 split_parts: dict[int, list], num_lanes: int, plans: dict[int, dict], group_names: list[str],
                 record: Recording | None, offsets: tuple[Sequence[float], Sequence[float]] | None = None,
                 serial: tuple[np.ndarray, np.ndarray] | None = None):
        T = tasks.num_tasks
        # (lane of each device, per device [all-reduce, push] fraction): synchronisation beside a CPU host's
        # compute delays both (tag.sim.host_cpu.sync_serial); None: nothing charged
        self.serial = serial
        self.tasks, self.routing, self.layout_of_task = tasks, routing, layout_of_task
        self.split_parts = split_parts        # split partition task -> [(device, its ops)] in run order
        self.plans = plans                    # partition group -> its plan (tag.sim.layouts.PartitionPlans)
        self.group_names = group_names
        self.record = record
        # resource / lane -> when it is next free (first: a worker's launch of its part, tag.sim.host_cpu)
        self.resource_free = [0.0] * len(routing.resource_names)
        self.lane_free = [0.0] * num_lanes
        if offsets is not None:
            self.lane_free, self.resource_free = [float(x) for x in offsets[0]], [float(x) for x in offsets[1]]
        self.release = [0.0] * T             # task -> earliest start (parameter-server pulls, collectives)
        self.comm_bytes = 0.0
        self.collective_end = [0.0] * tasks.num_groups
        # start, finish and per-replica batch of every task on every lane (finish -1: not run)
        self.start = np.zeros((num_lanes, T))
        self.finish = np.full((num_lanes, T), -1.0)
        self.batch = np.zeros((num_lanes, T))
        self.task_finish = [0.0] * T         # task -> its latest finish over lanes
        # flows[m] = [producer task, destination layout, per-example bytes, fixed bytes, bundle (split
        # layouts) or -1, wait-for-all flag, tensors]; flows_into / flows_out_of: task -> its flows
        self.flows: list[list] = []
        self.flows_into: dict[int, list[int]] = {}
        self.flows_out_of: dict[int, list[int]] = {}
        self.arrival: dict[int, dict[int, float]] = {}     # flow -> {destination lane: arrival time}
        self.flow_consumer: list[int] = []    # flow -> its first consumer task (trace labels)
        # trace label per task: the task graph's own (a pipeline's "F3 dense_1"), else the op group's name
        labels = getattr(tasks, "labels", None)
        self.task_labels = (labels if labels is not None or record is None
                            else [group_names[g] for g in tasks.task_group_list])
        # task -> [(group, resources, seconds, bytes on the wire, tasks it waits for, tasks waiting for it,
        # seconds of local compute after it, kind, payload bytes per device, devices)] of the collectives
        # issued once the task has run
        self.collectives_after: dict[int, list[tuple]] = {}

    # ------------------------------------------------------------------ setup
    def add_flows(self, actions: list[Action], has_ps: bool) -> None:
        """Flows of the bundles between tasks on different layouts (on a shared layout every lane already
        ran the producer before the consumer). A tensor moves once per destination layout."""
        tasks, layout_of_task = self.tasks, self.layout_of_task
        layout_id = np.fromiter((lay.id for lay in layout_of_task), dtype=np.int64, count=tasks.num_tasks)
        b_src, b_dst = tasks.bundle_src, tasks.bundle_dst
        b_same, tg_l = tasks.bundle_same_group, tasks.task_group_list
        ps_group = [a.mode == "ps" for a in actions] if has_ps else None
        flows, flows_into, flows_out_of = self.flows, self.flows_into, self.flows_out_of
        flow_of: dict[tuple, int] = {}          # (producer, destination layout id, bundle, wait_all) -> flow
        sent: set[tuple[int, int]] = set()      # (tensor, destination layout)
        b_own, b_shared, b_own_n = tasks.bundle_own, tasks.bundle_shared, tasks.bundle_own_tensors
        for b in np.flatnonzero(layout_id[tasks.bundle_src_array] != layout_id[tasks.bundle_dst_array]).tolist():
            k, t = b_src[b], b_dst[b]
            lk, ld = layout_of_task[k], layout_of_task[t]
            wait_all = ps_group is not None and b_same[b] and ps_group[tg_l[k]]
            key = (k, ld.id, b if lk.kind == "split" or ld.kind == "split" else -1, wait_all)
            m = flow_of.get(key)
            if m is None:
                m = flow_of[key] = len(flows)
                flows.append([k, ld, 0.0, 0.0, key[2], wait_all, 0])
                self.flow_consumer.append(t)
                flows_out_of.setdefault(k, []).append(m)
            fl = flows[m]
            per_example, fixed = b_own[b]
            fl[2] += per_example
            fl[3] += fixed
            fl[6] += b_own_n[b]
            for (tid, per_example, fixed) in b_shared[b]:
                if (tid, ld.id) not in sent:
                    sent.add((tid, ld.id))
                    fl[2] += per_example
                    fl[3] += fixed
                    fl[6] += 1
            xi = flows_into.setdefault(t, [])
            if not xi or xi[-1] != m:
                xi.append(m)

    def add_collectives(self, actions: list[Action], group_layouts: list[Layout | None],
                        weight_bytes: list[float], gathers: dict[int, list] | None = None,
                        weight_counts: list[int] | None = None, fuse: bool = False,
                        bucket_bytes: float | None = None) -> None:
        """ps groups pull their variables now (the forward tasks wait); gradients are all-reduced or pushed
        once the tasks producing them have run (``collectives_after``; the update tasks wait). GATHERS:
        op group -> its SFB all-gathers (``tag.sim.sfb.GatherCharge``), issued with its all-reduce; the
        update tasks also wait for each gather's local recompute. WEIGHT_COUNTS: trainable variables per
        group; a ps group's pull and push each pay the per-tensor cost per variable and remote worker (and
        the runtime's CPU work on slower CPU hosts: ``Routing.collective``'s seconds per variable).
        FUSE: all-reduce groups are summed in the buckets of ``tag.strategy.fusion.fusion_buckets`` (one
        collective per bucket, issued once every gradient of the bucket exists), as the rewriter fuses them;
        BUCKET_BYTES: where a bucket closes (None: ``FUSION_BUCKET_BYTES``)."""
        routing, rfree, release, record = self.routing, self.resource_free, self.release, self.record
        forward_tasks, coll_after, coll_deps = self.tasks.forward_tasks, self.tasks.coll_after, self.tasks.coll_deps
        update_tasks, post = self.tasks.update_tasks, self.collectives_after
        comm = self.comm_bytes
        coll_of: dict[int, tuple] = {}       # action id -> collective coefficients (() if none)
        fused = self._fused_buckets(actions, group_layouts, weight_bytes, gathers, bucket_bytes) if fuse else {}
        for g, a in enumerate(actions):
            W = weight_bytes[g]
            if gathers and g in gathers:
                devices = group_layouts[g].devices
                c = routing.collective("allgather", devices, a.placement, None)
                for ch in gathers[g]:
                    post.setdefault(coll_after[g], []).append(
                        (g, c[4], c[0] + c[1] * ch.block_bytes, c[5] * ch.block_bytes, coll_deps[g],
                         update_tasks[g], ch.recompute_s, "all-gather", ch.block_bytes, devices))
            if W <= 0 or a.mode == "partition":
                continue
            c = coll_of.get(id(a))
            if c is None:
                devices = group_layouts[g].devices
                if a.mode == "ps":
                    c = routing.collective("ps", devices, a.placement, int(a.ps_device))
                elif len(devices) > 1:
                    c = routing.collective("allreduce", devices, a.placement, None)
                else:
                    c = ()
                coll_of[id(a)] = c
            if not c or c[5] <= 0:
                continue
            if a.mode == "ps":
                dur = c[0] + c[1] * W
                if weight_counts is not None:
                    dur += weight_counts[g] * c[6]      # per variable (remote workers, slower CPU hosts)
                st = 0.0
                for r in c[4]:
                    if rfree[r] > st:
                        st = rfree[r]
                end = st + dur
                for r in c[4]:
                    rfree[r] = end
                comm += c[5] * W
                for t in forward_tasks[g]:
                    if end > release[t]:
                        release[t] = end
                if record is not None:
                    record.collectives.append((c[4], st, end, W * c[5], f"pull {self.group_names[g]}"))
                kind = "push"
            else:
                bucket = fused.get(g)
                if bucket is not None:
                    if bucket[0] == g:       # the bucket's collective, filed under its first group
                        W = sum(weight_bytes[h] for h in bucket)
                        post.setdefault(max(coll_after[h] for h in bucket), []).append((
                            g, c[7], min(c[0] + c[1] * W, c[2] + c[3] * W), c[5] * W,
                            [t for h in bucket for t in coll_deps[h]], [t for h in bucket for t in update_tasks[h]],
                            0.0, "all-reduce", W, group_layouts[g].devices))
                    continue
                dur = min(c[0] + c[1] * W, c[2] + c[3] * W)
                kind = "all-reduce"
            post.setdefault(coll_after[g], []).append((g, c[7], dur, c[5] * W, coll_deps[g], update_tasks[g], 0.0,
                                                       kind, W, group_layouts[g].devices))
        self.comm_bytes = comm

    def _fused_buckets(self, actions: list[Action], group_layouts: list[Layout | None], weight_bytes: list[float],
                       gathers: dict[int, list] | None, cap: float | None = None) -> dict[int, tuple[int, ...]]:
        """Op group -> its fusion bucket, for buckets of two groups or more. A bucket whose update tasks
        would be scheduled before its last gradient (never with the task order of a training step) keeps
        one collective per group, so that no update task is released before its collective is known."""
        replicated = [lay is not None and len(lay.devices) > 1 for lay in group_layouts]
        coll_after, update_tasks = self.tasks.coll_after, self.tasks.update_tasks
        out: dict[int, tuple[int, ...]] = {}
        for bucket in fusion_buckets(actions, weight_bytes, replicated, set(gathers or ()), cap=cap):
            if len(bucket) < 2:
                continue
            after = max(coll_after[h] for h in bucket)
            if all(t > after for h in bucket for t in update_tasks[h]):
                for h in bucket:
                    out[h] = bucket
        return out

    def _start_collectives(self, collectives: list[tuple]) -> None:
        """Start COLLECTIVES (issued after one task) once the tasks they wait for have finished on every
        lane and their links are free; release the tasks waiting for them (plus any local recompute)."""
        task_finish, resource_free, release, record = self.task_finish, self.resource_free, self.release, self.record
        collective_end = self.collective_end
        for g, res, dur, nbytes, deps, waiting, after, kind, payload, devices in collectives:
            ready = 0.0
            for dt in deps:
                if task_finish[dt] > ready:
                    ready = task_finish[dt]
            st = ready
            for r in res:
                if resource_free[r] > st:
                    st = resource_free[r]
            end = st + dur
            if self.serial is not None and kind != "pull":
                end += self._serialise(devices, st, end, 1 if kind == "push" else 0)
            for r in res:
                resource_free[r] = end
            self.comm_bytes += nbytes
            done = end + after
            if done > collective_end[g]:
                collective_end[g] = done
            for ut in waiting:
                if done > release[ut]:
                    release[ut] = done
            if record is not None:
                record.collectives.append((res, st, end, nbytes, f"{kind} {self.group_names[g]}"))
                if kind != "push":
                    record.collective_ops.append({"kind": kind.replace("-", ""), "group": g,
                                                  "devices": [int(d) for d in devices],
                                                  "bytes": float(payload), "start_s": st, "end_s": end})

    def _serialise(self, devices, st: float, end: float, column: int) -> float:
        """A synchronisation over DEVICES from ST to END beside the compute of their lanes: each CPU lane busy
        after ST is delayed by its fraction (``self.serial``, COLUMN 0 all-reduce, 1 push) of the overlap;
        returns the largest delay, by which the synchronisation ends later too (``tag.sim.host_cpu``)."""
        lane_of_device, fraction = self.serial
        lane_free = self.lane_free
        seen: list[int] = []
        extra = 0.0
        for d in devices:
            sigma = fraction[d, column]
            lane = int(lane_of_device[d])
            if sigma <= 0 or lane in seen:
                continue
            seen.append(lane)
            busy = min(end, lane_free[lane]) - st
            if busy > 0:
                lane_free[lane] += sigma * busy
                if sigma * busy > extra:
                    extra = sigma * busy
        return extra

    # ------------------------------------------------------------------ the list schedule
    def run(self, actions: list[Action]) -> float:
        """Schedule every task, transfer and collective; returns the step time (the last thing to end)."""
        T = self.tasks.num_tasks
        layout_of_task, ts_l, update = self.layout_of_task, self.tasks.task_stage_list, UPDATE_STAGE
        post = self.collectives_after
        task_finish, release, lane_free, arrival = self.task_finish, self.release, self.lane_free, self.arrival
        start, finish, batch = self.start, self.finish, self.batch
        flows_into, flows_out_of = self.flows_into, self.flows_out_of
        receivers = sorted(flows_into)
        todo = sorted(set(flows_out_of) | set(post))      # tasks with transfers to issue or collectives to start
        xi = pi = 0
        t = 0
        while t < T:
            lay = layout_of_task[t]
            # a run: consecutive tasks on one layout. Their inputs from other layouts come from earlier
            # tasks, so every release time is known now, except that of update tasks waiting for a
            # collective of this run: runs end before the first update task and after update tasks
            # that start a collective.
            e = t + 1
            if lay.kind != "split":
                while e < T and layout_of_task[e] is lay and not (ts_l[e] == update and ts_l[e - 1] < update) \
                        and not (ts_l[e - 1] == update and (e - 1) in post):
                    e += 1
            receiving = []       # tasks of the run with flows into them
            while xi < len(receivers) and receivers[xi] < e:
                receiving.append(receivers[xi])
                xi += 1
            if lay.kind == "split":
                self._run_split(t, lay, flows_into.get(t, ()))
                self.task_finish[t] = float(self.finish[:, t].max())
            elif (e - t) * len(lay.insts) >= _VECTOR_MIN:
                self._run_vectorised(t, e, lay, receiving)
            else:       # a short run: one lane after another (cheaper than numpy)
                for k in range(t, e):
                    incoming = flows_into.get(k) if receiving else None
                    r0 = release[k]
                    latest = 0.0
                    for lane, durations, lane_batch, _ in lay.insts:
                        r = r0
                        if incoming is not None:
                            for m in incoming:
                                x = arrival[m].get(lane, 0.0)
                                if x > r:
                                    r = x
                        s = lane_free[lane]
                        if r > s:
                            s = r
                        f = s + durations[k]
                        lane_free[lane] = f
                        start[lane, k] = s
                        finish[lane, k] = f
                        batch[lane, k] = lane_batch
                        if f > latest:
                            latest = f
                    task_finish[k] = latest
            # transfers out of the run and collectives it completes, in task order
            while pi < len(todo) and todo[pi] < e:
                k = todo[pi]
                pi += 1
                if k in flows_out_of:
                    self._send(k)
                collectives = post.get(k)
                if collectives is None:
                    continue
                self._start_collectives(collectives)
            t = e
        return max(max(self.lane_free, default=0.0), max(self.resource_free, default=0.0),
                   max(self.collective_end, default=0.0))

    def _run_vectorised(self, t: int, e: int, lay: Layout, receiving: list[int]) -> None:
        """Tasks T..E-1 on every lane of LAY at once: f_k = max(f_(k-1), release_k) + d_k, i.e.
        f = C + max(lane_free, running max of (release - C_(k-1))), C = cumulative durations.
        (Written without broadcasting, which costs more than the arithmetic at these sizes.)"""
        lane_free, arrival, flows_into = self.lane_free, self.arrival, self.flows_into
        durations = lay.durations[:, t:e]
        release = self.release[t:e]
        free = np.array([lane_free[lane] for lane in lay.lanes])
        if not receiving and not any(release):
            c0 = durations.copy()
            c0[:, 0] += free
            finish = np.add.accumulate(c0, axis=1)
        else:
            if receiving:
                rows = []
                for lane in lay.lanes:
                    r = list(release)
                    for k in receiving:
                        for m in flows_into[k]:
                            x = arrival[m].get(lane, 0.0)
                            if x > r[k - t]:
                                r[k - t] = x
                    rows.append(r)
                ready = np.array(rows)
            else:
                ready = np.array([release] * len(lay.lanes))
            cumulative = np.add.accumulate(durations, axis=1)
            x = ready - cumulative
            x += durations
            x[:, 0] = np.maximum(x[:, 0], free)
            finish = np.maximum.accumulate(x, axis=1)
            finish += cumulative
        rows_ = lay.lane_slice if lay.lane_slice is not None else lay.lane_idx
        self.finish[rows_, t:e] = finish
        self.start[rows_, t:e] = finish - durations
        self.batch[rows_, t:e] = lay.batch[:, t:e]
        for lane, x_ in zip(lay.lanes, finish[:, -1].tolist(), strict=True):
            lane_free[lane] = x_
        self.task_finish[t:e] = finish.max(axis=0).tolist()

    def _send(self, k: int) -> None:
        """Issue the transfers of every flow out of task K (it has run on all its lanes)."""
        lk = self.layout_of_task[k]
        fk = self.finish[:, k].tolist()
        rfree, rec, moves = self.resource_free, self.record, self.routing.moves
        flows, arrival = self.flows, self.arrival
        per_tensor = self.routing.cost.per_tensor_s
        for m in self.flows_out_of[k]:
            _, ld, per_example, fixed, b, wait_all, ntensors = flows[m]
            # between hosts every tensor is its own request (NetworkProfile.per_tensor_s)
            tensor_s = ntensors * per_tensor
            if wait_all:
                # gradients to the PS travel in the push collective: only wait for every replica
                arrival[m] = dict.fromkeys(ld.lanes, self.task_finish[k])
                continue
            if b >= 0:
                fins = {lane: fk[lane] for lane in lk.lanes}
                arrival[m] = self._split_bundle(b, lk, ld, fins)
                continue
            mk = ("c", lk.id, ld.id)
            cm = moves.get(mk)
            if cm is None:
                cm = self.routing.compiled_moves(mk, lk, ld)
            deps, routes1, routes2, full = cm
            arrd = {}            # destination lane -> arrival time
            for dl, sls in deps:
                x = 0.0
                for sl in sls:
                    y = fk[sl]
                    if y > x:
                        x = y
                arrd[dl] = x
            nbytes = 0.0
            if rec is None:
                # the search's hot loop: routes through one resource (a host bus) and through two (both
                # hosts' NICs) written out separately, as the recorded branch below does in general
                for (sl, dl, r1, lat, ipb, ex, cnt) in routes1:
                    nb = per_example * ex + fixed * cnt
                    if nb <= 0:
                        continue
                    nbytes += nb
                    st = fk[sl]
                    y = rfree[r1]
                    if y > st:
                        st = y
                    st += nb * ipb
                    rfree[r1] = st
                    st += lat
                    if st > arrd[dl]:
                        arrd[dl] = st
                for (sl, dl, r1, r2, r3, ipb1, ipb2, lat, ipb, ex, cnt) in routes2:
                    nb = per_example * ex + fixed * cnt
                    if nb <= 0:
                        continue
                    nbytes += nb
                    st = fk[sl]
                    y = rfree[r1]
                    if y > st:
                        st = y
                    y = rfree[r2]
                    if y > st:
                        st = y
                    if r3 >= 0:
                        y = rfree[r3]
                        if y > st:
                            st = y
                    # each NIC is held for the bytes at its own rate, the pair's link (and the transfer) at the link's
                    rfree[r1] = st + nb * ipb1 + tensor_s
                    rfree[r2] = st + nb * ipb2 + tensor_s
                    st += nb * ipb + tensor_s
                    if r3 >= 0:
                        rfree[r3] = st
                    st += lat
                    if st > arrd[dl]:
                        arrd[dl] = st
            else:   # the same schedule, recorded
                label = f"{self.task_labels[k]} -> {self.task_labels[self.flow_consumer[m]]}"
                for (sl, dl, res, lat, ipb, ex, cnt) in full:
                    nb = per_example * ex + fixed * cnt
                    if nb <= 0:
                        continue
                    nbytes += nb
                    st, end, held = self._hold(res, fk[sl], nb, lat, ipb, tensor_s)
                    arrd[dl] = max(arrd[dl], end)
                    rec.transfers.append((held, st, end, nb, label))
            self.comm_bytes += nbytes
            arrival[m] = arrd

    # ------------------------------------------------------------------ partition sub-tasks (slow path)
    def _hold(self, res: tuple, ready: float, nb: float, lat: float, ipb: float, tensor_s: float) -> tuple:
        """Hold RES for a transfer of NB bytes once READY: (start, arrival time, resources held). A host's bus is
        held while the bytes move; between hosts each NIC for the bytes at its own rate and the pair's link,
        if it has one, at the route's (``Routing.link_holds``), each also for the tensors' TENSOR_S."""
        rfree = self.resource_free
        if len(res) != 2:
            st = earliest_start(rfree, res, ready)
            free = st + nb * ipb
            occupy(rfree, res, free)
            return st, free + lat, res
        r3, ipb1, ipb2 = self.routing.link_holds(res)
        held = res if r3 < 0 else (*res, r3)
        st = earliest_start(rfree, held, ready)
        rfree[res[0]] = st + nb * ipb1 + tensor_s
        rfree[res[1]] = st + nb * ipb2 + tensor_s
        free = st + nb * ipb + tensor_s
        if r3 >= 0:
            rfree[r3] = free
        return st, free + lat, held

    def _transfer(self, p: int, c: int, nbytes: float, ready: float, label: str) -> float:
        """One transfer of NBYTES from device P to device C once READY: its arrival time."""
        res, lat, ipb = self.routing.route(p, c)
        st, end, held = self._hold(res, ready, nbytes, lat, ipb, 0.0)
        if self.record is not None:
            self.record.transfers.append((held, st, end, nbytes, label))
        return end

    def _run_split(self, t: int, lay: Layout, incoming: list[int] | tuple) -> None:
        """Run the per-device sub-tasks of split partition task T in order, with transfers between them."""
        parts = self.split_parts[t]
        order = {d: k for k, (d, _) in enumerate(parts)}
        moved = self.routing.split_internal_moves(t, parts, lay)
        internal_arrival: dict[int, float] = {}     # device -> when its inputs from earlier sub-tasks arrive
        label = f"{self.group_names[self.tasks.task_group_list[t]]} (split)"
        comm = 0.0
        for k, (lane, dur, lane_batch, _) in enumerate(lay.insts):
            d = parts[k][0]
            r = max(self.release[t], internal_arrival.get(d, 0.0))
            for m in incoming:
                x = self.arrival[m].get(lane, 0.0)
                if x > r:
                    r = x
            s = max(self.lane_free[lane], r)
            f = s + dur
            self.lane_free[lane] = f
            self.start[lane, t] = s
            self.finish[lane, t] = f
            self.batch[lane, t] = lane_batch
            for (ds, dd), nb in moved.items():
                if ds != d or nb <= 0:
                    continue
                comm += nb
                end = self._transfer(ds, dd, nb, f, label)
                if order[dd] > k:
                    internal_arrival[dd] = max(internal_arrival.get(dd, 0.0), end)
        self.comm_bytes += comm

    def _split_bundle(self, b: int, ls: Layout, ld: Layout, fins: dict[int, float]) -> dict[int, float]:
        """Arrival time per destination lane of bundle B when either side is a split partition task (FINS:
        finish time per source lane)."""
        deps, transfers = self.routing.split_moves(b, ls, ld, self.plans)
        arrd = {}
        for dl, sls in deps:
            arrd[dl] = max((fins.get(sl, 0.0) for sl in sls), default=0.0)
        comm = 0.0
        for (p, pl, c, cl, nb) in transfers:
            comm += nb
            end = self._transfer(p, c, nb, fins.get(pl, 0.0), "partition transfer")
            if end > arrd.get(cl, 0.0):
                arrd[cl] = end
        self.comm_bytes += comm
        return arrd
