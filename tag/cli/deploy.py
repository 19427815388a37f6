"""``tag-deploy``: search a strategy for a training step on a cluster (or predict a given one), print it,
write a report, save the plan, and optionally run it.

Usage::

    tag-deploy --topo topologies/lab-v100-1080ti.pbtxt --model zoo:resnet50 --batch-size 64 --budget 60 \\
               --save plan/ --json report.json --trace trace.json
    tag-deploy --topo topologies/localhost.pbtxt --model my_step.pb --playouts 200 --run --steps 20
    tag-deploy --topo ... --model ... --strategy dp_allreduce          # predict a built-in, no search
    tag-deploy --topo ... --model ... --strategy-file plan/ --run      # deploy a saved strategy or plan
    tag-deploy --topo ... --strategy-file plan/ --run                  # a saved plan's own step: no --model
    tag-deploy --topo ... --model ... --run --tune 4     # measure 4 candidates, train the fastest measured

    from tag.cli.deploy import main
    main(["--topo", "topologies/localhost.pbtxt", "--model", "zoo:mlp", "--playouts", "50"])

Without ``--strategy`` it searches (``tag.optimize``'s portfolio: built-ins, best uniform action, PaSE
DP, tree search, refinement) for ``--budget`` seconds or ``--playouts`` tree-search playouts, in
decision order ``--order`` with ``--seed``; a progress bar on stderr (a terminal only) shows the
playouts, their rate and the best speedup so far. ``--strategy NAME`` predicts one of the built-in
strategies instead; ``--strategy-file F`` predicts a saved strategy (``strategy.pb``) or plan directory (whose
``graph.pb`` is the model when ``--model`` is left out).
The entry points (step op, loss, initialiser) are found in any training graph; ``--train-op``,
``--loss`` and ``--init`` name them where that is ambiguous.

The table shows the predicted step time, per device the memory used against its capacity and the
utilisation, the bytes communicated, and every strategy compared (built-ins and search steps) with
its speedup over dp_allreduce. ``--json FILE`` writes the report keys (``tag.report``, ``Plan.report``)
as JSON; ``--trace`` writes the simulated step as a Chrome trace; ``--save DIR`` writes the plan
(``tag.Plan.save``: rewritten graph, strategy, report). Files are written only once everything has been
computed, through a temporary name, so an error never leaves a half-written file. ``--profile`` (else
``$TAG_PROFILE`` or the default profile of ``tag-profile``, when present) calibrates the cost model.
``--run --steps N`` deploys the plan on TensorFlow's distributed runtime (local workers started for a
loopback topology) beside the dp_allreduce baseline and adds the measured step times to the report;
progress (step, seconds per step, loss) goes to stderr, a dead worker or an unreachable host is named
(exit 1), no step blocks past ``--step-timeout``; ``--checkpoint-every K`` / ``--resume`` save and
restore the plan's variables (``tag.cli.deploy_run``). ``--run --tune K`` first measures the K most
promising distinct candidates (the plan, the best built-in, the best uniform action, then the next
fastest predicted; ``tag.tune``) on the same cluster in interleaved rounds, prints each one's predicted
and measured step time, and trains, reports and saves the fastest measured (report key ``tune``);
``--verify`` is ``--tune 2``. ``--logdir DIR``
writes the rewritten graph for TensorBoard's graph view (ops coloured by device) and the predicted
step's Chrome trace. A profile that serves no device type of the topology is a warning; the table says
which profile entry served each device type. TensorFlow's own log lines are hidden unless ``--verbose``.

Exit codes: 0 success, 2 bad input (one line on stderr; no file written), 1 anything else.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from tqdm import tqdm

from tag.cli.common import ArgumentParser, add_old_name, add_verbose, run_cli
from tag.cli.deploy_run import add_run_arguments, check_run_arguments, run_plan, tune_k, write_tensorboard_dir
from tag.errors import OptionError, StrategyError, TagError
from tag.files import write_atomic
from tag.options import SearchOptions
from tag.report import finite, format_measured, format_table, report_json

DEFAULT_GROUPS = 64
PROG = "tag-deploy"
RUN_AVAILABLE = True
SAVED = "saved"          # the report's name for a strategy read with --strategy-file


def _parser() -> argparse.ArgumentParser:
    from tag.search.orders import ORDERS
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    p = ArgumentParser(prog=PROG, description="Search a distributed strategy for a training step on a "
                                "cluster (or predict a given one), save the plan and run it.")
    p.add_argument("--topo", required=True, metavar="FILE", help="cluster topology (.pbtxt)")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="zoo:NAME[,key=value...] or a .pb/.pbtxt GraphDef (left out with --strategy-file DIR of a "
                        "saved plan: the step it was made for, DIR/graph.pb)")
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"predict a built-in strategy instead of searching: {', '.join(BUILTIN_STRATEGIES)}")
    p.add_argument("--strategy-file", default=None, metavar="F",
                   help="predict (and --run) a saved strategy.pb or plan directory instead of searching")
    p.add_argument("--budget", type=float, default=None, metavar="S", help="search for S seconds")
    p.add_argument("--playouts", type=int, default=None, metavar="N",
                   help="tree-search playouts (default: the search's own when no --budget)")
    p.add_argument("--order", default=None, metavar="NAME",
                   help=f"search decision order: auto (default), {', '.join(ORDERS)}")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="search seed (default 0)")
    p.add_argument("--prior", default=None, choices=["uniform", "gnn"],
                   help="what guides the tree search: uniform (default) or gnn (the shipped graph neural network)")
    p.add_argument("--save", default=None, metavar="DIR", help="write the plan (graph, strategy, report) to DIR")
    p.add_argument("--train-op", default=None, metavar="OP", help="the op that runs one training step (default: found)")
    p.add_argument("--loss", default=None, metavar="OP", help="the loss op (default: found)")
    p.add_argument("--init", default=None, metavar="OP", help="the variables' initialiser op (default: found)")
    add_old_name(p, "--batch", p.add_argument("--batch-size", dest="batch", type=int, default=None, metavar="N",
                                              help="global batch size (default: the model's)"))
    p.add_argument("--groups", type=int, default=DEFAULT_GROUPS, metavar="N",
                   help=f"target number of op groups (default {DEFAULT_GROUPS})")
    p.add_argument("--profile", default=None, metavar="P.json", help="cost profile from tag-profile")
    add_old_name(p, "--report", p.add_argument("--json", dest="report", default=None, metavar="FILE",
                                               help="write the report as JSON"))
    p.add_argument("--trace", default=None, metavar="T.json", help="write the simulated step as a Chrome trace")
    add_run_arguments(p)
    add_verbose(p)
    p.add_argument("--precision", default=None, metavar="P",
                   help="fp32 (default), tf32, mixed_float16 or mixed_bfloat16: the mixed ones rewrite the graph "
                        "with TensorFlow's automatic mixed precision first (FP16 with loss scaling); tf32 costs "
                        "FP32 MatMuls and convolutions at the TF32 tensor-core peak")
    p.add_argument("--xla", action="store_true",
                   help="cost element-wise and normalisation chains as XLA fuses them (one pass over memory) and "
                        "mark them for XLA in the deployed graph")
    p.add_argument("--no-sfb", action="store_true",
                   help="keep every gradient all-reduced (no sufficient-factor broadcasting after the search)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="search per-group actions only (no pipelines of op-group stages with micro-batches)")
    p.add_argument("--min-gain", type=float, default=None, metavar="F",
                   help="a searched strategy replaces the best built-in only when predicted this much faster "
                        "(default 0.05 = 5%%, the simulator's error on real runs; 0 keeps the fastest predicted)")
    p.add_argument("--mixed-min-gain", type=float, default=None, metavar="F",
                   help="a mixed strategy (op groups with different actions) or a pipeline replaces the best "
                        "uniform action only when predicted this much faster (default 0.10 = 10%%, the "
                        "simulator's larger error on mixed plans; 0 keeps the fastest predicted)")
    return p


def _searching(args: argparse.Namespace) -> bool:
    return args.strategy is None and args.strategy_file is None


def _check_args(args: argparse.Namespace) -> SearchOptions:
    """Cheap checks before anything heavy is built; the search options of the flags."""
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    if args.strategy is not None and args.strategy not in BUILTIN_STRATEGIES:
        raise StrategyError(f"unknown strategy {args.strategy!r} (known: {', '.join(BUILTIN_STRATEGIES)}; "
                            f"--strategy-file for a saved one, neither to search)")
    if args.strategy is not None and args.strategy_file is not None:
        raise TagError("--strategy and --strategy-file exclude each other")
    search_flags = [f for f, v in (("--budget", args.budget), ("--playouts", args.playouts), ("--order", args.order),
                                   ("--seed", args.seed), ("--prior", args.prior), ("--min-gain", args.min_gain),
                                   ("--mixed-min-gain", args.mixed_min_gain))
                    if v is not None]
    if search_flags and not _searching(args):
        raise TagError(f"{', '.join(search_flags)}: search options, but --strategy/--strategy-file turn the "
                       f"search off")
    options = search_options(args)
    from tag.cost.precision import check_plan_precision
    check_plan_precision(args.precision)
    for flag, value in (("--batch-size", args.batch), ("--groups", args.groups), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise TagError(f"{flag} must be positive, got {value}")
    from tag.files import check_writable
    for flag, path in (("--json", args.report), ("--trace", args.trace), ("--save", args.save)):
        if path is not None:    # exit 2 naming the path now, not after a search
            check_writable(path, what=f"{flag} output", directory=flag == "--save")
    check_run_arguments(args)
    if args.strategy_file is not None and not os.path.exists(args.strategy_file):
        raise TagError(f"--strategy-file {args.strategy_file}: no such file or plan directory")
    if args.model is None and not (args.strategy_file is not None and os.path.isdir(args.strategy_file)):
        raise TagError("--model is required (it may be left out only with --strategy-file DIR of a saved plan, "
                       "which holds the step it was made for)")
    return options


#: the flag of each SearchOptions field tag-deploy sets (sfb and pipeline come from --no-sfb / --no-pipeline)
OPTION_FLAGS = {"budget_s": "--budget", "playouts": "--playouts", "order": "--order", "seed": "--seed",
                "prior": "--prior", "min_gain": "--min-gain", "mixed_min_gain": "--mixed-min-gain",
                "tune_k": "--tune"}


def search_options(args: argparse.Namespace) -> SearchOptions:
    """The search and tuning settings of ARGS' flags as one ``SearchOptions``, which checks them; a value out of
    range is its one-line message with the flag's name (exit 2)."""
    try:
        return SearchOptions.of(budget_s=args.budget, playouts=args.playouts, order=args.order, seed=args.seed,
                                prior=args.prior, sfb=not args.no_sfb, pipeline=not args.no_pipeline,
                                min_gain=args.min_gain, mixed_min_gain=args.mixed_min_gain, tune_k=tune_k(args))
    except OptionError as err:
        raise TagError(err.named(OPTION_FLAGS.get(err.field, err.field))) from None


