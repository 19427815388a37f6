"""``tag-deploy --run``'s progress lines on stderr: every phase and checkpoint, a step line at most twice a second.

Shared by ``tag.cli.deploy_run`` (timed runs, tuning) and ``tag.cli.deploy_input`` (training on a data set).

Example::

    from tag.backend.runtime.guard import RunEvent
    from tag.cli.deploy_progress import ProgressPrinter
    printer = ProgressPrinter()
    printer("ps", RunEvent("phase", "starting 3 workers"))     # tag-deploy: ps: starting 3 workers
"""
from __future__ import annotations

import sys
import time
from typing import Any

PROG = "tag-deploy"


class ProgressPrinter:
    """RunEvents as lines on stderr: every phase and checkpoint; steps at most every MIN_INTERVAL_S
    (always the first and the last)."""

    def __init__(self, stream: Any = None, min_interval_s: float = 0.5, prog: str = PROG):
        self.stream = stream
        self.prog = prog
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def __call__(self, name: str, ev: Any) -> None:
        if ev.kind == "phase":
            line = f"{self.prog}: {name}: {ev.text}"
        elif ev.kind == "checkpoint":
            line = f"{self.prog}: {name}: checkpoint at step {ev.step}: {ev.text}"
        elif ev.kind != "step":
            return
        else:
            now = time.monotonic()
            if ev.step not in (1, ev.steps) and now - self._last < self.min_interval_s:
                return
            self._last = now
            loss = f"  loss {ev.loss:.4g}" if ev.loss is not None else ""
            line = f"{self.prog}: {name}: step {ev.step}/{ev.steps}  {ev.step_time_s:.3f} s/step{loss}"
        print(line, file=self.stream or sys.stderr, flush=True)
