"""Duplicate-code check: pylint's similarity checker over tag/, the harness (tag_bench/) and scripts/.

Blocks of at least MIN_LINES (6) lines shared by two or more places, not counting imports, comments and
docstrings, are printed; the check fails (exit 1) when they make more than MAX_PAIRS (8) pairs of places.
pylint's own exit code cannot say that: it is non-zero for any block at all. CI runs it (``.ci/run``), and
so does ``tests/test_lint.py``.

Usage::

    python scripts/check_duplicates.py                  # the blocks, the pair count, exit 0 or 1
    python scripts/check_duplicates.py --max-pairs 0    # fail on any duplicate block
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("tag", "tag_bench", "scripts")
MIN_LINES = 6
MAX_PAIRS = 8
TIMEOUT_S = 600
BLOCK = re.compile(r"R0801: Similar lines in (\d+) files")


def pylint_similarities(paths=PATHS, min_lines: int = MIN_LINES, timeout_s: float = TIMEOUT_S) -> str:
    """pylint's duplicate-code report over PATHS (relative to the repository root), as text."""
    cmd = [sys.executable, "-m", "pylint", "--disable=all", "--enable=duplicate-code",
           f"--min-similarity-lines={min_lines}", "--ignore-imports=y", "--ignore-comments=y",
           "--ignore-docstrings=y", "--ignore=_proto", "--persistent=n", "--score=n", *paths]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode & 1 or done.returncode & 32:      # fatal error / usage error (pylint's exit bits)
        raise RuntimeError(f"pylint failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def duplicate_pairs(report: str) -> tuple[list[str], int]:
    """(the report's blocks, the pairs of places they make: a block shared by n places makes n(n-1)/2)."""
    blocks, pairs = [], 0
    for chunk in re.split(r"\n(?=\S+:\d+:\d+: R0801)", report):
        m = BLOCK.search(chunk)
        if m:
            n = int(m.group(1))
            pairs += n * (n - 1) // 2
            blocks.append(chunk.rstrip())
    return blocks, pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-pairs", type=int, default=MAX_PAIRS, help="most pairs of duplicate places allowed")
    ap.add_argument("--min-lines", type=int, default=MIN_LINES, help="shortest block that counts (lines)")
    args = ap.parse_args(argv)
    blocks, pairs = duplicate_pairs(pylint_similarities(min_lines=args.min_lines))
    for b in blocks:
        print(b, end="\n\n")
    verdict = "ok" if pairs <= args.max_pairs else "too many"
    print(f"duplicate code: {len(blocks)} block(s) of >= {args.min_lines} lines, {pairs} pair(s) of places over "
          f"{', '.join(PATHS)} (at most {args.max_pairs}): {verdict}")
    return 0 if pairs <= args.max_pairs else 1


if __name__ == "__main__":
    sys.exit(main())
