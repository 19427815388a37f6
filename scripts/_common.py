"""Small helpers shared by the scripts in this folder (``from _common import ...``; Python puts the
running script's folder on ``sys.path``)."""
from __future__ import annotations

import json
import os
import subprocess


def write_json(path: str | None, obj, indent: int = 1) -> None:
    """Write OBJ as JSON to PATH (indented by INDENT); nothing when PATH is empty or None (no --json)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=indent)


def testbed_missing(prog: str) -> bool:
    """True (after saying why on stderr) when the network-namespace testbed cannot run here."""
    import sys
    from tag_bench.testbed import testbed_available
    ok, why = testbed_available()
    if not ok:
        print(f"{prog}: the testbed is not available here: {why}", file=sys.stderr)
    return not ok


def cpu_times(stat_path: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total) jiffies of every CPU since boot, from the ``cpu`` line of STAT_PATH; None where it cannot be
    read (not Linux). Steal is time a virtual machine's CPUs were ready but its host ran someone else: on the
    shared VM these benchmarks run on, 14-23% in some seconds while the load average stayed below 2, which the
    load average cannot show."""
    try:
        with open(stat_path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already in user and nice
    return values[7], sum(values[:8])


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two ``cpu_times`` readings (None when either is missing or no time
    passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def steal_text(fraction: float | None) -> str:
    """``"  steal 12%"`` for a row's printed line ('' when not known)."""
    return "" if fraction is None else f"  steal {fraction * 100:.0f}%"


def git_commit() -> str:
    """The repository's HEAD commit, with "-dirty" when tracked files differ from it ("unknown" without git)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
