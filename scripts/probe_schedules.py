"""When each pipeline step runs on the testbed, per stage, against when the simulator runs it.

Issue 21's question from bench_pipeline runs 28-29: on the transformer, ``deferred_w`` was predicted 5-6% faster
than fill-drain on the same stages and ran 11-13% slower. This takes the stages of one bench_pipeline row (its
JSON; default run 29's transformer), times them under each schedule asked for, side by side in interleaved
rounds on bench_pipeline's testbed (quotas 1, 0.5, 0.5; links sized like a V100 on 25 Gbit/s Ethernet), then
runs one traced step (TensorFlow step stats) per schedule and prints, per stage, when each forward (F), backward
(B) and once-per-step weight-gradient (W) step started and ended, measured and simulated, with each device's
busy time (the union of its ops' intervals). No runtime levels: the calibration's own predictions.

Usage::

    python scripts/probe_schedules.py --json F
    python scripts/probe_schedules.py --case deep-mlp --micro-batches 16 --schedules fill_drain,deferred_w
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

ROW_FROM = "docs/measured/issue21-pipeline/bench_pipeline_run29.json"
PROFILE = "docs/measured/issue22-e2e/e2e_g4_amd.profile.json"
_MICRO = re.compile(r"/replica_\d+_micro_(\d+)$")


def measured_steps(meta, phase_of: dict, deferred: set) -> dict:
    """{device: {"steps": {label: [start_ms, end_ms]}, "busy_ms", "span_ms"}} of one traced step (a RunMetadata):
    label F<m> / B<m> for micro-batch m's forward / backward instances, W for the once-per-step weight-gradient
    ops and the concatenations they read; times from the step's first op on any device."""
    stats = meta.step_stats.dev_stats
    t0 = min((n.all_start_micros for d in stats for n in d.node_stats), default=0)
    out = {}
    for dev in stats:
        steps: dict = {}
        spans = []
        for n in dev.node_stats:
            a, b = (n.all_start_micros - t0) / 1e3, (n.all_start_micros + n.all_end_rel_micros - t0) / 1e3
            spans.append((a, b))
            m = _MICRO.search(n.node_name)
            base = _MICRO.sub("", n.node_name)
            if m is not None and phase_of.get(base) in ("forward", "backward"):
                label = ("F" if phase_of[base] == "forward" else "B") + m.group(1)
            elif (base in deferred or n.node_name.startswith("tag/concat/gradients")) \
                    and not n.node_name.endswith("/axis"):      # a concatenation's axis constant runs at the start
                label = "W"
            else:
                continue
            s = steps.setdefault(label, [a, b])
            s[0], s[1] = min(s[0], a), max(s[1], b)
        spans.sort()
        busy, cur = 0.0, None
        for a, b in spans:
            if cur is None or a > cur[1]:
                busy += 0.0 if cur is None else cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        busy += 0.0 if cur is None else cur[1] - cur[0]
        name = dev.device.split("/job:")[-1]
        out[name] = {"steps": {k: [round(x, 1) for x in v] for k, v in sorted(steps.items(), key=lambda kv: kv[1][0])},
                     "busy_ms": round(busy, 1), "span_ms": round(max((b for _, b in spans), default=0.0), 1)}
    return out


