"""TensorBoard output of a plan: the rewritten graph as a graph event file, the predicted step as a trace.

``tag-deploy --logdir DIR`` calls ``write_tensorboard``. It writes:

- ``DIR/events.out.tfevents.*``: the rewritten GraphDef (TF1 ``FileWriter``). Every node carries its
  ``/job:worker/task:T/device:TYPE:I`` device string, so TensorBoard's Graphs tab, with "Color: Device",
  shows which host and device runs each op; replicas, collectives and parameter-server ops appear as
  the rewriter named them. With ``--run``, the step statistics of one traced training step of the plan
  (``RunMetadata``) are attached under the tag ``step``: the same tab can then colour ops by measured
  compute time and memory.
- ``DIR/predicted_step.trace.json``: the simulator's Chrome trace of the predicted step (one row per
  device, host interconnect and network interface). TensorBoard itself does not read this format;
  open it in ``chrome://tracing`` or https://ui.perfetto.dev.

Example::

    from tag.backend.runtime.tensorboard import write_tensorboard
    files = write_tensorboard("tb/", plan.graph_def, trace=simulator.trace(strategy))
    # then: tensorboard --logdir tb/   (Graphs tab, Color: Device)
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

from tag.backend.runtime.cluster_spec import import_tf
from tag.files import finite, write_atomic

TRACE_FILE = "predicted_step.trace.json"


def write_tensorboard(logdir: str | os.PathLike, graph_def: Any, *, trace: dict | None = None,
                      run_metadata: Any = None, run_tag: str = "step") -> list[str]:
    """Write GRAPH_DEF (and RUN_METADATA, when given) as an event file and TRACE as Chrome trace JSON into
    LOGDIR (created if needed); returns the paths written."""
    tf = import_tf()
    logdir = os.fspath(logdir)
    os.makedirs(logdir, exist_ok=True)
    before = set(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    with tf.Graph().as_default():          # TF1 FileWriter refuses to run eagerly
        writer = tf.compat.v1.summary.FileWriter(logdir, filename_suffix=".tag")
        try:
            writer.add_graph(None, graph_def=graph_def)
            if run_metadata is not None:
                writer.add_run_metadata(run_metadata, run_tag)
        finally:
            writer.close()
    written = sorted(set(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))) - before)
    if trace is not None:
        path = os.path.join(logdir, TRACE_FILE)
        write_atomic(path, json.dumps(finite(trace)))
        written.append(path)
    return written


class ScalarWriter:
    """Training curves for TensorBoard's Scalars tab: ``add(step, {"loss": 2.3, ...})`` appends one event
    per value to an event file in LOGDIR (written by TensorFlow's own ``FileWriter``); ``close()`` flushes.

    Example::

        curves = ScalarWriter("tb/")
        curves.add(1, {"train/loss": 2.30, "train/examples_per_s": 812.0})
        curves.close()                 # then: tensorboard --logdir tb/
    """

    def __init__(self, logdir: str | os.PathLike):
        tf = import_tf()
        os.makedirs(os.fspath(logdir), exist_ok=True)
        self._tf = tf
        with tf.Graph().as_default():          # TF1 FileWriter refuses to run eagerly
            self._writer = tf.compat.v1.summary.FileWriter(os.fspath(logdir), filename_suffix=".tag-train")

    def add(self, step: int, values: dict[str, float]) -> None:
        tf = self._tf
        summary = tf.compat.v1.Summary(value=[tf.compat.v1.Summary.Value(tag=k, simple_value=float(v))
                                              for k, v in values.items()])
        self._writer.add_summary(summary, int(step))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
