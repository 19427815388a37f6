"""Run training graphs on TensorFlow's distributed runtime: clusters, worker servers, timed steps.

A cluster comes from a topology (each host's address, port and task index) or, without one, from
the ``TF_CONFIG`` environment variable. Every host runs one ``tf.distribute.Server`` in the job
``worker`` (``tag-worker``); a client session connected to task 0 runs the (rewritten) training graph,
whose ops carry ``/job:worker/task:T/device:TYPE:I`` device strings.

Example::

    import tag
    from tag.backend.runtime import LocalCluster, run_steps

    topo = tag.load_topology("topologies/localhost.pbtxt")
    with LocalCluster(topo) as cluster:          # one tag-worker process per host, stopped on exit
        result = run_steps(graph_def, cluster.target, steps=20, warmup=3)
    print(result.mean_step_time_s, result.losses[-1])

From a shell, one host's server: ``tag-worker --topo cluster.pbtxt --host gpu-node-2`` (or
``python -m tag.backend.runtime ...``); with ``TF_CONFIG`` set and no ``--topo``, the cluster and this
task come from ``TF_CONFIG``.

Note: TensorFlow's gRPC server listens on every interface of its network namespace at the port the
cluster names for its task; the address in the topology is where the others reach it.
"""
from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from tag.cli.common import run_cli
from tag.errors import GraphError, TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import tensorflow as tf

    from tag.cluster.topology import Host, Topology

JOB = "worker"
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"
READY_WORD = "ready"


class ClusterError(TagError):
    """The cluster cannot be formed or started (no cluster given, port in use, a worker failed)."""


