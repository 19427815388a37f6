"""Gradient fusion buckets sized per plan (``tag.search.buckets``): predicted on the ready GPU topologies, measured
on the testbed.

Data parallelism sums its gradients in fusion buckets; where a bucket closes trades the fixed cost each collective
pays against how much of the backward pass the collectives overlap. tag used one size for every plan (16 MB) and
now simulates each of ``BUCKET_CHOICES`` and keeps the fastest (``Strategy.bucket_bytes``).

Two parts:

* predicted (always; seconds): ``dp_allreduce`` of zoo models on the ready topologies of ``topologies/`` with the
  default size and with the chosen one, and their ratio;
* measured (``--testbed``; needs root and a saved calibration, ``--profile``): on bench_e2e's configuration G (one
  full-core and two half-core hosts, links at a V100 cluster's bytes per FLOP), for bench_e2e's cases, one host,
  ``dp_allreduce`` with the default size and with the chosen size, timed side by side in interleaved rounds
  (``measure_interleaved``), each beside its prediction, with the load average. tf.distribute's
  MultiWorkerMirroredStrategy, the baseline of bench_e2e, packs every gradient into one collective by default.

Usage::

    python scripts/bench_buckets.py --json F                                   # predicted only (~2 minutes)
    python scripts/bench_buckets.py --testbed --profile P --cases transformer,cnn --json F

JSON keys: ``predicted`` (rows: topology, model, batch, default_s, chosen_s, bucket_bytes, speedup),
``geomean_predicted_speedup``, ``measured`` (rows: case, batch, predicted and measured seconds per program,
``dp_speedup`` = default-size dp over chosen-size dp, measured), ``geomean_measured_dp_speedup``,
``provenance`` (commit, command, load average, date, machine).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

from tag.search.buckets import size_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.stats import geomean  # noqa: E402

#: (ready topology, zoo model, global batch): the models bench_search plans, at batches that fill the devices
PREDICTED_CASES = [
    ("cloud-slow-link.pbtxt", "bert_base", 64), ("cloud-slow-link.pbtxt", "resnet50", 256),
    ("lab-v100-1080ti.pbtxt", "bert_base", 64), ("lab-v100-1080ti.pbtxt", "resnet50", 256),
    ("consumer-lab-4host.pbtxt", "bert_base", 32), ("consumer-lab-4host.pbtxt", "resnet50", 128),
    ("h100-2x8-infiniband.pbtxt", "bert_base", 256), ("h100-2x8-infiniband.pbtxt", "resnet50", 1024),
    ("fabric-64x8.pbtxt", "bert_base", 2048), ("fabric-64x8.pbtxt", "resnet50", 8192),
]
ROUNDS = 2


def mib(nbytes: float | None) -> str:
    return "default" if nbytes is None else size_text(nbytes)


def predicted_rows(cases) -> list[dict]:
    """Default-size and chosen-size dp_allreduce of each (topology, model, batch), predicted."""
    import tag
    from tag.api import prepare
    from tag.search.buckets import choose_bucket_bytes
    rows = []
    for topo_file, model, batch in cases:
        t0 = time.perf_counter()
        topo = tag.load_topology(os.path.join(REPO, "topologies", topo_file))
        analysis = prepare(tag.zoo.training_graph(model, batch_size=batch), topo, batch_size=batch, name=model)
        sim, dp = analysis.simulator(), analysis.builtin("dp_allreduce")
        default = sim.evaluate(dp).step_time
        chosen = choose_bucket_bytes(sim, dp, batch)
        best = default if chosen is None else chosen.step_time
        row = {"topology": topo_file, "devices": topo.num_devices, "model": model, "batch": batch,
               "default_s": float(default), "chosen_s": float(best),
               "bucket_bytes": None if chosen is None else chosen.strategy.bucket_bytes,
               "speedup": float(default / best),
               "step_times_s": {} if chosen is None else {mib(b): t for b, t in chosen.step_times.items()}}
        rows.append(row)
        print(f"{topo_file:28s} {topo.num_devices:4d} {model:10s} {batch:5d}  default {default * 1e3:9.1f} ms  "
              f"chosen {best * 1e3:9.1f} ms ({mib(row['bucket_bytes'])})  x{row['speedup']:.2f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def measured_rows(profile_path: str, case_names: list[str], seconds: float, rounds: int) -> list[dict]:
    """On configuration G: one host, default-size and chosen-size dp_allreduce per bench_e2e case, measured."""
    from tag.api import prepare
    from tag.cost.model import Profile
    from tag.search.buckets import choose_bucket_bytes
    from tag_bench.cases import E2E_CASES, config_recipe, load_recipe, measure_interleaved, testbed_topology
    from tag_bench.mwms import tf1_graph
    from tag_bench.testbed import Testbed
    profile = Profile.load(profile_path)
    recipe = config_recipe(load_recipe(), profile, 25.0)
    _, topo = testbed_topology(recipe, "G", profile)
    unknown = set(case_names) - {c[0] for c in E2E_CASES}
    if unknown:
        raise SystemExit(f"bench_buckets: unknown case(s) {', '.join(sorted(unknown))}")
    rows = []
    with Testbed(topo, cpu_quota=recipe["configs"]["G"]["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            for label, model, batch, width, depth in E2E_CASES:
                if label not in case_names:
                    continue
                b = batch * 4                         # bench_e2e's --batch-scale 4, as its G runs
                an = prepare(tf1_graph(model, b, width=width, depth=depth), topo, batch_size=b, profile=profile,
                             name=label)
                sim, dp = an.simulator(), an.builtin("dp_allreduce")
                chosen = choose_bucket_bytes(sim, dp, b)
                programs = {"single": an.builtin("single"), "dp_default": dp}
                if chosen is not None:
                    programs["dp_chosen"] = chosen.strategy
                predicted = {k: float(sim.evaluate(s).step_time) for k, s in programs.items()}
                cases = {k: (an.rewrite(s), predicted[k]) for k, s in programs.items()}
                measured = [measure_interleaved(tb, cases, seconds) for _ in range(rounds)]
                med = {k: sorted(m[k] for m in measured)[len(measured) // 2] for k in programs}
                row = {"case": label, "batch": b, "bucket_bytes": None if chosen is None else
                       chosen.strategy.bucket_bytes, "predicted_s": predicted,
                       "measured_s": [{k: float(v) for k, v in m.items()} for m in measured],
                       "dp_speedup": float(med["dp_default"] / med["dp_chosen"]) if chosen is not None else None,
                       "load": list(os.getloadavg())}
                rows.append(row)
                for k in programs:
                    print(f"G {label:18s} {b:4d} {k:11s} ({mib(programs[k].bucket_bytes):>8s})  predicted "
                          f"{predicted[k] * 1e3:7.1f} ms  measured "
                          + " / ".join(f"{m[k] * 1e3:7.1f}" for m in measured) + " ms", flush=True)
                print(f"  dp chosen over default, measured: x{row['dp_speedup'] or 1.0:.2f}  "
                      f"(load {row['load'][0]:.1f})", flush=True)
        finally:
            tb.stop_workers()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--testbed", action="store_true", help="also measure on the testbed's configuration G")
    p.add_argument("--profile", help="a saved testbed calibration (needed with --testbed)")
    p.add_argument("--cases", default="transformer,cnn", help="bench_e2e cases to measure (with --testbed)")
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per program and round")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved measurements per case")
    p.add_argument("--no-predicted", action="store_true", help="skip the ready topologies")
    p.add_argument("--json", help="write the rows and figures here")
    args = p.parse_args(argv)
    if args.testbed and not args.profile:
        print("bench_buckets: --testbed needs --profile (a saved testbed calibration)", file=sys.stderr)
        return 2
    this_run = Run(__file__, argv)
    out: dict = {}
    if not args.no_predicted:
        rows = predicted_rows(PREDICTED_CASES)
        out.update(predicted=rows, geomean_predicted_speedup=geomean([r["speedup"] for r in rows]))
        print(f"predicted dp_allreduce speedup of the chosen size over the default: geomean "
              f"x{out['geomean_predicted_speedup']:.3f}, {sum(r['bucket_bytes'] is not None for r in rows)} of "
              f"{len(rows)} cases change size", flush=True)
    if args.testbed:
        from tag_bench.testbed import testbed_missing
        if testbed_missing("bench_buckets"):
            return 2
        rows = measured_rows(args.profile, args.cases.split(","), args.seconds, args.rounds)
        speedups = [r["dp_speedup"] for r in rows if r["dp_speedup"]]
        out.update(measured=rows, geomean_measured_dp_speedup=geomean(speedups) if speedups else None)
    write_json(args.json, out, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
