"""Things that must not outlive this process: a registry whose members are stopped at interpreter exit.

``LocalCluster`` (worker processes) and ``tag_bench.testbed.Testbed`` (network namespaces) each
keep one registry: they add themselves when they start and discard themselves when stopped; at exit
whatever is still registered is stopped, best effort (errors are swallowed: the interpreter is
going away).

Example::

    from tag.backend.runtime.live import LiveRegistry

    class Thing:
        def stop(self): ...
    LIVE_THINGS = LiveRegistry("stop")   # registers its atexit hook
    t = Thing(); LIVE_THINGS.add(t)      # ... later: t.stop(); LIVE_THINGS.discard(t)
"""
from __future__ import annotations

import atexit
import threading
from typing import Any


class LiveRegistry:
    """A thread-safe set of live objects whose ``STOP_METHOD()`` runs at interpreter exit."""

    def __init__(self, stop_method: str):
        self.stop_method = stop_method
        self.lock = threading.RLock()     # re-entrant; also serialises callers' own bookkeeping (e.g. a counter)
        self._members: set[Any] = set()
        atexit.register(self.stop_all)

    def add(self, obj: Any) -> None:
        with self.lock:
            self._members.add(obj)

    def discard(self, obj: Any) -> None:
        with self.lock:
            self._members.discard(obj)

    def members(self) -> list[Any]:
        """The live objects now."""
        with self.lock:
            return list(self._members)

    def stop_all(self) -> None:
        """Call every member's stop method (best effort: errors are ignored)."""
        with self.lock:
            members = list(self._members)
        for obj in members:
            try:
                getattr(obj, self.stop_method)()
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass
