"""``tag-worker``: run one host's TensorFlow server (job ``worker``) until SIGTERM/SIGINT.

With ``--topo FILE --host NAME`` the cluster and this task come from the topology; with neither,
from ``TF_CONFIG``. Prints one line ``ready NAME ADDR:PORT grpc://...`` once the server listens.
``LocalCluster`` starts its workers as ``python -m tag.cli.worker``.

With ``--plan DIR --host NAME`` it runs that host's program of a saved plan beside its server instead, and
exits when the program's last step is done: started on every host of the plan, the hosts find each other
(their programs check that they run the same plan), train, and the chief host writes the checkpoints.

Usage::

    tag-worker --topo cluster.pbtxt --host gpu-node-2 [--threads N]
    python -m tag.cli.worker --topo topologies/localhost.pbtxt --host localhost
    tag-worker --plan plan/ --host gpu-node-2 --steps 1000 --input my_data:train_set --checkpoint-dir /shared/ckpt

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
    run = p.add_argument_group("running a saved plan (--plan DIR --host NAME on every host)")
    run.add_argument("--plan", metavar="DIR", help="run this host's program of the plan saved in DIR beside its "
                     "server, then exit (the cluster comes from the plan)")
    run.add_argument("--steps", type=int, default=20, metavar="N", help="--plan: training steps (default 20)")
    run.add_argument("--input", metavar="MODULE:FUNCTION", help="--plan: train on FUNCTION(ctx)'s data set on this "
                     "host (MODULE from the current directory or PYTHONPATH) instead of synthetic batches")
    run.add_argument("--checkpoint-dir", metavar="DIR", help="--plan: where the chief writes checkpoints (reachable "
                     "from the chief; --resume reads it on every host)")
    run.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="--plan: a checkpoint every K steps")
    run.add_argument("--resume", action="store_true", help="--plan: continue from the newest checkpoint")
    run.add_argument("--step-timeout", type=float, default=600.0, metavar="S",
                     help="--plan: fail a step that takes over S seconds (default 600)")
    run.add_argument("--join-timeout", type=float, default=600.0, metavar="S",
                     help="--plan: how long to wait for every host's program to start (default 600)")
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
        _check_fixed_ports(topo, args.topo)
        label = f"{host.name} {host.address}:{host.port}"
        return cluster_dict(topo), JOB, host.task_index, label, host_has_gpu(topo, host.name)
    if args.host:
        raise TagError("--host needs --topo FILE (with TF_CONFIG the task comes from TF_CONFIG)")
    cluster, job, index = tf_config_task()
    return cluster, job, index, f"{job}:{index} {cluster[job][index]}", True


def _check_fixed_ports(topology, where: str) -> None:
    """A host started by hand must know every host's port: ``port: 0`` (chosen when tag starts the hosts itself)
    is refused here, naming WHERE."""
    if topology.free_port_hosts:
        raise TagError(f"{where}: {', '.join(topology.free_port_hosts)} have port 0, a free port that only tag "
                       f"chooses when it starts the hosts itself (tag-deploy --run, tag.train); give tag-worker a "
                       f"topology with fixed ports")


def security_notice(address: str) -> str:
    """What every worker says when it starts: the server is open to anyone who reaches its port."""
    port = address.rsplit(":", 1)[-1]
    return (f"TensorFlow's gRPC server has no authentication and listens on every network interface of this "
            f"machine (port {port}), not only on {address}: anyone who can reach the port can run code here. "
            f"TensorFlow offers no option to bind one address (ServerDef has only a port). Run workers only "
            f"on a trusted network, or firewall port {port} to the cluster's hosts.")


def _run_plan(args: argparse.Namespace) -> int:
    """``--plan DIR --host NAME``: this host's server and program, until the program's last step."""
    from tag.backend.runtime.cluster_spec import import_tf, session_config
    from tag.backend.runtime.guard import RunControl
    from tag.backend.runtime.health import HostProbe
    from tag.backend.runtime.host_run import RunSpec, run_host
    from tag.backend.runtime.server import inter_threads_for
    from tag.cli.deploy_progress import ProgressPrinter
    from tag.plan import Plan
    if not args.host:
        raise TagError("--plan needs --host NAME (which host of the plan this process runs)")
    if args.topo:
        raise TagError("--plan takes the cluster from the plan; leave out --topo")
    for flag, value in (("--steps", args.steps), ("--step-timeout", args.step_timeout),
                        ("--join-timeout", args.join_timeout)):
        if not value > 0:
            raise TagError(f"{flag} must be positive, got {value:g}")
    if args.checkpoint_every < 0 or (args.checkpoint_every and not args.checkpoint_dir):
        raise TagError("--checkpoint-every K needs K >= 0 and --checkpoint-dir DIR")
    if args.resume and not args.checkpoint_dir:
        raise TagError("--resume needs --checkpoint-dir DIR")
    plan = Plan.load(args.plan)
    _check_fixed_ports(plan.cluster, f"the plan's cluster ({args.plan})")
    program = plan.program(args.host)
    dataset_fn = None
    if args.input:
        from tag.cli.deploy_input import load_dataset_fn
        dataset_fn = load_dataset_fn(args.input)
    programs = {h: plan.program(h) for h in plan.hosts}
    # one run id on every host whatever plan it was given (its servers are this process's own, fresh): hosts
    # given different plans still meet in the handshake, and learn it there
    spec = RunSpec.new(programs, fingerprint=plan.fingerprint, steps=args.steps, run_id="worker",
                       join_timeout_s=args.join_timeout)
    if dataset_fn is not None:
        program = _with_pipeline(plan, programs, program, dataset_fn, spec, args)
    host = next(h for h in plan.cluster.hosts if h.name == args.host)
    cluster = {"worker": [f"{h.address}:{h.port}" for h in sorted(plan.cluster.hosts, key=lambda h: h.task_index)]}
    print(f"{PROG}: warning: {security_notice(cluster['worker'][host.task_index])}", file=sys.stderr, flush=True)
    if not host_has_gpu(plan.cluster, host.name) and "tensorflow" not in sys.modules:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    tf = import_tf()
    config = session_config(intra_op_threads=args.threads,
                            inter_op_threads=inter_threads_for(args.threads, args.inter_threads))
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=JOB, task_index=host.task_index,
                                  config=config, start=True)
    others = [h for h in plan.cluster.hosts if h.name != host.name]
    probe = HostProbe(others) if others else None
    printer = ProgressPrinter(prog=PROG)
    chief = program.task == spec.chief
    control = RunControl(progress=lambda ev: printer(host.name, _own(ev, host.name)) if chief or ev.kind == "phase"
                         else None,
                         watchdog=probe.dead_host if probe else None, step_timeout_s=args.step_timeout,
                         setup_timeout_s=max(args.step_timeout, 120.0),
                         checkpoint_every=args.checkpoint_every or (args.steps if args.checkpoint_dir else 0),
                         checkpoint_path=args.checkpoint_dir, resume_from=args.checkpoint_dir if args.resume else None,
                         checkpoint_meta={"plan": plan.fingerprint, "batch_size": plan.batch_size})
    try:
        result = run_host(program, server.target, spec, control=control)
    finally:
        if probe is not None:
            probe.stop()
    last = f", loss {result.losses[-1]:.4g}" if result.losses else ""
    print(f"{PROG}: {host.name}: done, {result.steps_done} steps{last}", file=sys.stderr, flush=True)
    return 0


def _own(ev, host: str):
    """EV with its text's leading "HOST: " dropped (the printer names the host already)."""
    import dataclasses
    prefix = f"{host}: "
    return dataclasses.replace(ev, text=ev.text[len(prefix):]) if ev.text.startswith(prefix) else ev


def _with_pipeline(plan, programs, program, dataset_fn, spec, args):
    """PROGRAM with this host's input pipeline (``attach_pipeline``; every host works the pipelines out alike)."""
    from tag.backend.rewrite.collectives import collective_group_key
    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    from tag.backend.runtime.input_pipeline import attach_pipeline, host_pipeline_specs
    specs = host_pipeline_specs(programs)
    order = sorted(specs, key=lambda h: specs[h].lo)
    start = int(read_checkpoint_meta(args.checkpoint_dir)["step"]) if args.resume else 0
    return attach_pipeline(program, dataset_fn, spec=specs.get(args.host),
                           pipeline_id=order.index(args.host) if args.host in specs else -1, pipelines=len(order),
                           global_batch=plan.batch_size, inputs=list(plan.inputs), host_cpus=spec.host_cpus(),
                           group_key=collective_group_key(spec.host_cpus()) ^ 0x3C3C3C, start_step=start)


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    if args.threads < 0 or (args.inter_threads is not None and args.inter_threads < 0):
        raise TagError("--threads and --inter-threads must be >= 0")
    if args.plan:
        return _run_plan(args)
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
