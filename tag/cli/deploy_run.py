"""``tag-deploy --run`` and its companions: progress, deadlines, checkpoints, resume, TensorBoard output.

Kept apart from ``tag.cli.deploy`` (which parses, predicts and prints) so each stays short:

- ``add_run_arguments``: ``--run --steps N --step-timeout S --checkpoint-every K --checkpoint-dir DIR
  --resume --tune [K] --verify --logdir DIR --input MODULE:FUNCTION``;
- ``check_run_arguments``: their cheap checks, before anything is built (exit 2 on bad input);
- ``run_plan``: deploys the plan and the dp_allreduce baseline (``measure_strategies``), printing one
  progress line per step on stderr (``tag-deploy: ps: step 3/20  0.412 s/step  loss 2.301``, at most
  two a second), and returns the report's ``measured_*`` keys. Remote hosts must answer within 30 s; a
  worker that dies is named within seconds (exit 1); no step blocks past ``--step-timeout``. With
  ``--checkpoint-every K`` the plan's variables are saved as a TensorFlow checkpoint in DIR every K
  steps (original variable names, ``tag.backend.runtime.checkpoint``); ``--resume`` restores the newest
  and continues the step count and the loss curve (``--steps`` is the total). ``--input MODULE:FUNCTION``
  trains the plan on that data set function's per-host pipelines instead (``tag.cli.deploy_input``).
  ``--tune K`` first measures the K most promising distinct candidates on the same cluster start
  (``tag.tune``: the plan, the best built-in, the best uniform action, then the next fastest predicted; K
  left out: as many as cost about 30 steps of the slowest) in interleaved rounds, prints each one's
  predicted and measured step time (median +- MAD), and trains the fastest measured (the report's ``tune``
  keys). ``--verify`` is ``--tune 2`` (the plan, the best built-in, the best uniform action and one device). Not with
  ``--resume`` (the checkpoint fixes the strategy).
- ``write_tensorboard_dir``: ``--logdir DIR`` (``tag.backend.runtime.tensorboard``).

Example::

    tag-deploy --topo topologies/localhost.pbtxt --model zoo:mlp --strategy ps --run --steps 200 \\
               --checkpoint-every 20                        # killed at step 130 ...
    tag-deploy --topo topologies/localhost.pbtxt --model zoo:mlp --strategy ps --run --steps 200 --resume
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

from tag.cli.common import add_old_name
from tag.cli.deploy_input import load_dataset_fn, train_on_input
from tag.cli.deploy_progress import PROG, ProgressPrinter
from tag.errors import TagError

DEFAULT_CHECKPOINT_DIR = "tag-checkpoint"
DEFAULT_STEP_TIMEOUT_S = 600.0
TRACED_STEP = 2                  # --logdir --run: the plan's step whose statistics are kept


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The --run family of options (see the module docstring)."""
    p.add_argument("--run", action="store_true", help="also deploy the plan on TensorFlow and measure it")
    p.add_argument("--steps", type=int, default=20, metavar="N", help="training steps for --run (default 20)")
    p.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S, metavar="S",
                   help=f"--run: fail a step (or the set-up) that takes over S seconds (default "
                        f"{DEFAULT_STEP_TIMEOUT_S:.0f})")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="--run: save the plan's variables every K steps (to --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help=f"where checkpoints go and --resume reads them (default ./{DEFAULT_CHECKPOINT_DIR})")
    p.add_argument("--resume", action="store_true",
                   help="--run: continue from the last checkpoint (--steps counts from step 0)")
    p.add_argument("--tune", nargs="?", const=TUNE_DEFAULT, default=None, metavar="K",
                   help="--run: first measure the K most promising distinct candidates (the plan, the best "
                        "built-in, the best uniform action, then the next fastest predicted) on the cluster and "
                        "train the fastest measured (K left out: as many as cost about 30 steps of the slowest)")
    p.add_argument("--verify", action="store_true", help="--run: the same as --tune 2")
    add_old_name(p, "--tensorboard", p.add_argument(
        "--logdir", dest="tensorboard", default=None, metavar="DIR",
        help="TensorBoard directory: the rewritten graph (ops coloured by device), the predicted step's trace and, "
             "with --input, the training scalars"))
    p.add_argument("--input", default=None, metavar="MODULE:FUNCTION",
                   help="--run: train on the data sets FUNCTION(ctx) makes, one tf.data pipeline per worker host "
                        "(MODULE from the current directory or PYTHONPATH), instead of synthetic batches")


