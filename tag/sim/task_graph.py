"""The simulator's task graph: the tasks of a grouping in their fixed priority order, and the data between them.

A *task* is the ops of one op group in one stage (0 forward, 1 backward, 2 update; an op's stage is its
phase raised to the latest stage of its ancestors, ``tag.ir.algorithms.op_stages``). Tasks are numbered
in the order every lane runs them: forward and backward first, update tasks last, ties by the ops'
topological positions. A *bundle* is all the tensors one task sends to one later task. All of this
depends only on the graph and the grouping, so ``Simulator()`` builds it once (numpy only).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.sim.task_graph import TaskGraph
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    tasks = TaskGraph(tg, group_ops(tg, target_groups=8))
    tasks.num_tasks, tasks.task_group[:5], tasks.task_stage[:5], len(tasks.bundle_src)
"""
from __future__ import annotations

import heapq

import numpy as np

from tag.ir.algorithms import dependency_arrays, op_stages, topological_order
from tag.ir.types import TrainingGraph
from tag.strategy.types import Grouping

UPDATE_STAGE = 2


def priority_order(task_keys: np.ndarray, first_position: np.ndarray, edges: np.ndarray) -> list[int]:
    """Tasks (indices into TASK_KEYS = group * 3 + stage) in a topological order of EDGES (task pairs) by
    priority: update tasks last, then by FIRST_POSITION (the topological position of the task's first op),
    then by key. A cycle (only with hand-made groupings) is broken at its best remaining task."""
    num = len(task_keys)
    successors: list[list[int]] = [[] for _ in range(num)]
    indegree = [0] * num
    for a, b in edges.tolist():
        successors[a].append(b)
        indegree[b] += 1
    priority = [(int(task_keys[k] % 3 == UPDATE_STAGE), int(first_position[k]), int(task_keys[k]))
                for k in range(num)]
    heap = [(priority[k], k) for k in range(num) if indegree[k] == 0]
    heapq.heapify(heap)
    done = np.zeros(num, dtype=bool)
    order: list[int] = []
    while len(order) < num:
        if not heap:
            k = min((priority[k], k) for k in range(num) if not done[k])[1]
            indegree[k] = 0
            heapq.heappush(heap, (priority[k], k))
        _, k = heapq.heappop(heap)
        if done[k]:
            continue
        done[k] = True
        order.append(k)
        for j in successors[k]:
            indegree[j] -= 1
            if indegree[j] == 0 and not done[j]:
                heapq.heappush(heap, (priority[j], j))
    return order


