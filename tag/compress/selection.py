"""Which eligible gradients travel as sufficient factors: a 0/1 program solved by HiGHS, confirmed by the simulator.

The problem (for one strategy ``s`` at one global batch):

- Items ``i``: the SFB-eligible weights (``tag.strategy.sfb_eligibility``) of ``s``'s multi-replica ``allreduce``
  op groups. Decision variables ``x_i in {0, 1}``: gradient ``i`` travels as factors. For every op group
  ``g`` whose trainable bytes are all eligible, ``y_g in {0, 1}``: its all-reduce disappears.
- Savings (from the cost model, as the simulator charges them, ``tag.sim.sfb``): ``a_i = b_g W_i -
  (c_g + d_g F_i) - R_i``, where ``W_i`` is the gradient's bytes, ``b_g`` the all-reduce's seconds per
  byte of its group's devices, ``c_g + d_g F_i`` the ring all-gather of a padded factor block of ``F_i``
  bytes, ``R_i`` the extra local MatMul; ``e_g`` = the all-reduce's fixed seconds (saved only when the
  whole all-reduce goes, ``y_g = 1``).
- Constraints: ``y_g <= x_i`` for every item ``i`` of group ``g``; for every device ``d``:
  ``sum_{i on d} M_i x_i <= C_d - P_d`` with ``M_i`` the gathered factor memory, ``C_d`` its capacity and
  ``P_d`` its simulated peak without SFB (at least 0).
- Objective: maximise ``sum_i a_i x_i + sum_g e_g y_g`` (communication on the critical path is
  approximated as additive), i.e. ``scipy.optimize.milp`` minimises ``-(a, e) . (x, y)``.

The solution is then simulated (``Simulator.evaluate``) and kept only if the simulator agrees it is
faster than the strategy without SFB and fits in memory; otherwise the strategy is returned unchanged.
``brute_force`` solves the same problem by enumeration (tests compare it with the MILP).

Example::

    from tag.sim import Simulator
    from tag.compress.selection import select_sfb
    sim = Simulator(tg, topo, grouping)
    chosen = select_sfb(sim, strategy)
    chosen.strategy.sfb, chosen.step_time, chosen.base_step_time, chosen.bytes_saved
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from tag.sim.result import SimResult
from tag.strategy.types import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from tag.sim.simulator import Simulator

__all__ = ["SfbProblem", "SfbSelection", "brute_force", "build_problem", "select_sfb", "solve"]


@dataclass
class SfbProblem:
    """The 0/1 program of the module docstring, as arrays."""

    variables: list[str]              # item i -> its variable
    item_saving: np.ndarray           # a_i, seconds
    item_memory: np.ndarray           # M_i, bytes per device holding it
    item_devices: list[list[int]]     # devices of item i's replicas
    item_bytes_saved: np.ndarray      # bytes on the wire saved by item i (all-reduce minus all-gather)
    group_items: list[list[int]]      # per removable group: its items
    group_saving: np.ndarray          # e_g, seconds
    free_memory: np.ndarray           # C_d - P_d (>= 0), per device

    @property
    def num_items(self) -> int:
        return len(self.variables)

    def value(self, chosen: np.ndarray) -> float:
        """Objective of the item choice CHOSEN (0/1 per item; every group whose items are all chosen counts)."""
        chosen = np.asarray(chosen, dtype=bool)
        groups = sum(float(e) for e, items in zip(self.group_saving, self.group_items, strict=True)
                     if chosen[items].all())
        return float(self.item_saving[chosen].sum()) + groups

    def fits(self, chosen: np.ndarray) -> bool:
        """Whether CHOSEN fits every device's free memory."""
        used = np.zeros_like(self.free_memory)
        for i in np.flatnonzero(np.asarray(chosen, dtype=bool)):
            used[self.item_devices[i]] += self.item_memory[i]
        return bool(np.all(used <= self.free_memory + 1e-6))


@dataclass
class SfbSelection:
    """The outcome of ``select_sfb``."""

    strategy: Strategy                # the input strategy, with ``sfb`` set where it pays (else unchanged)
    chosen: list[str]                 # variables sent as factors (empty: SFB does not pay)
    step_time: float                  # simulated step time of ``strategy``
    base_step_time: float             # simulated step time without SFB
    bytes_saved: float                # bytes on the wire per step saved (simulated), >= 0 when chosen
    result: SimResult                 # the simulator's result for ``strategy``
    problem: SfbProblem | None = None
    milp_choice: list[str] = field(default_factory=list)   # what the MILP chose (before the simulator's check)