def simulated_steps(trace: dict) -> dict:
    """{device row: {label: [start_ms, end_ms]}} of a simulated pipelined step (``Simulator.trace``): its tasks'
    labels begin with F<m>, B<m> or W."""
    rows: dict = collections.defaultdict(dict)
    for e in trace["traceEvents"]:
        m = re.match(r"([FBW])(\d*) ", e.get("name", "")) if e.get("ph") == "X" else None
        if m is None or e.get("pid") != 0:
            continue
        s = rows[f"device {e['tid']}"].setdefault(m.group(1) + m.group(2), [e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3])
        s[0], s[1] = min(s[0], e["ts"] / 1e3), max(s[1], (e["ts"] + e["dur"]) / 1e3)
    return {r: {k: [round(x, 1) for x in v] for k, v in sorted(st.items(), key=lambda kv: kv[1][0])}
            for r, st in sorted(rows.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="transformer", help="a bench_pipeline case (default transformer)")
    p.add_argument("--rows", default=ROW_FROM, help="a bench_pipeline JSON whose row for --case gives the stages")
    p.add_argument("--profile", default=PROFILE, help="the calibration (Profile JSON)")
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--schedules", default="fill_drain,deferred_w", help="comma-separated schedules")
    p.add_argument("--budget", type=float, default=6.0, help="timed seconds per schedule")
    p.add_argument("--json", help="write predictions, timings and step tables here")
    args = p.parse_args(argv)
    from _common import testbed_missing, write_json
    if testbed_missing("probe_schedules"):
        return 2
    from _testbed_cases import device_type, load_recipe, measure_interleaved, testbed_topology
    from bench_pipeline import CASES, GPU_FLOPS, QUOTAS
    from tag.api import prepare
    from tag_bench.mwms import tf1_graph
    from tag.backend.runtime import RunControl, run_steps
    from tag_bench.testbed import Testbed
    from tag.cost.model import Profile
    from tag.ir.algorithms import weight_gradient_ops
    from tag.strategy.pipeline import Pipeline
    from tag.strategy.types import Strategy
    cases = {c[0]: c for c in CASES}
    if args.case not in cases:
        print(f"probe_schedules: unknown case {args.case!r} (known: {', '.join(cases)})", file=sys.stderr)
        return 2
    _, model, width, depth, batch = cases[args.case]
    with open(args.rows) as f:
        row = next((r for r in json.load(f)["rows"] if r["case"] == args.case), None)
    if row is None:
        print(f"probe_schedules: {args.rows} has no {args.case} row", file=sys.stderr)
        return 2
    profile = Profile.load(args.profile)
    recipe = load_recipe()
    link = 25.0 * profile.devices[device_type(max(QUOTAS))].peak_flops / GPU_FLOPS
    recipe["configs"] = {"P": {"quotas": QUOTAS, "links_gbps": [round(link, 6)] * 3}}
    _, topo = testbed_topology(recipe, "P", profile)
    stages = Pipeline.from_dict(row["pipeline"]).stages
    gd = tf1_graph(model, batch, width=width, depth=depth)
    an = prepare(gd, topo, batch_size=batch, profile=profile, name=args.case)
    phase_of = {op.name: op.phase for op in an.graph.ops}
    weight = weight_gradient_ops(an.graph)
    deferred = {op.name for i, op in enumerate(an.graph.ops) if weight[i]}     # labelled W where run once per step
    runs, result = {}, {"case": args.case, "rows_from": args.rows, "micro_batches": args.micro_batches,
                        "stages": row["pipeline"]["stages"], "schedules": {}}
    for s in args.schedules.split(","):
        st = Strategy.pipelined(an.grouping, Pipeline(stages, args.micro_batches, s))
        predicted = an.simulator().evaluate(st, batch_size=batch).step_time
        rw = an.rewrite(st)
        runs[s] = (rw, predicted)
        result["schedules"][s] = {"predicted_ms": round(1e3 * predicted, 1),
                                  "simulated": simulated_steps(an.simulator().trace(st, batch_size=batch))}
    with Testbed(topo, cpu_quota=QUOTAS) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            timed = measure_interleaved(tb, runs, args.budget)
            for s, (rw, predicted) in runs.items():
                entry = result["schedules"][s]
                res = run_steps(rw.graph_def, tb.target, train_op=rw.train_op, loss=rw.loss, init=rw.init,
                                steps=4, warmup=2, synthetic=True, control=RunControl(trace_step=4))
                entry["measured_ms"] = round(1e3 * timed[s], 1)
                entry["traced_step_ms"] = round(1e3 * res.step_times[-1], 1)
                entry["measured"] = measured_steps(res.run_metadata, phase_of, deferred)
                print(f"{s:<11} measured {entry['measured_ms']:7.1f} ms (traced step {entry['traced_step_ms']:.0f}), "
                      f"predicted {entry['predicted_ms']:7.1f} ms  load "
                      f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
                for dev, v in entry["measured"].items():
                    last = {k: v["steps"][k] for k in list(v["steps"])[-3:]}
                    print(f"  {dev}: busy {v['busy_ms']:.0f} of {v['span_ms']:.0f} ms; last steps {last}", flush=True)
                for dev, st in entry["simulated"].items():
                    print(f"  simulated {dev}: last steps {dict(list(st.items())[-3:])}", flush=True)
        finally:
            tb.stop_workers()
    result["load"] = list(os.getloadavg())
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
