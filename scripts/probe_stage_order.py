"""A pipeline's stage order on the testbed: the fastest host first against the slowest host first, side by side.

bench_e2e run 51 (issue 22) ran the deep transformer's and the deep MLP's three-stage pipelines as [h2 | h1 | h0]
(a half-core host first) and they gained 1.29x and 1.26x over one host, where runs 40-50 ran [h0 | h1 | h2] and
gained 1.43-1.63x; that run never measured the other order. This plans each order on one calibration (the pipeline
DP given that one sequence of hosts, then its hill-climb; ``tag.search.pipeline_dp``), rewrites both
and the one-host step, and times the three in interleaved rounds on configuration G's testbed (bench_e2e's
``run_interleaved``, tag's servers started afresh before each program), printing predicted and measured times.

Usage (needs root, as every testbed run)::

    python scripts/probe_stage_order.py --case deep-transformer \\
        --profile docs/measured/issue22-e2e/e2e_g5_amd_run51.profile.json --json F
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from tag_bench.mwms import tf1_graph  # noqa: E402
from tag_bench.testbed import Testbed  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag.api import prepare  # noqa: E402
from tag.search.env import SearchEnv  # noqa: E402
from tag.search.pipeline_dp import host_units, pipeline_dp  # noqa: E402
from _common import git_commit  # noqa: E402
from _testbed_cases import load_recipe, testbed_topology  # noqa: E402
from bench_e2e import CASES, GPU_CONFIG, config_recipe, describe, run_interleaved  # noqa: E402

ORDERS = {"fastest_first": (0, 1, 2), "slowest_first": (2, 1, 0)}


def pipeline_in_order(analysis, hosts: tuple[int, ...]):
    """The pipeline DP's answer when its only device-set sequence is one host per stage in HOSTS' order."""
    units = host_units(analysis.topology)
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch)
    return pipeline_dp(env, sequences=[[units[h] for h in hosts]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="deep-transformer", choices=[c[0] for c in CASES])
    p.add_argument("--batch-scale", type=int, default=4)
    p.add_argument("--profile", required=True, help="a saved calibration (bench_e2e's .profile.json)")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    label, model, batch, width, depth = next(c for c in CASES if c[0] == args.case)
    batch *= args.batch_scale
    print(f"commit {git_commit()}; load {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    profile = Profile.load(args.profile)
    recipe = config_recipe(load_recipe(), profile, 25.0)
    _, topo = testbed_topology(recipe, GPU_CONFIG, profile)
    gd = tf1_graph(model, batch, width=width, depth=depth)
    an = prepare(gd, topo, batch_size=batch, profile=profile, name=label)
    single = an.builtin("single")
    programs = {"single": an.rewrite(single)}
    predicted, described = {"single": an.simulator().evaluate(single, batch_size=batch).step_time}, {}
    for name, hosts in ORDERS.items():
        found = pipeline_in_order(an, hosts)
        programs[name] = an.rewrite(found.strategy)
        predicted[name] = found.outcome.step_time
        described[name] = describe(found.strategy, topo)
        print(f"{name}: predicted {found.outcome.step_time * 1e3:.1f} ms, {described[name]}", flush=True)
    print(f"single: predicted {predicted['single'] * 1e3:.1f} ms", flush=True)
    t0 = time.time()
    with Testbed(topo, cpu_quota=recipe["configs"][GPU_CONFIG]["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            measured, _, _ = run_interleaved(tb, programs, args.steps, args.warmup, fresh_servers="program")
        finally:
            tb.stop_workers()
    load = os.getloadavg()[0]
    rows = []
    for name in programs:
        rows.append({"program": name, "predicted_s": predicted[name], "measured_s": measured[name],
                     "over_single": measured["single"] / measured[name], "describe": described.get(name, "one device on h0")})
        print(f"{name:<14} predicted {predicted[name] * 1e3:8.1f} ms  measured {measured[name] * 1e3:8.1f} ms  "
              f"one host / this {measured['single'] / measured[name]:.2f}  load {load:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "case": label, "batch": batch, "profile": os.path.basename(args.profile),
                       "seconds": time.time() - t0, "load1": load, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
