"""How many strategies per second the step simulator scores (ResNet-50 and BERT-base, ~100 op groups).

The search calls ``Simulator.evaluate`` thousands of times, so this is its speed budget. Per model it
builds the training graph, groups it into about 100 op groups and times ``evaluate`` on:

- the four built-in strategies (dp_allreduce, ps, single, partition), each on its own;
- a search-like mix: data parallelism with 1-10 op groups changed to a random action (all-reduce or
  parameter server on a random set of device groups, or one device group's first device holding the
  whole op group), the kind of strategies a tree search scores one after another.

The same mix is also timed *screened*, as the search's refinement scores candidates: each one is first
checked by the step-time lower bound of ``tag.sim.bound`` against the best step time so far (starting
from the best built-in), and only the survivors are simulated (``screened_evaluations_per_second``, with
the fraction the bound rejected).

Per model it also reports how much of the schedule an exact incremental simulation could take over from
data parallelism's (``reusable_prefix``: the tasks before the first one an edited op group can affect) and,
with ``--profile``, where ``evaluate``'s CPU time goes on the search-like mix (``profile``: CPU-time
samples per ``tag.sim`` function, unaffected by other processes on the machine).

The simulator runs its compiled kernel (``tag.sim.kernel``) unless ``TAG_SIM_KERNEL=python`` selects the
Python reference; the first evaluation, timed apart (``first_evaluation_s``), compiles the kernel or loads
it from numba's on-disk cache, outside every timed loop.

The reported figure (``evaluations_per_second``) is the wall-clock rate on the search-like mix in the
fastest of repeated passes (as ``timeit`` reports; the mean over all passes is recorded too). The
objects built before timing (TensorFlow graphs, the IR) are moved out of the garbage collector's way
with ``gc.freeze()``, as a long-running search should do too; the machine's load average is printed
beside each figure (at the end of its timing), since other processes on a small machine slow every
figure down.

Usage::

    python scripts/bench_simulator.py [--quick] [--profile] [--json FILE] [--topo topologies/lab-v100-1080ti.pbtxt]
    TAG_SIM_KERNEL=python python scripts/bench_simulator.py ...     # the Python reference simulator
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag_bench.machine import load1  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

MODELS = {
    "resnet50": {"batch_size": 64},
    "bert_base": {"batch_size": 32},
}


def search_like(graph, topo, grouping, dp, n: int, seed: int = 0):
    """N strategies: dp_allreduce with 1-10 op groups given a random action."""
    from tag.strategy.types import Action, Strategy

    rng = random.Random(seed)
    ng = len(topo.groups)
    out = []
    for _ in range(n):
        acts = list(dp.actions)
        partition = {}
        for _ in range(rng.randint(1, 10)):
            g = rng.randrange(grouping.num_groups)
            placement = tuple(sorted(rng.sample(range(ng), rng.randint(1, ng))))
            devs = [d for p in placement for d in topo.groups[p].devices]
            u = rng.random()
            if u < 0.6:
                acts[g] = Action(placement, "allreduce")
            elif u < 0.9:
                acts[g] = Action(placement, "ps", ps_device=rng.choice(devs))
            else:
                acts[g] = Action(placement[:1], "partition")
                for i in grouping.members(g).tolist():
                    partition[i] = topo.groups[placement[0]].devices[0]
        for g, a in enumerate(acts):      # a later draw may have replaced a partition action
            if a.mode != "partition":
                for i in grouping.members(g).tolist():
                    partition.pop(i, None)
        out.append(Strategy(grouping, acts, partition=partition, name="search-like"))
    return out


def rate(sim, strategies, seconds: float) -> dict:
    """Evaluations per second over repeated passes through STRATEGIES for about SECONDS.

    ``best``: the fastest pass, wall clock (like ``timeit``: other processes on the machine only ever add
    time); ``mean``: all passes, wall clock; ``cpu``: the fastest pass in this process's CPU time.
    """
    for s in strategies:            # warm the caches once, as a search does within its first playouts
        sim.evaluate(s)
    walls, cpus = [], []
    start = time.perf_counter()
    while not walls or time.perf_counter() - start < seconds:
        w0, c0 = time.perf_counter(), time.process_time()
        for s in strategies:
            sim.evaluate(s)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    n = len(strategies)
    return {"best": n / min(walls), "mean": n * len(walls) / sum(walls), "cpu": n / max(min(cpus), 1e-9),
            "load": load1()}


def screened_rate(sim, strategies, incumbent: float, seconds: float) -> dict:
    """Candidates per second when each is first screened by the step-time lower bound (``tag.sim.bound``)
    against the best step time seen so far (starting at INCUMBENT, the best built-in), as the search's
    refinement does, and only the survivors are simulated. Each pass screens the same strategies from
    the same incumbent; ``rejected`` is the fraction the bound settled without a simulator run; ``cpu``
    the fastest pass in this process's CPU time."""
    from tag.sim.bound import StepBound

    bound = StepBound(sim)

    def one_pass() -> int:
        best, rejected = incumbent, 0
        for s in strategies:
            if bound.lower_bound(s, threshold=best) >= best:
                rejected += 1
                continue
            r = sim.evaluate(s)
            if r.feasible and r.step_time < best:
                best = r.step_time
        return rejected

    one_pass()                      # warm the caches once, as above
    walls, cpus, rejected = [], [], 0
    start = time.perf_counter()
    while not walls or time.perf_counter() - start < seconds:
        w0, c0 = time.perf_counter(), time.process_time()
        rejected = one_pass()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    n = len(strategies)
    return {"best": n / min(walls), "mean": n * len(walls) / sum(walls), "cpu": n / max(min(cpus), 1e-9),
            "rejected": rejected / n, "load": load1()}


