"""The simulator's memory model: static bytes per device from the actions, activation peaks from a schedule.

Static memory is what the variables need (parameters + gradients + optimizer slots + other state,
held where the action says: every replica for allreduce; for ps the trainable weights, slots and the
summed gradient on the PS and a pulled copy, the gradients and non-trainable state on every worker;
for partition on the variable's device). Activations: a task's outputs that later tasks read are held
on every lane that ran it from that task until their last reader (in the lane's task order: forward
activations live until their backward use); ops that only alias their input (``ALIAS_TYPES``) hold
no buffer of their own; the running task adds its largest op's inputs + outputs. Everything per op
and per tensor is folded into per-task arrays once, in ``MemoryModel()``; each evaluation is a few
numpy reductions over the schedule's [lane, task] matrices.

Sparse gradients: a weight whose gradient grows with the batch (an ``IndexedSlices`` gradient of an
embedding lookup: the rows the batch touched and their indices) is not all-reduced or pushed as a
dense tensor. The rewriter gives its update the whole batch's rows and indices on every replica
(allreduce: each replica receives the others' rows, an all-gather) or on the parameter server (ps:
each worker pushes its own rows, and its lookup's rows come back from the table on the PS). Where the
rows outweigh the table and the update deduplicates them (``tag.strategy.sparse``), an ``allreduce`` group
outside a pipeline all-reduces the dense table instead, and only the indices are gathered.
``collective_bytes`` turns that into the bytes the collective models charge (see its docstring).

Example::

    import tag
    from tag.cost.model import CostModel
    from tag.strategy.grouping import group_ops
    from tag.sim.memory import MemoryModel
    from tag.sim.task_graph import TaskGraph
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/localhost.pbtxt")
    memory = MemoryModel(tg, TaskGraph(tg, group_ops(tg, target_groups=8)), CostModel(tg, topo))
    memory.weight_bytes.sum(), memory.live_src_task[:5]
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tag.cost.model import CostModel
from tag.ir.types import TrainingGraph
from tag.sim.task_graph import TaskGraph
from tag.strategy.sparse import dense_sum_pays, grouped_dedups
from tag.strategy.types import Action

# ops whose output is their first input's buffer (no memory of their own)
ALIAS_TYPES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "ReadVariableOp", "Snapshot",
                         "StopGradient", "PreventGradient", "EnsureShape", "CheckNumerics", "Enter", "Exit"})


class _AliasRoots:
    """Tensor name -> the tensor whose buffer it is (following ALIAS_TYPES ops up to 64 steps), memoised."""

    def __init__(self, graph: TrainingGraph, producer_of: dict[str, tuple[int, float, float]]):
        self._producer_of = producer_of
        self._alias_input: dict[int, str] = {}      # alias op -> the tensor it aliases
        for i, op in enumerate(graph.ops):
            if op.type in ALIAS_TYPES and op.inputs:
                self._alias_input[i] = op.inputs[0].lstrip("^")
        self._root: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        path = []
        while name not in self._root:
            path.append(name)
            producer = self._producer_of.get(name, (None,))[0]
            if producer is None or producer not in self._alias_input or len(path) > 64:
                self._root[name] = name
                break
            name = self._alias_input[producer]
        root = self._root[name]
        for x in path:
            self._root[x] = root
        return root


class MemoryModel:
    """Per-task and per-group memory figures of one graph and grouping (see the module docstring)."""

    def __init__(self, graph: TrainingGraph, tasks: TaskGraph, cost: CostModel):
        self._live_buffers(graph, tasks)
        # transient working set of a task: its largest op's inputs + outputs (fixed, per-example bytes per task)
        arrays = cost.arrays
        reference = arrays.mem_fixed + arrays.mem_per_example * max(graph.batch_size, 1)
        largest = np.full(tasks.num_tasks, -1, dtype=np.int64)
        for t in range(tasks.num_tasks):
            ops_t = tasks.task_ops[t]
            largest[t] = ops_t[np.argmax(reference[ops_t])]
        self.working_fixed = arrays.mem_fixed[largest] if tasks.num_tasks else np.zeros(0)
        self.working_per_example = arrays.mem_per_example[largest] if tasks.num_tasks else np.zeros(0)
        self._variable_bytes(graph, tasks)

    def _live_buffers(self, graph: TrainingGraph, tasks: TaskGraph) -> None:
        """Buffers read by later tasks, summed per (producer task, last reader task): ``live_src_task``,
        ``live_last_task``, ``live_per_example``, ``live_fixed`` (one row each). Weights and their
        gradients are static memory, not activations."""
        task_of_op = tasks.task_of_op
        producer_of: dict[str, tuple[int, float, float]] = {}   # tensor -> (op, per-example, fixed bytes)
        for i, op in enumerate(graph.ops):
            for tinfo in op.outputs:
                producer_of[tinfo.name] = (i, max(tinfo.nbytes.per_example, 0.0), max(tinfo.nbytes.fixed, 0.0))
        root_of = _AliasRoots(graph, producer_of)
        static_roots = {root_of(v.gradient.lstrip("^")) for v in graph.variables
                        if v.kind == "trainable" and v.gradient}
        last_reader: dict[str, int] = {}     # buffer (root tensor) -> last task reading it
        for e in graph.edges:
            root = root_of(e.tensor)
            if root in static_roots or root not in producer_of:
                continue
            ts, td = int(task_of_op[producer_of[root][0]]), int(task_of_op[e.dst])
            if td > ts:
                last_reader[root] = max(last_reader.get(root, -1), td)
        summed: dict[tuple[int, int], list[float]] = {}   # (producer task, last reader) -> [per-example, fixed]
        for name, last in last_reader.items():
            op, per_example, fixed = producer_of[name]
            if per_example <= 0 and fixed <= 0:
                continue
            acc = summed.setdefault((int(task_of_op[op]), last), [0.0, 0.0])
            acc[0] += per_example
            acc[1] += fixed
        keys = sorted(summed)
        self.set_live_rows(np.array([k[0] for k in keys], dtype=np.int64),
                           np.array([k[1] for k in keys], dtype=np.int64),
                           np.array([summed[k][0] for k in keys], dtype=np.float64),
                           np.array([summed[k][1] for k in keys], dtype=np.float64))

    def set_live_rows(self, src_task: np.ndarray, last_task: np.ndarray, per_example: np.ndarray,
                      fixed: np.ndarray) -> None:
        """Set the live-buffer rows (producer task, last reader task, per-example and fixed bytes); a
        pipeline's expanded task graph (``tag.sim.pipeline``) sets its own on a copy of this model."""
        order = np.lexsort((last_task, src_task)) if len(src_task) else np.zeros(0, dtype=np.int64)
        self.live_src_task, self.live_last_task = src_task[order], last_task[order]
        self.live_per_example, self.live_fixed = per_example[order], fixed[order]
        # row groupings for summing the rows per producer task and per last reader task
        self._src_tasks, self._src_starts = np.unique(self.live_src_task, return_index=True)
        self._last_order = np.argsort(self.live_last_task, kind="stable")
        self._last_tasks, self._last_starts = np.unique(self.live_last_task[self._last_order], return_index=True)

    def _variable_bytes(self, graph: TrainingGraph, tasks: TaskGraph) -> None:
        """Per op group: ``weight_bytes`` (trainable), ``slot_bytes`` (their optimizer slots), ``state_bytes``
        (other variables), and ``partition_vars[g]`` = (variable ops, bytes each holds on its device)."""
        num_groups = tasks.num_groups
        group_of_op = tasks.group_of_op
        weights, slots, state = np.zeros(num_groups), np.zeros(num_groups), np.zeros(num_groups)
        counts = [0] * num_groups        # trainable variables per group (per-tensor costs of ps traffic)
        var_by_name = {v.name: v for v in graph.variables}
        claimed: set[str] = set()     # slot variables (counted with their weight)
        partition_vars: list[list[tuple[int, float]]] = [[] for _ in range(num_groups)]
        sparse_weights, sparse_rows = np.zeros(num_groups), np.zeros(num_groups)
        dedups = grouped_dedups(graph, group_of_op)
        dense: list[tuple[int, float, float]] = []   # (group, table bytes, row bytes per example) of each
        for v in graph.variables:
            if v.kind != "trainable":
                continue
            g = int(group_of_op[v.op])
            rows = sparse_gradient_bytes(graph, v)
            if rows > 0:
                sparse_weights[g] += v.nbytes
                sparse_rows[g] += rows
                if v.name in dedups:
                    dense.append((g, float(v.nbytes), dedups[v.name].values_bytes_per_example))
            slot = float(v.slot_bytes) if v.slot_bytes else float(sum(
                var_by_name[s].nbytes for s in v.slots if s in var_by_name))
            claimed.update(v.slots)
            weights[g] += v.nbytes
            counts[g] += 1
            slots[g] += slot
            partition_vars[g].append((v.op, 2.0 * v.nbytes + slot))
        for v in graph.variables:
            if v.kind == "trainable" or v.name in claimed:
                continue
            g = int(group_of_op[v.op])
            state[g] += v.nbytes
            partition_vars[g].append((v.op, float(v.nbytes)))
        self.weight_bytes, self.slot_bytes, self.state_bytes = weights, slots, state
        self.sparse_weight_bytes, self.sparse_row_bytes = sparse_weights, sparse_rows
        self.has_sparse = bool(np.any(sparse_rows > 0))
        # sparse weights that an allreduce group may sum as dense tables (tag.strategy.sparse)
        self.dense_groups = np.array([d[0] for d in dense], dtype=np.int64)
        self.dense_tables = np.array([d[1] for d in dense], dtype=np.float64)
        self.dense_values = np.array([d[2] for d in dense], dtype=np.float64)
        self.weight_bytes_list: list[float] = weights.tolist()
        self.weight_count_list: list[int] = counts
        self.partition_vars = [(np.array([p[0] for p in pv], dtype=np.int64), np.array([p[1] for p in pv]))
                               for pv in partition_vars]

    def collective_bytes(self, weights, factor, batch: int, groups=slice(None), dense_ok=False):
        """Per op group of GROUPS (default all; an int gives one), the bytes its all-reduce or ps transfer is
        charged for: WEIGHTS (its trainable bytes, or what SFB leaves of them) with every sparse weight's
        table replaced by BATCH's gradient rows times FACTOR (``sparse_factor`` of its action). Where
        DENSE_OK (per group of GROUPS, or one bool: an ``allreduce`` over several devices outside a
        pipeline) and ``dense_sum_pays``, a weight whose update deduplicates its rows is charged its table
        and its rows' indices instead (the rewriter all-reduces the dense table). Unchanged without sparse
        weights."""
        if not self.has_sparse:
            return weights
        out = np.asarray(weights, dtype=np.float64) - self.sparse_weight_bytes[groups] + \
            self.sparse_row_bytes[groups] * float(batch) * factor
        if self.dense_groups.size and np.any(dense_ok):
            num_groups = len(self.weight_bytes)
            ok, fac = np.zeros(num_groups, dtype=bool), np.zeros(num_groups)
            ok[groups], fac[groups] = dense_ok, factor
            g = self.dense_groups
            sel = ok[g] & dense_sum_pays(self.dense_values, self.dense_tables, float(batch))
            if sel.any():
                saved = self.dense_tables[sel] - self.dense_values[sel] * float(batch) * fac[g[sel]]
                out = out + np.bincount(g[sel], weights=saved, minlength=num_groups)[groups]
        return out

    def static_memory(self, actions: list[Action], distinct: dict[int, Action], plans: dict[int, dict],
                      devices_of: Callable[[tuple[int, ...]], list[int]], num_devices: int) -> np.ndarray:
        """Bytes of parameters, gradients, optimizer slots and state per device under ACTIONS (DISTINCT: the
        distinct actions by id; PLANS: partition plans per group; DEVICES_OF(placement) -> devices)."""
        static = self.partition_static(plans, num_devices)
        keys = list(distinct)
        index_of = {k: i for i, k in enumerate(keys)}
        action_index = [index_of[id(a)] for a in actions]
        weights = np.bincount(action_index, weights=self.weight_bytes, minlength=len(keys)).tolist()
        slots = np.bincount(action_index, weights=self.slot_bytes, minlength=len(keys)).tolist()
        state = np.bincount(action_index, weights=self.state_bytes, minlength=len(keys)).tolist()
        for i, k in enumerate(keys):
            a = distinct[k]
            if a.mode == "partition":
                continue
            devs = devices_of(a.placement)
            if a.mode == "ps":
                static[devs] += 2 * weights[i] + state[i]
                static[int(a.ps_device)] += 2 * weights[i] + slots[i]
            else:
                static[devs] += 2 * weights[i] + slots[i] + state[i]
        return static

    def partition_static(self, plans: dict[int, dict], num_devices: int) -> np.ndarray:
        """Bytes per device of the variables of partition groups (PLANS: their plans, tag.sim.layouts)."""
        static = np.zeros(num_devices)
        if plans:
            var_devices = [p["var_dev"] for p in plans.values() if len(p["var_dev"])]
            if var_devices:
                static += np.bincount(np.concatenate(var_devices), minlength=num_devices,
                                      weights=np.concatenate([p["var_bytes"] for p in plans.values()
                                                              if len(p["var_dev"])]))
        return static

    def activation_peak(self, ran: np.ndarray, batch: np.ndarray, split_parts: dict[int, list]) -> np.ndarray:
        """Peak bytes of live activations per lane of a schedule. RAN and BATCH are [lane, task] matrices
        (whether the lane ran the task, its per-replica batch); SPLIT_PARTS[t] = the per-device parts of a
        split partition task t (its buffers are spread over them)."""
        num_lanes, num_tasks = ran.shape
        if not num_tasks:
            return np.zeros(num_lanes)
        working = ran * self.working_fixed + batch * self.working_per_example
        if not len(self.live_src_task):
            return working.max(axis=1)
        src = self.live_src_task
        held = ran[:, src] * self.live_fixed + batch[:, src] * self.live_per_example   # [lane, buffer row]
        if split_parts:
            num_parts = np.ones(num_tasks)
            for t, parts in split_parts.items():
                num_parts[t] = len(parts)
            held = held / num_parts[src]
        # +bytes at the producer task, -bytes after the last reader, summed along the lane's tasks
        delta = np.zeros((num_lanes, num_tasks + 1))
        delta[:, self._src_tasks] += np.add.reduceat(held, self._src_starts, axis=1)
        delta[:, self._last_tasks + 1] -= np.add.reduceat(held[:, self._last_order], self._last_starts, axis=1)
        live = np.add.accumulate(delta[:, :num_tasks], axis=1)
        return ((live + working) * ran).max(axis=1)


