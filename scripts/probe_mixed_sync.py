"""Why a mix of parameter-server and all-reduce groups ran slower than either: B/cnn's plans timed side by side.

Issue 20's probe of bench_fidelity run 18's worst case. On testbed configuration B (one full-core host, two
quarter-core hosts, 0.3 Gbit/s), with the calibration run 18 saved beside its JSON, the small CNN's searched
``refine`` plan (8 op groups with a parameter server, conv2d_6 / conv2d_7 and the weightless adds all-reduced
over the three hosts) was predicted 98.8 ms and ran 155.9. This times, in interleaved rounds on one testbed,
that plan, the built-ins and three variants that change one thing each:

* ``refine_all_ps``: the plan with its all-reduced groups on the parameter server instead;
* ``ps_c7_ar``: ``ps`` with only conv2d_7 all-reduced (one collective among parameter-server traffic);
* ``dp_c7_ps``: ``dp_allreduce`` with only conv2d_7 on the parameter server.

and three that apply to any searched plan: ``best_uniform`` (the search's best one-action plan),
``refine_all_ar`` (the plan with its parameter-server groups all-reduced over the same devices) and
``refine_no_island`` (its groups that run alone on a device other than device 0 moved to device 0). It prints
each one's prediction with the profile as saved and with the profile's ``sync_serial_*`` set as given
(``--serial AR,PS``). ``--run PREFIX --config C`` probes another fidelity run's calibration and configuration
(its ``PREFIX.run1.testbed-C.pbtxt`` and ``.profile.json``). Needs root. Usage::

    python scripts/probe_mixed_sync.py --rounds 2 --serial 0.85,0.22 --json F
    python scripts/probe_mixed_sync.py --run docs/measured/issue20-fidelity/bench_fidelity_shared_run23 --config A --json F
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

RUN = "docs/measured/issue20-fidelity/bench_fidelity_shared_run18"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="times the interleaved measurement is repeated")
    p.add_argument("--serial", default="0.85,0.22", help="sync_serial_allreduce,sync_serial_ps for the second "
                                                          "prediction column")
    p.add_argument("--json", help="write predictions and measurements here")
    p.add_argument("--run", default=RUN, help="the fidelity run whose saved calibration and topology are probed")
    p.add_argument("--config", default="B", help="that run's testbed configuration")
    args = p.parse_args(argv)
    from _common import testbed_missing, write_json
    if testbed_missing("probe_mixed_sync"):
        return 2
    from _testbed_cases import calibration_graph, load_recipe, measure_interleaved, saved_testbed
    from bench_fidelity import MODELS
    from tag.api import prepare, search_plan
    from tag_bench.testbed import Testbed
    from tag.strategy.types import Action
    from tag.tune import best_uniform_of

    spec, batch = {label: (s, b) for label, s, b in MODELS}["cnn"]
    profile, topo = saved_testbed(args.run, args.config)
    an = prepare(calibration_graph(spec, batch), topo, batch_size=batch, profile=profile, name="cnn")
    plan = search_plan(an, budget_s=10.0, seed=0)    # the run's plan: the same profile, budget and seed
    names = an.grouping.names
    hosts = tuple(range(an.topology.num_devices))

    def variant(base, change, name):
        return dataclasses.replace(base, actions=[change(names[g], a) for g, a in enumerate(base.actions)], name=name)

    ps, dp = an.builtin("ps"), an.builtin("dp_allreduce")
    cases = {"single": an.builtin("single"), "dp": dp, "ps": ps, "refine": plan.strategy,
             "refine_all_ps": variant(plan.strategy, lambda n, a: Action(hosts, "ps", 0) if a.placement == hosts
                                      else a, "refine_all_ps"),
             "ps_c7_ar": variant(ps, lambda n, a: Action(hosts, "allreduce") if n == "conv2d_7" else a, "ps_c7_ar"),
             "dp_c7_ps": variant(dp, lambda n, a: Action(hosts, "ps", 0) if n == "conv2d_7" else a, "dp_c7_ps"),
             "best_uniform": best_uniform_of(an)[0],
             "refine_all_ar": variant(plan.strategy, lambda n, a: Action(a.placement, "allreduce")
                                      if a.mode == "ps" and len(a.placement) > 1 else a, "refine_all_ar"),
             "refine_no_island": variant(plan.strategy, lambda n, a: Action((0,), "allreduce")
                                         if a.placement != (0,) and len(a.placement) == 1 else a, "refine_no_island")}
    serial_ar, serial_ps = (float(x) for x in args.serial.split(","))
    serial = prepare(calibration_graph(spec, batch), topo, batch_size=batch, name="cnn", profile=dataclasses.replace(
        profile, network=dataclasses.replace(profile.network, sync_serial_allreduce=serial_ar,
                                             sync_serial_ps=serial_ps))).simulator()
    sim = an.simulator()
    out = {"plan": plan.method, "serial": [serial_ar, serial_ps], "predicted_ms": {}, "predicted_serial_ms": {},
           "measured_ms": [], "load": []}
    for k, s in cases.items():
        out["predicted_ms"][k] = sim.evaluate(s).step_time * 1e3
        out["predicted_serial_ms"][k] = serial.evaluate(s).step_time * 1e3
        print(f"{k:14s} predicted {out['predicted_ms'][k]:6.1f} ms, with sync_serial "
              f"{out['predicted_serial_ms'][k]:6.1f} ms", flush=True)
    runnables = {k: (plan if k == "refine" else an.rewrite(s), out["predicted_ms"][k] / 1e3)
                 for k, s in cases.items()}
    out["plan_actions"] = dict(Counter(str(a) for a in plan.strategy.actions))
    print("plan: " + ", ".join(f"{n} x{c}" for n, c in sorted(out["plan_actions"].items())), flush=True)
    with Testbed(an.topology, cpu_quota=load_recipe()["configs"][args.config]["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            for r in range(args.rounds):
                m = measure_interleaved(tb, runnables, 4.0)
                out["measured_ms"].append({k: v * 1e3 for k, v in m.items()})
                out["load"].append(os.getloadavg()[0])
                print(f"measured, repeat {r} (load {out['load'][-1]:.1f}): "
                      + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in m.items()), flush=True)
        finally:
            tb.stop_workers()
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
