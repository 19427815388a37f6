"""The search portfolio behind ``tag.optimize``: built-ins, the best uniform action, then the tree search.

Steps, all scored by the same simulator through one ``SearchEnv``:

1. the built-in strategies (``dp_allreduce``, ``ps``, ``single``, ``partition``), simulated once;
2. ``best_uniform``: every candidate action applied to every op group, the best kept;
3. the tree search (``tag.search.mcts``) in the chosen decision order, for the remaining budget.

The answer is the best strategy any step found; it is never predicted slower than the best feasible
built-in (a built-in wins when nothing beats it, and ``SearchResult.method`` says so).

Example::

    from tag.search import SearchEnv, search
    found = search(SearchEnv(tg, topo, grouping), playouts=500, seed=0)
    found.method, found.step_time, found.baselines["best_uniform"]
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tag.search.env import Outcome, SearchEnv
from tag.sim.simulator import SimResult
from tag.strategy.types import Strategy

DEFAULT_PLAYOUTS = 400


@dataclass
class SearchProgress:
    """What a progress callback sees: playouts done (of the total when known), rate, best so far."""

    playouts: int
    total: int | None
    seconds: float
    best_speedup: float


@dataclass
class SearchResult:
    """The best strategy found and how it compares."""

    strategy: Strategy
    outcome: Outcome                      # step time, feasibility, value of the winner
    result: SimResult                     # the winner's full simulator result
    method: str                           # which step found it: a built-in name, best_uniform, mcts, ...
    baselines: dict[str, float]           # name -> predicted step time (s): built-ins and other searches
    baselines_feasible: dict[str, bool]
    reference: str                        # the strategy speedups are measured against
    search_seconds: float
    evaluations: int
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return self.outcome.step_time


def best_uniform(env: SearchEnv) -> tuple[tuple[int, ...], Outcome]:
    """The best single candidate applied to every op group: (choice, outcome)."""
    best = None
    for k in range(len(env.candidates)):
        choice = env.uniform_choice(k)
        out = env.evaluate(choice)
        if best is None or (out.value, -out.step_time) > (best[1].value, -best[1].step_time):
            best = (choice, out)
    return best


def search(env: SearchEnv, *, budget_s: float | None = None, playouts: int | None = None, order: str = "auto",
           seed: int = 0, prior=None, progress: Callable[[SearchProgress], None] | None = None) -> SearchResult:
    """Run the portfolio (module docstring) on ENV and return the best strategy found.

    ``playouts`` bounds the tree search by simulated playouts, ``budget_s`` by wall-clock seconds (both:
    whichever ends first; neither: ``DEFAULT_PLAYOUTS``). ``order`` is a decision order name of
    ``tag.search.orders`` or ``"auto"``; ``prior`` a callable giving the tree search a prior over a group's
    candidates (uniform when None); ``seed`` makes the search deterministic.
    """
    t0 = time.perf_counter()
    baselines = {n: float(r.step_time) for n, r in env.builtin_results.items()}
    feasible = {n: bool(r.feasible) for n, r in env.builtin_results.items()}
    found: dict[str, tuple[tuple[int, ...] | None, Outcome]] = {}
    for name, r in env.builtin_results.items():
        found[name] = (None, env.outcome_of(r))
    uniform_choice, uniform_outcome = best_uniform(env)
    found["best_uniform"] = (uniform_choice, uniform_outcome)
    baselines["best_uniform"] = uniform_outcome.step_time
    feasible["best_uniform"] = uniform_outcome.feasible

    if playouts is None and budget_s is None:
        playouts = DEFAULT_PLAYOUTS
    remaining = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
    from tag.search.mcts import mcts
    report = None
    if progress is not None:
        def report(done: int, total: int | None, seconds: float, best: Outcome) -> None:
            progress(SearchProgress(done, total, seconds, best.value if best.feasible else 0.0))
    tree = mcts(env, order=order, playouts=playouts, budget_s=remaining, seed=seed, prior=prior,
                progress=report, start=uniform_choice)
    found["mcts"] = (tree.choice, tree.outcome)
    baselines["mcts"] = tree.outcome.step_time
    feasible["mcts"] = tree.outcome.feasible

    method = max(found, key=lambda n: (found[n][1].value, -found[n][1].step_time))
    choice, outcome = found[method]
    if choice is None:
        strategy = env.builtin_strategies[method]
        result = env.builtin_results[method]
    else:
        strategy = env.strategy(choice, name=method)
        result = env.result(choice)
    notes = []
    if choice is None:
        notes.append(f"no searched strategy beat the built-in {method!r}; the plan is that built-in")
    return SearchResult(strategy, outcome, result, method, baselines, feasible, env.reference_name,
                        time.perf_counter() - t0, env.evaluations, notes)
