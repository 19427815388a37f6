#!/usr/bin/env python
"""Benchmark the training-graph IR builder (tag.frontend.analyze) on every zoo model.

Prints one row per model: ops and variables in the IR, trainable parameters, forward+backward
FLOPs per example (the per-example FLOPs of the forward and backward ops), the seconds to build the
GraphDef (tag.zoo, reported separately) and the seconds ``analyze`` takes (wall clock, and the CPU
time of this process, which is what to compare on a shared machine).

Usage::

    python scripts/bench_ir.py                 # all zoo models at their default sizes
    python scripts/bench_ir.py --quick         # mlp and resnet50 only
    python scripts/bench_ir.py --json ir.json  # also write the figures as JSON
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

QUICK = ["mlp", "resnet50"]


def bench(name: str, batch_size: int) -> dict:
    from tag import zoo
    from tag.frontend.analyze import analyze

    t0 = time.perf_counter()
    gd = zoo.training_graph(name, batch_size=batch_size, cache=False)
    build_s = time.perf_counter() - t0
    w0, c0 = time.perf_counter(), time.process_time()
    tg = analyze(gd, name=name)
    analyze_s, analyze_cpu_s = time.perf_counter() - w0, time.process_time() - c0
    fwd_bwd = sum(op.flops.per_example for op in tg.ops if op.phase in ("forward", "backward"))
    fwd = sum(op.flops.per_example for op in tg.ops if op.phase == "forward")
    info = zoo.model_info(name)
    return {
        "model": name,
        "batch_size": tg.batch_size,
        "graph_nodes": len(gd.node),
        "ops": len(tg.ops),
        "variables": len(tg.variables),
        "trainable_variables": sum(v.kind == "trainable" for v in tg.variables),
        "parameters": tg.num_parameters,
        "published_parameters": info.get("published_parameters"),
        "fwd_bwd_flops_per_example": fwd_bwd,
        "fwd_flops_per_example": fwd,
        "build_graph_seconds": round(build_s, 3),
        "analyze_seconds": round(analyze_s, 3),
        "analyze_cpu_seconds": round(analyze_cpu_s, 3),
        "unknown_op_types": tg.unknown_op_types,
        "unknown_shape_tensors": tg.unknown_shape_tensors,
    }


def _warm_up() -> None:
    """Load TensorFlow and run analyze once on a tiny graph, so one-time import costs stay out."""
    from tag import zoo
    from tag.frontend.analyze import analyze

    analyze(zoo.training_graph("mlp", batch_size=2, hidden=(8,), cache=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    ap.add_argument("--batch-size", type=int, default=32, help="global batch of the graphs (default 32)")
    ap.add_argument("--models", nargs="*", help="zoo models to run (default: all)")
    args = ap.parse_args(argv)

    from tag import zoo

    models = args.models or (QUICK if args.quick else zoo.names())
    _warm_up()
    rows = []
    header = (f"{'model':<13} {'ops':>6} {'vars':>5} {'parameters':>12} {'published':>10} "
              f"{'fwd+bwd GFLOP/ex':>16} {'build s':>8} {'analyze s':>9} {'(cpu s)':>8}")
    print(header)
    print("-" * len(header))
    for name in models:
        r = bench(name, args.batch_size)
        rows.append(r)
        pub = r["published_parameters"]
        print(f"{r['model']:<13} {r['ops']:>6} {r['variables']:>5} {r['parameters']:>12,} "
              f"{(f'{pub / 1e6:.1f}M' if pub else '-'):>10} {r['fwd_bwd_flops_per_example'] / 1e9:>16.3f} "
              f"{r['build_graph_seconds']:>8.1f} {r['analyze_seconds']:>9.2f} {r['analyze_cpu_seconds']:>8.2f}",
              flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nbatch {args.batch_size}; {os.cpu_count()} CPUs, load average {load[0]:.1f}" if load else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch_size": args.batch_size, "cpus": os.cpu_count(), "load_average": load,
                       "python": platform.python_version(), "models": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