def checkpoint_path(args: argparse.Namespace) -> str:
    """The checkpoint directory (TensorFlow checkpoints ``model.ckpt-STEP`` and their descriptions)."""
    return args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR


def check_run_arguments(args: argparse.Namespace) -> None:
    """Cheap checks of the --run family; TagError (exit 2) before anything is built."""
    from tag.files import check_writable
    if not args.step_timeout > 0:
        raise TagError(f"--step-timeout must be a positive number of seconds, got {args.step_timeout:g}")
    needs_run = [f for f, v in (("--checkpoint-every", args.checkpoint_every), ("--resume", args.resume or None),
                                ("--checkpoint-dir", args.checkpoint_dir), ("--verify", args.verify or None),
                                ("--tune", args.tune), ("--input", args.input))
                 if v is not None]
    if needs_run and not args.run:
        raise TagError(f"{', '.join(needs_run)} only apply to --run")
    _check_tune_arguments(args)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise TagError(f"--checkpoint-every must be positive, got {args.checkpoint_every}")
    if args.checkpoint_every is not None or args.input is not None:
        check_writable(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR, what="checkpoint directory", directory=True)
    if args.input is not None:
        load_dataset_fn(args.input)         # exit 2 now if it does not import
    if args.resume:
        from tag.backend.runtime.checkpoint import latest_checkpoint, read_checkpoint_meta
        path = checkpoint_path(args)
        if latest_checkpoint(path) is None:
            raise TagError(f"--resume: no checkpoint in {path} (--checkpoint-every K writes one)")
        meta = read_checkpoint_meta(path)
        if meta["step"] >= args.steps:
            raise TagError(f"--resume: the checkpoint {path} is at step {meta['step']}, --steps is {args.steps}: "
                           f"nothing left to run (--steps is the total; raise it)")
    if args.tensorboard is not None:
        check_writable(args.tensorboard, what="TensorBoard directory", directory=True)


TUNE_DEFAULT = "default"          # --tune without K
VERIFY_K = 2                      # --verify is --tune 2


def tune_k(args: argparse.Namespace) -> int | str | None:
    """--tune's K as given (None: the default K, or no tuning; ``--verify``: ``VERIFY_K``); text that is not a
    number stays text, for ``SearchOptions.tune_k`` to refuse with the rest of the options."""
    if args.tune is None:
        return VERIFY_K if args.verify else None
    if args.tune == TUNE_DEFAULT:
        return None
    try:
        return int(args.tune)
    except ValueError:
        return args.tune


def _check_tune_arguments(args: argparse.Namespace) -> None:
    if args.verify and args.tune is not None:
        raise TagError("--verify is --tune 2: give one of them")
    if (args.verify or args.tune is not None) and args.resume:
        raise TagError(f"{'--verify' if args.verify else '--tune'} and --resume exclude each other: the checkpoint "
                       f"fixes the strategy")


def _checkpoint_meta(args: argparse.Namespace, analysis: Any, name: str) -> dict[str, Any]:
    return {"model": args.model, "strategy": name, "batch_size": int(analysis.batch),
            "topology": analysis.topology.name}


def _check_resume_matches(args: argparse.Namespace, analysis: Any, name: str) -> None:
    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    meta = read_checkpoint_meta(checkpoint_path(args))
    want = _checkpoint_meta(args, analysis, name)
    for key, value in want.items():
        if key in meta and meta[key] != value:
            raise TagError(f"--resume: {checkpoint_path(args)} was saved for {key} {meta[key]!r}, this run has "
                           f"{value!r}: resume with the same model, batch, strategy and topology")


@dataclass
class RunOutcome:
    """What ``run_plan`` did: the report's keys (``measured_*``, and ``tune``), the strategy trained (NAME,
    STRATEGY: the plan's, or the candidate that ``--tune`` measured fastest), a traced step's RunMetadata."""

    fields: dict[str, Any]
    name: str
    strategy: Any
    run_metadata: Any = None


def _control(args: argparse.Namespace, **kw: Any) -> Any:
    from tag.backend.runtime.guard import RunControl
    return RunControl(step_timeout_s=args.step_timeout, setup_timeout_s=max(args.step_timeout, 120.0), **kw)


