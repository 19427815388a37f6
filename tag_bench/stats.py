"""Summary statistics of a benchmark's rows.

Usage::

    from tag_bench.stats import figure_text, geomean
    geomean([1.2, 0.9, 1.5])                 # 1.17...; None for no values
    figure_text(geomean([]), ".2f", "x")     # "n/a"
"""
from __future__ import annotations

import math
from typing import Iterable


def geomean(values: Iterable[float]) -> float | None:
    """The geometric mean of VALUES (positive numbers); None when there are none."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def figure_text(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    """VALUE formatted by SPEC with UNIT after it, or "n/a" when there is none (a geomean of no cases)."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"
