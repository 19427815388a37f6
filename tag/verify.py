"""A measured guard on a plan: which built-in to measure it against, and which of the two to keep.

``tag.api.verify_plan`` and ``tag-deploy --run --verify`` run the plan and the best feasible built-in
strategy (by predicted step time) for a few steps on the cluster and keep the one measured faster (a
tie keeps the plan). ``verify_fields`` gives the report's ``verify`` keys; ``tag.report.format_verify``
prints them as one line. Pure Python, no TensorFlow.

Example::

    from tag.verify import best_builtin, verify_fields

    best_builtin({"dp_allreduce": 0.2, "ps": 0.3, "mcts": 0.1}, {}, "mcts")        # -> "dp_allreduce"
    verify_fields("mcts", 0.15, "dp_allreduce", 0.12, predicted={"mcts": 0.1, "dp_allreduce": 0.2},
                  steps=6, seconds=3.0)["kept"]                                     # -> "dp_allreduce"
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence

from tag.strategy.baselines import BUILTIN_STRATEGIES

VERIFY_STEPS = 6        # steps each of the two runs
VERIFY_WARMUP = 2       # of which the first ones are not timed


def best_builtin(baselines: Mapping[str, float | None], feasible: Mapping[str, bool], plan: str) -> str | None:
    """The feasible built-in with the lowest finite predicted time in BASELINES (name -> seconds; FEASIBLE:
    name -> fits in memory, missing means it fits); None when there is none or PLAN is one of them."""
    times = {n: float(t) for n, t in baselines.items()
             if n in BUILTIN_STRATEGIES and t is not None and math.isfinite(t) and feasible.get(n, True)}
    if not times or plan in times:
        return None
    return min(times, key=times.get)


def keep(plan: str, plan_s: float, baseline: str, baseline_s: float) -> str:
    """PLAN, unless BASELINE took strictly less time."""
    return baseline if baseline_s < plan_s else plan


def timed_median(step_times: Sequence[float], warmup: int = VERIFY_WARMUP) -> float:
    """The median of STEP_TIMES after the first WARMUP."""
    return float(statistics.median(step_times[warmup:]))


def verify_fields(plan: str, plan_s: float, baseline: str, baseline_s: float, *,
                  predicted: Mapping[str, float], steps: int, seconds: float,
                  warmup: int = VERIFY_WARMUP) -> dict[str, Any]:
    """The report's ``verify`` keys: PLAN and BASELINE measured PLAN_S / BASELINE_S seconds per step (medians
    of STEPS - WARMUP steps, SECONDS of wall time in all); PREDICTED (name -> seconds) holds both
    predictions, so ``overrode_simulator`` says whether the measurement kept the other one than the prediction
    would (a tie favours the plan in both)."""
    kept = keep(plan, plan_s, baseline, baseline_s)
    return {"plan": plan, "plan_ms": plan_s * 1e3, "baseline": baseline, "baseline_ms": baseline_s * 1e3,
            "steps": int(steps), "warmup_steps": int(warmup), "kept": kept,
            "overrode_simulator": kept != keep(plan, predicted[plan], baseline, predicted[baseline]),
            "seconds": float(seconds)}
