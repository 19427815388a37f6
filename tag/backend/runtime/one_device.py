"""A program placed on one device, run as a process of its own on that device's host: no TF server in between.

A plan that puts every op on one device needs no cluster, and a user would not start one for it: they would run
the training step in one process on that host. Through tag's servers the same step pays a master, a worker
session and gRPC calls every step: the transformer's one-device step (batch 384) measured 586 ms through its
server against 557 ms in a process of its own on the same testbed host (a host-drift probe,
docs/measured/issue22-e2e). So a cluster that can start a process on the device's host (``LocalCluster``:
loopback hosts, or the testbed's namespaces) runs such a program here, as its worker would, with the same
threads and environment; remote clusters keep the server path.

The child process gets the graph with its devices stripped of job and task (``localized``) and runs
``run_steps`` on an in-process session; its progress events come back as JSON lines, so a run here reports,
checkpoints and resumes as one through a server does (a traced step, whose statistics are a protobuf of the
child, stays on the server path: ``runs_alone``).

Example::

    from tag.backend.runtime.one_device import run_one_device, single_device

    if single_device(rewritten.graph_def) is not None:          # "/job:worker/task:0/device:CPU:0"
        result = run_one_device(rewritten.graph_def, threads=1, steps=20, warmup=3,
                                train_op=rewritten.train_op, loss=rewritten.loss, init=rewritten.init)
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Mapping, Sequence

from tag.backend.runtime.guard import RunControl, RunEvent
from tag.backend.runtime.steps import RunResult
from tag.cuda_noise import is_cuda_startup_noise
from tag.errors import RunError, TagError

START_ALLOWANCE_S = 120.0   # the child's Python and TensorFlow start before its first event
NO_DEADLINE_S = 3600.0      # the longest wait for the next event when the control sets no deadline
CONTROL_FIELDS = ("step_timeout_s", "setup_timeout_s", "checkpoint_every", "checkpoint_path", "checkpoint_meta",
                  "resume_from")   # what a child's RunControl carries over (plain data)


def _parts(device: str) -> dict[str, str]:
    """{"job": .., "replica": .., "task": .., "device": "CPU:0"} of a device string (the parts it names)."""
    out: dict[str, str] = {}
    for part in device.strip("/").split("/"):
        key, _, value = part.partition(":")
        if key.lower() in ("cpu", "gpu"):             # the legacy "/cpu:0" form
            key, value = "device", f"{key.upper()}:{value}"
        if key and value:
            out[key.lower()] = value
    return out


def single_device(graph_def: Any) -> str | None:
    """The one device every placed node of GRAPH_DEF is on ("/job:worker/task:0/device:CPU:0"), or None when the
    nodes are on several devices or none is placed."""
    seen: set[tuple[str | None, ...]] = set()
    first = None
    for node in graph_def.node:
        if not node.device:
            continue
        p = _parts(node.device)
        seen.add((p.get("job"), p.get("task", "0"), p.get("device", "CPU:0").upper()))
        first = first or node.device
        if len(seen) > 1:
            return None
    return first


def device_task(device: str) -> int:
    """The task index a device string names (0 when it names none)."""
    return int(_parts(device).get("task", "0"))


def localized(graph_def: Any) -> Any:
    """A copy of GRAPH_DEF whose device strings keep only the device ("/device:CPU:0"): the graph as an in-process
    session on the device's host places it."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.device:
            node.device = "/device:" + _parts(node.device).get("device", "CPU:0").upper()
    return out


def runs_alone(graph_def: Any, control: RunControl | None = None) -> bool:
    """Whether ``run_one_device`` can run GRAPH_DEF under CONTROL: one device, and no traced step."""
    return (control is None or control.trace_step is None) and single_device(graph_def) is not None