def _load_profile(path: str | None):
    """(profile or None, where it came from or None): ``--profile``, else the default location."""
    from tag.cli.profiles import load_profile_arg
    return load_profile_arg(path)


def _saved_plan(args: argparse.Namespace) -> Any:
    """``--strategy-file DIR`` without ``--model``: the plan saved in DIR, whose step is the model; the flags that
    would change the step it was made for are refused (exit 2)."""
    from tag.plan import GRAPH_FILE, Plan
    plan = Plan.load(args.strategy_file)
    given = [flag for flag, value in (("--train-op", args.train_op), ("--loss", args.loss), ("--init", args.init))
             if value is not None]
    if given:
        raise TagError(f"{', '.join(given)}: the plan in {args.strategy_file} names its own entry points; give "
                       f"--model to plan another step")
    if args.precision is not None and args.precision != plan.precision:
        raise TagError(f"--precision {args.precision}: the plan in {args.strategy_file} was made for "
                       f"{plan.precision}; give --model to plan the model again at another precision")
    args.model = os.path.join(args.strategy_file, GRAPH_FILE)       # what the table and checkpoints name
    return plan


def _analysis(args: argparse.Namespace, topology, profile, saved, loaded=None) -> Any:
    """Build the model and prepare it (``tag.plan.prepare``: entry points, IR, op groups, cost model); LOADED: a
    saved plan whose step is the model (``tag.plan.prepare_loaded``)."""
    from tag.plan import prepare, prepare_loaded
    if loaded is not None:
        return prepare_loaded(loaded, topology, profile=profile, batch_size=args.batch, xla=args.xla or None)
    # TensorFlow's deprecation notices (Keras model building) are noise in a CLI's output
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    with tqdm(total=2, desc=PROG, unit="stage", disable=not sys.stderr.isatty(), leave=False) as bar:
        bar.set_postfix_str("building the model")
        from tag.frontend import zoo
        model_name, graph_def = zoo.resolve_model(args.model, args.batch)
        if not str(args.model).strip().startswith("zoo:"):
            from tag.cli.graph_check import check_importable
            check_importable(graph_def, args.model)     # op signatures, attributes, cycles
        bar.update()
        bar.set_postfix_str("analysing the graph")
        analysis = prepare(graph_def, topology, batch_size=args.batch, profile=profile, groups=args.groups,
                           grouping=saved.grouping if saved is not None else None, train_op=args.train_op,
                           loss=args.loss, init=args.init, name=model_name, precision=args.precision,
                           xla=args.xla)
        bar.update()
    return analysis


