"""What each extra micro-batch of a pipeline costs on the testbed, against what the simulator predicts.

Issue 21's question from bench_fidelity run 19: the tuning step's pipeline candidates of the VGG-style CNN (batch 48,
eight micro-batches of six examples) were predicted 110 and 143 ms and ran 245 and 338 ms, while one host and most
other plans were predicted within 10-20%. This takes one pipeline's stages as the search returns them on a saved
calibration (``--run``, a bench_fidelity JSON whose profiles and topologies lie beside it), and times, side by side
in interleaved rounds on one testbed, one host and the same stages at every micro-batch count and schedule asked
for. Each row prints the prediction, the measurement and their ratio; the one-host ratio is the reference (the
calibration may have been taken on a faster or slower day). ``--no-quota`` runs the same hosts without CPU quotas
or pinning, to tell the runtime's own per-micro-batch work apart from the quotas' time slices. Needs root.

Usage::

    python scripts/probe_micro_batches.py --config A --model vgg --micro-batches 1,2,4,8 --json F
    python scripts/probe_micro_batches.py --config A --model vgg --no-quota --json F
    python scripts/probe_micro_batches.py --calibrate --one-host --json F   # a fresh calibration, saved beside F
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

RUN = "docs/measured/issue20-fidelity/bench_fidelity_shared_run19"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=RUN, help="a saved bench_fidelity --json path without .json (default: run 19)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate this machine afresh instead of reading --run's calibration (about 12 minutes); "
                        "the profile and topology are written beside --json")
    p.add_argument("--config", default="A", help="testbed configuration of the recipe (default A)")
    p.add_argument("--model", default="vgg", help="a bench_fidelity model label (default vgg)")
    p.add_argument("--micro-batches", default="1,2,4,8", help="comma-separated micro-batch counts")
    p.add_argument("--schedules", default="1f1b,fill_drain", help="comma-separated schedules")
    p.add_argument("--rounds", type=int, default=2, help="times the interleaved measurement is repeated")
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per case and round")
    p.add_argument("--no-quota", action="store_true", help="hosts without CPU quotas or pinning")
    p.add_argument("--one-host", action="store_true", help="every stage on the first host's device (no transfers)")
    p.add_argument("--json", help="write predictions and measurements here")
    args = p.parse_args(argv)
    from _common import testbed_missing, write_json
    if testbed_missing("probe_micro_batches"):
        return 2
    from _testbed_cases import calibration_graph, load_recipe, measure_interleaved
    from bench_fidelity import MODELS
    from tag.api import prepare, search_plan
    from tag_bench.testbed import Testbed
    from tag.cluster.topology import parse_topology
    from tag.cost.model import Profile
    from tag.strategy.types import Strategy

    spec, batch = {label: (s, b) for label, s, b in MODELS}[args.model]
    if args.calibrate:
        profile, topo = fresh_calibration(args.config, args.json)
    else:
        profile = Profile.load(f"{args.run}.run1.testbed-{args.config}.profile.json")
        with open(f"{args.run}.run1.testbed-{args.config}.pbtxt") as f:
            topo = parse_topology(f.read())
    an = prepare(calibration_graph(spec, batch), topo, batch_size=batch, profile=profile, name=args.model)
    found = search_plan(an, budget_s=10.0, seed=0)   # bench_fidelity's budget and seed
    base = found.candidates["pipeline"].pipeline
    if args.one_host:
        first = next(i for i, g in enumerate(topo.groups) if g.host == topo.hosts[0].name)
        base = dataclasses.replace(base, stages=[dataclasses.replace(s, placement=(first,)) for s in base.stages])
    print(f"stages {[(s.placement, len(s.groups)) for s in base.stages]} (searched M={base.micro_batches}, "
          f"{base.schedule})", flush=True)
    cases = {"single": an.builtin("single")}
    for m in (int(x) for x in args.micro_batches.split(",")):
        for schedule in args.schedules.split(","):
            if m == 1 and schedule != args.schedules.split(",")[0]:
                continue                     # one micro-batch: every schedule runs the same program
            name = f"M{m}_{schedule}"
            cases[name] = Strategy.pipelined(an.grouping, dataclasses.replace(base, micro_batches=m, schedule=schedule),
                                             name=name)
    sim = an.simulator()
    predicted = {k: sim.evaluate(s, batch_size=batch).step_time for k, s in cases.items()}
    runnables = {k: (an.rewrite(s), predicted[k]) for k, s in cases.items()}
    quotas = None if args.no_quota else load_recipe()["configs"][args.config]["quotas"]
    out = {"run": "fresh calibration" if args.calibrate else os.path.basename(args.run), "config": args.config,
           "model": args.model, "batch": batch, "quotas": quotas, "one_host": args.one_host,
           "stages": base.to_dict()["stages"],
           "predicted_ms": {k: v * 1e3 for k, v in predicted.items()}, "measured_ms": [], "load": []}
    with Testbed(an.topology, cpu_quota=quotas) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            for r in range(args.rounds):
                measured = measure_interleaved(tb, runnables, args.seconds)
                out["measured_ms"].append({k: v * 1e3 for k, v in measured.items()})
                out["load"].append(os.getloadavg()[0])
                ref = measured["single"] / predicted["single"]
                print(f"repeat {r} (load {out['load'][-1]:.1f}):", flush=True)
                for k in cases:
                    ratio = measured[k] / predicted[k]
                    print(f"  {k:16s} predicted {predicted[k] * 1e3:7.1f} ms  measured {measured[k] * 1e3:7.1f} ms  "
                          f"measured/predicted {ratio:4.2f} ({ratio / ref:4.2f} of one host's)", flush=True)
        finally:
            tb.stop_workers()
    write_json(args.json, out)
    return 0


def fresh_calibration(config: str, json_path: str | None):
    """(Profile, Topology) of CONFIG calibrated on this machine as bench_fidelity does it (the recipe's
    calibration, then runtime levels on the running testbed); saved beside JSON_PATH when given."""
    import tempfile
    from _testbed_cases import calibrate_testbed, load_recipe, runtime_levels, testbed_topology
    from tag_bench.testbed import Testbed
    recipe = load_recipe()
    with tempfile.TemporaryDirectory() as workdir:
        profile = calibrate_testbed(recipe, workdir, [config])
    text, topo = testbed_topology(recipe, config, profile)
    with Testbed(topo, cpu_quota=recipe["configs"][config]["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            profile = runtime_levels(tb, recipe, profile)
        finally:
            tb.stop_workers()
    if json_path:
        stem = json_path[:-5] if json_path.endswith(".json") else json_path
        profile.save(f"{stem}.testbed-{config}.profile.json")
        with open(f"{stem}.testbed-{config}.pbtxt", "w") as f:
            f.write(text)
    return profile, topo


if __name__ == "__main__":
    sys.exit(main())