def _tuned(args: argparse.Namespace, analysis: Any, cluster: Any, name: str, strategy: Any,
           report: dict[str, Any], searched: dict[str, Any], k: int | None) -> tuple[str, Any, dict[str, Any]]:
    """``--tune K``: measure the K most promising distinct candidates on CLUSTER (``tag.tune``); (the name and
    strategy to train: the fastest measured, the report's ``tune`` keys)."""
    from tag.report import format_tune
    from tag.tune import analysis_candidates, candidate_runner, choose, tune, tune_fields
    chosen = choose(analysis_candidates(analysis, name, strategy, report, searched), k)
    say = functools.partial(print, file=sys.stderr, flush=True)
    say(f"{PROG}: tune: measuring {len(chosen)} candidates: {', '.join(c.name for c in chosen)}")
    measure = candidate_runner(analysis, cluster, step_timeout_s=args.step_timeout)
    result = tune(chosen, measure, say=lambda text: say(f"{PROG}: tune: {text}"))
    fields = tune_fields(result)
    for line in format_tune(fields):
        say(f"{PROG}: tune: {line}")
    kept = result.kept.candidate
    return kept.name, kept.strategy, {"tune": fields}


def run_plan(args: argparse.Namespace, analysis: Any, name: str, strategy: Any, report: dict[str, Any],
             searched: dict[str, Any] | None = None, *, k: int | None = None) -> RunOutcome:
    """Deploy strategy NAME (predicted in REPORT) and the dp_allreduce baseline on one cluster start, after
    ``--tune`` has measured the K most promising candidates (``SearchOptions.tune_k``, None: the default K;
    SEARCHED: name -> each search step's best and the built-ins, ``Plan.candidates``) and kept the fastest."""
    from tag.backend.runtime.guard import RunEvent
    from tag.backend.runtime.measure import measure_strategies, open_cluster
    from tag.report import BASELINE_MAX_STEPS, measured_fields

    if args.resume:
        _check_resume_matches(args, analysis, name)
    printer, entry, fields = ProgressPrinter(), analysis.entry, {}
    with open_cluster(analysis.topology, say=lambda text: printer(name, RunEvent("phase", text))) as cluster:
        measure = functools.partial(measure_strategies, analysis.graph_def, analysis.graph, analysis.topology,
                                    batch_size=analysis.batch, train_op=entry.train_op, loss=entry.loss,
                                    init=entry.init, cluster=cluster)
        if args.verify or args.tune is not None:
            name, strategy, fields = _tuned(args, analysis, cluster, name, strategy, report, searched or {}, k)
        if args.input is not None:      # train on the user's data sets; nothing else is timed
            fields.update(train_on_input(args, analysis, name, strategy, cluster,
                                         _control(args, watchdog=cluster.watchdog),
                                         checkpoint_path(args),     # the trained weights are always saved
                                         _checkpoint_meta(args, analysis, name)))
            return RunOutcome(fields, name, strategy)
        wanted = {name: strategy}
        wanted.setdefault("dp_allreduce", analysis.builtin("dp_allreduce"))
        control = _control(args, checkpoint_every=args.checkpoint_every or 0,
                           checkpoint_path=checkpoint_path(args) if args.checkpoint_every else None,
                           checkpoint_meta=_checkpoint_meta(args, analysis, name),
                           resume_from=checkpoint_path(args) if args.resume else None,
                           trace_step=TRACED_STEP if args.tensorboard else None)
        if args.checkpoint_every:
            os.makedirs(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR, exist_ok=True)
        steps_of = {n: min(args.steps, BASELINE_MAX_STEPS) for n in wanted if n != name}
        runs = measure(wanted, steps=args.steps, warmup=min(3, args.steps - 1), controls={name: control},
                       progress=printer, steps_of=steps_of)
    mine, base = runs[name], runs["dp_allreduce"]
    fields.update(measured_fields(mine, base))
    if args.checkpoint_every:
        fields["checkpoint"] = checkpoint_path(args)
    return RunOutcome(fields, name, strategy, mine.run_metadata)


def write_tensorboard_dir(args: argparse.Namespace, analysis: Any, strategy: Any, graph_def: Any,
                          run_metadata: Any) -> list[str]:
    """``--logdir DIR``: the rewritten graph (+ a traced step's statistics) and the predicted trace."""
    from tag.backend.runtime.tensorboard import write_tensorboard
    trace = analysis.simulator().trace(strategy, batch_size=analysis.batch)
    return write_tensorboard(args.tensorboard, graph_def, trace=trace, run_metadata=run_metadata)
