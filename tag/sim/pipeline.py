"""Pipelines in the simulator: the task graph expanded per micro-batch, in the order the stages run it.

A pipelined strategy (``Strategy.pipeline``, ``tag.strategy.pipeline``) runs every forward and backward
task of a stage once per micro-batch. ``PipelineTasks`` builds that expanded task graph from the
simulator's ``TaskGraph`` so the same list schedule (``tag.sim.schedule.StepSchedule``), routing, contention
and memory model simulate it as they simulate any other strategy:

- expanded task = (base forward/backward task, micro-batch m), plus each base update task once (gradients
  accumulate over micro-batches and are applied once per step);
- a bundle between two base tasks becomes one bundle per micro-batch (forward activations crossing a stage
  boundary travel per micro-batch, their gradients back the same way); a bundle into an update task becomes
  one bundle from every micro-batch's producer;
- the expanded tasks are numbered in one global order that keeps each stage's schedule order
  (``Pipeline.steps()``) and every dependency: the steps are ordered by their start in a nominal timeline
  (a forward step takes 1, a backward 2, every stage in its own order), ties by stage. Each lane runs its
  tasks in that order, so a stage runs its micro-batches exactly as the schedule says, and the memory
  model's live buffers (forward activations held until their backward) follow the schedule: 1F1B holds
  fewer micro-batches than fill-drain;
- gradient collectives wait for every micro-batch's gradient task (one all-reduce or PS push per op group,
  as for per-group strategies); the update tasks wait for them;
- every backward task after the first micro-batch also adds its weight gradients into running sums
  (``accumulate_bytes``; the simulator charges three passes over them at the device's memory bandwidth,
  plus a launch overhead per gradient);
- under ``deferred_w`` (``DeferredWeights``), a backward task of a one-device stage that holds
  weight-gradient ops is split: its micro-batch copies run the other ops (``is_input_part``), and one W task
  (``micro_batch`` ``WEIGHT_STEP``, after the stage's last step) runs those ops on the stage's whole batch
  and concatenates their inputs (``concat_per_example``); its gradients leave from the W task, and nothing
  accumulates.

Bad pipelines raise ``StrategyError`` naming the stage: a forward tensor flowing from a later stage to an
earlier one (or a backward tensor from an earlier stage to a later one), which no schedule can run.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tag.sim import Simulator
    from tag.sim.pipeline import PipelineTasks
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    grouping = group_ops(tg, target_groups=6)
    sim = Simulator(tg, tag.load_topology("topologies/localhost.pbtxt"), grouping)
    p = Pipeline((PipelineStage((0, 1, 2), (0,)), PipelineStage((3, 4, 5), (0,))), 4, "1f1b")
    tasks = PipelineTasks(sim.tasks, sim.memory, p, grouping.names)
    tasks.num_tasks, tasks.labels[:3]             # ('F0 dense', ...)
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import numpy as np

from tag.errors import StrategyError
from tag.sim.memory import MemoryModel
from tag.sim.task_graph import UPDATE_STAGE, TaskGraph
from tag.strategy.pipeline import Pipeline

# nominal step lengths of the timeline that orders the expanded tasks (a backward costs about twice a forward)
_NOMINAL = {"F": 1.0, "B": 2.0}
WEIGHT_STEP = -2        # ``micro_batch`` of a deferred W task (-1: an update task)


@dataclass(frozen=True)
class DeferredWeights:
    """What ``deferred_w`` defers: STAGES (pipeline stages on one device), OPS (per op:
    ``tag.ir.algorithms.weight_gradient_ops``) and CONCAT_PER_EXAMPLE (per base task: bytes per example of the
    batch-axis tensors its weight-gradient ops read, which the rewriter concatenates over the micro-batches)."""

    stages: frozenset
    ops: np.ndarray
    concat_per_example: np.ndarray


_UIDS = itertools.count(1)      # a number per expansion, never reused (keys of the simulator's layout caches)


class PipelineTasks:
    """The task graph of one pipeline structure (stages' op groups, M, schedule), duck-typing ``TaskGraph``
    for ``StepSchedule`` and ``schedule_features``; ``memory`` is the matching ``MemoryModel``.

    Per expanded task: ``base_task`` (the TaskGraph task it copies), ``micro_batch`` (-1: update, once;
    ``WEIGHT_STEP``: a deferred W task),
    ``pipeline_stage``, ``labels`` (trace names: ``F3 dense_1`` = forward of micro-batch 3)."""

    def __init__(self, base: TaskGraph, memory: MemoryModel, pipeline: Pipeline, group_names: list[str],
                 deferred: DeferredWeights | None = None):
        self.base = base
        self.pipeline = pipeline
        self.uid = next(_UIDS)
        self.num_groups = base.num_groups
        self.group_of_op = base.group_of_op
        M = pipeline.micro_batches
        stage_of_group = pipeline.stage_of_group(base.num_groups)
        self.stage_of_group = stage_of_group
        base_stage = base.task_stage
        stage_of_task = stage_of_group[base.task_group]
        self._check_directions(base, stage_of_task, group_names)
        order = self._step_order(base, stage_of_task)
        # expanded numbering: the steps in timeline order, each its stage's base tasks of that kind in base order
        tasks_of: dict[tuple[str, int], list[int]] = {}
        for t in range(base.num_tasks):
            if base_stage[t] != UPDATE_STAGE:
                tasks_of.setdefault(("F" if base_stage[t] == 0 else "B", int(stage_of_task[t])), []).append(t)
        # deferred weight gradients: per base backward task of a deferring stage, whether it holds any
        self.has_weight_part = np.zeros(base.num_tasks, dtype=bool)
        self._weight_ops = deferred.ops if deferred is not None else np.zeros(len(base.group_of_op), dtype=bool)
        if deferred is not None and M > 1:
            for t in range(base.num_tasks):
                self.has_weight_part[t] = (base_stage[t] == 1 and int(stage_of_task[t]) in deferred.stages
                                           and bool(deferred.ops[base.task_ops[t]].any()))
            last = {s: j for j, (_, s, _) in enumerate(order)}
            for s in sorted(set(int(x) for x in stage_of_task[self.has_weight_part])):
                tasks_of[("W", s)] = [t for t in tasks_of.get(("B", s), ()) if self.has_weight_part[t]]
            order = [step for j, step in enumerate(order) for step in
                     ([step, ("W", step[1], WEIGHT_STEP)] if last[step[1]] == j and ("W", step[1]) in tasks_of
                      else [step])]
        base_task, micro = [], []
        for kind, s, m in order:
            for t in tasks_of.get((kind, s), ()):
                base_task.append(t)
                micro.append(m)
        updates = [t for t in range(base.num_tasks) if base_stage[t] == UPDATE_STAGE]
        base_task += updates
        micro += [-1] * len(updates)
        self.base_task = np.asarray(base_task, dtype=np.int64)
        self.micro_batch = np.asarray(micro, dtype=np.int64)
        self.num_tasks = T = len(base_task)
        index = np.full((base.num_tasks, M), -1, dtype=np.int64)     # (base task, micro-batch) -> expanded
        self.weight_task = np.full(base.num_tasks, -1, dtype=np.int64)   # base task -> its deferred W task
        for x in range(T):
            t, m = base_task[x], micro[x]
            if m == WEIGHT_STEP:
                self.weight_task[t] = x
            elif m < 0:
                index[t, :] = x
            else:
                index[t, m] = x
        self.index = index
        self.is_weight_task = self.micro_batch == WEIGHT_STEP                 # per expanded task
        self.is_input_part = (self.micro_batch >= 0) & self.has_weight_part[self.base_task]
        self.task_group = base.task_group[self.base_task]
        self.task_stage = base_stage[self.base_task]
        self.task_group_list: list[int] = self.task_group.tolist()
        self.task_stage_list: list[int] = self.task_stage.tolist()
        self.pipeline_stage = stage_of_task[self.base_task]
        self.tasks_of_group: list[list[int]] = [[] for _ in range(self.num_groups)]
        for x in range(T):
            self.tasks_of_group[self.task_group_list[x]].append(x)
        self.task_by_group = np.argsort(self.task_group, kind="stable")
        self.task_by_group_starts = np.searchsorted(self.task_group[self.task_by_group], np.arange(self.num_groups))
        self.labels = [f"{'FB'[st]}{m} {group_names[g]}" if m >= 0 else
                       f"W {group_names[g]}" if m == WEIGHT_STEP else f"update {group_names[g]}"
                       for st, m, g in zip(self.task_stage_list, micro, self.task_group_list, strict=True)]
        self._expand_bundles(base, M)
        self._expand_anchors(base, M)
        self._accumulation(base)
        self.concat_per_example = np.zeros(T)      # bytes per example the W task concatenates (its inputs)
        if deferred is not None:
            self.concat_per_example[self.is_weight_task] = deferred.concat_per_example[self.base_task[
                self.is_weight_task]]
        self.memory = self._expand_memory(memory, M)
        self.dropped_dependencies = base.dropped_dependencies
        self.internal_edges = [base.internal_edges[t] for t in base_task]

    def _accumulation(self, base: TaskGraph) -> None:
        """``accumulate_bytes`` / ``accumulate_tensors`` per expanded task: the weight gradients a backward task
        of micro-batch m >= 1 adds into the running sums (the rewriter's gradient accumulation: each add reads
        two gradients and writes one; the first micro-batch's gradients start the sums). For a 2048-wide
        layer that is 48 MB of memory traffic per micro-batch, which no per-op time of the base graph holds."""
        grad_bytes = np.zeros(base.num_tasks)
        grad_tensors = np.zeros(base.num_tasks)
        for b, (src, dst) in enumerate(zip(base.bundle_src, base.bundle_dst, strict=True)):
            if base.task_stage[dst] == UPDATE_STAGE and base.task_stage[src] == 1:
                grad_bytes[src] += base.bundle_own[b][1] + sum(fx for _, _, fx in base.bundle_shared[b])
                grad_tensors[src] += base.bundle_own_tensors[b] + len(base.bundle_shared[b])
        adds = (self.micro_batch >= 1) & (self.task_stage == 1) & ~self.has_weight_part[self.base_task]
        self.accumulate_bytes = np.where(adds, grad_bytes[self.base_task], 0.0)
        self.accumulate_tensors = np.where(adds, grad_tensors[self.base_task], 0.0)

    # ------------------------------------------------------------------ checks and order
    @staticmethod
    def _check_directions(base: TaskGraph, stage_of_task: np.ndarray, names: list[str]) -> None:
        """Forward data must flow to the same or a later stage, backward data to the same or an earlier one."""
        src, dst = base.bundle_src_array, base.bundle_dst_array
        if not len(src):
            return
        kind_src, kind_dst = base.task_stage[src], base.task_stage[dst]
        s_src, s_dst = stage_of_task[src], stage_of_task[dst]
        bad_forward = (kind_src == 0) & (kind_dst == 0) & (s_src > s_dst)
        bad_backward = (kind_src == 1) & (kind_dst == 1) & (s_src < s_dst)
        for bad, what in ((bad_forward, "forward"), (bad_backward, "backward")):
            if bad.any():
                b = int(np.flatnonzero(bad)[0])
                a, c = int(src[b]), int(dst[b])
                raise StrategyError(
                    f"pipeline stage {int(s_dst[b])}: its op group {names[base.task_group_list[c]]!r} reads "
                    f"{what} tensors of op group {names[base.task_group_list[a]]!r} in stage {int(s_src[b])}; "
                    f"stages must be contiguous runs of op groups in dependency order")

    def _step_order(self, base: TaskGraph, stage_of_task: np.ndarray) -> list[tuple[str, int, int]]:
        """Every (kind, stage, micro-batch) step in the order of a nominal timeline (module docstring)."""
        steps = self.pipeline.steps()
        S = len(steps)
        kinds = np.where(base.task_stage == 0, 0, np.where(base.task_stage == 1, 1, -1))
        src, dst = base.bundle_src_array, base.bundle_dst_array
        # (kind, stage) steps each (kind, stage) step waits for, for the same micro-batch
        waits: dict[tuple[str, int], set[tuple[str, int]]] = {}
        if len(src):
            ks, kd = kinds[src], kinds[dst]
            keep = (ks >= 0) & (kd >= 0)
            pairs = set(zip(ks[keep].tolist(), stage_of_task[src][keep].tolist(),
                            kd[keep].tolist(), stage_of_task[dst][keep].tolist(), strict=True))
            for a_kind, a_stage, b_kind, b_stage in pairs:
                if (a_kind, a_stage) != (b_kind, b_stage):
                    waits.setdefault(("FB"[b_kind], b_stage), set()).add(("FB"[a_kind], a_stage))
        done: dict[tuple[str, int, int], float] = {}      # step -> nominal finish
        position = [0] * S
        free = [0.0] * S
        order: list[tuple[str, int, int]] = []
        total = sum(len(s) for s in steps)
        while len(order) < total:
            best = None
            for s in range(S):
                if position[s] >= len(steps[s]):
                    continue
                kind, m = steps[s][position[s]]
                ready = free[s]
                for (wk, ws) in waits.get((kind, s), ()):
                    f = done.get((wk, ws, m))
                    if f is None:
                        ready = None
                        break
                    ready = max(ready, f)
                if ready is not None and (best is None or ready < best[0]):
                    best = (ready, s, kind, m)
            if best is None:     # cannot happen after _check_directions; kept as a clear error
                raise StrategyError("pipeline: the stages' schedules wait for each other (no order runs them)")
            ready, s, kind, m = best
            done[(kind, s, m)] = free[s] = ready + _NOMINAL[kind]
            position[s] += 1
            order.append((kind, s, m))
        return order

    # ------------------------------------------------------------------ bundles, anchors, memory
    def _expand_bundles(self, base: TaskGraph, M: int) -> None:
        """One bundle per micro-batch. With deferred weight gradients, the tensors a task's weight-gradient ops
        send (gradients to the update, partial sums to another W task) leave its W task once; the rest of
        the bundle still moves per micro-batch; and a W task waits for its task's every micro-batch (a
        dependency of no bytes: its inputs are already on its device)."""
        index, weight_task = self.index, self.weight_task
        # (expanded src, expanded dst) -> base bundle, or (edges, (per-example, fixed), tensors) of a part of one
        keys: dict[tuple[int, int], object] = {}
        ops = self._weight_ops
        for b, (a, c) in enumerate(zip(base.bundle_src, base.bundle_dst, strict=True)):
            to_update = base.task_stage[c] == UPDATE_STAGE
            if weight_task[a] >= 0 and (to_update or weight_task[c] >= 0):
                edges = base.bundle_edges[b]
                sent_by_w = [bool(ops[e[0]] and (to_update or ops[e[1]])) for e in edges]
                mine = [e for e, w in zip(edges, sent_by_w, strict=True) if w]
                rest = [e for e, w in zip(edges, sent_by_w, strict=True) if not w]
                xc = int(index[c, 0]) if to_update else int(weight_task[c])
                if mine and int(weight_task[a]) < xc:
                    keys.setdefault((int(weight_task[a]), xc), _part(mine))
                if to_update or mine:           # the rest (if any) per micro-batch, as its own bundle
                    if rest or not edges:
                        part = _part(rest)
                        for m in range(M):
                            xa, xc = int(index[a, m]), int(index[c, m])
                            if xa < xc:
                                keys.setdefault((xa, xc), part)
                    continue
            for m in range(M):
                xa, xc = int(index[a, m]), int(index[c, m])
                if xa < xc and (xa, xc) not in keys:
                    keys[(xa, xc)] = b
        for t in np.flatnonzero(weight_task >= 0).tolist():
            for m in range(M):
                keys.setdefault((int(index[t, m]), int(weight_task[t])), _part([]))
        ordered = sorted(keys)
        self.bundle_src = [k[0] for k in ordered]
        self.bundle_dst = [k[1] for k in ordered]
        self.bundle_src_array = np.asarray(self.bundle_src, dtype=np.int64)
        self.bundle_dst_array = np.asarray(self.bundle_dst, dtype=np.int64)
        base_of = [keys[k] for k in ordered]
        group = self.task_group_list
        self.bundle_edges = [base.bundle_edges[b] if isinstance(b, int) else b[0] for b in base_of]
        self.bundle_same_group = [base.bundle_same_group[b] if isinstance(b, int) else group[k[0]] == group[k[1]]
                                  for k, b in zip(ordered, base_of, strict=True)]
        self.bundle_own = [base.bundle_own[b] if isinstance(b, int) else b[1] for b in base_of]
        self.bundle_own_tensors = [base.bundle_own_tensors[b] if isinstance(b, int) else b[2] for b in base_of]
        # a shared tensor moves once per micro-batch and destination layout: one tensor id per micro-batch
        micro = self.micro_batch
        self.bundle_shared = [[(tid * M + max(int(micro[k[0]]), 0), pe, fx) for tid, pe, fx in base.bundle_shared[b]]
                              if isinstance(b, int) else [] for k, b in zip(ordered, base_of, strict=True)]

    def _expand_anchors(self, base: TaskGraph, M: int) -> None:
        index, stage = self.index, self.task_stage_list
        self.coll_deps, self.coll_after, self.update_tasks, self.forward_tasks = [], [], [], []
        weight_task = self.weight_task
        for g in range(self.num_groups):
            deps = sorted({int(weight_task[t]) if weight_task[t] >= 0 else int(index[t, m])
                           for t in base.coll_deps[g] for m in range(M)})
            after = max(deps) if deps else -1
            mine = self.tasks_of_group[g]
            self.coll_deps.append(deps)
            self.coll_after.append(after)
            self.update_tasks.append([x for x in mine if stage[x] == UPDATE_STAGE and x > after])
            self.forward_tasks.append([x for x in mine if stage[x] == 0])

    def _expand_memory(self, memory: MemoryModel, M: int) -> MemoryModel:
        """MEMORY with its per-task arrays over the expanded tasks: a buffer lives per micro-batch from its
        producer's copy to its last reader's copy of the same micro-batch."""
        index, weight_task = self.index, self.weight_task
        src_rows, last_rows, pe_rows, fixed_rows = [], [], [], []
        for s, last, pe, fx in zip(memory.live_src_task.tolist(), memory.live_last_task.tolist(),
                                   memory.live_per_example.tolist(), memory.live_fixed.tolist(), strict=True):
            # a buffer a deferred task reads lives until its W task (which may read it)
            pairs = {(int(index[s, m]), int(weight_task[last]) if weight_task[last] >= 0 else int(index[last, m]))
                     for m in range(M)}
            for xs, xl in pairs:
                if xl > xs:
                    src_rows.append(xs)
                    last_rows.append(xl)
                    pe_rows.append(pe)
                    fixed_rows.append(fx)
        out = copy.copy(memory)
        out.working_fixed = memory.working_fixed[self.base_task] if self.num_tasks else np.zeros(0)
        out.working_per_example = memory.working_per_example[self.base_task] if self.num_tasks else np.zeros(0)
        out.set_live_rows(np.asarray(src_rows, dtype=np.int64), np.asarray(last_rows, dtype=np.int64),
                          np.asarray(pe_rows, dtype=np.float64), np.asarray(fixed_rows, dtype=np.float64))
        return out


def _part(edges: list) -> tuple[list, tuple[float, float], int]:
    """A bundle of EDGES alone (each tensor counted once, as a tensor only it moves): (edges, (per-example,
    fixed) bytes, tensors)."""
    seen: dict[str, tuple[float, float]] = {}
    for _, _, pe, fx, tensor in edges:
        seen.setdefault(tensor, (pe, fx))
    return edges, (sum(v[0] for v in seen.values()), sum(v[1] for v in seen.values())), len(seen)


def bubble_fraction(pipeline_stage: np.ndarray, task_stage: np.ndarray, start: np.ndarray,
                    finish: np.ndarray) -> float:
    """Predicted bubble: 1 - mean over stages with forward/backward tasks of (the forward/backward seconds of
    the stage's busiest lane) / (the span from the first forward start to the last backward end over all
    stages). Equal stages give the ideal (S - 1) / (M + S - 1). START, FINISH: [lane, expanded task]
    (finish -1: not run); PIPELINE_STAGE, TASK_STAGE: per expanded task."""
    ran = (finish >= 0) & (task_stage < UPDATE_STAGE)[None, :]
    if not ran.any():
        return 0.0
    span = float(np.where(ran, finish, -np.inf).max() - np.where(ran, start, np.inf).min())
    if span <= 0:
        return 0.0
    busy = (finish - start) * ran
    working = pipeline_stage[task_stage < UPDATE_STAGE]
    fractions = [float(busy[:, pipeline_stage == s].sum(axis=1).max()) / span
                 for s in range(int(pipeline_stage.max()) + 1) if (working == s).any()]
    return float(min(1.0, max(0.0, 1.0 - float(np.mean(fractions)))))
