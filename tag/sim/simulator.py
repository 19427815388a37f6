"""Step simulator: predict one training iteration of a Strategy on a Topology, fast enough for search.

What is simulated (the strategy semantics of DESIGN.md / tag.strategy):

- Work units are *tasks*: the ops of one op group in one stage (forward, backward, update; an op's stage
  is its phase raised to the latest stage of its ancestors, so the task graph of a ``group_ops`` grouping
  is acyclic). Tasks run in one fixed topological priority order (forward and backward first, update
  tasks last, ties by the ops' topological positions).
- Devices are simulated per *lane*: the devices of one device group that behave identically (same
  speed, same work) share a lane; a device that holds partitioned ops or a parameter server gets a lane
  of its own. Each lane runs its tasks in the priority order, one at a time, as soon as its inputs have
  arrived (an in-order list schedule: a GPU stream, not a work-conserving thread pool).
- A replicated group (allreduce / ps) runs every task on every device of its placement on that device's
  batch share (``batch_shares``; a lane uses the largest share among its devices). A partition group runs
  each op once on the full batch on ``strategy.partition[op]``; a task whose ops sit on several devices
  splits into one sub-task per device, ordered by their first op (dependencies between those sub-tasks
  that point backwards in that order are not waited for; their bytes are still counted).
- Tensors crossing tasks with different layouts move as the semantics say (batch-axis tensors: the
  examples that change device; others: the whole tensor from one producer device, the best-connected
  one). Transfers between devices of one host use that host's interconnect (``bus``); across hosts they
  use both hosts' network interfaces (``nic``). Contention model: every bus and NIC is one *serialised*
  resource (FIFO in the order transfers are issued; a transfer occupies all its resources for
  latency + bytes / bandwidth), so concurrent transfers through a NIC add up.
- Gradients of an allreduce group are all-reduced over its devices as one fused collective per op
  group (``CostModel.allreduce_coeffs``: best of ring and hierarchical) once the tasks producing them
  have finished everywhere; the collective occupies the NICs of the hosts involved (and the bus of each
  host with several of its devices); the group's update tasks wait for it. ps groups pull their
  variables from the PS at the start of the step and push gradients after the backward pass
  (``CostModel.ps_coeffs`` per direction, on the PS host's NIC and the workers' NICs); the update runs
  once, on the PS device. ``Strategy.sfb`` is not modelled yet (plain all-reduce is assumed).
- Memory per device: parameters + gradients + optimizer slots held there (allreduce: every replica; ps:
  trainable weights, slots and the summed gradient on the PS, a pulled copy, the gradients and
  non-trainable state on every worker; partition: on the variable's device) + the peak of live
  activations in the simulated schedule: a task's outputs that later tasks read are held on every lane
  that ran it from that task until their last reader (in the lane's task order: forward activations
  live until their backward use); ops that only alias their input (Identity, Reshape, ReadVariableOp,
  ...) hold no buffer of their own; the running task adds its largest op's inputs + outputs.
  Compared with each device's memory.
- Reported per op group (features for the GNN): ``group_makespan`` = last finish of the group's tasks or
  collective - first start; ``group_idle_after`` = mean, over the group's task instances, of the idle
  time of that lane before its next task (or the end of the step).

Everything that depends only on the graph, grouping and topology is precomputed in ``Simulator()``;
``evaluate`` does no per-op work except for partition groups (one vectorised lookup of their ops'
devices) and caches what depends on placements and batch shares across calls. Deterministic.

Example::

    import json, tag
    from tag.strategy.grouping import group_ops
    from tag.sim.simulator import Simulator
    from tag.strategy.types import Action, Strategy
    tg = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=64))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    grouping = group_ops(tg, target_groups=100)
    sim = Simulator(tg, topo, grouping)
    dp = Strategy(grouping, [Action(tuple(range(len(topo.groups))), "allreduce")] * grouping.num_groups)
    r = sim.evaluate(dp)
    r.step_time, r.peak_memory, r.feasible
    json.dump(sim.trace(dp), open("trace.json", "w"))     # chrome://tracing or ui.perfetto.dev
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from tag.cost.model import CostModel
from tag.errors import StrategyError
from tag.ir.algorithms import op_stages, topological_order
from tag.ir.types import TrainingGraph
from tag.strategy.types import Action, Grouping, Strategy, batch_shares
from tag.cluster.topology import Topology

STAGE_NAMES = ("forward", "backward", "update")
_VECTOR_MIN = 8      # runs of at least this many task instances are simulated with numpy
# ops whose output is their first input's buffer (no memory of their own)
ALIAS_TYPES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "ReadVariableOp", "Snapshot",
                         "StopGradient", "PreventGradient", "EnsureShape", "CheckNumerics", "Enter", "Exit"})


@dataclass
class SimResult:
    """Prediction for one training step. Arrays are per device (topology order) or per op group.

    ``utilisation``, ``compute_time``, ``group_makespan`` and ``group_idle_after`` are computed from the
    simulated schedule on first access (a search that reads only the step time and feasibility does not
    pay for them).
    """

    step_time: float                 # seconds
    peak_memory: np.ndarray          # bytes per device: static (below) + activation peak
    feasible: bool                   # every device fits its memory
    oom_devices: list[int]           # devices whose peak memory exceeds their capacity
    comm_bytes: float                # bytes sent over links per step (transfers + collectives)
    static_memory: np.ndarray = field(default_factory=lambda: np.zeros(0))      # params+grads+slots per device
    activation_memory: np.ndarray = field(default_factory=lambda: np.zeros(0))  # activation peak per device
    batch_size: int = 0
    _features: object = field(default=None, repr=False, compare=False)   # () -> dict of the arrays below

    def _feature(self, name: str) -> np.ndarray:
        f = self._features
        if callable(f):
            f = self._features = f()
        return f[name] if f else np.zeros(0)

    @property
    def utilisation(self) -> np.ndarray:
        """Busy compute time / step time, per device."""
        return self._feature("utilisation")

    @property
    def compute_time(self) -> np.ndarray:
        """Busy compute seconds per device."""
        return self._feature("compute_time")

    @property
    def group_makespan(self) -> np.ndarray:
        """Per op group: last finish of its tasks or its collective - first start of its tasks (s)."""
        return self._feature("group_makespan")

    @property
    def group_idle_after(self) -> np.ndarray:
        """Per op group: mean idle time of a lane right after one of the group's tasks, before the lane's
        next task or the end of the step (s)."""
        return self._feature("group_idle_after")


class _Layout:
    """Where one task runs in one evaluation: lanes with their per-replica batch, and which devices hold
    which examples of its outputs."""

    __slots__ = ("id", "kind", "insts", "holdings", "devices", "lanes", "key", "lane_idx", "tmT", "bvec", "bmat",
                 "lane_slice")

    def __init__(self, id_, kind, insts, holdings, devices, key):
        self.id = id_
        self.kind = kind            # "rep" (replicated), "dev" (one device), "split" (partition sub-tasks)
        self.insts = insts          # [(lane, durations per task (list; a float for split), batch, array)]
        self.holdings = holdings    # [(device, lo, hi, lane)]
        self.devices = devices
        self.lanes = tuple(dict.fromkeys(i[0] for i in insts))
        self.key = key
        self.lane_idx = np.array([i[0] for i in insts], dtype=np.int64)
        self.bvec = np.array([i[2] for i in insts], dtype=np.float64)
        # durations and batch per lane (rows) and task (columns), for runs simulated with numpy
        self.tmT = np.stack([i[3] for i in insts]) if kind != "split" else None
        self.bmat = np.repeat(self.bvec[:, None], len(insts[0][3]), axis=1) if kind != "split" else None
        li = self.lane_idx
        self.lane_slice = slice(int(li[0]), int(li[0]) + len(li)) if len(li) and np.array_equal(
            li, np.arange(li[0], li[0] + len(li))) else None


class _Lanes:
    """Lane assignment for one set of devices that need their own lane."""

    __slots__ = ("key", "lanes", "lane_dg", "lane_of_device", "by_group")

    def __init__(self, topology: Topology, special: frozenset):
        self.key = special
        self.lanes: list[tuple[int, ...]] = []
        self.lane_dg: list[int] = []
        self.lane_of_device = np.zeros(topology.num_devices, dtype=np.int64)
        self.by_group: list[list[int]] = []
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


class Simulator:
    """Discrete-event simulator of one training step (see the module docstring for the model)."""

    def __init__(self, graph: TrainingGraph, topology: Topology, grouping: Grouping,
                 cost_model: CostModel | None = None):
        n = len(graph.ops)
        if len(grouping.group_of_op) != n:
            raise StrategyError(f"grouping covers {len(grouping.group_of_op)} ops but the graph has {n}")
        if topology.num_devices == 0:
            raise StrategyError("the topology has no devices")
        self.graph, self.topology, self.grouping = graph, topology, grouping
        self.cost = cost_model if cost_model is not None else CostModel(graph, topology)
        self.num_groups = G = grouping.num_groups
        gop = np.asarray(grouping.group_of_op, dtype=np.int64)
        if n and (gop.min() < 0 or gop.max() >= G):
            raise StrategyError("grouping.group_of_op names a group outside 0..num_groups-1")
        self._gop = gop
        order = topological_order(graph)
        stage = op_stages(graph, order).astype(np.int64)
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        self._pos = pos

        # ---- tasks = (group, stage), numbered in the fixed priority order
        key = gop * 3 + stage
        ukeys, key_inv = np.unique(key, return_inverse=True)
        K = len(ukeys)
        minpos = np.full(K, np.iinfo(np.int64).max)
        np.minimum.at(minpos, key_inv, pos)
        src = np.array([e.src for e in graph.edges] + [c[0] for c in graph.control_edges], dtype=np.int64)
        dst = np.array([e.dst for e in graph.edges] + [c[1] for c in graph.control_edges], dtype=np.int64)
        ka, kb = key_inv[src], key_inv[dst]
        cross = ka != kb
        pairs = np.unique(np.stack([ka[cross], kb[cross]], 1), axis=0) if cross.any() else np.zeros((0, 2), np.int64)
        succ: list[list[int]] = [[] for _ in range(K)]
        indeg = np.zeros(K, dtype=np.int64)
        for a, b in pairs.tolist():
            succ[a].append(b)
            indeg[b] += 1
        prio = [(int(ukeys[k] % 3 == 2), int(minpos[k]), int(ukeys[k])) for k in range(K)]
        heap = [(prio[k], k) for k in range(K) if indeg[k] == 0]
        heapq.heapify(heap)
        done = np.zeros(K, dtype=bool)
        proc = []
        indeg_l = indeg.tolist()
        while len(proc) < K:
            if not heap:   # a cycle (only with hand-made groupings): take the best remaining task
                k = min((prio[k], k) for k in range(K) if not done[k])[1]
                indeg_l[k] = 0
                heapq.heappush(heap, (prio[k], k))
            _, k = heapq.heappop(heap)
            if done[k]:
                continue
            done[k] = True
            proc.append(k)
            for j in succ[k]:
                indeg_l[j] -= 1
                if indeg_l[j] == 0 and not done[j]:
                    heapq.heappush(heap, (prio[j], j))
        rank = np.empty(K, dtype=np.int64)
        rank[np.asarray(proc, dtype=np.int64)] = np.arange(K)
        self.num_tasks = T = K
        self._task_of_op = rank[key_inv]
        tkeys = ukeys[np.asarray(proc, dtype=np.int64)] if K else ukeys
        self.task_group = (tkeys // 3).astype(np.int64)
        self.task_stage = (tkeys % 3).astype(np.int64)
        self._tg_l = self.task_group.tolist()
        self._ts_l = self.task_stage.tolist()
        self._task_ops = [[] for _ in range(T)]
        for i in np.argsort(self._task_of_op, kind="stable").tolist():
            self._task_ops[self._task_of_op[i]].append(i)
        self._task_ops = [np.asarray(x, dtype=np.int64) for x in self._task_ops]
        self._task_minpos = np.array([pos[x].min() for x in self._task_ops], dtype=np.int64) if T else np.zeros(0)
        self._members = [np.flatnonzero(gop == g) for g in range(G)]
        self._members_l = [m.tolist() for m in self._members]
        self._tasks_of_group: list[list[int]] = [[] for _ in range(G)]
        for t in range(T):
            self._tasks_of_group[self._tg_l[t]].append(t)

        # ---- data bundles between tasks (one per (producer task, consumer task))
        top = self._task_of_op
        e_src = np.array([e.src for e in graph.edges], dtype=np.int64)
        e_dst = np.array([e.dst for e in graph.edges], dtype=np.int64)
        e_F = np.array([max(e.nbytes.fixed, 0.0) for e in graph.edges])
        e_P = np.array([max(e.nbytes.per_example, 0.0) for e in graph.edges])
        tensors = [e.tensor for e in graph.edges]
        bundle_of: dict[tuple[int, int], list] = {}
        seen_tensor: set[tuple[str, int]] = set()
        contrib: dict[tuple[int, int], list] = {}
        tensor_id: dict[str, int] = {}
        b_tensors: dict[tuple[int, int], list] = {}
        self.dropped_dependencies = 0
        for i in range(len(tensors)):
            ts, td = int(top[e_src[i]]), int(top[e_dst[i]])
            if ts == td:
                continue
            if ts > td:
                self.dropped_dependencies += 1
                continue
            acc = bundle_of.setdefault((ts, td), [0.0, 0.0])
            if (tensors[i], td) not in seen_tensor:
                seen_tensor.add((tensors[i], td))
                acc[0] += e_P[i]
                acc[1] += e_F[i]
                tid = tensor_id.setdefault(tensors[i], len(tensor_id))
                b_tensors.setdefault((ts, td), []).append((tid, float(e_P[i]), float(e_F[i])))
            contrib.setdefault((ts, td), []).append(
                (int(e_src[i]), int(e_dst[i]), float(e_P[i]), float(e_F[i]), tensors[i]))
        for a, b in graph.control_edges:
            ts, td = int(top[a]), int(top[b])
            if ts < td:
                bundle_of.setdefault((ts, td), [0.0, 0.0])
            elif ts > td:
                self.dropped_dependencies += 1
        bkeys = sorted(bundle_of)
        self._b_src = [k[0] for k in bkeys]
        self._b_dst = [k[1] for k in bkeys]
        self._b_P = [bundle_of[k][0] for k in bkeys]
        self._b_F = [bundle_of[k][1] for k in bkeys]
        self._b_contrib = [contrib.get(k, []) for k in bkeys]
        # per bundle: bytes of tensors no other task reads (always moved with it), and the tensors other
        # tasks read too, [(tensor id, per-example, fixed bytes)], moved once per destination layout
        readers: dict[int, int] = {}
        for lst in b_tensors.values():
            for tid, _, _ in lst:
                readers[tid] = readers.get(tid, 0) + 1
        self._b_own = []
        self._b_shared = []
        for k in bkeys:
            own_p = own_f = 0.0
            shared = []
            for tid, P, F in b_tensors.get(k, []):
                if readers[tid] > 1:
                    shared.append((tid, P, F))
                else:
                    own_p += P
                    own_f += F
            self._b_own.append((own_p, own_f))
            self._b_shared.append(shared)
        self._b_src_arr = np.asarray(self._b_src, dtype=np.int64)
        self._b_dst_arr = np.asarray(self._b_dst, dtype=np.int64)
        self._b_same_group = [self._tg_l[a] == self._tg_l[b] for a, b in bkeys]
        self._in_b: list[list[int]] = [[] for _ in range(T)]
        self._out_b: list[list[int]] = [[] for _ in range(T)]
        for bi, (a, b) in enumerate(bkeys):
            self._in_b[b].append(bi)
            self._out_b[a].append(bi)
        # edges inside a task (only matter when a partition splits the task over devices)
        self._internal: list[list] = [[] for _ in range(T)]
        for i in range(len(tensors)):
            ts = int(top[e_src[i]])
            if ts == int(top[e_dst[i]]):
                self._internal[ts].append((int(e_src[i]), int(e_dst[i]), float(e_P[i]), float(e_F[i]), tensors[i]))

        # ---- memory: outputs read by later tasks live until the last reader finishes. Ops that only
        # alias their input (Identity, Reshape, ReadVariableOp, ...) extend the life of the buffer they
        # alias instead of holding one; weights and their gradients are static memory, not activations.
        out_bytes: dict[str, tuple[int, float, float]] = {}
        for i, op in enumerate(graph.ops):
            for tinfo in op.outputs:
                out_bytes[tinfo.name] = (i, max(tinfo.nbytes.per_example, 0.0), max(tinfo.nbytes.fixed, 0.0))
        alias_in: dict[int, str] = {}
        for i, op in enumerate(graph.ops):
            if op.type in ALIAS_TYPES and op.inputs:
                alias_in[i] = op.inputs[0].lstrip("^")
        root_cache: dict[str, str] = {}

        def root_of(name: str) -> str:
            seen_ = []
            while name not in root_cache:
                seen_.append(name)
                prod = out_bytes.get(name, (None,))[0]
                if prod is None or prod not in alias_in or len(seen_) > 64:
                    root_cache[name] = name
                    break
                name = alias_in[prod]
            r_ = root_cache[name]
            for x in seen_:
                root_cache[x] = r_
            return r_

        static_roots = {root_of(v.gradient.lstrip("^")) for v in graph.variables
                        if v.kind == "trainable" and v.gradient}
        last_reader: dict[str, int] = {}
        for i in range(len(tensors)):
            r_ = root_of(tensors[i])
            if r_ in static_roots or r_ not in out_bytes:
                continue
            ts, td = int(top[out_bytes[r_][0]]), int(top[e_dst[i]])
            if td > ts:
                last_reader[r_] = max(last_reader.get(r_, -1), td)
        mb: dict[tuple[int, int], list] = {}
        for name, last in last_reader.items():
            op, P, F = out_bytes[name]
            if P <= 0 and F <= 0:
                continue
            acc = mb.setdefault((int(top[op]), last), [0.0, 0.0])
            acc[0] += P
            acc[1] += F
        mkeys = sorted(mb)
        self._mb_src = np.array([k[0] for k in mkeys], dtype=np.int64)
        self._mb_last = np.array([k[1] for k in mkeys], dtype=np.int64)
        self._mb_P = np.array([mb[k][0] for k in mkeys], dtype=np.float64)
        self._mb_F = np.array([mb[k][1] for k in mkeys], dtype=np.float64)
        # row groupings for summing bundles per producer task and per last reader task
        self._mb_src_u, self._mb_src_starts = np.unique(self._mb_src, return_index=True)
        self._mb_last_order = np.argsort(self._mb_last, kind="stable")
        self._mb_last_u, self._mb_last_starts = np.unique(self._mb_last[self._mb_last_order], return_index=True)
        # transient working set of a task: its largest op's inputs + outputs
        a = self.cost.arrays
        ref = a.mem_fixed + a.mem_per_example * max(graph.batch_size, 1)
        best = np.full(T, -1, dtype=np.int64)
        for t in range(T):
            ops_t = self._task_ops[t]
            best[t] = ops_t[np.argmax(ref[ops_t])]
        self._tr_F = a.mem_fixed[best] if T else np.zeros(0)
        self._tr_P = a.mem_per_example[best] if T else np.zeros(0)

        # ---- variables per group
        W = np.zeros(G)
        S = np.zeros(G)
        X = np.zeros(G)
        var_by_name = {v.name: v for v in graph.variables}
        claimed: set[str] = set()
        part_vars: list[list[tuple[int, float]]] = [[] for _ in range(G)]
        grad_tasks: list[set[int]] = [set() for _ in range(G)]
        index = graph.op_index
        for v in graph.variables:
            if v.kind != "trainable":
                continue
            g = int(gop[v.op])
            slot = float(v.slot_bytes) if v.slot_bytes else float(sum(
                var_by_name[s].nbytes for s in v.slots if s in var_by_name))
            claimed.update(v.slots)
            W[g] += v.nbytes
            S[g] += slot
            part_vars[g].append((v.op, 2.0 * v.nbytes + slot))
            if v.gradient:
                j = index.get(v.gradient.rsplit(":", 1)[0].lstrip("^"))
                if j is not None:
                    grad_tasks[g].add(int(top[j]))
        for v in graph.variables:
            if v.kind == "trainable" or v.name in claimed:
                continue
            g = int(gop[v.op])
            X[g] += v.nbytes
            part_vars[g].append((v.op, float(v.nbytes)))
        self._W, self._S, self._X = W, S, X
        self._W_l, self._S_l, self._X_l = W.tolist(), S.tolist(), X.tolist()
        self._task_by_group = np.argsort(self.task_group, kind="stable")
        self._task_by_group_starts = np.searchsorted(self.task_group[self._task_by_group], np.arange(G))
        self._part_vars = [(np.array([p[0] for p in pv], dtype=np.int64), np.array([p[1] for p in pv]))
                           for pv in part_vars]
        # collectives wait for the tasks producing the gradients; update tasks after them wait for it
        self._coll_after: list[int] = []
        self._coll_deps: list[list[int]] = []
        self._upd_tasks: list[list[int]] = []
        self._fwd_tasks: list[list[int]] = []
        for g in range(G):
            tasks = self._tasks_of_group[g]
            deps = sorted(grad_tasks[g]) or [t for t in tasks if self._ts_l[t] == 1] or \
                [t for t in tasks if self._ts_l[t] < 2] or tasks[:1]
            after = max(deps) if deps else -1
            self._coll_deps.append(deps)
            self._coll_after.append(after)
            self._upd_tasks.append([t for t in tasks if self._ts_l[t] == 2 and t > after])
            self._fwd_tasks.append([t for t in tasks if self._ts_l[t] == 0])

        # ---- topology helpers
        self._H = len(topology.hosts)
        self._dev_host = [d.host_index for d in topology.devices]
        self._dev_dg = [d.group for d in topology.devices]
        self._dev_mem = np.array([d.memory_bytes for d in topology.devices], dtype=np.float64)
        self._dev_speed = [d.peak_flops for d in topology.devices]
        self._bw = self.cost.topology.bandwidth      # with the profile's network calibration, if any
        self._lat = self.cost.topology.latency
        net = self.cost.profile.network
        self._step_overhead = net.step_overhead_s if net is not None else 0.0
        self._res_names = [f"{h.name} interconnect" for h in topology.hosts] + \
                          [f"{h.name} network" for h in topology.hosts]

        # ---- caches across evaluations
        self._tables: dict[tuple[int, float], tuple] = {}
        self._lanes_cache: dict[frozenset, _Lanes] = {}
        self._layouts: dict[tuple, _Layout] = {}
        self._moves: dict[tuple[int, int], tuple] = {}
        self._shares: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._coll: dict[tuple, tuple] = {}
        self._part_cache: dict[tuple[int, bytes], dict] = {}
        self._valid_actions: set[Action] = set()
        self._next_layout_id = 0

    @property
    def cost_model(self) -> CostModel:
        """The cost model the simulator uses (the one passed in, or a default CostModel)."""
        return self.cost

    # ------------------------------------------------------------------ cached building blocks
    def _table(self, dg: int, batch: float) -> tuple[list[float], np.ndarray]:
        """Seconds per task on one device of device group DG at per-replica BATCH (as list and array)."""
        k = (dg, float(batch))
        t = self._tables.get(k)
        if t is None:
            if len(self._tables) > 4096:
                self._tables.clear()
            times = self.cost.op_times(dg, batch)
            arr = np.bincount(self._task_of_op, weights=times, minlength=self.num_tasks)
            t = (arr.tolist(), arr)
            self._tables[k] = t
        return t

    def _lanes(self, special: frozenset) -> _Lanes:
        ln = self._lanes_cache.get(special)
        if ln is None:
            ln = _Lanes(self.topology, special)
            self._lanes_cache[special] = ln
        return ln

    def _devices_of(self, placement: tuple[int, ...]) -> list[int]:
        return [d for g in placement for d in self.topology.groups[g].devices]

    def _shares_of(self, placement: tuple[int, ...], B: int) -> list[int]:
        k = (placement, B)
        s = self._shares.get(k)
        if s is None:
            devs = self._devices_of(placement)
            s = batch_shares([self._dev_speed[d] for d in devs], B)
            self._shares[k] = s
        return s

    def _new_layout(self, key, kind, insts, holdings, devices) -> _Layout:
        if len(self._layouts) > 20000:   # bound the caches; ids keep counting so they never repeat
            self._layouts.clear()
            self._moves.clear()
        self._next_layout_id += 1
        lay = _Layout(self._next_layout_id, kind, insts, holdings, devices, key)
        self._layouts[key] = lay
        return lay

    def _rep_layout(self, placement: tuple[int, ...], lanes: _Lanes, B: int) -> _Layout:
        key = ("r", placement, lanes.key, B)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        devs = self._devices_of(placement)
        shares = self._shares_of(placement, B)
        share_of = dict(zip(devs, shares))
        holdings, lo = [], 0
        for d, s in zip(devs, shares):
            holdings.append((d, lo, lo + s, int(lanes.lane_of_device[d])))
            lo += s
        insts = []
        for g in placement:
            for lane in lanes.by_group[g]:
                b = max(share_of[d] for d in lanes.lanes[lane])
                tl, ta = self._table(g, b)
                insts.append((lane, tl, b, ta))
        return self._new_layout(key, "rep", insts, holdings, tuple(devs))

    def _dev_layout(self, device: int, lanes: _Lanes, B: int) -> _Layout:
        key = ("d", device, lanes.key, B)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        lane = int(lanes.lane_of_device[device])
        tl, ta = self._table(self._dev_dg[device], B)
        insts = [(lane, tl, B, ta)]
        return self._new_layout(key, "dev", insts, [(device, 0, B, lane)], (device,))

    def _route(self, p: int, c: int) -> tuple:
        hp, hc = self._dev_host[p], self._dev_host[c]
        res = (hp,) if hp == hc else (self._H + hp, self._H + hc)
        return res, float(self._lat[p, c]), 1.0 / float(self._bw[p, c])

    def _best_source(self, sources: list[int], c: int) -> int:
        return max(sources, key=lambda p: (float(self._bw[p, c]), -p))

    def _movement(self, ls: _Layout, ld: _Layout) -> tuple:
        """(deps, routes) for a tensor bundle from layout LS to layout LD (cached):
        deps = [(dst lane, (src lanes...))]; routes = [(src lane, dst lane, resources, latency,
        seconds per byte, examples moved, whole copies moved)]."""
        k = (ls.id, ld.id)
        mv = self._moves.get(k)
        if mv is not None:
            return mv
        deps: dict[int, set] = {}
        routes: dict[tuple, list] = {}
        src_dev = {h[0]: h for h in ls.holdings}
        src_list = [h[0] for h in ls.holdings]
        for (c, clo, chi, cl) in ld.holdings:
            dset = deps.setdefault(cl, set())
            for (p, plo, phi, pl) in ls.holdings:
                ov = min(chi, phi) - max(clo, plo)
                if ov <= 0:
                    continue
                dset.add(pl)
                if p != c:
                    res, lat, ipb = self._route(p, c)
                    r = routes.setdefault((pl, cl, res), [0.0, 0.0, 0.0, 0.0])
                    r[0] += ov
                    r[2] = max(r[2], lat)
                    r[3] = max(r[3], ipb)
            if c in src_dev:
                dset.add(src_dev[c][3])
            else:
                p = self._best_source(src_list, c)
                pl = src_dev[p][3]
                dset.add(pl)
                res, lat, ipb = self._route(p, c)
                r = routes.setdefault((pl, cl, res), [0.0, 0.0, 0.0, 0.0])
                r[1] += 1
                r[2] = max(r[2], lat)
                r[3] = max(r[3], ipb)
        mv = ([(dl, tuple(sorted(s))) for dl, s in sorted(deps.items())],
              [(k_[0], k_[1], k_[2], v[2], v[3], v[0], v[1]) for k_, v in sorted(routes.items())])
        self._moves[k] = mv
        return mv

    def _compiled_moves(self, key: tuple, ls: _Layout, ld: _Layout) -> tuple:
        """``_movement`` from LS to LD with its routes split by how many resources they hold:
        (deps, [(sl, dl, r, lat, s/byte, examples, copies)], [(sl, dl, r1, r2, ...)], all routes in
        that order) (cached)."""
        deps, routes = self._movement(ls, ld)
        r1 = [(sl, dl, res[0], lat, ipb, ex, cnt) for (sl, dl, res, lat, ipb, ex, cnt) in routes if len(res) == 1]
        r2 = [(sl, dl, res[0], res[1], lat, ipb, ex, cnt) for (sl, dl, res, lat, ipb, ex, cnt) in routes
              if len(res) == 2]
        full = [r for r in routes if len(r[2]) == 1] + [r for r in routes if len(r[2]) == 2]
        cm = (deps, r1, r2, full)
        self._moves[key] = cm
        return cm

    def _collective(self, kind: str, placement: tuple[int, ...], ps_device: int | None) -> tuple:
        """(fixed s, s per byte, alt fixed, alt s per byte, resources, bytes multiplier) of a collective."""
        k = (kind, placement, ps_device)
        c = self._coll.get(k)
        if c is not None:
            return c
        devs = self._devices_of(placement)
        hosts: dict[int, int] = {}
        for d in devs:
            hosts[self._dev_host[d]] = hosts.get(self._dev_host[d], 0) + 1
        if kind == "allreduce":
            (a1, b1), (a2, b2) = self.cost.allreduce_coeffs(devs)
            res = tuple(sorted([h for h, cnt in hosts.items() if cnt > 1] +
                               ([self._H + h for h in hosts] if len(hosts) > 1 else [])))
            c = (a1, b1, a2, b2, res, 2.0 * (len(devs) - 1))
        else:
            workers = [d for d in devs if d != ps_device]
            a, b = self.cost.ps_coeffs(devs, ps_device)
            ph = self._dev_host[ps_device]
            rs = set()
            for w in workers:
                wh = self._dev_host[w]
                if wh == ph:
                    rs.add(ph)
                else:
                    rs.update((self._H + ph, self._H + wh))
            c = (a, b, a, b, tuple(sorted(rs)), float(len(workers)))
        self._coll[k] = c
        return c

    def _partition_array(self, partition: dict) -> np.ndarray:
        """strategy.partition as an array over ops (-1: not listed)."""
        n = len(self._gop)
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

    def _partition_plan(self, g: int, part: np.ndarray, action: Action, lanes_needed: set) -> dict:
        """Per task of partition group G: ("dev", device) or ("split", [(device, ops)...]) + variable devices."""
        members = self._members_l[g]
        devs = part[self._members[g]]
        k = (g, action.placement, devs.tobytes())
        plan = self._part_cache.get(k)
        if plan is None:
            allowed = np.array(self._devices_of(action.placement), dtype=np.int64)
            bad = ~np.isin(devs, allowed)
            if bad.any():
                i = members[int(np.flatnonzero(bad)[0])]
                raise StrategyError(f"op {self.graph.ops[i].name!r} of op group {g} is partitioned onto device "
                                    f"{int(devs[np.flatnonzero(bad)[0]])}, outside the group's placement "
                                    f"{list(action.placement)}")
            dev_of = dict(zip(members, devs.tolist()))
            tasks = {}
            for t in self._tasks_of_group[g]:
                ops_t = self._task_ops[t].tolist()
                on = {}
                for i in ops_t:
                    on.setdefault(dev_of[i], []).append(i)
                if len(on) == 1:
                    tasks[t] = ("dev", next(iter(on)))
                else:
                    parts = sorted(on.items(), key=lambda kv: min(self._pos[i] for i in kv[1]))
                    tasks[t] = ("split", [(d, np.asarray(o, dtype=np.int64)) for d, o in parts])
            vops, vbytes = self._part_vars[g]
            plan = {"tasks": tasks, "dev_of": dev_of, "devices": sorted(set(devs.tolist())), "layouts": {},
                    "var_dev": np.array([dev_of[int(o)] for o in vops], dtype=np.int64), "var_bytes": vbytes}
            if len(self._part_cache) > 4096:
                self._part_cache.clear()
            self._part_cache[k] = plan
        lanes_needed.update(plan["devices"])
        return plan

    def _check_action(self, a: Action) -> None:
        if a in self._valid_actions:
            return
        ng = len(self.topology.groups)
        for p in a.placement:
            if not 0 <= p < ng:
                raise StrategyError(f"an action places op groups on device group {p}, "
                                    f"but the topology has device groups 0..{ng - 1}")
        if a.mode == "ps":
            if not 0 <= int(a.ps_device) < self.topology.num_devices:
                raise StrategyError(f"ps_device {a.ps_device} is not a device of the topology "
                                    f"(0..{self.topology.num_devices - 1})")
        self._valid_actions.add(a)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, strategy: Strategy, batch_size: int | None = None) -> SimResult:
        """Simulate one step of STRATEGY at global batch BATCH_SIZE (default: the graph's)."""
        return self._run(strategy, batch_size, record=None)

    def trace(self, strategy: Strategy, batch_size: int | None = None) -> dict:
        """Chrome trace (chrome://tracing, Perfetto) of one simulated step: one row per device, one per
        host interconnect and network interface; ``ph: "X"`` events in microseconds."""
        rec: dict = {"transfers": [], "collectives": []}
        res = self._run(strategy, batch_size, record=rec)
        topo = self.topology
        lanes: _Lanes = rec["lanes"]
        events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "devices"}},
                  {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "links"}}]
        for d in topo.devices:
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d.index,
                           "args": {"name": f"{d.name} ({d.device_type})"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d.index,
                           "args": {"sort_index": d.index}})
        for r, name in enumerate(self._res_names):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": r, "args": {"name": name}})
        names = self.grouping.names
        S, F, Bm = rec["matrices"]
        for t, lane in zip(*np.nonzero(F >= 0)):
            t, lane = int(t), int(lane)
            g, st = self._tg_l[t], self._ts_l[t]
            for d in lanes.lanes[lane]:
                events.append({"name": f"{names[g]} [{STAGE_NAMES[st]}]", "cat": "compute", "ph": "X",
                               "ts": float(S[t, lane]) * 1e6, "dur": max(float(F[t, lane] - S[t, lane]), 0.0) * 1e6,
                               "pid": 0, "tid": int(d),
                               "args": {"group": g, "stage": STAGE_NAMES[st], "batch": float(Bm[t, lane])}})
        for (res_ids, st, fn, nbytes, label) in rec["transfers"] + rec["collectives"]:
            for r in res_ids:
                events.append({"name": label, "cat": "comm", "ph": "X", "ts": st * 1e6,
                               "dur": max(fn - st, 0.0) * 1e6, "pid": 1, "tid": int(r),
                               "args": {"bytes": float(nbytes)}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"step_time_s": res.step_time, "feasible": res.feasible,
                              "comm_bytes": res.comm_bytes, "strategy": strategy.name}}

    def _run(self, strategy: Strategy, batch_size: int | None, record: dict | None) -> SimResult:
        G, T = self.num_groups, self.num_tasks
        if strategy.grouping is not self.grouping and (
                len(strategy.grouping.group_of_op) != len(self._gop)
                or not np.array_equal(strategy.grouping.group_of_op, self._gop)):
            raise StrategyError("the strategy's grouping is not the simulator's grouping")
        B = int(self.graph.batch_size if batch_size is None else batch_size)
        if B <= 0:
            raise StrategyError(f"batch size must be positive, got {B}")
        actions = strategy.actions
        if len(actions) != G:
            raise StrategyError(f"strategy has {len(actions)} actions for {G} op groups")

        # distinct actions (by object: strategies usually share Action objects between groups)
        uniq: dict[int, Action] = {}
        for a in actions:
            if id(a) not in uniq:
                uniq[id(a)] = a
        special: set[int] = set()
        any_partition = False
        for a in uniq.values():
            self._check_action(a)
            if a.mode == "ps":
                special.add(int(a.ps_device))
            elif a.mode == "partition":
                any_partition = True
        plans: dict[int, dict] = {}
        if any_partition:
            part = self._partition_array(strategy.partition)
            pgroups = [g for g, a in enumerate(actions) if a.mode == "partition"]
            is_part = np.zeros(G, dtype=bool)
            is_part[pgroups] = True
            missing = np.flatnonzero(is_part[self._gop] & (part < 0))
            if len(missing):
                i = int(missing[0])
                g = int(self._gop[i])
                raise StrategyError(f"op group {g} ({self.grouping.names[g]}) is partitioned but op "
                                    f"{self.graph.ops[i].name!r} has no device in strategy.partition")
            for g in pgroups:
                plans[g] = self._partition_plan(g, part, actions[g], special)
        lanes = self._lanes(frozenset(special))
        L = len(lanes.lanes)

        # layout of every task
        rep_of: dict[int, _Layout] = {}
        ps_of: dict[int, _Layout] = {}
        for k, a in uniq.items():
            if a.mode != "partition":
                rep_of[k] = self._rep_layout(a.placement, lanes, B)
                if a.mode == "ps":
                    ps_of[k] = self._dev_layout(int(a.ps_device), lanes, B)
        group_lays = [rep_of.get(id(a)) for a in actions]
        lay_of_task = [group_lays[g] for g in self._tg_l]
        split_info: dict[int, list] = {}
        if ps_of or plans:
            for g, a in enumerate(actions):
                if a.mode == "ps":
                    pl = ps_of[id(a)]
                    for t in self._tasks_of_group[g]:
                        if self._ts_l[t] == 2:
                            lay_of_task[t] = pl
                elif a.mode == "partition":
                    plan = plans[g]
                    lk = (lanes.key, B)
                    lays = plan["layouts"].get(lk)
                    if lays is None:
                        lays = {}
                        for t, (kind, what) in plan["tasks"].items():
                            lays[t] = (self._dev_layout(what, lanes, B) if kind == "dev"
                                       else self._split_layout(t, what, lanes, B))
                        if len(plan["layouts"]) > 64:
                            plan["layouts"].clear()
                        plan["layouts"][lk] = lays
                    for t, lay in lays.items():
                        lay_of_task[t] = lay
                        if lay.kind == "split":
                            split_info[t] = plan["tasks"][t][1]
        # only bundles between different layouts need work: on a shared layout every lane already ran
        # the producer before the consumer (lanes run tasks in priority order)
        # Tensors from one task to tasks of one other layout travel together (one transfer per route).
        # flows[m] = (producer task, destination layout, per-example bytes, fixed bytes, bundle or -1,
        # wait-for-all flag); xin / xout: flows into / out of each task.
        xin: dict[int, list[int]] = {}
        xout: dict[int, list[int]] = {}
        flows: list[list] = []
        if len(uniq) > 1 or ps_of or plans:
            lid = np.fromiter((lay.id for lay in lay_of_task), dtype=np.int64, count=T)
            b_src, b_dst = self._b_src, self._b_dst
            b_same, tg_l = self._b_same_group, self._tg_l
            ps_group = [a.mode == "ps" for a in actions] if ps_of else None
            flow_of: dict[tuple, int] = {}
            sent: set[tuple[int, int]] = set()     # (tensor, destination layout): a tensor moves once
            b_own, b_shared = self._b_own, self._b_shared
            for b in np.flatnonzero(lid[self._b_src_arr] != lid[self._b_dst_arr]).tolist():
                k, t = b_src[b], b_dst[b]
                lk, ld = lay_of_task[k], lay_of_task[t]
                wait_all = ps_group is not None and b_same[b] and ps_group[tg_l[k]]
                key = (k, ld.id, b if lk.kind == "split" or ld.kind == "split" else -1, wait_all)
                m = flow_of.get(key)
                if m is None:
                    m = flow_of[key] = len(flows)
                    flows.append([k, ld, 0.0, 0.0, key[2], wait_all])
                    xout.setdefault(k, []).append(m)
                fl = flows[m]
                P, Fx = b_own[b]
                fl[2] += P
                fl[3] += Fx
                for (tid, P, Fx) in b_shared[b]:
                    if (tid, ld.id) not in sent:
                        sent.add((tid, ld.id))
                        fl[2] += P
                        fl[3] += Fx
                xi = xin.setdefault(t, [])
                if not xi or xi[-1] != m:
                    xi.append(m)

        rfree = [0.0] * (2 * self._H)
        lane_free = [0.0] * L
        ready0 = [0.0] * T
        comm = 0.0
        coll_end = [0.0] * G
        post: dict[int, list[int]] = {}
        rec = record
        names = self.grouping.names
        # ps pulls at the start of the step; collectives after the tasks producing the gradients:
        # post[task] = [(group, resources, seconds, bytes sent, tasks it waits for, tasks waiting for it)]
        coll_of: dict[int, tuple] = {}
        W_l, coll_after, coll_deps, upd_tasks = self._W_l, self._coll_after, self._coll_deps, self._upd_tasks
        for g, a in enumerate(actions):
            W = W_l[g]
            if W <= 0 or a.mode == "partition":
                continue
            c = coll_of.get(id(a))
            if c is None:
                if a.mode == "ps":
                    c = self._collective("ps", a.placement, int(a.ps_device))
                elif len(group_lays[g].devices) > 1:
                    c = self._collective("allreduce", a.placement, None)
                else:
                    c = ()
                coll_of[id(a)] = c
            if not c or c[5] <= 0:
                continue
            if a.mode == "ps":
                st = 0.0
                for r in c[4]:
                    if rfree[r] > st:
                        st = rfree[r]
                end = st + c[0] + c[1] * W
                for r in c[4]:
                    rfree[r] = end
                comm += c[5] * W
                for t in self._fwd_tasks[g]:
                    if end > ready0[t]:
                        ready0[t] = end
                if rec is not None:
                    rec["collectives"].append((c[4], st, end, W * c[5], f"pull {names[g]}"))
                dur = c[0] + c[1] * W
            else:
                dur = min(c[0] + c[1] * W, c[2] + c[3] * W)
            post.setdefault(coll_after[g], []).append((g, c[4], dur, c[5] * W, coll_deps[g], upd_tasks[g]))

        tg_l, ts_l = self._tg_l, self._ts_l
        arr: dict[int, dict] = {}
        moves = self._moves
        # start, finish and per-replica batch of every task on every lane (lane-major; finish -1: not run)
        S = np.zeros((L, T))
        F = np.full((L, T), -1.0)
        Bm = np.zeros((L, T))
        rowmax = [0.0] * T
        xin_tasks = sorted(xin)
        todo = sorted(set(xout) | set(post))      # tasks with transfers to issue or collectives to start
        xi = pi = 0
        t = 0
        while t < T:
            lay = lay_of_task[t]
            # a run: consecutive tasks on one layout. Their inputs from other layouts come from earlier
            # tasks, so every release time is known now, except that of update tasks waiting for a
            # collective of this run: runs end before the first update task and after update tasks
            # that start a collective.
            e = t + 1
            if lay.kind != "split":
                while e < T and lay_of_task[e] is lay and not (ts_l[e] == 2 and ts_l[e - 1] < 2) \
                        and not (ts_l[e - 1] == 2 and (e - 1) in post):
                    e += 1
            xs = []
            while xi < len(xin_tasks) and xin_tasks[xi] < e:
                xs.append(xin_tasks[xi])
                xi += 1
            if lay.kind == "split":
                comm += self._run_split(t, split_info[t], lay, xin.get(t, ()), arr, ready0[t], lane_free, rfree,
                                        S, F, Bm, rec)
                rowmax[t] = float(F[:, t].max())
            elif (e - t) * len(lay.insts) >= _VECTOR_MIN:
                # every lane at once: f_k = max(f_(k-1), release_k) + d_k, i.e.
                # f = C + max(lane_free, running max of (release - C_(k-1))), C = cumulative durations.
                # (Written without broadcasting, which costs more than the arithmetic at these sizes.)
                d = lay.tmT[:, t:e]
                rel = ready0[t:e]
                lf = np.array([lane_free[lane] for lane in lay.lanes])
                if not xs and not any(rel):
                    c0 = d.copy()
                    c0[:, 0] += lf
                    f = np.add.accumulate(c0, axis=1)
                else:
                    if xs:
                        rows = []
                        for lane in lay.lanes:
                            r = list(rel)
                            for k in xs:
                                for b_ in xin[k]:
                                    x = arr[b_].get(lane, 0.0)
                                    if x > r[k - t]:
                                        r[k - t] = x
                            rows.append(r)
                        rm_ = np.array(rows)
                    else:
                        rm_ = np.array([rel] * len(lay.lanes))
                    c = np.add.accumulate(d, axis=1)
                    x = rm_ - c
                    x += d
                    x[:, 0] = np.maximum(x[:, 0], lf)
                    f = np.maximum.accumulate(x, axis=1)
                    f += c
                sl = lay.lane_slice
                if sl is not None:
                    F[sl, t:e] = f
                    S[sl, t:e] = f - d
                    Bm[sl, t:e] = lay.bmat[:, t:e]
                else:
                    li = lay.lane_idx
                    F[li, t:e] = f
                    S[li, t:e] = f - d
                    Bm[li, t:e] = lay.bmat[:, t:e]
                for lane, x_ in zip(lay.lanes, f[:, -1].tolist()):
                    lane_free[lane] = x_
                rowmax[t:e] = f.max(axis=0).tolist()
            else:
                for k in range(t, e):
                    xb = xin.get(k) if xs else None
                    r0 = ready0[k]
                    m = 0.0
                    for lane, tbl, batch, _ in lay.insts:
                        r = r0
                        if xb is not None:
                            for b_ in xb:
                                x = arr[b_].get(lane, 0.0)
                                if x > r:
                                    r = x
                        s_ = lane_free[lane]
                        if r > s_:
                            s_ = r
                        f = s_ + tbl[k]
                        lane_free[lane] = f
                        S[lane, k] = s_
                        F[lane, k] = f
                        Bm[lane, k] = batch
                        if f > m:
                            m = f
                    rowmax[k] = m
            # transfers out of the run and collectives it completes, in task order
            while pi < len(todo) and todo[pi] < e:
                k = todo[pi]
                pi += 1
                xo = xout.get(k)
                if xo is not None:
                    lk = lay_of_task[k]
                    fk = F[:, k].tolist()
                    for m in xo:
                        _, ld, P, Fb, b, wait_all = flows[m]
                        if wait_all:
                            # gradients to the PS travel in the push collective: only wait for every replica
                            arr[m] = dict.fromkeys(ld.lanes, rowmax[k])
                        elif b >= 0:
                            fins = {lane: fk[lane] for lane in lk.lanes}
                            arr[m], c_add = self._split_bundle(b, lk, ld, fins, rfree, plans, rec)
                            comm += c_add
                        else:
                            mk = ("c", lk.id, ld.id)
                            cm = moves.get(mk)
                            if cm is None:
                                cm = self._compiled_moves(mk, lk, ld)
                            deps, routes1, routes2, full = cm
                            arrd = {}
                            for dl, sls in deps:
                                x = 0.0
                                for sl in sls:
                                    y = fk[sl]
                                    if y > x:
                                        x = y
                                arrd[dl] = x
                            nbytes = 0.0
                            if rec is None:
                                for (sl, dl, r1, lat, ipb, ex, cnt) in routes1:
                                    nb = P * ex + Fb * cnt
                                    if nb <= 0:
                                        continue
                                    nbytes += nb
                                    st = fk[sl]
                                    y = rfree[r1]
                                    if y > st:
                                        st = y
                                    st += lat + nb * ipb
                                    rfree[r1] = st
                                    if st > arrd[dl]:
                                        arrd[dl] = st
                                for (sl, dl, r1, r2, lat, ipb, ex, cnt) in routes2:
                                    nb = P * ex + Fb * cnt
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
                                    st += lat + nb * ipb
                                    rfree[r1] = st
                                    rfree[r2] = st
                                    if st > arrd[dl]:
                                        arrd[dl] = st
                            else:   # the same schedule, recorded
                                for (sl, dl, res, lat, ipb, ex, cnt) in full:
                                    nb = P * ex + Fb * cnt
                                    if nb <= 0:
                                        continue
                                    nbytes += nb
                                    st = max(fk[sl], *(rfree[r] for r in res))
                                    end = st + lat + nb * ipb
                                    for r in res:
                                        rfree[r] = end
                                    arrd[dl] = max(arrd[dl], end)
                                    rec["transfers"].append((res, st, end, nb,
                                                             f"{names[tg_l[k]]} -> {names[tg_l[flows[m][0]]]}"))
                            comm += nbytes
                            arr[m] = arrd
                pg = post.get(k)
                if pg is not None:
                    for g, res, dur, nbytes, deps, waiting in pg:
                        ready = 0.0
                        for dt in deps:
                            if rowmax[dt] > ready:
                                ready = rowmax[dt]
                        st = ready
                        for r in res:
                            if rfree[r] > st:
                                st = rfree[r]
                        end = st + dur
                        for r in res:
                            rfree[r] = end
                        comm += nbytes
                        coll_end[g] = end
                        for ut in waiting:
                            if end > ready0[ut]:
                                ready0[ut] = end
                        if rec is not None:
                            rec["collectives"].append((res, st, end, nbytes, ("push " if actions[g].mode == "ps"
                                                                              else "all-reduce ") + names[g]))
            t = e

        step = max(max(lane_free, default=0.0), max(rfree, default=0.0), max(coll_end, default=0.0))
        if rec is not None:
            rec["lanes"] = lanes
            rec["matrices"] = (S.T, F.T, Bm.T)
        return self._finish(actions, uniq, plans, lanes, B, step, comm, coll_end, split_info, S, F, Bm)

    # ------------------------------------------------------------------ partition sub-tasks (slow path)
    def _split_layout(self, t: int, parts: list, lanes: _Lanes, B: int) -> _Layout:
        key = ("s", t, tuple((d, o.tobytes()) for d, o in parts), lanes.key, B)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        insts = []
        for d, ops in parts:
            times = self.cost.op_times(self._dev_dg[d], B)
            insts.append((int(lanes.lane_of_device[d]), float(times[ops].sum()), B, None))
        holdings = [(d, 0, B, int(lanes.lane_of_device[d])) for d, _ in parts]
        return self._new_layout(key, "split", insts, holdings, tuple(d for d, _ in parts))

    def _transfer(self, p: int, c: int, nbytes: float, ready: float, rfree: list, rec, label: str) -> float:
        res, lat, ipb = self._route(p, c)
        st = ready
        for r in res:
            if rfree[r] > st:
                st = rfree[r]
        end = st + lat + nbytes * ipb
        for r in res:
            rfree[r] = end
        if rec is not None:
            rec["transfers"].append((res, st, end, nbytes, label))
        return end

    def _run_split(self, t, parts, lay, xb, arr, r0, lane_free, rfree, S, F, Bm, rec) -> float:
        """Run the per-device sub-tasks of a split partition task in order, with transfers between them.
        Returns the bytes moved between them."""
        order = {d: k for k, (d, _) in enumerate(parts)}
        key = ("split-internal", lay.id)
        moved = self._moves.get(key)
        if moved is None:
            dev_of_op = {}
            for d, ops in parts:
                for i in ops.tolist():
                    dev_of_op[i] = d
            B = lay.insts[0][2]
            moved = {}
            seen = set()
            for (so, do, Pe, Fx, name) in self._internal[t]:
                ds, dd = dev_of_op[so], dev_of_op[do]
                if ds == dd or (name, dd) in seen:
                    continue
                seen.add((name, dd))
                moved[(ds, dd)] = moved.get((ds, dd), 0.0) + Pe * B + Fx
            self._moves[key] = moved
        internal_arr: dict[int, float] = {}
        comm = 0.0
        label = f"{self.grouping.names[self._tg_l[t]]} (split)"
        for k, (lane, dur, batch, _) in enumerate(lay.insts):
            d = parts[k][0]
            r = max(r0, internal_arr.get(d, 0.0))
            for b in xb:
                x = arr[b].get(lane, 0.0)
                if x > r:
                    r = x
            s = max(lane_free[lane], r)
            f = s + dur
            lane_free[lane] = f
            S[lane, t] = s
            F[lane, t] = f
            Bm[lane, t] = batch
            for (ds, dd), nb in moved.items():
                if ds != d or nb <= 0:
                    continue
                comm += nb
                end = self._transfer(ds, dd, nb, f, rfree, rec, label)
                if order[dd] > k:
                    internal_arr[dd] = max(internal_arr.get(dd, 0.0), end)
        return comm

    def _holders(self, lay: _Layout, op: int, plans: dict) -> list:
        if lay.kind == "split":
            d = plans[self._tg_l[self._task_of_op[op]]]["dev_of"][op]
            return [h for h in lay.holdings if h[0] == d]
        return lay.holdings

    def _split_moves(self, b: int, ls: _Layout, ld: _Layout, plans: dict) -> tuple:
        """(deps, transfers) of bundle B between layouts LS and LD when either is a split partition task:
        deps = [(dst lane, src lanes)], transfers = [(src device, src lane, dst device, dst lane, bytes)]."""
        key = (b, ls.id, ld.id)
        mv = self._moves.get(key)
        if mv is not None:
            return mv
        deps: dict[int, set] = {h[3]: set() for h in ld.holdings}
        moved: dict[tuple, float] = {}
        sent: set = set()
        for (so, do, P, F, name) in self._b_contrib[b] or [(None, None, 0.0, 0.0, None)]:
            src_h = ls.holdings if so is None else self._holders(ls, so, plans)
            dst_h = ld.holdings if do is None else self._holders(ld, do, plans)
            src_lane = {h[0]: h[3] for h in src_h}
            for (c, clo, chi, cl) in dst_h:
                for (p, plo, phi, pl) in src_h:
                    ov = min(chi, phi) - max(clo, plo)
                    if ov <= 0:
                        continue
                    deps[cl].add(pl)
                    if p != c and P > 0 and (name, p, c, "P") not in sent:
                        sent.add((name, p, c, "P"))
                        moved[(p, pl, c, cl)] = moved.get((p, pl, c, cl), 0.0) + P * ov
                if c in src_lane:
                    deps[cl].add(src_lane[c])
                elif src_lane:
                    p = self._best_source(list(src_lane), c)
                    deps[cl].add(src_lane[p])
                    if F > 0 and (name, c, "F") not in sent:
                        sent.add((name, c, "F"))
                        moved[(p, src_lane[p], c, cl)] = moved.get((p, src_lane[p], c, cl), 0.0) + F
        mv = ([(dl, tuple(sorted(x))) for dl, x in sorted(deps.items())],
              [(k[0], k[1], k[2], k[3], v) for k, v in sorted(moved.items()) if v > 0])
        self._moves[key] = mv
        return mv

    def _split_bundle(self, b: int, ls: _Layout, ld: _Layout, fins: dict, rfree: list, plans: dict,
                      rec) -> tuple[dict, float]:
        """Arrival time per destination lane of bundle B when either side is a split partition task."""
        deps, transfers = self._split_moves(b, ls, ld, plans)
        arrd = {}
        for dl, sls in deps:
            arrd[dl] = max((fins.get(sl, 0.0) for sl in sls), default=0.0)
        comm = 0.0
        for (p, pl, c, cl, nb) in transfers:
            comm += nb
            end = self._transfer(p, c, nb, fins.get(pl, 0.0), rfree, rec, "partition transfer")
            if end > arrd.get(cl, 0.0):
                arrd[cl] = end
        return arrd, comm

    # ------------------------------------------------------------------ results
    def _finish(self, actions, uniq, plans, lanes: _Lanes, B: int, step: float, comm: float, coll_end: list,
                split_info: dict, S: np.ndarray, F: np.ndarray, Bm: np.ndarray) -> SimResult:
        T, L = self.num_tasks, len(lanes.lanes)
        ndev = self.topology.num_devices
        # static memory: parameters, gradients, optimizer slots, state
        static = np.zeros(ndev)
        if plans:
            vd = [p["var_dev"] for p in plans.values() if len(p["var_dev"])]
            if vd:
                static += np.bincount(np.concatenate(vd), minlength=ndev,
                                      weights=np.concatenate([p["var_bytes"] for p in plans.values()
                                                              if len(p["var_dev"])]))
        keys = list(uniq)
        slot = {k: i for i, k in enumerate(keys)}
        aidx = [slot[id(a)] for a in actions]
        nW = np.bincount(aidx, weights=self._W, minlength=len(keys)).tolist()
        nS = np.bincount(aidx, weights=self._S, minlength=len(keys)).tolist()
        nX = np.bincount(aidx, weights=self._X, minlength=len(keys)).tolist()
        for i, k in enumerate(keys):
            a = uniq[k]
            if a.mode == "partition":
                continue
            W, Sl, X = nW[i], nS[i], nX[i]
            devs = self._devices_of(a.placement)
            if a.mode == "ps":
                static[devs] += 2 * W + X
                static[int(a.ps_device)] += 2 * W + Sl
            else:
                static[devs] += 2 * W + Sl + X

        # activations: a task's outputs that later tasks read stay live on each lane that ran it from the
        # task until its last reader (in the lane's task order); plus the running task's working set.
        # Arrays are lane-major: [lane, task].
        mask = F >= 0
        act_peak = np.zeros(L)
        if T:
            trans = mask * self._tr_F + Bm * self._tr_P
            if len(self._mb_src):
                src = self._mb_src
                C = mask[:, src] * self._mb_F + Bm[:, src] * self._mb_P
                if split_info:
                    nsub = np.ones(T)
                    for t, parts in split_info.items():
                        nsub[t] = len(parts)
                    C = C / nsub[src]
                D = np.zeros((L, T + 1))
                D[:, self._mb_src_u] += np.add.reduceat(C, self._mb_src_starts, axis=1)
                D[:, self._mb_last_u + 1] -= np.add.reduceat(C[:, self._mb_last_order], self._mb_last_starts, axis=1)
                live = np.add.accumulate(D[:, :T], axis=1)
                act_peak = ((live + trans) * mask).max(axis=1)
            else:
                act_peak = trans.max(axis=1)
        lod = lanes.lane_of_device
        activation = np.maximum(act_peak, 0.0)[lod]
        peak = static + activation
        oom = np.flatnonzero(peak > self._dev_mem)

        features = partial(self._features, lod, step, coll_end, mask, S, F, ndev)
        return SimResult(float(step) + self._step_overhead, peak, len(oom) == 0, [int(d) for d in oom], float(comm), static, activation,
                         B, features)

    def _features(self, lod, step, coll_end, mask, S, F, ndev) -> dict:
        """Utilisation, compute time, group makespan and idle time from a simulated schedule."""
        G, (L, T) = self.num_groups, F.shape
        busy = ((F - S) * mask).sum(axis=1)
        compute = busy[lod]
        util = compute / step if step > 0 else np.zeros(ndev)
        if T:
            s_inf = np.where(mask, S, np.inf)
            o, starts = self._task_by_group, self._task_by_group_starts
            gstart = np.minimum.reduceat(s_inf.min(axis=0)[o], starts)
            gend = np.maximum(np.maximum.reduceat(F.max(axis=0)[o], starts), coll_end)
            makespan = np.where(np.isfinite(gstart), gend - np.where(np.isfinite(gstart), gstart, 0.0), 0.0)
            # next start on the same lane after each task (step end after the lane's last task)
            nxt = np.empty((L, T))
            nxt[:, :-1] = np.minimum.accumulate(s_inf[:, :0:-1], axis=1)[:, ::-1]
            nxt[:, -1] = np.inf
            nxt[np.isinf(nxt)] = step
            gaps = np.maximum(nxt - F, 0.0) * mask
            cnt = np.add.reduceat(mask.sum(axis=0)[o], starts)
            idle = np.add.reduceat(gaps.sum(axis=0)[o], starts) / np.maximum(cnt, 1)
        else:
            makespan = np.zeros(G)
            idle = np.zeros(G)
        return {"utilisation": util, "compute_time": compute, "group_makespan": makespan, "group_idle_after": idle}
