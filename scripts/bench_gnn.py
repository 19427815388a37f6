"""Benchmark the GNN prior: does a short guided tree search find what a long blind one finds?

For every --model x every --topo (both repeatable; default: the validation models inception_v3,
mobilenet_v2 and bert_large, full size, on every ready topology file -- none of which training saw), it
runs the tree search (``tag.search.mcts``, decision order ``auto``, seed 0) three times on fresh
environments sharing one simulator: with the shipped GNN prior at 100 playouts, with the uniform prior at
100 and at 1000 playouts, and prints each one's speedup over ``dp_allreduce`` (predicted step times),
its seconds, simulator runs, and the load average beside the timings.

JSON (``--json``): ``cases``, ``rows`` (one per case), ``guided100_over_uniform1000`` and
``guided100_over_uniform100`` (geometric means over cases of the ratio of speedups). Targets:
guided100_over_uniform1000 >= 0.95 and guided100_over_uniform100 > 1.0.

Usage::

    python scripts/bench_gnn.py --json gnn.json
    python scripts/bench_gnn.py --model zoo:mobilenet_v2,image_size=96 --topo topologies/lab-v100-1080ti.pbtxt
    python scripts/bench_gnn.py --model model.pbtxt --topo my_cluster.pbtxt --per-device 16
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tag  # noqa: E402
from tag.gnn import load_policy  # noqa: E402
from tag.search.env import SearchEnv  # noqa: E402
from tag.search.mcts import mcts, uniform_prior  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from _common import write_json  # noqa: E402

DEFAULT_MODELS = ["zoo:inception_v3", "zoo:mobilenet_v2", "zoo:bert_large"]
GROUPS = 64


def load() -> float:
    return float(os.getloadavg()[0])


def build_ir(spec: str):
    """The IR of a --model SPEC (zoo:NAME[,key=value...] at batch 32, or a GraphDef file)."""
    from tag.frontend.zoo import resolve_model
    name, graph_def = resolve_model(spec, 32 if spec.startswith("zoo:") else None)
    return name, tag.analyze(graph_def, batch_size=32 if spec.startswith("zoo:") else None, name=name)


def run_case(tg, grouping, topo, batch: int, methods: list[tuple[str, object, int]], seed: int) -> dict:
    """One case: each method's speedup over dp_allreduce, seconds and simulator runs."""
    base = SearchEnv(tg, topo, grouping, batch_size=batch)
    dp = base.builtin_results["dp_allreduce"]
    row = {"batch": batch, "groups": grouping.num_groups, "candidates": len(base.candidates),
           "dp_allreduce_step_s": float(dp.step_time), "dp_allreduce_feasible": bool(dp.feasible)}
    for key, prior, playouts in methods:
        env = SearchEnv(tg, topo, grouping, batch_size=batch, simulator=base.simulator)
        t0 = time.perf_counter()
        tree = mcts(env, order="auto", playouts=playouts, seed=seed, prior=prior)
        seconds = time.perf_counter() - t0
        out = tree.outcome
        row[key] = {"speedup": float(dp.step_time / out.step_time) if out.feasible else 0.0,
                    "feasible": bool(out.feasible), "step_s": float(out.step_time), "seconds": round(seconds, 2),
                    "evaluations": int(env.evaluations), "load": round(load(), 2)}
    return row


def geomean_ratio(rows: list[dict], a: str, b: str) -> float | None:
    ratios = [r[a]["speedup"] / r[b]["speedup"] for r in rows if r[a]["speedup"] > 0 and r[b]["speedup"] > 0]
    return float(math.exp(np.mean(np.log(ratios)))) if ratios else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", metavar="SPEC", help="zoo:NAME[,key=value...] or a GraphDef file")
    p.add_argument("--topo", action="append", metavar="FILE", help="a topology file (default: topologies/*.pbtxt)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--per-device", type=int, default=8, help="global batch = this x the topology's devices")
    p.add_argument("--playouts", type=int, default=100, help="playouts of the guided and short blind searches")
    p.add_argument("--long-playouts", type=int, default=1000, help="playouts of the long blind search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", help="policy weights (.npz); default: the shipped ones")
    args = p.parse_args(argv)
    args.model = args.model or DEFAULT_MODELS
    args.topo = args.topo or sorted(glob.glob(os.path.join(ROOT, "topologies", "*.pbtxt")))
    return args


def build_irs(models: list[str]) -> list[tuple]:
    """(spec, name, IR, grouping) per --model."""
    irs = []
    for spec in models:
        t0 = time.perf_counter()
        name, tg = build_ir(spec)
        grouping = group_ops(tg, target_groups=GROUPS)
        irs.append((spec, name, tg, grouping))
        print(f"{name}: IR {len(tg.ops)} ops, {grouping.num_groups} groups ({time.perf_counter() - t0:.0f} s, "
              f"load {load():.2f})", flush=True)
    return irs


def run_bench(args: argparse.Namespace, irs: list[tuple]) -> dict:
    """Every case, topology-major (a run stopped early covers every model); the JSON summary."""
    policy = load_policy(args.weights)
    methods = [("guided100", policy, args.playouts), ("uniform100", uniform_prior, args.playouts),
               ("uniform1000", uniform_prior, args.long_playouts)]
    rows: list[dict] = []

    def summary() -> dict:
        return {"cases": len(rows), "rows": rows,
                "guided100_over_uniform1000": geomean_ratio(rows, "guided100", "uniform1000"),
                "guided100_over_uniform100": geomean_ratio(rows, "guided100", "uniform100"),
                "playouts": {"guided": args.playouts, "uniform_short": args.playouts,
                             "uniform_long": args.long_playouts},
                "load_average_end": load()}

    for path in args.topo:
        topo = tag.load_topology(path)
        batch = args.per_device * topo.num_devices
        for spec, name, tg, grouping in irs:
            row = {"model": spec, "topology": os.path.basename(path), **run_case(tg, grouping, topo, batch, methods,
                                                                                  args.seed)}
            rows.append(row)
            cells = "  ".join(f"{k} {row[k]['speedup']:.3f}x ({row[k]['seconds']:.1f} s, {row[k]['evaluations']} sims)"
                              for k, _, _ in methods)
            print(f"  {name} on {row['topology']} (batch {batch}): {cells}  load {load():.2f}", flush=True)
            if args.json:                        # after every case: a long run stopped early keeps its rows
                write_json(args.json, summary())
    return summary()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"GNN prior vs uniform prior; {len(args.model)} model(s) x {len(args.topo)} topolog(y/ies); "
          f"load average {load():.2f} (2-core machine shared with other work)", flush=True)
    out = run_bench(args, build_irs(args.model))
    g1000, g100 = out["guided100_over_uniform1000"], out["guided100_over_uniform100"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"   # noqa: E731
    print(f"geomean guided100/uniform1000 {fmt(g1000)} (target >= 0.95), guided100/uniform100 {fmt(g100)} "
          f"(target > 1.0) over {out['cases']} case(s); load {load():.2f}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
