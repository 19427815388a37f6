"""Helpers shared by test modules (the exactness checks live in ``tag_bench.exactness``, which the benchmarks use
too; ``load_script`` loads a benchmark of scripts/ by its file path).

    from helpers import in_process_servers, trained_variables   # pyproject's pytest pythonpath holds tests/
    bench_e2e = load_script("bench_e2e")
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

from tag_bench.exactness import (  # noqa: F401 (re-exported)
    forward_group_order,
    in_process_servers,
    train_copies,
    train_host_programs,
    trained_variables,
    zero_gradient_variables,
)

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@functools.cache
def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module, loaded once from its file: the scripts are programs, not a package (they
    import ``tag`` and ``tag_bench`` as installed, nothing from beside them)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # registered first, as an import would (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def kept_within_noise(tune: dict) -> bool:
    """Whether a plan report's ``tune`` keys kept the candidate measured fastest or one within its noise
    (``tag.tune.keep``: of those, the one on the fewest hosts, then the plan)."""
    from tag.tune import within_noise
    rows = tune["candidates"]
    fastest = min(rows, key=lambda r: r["measured_ms"])
    kept = next(r for r in rows if r["name"] == tune["kept"])
    return within_noise(kept["measured_ms"], kept["mad_ms"], fastest["measured_ms"] + 1e-9, fastest["mad_ms"],
                        steps=kept["steps"], fastest_steps=fastest["steps"])


def allowed_slack(baseline: str) -> float:
    """How much slower than the search's BASELINE (a ``SearchResult.baselines`` name) the plan may be predicted:
    nothing for a built-in; ``min_gain`` for the best uniform action (a built-in within the margin is
    preferred); for a searched (possibly mixed or pipelined) strategy, the mixed margin over the best uniform
    action and then ``min_gain`` over a built-in (``tag.search.driver.search``)."""
    from tag.search.driver import DEFAULT_MIN_GAIN, MIXED_MIN_GAIN
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    if baseline in BUILTIN_STRATEGIES:
        return 1e-9
    if baseline == "best_uniform":
        return DEFAULT_MIN_GAIN + 1e-9
    return (1 + DEFAULT_MIN_GAIN) * (1 + MIXED_MIN_GAIN) - 1 + 1e-9
