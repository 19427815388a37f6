"""The rewriter's entry point: ``rewrite`` runs the passes and returns a ``RewriteResult``.

``Rewriter`` combines the concerns, each a mixin over ``RewriteContext`` in its own module:
``placement`` (which instances each op gets), ``variables``, ``batch_split``, ``instances`` (emission
and input resolution), ``loop_state`` (per-batch copies of loop bodies), ``collectives``, ``parameter_server``,
``sfb``, ``pipeline`` and ``loss``. The passes run in this order: set up the pipeline's micro-batches (if
any), prune and order the graph, find batch-following constants, flag batch/gradient-dependent ops, check
the pipeline's stage order, place variables, place instances, emit, enforce the pipeline's schedule, fetch,
check the result imports.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tag.errors import RewriteError
from tag.strategy.types import Strategy

from .batch_split import BatchSplitMixin
from .collectives import CollectivesMixin
from .graph_edit import check_imports
from .instances import InstancesMixin
from .loop_state import LoopStateMixin
from .loss import LossMixin
from .parameter_server import ParameterServerMixin
from .pipeline import PipelineMixin
from .placement import PlacementMixin
from .programs import split_programs
from .sfb import SfbMixin
from .variables import VariablesMixin

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph

    from .programs import HostProgram


@dataclass
class RewriteResult:
    """A rewritten training step and the names to run it by.

    ``inputs``: the original batch placeholders (full global batch; replicas slice them).
    ``train_op`` / ``loss`` / ``init``: op names to run (the loss is the global-batch mean).
    ``variables``: original variable name -> names of its copies in ``graph_def``.
    ``devices``: TF device string of every device that runs something.
    ``replicas``: replicated op group -> [(device index, first example, end example), ...].
    """

    graph_def: "tf.compat.v1.GraphDef"
    train_op: str
    loss: str | None
    init: str | None
    inputs: list[str]
    batch_size: int
    variables: dict[str, list[str]] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replicas: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    topology: "Topology | None" = field(default=None, repr=False)
    _programs: dict = field(default_factory=dict, repr=False)      # cache: "programs", "fingerprint"

    def copies(self, variable: str) -> list[str]:
        """Names of the copies of VARIABLE (one per replica for allreduce groups)."""
        return list(self.variables[variable])

    @property
    def fingerprint(self) -> str:
        """A digest of the rewritten step: hosts running programs cut from different rewrites tell them apart."""
        if "fingerprint" not in self._programs:
            import hashlib
            self._programs["fingerprint"] = hashlib.sha256(
                self.graph_def.SerializeToString(deterministic=True)).hexdigest()
        return self._programs["fingerprint"]

    def programs(self) -> "dict[str, HostProgram]":
        """Every host's program (``tag.backend.rewrite.programs``), host name -> HostProgram (cut on first use)."""
        if "programs" not in self._programs:
            if self.topology is None:
                raise RewriteError("this rewrite result has no topology to cut host programs for")
            self._programs["programs"] = split_programs(self, self.topology)
        return dict(self._programs["programs"])

    def program(self, host: "str | int") -> "HostProgram":
        """The program of HOST (a host name or task index); RewriteError for a host the topology lacks."""
        programs = self.programs()
        if isinstance(host, str) and host in programs:
            return programs[host]
        if isinstance(host, int) and not isinstance(host, bool):
            for p in programs.values():
                if p.task == host:
                    return p
        raise RewriteError(f"host {host!r} is not in the plan (hosts: {', '.join(sorted(programs))})")


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
        return Rewriter(graph_def, graph, strategy, topology, batch_size, train_op, loss, init,
                        fuse_allreduce).run(validate)
    finally:
        if was_enabled:
            gc.enable()


class Rewriter(PipelineMixin, LossMixin, SfbMixin, ParameterServerMixin, CollectivesMixin, InstancesMixin,
               LoopStateMixin,
               BatchSplitMixin, VariablesMixin, PlacementMixin):
    """One rewrite: the context (constructor arguments as for ``rewrite``) plus every concern."""

    def run(self, validate: bool) -> RewriteResult:
        """Run the passes; with VALIDATE, check that the result imports."""
        self._setup_pipeline()
        self._prune_and_order()
        self._const_rules()
        self._flags()
        self._check_pipeline_order()
        self._place_variables()
        self._place_all()
        self._check_seeds()
        self._emit_all()
        self._enforce_schedule()
        self._send_remote_slices_first()
        fetch_train, fetch_loss, fetch_init = self._fetches()
        out = graph_pb2.GraphDef()
        out.versions.CopyFrom(self.graph_def.versions)
        out.library.CopyFrom(self.graph_def.library)    # the function library is copied unchanged,
        out.library.function.extend(getattr(self, "added_functions", []))   # plus per-batch loop bodies
        out.node.extend(self.out_nodes)
        if validate:
            check_imports(out)
        devices = sorted({n.device for n in out.node if n.device})
        variables = {v: [i.name for i in self.instances[v]] for v in self.var_copies}
        replicas = {}
        for g, a in enumerate(self.strategy.actions):
            if a.mode != "partition":
                devs, ranges = self._replicas(g)
                replicas[g] = [(d, r[0], r[1]) for d, r in zip(devs, ranges, strict=True)]
        replicas.update(self._pipeline_replicas())
        return RewriteResult(out, fetch_train, fetch_loss, fetch_init, list(self.inputs), self.batch,
                             variables, devices, self.notes, replicas, self.topo)
