"""Bounded waits for tests that talk to child processes: no read or wait blocks forever.

    from bounded import LineReader, bounded, stop
    proc = subprocess.Popen([...], stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines = LineReader(proc.stdout)
    try:
        assert lines.next(timeout_s=60) == "up"      # AssertionError after 60 s without a line
    finally:
        stop(proc)                                    # SIGKILL its process group, wait at most 15 s

A reader thread moves the stream's lines into a queue, so that a read can time out (a plain
``readline`` on a pipe cannot). At end of stream ``next`` returns None. ``bounded(config)`` bounds a
cluster session's runs.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from typing import IO, Iterator

from tag_bench.exactness import SESSION_TIMEOUT_S, bounded  # noqa: F401 (re-exported: the tests' session bound)

READ_TIMEOUT_S = 120.0      # a child that prints nothing for this long is taken as hung
WAIT_TIMEOUT_S = 15.0       # a killed child is reaped within this


class LineReader:
    """The lines of STREAM (a child's text pipe), each read with a time limit."""

    def __init__(self, stream: IO[str]):
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self._lines.put(line)
        except (OSError, ValueError):     # the stream was closed under us
            pass
        finally:
            self._lines.put(None)

    def next(self, timeout_s: float = READ_TIMEOUT_S) -> str | None:
        """The next line without its newline, None at end of stream; AssertionError after TIMEOUT_S."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line from the child process within {timeout_s:g} s") from None
        return None if line is None else line.rstrip("\n")

    def lines(self, total_timeout_s: float, line_timeout_s: float = READ_TIMEOUT_S) -> Iterator[str]:
        """Every line until end of stream; AssertionError when one takes over LINE_TIMEOUT_S or all of
        them over TOTAL_TIMEOUT_S."""
        deadline = time.monotonic() + total_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the child process still writes after {total_timeout_s:g} s")
            line = self.next(min(left, line_timeout_s))
            if line is None:
                return
            yield line


def stop(proc: subprocess.Popen, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """Kill PROC (its process group when it leads one) if it still runs, and reap it within TIMEOUT_S."""
    if proc.poll() is None:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout_s)
