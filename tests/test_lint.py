"""The linters CI runs (``.ci/run``), run here too so that ``pytest`` catches a regression locally: ruff over
the repository (rules in pyproject.toml) and the duplicate-code check (scripts/check_duplicates.py)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_ruff = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed (pip install -e '.[test]')")
needs_pylint = pytest.mark.skipif(importlib.util.find_spec("pylint") is None,
                                  reason="pylint is not installed (pip install -e '.[test]')")


@needs_ruff
def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@needs_pylint
def test_duplicate_code_stays_within_the_limit():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_duplicates.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert ": ok" in done.stdout.splitlines()[-1]


def test_duplicate_pairs_count_every_pair_of_places_a_block_is_in():
    check = load_script("check_duplicates")
    report = ("************* Module x\n"
              "tag/a.py:1:0: R0801: Similar lines in 2 files\n==a:[1:7]\n==b:[3:9]\n    x = 1\n\n"
              "tag/a.py:1:0: R0801: Similar lines in 3 files\n==a:[10:16]\n==c:[1:7]\n==d:[5:11]\n    y = 2\n")
    blocks, pairs = check.duplicate_pairs(report)
    assert len(blocks) == 2 and pairs == 1 + 3
    assert blocks[1].splitlines()[1:4] == ["==a:[10:16]", "==c:[1:7]", "==d:[5:11]"]
    assert check.duplicate_pairs("") == ([], 0)