def _tf():
    """Import TensorFlow on first use (keeps ``tag-worker`` bad-input errors fast)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


# ----------------------------------------------------------------------------------------------
# Cluster description and configs
# ----------------------------------------------------------------------------------------------

def cluster_dict(topology: "Topology | None" = None) -> dict[str, list[str]]:
    """``{"worker": ["addr:port", ...]}`` from the topology, or from ``TF_CONFIG`` when it is None.

    Plain data (no TensorFlow), so callers can build ``TF_CONFIG`` strings from it.
    """
    if topology is not None:
        if not topology.hosts:
            raise ClusterError(f"topology {topology.name!r} has no hosts")
        return {k: list(v) for k, v in topology.cluster_spec().items()}
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        raise ClusterError("no cluster: give a topology file (--topo) or set TF_CONFIG")
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ClusterError(f"TF_CONFIG is not valid JSON: {err}") from None
    cluster = cfg.get("cluster") if isinstance(cfg, dict) else None
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError('TF_CONFIG has no "cluster" entry (expected {"cluster": {"worker": ["host:port", ...]}, ...})')
    return {str(job): [str(a) for a in addrs] for job, addrs in cluster.items()}


def cluster_spec_from(topology: "Topology | None" = None) -> "tf.train.ClusterSpec":
    """The ``tf.train.ClusterSpec`` of the topology's hosts (job ``worker``, in task order).

    Without a topology the cluster comes from ``TF_CONFIG`` through
    ``tf.distribute.cluster_resolver.TFConfigClusterResolver``; neither given -> ``ClusterError``.
    """
    tf = _tf()
    if topology is not None:
        return tf.train.ClusterSpec(cluster_dict(topology))
    cluster_dict(None)  # validates TF_CONFIG with a clear message first
    spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    if not spec.jobs:
        raise ClusterError("TF_CONFIG names no jobs in its cluster")
    return spec


def session_config(*, intra_op_threads: int = 0, inter_op_threads: int = 0,
                   soft_placement: bool = False) -> "tf.compat.v1.ConfigProto":
    """ConfigProto for tag's servers and client sessions.

    Sets the collective group leader (task 0 of job ``worker``), which TF's collective ops need in
    client-session (TF1) mode, and isolates each session's resources so that two graphs run one
    after another on the same cluster (a plan, then its baseline) never share variables.
    Thread counts of 0 let TensorFlow choose; servers sharing one machine should get fewer.
    """
    tf = _tf()
    cfg = tf.compat.v1.ConfigProto()
    cfg.experimental.collective_group_leader = COLLECTIVE_LEADER
    cfg.isolate_session_state = True
    cfg.allow_soft_placement = bool(soft_placement)
    cfg.intra_op_parallelism_threads = int(intra_op_threads)
    cfg.inter_op_parallelism_threads = int(inter_op_threads)
    return cfg


# ----------------------------------------------------------------------------------------------
# tag-worker
# ----------------------------------------------------------------------------------------------

def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tag-worker",
        description="Start one host's TensorFlow server (job 'worker') and wait until SIGTERM/SIGINT.",
    )
    p.add_argument("--topo", metavar="FILE", help="cluster topology (.pbtxt); without it TF_CONFIG is used")
    p.add_argument("--host", metavar="NAME", help="which host of the topology this process serves")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="intra-op threads of this server (0: TensorFlow's default)")
    p.add_argument("--inter-threads", type=int, default=None, metavar="N",
                   help="inter-op threads (default: same as --threads)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _resolve_worker(args: argparse.Namespace) -> tuple[dict[str, list[str]], str, int, str, bool]:
    """(cluster dict, job, task index, label, has_gpu) for the worker command line."""
    if args.topo:
        if not args.host:
            raise TagError("--topo needs --host NAME (which host this process serves)")
        from tag.cluster.topology import load_topology

        topo = load_topology(args.topo)
        by_name = {h.name: h for h in topo.hosts}
        host = by_name.get(args.host)
        if host is None:
            raise TagError(f"{args.topo}: unknown host {args.host!r}; known hosts: {', '.join(by_name) or '(none)'}")
        has_gpu = any(d.host == host.name and d.tf_device_type == "GPU" for d in topo.devices)
        return cluster_dict(topo), JOB, host.task_index, f"{host.name} {host.address}:{host.port}", has_gpu
    if args.host:
        raise TagError("--host needs --topo FILE (with TF_CONFIG the task comes from TF_CONFIG)")
    cluster = cluster_dict(None)
    task = json.loads(os.environ["TF_CONFIG"]).get("task") or {}
    job, index = task.get("type"), task.get("index")
    if job is None or index is None:
        raise ClusterError('TF_CONFIG has no "task": {"type": ..., "index": ...} for this process')
    if job not in cluster:
        raise ClusterError(f"TF_CONFIG task type {job!r} is not a job of its cluster ({', '.join(cluster)})")
    try:
        index = int(index)
    except (TypeError, ValueError):
        raise ClusterError(f"TF_CONFIG task index {index!r} is not an integer") from None
    if not 0 <= index < len(cluster[job]):
        raise ClusterError(f"TF_CONFIG task index {index} out of range: job {job!r} has {len(cluster[job])} tasks")
    return cluster, str(job), index, f"{job}:{index} {cluster[job][index]}", True


def _worker_body(argv: Sequence[str]) -> int:
    args = _worker_parser().parse_args(argv)
    if args.threads < 0 or (args.inter_threads is not None and args.inter_threads < 0):
        raise TagError("--threads and --inter-threads must be >= 0")
    cluster, job, index, label, has_gpu = _resolve_worker(args)
    if not has_gpu and "tensorflow" not in sys.modules:
        # A CPU-only host: keep TF from probing (and reserving) GPUs that the topology does not declare.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    tf = _tf()
    inter = args.threads if args.inter_threads is None else args.inter_threads
    config = session_config(intra_op_threads=args.threads, inter_op_threads=inter)
    stop = threading.Event()

    def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                          protocol="grpc", config=config, start=True)
        except Exception as err:  # noqa: BLE001 - TF raises assorted types for bind failures
            text = str(err)
            if "address already in use" in text.lower() or "failed to start server" in text.lower() \
                    or "could not start" in text.lower():
                raise ClusterError(f"{label}: cannot start the TF server (port in use?): {text}") from None
            raise
        print(f"{READY_WORD} {label} {server.target}", flush=True)
        parent = args.parent_pid
        while not stop.wait(0.5):
            if parent is not None and os.getppid() != parent:
                break  # whoever started us is gone: do not linger as an orphan server
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``tag-worker --topo FILE --host NAME`` (or TF_CONFIG): run one host's TF server until stopped.

    Prints one line ``ready NAME ADDR:PORT grpc://...`` once the server listens, then waits for
    SIGTERM or SIGINT. Bad input (unknown host, no cluster) is one line on stderr, exit code 2.
    """
    rc = run_cli("tag-worker", _worker_body, argv)
    if argv is None:
        # Running as the console script: a started gRPC server can hang interpreter shutdown, so the
        # process ends here, right after its output is flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


# ----------------------------------------------------------------------------------------------
# LocalCluster: one worker process per host
# ----------------------------------------------------------------------------------------------

