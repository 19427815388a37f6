"""Deploy strategies on TensorFlow and time them: rewrite each plan, run it on the topology's cluster.

A topology whose hosts are all on loopback gets its workers started here (``LocalCluster``, stopped
on exit, error or Ctrl-C); otherwise every host's ``tag-worker`` must already be running and the
client connects to task 0. Inputs are synthetic batches stored on the devices, so the time is the
training step alone. ``tag-deploy --run`` uses this.

Example::

    from tag.backend.runtime.measure import measure_strategies

    runs = measure_strategies(graph_def, training_graph, topology, {"dp_allreduce": dp},
                              batch_size=64, steps=20, warmup=3)
    runs["dp_allreduce"].mean_step_time_s
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from tag.backend.runtime.local_cluster import LocalCluster
from tag.backend.runtime.ports import is_loopback
from tag.backend.runtime.steps import RunResult, run_steps

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph
    from tag.strategy.types import Strategy


def measure_strategies(graph_def: Any, graph: "TrainingGraph", topology: "Topology",
                       strategies: Mapping[str, "Strategy"], *, batch_size: int, steps: int,
                       warmup: int, train_op: str = "train_op", loss: str | None = "loss",
                       init: str | None = "init") -> dict[str, RunResult]:
    """{name: RunResult} for each strategy of STRATEGIES, in order, all on one cluster of TOPOLOGY.

    ``train_op`` / ``loss`` / ``init`` name GRAPH_DEF's entry points (``tag.frontend.entry_points``
    finds them in any training graph)."""
    from tag.backend.rewrite import rewrite

    def measure_all(target: str) -> dict[str, RunResult]:
        out = {}
        for name, strategy in strategies.items():
            plan = rewrite(graph_def, graph, strategy, topology, batch_size=batch_size, train_op=train_op, loss=loss,
                           init=init)
            out[name] = run_steps(plan.graph_def, target, train_op=plan.train_op, loss=plan.loss, init=plan.init,
                                  steps=steps, warmup=warmup, synthetic=True)
        return out

    if all(is_loopback(h.address) for h in topology.hosts):
        with LocalCluster(topology) as cluster:
            return measure_all(cluster.target)
    first = min(topology.hosts, key=lambda h: h.task_index)
    return measure_all(f"grpc://{first.address}:{first.port}")
