"""The rewriter's entry point: ``rewrite`` runs the passes and returns a ``RewriteResult``.

``rewrite`` builds the shared state (``context.RewriteState``) and runs the passes of ``passes.PASSES`` on
it, each a function of one concern module with the fields it reads and writes: set up the pipeline's
micro-batches (if any), prune and order the graph, find batch-following constants, flag batch/gradient-
dependent ops, check the pipeline's stage order, place variables, place instances, check the seeds, start
the output graph, plan SFB, gradient fusion and dense sparse sums, emit the instances, the fused
collectives and the counts, enforce the pipeline's schedule, send remote input slices first, fetch, and
assemble the result (checking that it imports).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite.api import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    res.notes                          # what the rewrite added (slices, collectives, ...)
"""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import tensorflow as tf

from tag.strategy.types import Strategy

from .context import RewriteState
from .passes import run_passes
from .result import RewriteResult

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph

__all__ = ["RewriteResult", "rewrite"]


def rewrite(graph_def: "tf.compat.v1.GraphDef", graph: "TrainingGraph", strategy: Strategy,
            topology: "Topology", *, batch_size: int | None = None, train_op: str = "train_op",
            loss: str | None = "loss", init: str | None = "init", fuse_allreduce: bool = True,
            validate: bool = True) -> RewriteResult:
    """Rewrite GRAPH_DEF (analysed as GRAPH) to run STRATEGY on TOPOLOGY; returns a RewriteResult.

    ``batch_size`` overrides the global batch (default: ``graph.batch_size``). ``train_op``, ``loss``
    and ``init`` name the original ops to keep runnable (``loss``/``init`` may be absent).
    ``fuse_allreduce``: the gradients of each allreduce op group are summed by one collective over a
    concatenated buffer per fusion bucket (``tag.strategy.fusion``: the groups on the same replicas, up to
    16 MB; as the simulator models it) instead of one collective per variable. With
    ``validate`` the result is imported into a fresh ``tf.Graph`` (shape inference) before it is
    returned. Raises RewriteError (naming the op) for what cannot be rewritten and StrategyError
    when the strategy does not fit the graph or the topology.
    """
    # The rewrite allocates many small objects; with large graphs alive in the process, cyclic GC passes
    # would dominate its run time (seconds), and it creates no reference cycles worth collecting.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        st = RewriteState(graph_def, graph, strategy, topology, batch_size, train_op, loss, init, fuse_allreduce,
                          validate)
        run_passes(st)
        return st.result
    finally:
        if was_enabled:
            gc.enable()