def reusable_prefix(sim, dp, strategies) -> dict:
    """How much of the list schedule an exact incremental simulation could take over from DP's: per
    strategy, the fraction of tasks (in schedule order) before the first one an edited op group can
    affect -- its own first task, the first producer of data into any of its tasks, the task after
    which its collective starts -- and the same with 0 where the edit changes the lanes (a
    parameter-server or partition device gets a lane of its own, so every task's layout changes).
    ``single_group``: the mean over op groups of the fraction when that one group alone is edited."""
    import numpy as np

    tasks = sim.tasks
    T = max(tasks.num_tasks, 1)
    earliest = list(range(tasks.num_tasks))          # task -> first producer of data into it (or itself)
    for src, dst in zip(tasks.bundle_src, tasks.bundle_dst, strict=True):
        earliest[dst] = min(earliest[dst], src)
    first = []                                       # op group -> first task an edit of it can affect
    for g in range(sim.num_groups):
        anchors = [earliest[t] for t in tasks.tasks_of_group[g]]
        if tasks.coll_after[g] >= 0:
            anchors.append(tasks.coll_after[g])
        first.append(min(anchors, default=T))
    ignoring_lanes, same_lanes = [], []
    for s in strategies:
        edited = [g for g, (a, b) in enumerate(zip(s.actions, dp.actions, strict=True)) if a != b]
        p = min((first[g] for g in edited), default=T) / T
        ignoring_lanes.append(p)
        same_lanes.append(0.0 if any(s.actions[g].mode != "allreduce" for g in edited) else p)
    return {"search_like": float(np.mean(ignoring_lanes)), "search_like_same_lanes": float(np.mean(same_lanes)),
            "single_group": float(np.mean(first) / T)}


