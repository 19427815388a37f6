"""Per op type: what a saved profile predicts for one host's step, against what TensorFlow's step stats measure.

Why: on configuration G (issue 22, run 37) one host's step was predicted 19-23% too slow on the VGG-style CNN and
the deep transformer, where the runtime levels add little (their kernels are long). This prints, per op type, the
profile's op times on its fastest device type (the base profile: no runtime levels) beside the time TensorFlow's
step stats give the same graph run with one intra-op and one inter-op thread (pin the process to one CPU with
``taskset -c N`` to mimic a one-core host). TensorFlow's oneDNN build renames fused ops (``_MklNativeFusedConv2D``
holds a Conv2D with its BiasAdd and Relu), so the two lists are printed apart, largest first.

Usage::

    taskset -c 1 python scripts/probe_op_types.py --model transformer --batch 96 --width 384 --depth 8
    taskset -c 1 python scripts/probe_op_types.py --model vgg --batch 384 --profile P
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DEFAULT_PROFILE = "docs/measured/issue22-e2e/e2e_g4_amd.profile.json"


def predicted_by_type(graph_def, profile, batch: int) -> dict[str, float]:
    """{op type: seconds} of one step on one host of PROFILE's fastest device type."""
    from _testbed_cases import load_recipe, testbed_topology
    from tag.api import prepare
    recipe = load_recipe()
    recipe["configs"] = {"one": {"quotas": [1.0, 0.5], "links_gbps": [1.0]}}
    _, topology = testbed_topology(recipe, "one", profile)
    analysis = prepare(graph_def, topology, batch_size=batch, profile=profile, name="probe")
    times = analysis.simulator().cost_model.op_times(0, batch)
    out: dict[str, float] = collections.Counter()
    for op, seconds in zip(analysis.graph.ops, times):
        out[op.type] += float(seconds)
    return dict(out)


def measured_by_type(graph_def, model: str, batch: int, steps: int, warmup: int) -> tuple[dict[str, float], list[float]]:
    """({op type as the step stats label it: seconds per step}, [wall seconds of every step])."""
    import numpy as np
    import tensorflow as tf
    from tag.backend.mwms import input_spec
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    shape, dtype = input_spec(model)
    rng = np.random.default_rng(0)
    x = (rng.random((batch, *shape)).astype(dtype) if dtype.startswith("float")
         else rng.integers(0, 100, (batch, *shape)).astype(dtype))
    y = rng.integers(0, 10, batch).astype(np.int32)
    config = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    per_type: dict[str, float] = collections.Counter()
    walls = []
    with v1.Session(graph=graph, config=config) as session:
        session.run("init")
        for step in range(warmup + steps):
            metadata = v1.RunMetadata()
            start = time.perf_counter()
            session.run("train_op", {"input:0": x, "labels:0": y},
                        options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE), run_metadata=metadata)
            walls.append(time.perf_counter() - start)
            if step < warmup:
                continue
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    label = node.timeline_label
                    op_type = label.split("=", 1)[1].split("(", 1)[0].strip() if "=" in label else node.node_name
                    per_type[op_type] += (node.op_end_rel_micros - node.op_start_rel_micros) * 1e-6 / steps
    return dict(per_type), walls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a tag.backend.mwms model name (mlp, cnn, transformer, vgg)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--width", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"a saved profile (default {DEFAULT_PROFILE})")
    p.add_argument("--steps", type=int, default=2, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="op types printed per list")
    args = p.parse_args(argv)
    from tag.backend.mwms import tf1_graph
    from tag.cost.model import Profile
    from tag.errors import TagError
    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError, TagError) as err:
        print(f"probe_op_types: --profile {args.profile}: {err}", file=sys.stderr)
        return 2
    graph_def = tf1_graph(args.model, args.batch, width=args.width, depth=args.depth)
    predicted = predicted_by_type(graph_def, profile, args.batch)
    measured, walls = measured_by_type(graph_def, args.model, args.batch, args.steps, args.warmup)
    print(f"{args.model} at batch {args.batch}: predicted {sum(predicted.values()) * 1e3:.1f} ms (no runtime levels), "
          f"measured {sum(measured.values()) * 1e3:.1f} ms of kernels, steps "
          f"{', '.join(f'{w * 1e3:.0f}' for w in walls[args.warmup:])} ms; load {os.getloadavg()[0]:.1f}")
    print("predicted, by tag's op type:")
    for op_type, seconds in sorted(predicted.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {op_type:36s} {seconds * 1e3:9.1f} ms")
    print("measured, by the step stats' op type:")
    for op_type, seconds in sorted(measured.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {op_type:36s} {seconds * 1e3:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
