"""Signal handlers that take live testbeds down before a stopped process ends (SIGTERM, Ctrl-C, a time limit).

Kept apart from ``tag_bench.testbed`` (which builds namespaces, links and quotas): this module only decides
what a signal does while testbeds are up.

Example::

    from tag.backend.runtime.live import LiveRegistry
    from tag_bench.signal_teardown import TeardownOnSignal

    live = LiveRegistry("close")          # objects with .close(), stopped at interpreter exit
    signals = TeardownOnSignal(live)
    signals.arm()                         # SIGTERM/SIGINT now close every member of LIVE first
    with signals.held():                  # a teardown that a signal must not cut short
        ...
    signals.disarm()
"""
from __future__ import annotations

import contextlib
import signal

from tag.backend.runtime.live import LiveRegistry


class TeardownOnSignal:
    """SIGTERM and SIGINT handlers that stop every member of LIVE (the testbeds set up and not yet closed)
    before the process ends.

    ``arm()`` when a testbed is set up installs them (main thread only: Python delivers signals there);
    ``disarm()`` when the last one is closed puts the previous handlers back. Each handler closes the
    live testbeds, then does what the previous handler would have: a Python handler of the program is
    called, the default ends the process by an exception (so ``finally`` blocks and ``with`` exits still
    run); an ignored signal is left alone. tag's runs wait for TensorFlow in short polls
    (``tag.backend.runtime.guard``), so the handler runs within a fraction of a second.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, live: LiveRegistry) -> None:
        self._live = live
        self._previous: dict[int, object] = {}
        self._busy = False      # a handler is tearing down

    def arm(self) -> None:
        import threading
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in self.SIGNALS:
            current = signal.getsignal(signum)
            if current in (signal.SIG_IGN, None):
                continue          # ignored (a background job's SIGINT) or set outside Python: leave it
            self._previous[signum] = current
            signal.signal(signum, self._handle)

    def disarm(self) -> None:
        import threading
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def held(self):
        """SIGTERM and SIGINT held back (blocked in the main thread) for the ``with`` block: delivered after it."""
        import threading
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _handle(self, signum: int, frame) -> None:
        if self._busy:
            return                # a second signal during the teardown (``timeout`` signals the process and
                                  # its group): the first one ends the process once the teardown is done
        self._busy = True
        try:
            previous = self._previous.get(signum, signal.SIG_DFL)
            self._live.stop_all()   # closes every testbed (and so disarms)
        finally:
            self._busy = False
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)
