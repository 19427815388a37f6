"""``tag.train``: train a plan on your own data, each worker host reading its own share of it.

``dataset_fn(ctx)`` builds a ``tf.data.Dataset`` for one input pipeline; tag calls it once per worker host
that reads examples (``ctx``: a ``tf.distribute.InputContext`` with ``input_pipeline_id`` and
``num_input_pipelines``, plus ``ctx.batch_size``, that host's share of the global batch, uneven on unequal
devices), places the pipeline on that host, batches single examples to the share (or takes batches
already of that size) and prefetches; the rewritten graph reads the batches there, so no example passes
through the client. Read files where the workers are (``tf.data.TextLineDataset``, ``TFRecordDataset``,
``CsvDataset``): arrays captured with ``from_tensor_slices`` travel inside the host's program. Python code
in the data set (``tf.py_function``) runs only where the data set is built, not on the hosts. Elements match the
graph's batch inputs by name (a dict keyed by placeholder name) or by order (a tuple in the order of
``plan.inputs``). Checkpoints are TensorFlow checkpoints under the original graph's variable names (one
per variable), which ``tf.train.load_checkpoint`` reads and a ``Saver`` restores into the original graph.

Example::

    import tensorflow as tf
    import tag

    plan = tag.optimize(graph_def, "topologies/localhost.pbtxt")

    def dataset_fn(ctx):                  # runs once per worker host, on that host
        ds = tf.data.experimental.CsvDataset("train.csv", [tf.float32] * 65)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.map(lambda *cols: {"x": tf.stack(cols[:64]), "y": tf.cast(cols[64], tf.int64)}).repeat()

    result = tag.train(plan, dataset_fn, steps=500, checkpoint_dir="ckpt/", checkpoint_every=100,
                       eval_fn=lambda weights, step: {"accuracy": my_accuracy(weights)}, eval_every=50)
    tf.train.load_checkpoint(result.checkpoint).get_tensor("w1")     # the trained weight, original name
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from tag.errors import TagError


def _topology_of(plan: Any, topology: Any) -> Any:
    from tag.cluster.topology import Topology, load_topology
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, os.PathLike)):
        return load_topology(topology)
    for attr in ("cluster", "topology"):          # a Plan's cluster; a RewriteResult's topology
        value = getattr(plan, attr, None)
        if isinstance(value, Topology):
            return value
    raise TagError("tag.train: the plan names no cluster; pass topology= (the cluster it was planned for)")


def train(plan: Any, dataset_fn: Callable[[Any], Any], *, steps: int, checkpoint_dir: str | os.PathLike | None = None,
          checkpoint_every: int = 0, resume: bool = False,
          eval_fn: Callable[[dict, int], Mapping[str, float]] | None = None, eval_every: int = 0,
          logdir: str | os.PathLike | None = None, topology: Any = None, target: str | None = None,
          feeds: Mapping[str, Any] | None = None, progress: Any = True, step_timeout_s: float | None = 600.0,
          seed: int = 0) -> "Any":
    """Train PLAN (a ``tag.Plan``, or the ``RewriteResult`` of ``tag.rewrite``) for STEPS steps on the data
    sets DATASET_FN makes (module docstring); returns a ``TrainResult`` (losses, examples/s, evaluations,
    the last checkpoint, ``ended_early`` when the data ran out first).

    Every host runs its own program of the plan with its own input pipeline. The cluster: the plan's TOPOLOGY
    (default: the one it was planned for), whose loopback hosts are started here (a process per host beside its
    server) and whose remote hosts must run ``tag-worker`` (each host's program then runs from here, a session
    per host); TARGET (a running cluster's ``grpc://host:port``) says the servers run already. CHECKPOINT_DIR
    gets a TensorFlow checkpoint every CHECKPOINT_EVERY steps (0: only at the end) and the TensorBoard scalars
    (or LOGDIR); RESUME continues from its newest checkpoint (STEPS is the total). EVAL_FN(weights, step) ->
    {metric: value}, given one array per original variable name, runs every EVAL_EVERY steps and after the last.
    FEEDS: values for placeholders that are not batch inputs. PROGRESS: a progress bar on a terminal (True), a
    callable taking ``RunEvent``s, or False.
    """
    from tag.backend.runtime.guard import RunControl
    from tag.backend.runtime.measure import reach_cluster
    from tag.backend.runtime.training import train_programs
    for attr in ("programs", "inputs", "batch_size", "train_op", "fingerprint"):
        if not hasattr(plan, attr):
            raise TagError(f"tag.train takes a tag.Plan (tag.optimize, tag.Plan.load) or tag.rewrite's result, "
                           f"got {type(plan).__name__}")
    if not plan.inputs:
        raise TagError("the plan has no batch inputs (placeholders of the batch) for a data set to fill")
    name = getattr(plan, "topology", "")
    meta = {"strategy": getattr(plan, "method", "") or "", "batch_size": int(plan.batch_size),
            "topology": name if isinstance(name, str) else getattr(name, "name", "")}
    kwargs = dict(fingerprint=plan.fingerprint, inputs=list(plan.inputs), batch_size=int(plan.batch_size),
                  steps=int(steps), checkpoint_dir=os.fspath(checkpoint_dir) if checkpoint_dir is not None else None,
                  checkpoint_every=int(checkpoint_every), resume=resume, eval_fn=eval_fn, eval_every=int(eval_every),
                  logdir=os.fspath(logdir) if logdir is not None else None, progress=progress, feeds=feeds,
                  checkpoint_meta=meta, seed=seed)
    setup_s = max(step_timeout_s or 0.0, 120.0) if step_timeout_s else None
    topo = _topology_of(plan, topology)
    programs = plan.programs()
    with reach_cluster(topo, target) as cluster:
        control = RunControl(step_timeout_s=step_timeout_s, setup_timeout_s=setup_s, watchdog=cluster.watchdog)
        return train_programs(programs, cluster, dataset_fn, control=control, **kwargs)


def load_weights(path: str | os.PathLike) -> dict:
    """The values of a TensorFlow checkpoint (a directory: its newest; or a prefix), by variable name."""
    from tag.backend.runtime.checkpoint import read_weights
    return read_weights(path)