def run_one_device(graph_def: Any, *, train_op: str = "train_op", loss: str | None = "loss",
                   init: str | None = "init", steps: int = 20, warmup: int = 3, seed: int = 0,
                   threads: int = 0, inter_threads: int | None = None, prefix: Sequence[str] = (),
                   env: Mapping[str, str] | None = None, control: RunControl | None = None) -> RunResult:
    """``run_steps`` of one-device GRAPH_DEF on synthetic batches, in a child process started behind PREFIX (a
    testbed host's namespace and cgroup; nothing for this machine) with ENV, THREADS intra-op and INTER_THREADS
    inter-op threads (``serve``'s rule when None). CONTROL's deadlines bound every wait for the child's next
    event, its progress callback hears them all, and its checkpoint settings apply in the child."""
    from tag.backend.runtime.server import inter_threads_for
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    if ctl.trace_step is not None:
        raise TagError("a traced step cannot run in a process of its own; run it through the cluster's server")
    with tempfile.TemporaryDirectory(prefix="tag-one-device-") as tmp:
        graph_path = os.path.join(tmp, "graph.pb")
        with open(graph_path, "wb") as f:
            f.write(localized(graph_def).SerializeToString())
        spec = {"graph": graph_path, "train_op": train_op, "loss": loss, "init": init, "steps": int(steps),
                "warmup": int(warmup), "seed": int(seed), "threads": int(threads),
                "inter_threads": inter_threads_for(int(threads), inter_threads),
                "control": {k: getattr(ctl, k) for k in CONTROL_FIELDS}}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [*prefix, sys.executable, "-m", __name__, "--spec", spec_path]
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        child_env["PYTHONUNBUFFERED"] = "1"
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                    env=child_env, text=True, start_new_session=True)
            try:
                return _follow(proc, ctl, err)
            finally:
                _stop(proc)


def _follow(proc: subprocess.Popen, ctl: RunControl, err: Any) -> RunResult:
    """Relay the child's events to CTL until its result; RunError when it fails, dies or misses a deadline."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    wait_s = max(ctl.setup_timeout_s or NO_DEADLINE_S, START_ALLOWANCE_S)
    while True:
        try:
            line = lines.get(timeout=wait_s)
        except queue.Empty:
            raise RunError(f"the one-device run sent nothing for {wait_s:.0f} s (a step or its set-up past its "
                           f"deadline); stopped it") from None
        if line is None:
            proc.wait(timeout=30)
            err.seek(0)
            tail = " ".join(" ".join(ln.split()) for ln in err.read().splitlines()
                            if ln.strip() and not is_cuda_startup_noise(ln))[-800:]
            raise RunError(f"the one-device run exited (rc {proc.returncode}) without a result: {tail}")
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if "event" in msg:
            event = RunEvent(**msg["event"])
            ctl.emit(event)
            wait_s = (ctl.step_timeout_s if event.kind == "step" else ctl.setup_timeout_s) or NO_DEADLINE_S
        elif "error" in msg:
            raise (TagError if msg.get("kind") == "TagError" else RunError)(msg["error"])
        elif "result" in msg:
            r = msg["result"]
            return RunResult(r["mean_step_time_s"], r["step_times"], r["losses"], r["warmup"],
                             start_step=r["start_step"])


def _stop(proc: subprocess.Popen) -> None:
    """Kill the child's process group if it still runs, and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _child(spec_path: str) -> int:
    """The child: run the spec's graph on an in-process session and print its events and result as JSON lines."""
    def say(msg: dict) -> None:
        print(json.dumps(msg), flush=True)

    try:
        with open(spec_path) as f:
            spec = json.load(f)
        from tag.backend.runtime.cluster_spec import import_tf, session_config
        from tag.backend.runtime.steps import run_steps
        tf = import_tf()
        gd = tf.compat.v1.GraphDef()
        with open(spec["graph"], "rb") as f:
            gd.ParseFromString(f.read())
        ctl = RunControl(**spec["control"])
        ctl.progress = lambda ev: say({"event": vars(ev)})
        config = session_config(intra_op_threads=spec["threads"], inter_op_threads=spec["inter_threads"])
        res = run_steps(gd, "", train_op=spec["train_op"], loss=spec["loss"], init=spec["init"],
                        steps=spec["steps"], warmup=spec["warmup"], seed=spec["seed"], config=config,
                        synthetic=True, control=ctl)
    except (TagError, RunError) as e:
        say({"error": str(e), "kind": "RunError" if isinstance(e, RunError) else "TagError"})
        return 2
    say({"result": res.to_dict()})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run one spec'd one-device training run (started by run_one_device)")
    p.add_argument("--spec", required=True, help="the JSON spec run_one_device wrote")
    return _child(p.parse_args(argv).spec)


if __name__ == "__main__":
    sys.exit(main())
