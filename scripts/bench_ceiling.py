"""The testbed's ceiling: how much faster than one host any plan could be, with communication free.

bench_e2e and bench_pipeline compare plans on configuration G against one host. What bounds them is the
hosts' compute: each host trains its own copy of the model on its speed-proportional share of the global batch
(half on the full core, a quarter on each half core), all hosts at once, and no tensor crosses a link, so the
step is the slowest host's. ``one host's step / that step`` is the most any plan can gain on this testbed for
that case; communication, bubbles and the runtime's own work only take from it. The hosts share one machine's
cores, caches and memory bandwidth, so the shares are also timed one at a time (``ceiling_alone``): the gap
between the two is what running together costs.

Each case runs ROUNDS rounds of: the whole batch on h0; each share alone on its host; the three shares at
once (one thread per host, every wait bounded). Medians over the rounds' timed steps; the load average per row.
Needs root (namespaces, cgroup v1 cpu) and a saved testbed calibration with the G quotas' device types.

Usage::

    python scripts/bench_ceiling.py --profile P --json F                 # bench_e2e's G cases, batch scale 4
    python scripts/bench_ceiling.py --profile P --cases vgg,cnn --rounds 3
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag.api import prepare  # noqa: E402
from tag.backend.runtime import run_steps  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag.strategy.baselines import on_one_device  # noqa: E402
from tag.strategy.types import batch_shares  # noqa: E402
from tag_bench.cases import E2E_CASES, GPU_CONFIG, GPU_QUOTAS, config_recipe, load_recipe, testbed_topology  # noqa: E402
from tag_bench.machine import load_text  # noqa: E402
from tag_bench.mwms import tf1_graph  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.stats import geomean  # noqa: E402
from tag_bench.testbed import Testbed, testbed_missing  # noqa: E402

WARMUP = 3
JOIN_TIMEOUT_S = 900.0     # a share that has not finished by then is a failed case, never a hang


def one_host_program(topo, profile, model: str, batch: int, width, depth, host: int):
    """(rewritten graph, predicted step) of MODEL at BATCH run whole on HOST's first device."""
    an = prepare(tf1_graph(model, batch, width=width, depth=depth), topo, batch_size=batch, profile=profile)
    group = next(g for g in topo.groups if g.host == topo.hosts[host].name)
    strategy = on_one_device(an.grouping, topo, len(an.graph.ops), group.devices[0], name=f"h{host}")
    return an.rewrite(strategy), an.simulator().evaluate(strategy).step_time


def timed_steps(tb, program, steps: int) -> list[float]:
    res = run_steps(program.graph_def, tb.target, train_op=program.train_op, loss=program.loss, init=program.init,
                    steps=steps + WARMUP, warmup=WARMUP, synthetic=True)
    return list(res.step_times[WARMUP:])


def concurrently(tb, programs, steps: int) -> list[list[float]]:
    """Every program of PROGRAMS (one per host) run at once; each one's timed steps."""
    out: list = [None] * len(programs)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = timed_steps(tb, programs[i], steps)
        except Exception as err:  # noqa: BLE001 - reported below, in the main thread
            errors.append(err)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(programs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"a host's share did not finish within {JOIN_TIMEOUT_S:.0f} s")
    if errors:
        raise errors[0]
    return out


def measure_case(tb, topo, profile, case, rounds: int, steps: int) -> dict:
    label, model, batch, width, depth = case
    shares = batch_shares(GPU_QUOTAS, batch)     # in proportion to the hosts' speeds, as data parallelism splits it
    whole, predicted_whole = one_host_program(topo, profile, model, batch, width, depth, 0)
    parts = [one_host_program(topo, profile, model, b, width, depth, i) for i, b in enumerate(shares)]
    alone: list[float] = []
    share_alone: list[list[float]] = [[] for _ in parts]
    together: list[list[float]] = [[] for _ in parts]
    for _ in range(rounds):
        alone += timed_steps(tb, whole, steps)
        for i, (program, _) in enumerate(parts):
            share_alone[i] += timed_steps(tb, program, steps)
        for i, got in enumerate(concurrently(tb, [p for p, _ in parts], steps)):
            together[i] += got
    one = float(np.median(alone))
    at_once = [float(np.median(t)) for t in together]
    one_at_a_time = [float(np.median(t)) for t in share_alone]
    row = {"case": label, "model": model, "batch": batch, "width": width, "depth": depth, "shares": shares,
           "one_host_s": one, "one_host_predicted_s": predicted_whole, "share_alone_s": one_at_a_time,
           "share_together_s": at_once, "share_predicted_s": [p for _, p in parts],
           "ceiling": one / max(at_once), "ceiling_alone": one / max(one_at_a_time),
           "steps": steps * rounds, "load": list(os.getloadavg())}
    print(f"{label:<17} {batch:>4}  one host {one * 1e3:7.1f} ms (predicted {predicted_whole * 1e3:7.1f})  shares "
          f"{'/'.join(map(str, shares))}: together {'/'.join(f'{t * 1e3:.0f}' for t in at_once)} ms, one at a time "
          f"{'/'.join(f'{t * 1e3:.0f}' for t in one_at_a_time)} ms  ceiling {row['ceiling']:.2f}x "
          f"(one at a time {row['ceiling_alone']:.2f}x)  load {row['load'][0]:.1f}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="a saved testbed calibration (Profile JSON)")
    p.add_argument("--cases", default="vgg,deep-transformer,transformer,cnn,deep-mlp",
                   help="comma-separated subset of bench_e2e's cases")
    p.add_argument("--batch-scale", type=int, default=4, help="as bench_e2e's (its G runs use 4)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per program and round")
    p.add_argument("--gpu-gbps", type=float, default=25.0, help="as bench_e2e's (G's links; nothing crosses them)")
    p.add_argument("--json", help="write the rows and summary here")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    known = {c[0]: c for c in E2E_CASES}
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in known]:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.batch_scale < 1 or args.rounds < 1 or args.steps < 1:
        p.error("--batch-scale, --rounds and --steps must be positive")
    if testbed_missing("bench_ceiling"):
        return 2
    profile = Profile.load(args.profile)
    recipe = config_recipe(load_recipe(), profile, args.gpu_gbps)
    _, topo = testbed_topology(recipe, GPU_CONFIG, profile)
    t0, rows = time.time(), []
    print(f"commit {this_run.commit}; load {load_text()}", flush=True)
    with Testbed(topo, cpu_quota=GPU_QUOTAS) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            for n in names:
                label, model, batch, width, depth = known[n]
                rows.append(measure_case(tb, topo, profile, (label, model, batch * args.batch_scale, width, depth),
                                         args.rounds, args.steps))
                write_json(args.json, {"rows": rows, "complete": False}, this_run)
        finally:
            tb.stop_workers()
    result = {"ceiling_geomean": geomean([r["ceiling"] for r in rows]), "ceiling_min": min(r["ceiling"] for r in rows),
              "ceiling_alone_geomean": geomean([r["ceiling_alone"] for r in rows]), "quotas": GPU_QUOTAS,
              "rows": rows, "complete": True, "seconds": time.time() - t0}
    print(f"ceiling over one host: geomean {result['ceiling_geomean']:.2f}x, lowest {result['ceiling_min']:.2f}x "
          f"(shares one at a time: geomean {result['ceiling_alone_geomean']:.2f}x)", flush=True)
    write_json(args.json, result, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
