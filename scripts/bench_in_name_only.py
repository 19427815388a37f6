"""A pipeline in name only against the same per-group actions without it, measured side by side on the testbed.

A pipeline of one micro-batch whose stages all sit on the same devices (``Pipeline.in_name_only``) overlaps
nothing that its stages' actions without the pipeline would not; the search no longer returns one
(``tag.search.driver``). This script shows why on a saved bench_fidelity calibration: it builds the in-name-only
pipeline from the search's own pipeline answer (every stage moved onto every device group, one micro-batch),
the same actions without the pipeline, the plan the search returns now, and the built-ins, and times them all
interleaved (``measure_interleaved``) beside their predictions. Needs root (namespaces, cgroup v1 cpu).

Usage::

    python scripts/bench_in_name_only.py --saved docs/measured/issue20-fidelity/bench_fidelity_shared_run14 \\
        --config B --model cnn --json F
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench_fidelity import MODELS, git_commit  # noqa: E402
from _testbed_cases import calibration_graph, load_recipe, measure_interleaved  # noqa: E402
from tag.api import prepare, search_plan  # noqa: E402
from tag_bench.testbed import Testbed  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag.search import SearchEnv  # noqa: E402
from tag.search.pipeline_dp import pipeline_dp  # noqa: E402
from tag.strategy import Strategy  # noqa: E402
from tag.strategy.pipeline import Pipeline, PipelineStage  # noqa: E402
from tag.strategy.baselines import BUILTIN_STRATEGIES  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saved", required=True, help="a bench_fidelity --json F path without .json: its run 1's "
                                                   "profile and topology of --config are used")
    ap.add_argument("--config", default="B")
    ap.add_argument("--model", default="cnn", help="a bench_fidelity model label")
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per case, over the rounds")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    profile = Profile.load(f"{args.saved}.run1.testbed-{args.config}.profile.json")
    with open(f"{args.saved}.run1.testbed-{args.config}.pbtxt") as f:
        topology = parse_topology(f.read())
    _, spec, batch = next(m for m in MODELS if m[0] == args.model)
    with Testbed(topology, cpu_quota=load_recipe()["configs"][args.config]["quotas"]) as tb:
        an = prepare(calibration_graph(spec, batch), tb.topology, batch_size=batch, profile=profile, name=args.model)
        env = SearchEnv(an.graph, an.topology, an.grouping, cost_model=an.cost_model, batch_size=batch,
                        simulator=an.simulator())
        stages = pipeline_dp(env).strategy.pipeline.stages
        every = tuple(g.index for g in tb.topology.groups)
        fake = Pipeline(tuple(PipelineStage(s.groups, every, s.mode, s.ps_device) for s in stages), 1)
        piped = env.pipeline_strategy(fake, name="in_name_only")    # its actions: each stage's, per op group
        plan = search_plan(an, budget_s=10.0, seed=0)
        cases = {"in_name_only": piped, "same_actions": Strategy(an.grouping, list(piped.actions), name="same_actions"),
                 f"plan:{plan.method}": plan.strategy, **{n: an.builtin(n) for n in BUILTIN_STRATEGIES}}
        predicted = {k: env.simulator.evaluate(s, batch_size=batch).step_time for k, s in cases.items()}
        tb.start_workers(threads_per_worker=1)
        try:
            measured = measure_interleaved(tb, {k: (an.rewrite(s), predicted[k]) for k, s in cases.items()},
                                           args.seconds)
        finally:
            tb.stop_workers()
    load = os.getloadavg()[0]
    rows = [{"case": k, "predicted_s": predicted[k], "measured_s": measured[k]} for k in cases]
    for r in rows:
        print(f"{r['case']:16s} predicted {r['predicted_s'] * 1e3:7.1f} ms  measured {r['measured_s'] * 1e3:7.1f} ms"
              f"  error {r['predicted_s'] / r['measured_s'] - 1:+.1%}  load {load:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "config": args.config, "model": args.model, "batch": batch,
                       "saved": os.path.relpath(args.saved, REPO), "rows": rows, "load1": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
