"""Chrome trace export of one simulated step (chrome://tracing, ui.perfetto.dev).

``Recording`` is what the schedule writes down while it runs with recording on (every transfer and
collective with its resources and times; the lanes and the [task, lane] start / finish / batch
matrices); ``chrome_trace`` turns it into trace events: one row per device, one per host interconnect
and network interface, ``ph: "X"`` events in microseconds. ``otherData["collectives"]`` lists every
all-reduce and all-gather (kind, op group, devices, payload bytes per device): exactly the TF collectives
the rewriter emits for the same strategy (``tests/test_sfb.py`` checks this).

Example::

    import json, tag
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    from tag.sim import Simulator
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/a100-8x-nvlink.pbtxt")
    grouping = group_ops(tg, target_groups=8)
    sim = Simulator(tg, topo, grouping)
    trace = sim.trace(builtin_strategy("dp_allreduce", tg, topo, grouping))   # uses chrome_trace
    json.dump(trace, open("trace.json", "w"))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tag.cluster.topology import Topology

STAGE_NAMES = ("forward", "backward", "update")


@dataclass
class Recording:
    """What one recorded simulation did."""

    # (resource ids, start s, end s, bytes, label) per transfer / per collective, in issue order
    transfers: list[tuple] = field(default_factory=list)
    collectives: list[tuple] = field(default_factory=list)
    # every all-reduce and all-gather as the rewriter emits it: {"kind": "allreduce" | "allgather", "group",
    # "devices", "bytes" (payload per device), "start_s", "end_s"}, in issue order
    collective_ops: list[dict] = field(default_factory=list)
    lanes: Any = None                 # the evaluation's tag.sim.layouts.Lanes
    # (start, finish, batch) matrices indexed [task, lane]; finish -1: the lane did not run the task
    matrices: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def chrome_trace(recording: Recording, topology: Topology, group_names: list[str], task_group: list[int],
                 task_stage: list[int], resource_names: list[str], other_data: dict,
                 task_labels: list[str] | None = None, task_args: dict[str, list] | None = None) -> dict:
    """Trace events of RECORDING: compute events per device (named after the op group and stage of each task
    in TASK_GROUP / TASK_STAGE, or TASK_LABELS when given: a pipeline's ``F3 dense_1``), communication events
    per resource, OTHER_DATA as ``otherData``. TASK_ARGS: more per-task values for each event's args."""
    lanes = recording.lanes
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "devices"}},
              {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "links"}}]
    for d in topology.devices:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d.index,
                       "args": {"name": f"{d.name} ({d.device_type})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d.index,
                       "args": {"sort_index": d.index}})
    for r, name in enumerate(resource_names):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": r, "args": {"name": name}})
    start, finish, batch = recording.matrices
    for t, lane in zip(*np.nonzero(finish >= 0), strict=True):
        t, lane = int(t), int(lane)
        g, st = task_group[t], task_stage[t]
        name = task_labels[t] if task_labels is not None else f"{group_names[g]} [{STAGE_NAMES[st]}]"
        args = {"group": g, "stage": STAGE_NAMES[st], "batch": float(batch[t, lane])}
        if task_args:
            args.update({k: v[t] for k, v in task_args.items()})
        for d in lanes.lanes[lane]:
            events.append({"name": name, "cat": "compute", "ph": "X",
                           "ts": float(start[t, lane]) * 1e6,
                           "dur": max(float(finish[t, lane] - start[t, lane]), 0.0) * 1e6,
                           "pid": 0, "tid": int(d), "args": dict(args)})
    for (res_ids, st, fn, nbytes, label) in recording.transfers + recording.collectives:
        for r in res_ids:
            events.append({"name": label, "cat": "comm", "ph": "X", "ts": st * 1e6,
                           "dur": max(fn - st, 0.0) * 1e6, "pid": 1, "tid": int(r),
                           "args": {"bytes": float(nbytes)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**other_data, "collectives": [dict(c) for c in recording.collective_ops]}}
