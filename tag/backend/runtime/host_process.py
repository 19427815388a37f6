"""Every host's program in a process of its own on that host, beside its TF server: how a plan runs.

``run_in_processes`` starts one child per host (``python -m tag.backend.runtime.host_process``) the way that
host's worker was started (``LocalCluster``: same launcher -- a testbed host's namespace and cgroup -- and
environment). Each child loads its host's program and runs ``run_host`` in a session on its host's server;
the hosts meet in collectives, not through this process. The children stream their progress as JSON lines;
this process merges them (step K is done when every host has done it: its time is the slowest host's, its
loss the one host's that computes the loss) and relays them to the run's progress callback.

Every wait is bounded: a child that exits without a result, a worker the cluster's watchdog reports dead, or
no event from any host within the run's deadline stops every child and raises one ``RunError`` naming the
host.

Example::

    from tag.backend.runtime.host_process import HostLaunch, run_in_processes

    launches = {name: HostLaunch(prefix=[], env=None, target=f"grpc://127.0.0.1:{port}") for name, port in ...}
    results = run_in_processes(programs, launches, spec, control=control)     # {host: HostResult}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tag.backend.runtime.guard import RunControl, RunEvent, diagnose
from tag.backend.runtime.host_run import HostResult, RunSpec
from tag.cuda_noise import is_cuda_startup_noise
from tag.errors import RunError, TagError

if TYPE_CHECKING:  # pragma: no cover
    from tag.backend.rewrite.programs import HostProgram

START_ALLOWANCE_S = 120.0   # a child's Python and TensorFlow start before its first event
NO_DEADLINE_S = 3600.0      # the longest wait for the next event when the control sets no deadline
CONTROL_FIELDS = ("step_timeout_s", "setup_timeout_s", "checkpoint_every", "checkpoint_path", "checkpoint_meta",
                  "resume_from", "trace_step")   # what a child's RunControl carries over (plain data)


@dataclass(frozen=True)
class HostLaunch:
    """How to start a process on one host: the argv PREFIX (a testbed host's namespace and cgroup; empty here),
    its ENV (None: this process's) and TARGET, the host's own server ("grpc://addr:port")."""

    prefix: tuple[str, ...]
    env: Mapping[str, str] | None
    target: str


def run_in_processes(programs: Mapping[str, "HostProgram"], launches: Mapping[str, HostLaunch], spec: RunSpec, *,
                     control: RunControl | None = None, config: Any = None,
                     constants: Mapping[str, Any] | None = None, eval_every: int = 0,
                     eval_dir: str | None = None) -> dict[str, HostResult]:
    """``run_host`` of each program of PROGRAMS (host name -> program) in a child process started per
    LAUNCHES[host] (module docstring); {host: HostResult}. CONFIG: the children's session ConfigProto (None:
    ``session_config()``). CONSTANTS, EVAL_EVERY, EVAL_DIR: as ``run_host`` takes them."""
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    with tempfile.TemporaryDirectory(prefix="tag-hosts-") as tmp:
        children: dict[str, subprocess.Popen] = {}
        errs: dict[str, Any] = {}
        extra = {"eval_every": int(eval_every), "eval_dir": eval_dir, "constants": None}
        if constants:
            import numpy as np
            extra["constants"] = os.path.join(tmp, "constants.npz")
            np.savez(extra["constants"], **{k.split(":")[0]: np.asarray(v) for k, v in constants.items()})
        try:
            for name, program in programs.items():
                children[name], errs[name] = _start(name, program, launches[name], spec, ctl, config, tmp, extra)
            return _follow(children, errs, spec, ctl)
        finally:
            for proc in children.values():
                _stop(proc)
            for f in errs.values():
                f.close()


def _start(name: str, program: "HostProgram", launch: HostLaunch, spec: RunSpec, ctl: RunControl, config: Any,
           tmp: str, extra: dict) -> tuple[subprocess.Popen, Any]:
    """Start NAME's child; (its process, its stderr file)."""
    from google.protobuf import text_format
    graph_path, meta_path = program.to_files(tmp)
    child_spec = {"graph": graph_path, "program": meta_path, "target": launch.target, "run": dataclasses.asdict(spec),
                  "control": {k: getattr(ctl, k) for k in CONTROL_FIELDS},
                  "config": text_format.MessageToString(config) if config is not None else None, **extra}
    spec_path = os.path.join(tmp, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(child_spec, f)
    env = dict(os.environ if launch.env is None else launch.env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    err = open(os.path.join(tmp, f"{name}.stderr"), "w+")
    proc = subprocess.Popen([*launch.prefix, sys.executable, "-m", __name__, "--spec", spec_path],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env, text=True,
                            start_new_session=True)
    return proc, err


class EventMerge:
    """Per-host step events merged into one stream: step K once every host did it."""

    def __init__(self, hosts: Sequence[str], spec: RunSpec, ctl: RunControl):
        self.ctl = ctl
        self.spec = spec
        self.chief = next(name for task, name in spec.hosts if task == spec.chief)
        self.times: dict[str, dict[int, float]] = {h: {} for h in hosts}
        self.loss: dict[int, float | None] = {}
        self.emitted = 0

    def event(self, host: str, ev: RunEvent) -> None:
        if ev.kind != "step":
            if host == self.chief:
                self.ctl.emit(ev)
            return
        self.times[host][ev.step] = ev.step_time_s
        if ev.loss is not None:
            self.loss[ev.step] = ev.loss
        if not self.emitted:
            self.emitted = ev.step - 1          # every host starts at the same step (a resumed run: later)
        while all(self.emitted + 1 in t for t in self.times.values()):
            k = self.emitted + 1
            self.ctl.emit(RunEvent("step", step=k, steps=ev.steps,
                                   step_time_s=max(t[k] for t in self.times.values()), loss=self.loss.get(k)))
            self.emitted = k


def _follow(children: dict[str, subprocess.Popen], errs: dict[str, Any], spec: RunSpec,
            ctl: RunControl) -> dict[str, HostResult]:
    """Relay and merge the children's events until each has given its result; RunError when one fails."""
    lines: queue.Queue = queue.Queue()

    def read(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            lines.put((name, line))
        lines.put((name, None))

    for name, proc in children.items():
        threading.Thread(target=read, args=(name, proc), daemon=True, name=f"tag-host-reader-{name}").start()
    merge = EventMerge(list(children), spec, ctl)
    results: dict[str, HostResult] = {}
    wait_s = max(ctl.setup_timeout_s or NO_DEADLINE_S, START_ALLOWANCE_S, spec.join_timeout_s)
    poll_s = max(ctl.poll_s, 0.2)
    waited = 0.0
    while len(results) < len(children):
        try:
            name, line = lines.get(timeout=poll_s)
        except queue.Empty:
            waited += poll_s
            msg = ctl.watchdog() if ctl.watchdog is not None else None
            if msg:
                raise RunError(msg) from None
            if waited > wait_s:
                raise RunError(f"no host sent anything for {wait_s:.0f} s (a step or its set-up past its deadline); "
                               f"stopped every host") from None
            continue
        waited = 0.0
        if line is None:
            if name in results:
                continue
            proc = children[name]
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            msg = diagnose(ctl.watchdog)
            raise RunError(msg or f"host {name}'s program exited (rc {proc.returncode}) without a result: "
                                  f"{_tail(errs[name])}")
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if "event" in msg:
            event = RunEvent(**msg["event"])
            merge.event(name, event)
            wait_s = (ctl.step_timeout_s if event.kind == "step" else ctl.setup_timeout_s) or NO_DEADLINE_S
            wait_s = max(wait_s, spec.join_timeout_s if event.kind == "phase" else 0.0)
        elif "error" in msg:
            dead = diagnose(ctl.watchdog)          # a worker that died is what the hosts' errors are about
            if dead:
                raise RunError(dead)
            errors = {name: msg}
            _collect_errors(lines, errors, children)
            kind, text = root_cause([(n, m["kind"], m["error"]) for n, m in errors.items()])
            raise (TagError if kind == "TagError" else RunError)(text)
        elif "result" in msg:
            r = msg["result"]
            traced = None
            if r.get("run_metadata"):
                with open(r["run_metadata"], "rb") as f:
                    traced = f.read()
            results[name] = HostResult(name, r["step_times"], r["losses"], r["start_step"], r["checkpoints"],
                                       steps_done=r["steps_done"], ended_early=r["ended_early"], run_metadata=traced)
    return results


ERROR_GRACE_S = 3.0     # after one host's error, how long to wait for the others' (to name the one that started it)
_ECHOES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcast", "aborted", "Cancelled", "cancelled",
           "failed (during", "RecvBuf")


def _collect_errors(lines: queue.Queue, errors: dict, children: Mapping[str, subprocess.Popen]) -> None:
    """More hosts' error messages from LINES for up to ERROR_GRACE_S (host name -> message), into ERRORS."""
    import time
    deadline = time.monotonic() + ERROR_GRACE_S
    while len(errors) < len(children) and time.monotonic() < deadline:
        try:
            name, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line and line.startswith("{"):
            msg = json.loads(line)
            if "error" in msg:
                errors.setdefault(name, msg)


def root_cause(errors: Sequence[tuple[str, str, str]]) -> tuple[str, str]:
    """(kind, message) of the error that started a failed run, from every host's (host, kind, message): a bad
    input (TagError) first, then one that is not another host's collective or exchange giving up."""
    for _host, kind, text in errors:
        if kind == "TagError":
            return kind, text
    for _host, kind, text in errors:
        if not any(e in text for e in _ECHOES):
            return kind, text
    return errors[0][1], errors[0][2]


def _tail(err: Any) -> str:
    err.flush()
    err.seek(0)
    lines = [ln.strip() for ln in err.read().splitlines() if ln.strip() and not is_cuda_startup_noise(ln)]
    return " ".join(lines[-3:])[-800:] or "(no output)"


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


# ------------------------------------------------------------------------------------------------ the child
def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this process (in a daemon thread's poll) once PARENT is no longer its parent: a host program never
    outlives the run that started it."""
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="tag-parent-watch").start()


def _child(spec_path: str) -> int:
    """Run one host's program as the spec says, printing its events and result as JSON lines."""
    def say(msg: dict) -> None:
        print(json.dumps(msg), flush=True)

    _exit_with_parent(os.getppid())
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        from google.protobuf import text_format

        from tag.backend.rewrite.programs import HostProgram
        from tag.backend.runtime.cluster_spec import import_tf, session_config
        from tag.backend.runtime.host_run import run_host
        tf = import_tf()
        program = HostProgram.from_files(spec["graph"], spec["program"])
        run = dict(spec["run"])
        run["hosts"] = tuple(tuple(h) for h in run["hosts"])
        ctl = RunControl(**spec["control"])
        ctl.progress = lambda ev: say({"event": vars(ev)})
        config = session_config()
        if spec.get("config"):
            config = text_format.Parse(spec["config"], tf.compat.v1.ConfigProto())
        constants = None
        if spec.get("constants"):
            import numpy as np
            with np.load(spec["constants"], allow_pickle=False) as z:
                constants = {k: z[k] for k in z.files}
        result = run_host(program, spec["target"], RunSpec(**run), control=ctl, config=config, constants=constants,
                          eval_every=spec.get("eval_every", 0), eval_dir=spec.get("eval_dir"))
    except (TagError, RunError) as e:
        say({"error": str(e), "kind": "RunError" if isinstance(e, RunError) else "TagError"})
        return 2
    traced = None
    if result.run_metadata is not None:
        traced = spec_path + ".run_metadata.pb"
        with open(traced, "wb") as f:
            f.write(result.run_metadata)
    say({"result": {"step_times": result.step_times, "losses": result.losses, "start_step": result.start_step,
                    "checkpoints": result.checkpoints, "steps_done": result.steps_done,
                    "ended_early": result.ended_early, "run_metadata": traced}})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run one host's program of a tag run (started by run_in_processes)")
    p.add_argument("--spec", required=True, help="the JSON spec run_in_processes wrote")
    return _child(p.parse_args(argv).spec)


if __name__ == "__main__":
    sys.exit(main())
