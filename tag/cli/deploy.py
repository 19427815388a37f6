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

import numpy as np
from tqdm import tqdm

from tag.cli.common import run_cli, write_text_atomic
from tag.errors import StrategyError, TagError

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
    from tag.cost.calibration import default_profile_path, load_default_profile
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


def _finite(obj: Any) -> Any:
    """OBJ with non-finite floats replaced by None and numpy scalars by Python ones (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _fmt_time(s: float) -> str:
    if not np.isfinite(s):
        return "inf"
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def _fmt_bytes(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def _run_hook(args: argparse.Namespace, context: dict[str, Any]) -> dict[str, Any]:
    """``--run --steps N``: deploy the plan and the dp_allreduce baseline and measure them.

    Returns the report's ``measured_step_time_s``, ``measured_baseline_step_time_s`` and
    ``measured_speedup_vs_dp``. CONTEXT holds what the prediction used (graph_def, graph, topology,
    grouping, strategies by name, cost model, batch). A topology whose hosts are all on loopback gets
    its workers started here (and stopped on exit, error or Ctrl-C); otherwise the hosts' ``tag-worker``
    servers must already be running. Inputs are synthetic batches stored on the devices.
    """
    from tag.backend.rewrite import rewrite
    from tag.backend.runtime import LocalCluster, is_loopback, run_steps

    topology, strategies = context["topology"], context["strategies"]
    warmup = min(3, args.steps - 1)

    def measure(target: str, name: str):
        plan = rewrite(context["graph_def"], context["graph"], strategies[name], topology, batch_size=context["batch"])
        return run_steps(plan.graph_def, target, train_op=plan.train_op, loss=plan.loss, init=plan.init,
                         steps=args.steps, warmup=warmup, synthetic=True)

    def measure_both(target: str):
        mine = measure(target, args.strategy)
        base = mine if args.strategy == "dp_allreduce" else measure(target, "dp_allreduce")
        return mine, base

    if all(is_loopback(h.address) for h in topology.hosts):
        with LocalCluster(topology) as cluster:
            mine, base = measure_both(cluster.target)
    else:
        first = min(topology.hosts, key=lambda h: h.task_index)
        mine, base = measure_both(f"grpc://{first.address}:{first.port}")
    return {"measured_step_time_s": mine.mean_step_time_s,
            "measured_baseline_step_time_s": base.mean_step_time_s,
            "measured_speedup_vs_dp": base.mean_step_time_s / mine.mean_step_time_s,
            "measured_steps": args.steps, "measured_warmup_steps": warmup,
            "measured_losses": [float(x) for x in mine.losses]}


def predict(topology, graph, grouping, strategy_name: str, cost_model, batch: int) -> dict[str, Any]:
    """Simulate every built-in strategy; returns {"strategies": {name: Strategy}, "results": {name: SimResult},
    "simulator": Simulator}."""
    from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
    from tag.sim.simulator import Simulator
    sim = Simulator(graph, topology, grouping, cost_model)
    strategies, results = {}, {}
    for name in BUILTIN_STRATEGIES:
        s = builtin_strategy(name, graph, topology, grouping, cost_model)
        strategies[name] = s
        results[name] = sim.evaluate(s, batch_size=batch)
    return {"strategies": strategies, "results": results, "simulator": sim}


def build_report(model: str, topology, graph, grouping, strategy_name: str, results: dict, batch: int) -> dict:
    """The report dict (DESIGN.md's keys plus the strategy and per-device details)."""
    r = results[strategy_name]
    names = [d.name for d in topology.devices]
    step = float(r.step_time)
    dp = float(results["dp_allreduce"].step_time)
    peak = np.asarray(r.peak_memory, dtype=np.float64)
    util = np.asarray(r.utilisation, dtype=np.float64)
    return {
        "model": model,
        "topology": topology.name,
        "strategy": strategy_name,
        "batch_size": int(batch),
        "devices": topology.num_devices,
        "groups": grouping.num_groups,
        "predicted_step_time_s": step,
        "baselines": {n: float(res.step_time) for n, res in results.items()},
        "baselines_feasible": {n: bool(res.feasible) for n, res in results.items()},
        "speedup_vs_dp": (dp / step) if step > 0 else None,
        "search_seconds": 0.0,
        "peak_memory_bytes": {n: int(round(float(b))) for n, b in zip(names, peak)},
        "memory_capacity_bytes": {d.name: int(d.memory_bytes) for d in topology.devices},
        "utilisation": {n: float(u) for n, u in zip(names, util)},
        "communication_bytes": float(r.comm_bytes),
        "feasible": bool(r.feasible),
        "oom_devices": [names[int(d)] if not isinstance(d, str) else d for d in r.oom_devices],
        "sfb_gradients": [],
    }


def format_table(report: dict, model_spec: str) -> str:
    """The human-readable summary tag-deploy prints."""
    lines = [f"{report['model']} ({model_spec}) on {report['topology']}: {report['devices']} devices, "
             f"batch {report['batch_size']}, {report['groups']} op groups, strategy {report['strategy']}",
             f"predicted step time  {_fmt_time(report['predicted_step_time_s'])}"
             f"{'' if report['feasible'] else '   (OUT OF MEMORY on ' + ', '.join(report['oom_devices']) + ')'}",
             f"communication        {_fmt_bytes(report['communication_bytes'])} per step",
             "cost model           " + (f"profile {report['profile']}" if report.get("profile") else
                                           "built-in defaults (calibrate: tag-profile --model ...)"),
             ""]
    width = max([len("device")] + [len(n) for n in report["peak_memory_bytes"]])
    lines.append(f"{'device':<{width}}  {'memory used / capacity':>28}  {'util':>6}")
    for name, used in report["peak_memory_bytes"].items():
        cap = report["memory_capacity_bytes"][name]
        flag = "  OOM" if name in report["oom_devices"] else ""
        mem = f"{_fmt_bytes(used)} / {_fmt_bytes(cap)}"
        lines.append(f"{name:<{width}}  {mem:>28}  {report['utilisation'][name] * 100:5.1f}%{flag}")
    lines += ["", "built-in strategies (predicted step time):"]
    for name, t in report["baselines"].items():
        notes = []
        if name == report["strategy"]:
            notes.append("this plan")
        if not report["baselines_feasible"][name]:
            notes.append("out of memory")
        lines.append(f"  {name:<14} {_fmt_time(t):>12}{'   (' + ', '.join(notes) + ')' if notes else ''}")
    sp = report["speedup_vs_dp"]
    lines.append(f"speedup vs dp_allreduce: {sp:.3g}x" if sp is not None else "speedup vs dp_allreduce: n/a")
    if "measured_step_time_s" in report:
        lines += ["", f"measured on TensorFlow ({report['measured_steps']} steps, "
                      f"{report['measured_warmup_steps']} warm-up):",
                  f"  {report['strategy']:<14} {_fmt_time(report['measured_step_time_s']):>12}"]
        if report["strategy"] != "dp_allreduce":
            lines.append(f"  {'dp_allreduce':<14} {_fmt_time(report['measured_baseline_step_time_s']):>12}")
        lines.append(f"measured speedup vs dp_allreduce: {report['measured_speedup_vs_dp']:.3g}x")
    return "\n".join(lines)


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
        pred = predict(topology, graph, grouping, args.strategy, cost_model, batch)
        bar.update()
    report = build_report(model_name, topology, graph, grouping, args.strategy, pred["results"], batch)
    report["profile"] = profile_path
    report["predict_seconds"] = time.perf_counter() - t0
    if args.run:
        report.update(_run_hook(args, {"graph_def": graph_def, "graph": graph, "topology": topology,
                                       "grouping": grouping, "strategies": pred["strategies"],
                                       "cost_model": cost_model, "batch": batch}))
    trace_text = None
    if args.trace:
        trace_text = json.dumps(_finite(pred["simulator"].trace(pred["strategies"][args.strategy], batch_size=batch)))
    report_text = json.dumps(_finite(report), indent=2) + "\n" if args.report else None
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
