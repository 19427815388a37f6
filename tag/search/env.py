"""The search environment: candidates per op group, strategies built from choices, cached simulation.

Every search (tree search, dynamic programming, random, uniform) talks to one ``SearchEnv``. A *choice* is a
tuple with one candidate index per op group (indices into ``env.candidates``); ``env.evaluate(choice)``
builds the ``Strategy`` (with the per-group partition maps of partitioned groups), simulates it and caches
the outcome by value: equal choices are one cache entry whatever object built them.

Scores: the *reference* is ``dp_allreduce`` when it fits in memory, else the fastest built-in strategy that
fits (else ``dp_allreduce`` anyway). A feasible strategy's value is its predicted speedup over the reference
(reference step time / step time, > 0); a strategy that runs a device out of memory gets a negative value,
minus how far (as a fraction, capped at 1) its worst device overshoots, so it ranks below every feasible one
and above worse overshoots.

Example::

    from tag.search.env import SearchEnv
    env = SearchEnv(tg, topo, grouping)                     # cost_model=..., batch_size=... optional
    uniform = env.uniform_choice(0)                         # candidate 0 for every group
    outcome = env.evaluate(uniform)                         # Outcome(step_time, feasible, value, ...)
    env.strategy(uniform)                                   # the Strategy the rewriter deploys
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.cost.model import CostModel
from tag.cost.speeds import device_speeds
from tag.errors import StrategyError
from tag.search.candidates import DEFAULT_MAX_ACTIONS, Candidate, candidate_actions
from tag.sim.bound import StepBound
from tag.sim.simulator import SimResult, Simulator
from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
from tag.strategy.partition import GroupPartitioner
from tag.strategy.types import Grouping, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph
    from tag.strategy.pipeline import Pipeline

Choice = tuple[int, ...]   # one candidate index per op group


@dataclass(frozen=True)
class Outcome:
    """What the simulator predicted for one choice."""

    step_time: float          # seconds
    feasible: bool            # every device fits its memory
    value: float              # speedup over the reference if feasible, else -(worst overshoot fraction, <= 1)
    overshoot_bytes: float    # largest (peak - capacity) over devices, 0 when feasible

    @property
    def rank(self) -> tuple[float, float]:
        """Sort key of outcomes, best last: higher value, then (equal values) the shorter step."""
        return self.value, -self.step_time


class SearchEnv:
    """Candidates, strategy building and cached evaluation for one graph on one topology (module docstring)."""

    def __init__(self, graph: "TrainingGraph", topology: "Topology", grouping: Grouping, *,
                 cost_model: CostModel | None = None, batch_size: int | None = None,
                 max_actions: int = DEFAULT_MAX_ACTIONS, simulator: Simulator | None = None):
        self.graph, self.topology, self.grouping = graph, topology, grouping
        self.cost_model = cost_model if cost_model is not None else CostModel(graph, topology)
        self.batch_size = int(graph.batch_size if batch_size is None else batch_size)
        self.simulator = simulator if simulator is not None else Simulator(graph, topology, grouping,
                                                                            self.cost_model)
        self.num_groups = grouping.num_groups
        self.speeds = device_speeds(self.cost_model, self.batch_size)   # examples/s per device
        self.device_speeds: tuple[float, ...] = tuple(float(x) for x in self.speeds)   # what batch shares follow
        self.candidates: list[Candidate] = candidate_actions(topology, self.speeds, max_actions)
        self.group_ops: list[np.ndarray] = [grouping.members(g) for g in range(self.num_groups)]
        self._capacity = np.array([d.memory_bytes for d in topology.devices], dtype=np.float64)
        self._weight_ops = {v.op for v in graph.variables if v.kind == "trainable"}   # ops that hold trainable weights
        self.allowed: list[list[int]] = [self._allowed_for(g) for g in range(self.num_groups)]
        self.allowed_sets: list[frozenset[int]] = [frozenset(a) for a in self.allowed]
        self.partitioner = GroupPartitioner(graph, topology, self.cost_model, grouping.group_of_op, self.batch_size)
        self._partition_maps: dict[tuple[int, int], dict[int, int]] = {}   # (group, candidate) -> op -> device
        self._outcomes: dict[Choice, Outcome] = {}                           # choice -> its outcome
        self._pipeline_outcomes: dict = {}                                   # Pipeline -> its outcome (or None)
        self.evaluations = 0          # simulator runs
        self.cache_hits = 0
        self.screened = 0             # choices rejected by the lower bound and never simulated
        self._screened: dict[Choice, float] = {}                            # choice -> its lower bound (s)
        self._bound: StepBound | None = None
        self.simulate_seconds = 0.0
        self.best_choice: Choice | None = None
        self.best_outcome: Outcome | None = None
        self.builtin_results: dict[str, SimResult] = {}
        self.builtin_strategies: dict[str, Strategy] = {}
        for name in BUILTIN_STRATEGIES:
            s = builtin_strategy(name, graph, topology, grouping, self.cost_model, self.device_speeds)
            self.builtin_strategies[name] = s
            self.builtin_results[name] = self.simulator.evaluate(s, batch_size=self.batch_size)
        self.reference_name = self._reference()
        self.reference_time = float(self.builtin_results[self.reference_name].step_time)

    # ------------------------------------------------------------------ set-up
    def _allowed_for(self, group: int) -> list[int]:
        """Candidate indices that make sense for GROUP: ps only for groups with trainable variables
        (elsewhere it is allreduce under another name), a multi-device partition only for groups of
        more than one op."""
        ops = self.group_ops[group]
        has_weights = any(int(i) in self._weight_ops for i in ops)
        allowed = []
        for k, c in enumerate(self.candidates):
            if c.action.mode == "ps" and not has_weights:
                continue
            if c.action.mode == "partition" and len(c.partition_devices) > 1 and len(ops) < 2:
                continue
            allowed.append(k)
        return allowed

    def _reference(self) -> str:
        if self.builtin_results["dp_allreduce"].feasible:
            return "dp_allreduce"
        feasible = [n for n, r in self.builtin_results.items() if r.feasible]
        if not feasible:
            return "dp_allreduce"
        return min(feasible, key=lambda n: self.builtin_results[n].step_time)

    # ------------------------------------------------------------------ strategies
    def uniform_choice(self, candidate: int) -> Choice:
        """Candidate CANDIDATE for every op group (where it is not allowed, the group's first allowed one)."""
        return tuple(candidate if candidate in self.allowed_sets[g] else self.allowed[g][0]
                     for g in range(self.num_groups))

    def partition_map(self, group: int, candidate: int) -> dict[int, int]:
        """Op -> device of GROUP's ops under a partition candidate (cached)."""
        key = (group, candidate)
        m = self._partition_maps.get(key)
        if m is None:
            c = self.candidates[candidate]
            m = self.partitioner.split(group, c.partition_devices)
            self._partition_maps[key] = m
        return m

    def strategy(self, choice: Sequence[int], name: str = "") -> Strategy:
        """The Strategy of CHOICE (one candidate index per op group)."""
        actions, partition = [], {}
        for g, k in enumerate(choice):
            c = self.candidates[k]
            actions.append(c.action)
            if c.action.mode == "partition":
                partition.update(self.partition_map(g, int(k)))
        return Strategy(self.grouping, actions, partition=partition, name=name, device_speeds=self.device_speeds)

    # ------------------------------------------------------------------ evaluation
    def outcome_of(self, result: SimResult) -> Outcome:
        """Score a simulator result against the reference (module docstring)."""
        step = float(result.step_time)
        if result.feasible:
            return Outcome(step, True, self.reference_time / step if step > 0 else float("inf"), 0.0)
        capacity = self._capacity
        over = np.asarray(result.peak_memory, dtype=np.float64) - capacity
        worst = int(np.argmax(over / capacity))
        return Outcome(step, False, -min(1.0, float(over[worst] / capacity[worst])), float(over.max()))

    def evaluate(self, choice: Sequence[int]) -> Outcome:
        """Simulate CHOICE (cached by value); keeps the best choice seen."""
        key = tuple(int(k) for k in choice)
        out = self._outcomes.get(key)
        if out is not None:
            self.cache_hits += 1
            return out
        if self._screened and self._screened.pop(key, None) is not None:
            self.screened -= 1       # simulated after all: it counts as the one simulator run it is
        t0 = time.perf_counter()
        result = self.simulator.evaluate(self.strategy(key), batch_size=self.batch_size)
        self.simulate_seconds += time.perf_counter() - t0
        self.evaluations += 1
        out = self.outcome_of(result)
        if len(self._outcomes) > 200_000:
            self._outcomes.clear()
        self._outcomes[key] = out
        if self.best_outcome is None or out.rank > self.best_outcome.rank:
            self.best_choice, self.best_outcome = key, out
        return out

    def _bound_terms(self, choice: Sequence[int]) -> list:
        """The per-group terms of CHOICE for the step-time bound (``tag.sim.bound``), cached per candidate."""
        if self._bound is None:
            self._bound = StepBound(self.simulator)
        bound = self._bound
        bound.use(self.device_speeds, self.batch_size)
        candidates, members = self.candidates, self.simulator.tasks.members
        terms = []
        for g, k in enumerate(choice):
            key = ("choice", g, k)
            t = bound.cached_terms(key)
            if t is None:
                c = candidates[k]
                devices = None
                if c.action.mode == "partition":
                    m = self.partition_map(g, int(k))
                    devices = np.array([m[int(i)] for i in members[g]], dtype=np.int64)
                t = bound.terms(g, c.action, devices, self.batch_size, key=key)
            terms.append(t)
        return terms

    def step_lower_bound(self, choice: Sequence[int], threshold: float | None = None) -> float:
        """A lower bound on CHOICE's simulated step time (``tag.sim.bound``; with THRESHOLD it may stop
        early once the bound reaches it)."""
        terms = self._bound_terms(choice)
        return self._bound.combine(terms, threshold)

    def evaluate_unless_slower(self, choice: Sequence[int], incumbent: Outcome) -> Outcome | None:
        """``evaluate(choice)``, or None without simulating when CHOICE cannot rank above INCUMBENT: its
        step-time lower bound is not below a feasible INCUMBENT's step time, or its static memory alone
        overflows a device (``tag.sim.bound``: a bound never exceeds the simulated step, so no better
        choice is ever rejected). Rejected choices are remembered like cached ones (``screened`` counts
        them once)."""
        key = tuple(int(k) for k in choice)
        if key in self._outcomes or not incumbent.feasible:
            return self.evaluate(key)
        bound = self._screened.get(key)
        if bound is not None:
            if bound >= incumbent.step_time:
                self.cache_hits += 1
                return None
            return self.evaluate(key)
        terms = self._bound_terms(key)
        bound = self._bound.combine(terms, incumbent.step_time)
        if bound < incumbent.step_time and not self._bound.static_fits(terms):
            bound = float("inf")          # out of memory: ranks below every feasible incumbent
        if bound >= incumbent.step_time:
            if len(self._screened) > 200_000:
                self._screened.clear()
            self._screened[key] = bound
            self.screened += 1
            return None
        return self.evaluate(key)

    def pipeline_strategy(self, pipeline: "Pipeline", name: str = "pipeline") -> Strategy:
        """The Strategy that runs PIPELINE (its stages' actions on every op group of the stage)."""
        return Strategy.pipelined(self.grouping, pipeline, name=name, device_speeds=self.device_speeds)

    def evaluate_pipeline(self, pipeline: "Pipeline") -> Outcome | None:
        """Simulate PIPELINE (cached by value, as choices are); None when it does not fit the graph (a
        StrategyError: a cut the dependencies do not allow)."""
        if pipeline in self._pipeline_outcomes:
            self.cache_hits += 1
            return self._pipeline_outcomes[pipeline]
        t0 = time.perf_counter()
        try:
            result = self.simulator.evaluate(self.pipeline_strategy(pipeline), batch_size=self.batch_size)
        except StrategyError:
            out = None
        else:
            out = self.outcome_of(result)
            self.evaluations += 1
        self.simulate_seconds += time.perf_counter() - t0
        if len(self._pipeline_outcomes) > 200_000:
            self._pipeline_outcomes.clear()
        self._pipeline_outcomes[pipeline] = out
        return out

    def result(self, choice: Sequence[int]) -> SimResult:
        """The full simulator result of CHOICE (not cached; for reports)."""
        return self.simulator.evaluate(self.strategy(choice), batch_size=self.batch_size)

