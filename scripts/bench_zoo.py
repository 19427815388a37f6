"""Build every zoo model's training graph and print build time, size and parameter counts.

Usage::

    python scripts/bench_zoo.py                       # all models at default sizes, batch 32
    python scripts/bench_zoo.py --quick               # small sizes (seconds), a CI-sized check
    python scripts/bench_zoo.py --models resnet50 bert_base --json zoo.json

Parameters are counted from the GraphDef itself: the variables that optimizer apply ops update.
JSON keys per model: model, build_seconds, nodes, variables, parameters, published_parameters,
parameter_error_pct (null at --quick sizes), graph_def_bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag import zoo  # noqa: E402
from tag_bench.exactness import trained_variables  # noqa: E402
from tag_bench.machine import load_text  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402

QUICK = {
    "mlp": dict(hidden=(256, 256)),
    "vgg19": dict(image_size=32, num_classes=10),
    "resnet50": dict(image_size=32, num_classes=10),
    "transformer": dict(num_layers=1, seq_len=16, vocab_size=1000),
    "bert_base": dict(num_layers=2, seq_len=16, vocab_size=1000),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None, help="models to build (default: all)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="small sizes of a few models")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)
    models = args.models or (list(QUICK) if args.quick else zoo.names())
    rows = []
    print(f"{'model':14s} {'build s':>8s} {'nodes':>7s} {'vars':>5s} {'parameters':>13s} {'published':>13s} "
          f"{'diff %':>7s} {'GraphDef MB':>11s}")
    for name in models:
        options = QUICK.get(name, {}) if args.quick else {}
        start = time.perf_counter()
        gd = zoo.training_graph(name, batch_size=args.batch_size, cache=False, **options)
        seconds = time.perf_counter() - start
        trained = trained_variables(gd)
        nvars, params = len(trained), sum(trained.values())
        published = zoo.model_info(name)["published_parameters"]
        row = dict(model=name, build_seconds=round(seconds, 3), nodes=len(gd.node), variables=nvars,
                   parameters=params, published_parameters=published,
                   # Published counts are for the default sizes only.
                   parameter_error_pct=None if options else round(100.0 * (params - published) / published, 2),
                   graph_def_bytes=gd.ByteSize(), options=options)
        rows.append(row)
        print(f"{name:14s} {seconds:8.2f} {len(gd.node):7d} {nvars:5d} {params:13,d} {published:13,d} "
              f"{'-' if options else format(row['parameter_error_pct'], '7.2f'):>7s} {gd.ByteSize() / 1e6:11.2f}",
              flush=True)
    print(f"load {load_text()}")
    write_json(args.json, {"batch_size": args.batch_size, "quick": args.quick, "models": rows}, this_run, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
