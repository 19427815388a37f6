"""Runs that never hang: every blocking TensorFlow call under a deadline and a watchdog, and progress events.

A distributed ``session.run`` can block forever: a worker that died mid-collective, a host that stopped
answering, a master still waiting for a worker to register. ``guarded(fn, ...)`` runs FN in a helper
thread and waits for it in short polls; at each poll the WATCHDOG (a callable returning a message when a
worker is gone, e.g. ``LocalCluster.dead_worker`` or ``HostProbe.dead_host``) is asked, and the deadline
checked. Either one ends the wait with ``tag.errors.RunError`` naming the host or the deadline; the
helper thread is left behind (it ends once the cluster is stopped). TensorFlow errors raised by FN
become RunError too, with the watchdog's diagnosis when it has one (a step fails with "Socket closed"
because a worker died: the message names the worker). ``RunControl`` bundles what ``run_steps`` needs
for this (deadlines, watchdog, progress callback, checkpoints); ``RunEvent`` is what the callback gets.

Example::

    from tag.backend.runtime.guard import RunControl, guarded

    value = guarded(lambda: sess.run(loss), what="step 3", timeout_s=600,
                    watchdog=cluster.dead_worker)      # RunError within a second if a worker dies
    control = RunControl(progress=print, watchdog=cluster.dead_worker, step_timeout_s=600)
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tag.errors import RunError, TagError

Watchdog = Callable[[], "str | None"]


@dataclass
class RunEvent:
    """One progress event of a run: ``kind`` is "phase" (TEXT says what starts), "step" (STEP of STEPS
    done in STEP_TIME_S with LOSS), "checkpoint" (TEXT is the path written at STEP) or "weights" (TEXT is the
    checkpoint of the weights at STEP written for an evaluation)."""

    kind: str
    text: str = ""
    step: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    loss: float | None = None


@dataclass
class RunControl:
    """How ``run_steps`` guards and reports a run.

    ``progress(RunEvent)`` after each phase and step; ``watchdog()`` -> message when a worker is gone;
    ``step_timeout_s``: deadline of one step (also TF's ``operation_timeout_in_ms``); ``setup_timeout_s``:
    deadline of session creation, initialisation and checkpoint I/O; ``checkpoint_every`` K > 0 saves the
    variables as a TensorFlow checkpoint in the directory ``checkpoint_path`` every K steps (and after the
    last), with ``checkpoint_meta`` in its description; ``resume_from``: a checkpoint (directory or prefix)
    to restore before the first step (its step count and losses carry on);
    ``trace_step``: the step run with a full trace (``RunResult.run_metadata``)."""

    progress: Callable[[RunEvent], None] | None = None
    watchdog: Watchdog | None = None
    step_timeout_s: float | None = 600.0
    setup_timeout_s: float | None = 600.0
    poll_s: float = 0.2
    checkpoint_every: int = 0
    checkpoint_path: str | None = None
    checkpoint_meta: dict[str, Any] = field(default_factory=dict)
    resume_from: str | None = None
    trace_step: int | None = None

    def emit(self, event: RunEvent) -> None:
        if self.progress is not None:
            self.progress(event)


def diagnose(watchdog: Watchdog | None, wait_s: float = 2.0) -> str | None:
    """The watchdog's message, waiting up to WAIT_S for a death to become visible (exit codes lag)."""
    if watchdog is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        msg = watchdog()
        if msg or time.monotonic() >= deadline:
            return msg
        time.sleep(0.1)


def _first_line(err: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong, with the node it happened at.

    TF 2 wraps session errors as "Graph execution error:", a Python traceback of where the node was
    defined, "Node: 'name'" and only then the message: the header alone says nothing.
    """
    lines = [" ".join(line.split()) for line in str(getattr(err, "message", "") or err).strip().splitlines()]
    lines = [line for line in lines if line]
    at = next((i for i, line in enumerate(lines) if line.startswith("Node: ")), None)
    if at is not None:
        message = next((line for line in lines[at + 1:] if not line.startswith("[[")), None)
        node = lines[at][len("Node: "):].strip("'")
        if message:
            return f"{message} (at node {node})"
    skip = ("Graph execution error", "Detected at node", "File \"", "Node: ", "[[")
    message = next((line for line in lines if not line.startswith(skip)), None)
    return message or (lines[0] if lines else type(err).__name__)


def guarded(fn: Callable[[], Any], *, what: str, timeout_s: float | None, watchdog: Watchdog | None = None,
            poll_s: float = 0.2) -> Any:
    """FN() run in a helper thread; RunError when WATCHDOG reports a dead worker, when TIMEOUT_S passes,
    or when FN raises a TensorFlow error; TagError from FN passes through unchanged."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = err
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"tag-guarded: {what}", daemon=True)
    start = time.monotonic()
    thread.start()
    while not done.wait(poll_s):
        msg = watchdog() if watchdog is not None else None
        if msg:
            raise RunError(f"{msg} (during {what})")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise RunError(f"{what} did not finish within {timeout_s:.0f} s: a worker hangs or the step is slower "
                           f"than that (raise --step-timeout)")
    err = box.get("error")
    if err is None:
        return box.get("value")
    if isinstance(err, (TagError, RunError, KeyboardInterrupt)):
        raise err
    if type(err).__module__.startswith("tensorflow"):
        msg = diagnose(watchdog)
        if msg:
            raise RunError(f"{msg} (during {what})") from None
        name = type(err).__name__
        if name == "DeadlineExceededError":
            raise RunError(f"{what} did not finish within {timeout_s or 0:.0f} s (TensorFlow's operation "
                           f"timeout; raise --step-timeout)") from None
        raise RunError(f"{what} failed: {name}: {_first_line(err)}") from None
    raise err


def close_quietly(sess: Any, timeout_s: float = 5.0) -> None:
    """Close SESS in a helper thread and wait at most TIMEOUT_S (a dead master must not block the exit)."""
    def target() -> None:
        try:
            sess.close()
        except Exception:  # noqa: BLE001 - closing after a failure: nothing more to report
            pass

    thread = threading.Thread(target=target, name="tag-session-close", daemon=True)
    thread.start()
    thread.join(timeout_s)
