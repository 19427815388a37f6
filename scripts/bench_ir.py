#!/usr/bin/env python
"""Benchmark the training-graph IR builder (tag.frontend.analyze) on every zoo model and on real graphs.

Real graphs (``tag.frontend.real_graphs``): a recommendation model (four 1M x 64 embedding tables, TF1
Adam's sparse updates, ``sigmoid_cross_entropy`` with its folded ``zeros_like``), a GPT-style causal
language model (shifted-token loss), a 2-layer tf_keras LSTM language model (While loops over
TensorLists) and a small sparse classifier per TF1 optimizer; their "published" column is the count of
trainable parameters TensorFlow reports, which the IR's count must equal.

Prints one row per model: ops and variables in the IR, trainable parameters, forward+backward
FLOPs per example (the per-example FLOPs of the forward and backward ops), the seconds to build the
GraphDef (tag.zoo, reported separately) and the seconds ``analyze`` takes (wall clock, and the CPU
time of this process, which is what to compare on a shared machine).

Usage::

    python scripts/bench_ir.py                 # all zoo models at their default sizes
    python scripts/bench_ir.py --quick         # mlp and resnet50 only
    python scripts/bench_ir.py --json ir.json  # also write the figures as JSON
    python scripts/bench_ir.py --real          # only the real graphs
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag_bench.machine import load_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

QUICK = ["mlp", "resnet50"]


def _real_graphs() -> dict:
    """Real-graph rows: name -> builder of the GraphDef at a batch size."""
    from tag.frontend import real_graphs as rg

    rows = {
        "recommender": lambda b: rg.recommender_graph(batch_size=b, tables=4, rows=1_000_000, dim=64, hidden=256),
        "causal_lm": lambda b: rg.causal_lm_graph(batch_size=b, seq_len=128, vocab_size=8000, d_model=256),
        "lstm_lm": lambda b: rg.lstm_lm_graph(batch_size=b, seq_len=32, vocab_size=10000, embed=256, units=512),
    }
    for o in sorted(rg.OPTIMIZERS):
        rows[f"sparse_{o}"] = lambda b, o=o: rg.optimizer_graph(o, sparse=True, resource=True, batch_size=b)
    return rows


def bench(name: str, batch_size: int) -> dict:
    from tag import zoo
    from tag.frontend import real_graphs as rg
    from tag.frontend.analyze import analyze

    real = _real_graphs()
    t0 = time.perf_counter()
    gd = real[name](batch_size) if name in real else zoo.training_graph(name, batch_size=batch_size, cache=False)
    build_s = time.perf_counter() - t0
    w0, c0 = time.perf_counter(), time.process_time()
    tg = analyze(gd, name=name)
    analyze_s, analyze_cpu_s = time.perf_counter() - w0, time.process_time() - c0
    fwd_bwd = sum(op.flops.per_example for op in tg.ops if op.phase in ("forward", "backward"))
    fwd = sum(op.flops.per_example for op in tg.ops if op.phase == "forward")
    published = rg.framework_parameters(gd) if name in real else zoo.model_info(name).get("published_parameters")
    return {
        "model": name,
        "batch_size": tg.batch_size,
        "graph_nodes": len(gd.node),
        "ops": len(tg.ops),
        "variables": len(tg.variables),
        "trainable_variables": sum(v.kind == "trainable" for v in tg.variables),
        "parameters": tg.num_parameters,
        "published_parameters": published,
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
    ap.add_argument("--models", nargs="*", help="zoo models or real graphs to run (default: all)")
    ap.add_argument("--real", action="store_true", help="only the real graphs: " + ", ".join(_real_graphs()))
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)

    from tag import zoo

    models = args.models or (QUICK if args.quick else list(_real_graphs()) if args.real
                             else zoo.names() + list(_real_graphs()))
    _warm_up()
    rows = []
    header = (f"{'model':<13} {'ops':>6} {'vars':>5} {'parameters':>12} {'published':>12} "
              f"{'fwd+bwd GFLOP/ex':>16} {'build s':>8} {'analyze s':>9} {'(cpu s)':>8}")
    print(header)
    print("-" * len(header))
    for name in models:
        r = bench(name, args.batch_size)
        rows.append(r)
        pub = r["published_parameters"]
        print(f"{r['model']:<13} {r['ops']:>6} {r['variables']:>5} {r['parameters']:>12,} "
              f"{(f'{pub:,}' if pub else '-'):>12} {r['fwd_bwd_flops_per_example'] / 1e9:>16.3f} "
              f"{r['build_graph_seconds']:>8.1f} {r['analyze_seconds']:>9.2f} {r['analyze_cpu_seconds']:>8.2f}",
              flush=True)
    print(f"\nbatch {args.batch_size}; {os.cpu_count()} CPUs, load average {load_text()}")
    write_json(args.json, {"batch_size": args.batch_size, "cpus": os.cpu_count(),
                           "python": platform.python_version(), "models": rows}, this_run, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
