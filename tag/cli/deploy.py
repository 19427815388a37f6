"""``tag-deploy``: predict one training step of a strategy on a cluster, print it, write a report.

Usage::

    tag-deploy --topo topologies/lab-v100-1080ti.pbtxt --model zoo:resnet50 --strategy dp_allreduce \\
               --batch 64 --report report.json --trace trace.json

    from tag.cli.deploy import main
    main(["--topo", "topologies/localhost.pbtxt", "--model", "zoo:mlp", "--report", "r.json"])

No search here: ``--strategy`` names one of the built-in strategies (tag.baselines), which is
simulated beside all the others. The table shows the predicted step time, per device the memory
used against its capacity and the utilisation, the bytes communicated, and every built-in's
predicted step time. ``--report`` writes DESIGN.md's report keys as JSON; ``--trace`` writes the
simulated step as a Chrome trace (chrome://tracing, Perfetto). Files are written to a temporary
name and renamed, so an error never leaves a half-written file. ``--profile`` (else
``$TAG_PROFILE`` or the default profile of ``tag-profile``, when present) calibrates the
cost model. ``--run --steps N`` rewrites the graph for the strategy, runs it on TensorFlow's distributed
runtime (local workers started for a loopback topology) beside the dp_allreduce baseline, and adds the
measured step times to the report.

Exit codes: 0 success, 2 bad input (one line on stderr; no file written), 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from tqdm import tqdm

from tag.cli.common import run_cli, write_text_atomic
from tag.errors import StrategyError, TagError
from tag.report import build_report, finite, format_table, measured_fields, predict, report_json

DEFAULT_GROUPS = 64
PROG = "tag-deploy"
RUN_AVAILABLE = True


def _parser() -> argparse.ArgumentParser:
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    p = argparse.ArgumentParser(prog=PROG, description="Predict (and later run) one training step of a "
                                "distributed strategy on a cluster.")
    p.add_argument("--topo", required=True, metavar="FILE", help="cluster topology (.pbtxt)")
    p.add_argument("--model", required=True, metavar="SPEC", help="zoo:NAME[,key=value...] or a .pb/.pbtxt GraphDef")
    p.add_argument("--strategy", default="dp_allreduce", metavar="NAME",
                   help=f"built-in strategy: {', '.join(BUILTIN_STRATEGIES)} (default dp_allreduce)")
    p.add_argument("--batch", type=int, default=None, metavar="N", help="global batch size (default: the model's)")
    p.add_argument("--groups", type=int, default=DEFAULT_GROUPS, metavar="N",
                   help=f"target number of op groups (default {DEFAULT_GROUPS})")
    p.add_argument("--profile", default=None, metavar="P.json", help="cost profile from tag-profile")
    p.add_argument("--report", default=None, metavar="R.json", help="write the report as JSON")
    p.add_argument("--trace", default=None, metavar="T.json", help="write the simulated step as a Chrome trace")
    p.add_argument("--run", action="store_true", help="also deploy the plan on TensorFlow and measure it")
    p.add_argument("--steps", type=int, default=20, metavar="N", help="training steps for --run (default 20)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Cheap checks before anything heavy is built."""
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    if args.strategy not in BUILTIN_STRATEGIES:
        raise StrategyError(f"unknown strategy {args.strategy!r} (known: {', '.join(BUILTIN_STRATEGIES)})")
    if args.batch is not None and args.batch < 1:
        raise TagError(f"--batch must be positive, got {args.batch}")
    if args.groups < 1:
        raise TagError(f"--groups must be positive, got {args.groups}")
    if args.steps < 1:
        raise TagError(f"--steps must be positive, got {args.steps}")
    for flag, path in (("--report", args.report), ("--trace", args.trace)):
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path):
                raise TagError(f"{flag} {path}: is a directory")
            if not os.path.isdir(parent):
                raise TagError(f"{flag} {path}: directory {parent} does not exist")
    if args.profile is not None and not os.path.isfile(args.profile):
        raise TagError(f"--profile {args.profile}: no such file")


def _load_profile(path: str | None):
    """(profile or None, where it came from or None)."""
    from tag.cost.profile_store import default_profile_path, load_default_profile
    if path is None:
        prof = load_default_profile()
        return prof, (default_profile_path() if prof is not None else None)
    from tag.cost.model import Profile
    try:
        return Profile.load(path), path
    except TagError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TagError(f"{path}: not a tag cost profile ({type(err).__name__}: {err})") from None


