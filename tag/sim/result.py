"""What one simulated step reports: ``SimResult``, and the per-device / per-group statistics of a schedule.

The statistics the GNN uses as features (utilisation, compute time, group makespan, idle time after a
group's tasks) are computed from the schedule's [lane, task] matrices on first access, so a search
that reads only the step time and feasibility does not pay for them.

Example::

    import tag
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    from tag.sim import Simulator
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    grouping = group_ops(tg, target_groups=8)
    r = Simulator(tg, topo, grouping).evaluate(builtin_strategy("dp_allreduce", tg, topo, grouping))
    r.step_time, r.feasible, r.group_makespan       # a SimResult
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    # pipelined strategies: predicted idle fraction of the stages (tag.sim.pipeline.bubble_fraction); else None
    bubble_fraction: float | None = None
    _features: object = field(default=None, repr=False, compare=False)   # () -> dict of the arrays below
    _compute: object = field(default=None, repr=False, compare=False)    # () -> compute_time alone (cheaper)

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
        if callable(self._compute) and callable(self._features):     # without the other features' work
            self._compute = self._compute()
        if isinstance(self._compute, np.ndarray):
            return self._compute
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


def device_compute_time(lane_of_device: np.ndarray, start: np.ndarray, finish: np.ndarray,
                        ran: np.ndarray | None = None) -> np.ndarray:
    """Busy compute seconds per device: the task times of its lane (RAN, START, FINISH: [lane, task]; a task
    ran on a lane where its finish is >= 0 when RAN is not given)."""
    return ((finish - start) * (finish >= 0 if ran is None else ran)).sum(axis=1)[lane_of_device]


def schedule_features(num_groups: int, task_by_group: np.ndarray, task_by_group_starts: np.ndarray,
                      lane_of_device: np.ndarray, step: float, collective_end: list[float], ran: np.ndarray,
                      start: np.ndarray, finish: np.ndarray, num_devices: int) -> dict[str, np.ndarray]:
    """Utilisation, compute time, group makespan and idle time from a simulated schedule.

    RAN, START and FINISH are [lane, task] matrices; TASK_BY_GROUP orders the tasks by op group and
    TASK_BY_GROUP_STARTS says where each group starts in that order (``TaskGraph``)."""
    num_lanes, num_tasks = finish.shape
    compute = device_compute_time(lane_of_device, start, finish, ran)
    util = compute / step if step > 0 else np.zeros(num_devices)
    if num_tasks:
        start_or_inf = np.where(ran, start, np.inf)
        o, starts = task_by_group, task_by_group_starts
        group_start = np.minimum.reduceat(start_or_inf.min(axis=0)[o], starts)
        group_end = np.maximum(np.maximum.reduceat(finish.max(axis=0)[o], starts), collective_end)
        makespan = np.where(np.isfinite(group_start),
                            group_end - np.where(np.isfinite(group_start), group_start, 0.0), 0.0)
        # next start on the same lane after each task (step end after the lane's last task)
        next_start = np.empty((num_lanes, num_tasks))
        next_start[:, :-1] = np.minimum.accumulate(start_or_inf[:, :0:-1], axis=1)[:, ::-1]
        next_start[:, -1] = np.inf
        next_start[np.isinf(next_start)] = step
        gaps = np.maximum(next_start - finish, 0.0) * ran
        count = np.add.reduceat(ran.sum(axis=0)[o], starts)
        idle = np.add.reduceat(gaps.sum(axis=0)[o], starts) / np.maximum(count, 1)
    else:
        makespan = np.zeros(num_groups)
        idle = np.zeros(num_groups)
    return {"utilisation": util, "compute_time": compute, "group_makespan": makespan, "group_idle_after": idle}
