"""LocalCluster: one ``tag-worker`` process per host of a topology, started and stopped together.

Each worker runs ``python -m tag.cli.worker`` with ``TF_CONFIG`` naming its task, in its own process
group, with stdout/stderr in a temporary directory; start-up waits for every worker's ``ready``
line and open port. A host with ``port: 0`` gets a free port chosen at each start (``cluster.topology`` names it;
the start is tried again with new ports when another program takes one first). Workers are stopped on exit from
the ``with`` block, on errors, on Ctrl-C, at interpreter exit (``LIVE_CLUSTERS``),
and stop themselves when this process disappears.

Example::

    import tag
    from tag.backend.runtime.local_cluster import LocalCluster

    topo = tag.load_topology("topologies/localhost.pbtxt")
    with LocalCluster(topo, threads_per_worker=1) as cluster:
        print(cluster.target, cluster.pids)        # grpc://127.0.0.1:PORT of task 0, worker pids
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tag.backend.runtime.cluster_spec import JOB, ClusterError, cluster_dict, host_has_gpu
from tag.backend.runtime.live import LiveRegistry
from tag.backend.runtime.ports import free_ports, is_loopback, port_bindable, port_listening
from tag.backend.runtime.server import PORT_IN_USE, READY_WORD
from tag.cuda_noise import is_cuda_startup_noise

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.backend.runtime.host_process import HostLaunch
    from tag.backend.runtime.steps import RunResult
    from tag.cluster.topology import Host, Topology

WORKER_MODULE = "tag.cli.worker"          # run as ``sys.executable -m WORKER_MODULE``
LIVE_CLUSTERS = LiveRegistry("stop")      # clusters started and not yet stopped; stopped at exit
PORT_ATTEMPTS = 5                         # starts tried with new free ports when another program took one


class PortTaken(ClusterError):
    """A worker could not bind its port: another program listens there (taken after it was chosen, for port 0)."""


@dataclass
class _Worker:
    """One started worker process and the files its stdout and stderr go to."""

    host: "Host"
    proc: subprocess.Popen
    stdout_path: str
    stderr_path: str


class LocalCluster:
    """One ``tag-worker`` process per host of a topology, started together and stopped together.

    ``with LocalCluster(topo) as c: run_steps(gd, c.target)``. Workers run
    ``sys.executable -m tag.cli.worker`` with ``TF_CONFIG`` naming their task, each in its own process
    group; they are stopped (SIGTERM, then SIGKILL) on exit from the block, on errors, on Ctrl-C, at
    interpreter exit, and they stop themselves if this process disappears.

    Only loopback hosts are allowed unless ``allow_remote=True`` (the testbed uses that, together
    with ``launcher`` to start each worker inside its host's network namespace).
    ``threads_per_worker`` defaults to the CPU count divided by the number of hosts (at least 1),
    so co-located servers do not oversubscribe the cores. ``inter_threads_per_worker``: inter-op threads
    (default: as many as intra-op threads).
    """

    def __init__(self, topology: "Topology", *, threads_per_worker: int | None = None,
                 inter_threads_per_worker: int | None = None,
                 startup_timeout_s: float = 60.0, allow_remote: bool = False,
                 launcher: Callable[["Host"], list[str]] | None = None,
                 env: Mapping[str, str] | None = None):
        if not topology.hosts:
            raise ClusterError(f"topology {topology.name!r} has no hosts")
        if not allow_remote:
            remote = [f"{h.name} ({h.address})" for h in topology.hosts if not is_loopback(h.address)]
            if remote:
                raise ClusterError("LocalCluster starts workers on this machine only, but these hosts are not "
                                   f"loopback addresses: {', '.join(remote)}; run tag-worker on them instead")
        self.planned = topology           # as given: a host's port 0 is chosen anew at each start
        self._use(topology)
        n = len(topology.hosts)
        self.threads_per_worker = int(threads_per_worker or max(1, (os.cpu_count() or 1) // n))
        self.inter_threads_per_worker = inter_threads_per_worker
        self.startup_timeout_s = float(startup_timeout_s)
        self.launcher = launcher
        self.extra_env = dict(env or {})
        self._workers: list[_Worker] = []
        self._logdir: tempfile.TemporaryDirectory | None = None
        self._stop_lock = threading.Lock()

    def _use(self, topology: "Topology") -> None:
        """Serve TOPOLOGY (its ports known): the cluster spec and the target of task 0 follow it."""
        self.topology = topology
        self.cluster = cluster_dict(topology)
        task0 = min(topology.hosts, key=lambda h: h.task_index)
        self.target = f"grpc://{task0.address}:{task0.port}"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def start(self) -> "LocalCluster":
        """Start every worker and wait until all print ``ready`` and accept connections.

        Hosts with ``port: 0`` get free ports chosen now (``self.topology`` then names them). The ports are free
        when chosen, but another program may take one before the worker binds it (``free_ports`` cannot hold
        them for another process): then every worker is stopped and the start tried again with new ports, up to
        ``PORT_ATTEMPTS`` times."""
        if self._workers:
            raise ClusterError("this LocalCluster is already running")
        free = self.planned.free_port_hosts
        for attempt in range(1, (PORT_ATTEMPTS if free else 1) + 1):
            if free:
                self._use(self.planned.with_ports(dict(zip(free, free_ports(len(free), "0.0.0.0"), strict=True))))
            elif self.launcher is None:
                busy = [f"{h.name} {h.address}:{h.port}" for h in self.topology.hosts
                        if port_listening(h.address, h.port) or not port_bindable(h.port)]
                if busy:
                    raise ClusterError(f"port already in use for {', '.join(busy)} (a leftover tag-worker or "
                                       "another program?); stop it, change the ports in the topology, or give "
                                       "loopback hosts port: 0 (a free port chosen at start)")
            self._logdir = tempfile.TemporaryDirectory(prefix="tag-workers-")
            LIVE_CLUSTERS.add(self)
            try:
                for host in sorted(self.topology.hosts, key=lambda h: h.task_index):
                    self._workers.append(self._spawn(host))
                self._wait_ready()
                return self
            except PortTaken:
                self.stop()
                if not free or attempt == PORT_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _host_env(self, host: "Host") -> dict[str, str]:
        """The environment of a process on HOST: no GPUs where the topology declares none, this tag package."""
        env = dict(os.environ)
        env.update(self.extra_env)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["PYTHONUNBUFFERED"] = "1"
        if not host_has_gpu(self.topology, host.name):
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        # Make the child import this same tag package even when it is not installed: its parent directory
        # is three levels above this file's (tag/backend/runtime/local_cluster.py).
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def _spawn(self, host: "Host") -> _Worker:
        env = self._host_env(host)
        env["TF_CONFIG"] = json.dumps({"cluster": self.cluster, "task": {"type": JOB, "index": host.task_index}})
        cmd = [sys.executable, "-m", WORKER_MODULE, "--threads", str(self.threads_per_worker),
               "--parent-pid", str(os.getpid())]
        if self.inter_threads_per_worker is not None:
            cmd += ["--inter-threads", str(int(self.inter_threads_per_worker))]
        if self.launcher is not None:
            cmd = list(self.launcher(host)) + cmd
        assert self._logdir is not None
        out_path = os.path.join(self._logdir.name, f"task{host.task_index}.out")
        err_path = os.path.join(self._logdir.name, f"task{host.task_index}.err")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    start_new_session=True)
        return _Worker(host, proc, out_path, err_path)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(self._workers)
        while pending:
            for w in list(pending):
                rc = w.proc.poll()
                if rc is not None:
                    tail = self._tail(w.stderr_path)
                    error = PortTaken if PORT_IN_USE in tail else ClusterError
                    raise error(f"worker for host {w.host.name} ({w.host.address}:{w.host.port}) exited "
                                f"with code {rc} during start-up: {tail}")
                with open(w.stdout_path, "rb") as f:
                    ready = any(line.startswith(READY_WORD.encode()) for line in f)
                if ready and (self.launcher is not None or port_listening(w.host.address, w.host.port)):
                    pending.remove(w)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(w.host.name for w in pending)
                raise ClusterError(f"workers not ready after {self.startup_timeout_s:.0f} s: {names}")
            time.sleep(0.1)
        if self.launcher is not None:  # reachable from here? (testbed: across the bridge)
            while True:
                waiting = [w for w in self._workers if not port_listening(w.host.address, w.host.port, 0.5)]
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    names = ", ".join(f"{w.host.name} {w.host.address}:{w.host.port}" for w in waiting)
                    raise ClusterError(f"workers started but not reachable from here: {names}")
                time.sleep(0.1)

    @staticmethod
    def _tail(path: str) -> str:
        try:
            with open(path, "rb") as f:
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no output)"
        useful = [ln for ln in lines if not is_cuda_startup_noise(ln)]
        return (useful or lines or ["(no output)"])[-1]

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (SIGTERM to its process group, SIGKILL after TIMEOUT_S). Idempotent."""
        with self._stop_lock:
            workers, self._workers = self._workers, []
            for w in workers:
                if w.proc.poll() is None:
                    _signal_group(w.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for w in workers:
                try:
                    w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for w in workers:
                if w.proc.poll() is None:
                    _signal_group(w.proc.pid, signal.SIGKILL)
                    try:
                        w.proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        pass
            LIVE_CLUSTERS.discard(self)
            if self._logdir is not None:
                self._logdir.cleanup()
                self._logdir = None

    def host_launch(self, host_name: str) -> "HostLaunch":
        """How to start a process on host HOST_NAME as its worker was started (launcher prefix, environment),
        and that host's server target."""
        from tag.backend.runtime.host_process import HostLaunch
        host = next((h for h in self.topology.hosts if h.name == host_name), None)
        if host is None:
            raise ClusterError(f"host {host_name!r} is not in topology {self.topology.name!r}")
        prefix = tuple(self.launcher(host)) if self.launcher is not None else ()
        return HostLaunch(prefix, self._host_env(host), f"grpc://{host.address}:{host.port}")

    def run_one_device(self, graph_def: Any, **run: Any) -> "RunResult":
        """Run GRAPH_DEF, placed on one device, as a process of its own on that device's host
        (``tag.backend.runtime.one_device``): started as the host's worker is (launcher, environment) with the
        worker's threads, no server in between. RUN: ``run_one_device``'s keywords (steps, warmup, control...)."""
        from tag.backend.runtime.one_device import device_task, run_one_device, single_device
        device = single_device(graph_def)
        if device is None:
            raise ClusterError("run_one_device needs a graph placed on one device")
        task = device_task(device)
        host = next((h for h in self.topology.hosts if h.task_index == task), None)
        if host is None:
            raise ClusterError(f"the graph is placed on task {task}, which topology {self.topology.name!r} "
                               f"does not have")
        prefix = list(self.launcher(host)) if self.launcher is not None else []
        return run_one_device(graph_def, threads=self.threads_per_worker,
                              inter_threads=self.inter_threads_per_worker, prefix=prefix,
                              env=self._host_env(host), **run)

    def dead_worker(self) -> str | None:
        """A one-line message naming the first worker process that has exited, or None while all live.

        The watchdog of ``run_steps`` (``RunControl.watchdog``): a dead worker is reported at the next
        poll (a fraction of a second) instead of leaving a step blocked on it."""
        for w in list(self._workers):
            rc = w.proc.poll()
            if rc is None:
                continue
            how = f"killed by signal {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() \
                else f"exit code {rc}"
            tail = self._tail(w.stderr_path) if rc > 0 else ""    # a killed worker's last line is not why
            return (f"worker for host {w.host.name} ({w.host.address}:{w.host.port}) died ({how})"
                    + (f": {tail}" if tail and tail != "(no output)" else ""))
        return None

    def logs(self) -> dict[str, str]:
        """Host name -> the worker's stderr so far (for diagnosing a failed run)."""
        out = {}
        for w in self._workers:
            try:
                with open(w.stderr_path, "rb") as f:
                    out[w.host.name] = f.read().decode(errors="replace")
            except OSError:
                out[w.host.name] = ""
        return out


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