def profile(sim, strategies, seconds: float) -> dict:
    """Where the CPU time of ``evaluate`` goes on STRATEGIES: the share of CPU-time samples (SIGPROF every
    0.5 ms of this process's CPU time, so other processes on the machine do not skew it) in which each
    function of ``tag.sim`` was on the stack, largest first."""
    import collections
    import signal

    on_stack: collections.Counter = collections.Counter()
    samples = [0]

    def sample(signum, frame):
        samples[0] += 1
        seen = set()
        while frame is not None:
            code = frame.f_code
            if "/tag/sim/" in code.co_filename.replace(os.sep, "/"):
                key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                if key not in seen:
                    seen.add(key)
                    on_stack[key] += 1
            frame = frame.f_back

    old = signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, 0.0005, 0.0005)
    try:
        start = time.process_time()
        while time.process_time() - start < seconds:
            for s in strategies:
                sim.evaluate(s)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, old)
    n = max(samples[0], 1)
    return {"samples": samples[0], "share": {k: v / n for k, v in on_stack.most_common(25)}}


def bench_model(name: str, topo, seconds: float, groups: int, with_profile: bool = False) -> dict:
    import tag
    from tag.sim.simulator import Simulator
    from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
    from tag.strategy.grouping import group_ops

    t0 = time.perf_counter()
    gd = tag.zoo.training_graph(name, **MODELS[name])
    t1 = time.perf_counter()
    graph = tag.analyze(gd)
    t2 = time.perf_counter()
    grouping = group_ops(graph, target_groups=groups)
    t3 = time.perf_counter()
    sim = Simulator(graph, topo, grouping)
    t4 = time.perf_counter()
    del gd
    gc.collect()
    gc.freeze()
    builtins = {n: builtin_strategy(n, graph, topo, grouping, sim.cost) for n in BUILTIN_STRATEGIES}
    t5 = time.perf_counter()
    sim.evaluate(builtins["dp_allreduce"])
    t6 = time.perf_counter()
    row = {"ops": len(graph.ops), "groups": grouping.num_groups, "tasks": sim.num_tasks,
           "batch_size": graph.batch_size, "build_graph_s": t1 - t0, "analyze_s": t2 - t1,
           "group_s": t3 - t2, "simulator_init_s": t4 - t3, "kernel": sim.kernel,
           "first_evaluation_s": t6 - t5, "builtin": {}}
    for n, s in builtins.items():
        r = sim.evaluate(s)
        rt = rate(sim, [s] * 10, seconds / 8)
        row["builtin"][n] = {"step_time_s": r.step_time, "feasible": r.feasible,
                             "evaluations_per_second": rt["best"], "mean_evaluations_per_second": rt["mean"],
                             "evaluations_per_cpu_second": rt["cpu"], "load_average": rt["load"]}
    mix = search_like(graph, topo, grouping, builtins["dp_allreduce"], 50)
    rt = rate(sim, mix, seconds)
    row["search_like"] = {"strategies": len(mix), "evaluations_per_second": rt["best"],
                          "mean_evaluations_per_second": rt["mean"], "evaluations_per_cpu_second": rt["cpu"],
                          "load_average": rt["load"]}
    row["evaluations_per_second"] = rt["best"]
    feasible = [r["step_time_s"] for r in row["builtin"].values() if r["feasible"]]
    incumbent = min(feasible) if feasible else float("inf")
    sc = screened_rate(sim, mix, incumbent, seconds)
    row["search_like_screened"] = {"strategies": len(mix), "incumbent_s": incumbent,
                                   "evaluations_per_second": sc["best"], "mean_evaluations_per_second": sc["mean"],
                                   "evaluations_per_cpu_second": sc["cpu"], "rejected_fraction": sc["rejected"],
                                   "load_average": sc["load"]}
    row["screened_evaluations_per_second"] = sc["best"]
    row["reusable_prefix"] = reusable_prefix(sim, builtins["dp_allreduce"], mix)
    if with_profile:
        row["profile"] = profile(sim, mix, seconds)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="time each case briefly (CI-sized run)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--topo", default=os.path.join(os.path.dirname(__file__), "..", "topologies",
                                                   "lab-v100-1080ti.pbtxt"))
    ap.add_argument("--groups", type=int, default=100, help="target number of op groups (default 100)")
    ap.add_argument("--seconds", type=float, default=None, help="timing budget per model (default 6, quick 1.5)")
    ap.add_argument("--profile", action="store_true",
                    help="also sample where evaluate's CPU time goes on the search-like mix (per tag.sim function)")
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)
    import tag

    topo = tag.load_topology(args.topo)
    seconds = args.seconds if args.seconds is not None else (1.5 if args.quick else 6.0)
    results = {}
    for name in MODELS:
        results[name] = bench_model(name, topo, seconds, args.groups, args.profile)
        print(f"  {name}: done", file=sys.stderr)

    first = results["resnet50"]
    print(f"Simulator speed on {topo.name} ({topo.num_devices} devices, {len(topo.groups)} device groups), "
          f"{os.cpu_count()} CPUs, load average {load1():.1f}; simulator kernel: {first['kernel']} "
          f"(TAG_SIM_KERNEL=python: the reference); first evaluation {first['first_evaluation_s']:.2f} s "
          "(compiling the kernel, or loading it from numba's cache)")
    print("evaluations per second (fastest pass, wall clock; search-like also: mean over passes, CPU time)")
    hdr = f"{'model':<10} {'ops':>6} {'groups':>6} {'tasks':>6} {'init s':>7} " + \
          " ".join(f"{n:>13}" for n in results["resnet50"]["builtin"]) + \
          f" {'search-like':>12} {'(mean)':>9} {'(CPU)':>9} {'load':>5} {'screened':>10} {'(mean)':>9} {'(CPU)':>9}" \
          f" {'rejected':>8} {'load':>5}"
    print(hdr)
    for name, r in results.items():
        sl, sc = r["search_like"], r["search_like_screened"]
        cells = " ".join(f"{b['evaluations_per_second']:>11.0f}/s" for b in r["builtin"].values())
        print(f"{name:<10} {r['ops']:>6} {r['groups']:>6} {r['tasks']:>6} {r['simulator_init_s']:>7.2f} {cells} "
              f"{sl['evaluations_per_second']:>10.0f}/s {sl['mean_evaluations_per_second']:>7.0f}/s "
              f"{sl['evaluations_per_cpu_second']:>7.0f}/s {sl['load_average']:>5.1f} "
              f"{sc['evaluations_per_second']:>8.0f}/s "
              f"{sc['mean_evaluations_per_second']:>7.0f}/s {sc['evaluations_per_cpu_second']:>7.0f}/s "
              f"{sc['rejected_fraction'] * 100:>7.0f}% {sc['load_average']:>5.1f}")
    print("screened: each candidate first checked against the best step time so far by the lower bound of "
          "tag.sim.bound; only survivors are simulated")
    print("load: the 1-minute load average at the end of each timing (the machine's other processes slow every "
          "figure down)")
    for name, r in results.items():
        rp = r["reusable_prefix"]
        print(f"{name}: schedule before the first task an edit can affect (what an exact incremental simulation "
              f"could reuse from data parallelism's): {rp['search_like'] * 100:.0f}% on the search-like mix, "
              f"{rp['search_like_same_lanes'] * 100:.0f}% counting only edits that keep the lanes, "
              f"{rp['single_group'] * 100:.0f}% for one op group edited")
        if "profile" in r:
            share = r["profile"]["share"]
            print(f"{name}: CPU time of evaluate on the search-like mix ({r['profile']['samples']} samples; "
                  "share of samples with the function on the stack): " +
                  ", ".join(f"{k} {v * 100:.0f}%" for k, v in list(share.items())[:14]))
    print("predicted step times (ms): " + "; ".join(
        f"{name}: " + ", ".join(f"{n} {b['step_time_s'] * 1e3:.1f}" for n, b in r["builtin"].items())
        for name, r in results.items()))
    write_json(args.json, {"evaluations_per_second": {n: r["evaluations_per_second"] for n, r in results.items()},
                           "screened_evaluations_per_second": {n: r["screened_evaluations_per_second"]
                                                               for n, r in results.items()},
                           "topology": topo.name, "cpus": os.cpu_count(), "load_average": load1(),
                           "kernel": first["kernel"], "models": results}, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