_LIVE_CLUSTERS: "set[LocalCluster]" = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_live() -> None:
    with _LIVE_LOCK:
        clusters = list(_LIVE_CLUSTERS)
    for c in clusters:
        try:
            c.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


atexit.register(_stop_all_live)


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """N TCP ports on ADDRESS that nothing listens on right now (the OS picks them)."""
    import socket
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind((address, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def is_loopback(address: str) -> bool:
    if address in ("localhost", "ip6-localhost"):
        return True
    try:
        infos = socket.getaddrinfo(address, None)
    except socket.gaierror:
        return False
    import ipaddress

    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _port_listening(address: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _port_bindable(port: int) -> bool:
    """Can a server bind PORT on every interface (as TF's gRPC server does)?"""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            return True
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            continue  # e.g. IPv6 disabled: try IPv4
        finally:
            s.close()
    return True


@dataclass
class _Worker:
    host: "Host"
    proc: subprocess.Popen
    stdout_path: str
    stderr_path: str


class LocalCluster:
    """One ``tag-worker`` process per host of a topology, started together and stopped together.

    ``with LocalCluster(topo) as c: run_steps(gd, c.target)``. Workers run
    ``sys.executable -m tag.backend.runtime`` with ``TF_CONFIG`` naming their task, each in its own process
    group; they are stopped (SIGTERM, then SIGKILL) on exit from the block, on errors, on Ctrl-C, at
    interpreter exit, and they stop themselves if this process disappears.

    Only loopback hosts are allowed unless ``allow_remote=True`` (the testbed uses that, together
    with ``launcher`` to start each worker inside its host's network namespace).
    ``threads_per_worker`` defaults to the CPU count divided by the number of hosts (at least 1),
    so co-located servers do not oversubscribe the cores.
    """

    def __init__(self, topology: "Topology", *, threads_per_worker: int | None = None,
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
        self.topology = topology
        n = len(topology.hosts)
        self.threads_per_worker = int(threads_per_worker or max(1, (os.cpu_count() or 1) // n))
        self.startup_timeout_s = float(startup_timeout_s)
        self.launcher = launcher
        self.extra_env = dict(env or {})
        self.cluster = cluster_dict(topology)
        task0 = min(topology.hosts, key=lambda h: h.task_index)
        self.target = f"grpc://{task0.address}:{task0.port}"
        self._workers: list[_Worker] = []
        self._logdir: tempfile.TemporaryDirectory | None = None
        self._stop_lock = threading.Lock()

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
        """Start every worker and wait until all print ``ready`` and accept connections."""
        if self._workers:
            raise ClusterError("this LocalCluster is already running")
        if self.launcher is None:
            busy = [f"{h.name} {h.address}:{h.port}" for h in self.topology.hosts
                    if _port_listening(h.address, h.port) or not _port_bindable(h.port)]
            if busy:
                raise ClusterError(f"port already in use for {', '.join(busy)} (a leftover tag-worker or another "
                                   "program?); stop it or change the ports in the topology")
        self._logdir = tempfile.TemporaryDirectory(prefix="tag-workers-")
        with _LIVE_LOCK:
            _LIVE_CLUSTERS.add(self)
        try:
            for host in sorted(self.topology.hosts, key=lambda h: h.task_index):
                self._workers.append(self._spawn(host))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, host: "Host") -> _Worker:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["TF_CONFIG"] = json.dumps({"cluster": self.cluster, "task": {"type": JOB, "index": host.task_index}})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["PYTHONUNBUFFERED"] = "1"
        has_gpu = any(d.host == host.name and d.tf_device_type == "GPU" for d in self.topology.devices)
        if not has_gpu:
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        # Make the child import this same tag package even when it is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "tag.backend.runtime", "--threads", str(self.threads_per_worker),
               "--parent-pid", str(os.getpid())]
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
                    raise ClusterError(f"worker for host {w.host.name} ({w.host.address}:{w.host.port}) exited "
                                       f"with code {rc} during start-up: {self._tail(w.stderr_path)}")
                with open(w.stdout_path, "rb") as f:
                    ready = any(line.startswith(READY_WORD.encode()) for line in f)
                if ready and (self.launcher is not None or _port_listening(w.host.address, w.host.port)):
                    pending.remove(w)
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(w.host.name for w in pending)
                raise ClusterError(f"workers not ready after {self.startup_timeout_s:.0f} s: {names}")
            time.sleep(0.1)
        if self.launcher is not None:  # reachable from here? (testbed: across the bridge)
            while True:
                waiting = [w for w in self._workers if not _port_listening(w.host.address, w.host.port, 0.5)]
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
        useful = [ln for ln in lines if "cuInit" not in ln and "cuda_" not in ln]
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
            with _LIVE_LOCK:
                _LIVE_CLUSTERS.discard(self)
            if self._logdir is not None:
                self._logdir.cleanup()
                self._logdir = None

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


# ----------------------------------------------------------------------------------------------
# Running training steps
# ----------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """Timed training steps. ``mean_step_time_s`` is the mean of ``step_times[warmup:]``."""

    mean_step_time_s: float
    step_times: list[float]
    losses: list[float]
    warmup: int
    values: dict[str, np.ndarray] = field(default_factory=dict)  # fetched after the last step

    def to_dict(self) -> dict:
        return {"mean_step_time_s": self.mean_step_time_s, "step_times": list(self.step_times),
                "losses": list(self.losses), "warmup": self.warmup}


def _op_and_tensor(graph, name: str, what: str):
    """Resolve NAME ("loss", "loss:0" or an op name) in GRAPH to (op, tensor-or-None)."""
    op_name, _, idx = name.partition(":")
    try:
        op = graph.get_operation_by_name(op_name)
    except KeyError:
        raise GraphError(f"the graph has no op named {op_name!r} (the {what})") from None
    if idx:
        return op, graph.get_tensor_by_name(name)
    return op, (op.outputs[0] if op.outputs else None)


def _readable(graph, tensor):
    """A tensor whose value can be fetched: resource-variable handles get a ReadVariableOp beside them."""
    tf = _tf()
    if tensor is None or tensor.dtype != tf.resource:
        return tensor
    with graph.as_default(), tf.device(tensor.op.device):
        return tf.raw_ops.ReadVariableOp(resource=tensor, dtype=tensor.op.get_attr("dtype"))


_V1_COLLECTIVES = {"CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastRecv"}
_KEY_ALLOC_LOCK = threading.Lock()
_NEXT_KEY = [0]


def _fresh_key() -> int:
    """A collective key no earlier run of this process used (start varies per process)."""
    with _KEY_ALLOC_LOCK:
        if _NEXT_KEY[0] == 0:
            _NEXT_KEY[0] = (1 << 24) + ((os.getpid() * 7919 + int(time.time())) % (1 << 20)) * 512
        _NEXT_KEY[0] += 1
        if _NEXT_KEY[0] >= (1 << 31) - 1:
            _NEXT_KEY[0] = 1 << 24
        return _NEXT_KEY[0]


def _input_positions(node, op_def, arg_names: Sequence[str]) -> dict[str, int]:
    """Position in NODE.input of each named single-tensor input argument."""
    pos, out = 0, {}
    for arg in op_def.input_arg:
        if arg.number_attr:
            count = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count = len(node.attr[arg.type_list_attr].list.type)
        else:
            count = 1
        if arg.name in arg_names and count == 1:
            out[arg.name] = pos
        pos += count
    return out


def fresh_collective_keys(graph_def: Any) -> Any:
    """A copy of GRAPH_DEF whose collective group and instance keys are new to this process's clusters.

    TF servers remember collective groups for their whole life: a later session that reuses a group
    key with other members aborts every collective on the cluster ("joining a group with size 2, but
    that group has size 3"). Renumbering the keys of each graph before it runs (same old key -> same
    new key, so the members of one collective still agree) lets one cluster run many graphs, e.g. a
    plan and then its baseline. Keys of V2 ops must come from Const nodes; when one does not, the graph
    is returned unchanged. ``run_steps`` calls this itself.
    """
    tf = _tf()
    from tensorflow.python.framework import op_def_registry, tensor_util

    nodes = {n.name: n for n in graph_def.node}
    plan = []  # (node index, kind, arg name, position or None)
    for idx, node in enumerate(graph_def.node):
        if node.op in _V1_COLLECTIVES:
            plan.extend((idx, "attr", k, None) for k in ("group_key", "instance_key") if k in node.attr)
        elif node.op.startswith("Collective") and node.op.endswith(("V2", "V3")):
            op_def = op_def_registry.get(node.op)
            if op_def is None:
                continue
            positions = _input_positions(node, op_def, ("group_key", "instance_key"))
            for k, p in positions.items():
                src = node.input[p].lstrip("^").split(":")[0]
                if src not in nodes or nodes[src].op != "Const":
                    return graph_def  # cannot renumber consistently: leave the graph as it is
                plan.append((idx, "input", k, p))
    if not plan:
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    maps: dict[str, dict[int, int]] = {"group_key": {}, "instance_key": {}}
    taken = set(nodes)
    for idx, kind, key, p in plan:
        node = out.node[idx]
        if kind == "attr":
            old = int(node.attr[key].i)
        else:
            old = int(tensor_util.MakeNdarray(nodes[node.input[p].split(":")[0]].attr["value"].tensor))
        new = maps[key].setdefault(old, _fresh_key())
        if kind == "attr":
            node.attr[key].i = new
            continue
        src = nodes[node.input[p].split(":")[0]]
        name = f"{node.name}/tag_{key}"
        while name in taken:
            name += "_"
        taken.add(name)
        const = out.node.add()
        const.name, const.op, const.device = name, "Const", node.device
        dtype = src.attr["dtype"].type
        const.attr["dtype"].type = dtype
        const.attr["value"].tensor.CopyFrom(
            tensor_util.make_tensor_proto(np.array(new, dtype=tf.dtypes.as_dtype(dtype).as_numpy_dtype)))
        node.input[p] = name
    return out


def random_input(name: str, dims: Sequence[int], dtype: Any, rng: np.random.Generator,
                 hint: str = "pass feeds= or input_fn= for it") -> np.ndarray:
    """A random batch for input NAME: floats ~ N(0, 1), integers and booleans in {0, 1} (valid class ids
    and token ids for any model). DTYPE is a tf.DType; HINT ends the error for an unsupported dtype."""
    np_dtype = dtype.as_numpy_dtype
    if dtype.is_floating:
        return rng.standard_normal(list(dims)).astype(np_dtype)
    if dtype.is_integer:
        return rng.integers(0, 2, size=list(dims)).astype(np_dtype)
    if dtype.is_bool:
        return rng.integers(0, 2, size=list(dims)).astype(bool)
    raise GraphError(f"placeholder {name!r} has dtype {dtype.name}, which tag cannot fill with random data; {hint}")


def _random_feed(op, rng: np.random.Generator) -> np.ndarray:
    shape = op.get_attr("shape")
    dims = None if shape.unknown_rank else [d.size for d in shape.dim]
    if dims is None or any(d < 0 for d in dims):
        raise GraphError(f"placeholder {op.name!r} has an unknown dimension (shape {dims if dims is not None else '?'}); "
                         "pass feeds= or input_fn= for it")
    return random_input(op.name, dims, op.get_attr("dtype"), rng)


def _synthetic_input(node) -> tuple[Any, Any]:
    """(initializer, per-step value) of an on-device variable standing in for placeholder NODE."""
    tf = _tf()
    dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
    shape = tf.TensorShape(node.attr["shape"].shape)
    dims = shape.as_list() if shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        raise GraphError(f"placeholder {node.name!r} has an unknown dimension (shape {dims if dims is not None else '?'}); "
                         "pass feeds= for it")
    with tf.device(node.device), tf.name_scope(f"tag_synthetic/{node.name}/"):
        if dtype.is_floating:
            value = tf.random.normal(dims, dtype=dtype)
        elif dtype.is_integer or dtype.is_bool:
            value = tf.random.uniform(dims, 0, 2, dtype=tf.int64 if dtype == tf.int64 else tf.int32)
            value = tf.cast(value, dtype) if value.dtype != dtype else value
        else:
            raise GraphError(f"placeholder {node.name!r} has dtype {dtype.name}, which tag cannot fill with random "
                             "data; pass feeds= for it")
        var = tf.compat.v1.Variable(value, trainable=False, use_resource=True, collections=[], name="batch")
        return var.initializer, var.value()


def run_steps(graph_def: Any, target: str, *, train_op: str = "train_op", loss: str | None = "loss",
              init: str | None = "init", steps: int = 20, warmup: int = 3,
              feeds: Mapping[str, Any] | None = None,
              input_fn: Callable[[int], Mapping[str, Any]] | None = None,
              config: Any = None, seed: int = 0, fetch_after: Sequence[str] = (),
              renumber_collectives: bool = True, synthetic: bool = False) -> RunResult:
    """Run STEPS training steps of GRAPH_DEF on TARGET ("grpc://host:port", or "" for in-process).

    Imports the graph into a fresh ``tf.Graph``, opens ``Session(target, config=session_config())``,
    runs INIT, then STEPS times ``[train_op, loss]``. Placeholders get fresh random batches each step
    (floats: standard normal; integers: values in [0, 2) so labels and token ids are valid), drawn
    from ``numpy.random.default_rng(seed)``, unless FEEDS (name -> value, every step) or
    ``INPUT_FN(step) -> {name: value}`` supply them. Only ``session.run`` is timed; the mean skips the
    first WARMUP steps. FETCH_AFTER names tensors (e.g. variables) read once after the last step
    into ``RunResult.values``. Collective keys are renumbered first (``fresh_collective_keys``) so
    that graphs run one after another on one cluster never clash; pass RENUMBER_COLLECTIVES=False to
    keep them.

    SYNTHETIC=True: instead of feeding, each placeholder (not in FEEDS) becomes a variable on the
    placeholder's own device holding one random batch of the same distribution, made at start-up and
    reused every step -- as synthetic-data benchmarks do, no input crosses the client connection or
    the network, so the step time is the training step alone.
    """
    if steps < 1:
        raise TagError(f"steps must be >= 1, got {steps}")
    if not 0 <= warmup < steps:
        raise TagError(f"warmup must be in [0, steps) = [0, {steps}), got {warmup}")
    tf = _tf()
    if isinstance(graph_def, (bytes, bytearray)):
        gd = tf.compat.v1.GraphDef()
        gd.ParseFromString(bytes(graph_def))
        graph_def = gd
    if renumber_collectives:
        graph_def = fresh_collective_keys(graph_def)
    graph = tf.Graph()
    input_map: dict[str, Any] = {}
    synthetic_init: list[Any] = []
    if synthetic:
        if input_fn is not None:
            raise TagError("synthetic=True and input_fn= exclude each other")
        fed = {k.split(":")[0] for k in (feeds or {}) if isinstance(k, str)}
        with graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            for node in graph_def.node:
                if node.op == "Placeholder" and node.name not in fed:
                    var_init, value = _synthetic_input(node)
                    input_map[f"{node.name}:0"] = value
                    synthetic_init.append(var_init)
    with graph.as_default():
        try:
            tf.compat.v1.import_graph_def(graph_def, input_map=input_map or None, name="")
        except (ValueError, TypeError) as err:
            raise GraphError(f"cannot import the graph: {err}") from None
    train = _op_and_tensor(graph, train_op, "training op")[0]
    loss_t = _op_and_tensor(graph, loss, "loss")[1] if loss else None
    init_op = _op_and_tensor(graph, init, "initializer")[0] if init else None
    after = [_readable(graph, _op_and_tensor(graph, n, "value to fetch")[1]) for n in fetch_after]

    def to_tensor(name):
        if not isinstance(name, str):
            return name
        return _op_and_tensor(graph, name, "fed tensor")[1]

    fixed = {to_tensor(k): v for k, v in (feeds or {}).items()}
    placeholders = [op for op in graph.get_operations()
                    if op.type == "Placeholder" and f"{op.name}:0" not in input_map]
    rng = np.random.default_rng(seed)

    def feed_for(step: int) -> dict:
        fd = dict(fixed)
        if input_fn is not None:
            fd.update({to_tensor(k): v for k, v in input_fn(step).items()})
        for op in placeholders:
            if op.outputs[0] not in fd:
                fd[op.outputs[0]] = _random_feed(op, rng)
        return fd

    cfg = config if config is not None else session_config()
    fetches = [train] + ([loss_t] if loss_t is not None else [])
    times: list[float] = []
    losses: list[float] = []
    values: dict[str, np.ndarray] = {}
    with tf.compat.v1.Session(target, graph=graph, config=cfg) as sess:
        if synthetic_init:
            sess.run(synthetic_init)
        if init_op is not None:
            sess.run(init_op)
        for step in range(steps):
            fd = feed_for(step)
            t0 = time.perf_counter()
            out = sess.run(fetches, feed_dict=fd)
            times.append(time.perf_counter() - t0)
            if loss_t is not None:
                losses.append(float(np.mean(out[1])))
        if after:
            values = dict(zip(fetch_after, sess.run(after)))
    return RunResult(float(np.mean(times[warmup:])), times, losses, warmup, values)


if __name__ == "__main__":
    worker_main()