def _run_hook(args: argparse.Namespace, context: dict[str, Any]) -> dict[str, Any]:
    """``--run --steps N``: deploy the plan and the dp_allreduce baseline and measure them.

    Returns the report's ``measured_*`` keys (``tag.report.measured_fields``). CONTEXT holds what the
    prediction used (``_predict_stages``: graph_def, graph, topology, strategies, batch). A topology whose hosts are
    all on loopback gets its workers started (and stopped on exit, error or Ctrl-C); otherwise the hosts'
    ``tag-worker`` servers must already be running (``tag.backend.runtime.measure_strategies``).
    """
    from tag.backend.runtime.measure import measure_strategies

    strategies = context["strategies"]
    warmup = min(3, args.steps - 1)
    wanted = {name: strategies[name] for name in dict.fromkeys([args.strategy, "dp_allreduce"])}
    runs = measure_strategies(context["graph_def"], context["graph"], context["topology"], wanted,
                              batch_size=context["batch"], steps=args.steps, warmup=warmup)
    return measured_fields(runs[args.strategy], runs["dp_allreduce"], args.steps, warmup)


def _predict_stages(args: argparse.Namespace, topology, profile) -> dict[str, Any]:
    """Build the model, analyse it, group ops and simulate every built-in strategy (a progress bar on a tty).

    Returns the context later steps need: model_name, graph_def, graph, topology, batch, grouping,
    cost_model, and ``tag.report.predict``'s strategies, results and simulator.
    """
    # TensorFlow's deprecation notices (Keras model building) are noise in a CLI's output
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    with tqdm(total=4, desc=PROG, unit="stage", disable=not sys.stderr.isatty(), leave=False) as bar:
        bar.set_postfix_str("building the model")
        from tag import zoo
        from tag.frontend.analyze import analyze
        model_name, graph_def = zoo.resolve_model(args.model, args.batch)
        bar.update()
        bar.set_postfix_str("analysing the graph")
        graph = analyze(graph_def, batch_size=args.batch)
        batch = int(args.batch if args.batch is not None else graph.batch_size)
        if batch < topology.num_devices:
            raise TagError(f"the model's batch {batch} is smaller than the {topology.num_devices} devices of "
                           f"{args.topo}; pass a larger --batch")
        bar.update()
        bar.set_postfix_str("grouping ops")
        from tag.cost.model import CostModel
        from tag.strategy.grouping import group_ops
        grouping = group_ops(graph, target_groups=args.groups)
        cost_model = CostModel(graph, topology, profile)
        bar.update()
        bar.set_postfix_str("simulating the built-in strategies")
        pred = predict(topology, graph, grouping, cost_model, batch)
        bar.update()
    return {"model_name": model_name, "graph_def": graph_def, "graph": graph, "topology": topology, "batch": batch,
            "grouping": grouping, "cost_model": cost_model, **pred}


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)
    if args.run and not RUN_AVAILABLE:      # refuse before anything heavy is built
        raise TagError("--run is not available yet")
    from tag.cluster.topology import load_topology
    topology = load_topology(args.topo)
    if args.batch is not None and args.batch < topology.num_devices:
        raise TagError(f"--batch {args.batch} is smaller than the {topology.num_devices} devices of "
                       f"{args.topo}; data parallelism needs at least one example per device")
    profile, profile_path = _load_profile(args.profile)
    t0 = time.perf_counter()
    ctx = _predict_stages(args, topology, profile)
    report = build_report(ctx["model_name"], topology, ctx["grouping"], args.strategy, ctx["results"], ctx["batch"])
    report["profile"] = profile_path
    report["predict_seconds"] = time.perf_counter() - t0
    if args.run:
        report.update(_run_hook(args, ctx))
    trace_text = None
    if args.trace:
        trace = ctx["simulator"].trace(ctx["strategies"][args.strategy], batch_size=ctx["batch"])
        trace_text = json.dumps(finite(trace))
    report_text = report_json(report) if args.report else None
    # write only once everything has been computed: an error above leaves no file behind
    if trace_text is not None:
        write_text_atomic(args.trace, trace_text)
    if report_text is not None:
        write_text_atomic(args.report, report_text)
    print(format_table(report, args.model))
    for flag, path in (("report", args.report), ("trace", args.trace)):
        if path:
            print(f"{flag}: {path}")
    sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tag-deploy`` console script."""
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
