"""Predicted against published training throughput, with no user profile (tag's shipped GPU defaults).

Every row of ``data/published_throughput.csv`` names a model, a GPU system, a GPU count, a per-GPU batch
(and a sequence length for BERT) and the throughput its source published. The prediction is the
data-parallel throughput tag's simulator gives without any profile: global batch / simulated step time of
the built-in ``dp_allreduce`` strategy on a topology of N such GPUs in one host (built with
``tag.parse_topology`` from the system's spec sheet in ``tag_bench.published.SYSTEMS``), op groups from
``group_ops(graph, 64)`` as ``tag-deploy`` uses by default. The error is predicted / published - 1; the
medians and the maximum are reported for the fit rows (those ``scripts/fit_gpu_defaults.py`` fitted the
shipped profiles on) and the validation rows separately, for FP32 rows and for mixed-precision / TF32
rows (``*_mixed`` keys). A row's ``precision`` says how it is costed: ``fp32`` as built; ``tf32`` the
same graph with ``CostModel(tf32=True)``; ``mixed`` the graph after ``tag.frontend.precision``'s
``mixed_float16`` rewrite (TensorFlow's automatic mixed-precision pass), so its MatMuls and convolutions
are half precision in the IR. ``xla`` rows are costed with ``CostModel(xla=True)``; rows whose source
all-reduced float16 gradients (``grad_dtype`` fp16: tf_cnn_benchmarks with ``--use_fp16``, NVIDIA's BERT with
Horovod's fp16 compression) with ``CostModel(gradient_dtype="fp16")``. For every 8-GPU
validation row with a 1-GPU row of the same configuration, the predicted 1->8 scaling is compared with
the published one (``scaling``, ``max_abs_scaling_error_8gpu_validation``).

One IR is built per model (10-60 s each; the simulator takes the batch); ``--cache DIR`` keeps them as
plain JSON between runs (``tag.ir.serialize``; never pickles). ``vgg16`` is not a zoo model:
``tag_bench.published`` builds it with ``tf_keras.applications.VGG16`` under the zoo's conventions (placeholders,
mean cross-entropy, Momentum 0.9). ResNet-50 is built there too, as the sources' code builds it: no bias on
the convolutions that batch norm follows (Keras' ResNet50, the zoo's, has them), v1 for tf_cnn_benchmarks'
``resnet50`` and v1.5 (``resnet50_v1.5``, the stride in the 3x3 convolution) for NVIDIA's.

Usage::

    python scripts/bench_published.py [--json FILE] [--cache DIR] [--quick] [--data data/published_throughput.csv]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag_bench.published import DATA, build_ir, model_key, predict, read_rows  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402


def _config(r: dict[str, Any]) -> tuple:
    return (r["system"], r["model"], r["seq_len"], r["precision"], r["xla"], r["per_gpu_batch"])


def scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """1 -> 8 GPU scaling of every 8-GPU validation row that has a 1-GPU row of the same configuration:
    predicted ratio against the published one."""
    one = {_config(r): r for r in results if r["gpus"] == 1}
    out = []
    for r in results:
        base = one.get(_config(r))
        if r["split"] == "validation" and r["gpus"] == 8 and base is not None:
            pub, pred = r["published"] / base["published"], r["predicted"] / base["predicted"]
            out.append({"id": r["id"], "published": pub, "predicted": pred, "rel_error": pred / pub - 1.0})
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    def errs(split: str, mixed: bool) -> list[float]:
        return [abs(r["rel_error"]) for r in results if r["split"] == split and (r["precision"] != "fp32") == mixed]

    fit, val, fit_m, val_m = errs("fit", False), errs("validation", False), errs("fit", True), errs("validation", True)
    scale = scaling(results)
    return {"rows": results,
            "median_abs_rel_error_fit": statistics.median(fit) if fit else None,
            "max_abs_rel_error_fit": max(fit) if fit else None,
            "median_abs_rel_error_validation": statistics.median(val) if val else None,
            "max_abs_rel_error_validation": max(val) if val else None,
            "validation_rows": len(val), "fit_rows": len(fit),
            "median_abs_rel_error_fit_mixed": statistics.median(fit_m) if fit_m else None,
            "max_abs_rel_error_fit_mixed": max(fit_m) if fit_m else None,
            "median_abs_rel_error_validation_mixed": statistics.median(val_m) if val_m else None,
            "max_abs_rel_error_validation_mixed": max(val_m) if val_m else None,
            "validation_rows_mixed": len(val_m), "fit_rows_mixed": len(fit_m),
            "validation_gpu_types_mixed": sorted({r["gpu"] for r in results
                                                  if r["split"] == "validation" and r["precision"] != "fp32"}),
            "scaling": scale,
            "max_abs_scaling_error_8gpu_validation": max((abs(x["rel_error"]) for x in scale), default=None)}


def run(rows: list[dict[str, Any]], cache: str | None = None, quiet: bool = False) -> list[dict[str, Any]]:
    graphs: dict[str, Any] = {}
    out = []
    for row in rows:
        key = model_key(row)
        if key not in graphs:
            t0 = time.time()
            graphs[key] = build_ir(row, cache)
            if not quiet:
                print(f"  built {key} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        out.append(predict(row, graphs[key]))
    return out


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"{'id':24} {'split':10} {'model':12} {'gpu':15} {'prec':5} {'xla':3} {'n':>2} {'b/gpu':>5} "
             f"{'published':>10} {'predicted':>10} {'error':>7}"]
    for r in summary["rows"]:
        lines.append(f"{r['id']:24} {r['split']:10} {r['model']:12} {r['gpu']:15} {r['precision']:5} "
                     f"{'yes' if r['xla'] else 'no':3} {r['gpus']:>2} "
                     f"{r['per_gpu_batch']:>5} {r['published']:>10.1f} {r['predicted']:>10.1f} "
                     f"{100 * r['rel_error']:>+6.1f}%")
    s = summary
    if s["fit_rows"]:
        lines.append(f"fit rows: {s['fit_rows']}, median |error| {100 * s['median_abs_rel_error_fit']:.1f}%, "
                     f"max {100 * s['max_abs_rel_error_fit']:.1f}%")
    if s["validation_rows"]:
        lines.append(f"validation rows: {s['validation_rows']}, median |error| "
                     f"{100 * s['median_abs_rel_error_validation']:.1f}%, "
                     f"max {100 * s['max_abs_rel_error_validation']:.1f}%")
    if s["fit_rows_mixed"]:
        lines.append(f"mixed/TF32 fit rows: {s['fit_rows_mixed']}, median |error| "
                     f"{100 * s['median_abs_rel_error_fit_mixed']:.1f}%, "
                     f"max {100 * s['max_abs_rel_error_fit_mixed']:.1f}%")
    if s["validation_rows_mixed"]:
        lines.append(f"mixed/TF32 validation rows: {s['validation_rows_mixed']} on "
                     f"{len(s['validation_gpu_types_mixed'])} GPU types, "
                     f"median |error| {100 * s['median_abs_rel_error_validation_mixed']:.1f}%, "
                     f"max {100 * s['max_abs_rel_error_validation_mixed']:.1f}%")
    for x in s["scaling"]:
        lines.append(f"scaling 1->8 {x['id']:24} published {x['published']:.2f}x predicted {x['predicted']:.2f}x "
                     f"({100 * x['rel_error']:+.1f}%)")
    if s["scaling"]:
        lines.append(f"max |scaling error| over {len(s['scaling'])} 8-GPU validation rows: "
                     f"{100 * s['max_abs_scaling_error_8gpu_validation']:.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=DATA, help="the published-throughput CSV")
    p.add_argument("--json", metavar="FILE", help="write the rows and error summary as JSON")
    p.add_argument("--cache", metavar="DIR", help="keep built IRs here (JSON) between runs")
    p.add_argument("--quick", action="store_true", help="ResNet-50 rows on 1 and 8 GPUs only (no BERT IRs)")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    rows = read_rows(args.data)
    if args.quick:
        rows = [r for r in rows if r["model"].startswith("resnet50") and r["gpu_count"] in (1, 8)]
    summary = summarise(run(rows, args.cache))
    print(format_table(summary))
    write_json(args.json, summary, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
