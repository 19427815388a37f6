"""tag_bench.stats: the geometric mean of a benchmark's rows and its text when there are none."""
from __future__ import annotations

import pytest

from tag_bench.stats import figure_text, geomean


def test_geomean_of_values_and_of_none():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean(iter([1.5])) == pytest.approx(1.5)
    assert geomean([]) is None


def test_figure_text_says_na_for_a_missing_figure():
    assert figure_text(1.2345, ".2f", "x") == "1.23x"
    assert figure_text(0.5) == "0.50"
    assert figure_text(None, ".3f", "x") == "n/a"
