"""Step simulator: predict one training iteration of a Strategy on a Topology, fast enough for search.

What is simulated (the strategy semantics of ARCHITECTURE.md / tag.strategy):

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
  group (``CostModel.allreduce_coeffs``, ring: the rewriter emits one flat ``CollectiveReduceV2`` over the
  group's devices, so the hierarchical model, which nothing deploys, is not charged) once the tasks producing them
  have finished everywhere; the collective occupies the NICs of the hosts involved (and the bus of each
  host with several of its devices); the group's update tasks wait for it. ps groups pull their
  variables from the PS at the start of the step and push gradients after the backward pass
  (``CostModel.ps_coeffs`` per direction). NICs are full duplex: a pull holds the PS host's send side and
  the workers' receive sides, a push the workers' send sides and the PS host's receive side, so one group's
  pull may run beside another's push or a pull from a PS on another host; the update runs once, on the PS
  device.
- ``Strategy.sfb`` (sufficient-factor broadcasting, ``tag.sim.sfb``): an SFB variable of a multi-replica
  allreduce group leaves its group's all-reduce; one ring all-gather of its padded factors is issued with
  it, and the group's update waits for the gather plus the extra local MatMul on the gathered rows; the
  gathered factors count as static memory on every replica. ``Simulator.collectives`` lists every
  all-reduce and all-gather of a strategy as the rewriter emits them.
- Memory per device: parameters + gradients + optimizer slots held there (allreduce: every replica; ps:
  trainable weights, slots and the summed gradient on the PS, a pulled copy, the gradients and
  non-trainable state on every worker; partition: on the variable's device) + the peak of live
  activations in the simulated schedule: a task's outputs that later tasks read are held on every lane
  that ran it from that task until their last reader (in the lane's task order: forward activations
  live until their backward use); ops that only alias their input (Identity, Reshape, ReadVariableOp,
  ...) hold no buffer of their own; the running task adds its largest op's inputs + outputs.
  Compared with each device's memory.
- A pipelined strategy (``Strategy.pipeline``) runs the task graph expanded per micro-batch
  (``tag.sim.pipeline.PipelineTasks``: each forward/backward task once per micro-batch at the micro-batch's
  per-device share, update tasks once, numbered so that each stage keeps its schedule) through the same
  schedule, routing and memory model; ``SimResult.bubble_fraction`` is its predicted bubble.
- Hosts that share one machine (a testbed of processes on one machine; a profile with
  ``devices_under_load``): a step that keeps several hosts busy is slower than its hosts timed alone.
  ``evaluate`` simulates the step with the devices as timed alone (t0) and, when another host computes
  in it, again with the device entries timed while every other host computed (t1), and reports
  ``t0 + f * (t1 - t0)``, with f the mean compute utilisation (in the first simulation) of every host but
  the busiest: 0 on one host, near 1 when all hosts compute all step long. Real clusters' profiles have no
  such entries, and their steps are simulated once.
- Reported per op group (features for the GNN): ``group_makespan`` = last finish of the group's tasks or
  collective - first start; ``group_idle_after`` = mean, over the group's task instances, of the idle
  time of that lane before its next task (or the end of the step).

Everything that depends only on the graph, grouping and topology is precomputed in ``Simulator()``;
``evaluate`` does no per-op work except for partition groups (one vectorised lookup of their ops'
devices) and caches what depends on placements and batch shares across calls. Deterministic.

Where each part lives: the tasks and the bundles between them in ``tag.sim.task_graph``; lanes, layouts
and partition plans in ``tag.sim.layouts``; routes and collective coefficients in ``tag.sim.routing``;
the list schedule in ``tag.sim.schedule``; static and activation memory in ``tag.sim.memory``; the
result and its schedule statistics in ``tag.sim.result``; the Chrome trace in ``tag.sim.trace``. This
module is the API (``Simulator``, ``SimResult``) and wires them together. ``evaluate`` runs the schedule
and memory model as one compiled call (``tag.sim.kernel``, numba), with ``tag.sim.schedule`` and
``tag.sim.memory`` as the reference (``kernel="python"`` or ``TAG_SIM_KERNEL=python``), which traces and
SFB strategies always use.

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

from functools import partial
from typing import Iterable

import numpy as np

from tag.cluster.topology import Topology
from tag.cost.model import CostModel
from tag.errors import StrategyError
from tag.ir.algorithms import weight_gradient_ops
from tag.ir.types import TrainingGraph
from tag.sim.host_cpu import cpu_speed, step_offsets, sync_serial
from tag.sim.kernel import choose_kernel
from tag.sim.kernel_state import KernelState
from tag.sim.layouts import Lanes, Layout, LayoutCache, PartitionPlans
from tag.sim.memory import ALIAS_TYPES, MemoryModel, sparse_factor
from tag.sim.pipeline import WEIGHT_STEP, DeferredWeights, PipelineTasks, bubble_fraction
from tag.sim.result import SimResult, device_compute_time, schedule_features
from tag.sim.routing import Routing
from tag.sim.schedule import StepSchedule
from tag.sim.sfb import SfbModel, SfbPlan
from tag.sim.task_graph import UPDATE_STAGE, TaskGraph
from tag.sim.trace import STAGE_NAMES, Recording, chrome_trace
from tag.strategy import fusion
from tag.strategy.baselines import action_devices
from tag.strategy.pipeline import DEFERRED_W, Pipeline
from tag.strategy.types import Action, Grouping, Strategy, batch_shares

__all__ = ["ALIAS_TYPES", "STAGE_NAMES", "SimResult", "Simulator"]


class Simulator:
    """Discrete-event simulator of one training step (see the module docstring for the model).

    Built from: ``tasks`` (tag.sim.task_graph), ``memory`` (tag.sim.memory), ``layouts`` and
    ``partitions`` (tag.sim.layouts), ``routing`` (tag.sim.routing); each evaluation runs a
    ``StepSchedule`` (tag.sim.schedule)."""

    def __init__(self, graph: TrainingGraph, topology: Topology, grouping: Grouping,
                 cost_model: CostModel | None = None, kernel: str | None = None):
        n = len(graph.ops)
        if len(grouping.group_of_op) != n:
            raise StrategyError(f"grouping covers {len(grouping.group_of_op)} ops but the graph has {n}")
        if topology.num_devices == 0:
            raise StrategyError("the topology has no devices")
        self.graph, self.topology, self.grouping = graph, topology, grouping
        self.cost = cost_model if cost_model is not None else CostModel(graph, topology)
        self.num_groups = grouping.num_groups
        group_of_op = np.asarray(grouping.group_of_op, dtype=np.int64)
        if n and (group_of_op.min() < 0 or group_of_op.max() >= self.num_groups):
            raise StrategyError("grouping.group_of_op names a group outside 0..num_groups-1")
        self.tasks = TaskGraph(graph, grouping)
        self.num_tasks = self.tasks.num_tasks
        self.task_group = self.tasks.task_group
        self.task_stage = self.tasks.task_stage
        self.dropped_dependencies = self.tasks.dropped_dependencies
        self.memory = MemoryModel(graph, self.tasks, self.cost)
        self.routing = Routing(topology, self.cost, self.tasks)
        self.layouts = LayoutCache(topology, self.cost, self.tasks, [self.routing.moves])
        self.partitions = PartitionPlans(graph, self.tasks, self.memory.partition_vars, self.layouts.devices_of)
        self.sfb = SfbModel(graph, self.tasks, self.cost, self.memory.weight_bytes_list)
        self._device_memory = np.array([d.memory_bytes for d in topology.devices], dtype=np.float64)
        net = self.cost.profile.network
        self._step_overhead = net.step_overhead_s if net is not None else 0.0
        # the runtime's CPU work on hosts whose device is their CPU (tag.sim.host_cpu), when it was measured
        self._host_net = net if net is not None and net.host_cpu else None
        self._cpu_speed = cpu_speed(topology, net) if self._host_net is not None else None
        self._sync_serial = sync_serial(topology, net)     # per device [all-reduce, push] fraction, or None
        self._action_devices: dict[Action, tuple[int, ...]] = {}      # action -> the devices it runs on
        self._offsets: dict[tuple, tuple | None] = {}               # (devices used, lanes) -> step_offsets
        self._valid_actions: set[Action] = set()
        self._pipelines: dict[tuple, PipelineTasks] = {}         # pipeline structure -> its expanded tasks
        self._pipeline_layouts: dict[tuple, Layout] = {}         # (layout id, expansion id) -> expanded layout
        self._weight_ops: tuple[np.ndarray, np.ndarray] | None = None    # ``_weight_gradients``
        # "compiled" (tag.sim.kernel, numba) or "python" (the reference: tag.sim.schedule and tag.sim.memory)
        self.kernel = choose_kernel(kernel)
        self._kernel = (KernelState(self.tasks, self.memory, self.routing, self._device_memory)
                        if self.kernel == "compiled" else None)
        self.compiled_evaluations = 0        # evaluations the compiled kernel ran (the rest ran the reference)
        self._pipeline_kernels: dict[int, tuple] = {}     # PipelineTasks.uid -> its kernel state, layout columns
        # hosts that share one machine: the same simulator costed with the device entries timed under load
        self._loaded_profile = self.cost.profile.under_load()
        self._loaded: Simulator | None = None
        self._host_of_device = np.array([d.host_index for d in topology.devices], dtype=np.int64)

    @property
    def cost_model(self) -> CostModel:
        """The cost model the simulator uses (the one passed in, or a default CostModel)."""
        return self.cost

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, strategy: Strategy, batch_size: int | None = None) -> SimResult:
        """Simulate one step of STRATEGY at global batch BATCH_SIZE (default: the graph's)."""
        result = self._run(strategy, batch_size, record=None)
        if self._loaded_profile is None:
            return result
        return self._under_load(result, strategy, batch_size)

    def other_hosts_busy(self, result: SimResult) -> float:
        """Mean compute utilisation, in RESULT's step (before the runtime's step overhead, as
        ``SimResult.utilisation``), of every host but the busiest (a host's: its busiest device's); 0 with one
        host. Reads only the per-device compute time, not the other schedule features (a hot path)."""
        num_hosts = len(self.topology.hosts)
        step = result.step_time - self._step_overhead
        if num_hosts < 2 or step <= 0:
            return 0.0
        util = np.zeros(num_hosts)
        np.maximum.at(util, self._host_of_device, np.clip(result.compute_time / step, 0.0, 1.0))
        return float((util.sum() - util.max()) / (num_hosts - 1))

    def _under_load(self, result: SimResult, strategy: Strategy, batch_size: int | None) -> SimResult:
        """RESULT's step moved toward the same step costed with the devices timed under load, by how busy the
        other hosts are (module docstring, "Hosts that share one machine")."""
        busy = self.other_hosts_busy(result)
        if busy <= 0.0:
            return result
        if self._loaded is None:
            self._loaded = Simulator(self.graph, self.topology, self.grouping,
                                     self.cost.with_profile(self._loaded_profile), kernel=self.kernel)
        loaded = self._loaded._run(strategy, batch_size, record=None).step_time
        result.step_time += busy * max(loaded - result.step_time, 0.0)
        return result

    def trace(self, strategy: Strategy, batch_size: int | None = None) -> dict:
        """Chrome trace (chrome://tracing, Perfetto) of one simulated step: one row per device, one per
        host interconnect and network interface; ``ph: "X"`` events in microseconds (tag.sim.trace)."""
        rec = Recording()
        res = self._run(strategy, batch_size, record=rec)
        other = {"step_time_s": res.step_time, "feasible": res.feasible, "comm_bytes": res.comm_bytes,
                 "strategy": strategy.name}
        if strategy.pipeline is None:
            return chrome_trace(rec, self.topology, self.grouping.names, self.tasks.task_group_list,
                                self.tasks.task_stage_list, self.routing.resource_names, other)
        pt = self.pipeline_tasks(strategy.pipeline)
        other.update(pipeline=strategy.pipeline.to_dict(), bubble_fraction=res.bubble_fraction)
        return chrome_trace(rec, self.topology, self.grouping.names, pt.task_group_list, pt.task_stage_list,
                            self.routing.resource_names, other, task_labels=pt.labels,
                            task_args={"micro_batch": pt.micro_batch.tolist(),
                                       "pipeline_stage": pt.pipeline_stage.tolist()})

    def collectives(self, strategy: Strategy, batch_size: int | None = None) -> list[dict]:
        """Every all-reduce and all-gather one step of STRATEGY issues, in issue order: {"kind": "allreduce"
        or "allgather", "group": op group, "devices": [device], "bytes": payload per device, "start_s",
        "end_s"} -- the TF collectives the rewriter emits for STRATEGY."""
        rec = Recording()
        self._run(strategy, batch_size, record=rec)
        return [dict(c) for c in rec.collective_ops]

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

    def _check_strategy(self, strategy: Strategy, batch_size: int | None) -> int:
        """Raise StrategyError if STRATEGY does not fit this simulator; returns the global batch."""
        if strategy.grouping is not self.grouping and (
                len(strategy.grouping.group_of_op) != len(self.tasks.group_of_op)
                or not np.array_equal(strategy.grouping.group_of_op, self.tasks.group_of_op)):
            raise StrategyError("the strategy's grouping is not the simulator's grouping")
        batch = int(self.graph.batch_size if batch_size is None else batch_size)
        if batch <= 0:
            raise StrategyError(f"batch size must be positive, got {batch}")
        if len(strategy.actions) != self.num_groups:
            raise StrategyError(f"strategy has {len(strategy.actions)} actions for {self.num_groups} op groups")
        return batch

    def _partition_plans(self, strategy: Strategy, special: set[int]) -> dict[int, dict]:
        """Plan per partition op group (tag.sim.layouts.PartitionPlans); adds their devices to SPECIAL."""
        actions = strategy.actions
        device_of_op = self.partitions.device_array(strategy.partition)
        partition_groups = [g for g, a in enumerate(actions) if a.mode == "partition"]
        is_partition = np.zeros(self.num_groups, dtype=bool)
        is_partition[partition_groups] = True
        group_of_op = self.tasks.group_of_op
        missing = np.flatnonzero(is_partition[group_of_op] & (device_of_op < 0))
        if len(missing):
            i = int(missing[0])
            g = int(group_of_op[i])
            raise StrategyError(f"op group {g} ({self.grouping.names[g]}) is partitioned but op "
                                f"{self.graph.ops[i].name!r} has no device in strategy.partition")
        return {g: self.partitions.plan(g, device_of_op, actions[g], special) for g in partition_groups}

    def _task_layouts(self, actions: list[Action], distinct: dict[int, Action], plans: dict[int, dict],
                      lanes: Lanes, batch: int) -> tuple[list[Layout | None], list[Layout], dict[int, list], bool]:
        """(layout per op group (None for partition groups), layout per task, the parts of each split
        partition task, whether a ps layout is used)."""
        tasks, cache = self.tasks, self.layouts
        replicated: dict[int, Layout] = {}     # action id -> layout of its tasks
        ps_layout: dict[int, Layout] = {}      # action id -> layout of its update tasks (on the PS)
        for k, a in distinct.items():
            if a.mode != "partition":
                replicated[k] = cache.replicated_layout(a.placement, lanes, batch)
                if a.mode == "ps":
                    ps_layout[k] = cache.device_layout(int(a.ps_device), lanes, batch)
        group_layouts = [replicated.get(id(a)) for a in actions]
        layout_of_task = [group_layouts[g] for g in tasks.task_group_list]
        split_parts: dict[int, list] = {}
        if ps_layout or plans:
            stage, update = tasks.task_stage_list, UPDATE_STAGE
            for g, a in enumerate(actions):
                if a.mode == "ps":
                    pl = ps_layout[id(a)]
                    for t in tasks.tasks_of_group[g]:
                        if stage[t] == update:
                            layout_of_task[t] = pl
                elif a.mode == "partition":
                    plan = plans[g]
                    for t, lay in cache.partition_layouts(plan, lanes, batch).items():
                        layout_of_task[t] = lay
                        if lay.kind == "split":
                            split_parts[t] = plan["tasks"][t][1]
        return group_layouts, layout_of_task, split_parts, bool(ps_layout)

    def _run(self, strategy: Strategy, batch_size: int | None, record: Recording | None) -> SimResult:
        batch = self._check_strategy(strategy, batch_size)
        if strategy.device_speeds and len(strategy.device_speeds) != self.topology.num_devices:
            raise StrategyError(f"strategy has {len(strategy.device_speeds)} device speeds for "
                                f"{self.topology.num_devices} devices")
        self.layouts.use_speeds(strategy.device_speeds)
        if strategy.pipeline is not None:
            return self._run_pipeline(strategy.pipeline, batch, record)
        if self._kernel is not None and record is None and not strategy.sfb:
            return self._run_compiled(strategy, batch)
        actions = strategy.actions
        # distinct actions (by object: strategies usually share Action objects between groups)
        distinct: dict[int, Action] = {}
        for a in actions:
            if id(a) not in distinct:
                distinct[id(a)] = a
        special: set[int] = set()      # devices that need a lane of their own
        any_partition = False
        for a in distinct.values():
            self._check_action(a)
            if a.mode == "ps":
                special.add(int(a.ps_device))
            elif a.mode == "partition":
                any_partition = True
        plans = self._partition_plans(strategy, special) if any_partition else {}
        lanes = self.layouts.lanes(frozenset(special))
        group_layouts, layout_of_task, split_parts, has_ps = self._task_layouts(actions, distinct, plans, lanes,
                                                                                batch)
        schedule = StepSchedule(self.tasks, self.routing, layout_of_task, split_parts, len(lanes.lanes), plans,
                                self.grouping.names, record, self._step_offsets(distinct.values(), lanes),
                                None if self._sync_serial is None else (lanes.lane_of_device, self._sync_serial))
        if len(distinct) > 1 or has_ps or plans:
            schedule.add_flows(actions, has_ps)
        sfb = self.sfb.plan(strategy, actions, self.layouts, batch)
        schedule.add_collectives(actions, group_layouts, self._collective_bytes(actions, sfb.weight_bytes, batch),
                                 sfb.gathers, self.memory.weight_count_list, fuse=True,
                                 bucket_bytes=fusion.bucket_cap(strategy))
        step = schedule.run(actions)
        if record is not None:
            record.lanes = lanes
            record.matrices = (schedule.start.T, schedule.finish.T, schedule.batch.T)
        return self._result(actions, distinct, plans, lanes, batch, step, schedule, sfb)

    def _run_compiled(self, strategy: Strategy, batch: int) -> SimResult:
        """One step on the compiled kernel (tag.sim.kernel)."""
        kernel, cache = self._kernel, self.layouts
        kernel.begin()
        actions = strategy.actions
        ids = list(map(id, actions))
        local = dict.fromkeys(ids)           # distinct actions (by object), in order of first use
        objects = dict(zip(ids, actions, strict=True))
        special: set[int] = set()            # devices that need a lane of their own
        local_actions = []
        for i, key in enumerate(local):
            local[key] = i
            a = objects[key]
            local_actions.append(a)
            if a.mode == "ps":
                special.add(int(a.ps_device))
        group_local = np.fromiter(map(local.__getitem__, ids), dtype=np.int64, count=len(ids))
        local_ai = np.empty(len(local_actions), dtype=np.int64)
        any_partition = False
        for i, a in enumerate(local_actions):
            ai = kernel.action_index.get(a)
            if ai is None:
                self._check_action(a)
                ai = kernel.action(a, cache.devices_of(a.placement))
            local_ai[i] = ai
            any_partition |= a.mode == "partition"
        plans = self._partition_plans(strategy, special) if any_partition else {}
        lanes = cache.lanes(frozenset(special))
        local_rep = np.full(len(local_actions), -1, dtype=np.int64)
        local_upd = np.full(len(local_actions), -1, dtype=np.int64)
        for i, a in enumerate(local_actions):
            if a.mode != "partition":
                local_rep[i] = local_upd[i] = kernel.layout(cache.replicated_layout(a.placement, lanes, batch))
                if a.mode == "ps":
                    local_upd[i] = kernel.layout(cache.device_layout(int(a.ps_device), lanes, batch))
        task_override, static0 = kernel.no_override, kernel.static_zero
        if plans:
            task_override = task_override.copy()
            for plan in plans.values():
                for t, lay in cache.partition_layouts(plan, lanes, batch).items():
                    task_override[t] = kernel.layout(lay, plan["tasks"][t][1] if lay.kind == "split" else None)
            static0 = self.memory.partition_static(plans, self.topology.num_devices)
        lane_of_device = lanes.lane_of_device
        w_coll = self._collective_bytes(local_actions, None, batch, group_local)
        step, comm, start, finish, batches, collective_end, peak, static, activation = kernel.run(
            group_local, local_ai, local_rep, local_upd, task_override, len(lanes.lanes), lane_of_device, static0,
            plans, fusion.bucket_cap(strategy), w_coll=w_coll, offsets=self._step_offsets(local_actions, lanes),
            serial=self._sync_serial)
        self.compiled_evaluations += 1
        oom = np.flatnonzero(peak > self._device_memory)
        features = partial(_features_of_schedule, self.num_groups, self.tasks.task_by_group,
                           self.tasks.task_by_group_starts, lane_of_device, step, collective_end, start, finish,
                           self.topology.num_devices)
        return SimResult(step + self._step_overhead, peak, len(oom) == 0, oom.tolist(), comm, static, activation,
                         batch, _features=features,
                         _compute=partial(device_compute_time, lane_of_device, start, finish))

    # ------------------------------------------------------------------ pipelines
    def pipeline_tasks(self, pipeline: Pipeline) -> PipelineTasks:
        """The expanded task graph of PIPELINE's structure (tag.sim.pipeline), cached by stages, M, schedule."""
        if pipeline.num_stages > self.num_groups:
            raise StrategyError(f"pipeline has {pipeline.num_stages} stages but the grouping has only "
                                f"{self.num_groups} op groups: stage {self.num_groups} and later would be empty")
        deferring = frozenset(i for i, st in enumerate(pipeline.stages) if len(self.layouts.devices_of(st.placement))
                              == 1) if pipeline.schedule == DEFERRED_W else frozenset()
        key = (tuple(st.groups for st in pipeline.stages), pipeline.micro_batches, pipeline.schedule, deferring)
        pt = self._pipelines.get(key)
        if pt is None:
            if len(self._pipelines) > 64:
                self._pipelines.clear()
                self._pipeline_layouts.clear()
                self._pipeline_kernels.clear()
            deferred = None
            if deferring:
                ops, concat = self._weight_gradients()
                deferred = DeferredWeights(deferring, ops, concat)
            pt = PipelineTasks(self.tasks, self.memory, pipeline, self.grouping.names, deferred)
            self._pipelines[key] = pt
        return pt

    def _weight_gradients(self) -> tuple[np.ndarray, np.ndarray]:
        """(per op: ``weight_gradient_ops``; per base task: bytes per example of the batch-axis tensors its
        weight-gradient ops read, each tensor once), computed once."""
        if self._weight_ops is None:
            ops = weight_gradient_ops(self.graph)
            concat = np.zeros(self.num_tasks)
            seen: set[tuple[int, str]] = set()
            task_of_op = self.tasks.task_of_op
            for e in self.graph.edges:
                t = int(task_of_op[e.dst])
                if ops[e.dst] and e.nbytes.per_example > 0 and (t, e.tensor) not in seen:
                    seen.add((t, e.tensor))
                    concat[t] += e.nbytes.per_example
            self._weight_ops = (ops, concat)
        return self._weight_ops

    def _expanded_layout(self, base: Layout, pt: PipelineTasks, lane_dg: list[int]) -> Layout:
        """BASE with its per-task durations over PT's expanded tasks (same lanes and holdings, same id: the
        routing caches, keyed by layout ids, depend only on those), plus the gradient accumulation of each
        backward task after the first micro-batch on the lane's device (LANE_DG: lane -> device group)."""
        key = (base.id, pt.uid)
        lay = self._pipeline_layouts.get(key)
        if lay is None:
            if len(self._pipeline_layouts) > 4096:
                self._pipeline_layouts.clear()
            insts = []
            accumulates = bool(pt.accumulate_tensors.any())
            defers = bool(pt.is_weight_task.any())
            for lane, _, b, ta in base.insts:
                d = ta[pt.base_task]
                r = self.cost.rates(lane_dg[lane])
                if accumulates:
                    d = d + 3.0 * pt.accumulate_bytes / r.memory_bandwidth + pt.accumulate_tensors * r.launch_overhead_s
                if defers:      # W tasks: the weight-gradient ops and the concatenation of their inputs
                    w = self.layouts.table(lane_dg[lane], b, self._weight_gradients()[0])[1][pt.base_task]
                    d = np.where(pt.is_weight_task, w + 2.0 * b * pt.concat_per_example / r.memory_bandwidth,
                                 np.where(pt.is_input_part, d - w, d))
                insts.append((lane, d.tolist(), b, d))
            lay = Layout(base.id, base.kind, insts, base.holdings, base.devices, ("pipeline", pt.uid) + base.key)
            self._pipeline_layouts[key] = lay
        return lay

    def _check_micro_batches(self, pipeline: Pipeline, batch: int) -> None:
        """Every device of every stage gets at least one example of every micro-batch."""
        M = pipeline.micro_batches
        devices = self.topology.devices
        for i, st in enumerate(pipeline.stages):
            devs = self.layouts.devices_of(st.placement)
            if batch < len(devs):
                raise StrategyError(f"pipeline stage {i}: the global batch of {batch} is smaller than its "
                                    f"{len(devs)} devices")
            shares = self.layouts.shares_of(st.placement, batch)
            k = int(np.argmin(shares))
            if shares[k] < M:
                raise StrategyError(f"pipeline stage {i}: {M} micro-batches but device {devices[devs[k]].name} "
                                    f"gets only {shares[k]} examples of the batch of {batch} (a micro-batch "
                                    f"would be empty there)")

    def _run_pipeline(self, pipeline: Pipeline, batch: int, record: Recording | None) -> SimResult:
        """One step of a pipelined strategy: the expanded task graph (tag.sim.pipeline) on the list schedule."""
        pt = self.pipeline_tasks(pipeline)
        stage_actions = [st.action() for st in pipeline.stages]
        for a in stage_actions:
            self._check_action(a)
        self._check_micro_batches(pipeline, batch)
        actions = [stage_actions[int(s)] for s in pt.stage_of_group]
        distinct = {id(a): a for a in stage_actions}
        special = frozenset(int(a.ps_device) for a in stage_actions if a.mode == "ps")
        lanes = self.layouts.lanes(special)
        sizes = batch_shares([1.0] * pipeline.micro_batches, batch)      # examples per micro-batch
        cache = self.layouts
        # per stage: {micro-batch size: expanded layout}, and the PS layout of its update tasks
        by_size = [{b: self._expanded_layout(cache.replicated_layout(st.placement, lanes, b), pt, lanes.lane_dg)
                    for b in sorted(set(sizes))} for st in pipeline.stages]
        # deferred W tasks run once on the stage's whole share of the batch
        whole = [self._expanded_layout(cache.replicated_layout(st.placement, lanes, batch), pt, lanes.lane_dg)
                 if pt.is_weight_task.any() else None for st in pipeline.stages]
        ps_layouts = [self._expanded_layout(cache.device_layout(int(a.ps_device), lanes, sizes[0]), pt, lanes.lane_dg)
                      if a.mode == "ps" else None for a in stage_actions]
        if self._kernel is not None and record is None:
            return self._run_pipeline_compiled(pt, stage_actions, by_size, ps_layouts, whole, sizes, lanes, batch)
        update = UPDATE_STAGE
        layout_of_task = []
        for s, st_kind, m in zip(pt.pipeline_stage.tolist(), pt.task_stage_list, pt.micro_batch.tolist(), strict=True):
            if st_kind == update:
                layout_of_task.append(ps_layouts[s] or by_size[s][sizes[0]])
            elif m == WEIGHT_STEP:
                layout_of_task.append(whole[s])
            else:
                layout_of_task.append(by_size[s][sizes[m]])
        group_layouts = [by_size[int(s)][sizes[0]] for s in pt.stage_of_group]
        schedule = StepSchedule(pt, self.routing, layout_of_task, {}, len(lanes.lanes), {}, self.grouping.names,
                                record, None,
                                None if self._sync_serial is None else (lanes.lane_of_device, self._sync_serial))
        has_ps = any(a.mode == "ps" for a in stage_actions)
        schedule.add_flows(actions, has_ps)
        schedule.add_collectives(actions, group_layouts,
                                 self._collective_bytes(actions, self.memory.weight_bytes_list, batch,
                                                        pipeline=True), None,
                                 self.memory.weight_count_list)
        step = schedule.run(actions)
        if record is not None:
            record.lanes = lanes
            record.matrices = (schedule.start.T, schedule.finish.T, schedule.batch.T)
        result = self._result(actions, distinct, {}, lanes, batch, step, schedule, SfbPlan([]), tasks=pt)
        result.bubble_fraction = bubble_fraction(pt.pipeline_stage, pt.task_stage, schedule.start, schedule.finish)
        return result

    def _run_pipeline_compiled(self, pt: PipelineTasks, stage_actions: list[Action], by_size: list[dict],
                               ps_layouts: list[Layout | None], whole: list[Layout | None], sizes: list[int],
                               lanes: Lanes, batch: int) -> SimResult:
        """``_run_pipeline`` on the compiled kernel: one kernel state per expanded task graph (its layouts
        carry their base layouts' ids, so each pipeline structure registers them apart)."""
        entry = self._pipeline_kernels.get(pt.uid)
        if entry is None:
            M = len(sizes)
            entry = (KernelState(pt, pt.memory, self.routing, self._device_memory),
                     np.asarray(pt.stage_of_group, dtype=np.int64),
                     np.where(pt.micro_batch == WEIGHT_STEP, M + 1,
                              np.where(pt.micro_batch < 0, M, pt.micro_batch)))  # task -> column of the layout table
            self._pipeline_kernels[pt.uid] = entry
        kernel, group_stage, column = entry
        kernel.begin()
        num_stages, M = len(stage_actions), len(sizes)
        local_ai = np.empty(num_stages, dtype=np.int64)
        for i, a in enumerate(stage_actions):
            ai = kernel.action_index.get(a)
            local_ai[i] = ai if ai is not None else kernel.action(a, self.layouts.devices_of(a.placement))
        # [stage, micro-batch] -> layout of its forward and backward tasks; [stage, M] -> of its update tasks;
        # [stage, M + 1] -> of its deferred W tasks
        table = np.empty((num_stages, M + 2), dtype=np.int64)
        for i in range(num_stages):
            for m in range(M):
                table[i, m] = kernel.layout(by_size[i][sizes[m]])
            table[i, M] = kernel.layout(ps_layouts[i]) if ps_layouts[i] is not None else table[i, 0]
            table[i, M + 1] = kernel.layout(whole[i]) if whole[i] is not None else table[i, 0]
        task_layout = table[pt.pipeline_stage, column]
        unused = np.full(num_stages, -1, dtype=np.int64)
        lane_of_device = lanes.lane_of_device
        step, comm, start, finish, batches, collective_end, peak, static, activation = kernel.run(
            group_stage, local_ai, unused, unused, task_layout, len(lanes.lanes), lane_of_device, kernel.static_zero,
            {}, w_coll=self._collective_bytes(stage_actions, None, batch, group_stage, pipeline=True),
            serial=self._sync_serial)
        self.compiled_evaluations += 1
        oom = np.flatnonzero(peak > self._device_memory)
        features = partial(_features_of_schedule, self.num_groups, pt.task_by_group, pt.task_by_group_starts,
                           lane_of_device, step, collective_end, start, finish, self.topology.num_devices)
        result = SimResult(step + self._step_overhead, peak, len(oom) == 0, oom.tolist(), comm, static, activation,
                           batch, _features=features,
                           _compute=partial(device_compute_time, lane_of_device, start, finish))
        result.bubble_fraction = bubble_fraction(pt.pipeline_stage, pt.task_stage, start, finish)
        return result

    def _step_offsets(self, actions: Iterable[Action], lanes: Lanes) -> tuple[np.ndarray, np.ndarray] | None:
        """When each lane and communication resource is first free: workers on other hosts launch their part
        of the step first (``tag.sim.host_cpu.step_offsets``; None when nothing is charged). ACTIONS: the
        step's distinct actions. Cached by the devices they use, since the search evaluates few such sets."""
        if self._host_net is None:
            return None
        used: set[int] = set()
        for a in actions:
            devices = self._action_devices.get(a)
            if devices is None:
                if len(self._action_devices) > 20000:
                    self._action_devices.clear()
                devices = self._action_devices[a] = action_devices(a, self.topology)
            used.update(devices)
        key = (frozenset(used), lanes.key)
        if key not in self._offsets:
            if len(self._offsets) > 4096:
                self._offsets.clear()
            self._offsets[key] = step_offsets(self.topology, self._host_net, self._cpu_speed, lanes, key[0],
                                              len(self.routing.resource_names))
        return self._offsets[key]

    def _collective_bytes(self, actions: list[Action], weights, batch: int, group_of: np.ndarray | None = None,
                          pipeline: bool = False):
        """Bytes each op group's collective is charged for (``MemoryModel.collective_bytes``): WEIGHTS
        (default: the trainable bytes) with sparse gradients as rows, or as dense tables where an allreduce
        group outside a PIPELINE sums them so. ACTIONS: one per op group, or with GROUP_OF (group -> index
        into ACTIONS) one per distinct action. None for the kernel means its own weight bytes; a list stays
        a list."""
        memory = self.memory
        if not memory.has_sparse:
            return weights
        replicas = [len(self.layouts.devices_of(a.placement)) for a in actions]
        factors = np.array([sparse_factor(a.mode, n) for a, n in zip(actions, replicas, strict=True)])
        dense_ok = np.array([not pipeline and a.mode == "allreduce" and n > 1
                             for a, n in zip(actions, replicas, strict=True)])
        if group_of is not None:
            factors, dense_ok = factors[group_of], dense_ok[group_of]
        out = memory.collective_bytes(memory.weight_bytes if weights is None else weights, factors, batch,
                                      dense_ok=dense_ok)
        return out if weights is None else out.tolist()

    def _result(self, actions: list[Action], distinct: dict[int, Action], plans: dict[int, dict], lanes: Lanes,
                batch: int, step: float, schedule: StepSchedule, sfb: SfbPlan,
                tasks: TaskGraph | PipelineTasks | None = None) -> SimResult:
        num_devices = self.topology.num_devices
        tasks = self.tasks if tasks is None else tasks
        memory = self.memory if tasks is self.tasks else tasks.memory
        static = self.memory.static_memory(actions, distinct, plans, self.layouts.devices_of, num_devices)
        if sfb.memory is not None:
            static = static + sfb.memory
        ran = schedule.finish >= 0
        activation_peak = memory.activation_peak(ran, schedule.batch, schedule.split_parts)
        lane_of_device = lanes.lane_of_device
        activation = np.maximum(activation_peak, 0.0)[lane_of_device]
        peak = static + activation
        oom = np.flatnonzero(peak > self._device_memory)
        features = partial(schedule_features, self.num_groups, tasks.task_by_group,
                           tasks.task_by_group_starts, lane_of_device, step, schedule.collective_end, ran,
                           schedule.start, schedule.finish, num_devices)
        return SimResult(float(step) + self._step_overhead, peak, len(oom) == 0, [int(d) for d in oom],
                         float(schedule.comm_bytes), static, activation, batch, _features=features,
                         _compute=partial(device_compute_time, lane_of_device, schedule.start, schedule.finish, ran))


def _features_of_schedule(num_groups: int, task_by_group: np.ndarray, task_by_group_starts: np.ndarray,
                          lane_of_device: np.ndarray, step: float, collective_end: np.ndarray, start: np.ndarray,
                          finish: np.ndarray, num_devices: int) -> dict[str, np.ndarray]:
    """``schedule_features`` of the compiled kernel's schedule (which lanes ran which task: finish >= 0)."""
    return schedule_features(num_groups, task_by_group, task_by_group_starts, lane_of_device, step, collective_end,
                             finish >= 0, start, finish, num_devices)