def build_problem(sim: "Simulator", strategy: Strategy, batch: int, base: SimResult) -> SfbProblem:
    """The 0/1 program for STRATEGY at BATCH; BASE is its simulated result without SFB (peak memory)."""
    model, layouts, routing = sim.sfb, sim.layouts, sim.routing
    layouts.use_speeds(strategy.device_speeds)
    names, saving, memory, devices_of, wire = [], [], [], [], []
    by_group: dict[int, list[int]] = {}
    for name, f in model.factors.items():
        g = model.group_of[name]
        a = strategy.actions[g]
        devices = layouts.devices_of(a.placement)
        if not model.applies(name, a, devices):
            continue
        charge = model.charge(f, a, devices, layouts.shares_of(a.placement, batch), sim.topology)
        ar = routing.collective("allreduce", devices, a.placement, None)
        ag = routing.collective("allgather", devices, a.placement, None)
        by_group.setdefault(g, []).append(len(names))
        names.append(name)
        saving.append(ar[1] * f.weight_bytes - (ag[0] + ag[1] * charge.block_bytes) - charge.recompute_s)
        memory.append(charge.gathered_bytes + charge.block_bytes)
        devices_of.append(list(devices))
        wire.append(ar[5] * f.weight_bytes - ag[5] * charge.block_bytes)
    group_items, group_saving = [], []
    for g, items in by_group.items():
        if sum(model.factors[names[i]].weight_bytes for i in items) >= model.weight_bytes[g] - 0.5:
            a = strategy.actions[g]
            group_items.append(items)
            group_saving.append(routing.collective("allreduce", layouts.devices_of(a.placement), a.placement,
                                                   None)[0])
    capacity = np.array([d.memory_bytes for d in sim.topology.devices], dtype=np.float64)
    free = np.maximum(capacity - np.asarray(base.peak_memory, dtype=np.float64), 0.0)
    return SfbProblem(names, np.array(saving, dtype=np.float64), np.array(memory, dtype=np.float64), devices_of,
                      np.array(wire, dtype=np.float64), group_items, np.array(group_saving, dtype=np.float64), free)


def solve(problem: SfbProblem) -> np.ndarray:
    """The items the optimum of PROBLEM chooses (0/1 per item), by ``scipy.optimize.milp`` (HiGHS)."""
    n, k = problem.num_items, len(problem.group_items)
    if n == 0:
        return np.zeros(0, dtype=bool)
    c = -np.concatenate([problem.item_saving, problem.group_saving])
    rows, lower, upper = [], [], []
    for j, items in enumerate(problem.group_items):          # y_g - x_i <= 0
        for i in items:
            row = np.zeros(n + k)
            row[n + j], row[i] = 1.0, -1.0
            rows.append(row)
            lower.append(-np.inf)
            upper.append(0.0)
    for d, free in enumerate(problem.free_memory):           # sum_i M_i x_i <= free_d
        row = np.zeros(n + k)
        for i, devs in enumerate(problem.item_devices):
            if d in devs:
                row[i] = problem.item_memory[i]
        if row.any():
            rows.append(row)
            lower.append(-np.inf)
            upper.append(float(free))
    constraints = [LinearConstraint(np.array(rows), lower, upper)] if rows else []
    res = milp(c, constraints=constraints, integrality=np.ones(n + k), bounds=Bounds(0, 1))
    if res.x is None:
        return np.zeros(n, dtype=bool)
    return np.round(res.x[:n]).astype(bool)


def brute_force(problem: SfbProblem) -> np.ndarray:
    """The same optimum by enumerating every item subset (small problems only: 2^n subsets)."""
    best, best_value = np.zeros(problem.num_items, dtype=bool), 0.0
    for bits in itertools.product((False, True), repeat=problem.num_items):
        chosen = np.array(bits, dtype=bool)
        if problem.fits(chosen):
            v = problem.value(chosen)
            if v > best_value + 1e-12:
                best, best_value = chosen, v
    return best


def select_sfb(sim: "Simulator", strategy: Strategy, batch_size: int | None = None) -> SfbSelection:
    """STRATEGY with the SFB gradients the MILP picks, if the simulator confirms the step is faster and fits
    (module docstring); otherwise STRATEGY without SFB. Any ``sfb`` STRATEGY already has is replaced."""
    batch = int(sim.graph.batch_size if batch_size is None else batch_size)
    plain = dataclasses.replace(strategy, sfb=[])
    base = sim.evaluate(plain, batch_size=batch)
    problem = build_problem(sim, plain, batch, base)
    chosen = solve(problem)
    picked = [v for v, c in zip(problem.variables, chosen, strict=True) if c]
    if picked:
        with_sfb = dataclasses.replace(plain, sfb=picked)
        r = sim.evaluate(with_sfb, batch_size=batch)
        if r.feasible and r.step_time < base.step_time:
            return SfbSelection(with_sfb, picked, float(r.step_time), float(base.step_time),
                                float(base.comm_bytes - r.comm_bytes), r, problem, picked)
    return SfbSelection(plain, [], float(base.step_time), float(base.step_time), 0.0, base, problem, picked)
