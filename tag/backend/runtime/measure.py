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
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from tag.backend.runtime.guard import RunControl, RunEvent
from tag.backend.runtime.health import HOST_TIMEOUT_S, HostProbe, wait_for_hosts
from tag.backend.runtime.local_cluster import LocalCluster
from tag.backend.runtime.ports import is_loopback
from tag.backend.runtime.steps import RunResult
from tag.errors import RunError, TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import Topology
    from tag.ir.types import TrainingGraph
    from tag.strategy.types import Strategy


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster ready for runs: its session target (task 0), the watchdog naming a dead worker or host, every
    host's server target by name, and (local workers) how to start a process on each host (``LocalCluster``'s
    ``host_launch``) and ``run_one_device``, which runs a one-device graph on its host with no server."""

    target: str
    watchdog: Callable[[], str | None]
    one_device: Callable[..., RunResult] | None = None
    targets: Mapping[str, str] = dataclasses.field(default_factory=dict)
    host_launch: Callable[[str], Any] | None = None


def run_on(cluster: Any, rewritten: Any, *, control: RunControl | None = None, steps: int = 20, warmup: int = 3,
           seed: int = 0) -> RunResult:
    """STEPS steps of the rewritten step REWRITTEN (a ``RewriteResult``, or a Plan: its graph and its host programs) on
    synthetic batches on CLUSTER (a ``Cluster``, ``LocalCluster`` or running ``Testbed``). A graph placed on one
    device runs as a process of its own on its host when the cluster can start one (``one_device``); otherwise
    every host runs its own program (``tag.backend.runtime.host_run``): in a process on the host when the cluster
    can start one there, else in a thread here with a session on that host's server (remote hosts)."""
    from tag.backend.runtime.one_device import runs_alone
    rewritten = getattr(rewritten, "rewritten", rewritten)      # a Plan: its rewrite
    if steps < 1:
        raise TagError(f"steps must be >= 1, got {steps}")
    if not 0 <= warmup < steps:
        raise TagError(f"warmup must be in [0, steps) = [0, {steps}), got {warmup}")
    one_device = one_device_runner(cluster)
    if one_device is not None and runs_alone(rewritten.graph_def, control):
        return one_device(rewritten.graph_def, control=control, train_op=rewritten.train_op, loss=rewritten.loss,
                          init=rewritten.init, steps=steps, warmup=warmup, seed=seed)
    return run_programs(cluster, rewritten.programs(), fingerprint=rewritten.fingerprint, control=control,
                        steps=steps, warmup=warmup, seed=seed)


def run_programs(cluster: Any, programs: Mapping[str, Any], *, fingerprint: str, control: RunControl | None = None,
                 steps: int = 20, warmup: int = 3, seed: int = 0) -> RunResult:
    """Every host's program of PROGRAMS (host name -> ``HostProgram``) for STEPS steps on synthetic batches on
    CLUSTER, merged into one RunResult (a step's time is its slowest host's; the loss is the chief's)."""
    from tag.backend.runtime.host_process import run_in_processes
    from tag.backend.runtime.host_run import RunSpec
    from tag.backend.runtime.host_threads import run_in_threads
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    spec = RunSpec.new(programs, fingerprint=fingerprint, steps=steps, warmup=warmup, seed=seed,
                       **({"join_timeout_s": ctl.setup_timeout_s} if ctl.setup_timeout_s else {}))
    launch = host_launcher(cluster)
    if launch is not None:
        results = run_in_processes(programs, {name: launch(name) for name in programs}, spec, control=ctl)
    else:
        results = run_in_threads(programs, cluster_targets(cluster), spec, control=ctl)
    return merged_result(results, spec)


def merged_result(results: Mapping[str, Any], spec: Any) -> RunResult:
    """One RunResult of every host's HostResult: a step's time is its slowest host's, the losses the chief's."""
    chief = next(name for task, name in spec.hosts if task == spec.chief)
    count = min(len(r.step_times) for r in results.values())
    times = [max(r.step_times[k] for r in results.values()) for k in range(count)]
    skip = min(spec.warmup, max(0, count - 1))
    mean = float(np.mean(times[skip:])) if times else float("nan")
    return RunResult(mean, times, list(results[chief].losses), skip, start_step=results[chief].start_step,
                     run_metadata=_merged_trace([r.run_metadata for r in results.values()]))


def _merged_trace(traces: list) -> Any:
    """One RunMetadata holding every host's traced step (their devices' statistics side by side), or None."""
    traces = [t for t in traces if t]
    if not traces:
        return None
    from tag.backend.runtime.cluster_spec import import_tf
    tf = import_tf()
    merged = tf.compat.v1.RunMetadata()
    for data in traces:
        one = tf.compat.v1.RunMetadata()
        one.ParseFromString(data)
        merged.step_stats.dev_stats.extend(one.step_stats.dev_stats)
    return merged


def host_launcher(cluster: Any) -> Callable[[str], Any] | None:
    """CLUSTER's way to start a process on one of its hosts (``LocalCluster.host_launch``), or None (remote)."""
    for obj in (cluster, getattr(cluster, "cluster", None)):
        fn = getattr(obj, "host_launch", None)
        if callable(fn):
            return fn
    return None


def cluster_targets(cluster: Any) -> dict[str, str]:
    """Host name -> its server target ("grpc://addr:port") of CLUSTER."""
    targets = dict(getattr(cluster, "targets", None) or {})
    topology = getattr(cluster, "topology", None)
    if not targets and topology is not None:
        targets = {h.name: f"grpc://{h.address}:{h.port}" for h in topology.hosts}
    if not targets:
        raise RunError("this cluster names no host targets: run the plan through open_cluster or a LocalCluster")
    return targets


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
            yield Cluster(local.target, local.dead_worker, local.run_one_device, _targets(local.topology),
                          local.host_launch)
        return
    say(f"checking that the {len(topology.hosts)} hosts answer")
    wait_for_hosts(topology.hosts, timeout_s=host_timeout_s)
    first = min(topology.hosts, key=lambda h: h.task_index)
    probe = HostProbe(topology.hosts)
    try:
        yield Cluster(f"grpc://{first.address}:{first.port}", probe.dead_host, targets=_targets(topology))
    finally:
        probe.stop()


@contextlib.contextmanager
def reach_cluster(topology: "Topology", target: str | None = None, *, say: Callable[[str], None] | None = None,
                  ) -> Iterator[Cluster]:
    """TOPOLOGY's cluster for the ``with`` block: TARGET (a running cluster's "grpc://host:port") says its servers
    run already (no watchdog, every host's program run from here); None opens it (``open_cluster``)."""
    if target is None:
        with open_cluster(topology, say=say) as opened:
            yield opened
        return
    if topology.free_port_hosts:
        raise TagError(f"a running cluster's target was given, but {', '.join(topology.free_port_hosts)} of "
                       f"topology {topology.name!r} have port 0 (a free port chosen when tag starts them): give the "
                       f"topology with the ports its servers listen on")
    yield Cluster(target, lambda: None, targets=_targets(topology))


def _targets(topology: "Topology") -> dict[str, str]:
    return {h.name: f"grpc://{h.address}:{h.port}" for h in topology.hosts}


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
                ctl.progress = functools.partial(progress, name)
            n = int((steps_of or {}).get(name, steps))
            out[name] = run_on(on, plan, steps=n, warmup=min(warmup, n - 1), control=ctl)
        return out

    if cluster is not None:
        return measure_all(cluster)
    first_name = next(iter(strategies), "")
    with open_cluster(topology, say=lambda text: say(first_name, text), host_timeout_s=host_timeout_s) as opened:
        return measure_all(opened)
