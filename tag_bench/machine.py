"""The machine a benchmark runs on: its load average, the CPU time its VM's host stole, its CPU model.

The machine the benchmarks run on is shared: every timing is printed beside the load average, and rows that
run long record the share of CPU time stolen while they ran (``steal``), which the load average cannot show.

Usage::

    from tag_bench.machine import cpu_times, load_text, steal_fraction, steal_text
    before = cpu_times()
    ...                                                    # the timed work
    print(f"load {load_text()}{steal_text(steal_fraction(before, cpu_times()))}")
"""
from __future__ import annotations

import os
import platform


def load1() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def load_averages() -> list[float]:
    """The 1-, 5- and 15-minute load averages to two decimals, for a row of a benchmark's JSON."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def load_text(decimals: int = 1) -> str:
    """The 1-, 5- and 15-minute load averages, e.g. ``"1.2 0.9 0.8"`` (``"n/a"`` where the platform has none)."""
    if not hasattr(os, "getloadavg"):
        return "n/a"
    return " ".join(f"{x:.{decimals}f}" for x in os.getloadavg())


def machine_text(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The CPU model and core count, e.g. ``"AMD EPYC, 2 cores"`` (the model from CPUINFO_PATH on Linux)."""
    model = ""
    try:
        with open(cpuinfo_path) as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine() or 'unknown CPU'}, {os.cpu_count()} cores"


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
