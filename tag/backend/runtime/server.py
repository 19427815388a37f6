"""One host's TensorFlow server: start it, say ``ready``, serve until SIGTERM/SIGINT or the parent is gone.

This is what ``tag-worker`` (``tag.cli.worker``) runs once it knows the cluster and its task. The
``ready NAME ADDR:PORT grpc://...`` line on stdout is how ``LocalCluster`` learns that a worker is up.

Example::

    from tag.backend.runtime.server import serve

    # blocks until SIGTERM/SIGINT; prints "ready h0 127.0.0.1:2222 grpc://localhost:2222"
    serve({"worker": ["127.0.0.1:2222"]}, "worker", 0, label="h0 127.0.0.1:2222", threads=1)
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from tag.backend.runtime.cluster_spec import ClusterError, import_tf, session_config

READY_WORD = "ready"
PORT_IN_USE = "cannot start the TF server (port in use?)"     # how a worker says that it could not bind its port
MIN_INTER_THREADS = 2    # default inter-op threads of a server given intra-op threads (serve)


def inter_threads_for(threads: int, inter_threads: int | None = None) -> int:
    """Inter-op threads of a process given THREADS intra-op threads: INTER_THREADS when given, else as many as
    THREADS and at least MIN_INTER_THREADS (0 stays 0: TensorFlow's default). See ``serve`` for why."""
    if inter_threads is not None:
        return int(inter_threads)
    return max(threads, MIN_INTER_THREADS) if threads > 0 else 0


def serve(cluster: dict[str, list[str]], job: str, index: int, *, label: str, threads: int = 0,
          inter_threads: int | None = None, has_gpu: bool = True, parent_pid: int | None = None) -> int:
    """Run task INDEX of JOB in CLUSTER until SIGTERM/SIGINT (or until PARENT_PID is no longer our parent).

    THREADS intra-op threads (0: TensorFlow's default), INTER_THREADS inter-op threads (None: as many as
    THREADS, at least 2: with one inter-op thread the closures that answer other tasks' tensor requests
    queue behind the local compute chain, which TF runs inline, so remote replicas wait for their inputs
    until it yields -- measured on a 3-host CPU testbed, a small CNN's data-parallel step took 330 ms with
    one inter-op thread and 205 ms with two).
    HAS_GPU=False hides GPUs from TensorFlow when it is not loaded yet (a CPU-only host).
    Returns 0; a port in use is a ClusterError.
    """
    if not has_gpu and "tensorflow" not in sys.modules:
        # A CPU-only host: keep TF from probing (and reserving) GPUs that the topology does not declare.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    tf = import_tf()
    config = session_config(intra_op_threads=threads, inter_op_threads=inter_threads_for(threads, inter_threads))
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
                raise ClusterError(f"{label}: {PORT_IN_USE}: {text}") from None
            raise
        print(f"{READY_WORD} {label} {server.target}", flush=True)
        while not stop.wait(0.5):
            if parent_pid is not None and os.getppid() != parent_pid:
                break  # whoever started us is gone: do not linger as an orphan server
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0