def sparse_gradient_bytes(graph: TrainingGraph, variable) -> float:
    """Bytes per example of trainable VARIABLE's gradient when it is sparse (its gradient tensor grows with
    the batch: the rows of an ``IndexedSlices``), plus their int32 indices; 0.0 for a dense gradient."""
    op_name, _, index = (variable.gradient or "").lstrip("^").partition(":")
    i = graph.op_index.get(op_name)
    outputs = graph.ops[i].outputs if i is not None else []
    k = int(index or 0)
    if k >= len(outputs) or not variable.shape or variable.shape[0] <= 0 or variable.nbytes <= 0:
        return 0.0
    per_example = float(outputs[k].nbytes.per_example)
    if per_example <= 0:
        return 0.0
    rows_per_example = per_example / (variable.nbytes / variable.shape[0])
    return per_example + 4.0 * rows_per_example


def sparse_factor(mode: str, replicas: int) -> float:
    """What a sparse gradient's BATCH rows count for in the collective models of an action in MODE over
    REPLICAS devices (``CostModel.allreduce_coeffs`` charges 2(n-1)/n of its bytes per device, ``ps_coeffs``
    its bytes once per worker): allreduce 1/2 (the all-gather of the whole batch's rows moves (n-1)/n of
    them through each device), ps 1/n (each worker pushes its own share and pulls its lookup's rows)."""
    if replicas <= 1 or mode == "partition":
        return 0.0
    return 0.5 if mode == "allreduce" else 1.0 / replicas
