"""How long planning takes at cluster scale: tag's search at its default budget, and how its cost grows.

Per case (a zoo model on a ready topology at a global batch) it times what ``tag.optimize`` does after
the IR is built: the search environment (simulator, candidates, built-in strategies) and the search
portfolio (``tag.search.search`` at its default budget: 400 playouts and the refinement that follows),
and records the plan's predicted step time, which step found it, the simulator runs and cache hits, and
simulator runs per second. ``--growth MODEL`` plans MODEL on 8, 64, 512 and 1,024 A100s (the first 1,
8, 64 and 128 hosts of ``topologies/fabric-128x8.pbtxt``, 4 examples per device) to show how the cost
grows with the cluster. The machine's load average is printed beside every time.

Usage::

    python scripts/bench_scale.py --json scale.json                        # the issue-26 target cases
    python scripts/bench_scale.py --cases resnet50:lab-v100-1080ti:64 --json f.json
    python scripts/bench_scale.py --growth bert_large --json growth.json
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tag  # noqa: E402
from tag.search import SearchEnv, search  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag_bench.machine import load1  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

GROUPS = 64          # tag.optimize's default number of op groups
TARGET_CASES = ["resnet50:lab-v100-1080ti:64", "resnet50:lab-v100-1080ti:1024",
                "bert_large:fabric-64x8:2048", "bert_large:fabric-64x8:8192"]
GROWTH_HOSTS = [1, 8, 64, 128]      # x 8 GPUs = 8, 64, 512, 1,024


def fabric_hosts(hosts: int) -> "tag.Topology":
    """The first HOSTS hosts of fabric-128x8 as a topology of their own (same devices and fabric)."""
    with open(os.path.join(ROOT, "topologies", "fabric-128x8.pbtxt")) as f:
        text = f.read()
    blocks = re.split(r"(?m)^(?=host \{)", text)
    head, host_blocks = blocks[0], blocks[1:]
    tail = ""
    last = host_blocks[-1]
    cut = last.find("\nfabric")
    if cut >= 0:
        host_blocks[-1], tail = last[:cut + 1], last[cut + 1:]
    head = re.sub(r'name: "fabric-128x8"', f'name: "fabric-{hosts}x8"', head)
    with tempfile.NamedTemporaryFile("w", suffix=".pbtxt", delete=False) as f:
        f.write(head + "".join(host_blocks[:hosts]) + tail)
        path = f.name
    try:
        return tag.load_topology(path)
    finally:
        os.unlink(path)


def plan_case(graph, grouping, topo, batch: int, playouts: int | None) -> dict:
    """Time the environment and the default search of one case."""
    load0 = load1()
    t0, c0 = time.perf_counter(), time.process_time()
    env = SearchEnv(graph, topo, grouping, batch_size=batch)
    t1 = time.perf_counter()
    found = search(env, playouts=playouts, seed=0, min_gain=0.0, mixed_min_gain=0.0)
    t2, c2 = time.perf_counter(), time.process_time()
    sim_s = env.simulate_seconds
    return {"devices": topo.num_devices, "batch": batch, "env_s": t1 - t0, "search_s": t2 - t1,
            "plan_s": t2 - t0, "plan_cpu_s": c2 - c0, "step_time_s": found.step_time,
            "feasible": found.outcome.feasible, "method": found.method, "evaluations": env.evaluations,
            "screened": getattr(env, "screened", 0), "cache_hits": env.cache_hits,
            "simulate_s": sim_s, "evaluations_per_second": env.evaluations / sim_s if sim_s > 0 else 0.0,
            "load_before": load0, "load_average": load1()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=None, help="MODEL:TOPOLOGY:BATCH (default: the target cases)")
    ap.add_argument("--growth", metavar="MODEL", default=None, help="plan MODEL on 8, 64, 512 and 1,024 GPUs")
    ap.add_argument("--playouts", type=int, default=None, help="tree-search playouts (default: the search's)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)
    cases = args.cases if args.cases is not None else ([] if args.growth else TARGET_CASES)
    graphs: dict[str, tuple] = {}

    def model(name: str):
        if name not in graphs:
            t0 = time.perf_counter()
            gd = tag.zoo.training_graph(name, batch_size=32, cache=False)
            t1 = time.perf_counter()
            tg = tag.analyze(gd)
            t2 = time.perf_counter()
            graphs[name] = (tg, group_ops(tg, target_groups=GROUPS))
            print(f"# {name}: zoo build {t1 - t0:.1f} s, analysis {t2 - t1:.1f} s (load {load1():.1f})", flush=True)
        return graphs[name]

    rows = []
    hdr = (f"{'model':<11} {'topology':<17} {'devices':>7} {'batch':>6} {'env s':>6} {'search s':>8} "
           f"{'plan s':>7} {'CPU s':>6} {'sims':>6} {'screened':>8} {'hits':>6} {'sims/s':>7} {'step ms':>9} "
           f"{'load':>5}  method")
    print(hdr)

    def show(r: dict) -> None:
        print(f"{r['model']:<11} {r['topology']:<17} {r['devices']:>7} {r['batch']:>6} {r['env_s']:>6.1f} "
              f"{r['search_s']:>8.1f} {r['plan_s']:>7.1f} {r['plan_cpu_s']:>6.1f} {r['evaluations']:>6} "
              f"{r['screened']:>8} {r['cache_hits']:>6} "
              f"{r['evaluations_per_second']:>7.0f} {r['step_time_s'] * 1e3:>9.2f} {r['load_average']:>5.1f}  "
              f"{r['method']}{'' if r['feasible'] else ' (OOM)'}", flush=True)

    for case in cases:
        name, topo_name, batch = case.split(":")
        tg, grouping = model(name)
        topo = tag.load_topology(os.path.join(ROOT, "topologies", f"{topo_name}.pbtxt"))
        r = {"model": name, "topology": topo_name, **plan_case(tg, grouping, topo, int(batch), args.playouts)}
        rows.append(r)
        show(r)
    growth = []
    if args.growth:
        tg, grouping = model(args.growth)
        for hosts in GROWTH_HOSTS:
            topo = fabric_hosts(hosts)
            r = {"model": args.growth, "topology": topo.name,
                 **plan_case(tg, grouping, topo, 4 * topo.num_devices, args.playouts)}
            growth.append(r)
            show(r)
    write_json(args.json, {"cases": rows, "growth": growth, "playouts": args.playouts, "cpus": os.cpu_count()},
               this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
