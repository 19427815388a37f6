"""How much one machine's calibration moves from one run to the next: the traced profile of the testbed's
calibration models (``testbed_recipe.json``: the models, batch, traced steps, sustained window and MatMul table
that ``bench_e2e`` and ``bench_fidelity`` calibrate with), taken RUNS times in a row, each in its own process
pinned to one core, as ``tag_bench.cases.calibrate_testbed`` takes it.

Prints per run the fields the fit makes from the step (launch overhead per op, the bandwidth memory-bound ops
reach, peak, the sustained step, the two step walls) and their spread ((largest - smallest) / median). The
launch overhead is a residual of a few percent of the step and the bandwidth decides which ops are memory-bound
(``tag.cost.fitting``), so these two show first when the measurement hangs on the machine's moment.

Usage::

    python scripts/bench_calibration_spread.py --runs 3 --json spread.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

from tag_bench.cases import load_recipe, model_file, profile_command, traced_args
from tag_bench.records import Run, write_json

DEVICE_TYPE = "CPUq100"
FIELDS = ("launch_us", "bandwidth_gbs", "peak_gflops", "sustained_ms")


def one_profile(models: list[str], cal: dict, out: str) -> dict:
    """One ``tag-profile`` of MODELS as the testbed calibration runs it (CAL: the recipe's calibration), written
    to OUT; the row of this script's fields."""
    t0 = time.perf_counter()
    subprocess.run(profile_command(cal, traced_args(cal, models), DEVICE_TYPE, out), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    with open(out) as f:
        prof = json.load(f)
    d = prof["devices"][DEVICE_TYPE]
    walls = re.findall(r"step ([0-9.]+) ms ops one at a time, ([0-9.]+) ms with default settings", prof["source"])
    return {"launch_us": d["launch_overhead_s"] * 1e6, "bandwidth_gbs": d["memory_bandwidth"] / 1e9,
            "peak_gflops": d["peak_flops"] / 1e9, "sustained_ms": d["sustained_step_s"] * 1e3,
            "walls_ms": [[float(a), float(b)] for a, b in walls], "seconds": time.perf_counter() - t0,
            "load": list(os.getloadavg())}


def spread(values: list[float]) -> float:
    """(largest - smallest) / median of VALUES."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="calibrations in a row (default 3)")
    p.add_argument("--json", default=None, help="write every run and the spreads here")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    if args.runs < 2:
        p.error("--runs must be at least 2 to show a spread")
    cal = load_recipe()["calibration"]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        models = [model_file(spec, cal["batch"], work) for spec in cal["models"]]
        for r in range(args.runs):
            row = one_profile(models, cal, os.path.join(work, f"profile-{r}.json"))
            rows.append(row)
            print(f"run {r + 1}/{args.runs}: launch {row['launch_us']:.1f} us/op, memory-bound ops at "
                  f"{row['bandwidth_gbs']:.1f} GB/s, peak {row['peak_gflops']:.1f} GFLOP/s, sustained step "
                  f"{row['sustained_ms']:.2f} ms, walls (one at a time / default) "
                  f"{', '.join(f'{a:.2f}/{b:.2f}' for a, b in row['walls_ms'])} ms, load {row['load'][0]:.1f}",
                  flush=True)
    spreads = {k: spread([row[k] for row in rows]) for k in FIELDS}
    print("spread (largest - smallest) / median: " + ", ".join(f"{k} {v:.2f}" for k, v in spreads.items()))
    write_json(args.json, {"runs": rows, "spread": spreads, "recipe_calibration": cal}, this_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