def _search(args: argparse.Namespace, analysis, options: SearchOptions) -> Any:
    """``tag.api.search_plan`` with OPTIONS and a progress bar: playouts, playouts/s, best speedup so far."""
    from tag.api import search_plan
    with tqdm(total=args.playouts, desc="search", unit="playout", disable=not sys.stderr.isatty(),
              leave=False) as bar:
        def progress(p) -> None:
            bar.set_postfix_str(f"best speedup {p.best_speedup:.3g}x", refresh=False)
            bar.update(p.playouts - bar.n)
            if p.total is not None and p.playouts >= p.total:
                bar.refresh()           # the last playout is shown whatever the refresh interval

        plan = search_plan(analysis, options=options, progress=progress)
        bar.refresh()
        return plan


CARRIED_KEYS = ("profile", "profile_use", "predict_seconds", "search_seconds", "evaluations", "search",
                "strategy_file")


def _kept_report(plan_report: dict, kept_report: dict, notes: list[str]) -> dict:
    """KEPT_REPORT (the candidate --tune kept) with what PLAN_REPORT knew beyond its own strategy: the
    profile, the search's figures, every strategy compared; NOTES added to its notes."""
    kept_report.update({k: plan_report[k] for k in CARRIED_KEYS if k in plan_report})
    for key in ("baselines", "baselines_feasible"):
        kept_report[key] = {**plan_report[key], **kept_report[key]}
    kept_report["notes"] = [*kept_report.get("notes", []), *notes]
    return kept_report


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    options = _check_args(args)
    if args.run and not RUN_AVAILABLE:      # refuse before anything heavy is built
        raise TagError("--run is not available yet")
    from tag.cluster.topology import load_topology
    from tag.plan import load_strategy, plan_for, strategy_report
    topology = load_topology(args.topo)
    if args.batch is not None and args.batch < topology.num_devices:
        raise TagError(f"--batch-size {args.batch} is smaller than the {topology.num_devices} devices of "
                       f"{args.topo}; data parallelism needs at least one example per device")
    from tag.cli.model_size import check_model_spec
    from tag.cli.profiles import profile_use, profile_warning
    if args.model is not None:
        check_model_spec(args.model, args.batch)    # absurd sizes: a clean error before building
    profile, profile_path = _load_profile(args.profile)
    warning = profile_warning(profile, profile_path, topology)
    if warning:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    saved, loaded = None, None
    if args.model is None:          # --strategy-file DIR: the plan's own step
        loaded = _saved_plan(args)
    if args.strategy_file is not None:
        saved, planned_batch = load_strategy(args.strategy_file)
        if args.batch is None:          # a plan directory knows the batch it was planned for
            args.batch = planned_batch
    t0 = time.perf_counter()
    analysis = _analysis(args, topology, profile, saved, loaded)
    plan = None
    if _searching(args):
        plan = _search(args, analysis, options)
        report, name, strategy = plan.report(), plan.method, plan.strategy
    else:
        name, strategy, report = strategy_report(analysis, args.strategy or saved,
                                                 name=SAVED if saved is not None else None)
        if saved is not None:
            report["strategy_file"] = args.strategy_file
    report["profile"] = profile_path
    report["profile_use"] = profile_use(profile, profile_path, topology)
    if warning:
        report["notes"] = [*report.get("notes", []), warning]
    report["predict_seconds"] = time.perf_counter() - t0
    run_metadata = None
    if args.run:        # the plan's table first, then the run's progress and measurements
        print(format_table(report, args.model, measured=False), flush=True)
        if not report.get("feasible", True):
            from tag.report import oom_stages
            stages = oom_stages(report)
            where = f", pipeline stage {', '.join(map(str, stages))}" if stages else ""
            raise TagError(f"--run: the plan {name!r} does not fit in the devices' memory (out of memory on "
                           f"{', '.join(report.get('oom_devices', [])) or 'some device'}{where}); nothing was run")
        outcome = run_plan(args, analysis, name, strategy, report, plan.candidates if plan is not None else None,
                           k=options.tune_k)
        if outcome.name != name:        # --tune measured another candidate faster: it is the plan now
            name, strategy = outcome.name, outcome.strategy
            plan = plan_for(analysis, strategy, name=name)
            report = _kept_report(report, plan.report(), [warning] if warning else [])
        report.update(outcome.fields)
        run_metadata = outcome.run_metadata
    trace_text = None
    if args.trace:
        trace_text = json.dumps(finite(analysis.simulator().trace(strategy, batch_size=analysis.batch)))
    report_text = report_json(report) if args.report else None
    if args.save or args.tensorboard:   # the plan's files carry this report (profile, timings, measurements)
        plan = dataclasses.replace(plan or plan_for(analysis, strategy, name=name), _report=report)
    # write only once everything has been computed: an error above leaves no file behind
    if plan is not None and args.save:
        plan.save(args.save)
    if trace_text is not None:
        write_atomic(args.trace, trace_text)
    if report_text is not None:
        write_atomic(args.report, report_text)
    if args.tensorboard:
        write_tensorboard_dir(args, analysis, strategy, plan.rewritten.graph_def, run_metadata)
    if not args.run or "tune" in report:      # --tune may have kept another plan: its table again
        print(("\n" if args.run else "") + format_table(report, args.model, measured=not args.run))
    measured = format_measured(report) if args.run else ""
    if measured:
        print("\n" + measured)
    for flag, path in (("plan", args.save), ("report", args.report), ("trace", args.trace),
                       ("tensorboard", args.tensorboard)):
        if path:
            print(f"{flag}: {path}")
    sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tag-deploy`` console script."""
    rc = run_cli(PROG, _body, argv)
    if argv is None and "tensorflow" in sys.modules and rc != 0:
        # A failed --run can leave a gRPC call blocked in a helper thread, which would hang interpreter
        # shutdown: stop what is still running, flush, and end the process here.
        from tag.backend.runtime.local_cluster import LIVE_CLUSTERS
        LIVE_CLUSTERS.stop_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
