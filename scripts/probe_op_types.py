"""Per op type: what a saved profile predicts for one host's step, against what TensorFlow's step stats measure.

Why: on configuration G (issue 22, run 37) one host's step was predicted 19-23% too slow on the VGG-style CNN and
the deep transformer, where the runtime levels add little (their kernels are long). This prints, per op type, the
profile's op times on its fastest device type (the base profile: no runtime levels) beside the kernel times
``tag.cost.calibration.measure_step`` reads from TensorFlow's step stats for the same ops (ops one at a time, no
graph rewrites, as ``tag-profile`` measures them). An op that TensorFlow's oneDNN build fuses into a node of another
name (a Conv2D with its BiasAdd and Relu) has no kernel time of its own and prints "-". Pin the process to one CPU with ``taskset -c N`` to mimic a
one-core host.

Usage::

    taskset -c 1 python scripts/probe_op_types.py --model transformer --batch 96 --width 384 --depth 8
    taskset -c 1 python scripts/probe_op_types.py --model vgg --batch 384 --profile P
    taskset -c 1 python scripts/probe_op_types.py --model transformer --batch 96 --width 384 --depth 8 --detail Einsum --json F
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DEFAULT_PROFILE = "docs/measured/issue22-e2e/e2e_g4_amd.profile.json"


def by_type(graph_def, profile, batch: int, steps: int, warmup: int,
            detail: str | None = None) -> tuple[dict[str, tuple[float, float]], float, list[tuple[str, str, float, float]]]:
    """({op type: (predicted, measured) seconds per step}, the median step with ops one at a time, and the ops of type
    DETAIL as (name, equation or transposes, predicted, measured)): PROFILE's op times on one host of its fastest
    device type beside ``tag.cost.calibration.measure_step``'s kernel times of the same ops."""
    from _testbed_cases import load_recipe, testbed_topology
    from tag.api import prepare
    from tag.calibration import measure_step
    recipe = load_recipe()
    recipe["configs"] = {"one": {"quotas": [1.0, 0.5], "links_gbps": [1.0]}}
    _, topology = testbed_topology(recipe, "one", profile)
    analysis = prepare(graph_def, topology, batch_size=batch, profile=profile, name="probe")
    predicted = analysis.simulator().cost_model.op_times(0, batch)
    measured = measure_step(graph_def, analysis.graph, steps=steps, warmup=warmup)
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    ops = []
    for op, p, m in zip(analysis.graph.ops, predicted, measured.op_times):
        out[op.type][0] += float(p)
        out[op.type][1] += 0.0 if np.isnan(m) else float(m)
        if op.type == detail:
            ops.append((op.name, " ".join(f"{k}={v}" for k, v in sorted(op.attrs.items())), float(p), float(m)))
    return {k: (v[0], v[1]) for k, v in out.items()}, measured.wall_s, ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a tag_bench.mwms model name (mlp, cnn, transformer, vgg)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--width", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"a saved profile (default {DEFAULT_PROFILE})")
    p.add_argument("--steps", type=int, default=3, help="traced steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="op types printed per list")
    p.add_argument("--detail", metavar="TYPE", help="also print every op of this type (its equation or transposes)")
    p.add_argument("--json", help="also write the figures (per op type, and the --detail ops) to this file")
    args = p.parse_args(argv)
    from tag_bench.mwms import tf1_graph
    from tag.cost.model import Profile
    from tag.errors import TagError
    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError, TagError) as err:
        print(f"probe_op_types: --profile {args.profile}: {err}", file=sys.stderr)
        return 2
    graph_def = tf1_graph(args.model, args.batch, width=args.width, depth=args.depth)
    rows, wall, ops = by_type(graph_def, profile, args.batch, args.steps, args.warmup, args.detail)
    print(f"{args.model} at batch {args.batch}: predicted {sum(p for p, _ in rows.values()) * 1e3:.1f} ms "
          f"(no runtime levels), measured {sum(m for _, m in rows.values()) * 1e3:.1f} ms of kernels, "
          f"step {wall * 1e3:.0f} ms with ops one at a time; load {os.getloadavg()[0]:.1f}")
    for op_type, (p, m) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        ratio = f"{p / m:5.2f}x" if m > 0 else "    -"
        print(f"  {op_type:28s} predicted {p * 1e3:9.1f} ms  measured {m * 1e3:9.1f} ms  {ratio}")
    if ops:
        print(f"every {args.detail} op:")
    for name, attrs, p, m in ops:
        ratio = f"{p / m:5.2f}x" if m > 0 else "    -"
        print(f"  {p * 1e3:8.2f} ms predicted {m * 1e3:8.2f} ms measured {ratio}  {attrs:24s} {name}")
    if args.json:
        from _common import git_commit, write_json
        write_json(args.json, {
            "commit": git_commit(), "model": args.model, "batch": args.batch, "width": args.width, "depth": args.depth,
            "profile": args.profile, "load": os.getloadavg()[0], "step_s": wall,
            "predicted_s": sum(p for p, _ in rows.values()), "measured_kernels_s": sum(m for _, m in rows.values()),
            "by_type": {k: {"predicted_s": p, "measured_s": m} for k, (p, m) in rows.items()},
            "ops": [{"name": n, "attrs": a, "predicted_s": p, "measured_s": None if np.isnan(m) else m}   # None: no kernel
                    for n, a, p, m in ops]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
