"""``tag-deploy --run --input MODULE:FUNCTION``: train the plan on the user's data set instead of timing it.

``load_dataset_fn`` imports MODULE from the current directory or ``PYTHONPATH`` and returns its FUNCTION,
the ``dataset_fn(ctx)`` of ``tag.train`` (one ``tf.data`` pipeline per worker host; see
``tag.backend.runtime.input_pipeline``); a spec that does not name an importable callable is a one-line
error (exit 2) before anything is built. ``train_on_input`` trains the plan on the cluster that
``tag-deploy --run`` opened, with ``--steps``, ``--checkpoint-every`` / ``--checkpoint-dir`` / ``--resume``
(TensorFlow checkpoints) and ``--logdir`` (training scalars beside the graph), and returns the
report's ``trained`` key. No dp_allreduce baseline is timed in this mode.

Example::

    # my_data.py:  def train_set(ctx): return tf.data.Dataset.from_tensor_slices(...).shard(...).repeat()
    tag-deploy --topo topologies/localhost.pbtxt --model my_graph.pb --run --input my_data:train_set \\
               --steps 500 --checkpoint-every 100
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable

from tag.cli.deploy_progress import PROG, ProgressPrinter
from tag.errors import TagError


def load_dataset_fn(spec: str) -> Callable[[Any], Any]:
    """The callable SPEC ("module:function", module imported from the current directory or PYTHONPATH)."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise TagError(f"--input {spec}: expected MODULE:FUNCTION (e.g. my_data:train_set)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module: any error is reported in one line
        first = " ".join(str(err).split())[:200]
        raise TagError(f"--input {spec}: cannot import {module_name} ({type(err).__name__}: {first})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise TagError(f"--input {spec}: {module_name} has no {attr!r}")
    if not callable(fn):
        raise TagError(f"--input {spec}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def train_on_input(args: argparse.Namespace, analysis: Any, name: str, strategy: Any, cluster: Any,
                   control: Any, checkpoint_dir: str | None, meta: dict) -> dict[str, Any]:
    """Rewrite STRATEGY and train it for ``--steps`` on ``--input``'s data sets; the report's keys."""
    from tag.backend.runtime.training import train_programs
    dataset_fn = load_dataset_fn(args.input)
    res = analysis.rewrite(strategy)

    show_bar = sys.stderr.isatty()
    result = train_programs(res.programs(), cluster, dataset_fn, fingerprint=res.fingerprint, inputs=res.inputs,
                            batch_size=analysis.batch, steps=args.steps, checkpoint_dir=checkpoint_dir,
                            checkpoint_every=args.checkpoint_every or 0, resume=bool(args.resume),
                            logdir=args.tensorboard, progress=True if show_bar else _every_step_line(name),
                            control=control, checkpoint_meta=meta)
    losses = result.losses
    print(f"{PROG}: {name}: trained to step {result.steps_done}" +
          (" (the data set ended first)" if result.ended_early else "") +
          (f", loss {losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "") +
          f", {result.examples_per_s:,.0f} examples/s on {len(result.pipelines)} input pipeline(s)" +
          (f", checkpoint {result.checkpoint}" if result.checkpoint else ""), file=sys.stderr, flush=True)
    return {"trained": {**result.to_dict(), "input": args.input, "strategy": name}}


def _every_step_line(name: str) -> Callable[[Any], None]:
    """Progress for a non-terminal stderr: phases, checkpoints, and a step line at most twice a second."""
    printer = ProgressPrinter()
    return lambda ev: printer(name, ev)
