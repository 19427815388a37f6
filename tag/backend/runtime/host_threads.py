"""Every host's program of one run, each in a thread of this process with a session on its own host's server.

The usual way a plan runs is a process per host (``tag.backend.runtime.host_process``). When this process
cannot start one there -- hosts on other machines that already run ``tag-worker``, or tests with servers in
this process -- ``run_in_threads`` drives each host's program from here instead: one thread and one session
per host, each session on that host's own server, so every host's master still runs only that host's
program. When one host fails, the others are stopped at their next poll (no host waits out a collective
timeout for a peer that is gone).

Example::

    from tag.backend.runtime.host_threads import run_in_threads

    results = run_in_threads(programs, {"cpu0": "grpc://127.0.0.1:23451", ...}, spec, feeds=lambda s: batches[s])
    results["cpu0"].losses
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Mapping

from tag.backend.runtime.guard import RunControl
from tag.backend.runtime.host_process import EventMerge
from tag.backend.runtime.host_run import FeedFn, HostResult, RunSpec, run_host
from tag.errors import RunError

if TYPE_CHECKING:  # pragma: no cover
    from tag.backend.rewrite.programs import HostProgram

JOIN_GRACE_S = 30.0   # how long the other hosts' threads get to stop once one host failed


def run_in_threads(programs: Mapping[str, "HostProgram"], targets: Mapping[str, str], spec: RunSpec, *,
                   control: RunControl | None = None, feeds: FeedFn | None = None, config: Any = None,
                   read_values: bool = False, constants: Mapping[str, Any] | None = None, eval_every: int = 0,
                   eval_dir: str | None = None) -> dict[str, HostResult]:
    """``run_host`` of every program of PROGRAMS (host name -> program) at TARGETS[host], one thread each; the
    first failure is raised (a RunError or TagError naming the host) once every thread has stopped or
    ``JOIN_GRACE_S`` passed. CONTROL's progress hears every host's events (the chief's phases, every host's
    steps: ``run_in_processes`` merges them, this does not); its watchdog is asked too. The other keywords:
    as ``run_host`` takes them."""
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    failed: list[tuple[str, BaseException]] = []
    lock = threading.Lock()

    def watchdog() -> str | None:
        with lock:
            if failed:
                return f"host {failed[0][0]} failed"
        return ctl.watchdog() if ctl.watchdog is not None else None

    results: dict[str, HostResult] = {}

    merge = EventMerge(list(programs), spec, ctl)

    def progress(name: str):
        def hear(ev) -> None:
            with lock:
                merge.event(name, ev)
        return hear

    def go(name: str) -> None:
        host_ctl = dataclasses.replace(ctl, watchdog=watchdog, progress=progress(name))
        try:
            results[name] = run_host(programs[name], targets[name], spec, control=host_ctl, feeds=feeds,
                                     config=_copy(config), read_values=read_values, constants=constants,
                                     eval_every=eval_every, eval_dir=eval_dir)
        except BaseException as err:  # noqa: BLE001 - reported below, after the other threads stop
            with lock:
                failed.append((name, err))

    threads = [threading.Thread(target=go, args=(name,), name=f"tag-host-{name}", daemon=True) for name in programs]
    for t in threads:
        t.start()
    budget = _longest_wait(ctl, spec)
    for t in threads:
        t.join(budget)
        if failed:
            budget = JOIN_GRACE_S
    alive = [t.name for t in threads if t.is_alive()]
    if failed:
        first = _root_cause(failed)
        raise first
    if alive:
        raise RunError(f"{', '.join(alive)} did not finish in time")
    return results


def _copy(config: Any) -> Any:
    if config is None:
        return None
    out = type(config)()
    out.CopyFrom(config)
    return out


def _longest_wait(ctl: RunControl, spec: RunSpec) -> float | None:
    """The longest a whole run may take under CTL's deadlines (None: no deadline)."""
    if ctl.step_timeout_s is None or ctl.setup_timeout_s is None:
        return None
    return ctl.setup_timeout_s * 8 + ctl.step_timeout_s * (spec.steps + 1)


def _root_cause(failed: list[tuple[str, BaseException]]) -> BaseException:
    """The failure that started it: one not caused by another host failing."""
    for _, err in failed:
        if "failed (during" not in str(err):
            return err
    return failed[0][1]
