"""Local refinement: improve a complete choice by moves that a person would try, until none pays.

Neighbourhood of a choice (one candidate index per op group), with the op groups in step order
(``tag.strategy.baselines.group_order``):

- *group move*: one op group takes another allowed candidate;
- *prefix move*: every group up to step position p takes candidate k;
- *suffix move*: every group from step position p on takes candidate k.

Prefix and suffix moves reach the pipeline-like mixes that single-group changes cannot (for example the
convolutions of a CNN replicated over every device while its fully connected layers stay on the best
connected host: moving one layer at a time only adds re-layout traffic and looks worse at each step).
Each sweep tries every move once (first improvement is taken immediately) in this order: suffix and
prefix moves by position, then group moves in the decision order. It stops when a sweep improves
nothing, at ``max_evaluations`` simulator runs, or at ``budget_s``. Deterministic.

A move is first screened by the step-time lower bound (``tag.sim.bound``): one that cannot beat the
current choice is rejected without simulating it. A rejected move counts towards ``max_evaluations`` as
the simulator run it replaces, so screening changes how long refinement takes, never what it returns
under an evaluation cap (under ``budget_s`` it gets further in the same time).

Example::

    from tag.search.local import refine
    better = refine(env, start_choice, budget_s=10)
    better.choice, better.outcome.step_time, better.sweeps
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tag.search.env import Choice, Outcome, SearchEnv
from tag.strategy.baselines import group_order


@dataclass
class RefineResult:
    choice: Choice
    outcome: Outcome
    sweeps: int
    evaluations: int          # simulator runs made by the refinement (cache hits excluded)
    seconds: float
    moves: int                # accepted improving moves


def _ranks_better(a: Outcome, b: Outcome) -> bool:
    return a.rank > b.rank and a.value > b.value * (1 + 1e-9) + 1e-12


def refine(env: SearchEnv, start: Sequence[int], *, order: Sequence[int] | None = None,
           budget_s: float | None = None, max_evaluations: int | None = None,
           progress: Callable[[Outcome], None] | None = None, screen: bool = True) -> RefineResult:
    """Hill-climb from START with group, prefix and suffix moves (module docstring). ``screen``: reject
    moves whose step-time lower bound shows they cannot improve without simulating them
    (``SearchEnv.evaluate_unless_slower``; the same moves are accepted either way, and
    ``max_evaluations`` counts rejected moves as the simulator runs they replace)."""
    t0 = time.perf_counter()
    evals0 = env.evaluations
    tried0 = env.evaluations + env.screened
    step_order = [int(g) for g in group_order(env.graph, env.grouping)]
    order = [int(g) for g in (order if order is not None else step_order)]
    current = tuple(int(k) for k in start)
    best = env.evaluate(current)
    n = len(step_order)
    sweeps = moves = 0

    def out_of_budget() -> bool:
        if budget_s is not None and time.perf_counter() - t0 >= budget_s:
            return True
        return max_evaluations is not None and env.evaluations + env.screened - tried0 >= max_evaluations

    def try_choice(trial: tuple[int, ...]) -> bool:
        nonlocal current, best, moves
        if trial == current:
            return False
        out = env.evaluate_unless_slower(trial, best) if screen else env.evaluate(trial)
        if out is not None and _ranks_better(out, best):
            current, best = trial, out
            moves += 1
            if progress is not None:
                progress(best)
            return True
        return False

    def with_segment(positions: range, k: int) -> tuple[int, ...]:
        trial = list(current)
        for p in positions:
            g = step_order[p]
            if k in env.allowed_sets[g]:
                trial[g] = k
        return tuple(trial)

    improved = True
    while improved and not out_of_budget():
        improved = False
        sweeps += 1
        for p in range(1, n):
            for k in range(len(env.candidates)):
                if out_of_budget():
                    break
                improved |= try_choice(with_segment(range(p, n), k))
                improved |= try_choice(with_segment(range(0, p), k))
        for g in order:
            for k in env.allowed[g]:
                if out_of_budget():
                    break
                if k != current[g]:
                    trial = list(current)
                    trial[g] = k
                    improved |= try_choice(tuple(trial))
    return RefineResult(current, best, sweeps, env.evaluations - evals0, time.perf_counter() - t0, moves)
