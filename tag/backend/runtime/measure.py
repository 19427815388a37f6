"""Deploy strategies on TensorFlow and time them: rewrite each plan, run it on the topology's cluster.

A topology whose hosts are all on loopback gets its workers started here (``LocalCluster``, stopped
on exit, error or Ctrl-C); otherwise every host's ``tag-worker`` must already be running (each must
answer within 30 s, ``wait_for_hosts``) and the client connects to task 0. Every run is guarded
(``tag.backend.runtime.guard``): a worker that dies is reported by host name, a step never blocks past
its deadline. Inputs are synthetic batches stored on the devices, so the time is the
training step alone. A plan placed on one device runs as a process of its own on its host where the
cluster can start one there (local workers: ``tag.backend.runtime.one_device``), with no TF server in
between, as a user would run it (``run_on``). ``tag-deploy --run`` uses this.

Example::

    from tag.backend.runtime.measure import measure_strategies

    runs = measure_strategies(graph_def, training_graph, topology, {"dp_allreduce": dp},
                              batch_size=64, steps=20, warmup=3)
    runs["dp_allreduce"].mean_step_time_s

    with open_cluster(topology) as cluster:       # several measurements on one cluster start
        first = measure_strategies(..., cluster=cluster)
        then = measure_strategies(..., cluster=cluster)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from tag.backend.runtime.guard import RunControl, RunEvent
from tag.backend.runtime.health import HOST_TIMEOUT_S, HostProbe, wait_for_hosts
from tag.backend.runtime.local_cluster import LocalCluster
from tag.backend.runtime.ports import is_loopback
from tag.backend.runtime.steps import RunResult, run_steps

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph
    from tag.strategy.types import Strategy


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster ready for runs: its session target, the watchdog naming a dead worker or host, and (local
    workers) ``LocalCluster.run_one_device``, which runs a one-device graph on its host with no server."""

    target: str
    watchdog: Callable[[], str | None]
    one_device: Callable[..., RunResult] | None = None


def run_on(cluster: Any, graph_def: Any, *, control: RunControl | None = None, **run: Any) -> RunResult:
    """``run_steps`` of GRAPH_DEF on synthetic batches on CLUSTER (a ``Cluster``, ``LocalCluster`` or running
    ``Testbed``): a graph placed on one device as a process of its own on its host when the cluster can start one
    (``one_device``), else through the cluster's servers. RUN: train_op, loss, init, steps, warmup."""
    from tag.backend.runtime.one_device import runs_alone
    one_device = one_device_runner(cluster)
    if one_device is not None and runs_alone(graph_def, control):
        return one_device(graph_def, control=control, **run)
    return run_steps(graph_def, cluster.target, synthetic=True, control=control, **run)


def one_device_runner(cluster: Any) -> Callable[..., RunResult] | None:
    """CLUSTER's way to run a one-device graph on its host (``LocalCluster.run_one_device``), or None (remote
    hosts, a bare session target)."""
    for obj in (cluster, getattr(cluster, "cluster", None)):
        fn = getattr(obj, "one_device", None) or getattr(obj, "run_one_device", None)
        if callable(fn):
            return fn
    return None


@contextlib.contextmanager
def open_cluster(topology: "Topology", *, say: Callable[[str], None] | None = None,
                 host_timeout_s: float = HOST_TIMEOUT_S) -> Iterator[Cluster]:
    """TOPOLOGY's cluster for the ``with`` block: local workers started (and stopped) for a loopback
    topology, else remote hosts that must all answer within HOST_TIMEOUT_S. SAY(text) hears what it does."""
    say = say or (lambda text: None)
    if all(is_loopback(h.address) for h in topology.hosts):
        say(f"starting {len(topology.hosts)} local TF workers")
        with LocalCluster(topology) as local:
            yield Cluster(local.target, local.dead_worker, local.run_one_device)
        return
    say(f"checking that the {len(topology.hosts)} hosts answer")
    wait_for_hosts(topology.hosts, timeout_s=host_timeout_s)
    first = min(topology.hosts, key=lambda h: h.task_index)
    probe = HostProbe(topology.hosts)
    try:
        yield Cluster(f"grpc://{first.address}:{first.port}", probe.dead_host)
    finally:
        probe.stop()


def measure_strategies(graph_def: Any, graph: "TrainingGraph", topology: "Topology",
                       strategies: Mapping[str, "Strategy"], *, batch_size: int, steps: int,
                       warmup: int, train_op: str = "train_op", loss: str | None = "loss",
                       init: str | None = "init",
                       controls: Mapping[str, RunControl] | None = None,
                       progress: Callable[[str, RunEvent], None] | None = None,
                       steps_of: Mapping[str, int] | None = None,
                       host_timeout_s: float = HOST_TIMEOUT_S,
                       cluster: Cluster | None = None) -> dict[str, RunResult]:
    """{name: RunResult} for each strategy of STRATEGIES, in order, all on one cluster of TOPOLOGY.

    ``train_op`` / ``loss`` / ``init`` name GRAPH_DEF's entry points (``tag.frontend.entry_points``
    finds them in any training graph). CONTROLS: name -> ``RunControl`` (deadlines, checkpoints,
    resume) of that strategy's run; its watchdog is set here (the local workers' processes, or a
    ``HostProbe`` of remote hosts). PROGRESS(name, RunEvent) sees every phase and step. Remote hosts
    must all answer within HOST_TIMEOUT_S before anything runs (``wait_for_hosts``). STEPS_OF: name ->
    its own number of steps (default STEPS; warm-up is cut to fit). CLUSTER: one already opened
    (``open_cluster``) instead of a cluster started for this call."""
    from tag.backend.rewrite import rewrite

    def say(name: str, text: str) -> None:
        if progress is not None:
            progress(name, RunEvent("phase", text))

    def measure_all(on: Cluster) -> dict[str, RunResult]:
        out = {}
        for name, strategy in strategies.items():
            say(name, "rewriting the graph")
            plan = rewrite(graph_def, graph, strategy, topology, batch_size=batch_size, train_op=train_op, loss=loss,
                           init=init)
            ctl = dataclasses.replace((controls or {}).get(name) or RunControl(), watchdog=on.watchdog)
            if progress is not None:
                ctl.progress = (lambda n: (lambda ev: progress(n, ev)))(name)
            n = int((steps_of or {}).get(name, steps))
            out[name] = run_on(on, plan.graph_def, train_op=plan.train_op, loss=plan.loss, init=plan.init,
                               steps=n, warmup=min(warmup, n - 1), control=ctl)
        return out

    if cluster is not None:
        return measure_all(cluster)
    first_name = next(iter(strategies), "")
    with open_cluster(topology, say=lambda text: say(first_name, text), host_timeout_s=host_timeout_s) as opened:
        return measure_all(opened)
