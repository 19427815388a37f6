"""Calibrated device speeds: examples per second of each device for one graph, from the cost model.

Replicated op groups split their batch in proportion to these (``Strategy.device_speeds``), in the
simulator and in the rewriter alike, so a fast device gets the share its predicted time for *this* graph
earns rather than the share its spec-sheet peak suggests (a GPU's peak overstates it on memory-bound
models; launch overheads weigh more at small per-device batches).

Example::

    from tag.cost.speeds import device_speeds
    speeds = device_speeds(cost_model, batch=64)     # numpy array, one entry per device of the topology
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tag.cost.model import CostModel


def device_speeds(cost_model: "CostModel", batch: int) -> np.ndarray:
    """Examples per second of each device: its share of BATCH (global batch over the number of devices,
    at least one example) over the predicted compute time of one step at that share."""
    topology = cost_model.topology
    per_device_batch = max(1.0, float(batch) / max(1, topology.num_devices))
    per_group = {}
    for g in topology.groups:
        t = cost_model.compute_time(g.index, per_device_batch)
        per_group[g.index] = per_device_batch / t if t > 0 else float(g.peak_flops)
    return np.array([per_group[d.group] for d in topology.devices], dtype=np.float64)
