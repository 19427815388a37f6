"""The rewrite's result: the rewritten GraphDef and the names to run it by (``RewriteResult``), assembled
from the rewriter's state by the last pass (``assemble``).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    res.program(0).graph_def           # the first host's part of the step
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tag.errors import RewriteError

from . import pipeline
from .context import RewriteState
from .graph_edit import check_imports
from .programs import split_programs

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology

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


def assemble(st: RewriteState) -> None:
    """``result``: the output nodes under the original versions and function library (plus the per-batch
    loop bodies), the fetches, variable copies, devices, notes and replicas; with ``validate``, checked to
    import."""
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(st.graph_def.versions)
    out.library.CopyFrom(st.graph_def.library)    # the function library is copied unchanged,
    out.library.function.extend(st.added_functions)   # plus per-batch loop bodies
    out.node.extend(st.out_nodes)
    if st.validate:
        check_imports(out)
    devices = sorted({n.device for n in out.node if n.device})
    variables = {v: [i.name for i in st.instances[v]] for v in st.var_copies}
    replicas = {}
    for g, a in enumerate(st.strategy.actions):
        if a.mode != "partition":
            devs, ranges = st.replicas(g)
            replicas[g] = [(d, r[0], r[1]) for d, r in zip(devs, ranges, strict=True)]
    replicas.update(pipeline.pipeline_replicas(st))
    st.result = RewriteResult(out, st.fetch_train, st.fetch_loss, st.fetch_init, list(st.inputs), st.batch,
                              variables, devices, st.notes, replicas, st.topo)
