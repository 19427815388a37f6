"""Fidelity of the step simulator: predicted vs measured step times on a real multi-host testbed.

For every (model, strategy, link bandwidth) case the script
  1. predicts one training step with the simulator (cost model calibrated once for this machine by
     ``tag-profile`` on a calibration graph, pinned to one core as each worker is),
  2. rewrites the graph for the strategy (``tag.rewrite``) and runs it on TF servers inside network
     namespaces whose links are shaped to the declared bandwidth (``tag.testbed``), one core-sized
     worker per host,
and prints predicted and measured times, the median absolute relative error and Spearman's rank
correlation. Needs root (network namespaces, tc).

Usage::

    python scripts/bench_fidelity.py                 # 24 cases, about 15 minutes here
    python scripts/bench_fidelity.py --quick         # 8 cases
    python scripts/bench_fidelity.py --json fid.json # {"cases", "median_abs_rel_error", "spearman", "rows"}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from tag import zoo  # noqa: E402
from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy  # noqa: E402
from tag.cost.model import CostModel, Profile  # noqa: E402
from tag.frontend.analyze import analyze  # noqa: E402
from tag.cost.calibration import profile_network  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.runtime import run_steps  # noqa: E402
from tag.sim.simulator import Simulator  # noqa: E402
from tag.backend.testbed import Testbed  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402

# (label, model spec, global batch)
MODELS = [
    ("mlp-512", "zoo:mlp,hidden=512x512", 64),
    ("mlp-1024x3", "zoo:mlp,hidden=1024x1024x1024", 64),
]
BANDWIDTHS_GBPS = [0.15, 0.5, 2.0]
CALIBRATION_MODEL = "zoo:mlp,hidden=512x1024x1536x768"  # not one of the measured cases; a sweep of layer widths
CALIBRATION_BATCH = 64


def two_host_topology(bandwidth_gbps: float, latency_us: float) -> str:
    """Two one-core CPU hosts joined by one link of the given bandwidth (the testbed shapes it)."""
    hosts = "\n".join(
        f'host {{ name: "cpu{i}" address: "127.0.0.1" port: {24461 + i}\n'
        f'  device {{ type: "CPU" kind: CPU count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}'
        for i in range(2))
    return (f'name: "testbed-{bandwidth_gbps:g}gbps"\n{hosts}\n'
            f'link {{ a: "cpu0" b: "cpu1" bandwidth_gbps: {bandwidth_gbps} latency_us: {latency_us} }}\n')


def calibrate(workdir: str) -> Profile:
    """Profile the calibration graph on one core (as a worker runs), then TF's runtime between two local
    one-thread workers (tag.profile.profile_network); one profile for every case."""
    out = os.path.join(workdir, "profile.json")
    cmd = [sys.executable, "-m", "tag.cli.profile", "--model", CALIBRATION_MODEL, "--batch", str(CALIBRATION_BATCH),
           "--steps", "20", "--out", out]
    if os.path.exists("/usr/bin/taskset"):
        cmd = ["taskset", "-c", "0"] + cmd
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    profile = Profile.load(out)
    profile.network = profile_network(steps=30)
    n, d = profile.network, profile.devices["CPU"]
    print(f"calibration: CPU peak {d.peak_flops / 1e9:.1f} GFLOP/s, launch {d.launch_overhead_s * 1e6:.0f} us; "
          f"runtime step overhead {n.step_overhead_s * 1e3:.2f} ms, transfer latency {n.transfer_latency_s * 1e6:.0f} us, "
          f"throughput {n.transfer_bytes_per_s / 1e9:.2f} GB/s", flush=True)
    return profile


def run_case_set(profile: Profile, bandwidth: float, models, strategies, steps: int, latency_us: float) -> list[dict]:
    topo = parse_topology(two_host_topology(bandwidth, latency_us), path=f"<testbed {bandwidth} Gbit/s>")
    rows = []
    with Testbed(topo) as tb:
        tb.start_workers(threads_per_worker=1)
        for label, spec, batch in models:
            _, gd = zoo.resolve_model(spec, batch)
            tg = analyze(gd, batch_size=batch)
            grouping = group_ops(tg)
            sim = Simulator(tg, topo, grouping, CostModel(tg, topo, profile))
            for name in strategies:
                strategy = builtin_strategy(name, tg, topo, grouping)
                predicted = sim.evaluate(strategy, batch_size=batch).step_time
                res = rewrite(gd, tg, strategy, tb.topology, batch_size=batch)
                run = run_steps(res.graph_def, tb.target, train_op=res.train_op, loss=res.loss, init=res.init,
                                steps=steps, warmup=3, synthetic=True)
                measured = float(np.median(run.step_times[3:]))
                row = {"model": label, "strategy": name, "bandwidth_gbps": bandwidth,
                       "predicted_s": predicted, "measured_s": measured,
                       "rel_error": (predicted - measured) / measured}
                rows.append(row)
                print(f"{label:<12} {name:<13} {bandwidth:>6.2f} Gbit/s  predicted {predicted * 1e3:9.2f} ms"
                      f"  measured {measured * 1e3:9.2f} ms  error {row['rel_error'] * 100:+7.1f}%", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one model, two bandwidths (8 cases)")
    p.add_argument("--steps", type=int, default=12, help="steps per case (the first 3 are warm-up)")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="declared one-way link latency (default 50; this kernel's testbed cannot add it)")
    p.add_argument("--json", help="write the figures as JSON to this file")
    args = p.parse_args(argv)
    from _common import testbed_missing
    if testbed_missing("bench_fidelity"):
        return 2
    models = MODELS[:1] if args.quick else MODELS
    bandwidths = BANDWIDTHS_GBPS[::2] if args.quick else BANDWIDTHS_GBPS
    t0 = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        profile = calibrate(workdir)
    rows = []
    for bw in bandwidths:
        rows += run_case_set(profile, bw, models, BUILTIN_STRATEGIES, args.steps, args.latency_us)
    pred = np.array([r["predicted_s"] for r in rows])
    meas = np.array([r["measured_s"] for r in rows])
    mare = float(np.median(np.abs(pred - meas) / meas))
    rho = float(spearmanr(pred, meas).statistic)
    print(f"\n{len(rows)} cases in {time.time() - t0:.0f} s: median |relative error| {mare * 100:.1f}%, "
          f"Spearman rho {rho:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": len(rows), "median_abs_rel_error": mare, "spearman": rho, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
