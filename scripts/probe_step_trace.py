"""Where one step's time goes on each host, measured and simulated: a traced step per plan, side by side.

Issue 20's recurring miss is a plan over two hosts that the simulator puts ahead of another over the same
hosts while it runs behind it (bench_fidelity runs 21-23, A/cnn: the searched mix of parameter-server and
all-reduce groups predicted 44 ms and measured 47-51, all-reduce everywhere predicted 46.6 and measured
36-49). Step times alone cannot say which part of the step the model gets wrong. This runs each plan on the
testbed of a saved fidelity run (its calibration and topology, ``--run PREFIX --config C``), traces one step
after warm-up (TensorFlow's step stats of every worker; the workers share this machine's clock) and prints,
per host: when its first kernel starts and its last ends (ms from the step's first kernel), the kernel time
it ran (ops of all its threads added up), the time its receive ops waited, and its longest waits. The same
figures come from the simulator's recorded schedule of the plan (``Simulator.trace``). Each plan is traced
``--traces`` times (a new session each) and the median of every figure is printed: one step on this shared
machine can be off by 15%.
Also per pair of hosts: the median rate of the traced step's receives of 64 KB or more beside the link's
declared rate, which shows whether the testbed's shaping holds for the tensors a step really sends
(``--gso-max-bytes 65536``: the kernel's offload packets, as the testbed had them before December 4).

Plans: ``single`` (device 0), ``ar2`` / ``ps2`` (every op group all-reduced over / served by a parameter
server on device 0 for devices 0 and 1), the built-ins ``dp_allreduce`` and ``ps`` (all hosts), ``plan``
(what ``search_plan`` returns on that profile with bench_fidelity's budget and seed) and ``random0``-``random2``
(bench_fidelity's random mixes of the group, the same seed). Needs root.

Usage::

    python scripts/probe_step_trace.py --run docs/measured/issue20-fidelity/bench_fidelity_shared_run23 \\
        --config A --model cnn --json F
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

RUN = "docs/measured/issue20-fidelity/bench_fidelity_shared_run23"
PLANS = ("single", "ar2", "ps2", "dp_allreduce", "ps", "plan", "random0", "random1", "random2")
HEAVY_KERNELS = ("Conv2D", "MatMul", "Einsum")    # in a kernel's label: the model's compute, not bookkeeping
RATE_MIN_BYTES = 64_000                          # receives at least this large report their wire rate
_RECV_LABEL = re.compile(r"\[[^]]*\] \[([\d.]+)([KMG]?)b/s\] \S+ from (\S+) to (\S+)")


def task_of(device: str) -> int | None:
    """The worker task index in a TF device name (``/job:worker/replica:0/task:1/device:CPU:0`` -> 1)."""
    for part in device.split("/"):
        if part.startswith("task:"):
            return int(part[len("task:"):])
    return None


def receive_rates(step_stats, min_bytes: int = RATE_MIN_BYTES) -> dict[str, dict]:
    """Per sending -> receiving task ("0->2"): the median rate in Mbit/s of the step's receives of at least
    MIN_BYTES and how many there were. A receive's label carries its rate over the response's time on the
    wire (TensorFlow logs from the sender's start of the response), so bytes = rate x duration."""
    rates: dict[str, list[float]] = {}
    for dev in step_stats.dev_stats:
        for ns in dev.node_stats:
            m = _RECV_LABEL.match(ns.timeline_label)
            if not m:
                continue
            mbits = float(m.group(1)) * {"": 1e-6, "K": 1e-3, "M": 1.0, "G": 1e3}[m.group(2)]
            seconds = max(ns.all_end_rel_micros, ns.op_end_rel_micros, 0) / 1e6
            src, dst = task_of(m.group(3)), task_of(m.group(4))
            if src is None or dst is None or mbits * 1e6 / 8 * seconds < min_bytes:
                continue
            rates.setdefault(f"{src}->{dst}", []).append(mbits)
    return {k: {"median_mbit_s": statistics.median(v), "receives": len(v)} for k, v in sorted(rates.items())}


def measured_hosts(step_stats, top: int = 4) -> dict[int, dict]:
    """Per worker task: first start and last end (ms from the step's first kernel), the start of its first
    convolution, MatMul or Einsum (``first_heavy_ms``), kernel ms (every op's time but receives, added up),
    receive-wait ms and the TOP longest receives (name, start ms, ms) of one traced step."""
    ops = []
    for dev in step_stats.dev_stats:
        task = task_of(dev.device)
        if task is None or "stream" in dev.device or "memcpy" in dev.device:
            continue
        for ns in dev.node_stats:
            if ns.all_start_micros <= 0:
                continue
            start = ns.all_start_micros
            end = start + max(ns.op_end_rel_micros, ns.all_end_rel_micros, 0)
            # a receive's label names the tensor and both ends: "[2560B] [1.3Mb/s] edge_290_... from /job:... to ..."
            is_recv = " from /job:" in ns.timeline_label
            heavy = not is_recv and any(k in ns.timeline_label for k in HEAVY_KERNELS)
            ops.append((task, ns.node_name, start, end, is_recv, heavy))
    if not ops:
        return {}
    t0 = min(o[2] for o in ops)
    hosts: dict[int, dict] = {}
    for task in sorted({o[0] for o in ops}):
        mine = [o for o in ops if o[0] == task]
        recvs = sorted(((n, (s - t0) / 1e3, (e - s) / 1e3) for _, n, s, e, r, _ in mine if r), key=lambda x: -x[2])
        heavy = [o[2] for o in mine if o[5]]
        hosts[task] = {"first_ms": (min(o[2] for o in mine) - t0) / 1e3,
                       "last_ms": (max(o[3] for o in mine) - t0) / 1e3,
                       "first_heavy_ms": (min(heavy) - t0) / 1e3 if heavy else None,
                       "kernel_ms": sum(o[3] - o[2] for o in mine if not o[4]) / 1e3,
                       "recv_wait_ms": sum(r[2] for r in recvs),
                       "recvs": len(recvs),
                       "longest_recvs": [list(r) for r in recvs[:top]]}
    return hosts


def simulated_hosts(trace: dict, topology) -> dict[int, dict]:
    """The same figures per worker task (no receive waits: the simulator has none) from a ``Simulator.trace``."""
    host_of = {d.index: topology.hosts[d.host_index].task_index for d in topology.devices}
    hosts: dict[int, dict] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") != "compute":
            continue
        h = hosts.setdefault(host_of[e["tid"]], {"first_ms": float("inf"), "last_ms": 0.0, "kernel_ms": 0.0})
        h["first_ms"] = min(h["first_ms"], e["ts"] / 1e3)
        h["last_ms"] = max(h["last_ms"], (e["ts"] + e["dur"]) / 1e3)
        h["kernel_ms"] += e["dur"] / 1e3
    return hosts


def median_hosts(traces: list[dict[int, dict]]) -> dict[int, dict]:
    """Figure by figure, the median over TRACES of each host's figures (the longest receives of the first)."""
    out: dict[int, dict] = {}
    for task in sorted({t for tr in traces for t in tr}):
        mine = [tr[task] for tr in traces if task in tr]
        out[task] = {k: statistics.median(m[k] for m in mine) if all(m[k] is not None for m in mine) else None
                     for k in mine[0] if k != "longest_recvs"}
        if "longest_recvs" in mine[0]:
            out[task]["longest_recvs"] = mine[0]["longest_recvs"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=RUN, help="the fidelity run whose saved calibration and topology are used")
    p.add_argument("--config", default="A", help="that run's testbed configuration")
    p.add_argument("--model", default="cnn", help="a bench_fidelity model label")
    p.add_argument("--plans", default=",".join(PLANS), help="comma-separated subset of " + ",".join(PLANS))
    p.add_argument("--traces", type=int, default=3, help="traced steps per plan (a new session each)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per session beside the traced one")
    p.add_argument("--gso-max-bytes", type=int, default=None,
                   help="the testbed's largest offload packet (default: tag_bench.testbed.GSO_MAX_BYTES; "
                        "65536: the kernel's own, as before December 4)")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    from _common import testbed_missing, write_json
    if testbed_missing("probe_step_trace"):
        return 2
    import numpy as np
    from _testbed_cases import calibration_graph, load_recipe, saved_testbed
    from bench_fidelity import MODELS, random_mixes
    from tag.api import prepare, search_plan
    from tag.backend.runtime import run_steps
    from tag.backend.runtime.guard import RunControl
    from tag_bench.testbed import Testbed
    from tag.strategy.types import Action

    models = {label: (s, b) for label, s, b in MODELS}
    if args.model not in models:
        print(f"probe_step_trace: unknown model {args.model!r} (known: {', '.join(models)})", file=sys.stderr)
        return 2
    plans = [x for x in args.plans.split(",") if x]
    unknown = sorted(set(plans) - set(PLANS))
    if unknown:
        print(f"probe_step_trace: unknown plan(s) {', '.join(unknown)} (known: {', '.join(PLANS)})", file=sys.stderr)
        return 2
    spec, batch = models[args.model]
    profile, topo = saved_testbed(args.run, args.config)
    an = prepare(calibration_graph(spec, batch), topo, batch_size=batch, profile=profile, name=args.model)
    base = an.builtin("single")

    def uniform(action, name):
        return dataclasses.replace(base, actions=[action] * len(base.actions), name=name)

    make = {"single": lambda: base, "ar2": lambda: uniform(Action((0, 1), "allreduce"), "ar2"),
            "ps2": lambda: uniform(Action((0, 1), "ps", 0), "ps2"),
            "dp_allreduce": lambda: an.builtin("dp_allreduce"), "ps": lambda: an.builtin("ps"),
            "plan": lambda: search_plan(an, budget_s=10.0, seed=0).strategy}
    if any(k.startswith("random") for k in plans):
        make.update((name, lambda s=s: s) for name, s, _ in random_mixes(an, 3, 0))
    strategies = {k: make[k]() for k in plans}
    sim = an.simulator()
    out: dict = {"run": os.path.basename(args.run), "config": args.config, "model": args.model, "batch": batch,
                 "plans": {}}
    for k, s in strategies.items():
        out["plans"][k] = {"predicted_ms": sim.evaluate(s).step_time * 1e3,
                           "simulated_hosts": simulated_hosts(sim.trace(s), an.topology)}
    rewritten = {k: an.rewrite(s) for k, s in strategies.items()}
    from tag_bench.testbed import GSO_MAX_BYTES
    gso = GSO_MAX_BYTES if args.gso_max_bytes is None else args.gso_max_bytes
    out["gso_max_bytes"] = gso
    with Testbed(an.topology, cpu_quota=load_recipe()["configs"][args.config]["quotas"], gso_max_bytes=gso) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            for rep in range(args.traces):
                for k, rw in (rewritten.items() if rep % 2 == 0 else reversed(list(rewritten.items()))):
                    warmup = 3
                    r = run_steps(rw.graph_def, tb.target, train_op=rw.train_op, loss=rw.loss, init=rw.init,
                                  steps=warmup + args.steps + 1, warmup=warmup, synthetic=True,
                                  control=RunControl(step_timeout_s=120.0, setup_timeout_s=300.0,
                                                     trace_step=warmup + args.steps + 1))
                    entry = out["plans"][k]
                    entry.setdefault("measured_ms", []).append(float(np.median(r.step_times[warmup:-1])) * 1e3)
                    entry.setdefault("traced_ms", []).append(float(r.step_times[-1]) * 1e3)
                    entry.setdefault("traces", []).append(measured_hosts(r.run_metadata.step_stats))
                    entry.setdefault("receive_rates", []).append(receive_rates(r.run_metadata.step_stats))
                    print(f"{k:12s} trace {rep + 1}: step {entry['measured_ms'][-1]:6.1f} ms (traced "
                          f"{entry['traced_ms'][-1]:6.1f}), load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            tb.stop_workers()
    names = {h.task_index: h.name for h in topo.hosts}
    for k, entry in out["plans"].items():
        entry["measured_hosts"] = median_hosts(entry["traces"])
        print(f"\n{k}: predicted {entry['predicted_ms']:.1f} ms, measured {statistics.median(entry['measured_ms']):.1f}"
              f" ms (traced steps {', '.join(f'{x:.1f}' for x in entry['traced_ms'])})")
        for h in sorted(set(entry["measured_hosts"]) | set(entry["simulated_hosts"])):
            m, s = entry["measured_hosts"].get(h), entry["simulated_hosts"].get(h)
            heavy = "-" if not m or m["first_heavy_ms"] is None else f"{m['first_heavy_ms']:.1f}"
            ms = (f"measured {m['first_ms']:6.1f}-{m['last_ms']:6.1f} ms, first conv/matmul at {heavy}, "
                  f"kernels {m['kernel_ms']:6.1f}, "
                  f"recv wait {m['recv_wait_ms']:6.1f} ({m['recvs']:.0f} recvs)") if m else "measured -"
            ss = f"simulated {s['first_ms']:6.1f}-{s['last_ms']:6.1f} ms, kernels {s['kernel_ms']:6.1f}" if s else \
                "simulated -"
            print(f"  {names.get(h, h)}: {ms} | {ss}")
            if m and m.get("longest_recvs"):
                print("      longest recvs: " + "; ".join(f"{n.split('/')[-1][:40]} at {st:.1f} for {d:.1f}"
                                                         for n, st, d in m["longest_recvs"]))
        pairs = sorted({k for r in entry.get("receive_rates", []) for k in r})
        if pairs:
            rates = []
            for k in pairs:
                src, dst = (int(x) for x in k.split("->"))
                got = [r[k]["median_mbit_s"] for r in entry["receive_rates"] if k in r]
                link = float(topo.host_bandwidth[src, dst]) * 8 / 1e6
                rates.append(f"{names.get(src, src)}->{names.get(dst, dst)} {statistics.median(got):.0f} (link {link:.0f})")
            print(f"  receives of {RATE_MIN_BYTES // 1000} KB or more, median Mbit/s: " + "; ".join(rates))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