class TaskGraph:
    """Tasks, their ops, and the bundles of tensors between them, for one graph and grouping.

    Per task (arrays and lists indexed by task number): ``task_group``, ``task_stage``, ``task_ops``.
    Per op: ``group_of_op``, ``op_position`` (topological), ``task_of_op``. Per op group: ``members``,
    ``tasks_of_group``. Per bundle (sorted by (producer task, consumer task)): ``bundle_src``,
    ``bundle_dst``, ``bundle_edges``, ``bundle_own``, ``bundle_shared``, ``bundle_same_group``.
    """

    def __init__(self, graph: TrainingGraph, grouping: Grouping):
        n = len(graph.ops)
        self.num_groups = num_groups = grouping.num_groups
        self.group_of_op = group_of_op = np.asarray(grouping.group_of_op, dtype=np.int64)
        order = topological_order(graph)
        stage = op_stages(graph, order).astype(np.int64)
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)
        self.op_position = position
        self._number_tasks(graph, group_of_op * 3 + stage, position)
        # per op group: its ops (array and list) and its tasks in priority order
        self.members = [np.flatnonzero(group_of_op == g) for g in range(num_groups)]
        self.members_list = [m.tolist() for m in self.members]
        self.tasks_of_group: list[list[int]] = [[] for _ in range(num_groups)]
        for t in range(self.num_tasks):
            self.tasks_of_group[self.task_group_list[t]].append(t)
        # tasks sorted by group, and where each group's run starts in that order (for per-group reductions)
        self.task_by_group = np.argsort(self.task_group, kind="stable")
        self.task_by_group_starts = np.searchsorted(self.task_group[self.task_by_group], np.arange(num_groups))
        self._find_bundles(graph)
        self._collective_anchors(graph)

    def _number_tasks(self, graph: TrainingGraph, op_key: np.ndarray, position: np.ndarray) -> None:
        """Tasks = distinct (group, stage) keys of the ops, numbered in priority order."""
        task_keys, key_of_op = np.unique(op_key, return_inverse=True)
        num = len(task_keys)
        first_position = np.full(num, np.iinfo(np.int64).max)
        np.minimum.at(first_position, key_of_op, position)
        src, dst = dependency_arrays(graph)
        key_src, key_dst = key_of_op[src], key_of_op[dst]
        cross = key_src != key_dst
        edges = (np.unique(np.stack([key_src[cross], key_dst[cross]], 1), axis=0) if cross.any()
                 else np.zeros((0, 2), np.int64))
        order = np.asarray(priority_order(task_keys, first_position, edges), dtype=np.int64)
        rank = np.empty(num, dtype=np.int64)
        rank[order] = np.arange(num)
        self.num_tasks = num
        self.task_of_op = rank[key_of_op]
        ordered_keys = task_keys[order] if num else task_keys
        self.task_group = (ordered_keys // 3).astype(np.int64)
        self.task_stage = (ordered_keys % 3).astype(np.int64)
        self.task_group_list: list[int] = self.task_group.tolist()
        self.task_stage_list: list[int] = self.task_stage.tolist()
        ops_of_task: list[list[int]] = [[] for _ in range(num)]
        for i in np.argsort(self.task_of_op, kind="stable").tolist():
            ops_of_task[self.task_of_op[i]].append(i)
        self.task_ops = [np.asarray(x, dtype=np.int64) for x in ops_of_task]

    def _find_bundles(self, graph: TrainingGraph) -> None:
        """Bundles of tensors between tasks, edges inside tasks, and the dependencies that point backwards."""
        task_of_op = self.task_of_op
        edge_src = np.array([e.src for e in graph.edges], dtype=np.int64)
        edge_dst = np.array([e.dst for e in graph.edges], dtype=np.int64)
        edge_fixed = np.array([max(e.nbytes.fixed, 0.0) for e in graph.edges])
        edge_per_example = np.array([max(e.nbytes.per_example, 0.0) for e in graph.edges])
        tensors = [e.tensor for e in graph.edges]
        # (producer task, consumer task) -> its edges [(src op, dst op, per-example, fixed bytes, tensor)]
        edges_of: dict[tuple[int, int], list] = {}
        # (producer task, consumer task) -> [(tensor id, per-example, fixed bytes)], each tensor once
        tensors_of: dict[tuple[int, int], list] = {}
        tensor_id: dict[str, int] = {}
        seen_tensor: set[tuple[str, int]] = set()
        # edges inside a task (only matter when a partition splits the task over devices)
        self.internal_edges: list[list] = [[] for _ in range(self.num_tasks)]
        self.dropped_dependencies = 0
        for i in range(len(tensors)):
            ts, td = int(task_of_op[edge_src[i]]), int(task_of_op[edge_dst[i]])
            edge = (int(edge_src[i]), int(edge_dst[i]), float(edge_per_example[i]), float(edge_fixed[i]), tensors[i])
            if ts == td:
                self.internal_edges[ts].append(edge)
                continue
            if ts > td:
                self.dropped_dependencies += 1
                continue
            edges_of.setdefault((ts, td), []).append(edge)
            if (tensors[i], td) not in seen_tensor:
                seen_tensor.add((tensors[i], td))
                tid = tensor_id.setdefault(tensors[i], len(tensor_id))
                tensors_of.setdefault((ts, td), []).append((tid, edge[2], edge[3]))
        control_only: set[tuple[int, int]] = set()
        for a, b in graph.control_edges:
            ts, td = int(task_of_op[a]), int(task_of_op[b])
            if ts < td:
                control_only.add((ts, td))
            elif ts > td:
                self.dropped_dependencies += 1
        keys = sorted(set(edges_of) | control_only)
        self.bundle_src: list[int] = [k[0] for k in keys]
        self.bundle_dst: list[int] = [k[1] for k in keys]
        self.bundle_src_array = np.asarray(self.bundle_src, dtype=np.int64)
        self.bundle_dst_array = np.asarray(self.bundle_dst, dtype=np.int64)
        self.bundle_edges: list[list] = [edges_of.get(k, []) for k in keys]
        self.bundle_same_group: list[bool] = [self.task_group_list[a] == self.task_group_list[b] for a, b in keys]
        self._split_shared_tensors(keys, tensors_of)

    def _split_shared_tensors(self, keys: list[tuple[int, int]], tensors_of: dict[tuple[int, int], list]) -> None:
        """Per bundle: ``bundle_own`` = (per-example, fixed) bytes of the tensors no other task reads (always
        moved with it); ``bundle_shared`` = [(tensor id, per-example, fixed bytes)] of the tensors other
        tasks read too, moved once per destination layout."""
        readers: dict[int, int] = {}
        for lst in tensors_of.values():
            for tid, _, _ in lst:
                readers[tid] = readers.get(tid, 0) + 1
        self.bundle_own: list[tuple[float, float]] = []
        self.bundle_own_tensors: list[int] = []      # how many tensors bundle_own's bytes are (per-tensor costs)
        self.bundle_shared: list[list[tuple[int, float, float]]] = []
        for k in keys:
            own_per_example = own_fixed = 0.0
            own_tensors = 0
            shared = []
            for tid, per_example, fixed in tensors_of.get(k, []):
                if readers[tid] > 1:
                    shared.append((tid, per_example, fixed))
                else:
                    own_per_example += per_example
                    own_fixed += fixed
                    own_tensors += 1
            self.bundle_own.append((own_per_example, own_fixed))
            self.bundle_own_tensors.append(own_tensors)
            self.bundle_shared.append(shared)

    def _collective_anchors(self, graph: TrainingGraph) -> None:
        """When each op group's gradient collective can start and which tasks wait for it.

        ``coll_deps[g]``: the tasks producing the group's trainable gradients (else its backward tasks, else
        its first task); ``coll_after[g]``: the last of them (the collective is issued once it has run);
        ``update_tasks[g]``: the group's update tasks after it (they wait for the collective);
        ``forward_tasks[g]``: its forward tasks (they wait for a parameter-server pull)."""
        index = graph.op_index
        grad_tasks: list[set[int]] = [set() for _ in range(self.num_groups)]
        for v in graph.variables:
            if v.kind == "trainable" and v.gradient:
                j = index.get(v.gradient.rsplit(":", 1)[0].lstrip("^"))
                if j is not None:
                    grad_tasks[int(self.group_of_op[v.op])].add(int(self.task_of_op[j]))
        stage = self.task_stage_list
        self.coll_after: list[int] = []
        self.coll_deps: list[list[int]] = []
        self.update_tasks: list[list[int]] = []
        self.forward_tasks: list[list[int]] = []
        for g in range(self.num_groups):
            tasks = self.tasks_of_group[g]
            deps = sorted(grad_tasks[g]) or [t for t in tasks if stage[t] == 1] or \
                [t for t in tasks if stage[t] < 2] or tasks[:1]
            after = max(deps) if deps else -1
            self.coll_deps.append(deps)
            self.coll_after.append(after)
            self.update_tasks.append([t for t in tasks if stage[t] == UPDATE_STAGE and t > after])
            self.forward_tasks.append([t for t in tasks if stage[t] == 0])
