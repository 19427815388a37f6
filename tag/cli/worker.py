"""``tag-worker``: run one host's TensorFlow server (job ``worker``) until SIGTERM/SIGINT.

With ``--topo FILE --host NAME`` the cluster and this task come from the topology; with neither,
from ``TF_CONFIG``. Prints one line ``ready NAME ADDR:PORT grpc://...`` once the server listens.
``LocalCluster`` starts its workers as ``python -m tag.cli.worker``.

Usage::

    tag-worker --topo cluster.pbtxt --host gpu-node-2 [--threads N]
    python -m tag.cli.worker --topo topologies/localhost.pbtxt --host localhost

    from tag.cli.worker import main
    main(["--topo", "c.pbtxt", "--host", "nope"])   # -> 2, "tag-worker: error: ... unknown host 'nope'"

Security: TensorFlow's gRPC server has no authentication and binds every interface (``0.0.0.0``/``[::]``
at the cluster's port; TF 2.21's ``ServerDef`` has a port but no bind address, and no ``experimental``
option changes that). The worker says so on stderr when it starts; run workers on a trusted network only.

Exit codes: 0 stopped by a signal, 2 bad input (one line on stderr, before TensorFlow loads), 1 anything else.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tag.backend.runtime.cluster_spec import JOB, cluster_dict, host_has_gpu, tf_config_task
from tag.backend.runtime.server import serve
from tag.cli.common import ArgumentParser, add_verbose, run_cli
from tag.errors import TagError

PROG = "tag-worker"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Start one host's TensorFlow server (job 'worker') and wait until SIGTERM/SIGINT.",
    )
    p.add_argument("--topo", metavar="FILE", help="cluster topology (.pbtxt); without it TF_CONFIG is used")
    p.add_argument("--host", metavar="NAME", help="which host of the topology this process serves")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="intra-op threads of this server (0: TensorFlow's default)")
    p.add_argument("--inter-threads", type=int, default=None, metavar="N",
                   help="inter-op threads (default: as many as --threads, at least 2)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    add_verbose(p)
    return p


def _resolve_task(args: argparse.Namespace) -> tuple[dict[str, list[str]], str, int, str, bool]:
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
        label = f"{host.name} {host.address}:{host.port}"
        return cluster_dict(topo), JOB, host.task_index, label, host_has_gpu(topo, host.name)
    if args.host:
        raise TagError("--host needs --topo FILE (with TF_CONFIG the task comes from TF_CONFIG)")
    cluster, job, index = tf_config_task()
    return cluster, job, index, f"{job}:{index} {cluster[job][index]}", True


def security_notice(address: str) -> str:
    """What every worker says when it starts: the server is open to anyone who reaches its port."""
    port = address.rsplit(":", 1)[-1]
    return (f"TensorFlow's gRPC server has no authentication and listens on every network interface of this "
            f"machine (port {port}), not only on {address}: anyone who can reach the port can run code here. "
            f"TensorFlow offers no option to bind one address (ServerDef has only a port). Run workers only "
            f"on a trusted network, or firewall port {port} to the cluster's hosts.")


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    if args.threads < 0 or (args.inter_threads is not None and args.inter_threads < 0):
        raise TagError("--threads and --inter-threads must be >= 0")
    cluster, job, index, label, has_gpu = _resolve_task(args)
    print(f"{PROG}: warning: {security_notice(cluster[job][index])}", file=sys.stderr, flush=True)
    return serve(cluster, job, index, label=label, threads=args.threads, inter_threads=args.inter_threads,
                 has_gpu=has_gpu, parent_pid=args.parent_pid)


def main(argv: Sequence[str] | None = None) -> int:
    """``tag-worker --topo FILE --host NAME`` (or TF_CONFIG): run one host's TF server until stopped.

    Prints one line ``ready NAME ADDR:PORT grpc://...`` once the server listens, then waits for
    SIGTERM or SIGINT. Bad input (unknown host, no cluster) is one line on stderr, exit code 2.
    """
    rc = run_cli(PROG, _body, argv)
    if argv is None:
        # Running as a program: a started gRPC server can hang interpreter shutdown, so the
        # process ends here, right after its output is flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    main()
