"""The search portfolio behind ``tag.optimize``: built-ins, best uniform action, PaSE DP, MCTS, refinement.

Steps, all scored by the same simulator through one ``SearchEnv``:

1. the built-in strategies (``dp_allreduce``, ``ps``, ``single``, ``partition``), simulated once;
2. ``best_uniform``: every candidate action applied to every op group, the best kept;
3. ``pase_dp``: PaSE-style dynamic programming on an additive cost model (``tag.search.pase``);
4. ``pipeline``: stage boundaries, device sets, micro-batches and schedule by dynamic programming over the
   op-group chain (``tag.search.pipeline_dp``); the best simulated pipeline competes with everything else
   (it wins only when predicted ``PIPELINE_MIN_GAIN``, 1%, faster than the best per-group answer).
   Its stages' placements as per-group actions (``pipeline_stages``: the same stages without micro-batches)
   are also evaluated, so they seed the tree search and refinement when they are the best choice so far.
   A pipeline whose stages all sit on the same devices competes through those per-group actions alone, here
   and in step 5, unless they do not fit in memory and it has several micro-batches (``pipeline_admitted``);
5. ``mcts``: the tree search (``tag.search.mcts``) in the chosen decision order, seeded with the best so far;
   the best pipelines of step 4 are root candidates of the tree beside the per-group ones, with one level
   per stage below them choosing the stage's action (``tag.search.pipeline_tree``), so per-group actions and
   pipelines compete for the same playouts; a better pipeline the tree finds competes as ``mcts_pipeline``;
6. ``refine``: local moves (group, prefix and suffix moves; ``tag.search.local``) from the best so far.

The answer is the best strategy any step found; it is never predicted slower than the best feasible
built-in (a built-in wins when nothing beats it, and ``SearchResult.method`` and ``notes`` say so), except
that a built-in on fewer devices within ``min_gain`` of it is preferred (below). A
searched strategy must also be predicted at least ``min_gain`` (default ``DEFAULT_MIN_GAIN``, 5%) faster
than the best feasible built-in: a smaller predicted gain is within the simulator's error on real runs
(``scripts/bench_fidelity.py``), and a mixed strategy has more to mispredict (its transfers), so the
simpler built-in is deployed. Among the built-ins the same margin favours fewer devices
(``simplest_builtin``): one using more devices must be predicted ``min_gain`` faster than one using fewer.
Before those checks, a mixed strategy (op groups with different actions) or a pipeline must be predicted
``mixed_min_gain`` (default ``MIXED_MIN_GAIN``, 10%) faster than the best uniform action, or that action is the
answer (``is_mixed``): the simulator errs more on mixed plans than on uniform ones.
``SearchResult.baselines`` holds each step's own best (the ``refine`` entry is the final answer when
refinement found the winner), and ``SearchResult.candidates`` each step's best strategy and every
built-in (name -> Strategy), plus the pipeline search's best for each other micro-batch count and its
answer under each other schedule (``pipeline_m{M}``, ``pipeline_{schedule}``; in ``baselines`` too; never
the plan unmeasured): the distinct ones among them are what
the measured tuning step (``tag.tune``) runs on the cluster.

Budgets: with ``budget_s`` the tree search gets half of what is left after steps 1-3 and refinement
the rest; with ``playouts`` (and no seconds) the tree search runs that many playouts and refinement at
most ``REFINE_EVALUATIONS_PER_PLAYOUT`` simulator runs per playout (at least ``MIN_REFINE_EVALUATIONS``).

Example::

    from tag.search import SearchEnv, search
    found = search(SearchEnv(tg, topo, grouping), playouts=500, seed=0)
    found.method, found.step_time, found.baselines["best_uniform"]
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tag.search.env import Choice, Outcome, SearchEnv
from tag.search.local import refine
from tag.search.mcts import mcts
from tag.search.pase import pase_dp
from tag.search.pipeline_dp import PipelineSearchResult, pipeline_alternatives, pipeline_dp
from tag.search.pipeline_tree import PipelineRoots
from tag.sim.simulator import SimResult
from tag.strategy.types import Strategy

DEFAULT_PLAYOUTS = 400
DEFAULT_MIN_GAIN = 0.05          # a searched strategy must be predicted this much faster than the best built-in
MIXED_MIN_GAIN = 0.10            # a mixed or pipelined strategy: this much faster than the best uniform action
REFINE_EVALUATIONS_PER_PLAYOUT = 8
MIN_REFINE_EVALUATIONS = 2000
PIPELINE_BUDGET_FRACTION = 0.25  # with budget_s: the pipeline search's share of what is left after steps 1-3
PIPELINE_MIN_GAIN = 0.01         # a pipeline must be predicted this much faster than the best per-group answer
_PIPELINE = ("pipeline",)        # the found-table's marker for a pipeline (not a per-group choice)


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
    candidates: dict[str, Strategy] = field(default_factory=dict, repr=False)   # name -> each step's best
    pipeline: PipelineSearchResult | None = None    # the pipeline search's answer (whether or not it won)
    # when a pipeline won: the best per-group answer (method, strategy, result), which post-passes that do
    # not apply to pipelines (SFB) may still make faster
    per_group: tuple[str, Strategy, SimResult] | None = None

    @property
    def step_time(self) -> float:
        return self.outcome.step_time


def best_uniform(env: SearchEnv) -> tuple[tuple[int, ...], Outcome]:
    """The best single candidate applied to every op group: (choice, outcome)."""
    best = None
    for k in range(len(env.candidates)):
        choice = env.uniform_choice(k)
        out = env.evaluate(choice)
        if best is None or out.rank > best[1].rank:
            best = (choice, out)
    return best


def stage_choice(env: SearchEnv, strategy: Strategy) -> Choice | None:
    """A pipelined STRATEGY's per-group actions as a choice of ENV's candidates (each group: the allowed
    candidate with its stage's action), or None when some stage's action is not a candidate."""
    index = {c.action: k for k, c in enumerate(env.candidates)}
    choice = []
    for g, a in enumerate(strategy.actions):
        k = index.get(a)
        if k is None or k not in env.allowed_sets[g]:
            return None
        choice.append(k)
    return tuple(choice)


def pipeline_admitted(env: SearchEnv, strategy: Strategy) -> bool:
    """Whether the search may answer with the pipelined STRATEGY. A pipeline whose stages all sit on the same
    devices (``Pipeline.on_one_placement``) only buys memory: it is admitted only when the same per-group
    actions without micro-batches do not fit, and never with one micro-batch (``Pipeline.in_name_only``).
    Measured: bench_e2e's G run (5cf7ed8) offered such a pipeline (two stages on h0, M=4) to its tuning step,
    which kept it; it then ran 405 ms against one device's 351 ms in the same run (the transformer at batch
    192). ``Pipeline.in_name_only`` has the measured case for one micro-batch."""
    p = strategy.pipeline
    if p is None or not p.on_one_placement:
        return True
    if p.in_name_only:
        return False
    plain = Strategy(strategy.grouping, list(strategy.actions), name="same_actions")
    return not env.simulator.evaluate(plain, batch_size=env.batch_size).feasible


def is_mixed(choice) -> bool:
    """Whether a found-table CHOICE is a mixed strategy (op groups with different actions) or a pipeline,
    which ``MIXED_MIN_GAIN`` holds to a margin over the best uniform action: on the testbed the simulator's
    error on such plans is larger than on uniform ones (bench_fidelity runs 26-27: median 6.3% and 7.4% for the
    mixed plans, 5.3% and 4.1% for the built-ins, and configuration A's searched CNN plan, predicted 4.4% and 7.0%
    faster than all-reducing every group over two hosts, ran 15% and 18% slower). A built-in (None) is not."""
    if choice is None:
        return False
    return choice is _PIPELINE or len(set(choice)) > 1


def devices_used(strategy: Strategy, topology) -> int:
    """How many devices STRATEGY runs any op group on."""
    return len({d for g in range(len(strategy.actions)) for d in strategy.devices_of(g, topology)})


def simplest_builtin(env: SearchEnv, step_times: dict[str, float], margin: float) -> str:
    """Of the feasible built-ins in STEP_TIMES (name -> predicted seconds), the fastest, unless one using fewer
    devices is predicted within MARGIN of it: then the one using the fewest devices among those (a predicted gain
    smaller than the simulator's error does not pay for more hosts; bench_e2e measured such near-ties the wrong
    way round, e.g. ``partition`` over two hosts predicted 0.01% faster than one device and measured 6% slower)."""
    best = min(step_times, key=step_times.get)
    near = [n for n in step_times if step_times[n] <= step_times[best] * (1 + margin)]
    return min(near, key=lambda n: (devices_used(env.builtin_strategies[n], env.topology), step_times[n]))


def search(env: SearchEnv, *, budget_s: float | None = None, playouts: int | None = None, order: str = "auto",
           seed: int = 0, prior=None, progress: Callable[[SearchProgress], None] | None = None,
           use_pase: bool = True, use_refine: bool = True, min_gain: float = DEFAULT_MIN_GAIN,
           use_pipeline: bool = True, mixed_min_gain: float = MIXED_MIN_GAIN) -> SearchResult:
    """Run the portfolio (module docstring) on ENV and return the best strategy found.

    ``playouts`` bounds the tree search by simulated playouts, ``budget_s`` the whole search by wall-clock
    seconds (both: whichever ends first; neither: ``DEFAULT_PLAYOUTS``). ``order`` is a decision order
    name of ``tag.search.orders`` or ``"auto"``; ``prior`` a callable giving the tree search a prior over a
    group's candidates (``tag.search.mcts.uniform_value_prior`` when None); ``seed`` makes the search
    deterministic (under a playout budget). ``min_gain``: how much faster than the best feasible built-in
    a searched strategy must be predicted to replace it (0.05 = 5%; 0 keeps the fastest predicted).
    ``use_pipeline``: search pipelines too (``tag.search.pipeline_dp``). ``mixed_min_gain``: how much faster
    than the best uniform action a mixed or pipelined strategy must be predicted to replace it (0 keeps the
    fastest predicted; ``is_mixed``).
    """

    t0 = time.perf_counter()
    found: dict[str, tuple[tuple[int, ...] | None, Outcome]] = {}
    for name, r in env.builtin_results.items():
        found[name] = (None, env.outcome_of(r))
    found["best_uniform"] = best_uniform(env)
    if use_pase:
        dp = pase_dp(env)
        found["pase_dp"] = (dp.choice, dp.outcome)

    piped = None
    pipelines: dict[str, Strategy] = {}          # found-table name -> the pipelined strategy it stands for
    if use_pipeline:
        left = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
        piped = pipeline_dp(env, budget_s=None if left is None else left * PIPELINE_BUDGET_FRACTION)
        if piped.strategy is not None:
            if pipeline_admitted(env, piped.strategy):      # else its stages' actions compete as a seed only
                found["pipeline"] = (_PIPELINE, piped.outcome)
                pipelines["pipeline"] = piped.strategy
            seed_choice = stage_choice(env, piped.strategy)
            if seed_choice is not None:
                found["pipeline_stages"] = (seed_choice, env.evaluate(seed_choice))

    def best_so_far() -> tuple[tuple[int, ...], Outcome]:
        searched = {n: v for n, v in found.items() if v[0] is not None and v[0] is not _PIPELINE}
        name = max(searched, key=lambda n: searched[n][1].rank)
        return searched[name]

    if playouts is None and budget_s is None:
        playouts = DEFAULT_PLAYOUTS
    left = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
    report = None
    if progress is not None:
        def report(done: int, total: int | None, seconds: float, best: Outcome) -> None:
            progress(SearchProgress(done, total, time.perf_counter() - t0, best.value if best.feasible else 0.0))
    tree = mcts(env, order=order, playouts=playouts, budget_s=None if left is None else left / 2, seed=seed,
                prior=prior, progress=report, start=best_so_far()[0],
                pipelines=PipelineRoots.of(env, piped) if piped is not None else None,
                admit_pipeline=lambda p: pipeline_admitted(env, env.pipeline_strategy(p)))
    found["mcts"] = (tree.choice, tree.outcome)
    if tree.pipeline is not None and tree.pipeline_outcome.feasible and (     # admitted by the tree already
            "pipeline" not in pipelines or tree.pipeline_outcome.rank > piped.outcome.rank):
        found["mcts_pipeline"] = (_PIPELINE, tree.pipeline_outcome)
        pipelines["mcts_pipeline"] = env.pipeline_strategy(tree.pipeline, name="mcts_pipeline")
    if use_refine:
        left = None if budget_s is None else max(0.0, budget_s - (time.perf_counter() - t0))
        cap = None if playouts is None else max(MIN_REFINE_EVALUATIONS, REFINE_EVALUATIONS_PER_PLAYOUT * playouts)
        refined = refine(env, best_so_far()[0], order=tree.order, budget_s=left, max_evaluations=cap)
        found["refine"] = (refined.choice, refined.outcome)

    per_group = None
    method = max(found, key=lambda n: found[n][1].rank)
    if method in pipelines and found[method][1].feasible:
        # a pipeline has more to mispredict (micro-batches, bubbles): a per-group answer within
        # PIPELINE_MIN_GAIN of it is kept instead
        others = [n for n in found if n not in pipelines]
        runner_up = max(others, key=lambda n: found[n][1].rank)
        if found[runner_up][1].feasible and \
                found[runner_up][1].step_time <= found[method][1].step_time * (1 + PIPELINE_MIN_GAIN):
            method = runner_up
    notes = []
    choice, outcome = found[method]
    uniform = found["best_uniform"][1]
    if is_mixed(choice) and outcome.feasible and uniform.feasible and \
            uniform.step_time <= outcome.step_time * (1 + mixed_min_gain):
        gain = uniform.step_time / outcome.step_time - 1.0
        notes.append(f"the {'pipelined' if choice is _PIPELINE else 'mixed'} strategy ({method}) is "
                     f"predicted only {gain * 100:.1f}% faster than the best uniform action, less than the "
                     f"{mixed_min_gain * 100:g}% margin for the simulator's error on mixed plans; the plan is "
                     f"that uniform action")
        method = "best_uniform"
        choice, outcome = found[method]
    builtins = [n for n in env.builtin_results if found[n][1].feasible]
    best_builtin = simplest_builtin(env, {n: found[n][1].step_time for n in builtins}, min_gain) if builtins else None
    if choice is None and method in builtins and best_builtin != method:
        gain = found[best_builtin][1].step_time / outcome.step_time - 1.0
        notes.append(f"the built-in {method!r} is predicted only {gain * 100:.1f}% faster than {best_builtin!r}, "
                     f"which uses fewer devices: less than the {min_gain * 100:g}% margin for the "
                     f"simulator's error; the plan is {best_builtin!r}")
        method = best_builtin
        choice, outcome = found[method]
    if choice is not None and outcome.feasible and builtins:
        gain = found[best_builtin][1].step_time / outcome.step_time - 1.0
        if gain < min_gain:
            notes.append(f"the searched strategy ({method}) is predicted only {gain * 100:.1f}% faster than the "
                         f"built-in {best_builtin!r}, less than the {min_gain * 100:g}% margin for the simulator's "
                         f"error; the plan is that built-in")
            method = best_builtin
            choice, outcome = found[method]
    if choice is None:
        strategy, result = env.builtin_strategies[method], env.builtin_results[method]
        if not notes:
            notes.append(f"no searched strategy beat the built-in {method!r}; the plan is that built-in")
    elif choice is _PIPELINE:
        strategy = pipelines[method]
        result = piped.result if method == "pipeline" else env.simulator.evaluate(strategy, batch_size=env.batch_size)
        others = [n for n in found if n not in pipelines]
        runner_up = max(others, key=lambda n: found[n][1].rank)
        runner_choice = found[runner_up][0]
        per_group = (runner_up, env.builtin_strategies[runner_up], env.builtin_results[runner_up]) \
            if runner_choice is None else (runner_up, env.strategy(runner_choice, name=runner_up),
                                           env.result(runner_choice))
    else:
        strategy, result = env.strategy(choice, name=method), env.result(choice)
    baselines = {n: float(v[1].step_time) for n, v in found.items()}
    feasible = {n: bool(v[1].feasible) for n, v in found.items()}
    candidates = {n: env.builtin_strategies[n] if c is None else pipelines[n] if c is _PIPELINE
                  else env.strategy(c, name=n) for n, (c, _) in found.items()}
    if piped is not None:
        # the best pipeline of every other micro-batch count and schedule: compared in the report, measured by
        # the tuning step when promising (``pipeline_alternatives``), never the plan without being measured
        for name, (alternative, alt) in pipeline_alternatives(piped).items():
            candidates[name] = alternative
            baselines[name], feasible[name] = float(alt.step_time), bool(alt.feasible)
    return SearchResult(strategy, outcome, result, method, baselines, feasible, env.reference_name,
                        time.perf_counter() - t0, env.evaluations + (piped.evaluated if piped else 0), notes,
                        candidates, piped, per_group)
