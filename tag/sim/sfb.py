"""How the simulator charges sufficient-factor broadcasting (``Strategy.sfb``), as the rewriter deploys it.

For an SFB variable of an ``allreduce`` op group with n > 1 replicas (and an SFB-eligible gradient,
``tag.strategy.sfb_eligibility``), the rewriter does not all-reduce its gradient. Each replica pads its two
factors to the largest share's rows, puts them side by side (``[rows, m + n]``), and one
``CollectiveGatherV2`` (ring) gives every replica all n blocks; each then computes the gradient as one
MatMul over the gathered rows (padding rows are zeros and add nothing). The simulator therefore:

- removes the variable's bytes from its group's all-reduce (no all-reduce at all when nothing is left);
- adds one all-gather per SFB variable, issued with the group's all-reduce (once the tasks producing
  the group's gradients have run everywhere) on the same links: ring all-gather of a block of
  ``max_share * factor bytes per example`` per replica (``CostModel.allgather_coeffs``, ring);
- delays the group's update tasks by the extra local MatMul: its time on ``n * max_share`` rows minus its
  time on the replica's own share (which the backward pass already charged);
- holds the gathered factors (``n * max_share`` rows) and the local padded block (``max_share`` rows) in
  memory on every replica, as static memory (conservatively: all SFB variables of a device at once).

Variables listed in ``Strategy.sfb`` that are not eligible, or whose group is not a multi-replica
allreduce group, are ignored here and by the rewriter alike (their gradients are all-reduced).

Example::

    from tag.sim import Simulator
    sim = Simulator(tg, topo, grouping)
    plan = sim.sfb.plan(strategy, strategy.actions, sim.layouts, tg.batch_size)
    plan.weight_bytes, plan.gathers, plan.memory            # what the schedule and memory model use
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tag.cost.model import CostModel
from tag.ir.types import TrainingGraph
from tag.sim.layouts import LayoutCache
from tag.sim.task_graph import TaskGraph
from tag.strategy.sfb_eligibility import SufficientFactors, eligible_gradients
from tag.strategy.types import Action, Strategy


@dataclass
class GatherCharge:
    """One SFB all-gather of one evaluation."""

    variable: str
    block_bytes: float        # bytes each replica contributes (padded to the largest share)
    recompute_s: float        # extra local MatMul after the gather (the update waits for it)
    gathered_bytes: float     # bytes each replica holds after the gather


@dataclass
class SfbPlan:
    """What SFB changes in one evaluation: per-group all-reduce bytes, gathers and memory."""

    weight_bytes: list[float]                                   # per op group, what is still all-reduced
    gathers: dict[int, list[GatherCharge]] = field(default_factory=dict)   # op group -> its gathers
    memory: np.ndarray | None = None                            # extra bytes per device (None: nothing)
    variables: list[str] = field(default_factory=list)          # the SFB variables that apply


class SfbModel:
    """The SFB-eligible variables of one graph and grouping, and per-evaluation plans (module docstring)."""

    def __init__(self, graph: TrainingGraph, tasks: TaskGraph, cost: CostModel, weight_bytes: list[float]):
        self.cost = cost
        self.weight_bytes = weight_bytes
        self.factors: dict[str, SufficientFactors] = {f.variable: f for f in eligible_gradients(graph)}
        var_op = {v.name: v.op for v in graph.variables}
        self.group_of: dict[str, int] = {name: int(tasks.group_of_op[var_op[name]]) for name in self.factors}
        self._empty = SfbPlan(weight_bytes)

    def applies(self, name: str, action: Action, devices: list[int]) -> bool:
        """Whether SFB variable NAME is modelled (and deployed) under ACTION over DEVICES."""
        return name in self.factors and action.mode == "allreduce" and len(devices) > 1

    def plan(self, strategy: Strategy, actions: list[Action], layouts: LayoutCache, batch: int) -> SfbPlan:
        """The SFB plan of STRATEGY at global BATCH (LAYOUTS: devices and shares of placements)."""
        if not strategy.sfb:
            return self._empty
        weights = list(self.weight_bytes)
        gathers: dict[int, list[GatherCharge]] = {}
        memory = np.zeros(len(layouts.topology.devices))
        applied = []
        for name in dict.fromkeys(strategy.sfb):
            f = self.factors.get(name)
            if f is None:
                continue
            g = self.group_of[name]
            a = actions[g]
            devices = layouts.devices_of(a.placement)
            if not self.applies(name, a, devices):
                continue
            charge = self.charge(f, a, devices, layouts.shares_of(a.placement, batch), layouts.topology)
            weights[g] = max(weights[g] - f.weight_bytes, 0.0)
            gathers.setdefault(g, []).append(charge)
            memory[devices] += charge.gathered_bytes + charge.block_bytes
            applied.append(name)
        if not applied:
            return self._empty
        return SfbPlan(weights, gathers, memory, applied)

    def charge(self, f: SufficientFactors, action: Action, devices: list[int], shares: list[int],
               topology) -> GatherCharge:
        """The gather and recompute of F's gradient over DEVICES (batch SHARES each)."""
        n, max_share = len(devices), max(shares)
        block = max_share * f.factor_bytes_per_example
        recompute = 0.0
        for dg in action.placement:
            local = max(s for d, s in zip(devices, shares, strict=True) if topology.devices[d].group == dg)
            full = float(self.cost.op_times(dg, n * max_share)[f.gradient_op])
            own = float(self.cost.op_times(dg, local)[f.gradient_op])
            recompute = max(recompute, full - own)
        return GatherCharge(f.variable, block, recompute, n * block)
