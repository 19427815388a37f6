"""Is every host's TF server answering? A check before a run and a watchdog during it, for remote clusters.

TensorFlow's master waits forever for a worker that never registers ("CreateSession still waiting"), and a
step blocks on a host that went away. Before ``tag-deploy --run`` starts on hosts it did not start itself,
``wait_for_hosts`` connects to every host's ``address:port`` (in parallel, retrying) and raises
``tag.errors.RunError`` naming each host that did not answer within the limit (30 s by default).
``HostProbe`` is the watchdog for such a run: every few seconds it connects to each host again, and a host
that misses ``misses`` probes in a row is reported by name (``RunControl.watchdog``). For a cluster this
process started (``LocalCluster``) the watchdog is ``LocalCluster.dead_worker`` instead: it sees a worker
process exit at once.

Example::

    from tag.backend.runtime.health import HostProbe, wait_for_hosts

    wait_for_hosts(topology.hosts, timeout_s=30)        # RunError: "no answer from host gpu2 (10.0.0.3:2222) ..."
    probe = HostProbe(topology.hosts)
    probe.dead_host()                                    # None while every host answers
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from tag.backend.runtime.ports import port_listening
from tag.errors import RunError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import Host

HOST_TIMEOUT_S = 30.0


def _label(h: "Host") -> str:
    return f"{h.name} ({h.address}:{h.port})"


def wait_for_hosts(hosts: Sequence["Host"], *, timeout_s: float = HOST_TIMEOUT_S, interval_s: float = 1.0) -> None:
    """Return once every host of HOSTS accepts a TCP connection at its port; RunError naming the hosts
    that did not within TIMEOUT_S."""
    pending = list(hosts)
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(pending)))) as pool:
        while pending:
            left = deadline - time.monotonic()
            connect_s = max(0.1, min(2.0, left))
            answers = list(pool.map(lambda h, t=connect_s: port_listening(h.address, h.port, t), pending))
            pending = [h for h, ok in zip(pending, answers, strict=True) if not ok]
            if not pending:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(_label(h) for h in pending)
                raise RunError(f"no answer from host{'s' if len(pending) > 1 else ''} {names} within "
                               f"{timeout_s:.0f} s: is tag-worker running there, and is the port open from here?")
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


class HostProbe:
    """A watchdog for hosts this process did not start: ``dead_host()`` names a host that has missed
    MISSES connection probes in a row (one probe per host every INTERVAL_S, in a background thread)."""

    def __init__(self, hosts: Sequence["Host"], *, interval_s: float = 5.0, misses: int = 3,
                 connect_s: float = 2.0):
        self.hosts = list(hosts)
        self.interval_s, self.misses, self.connect_s = float(interval_s), int(misses), float(connect_s)
        self._missed = {h.name: 0 for h in self.hosts}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tag-host-probe", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for h in self.hosts:
                ok = port_listening(h.address, h.port, self.connect_s)
                with self._lock:
                    self._missed[h.name] = 0 if ok else self._missed[h.name] + 1

    def dead_host(self) -> str | None:
        """A one-line message naming a host that stopped answering, or None."""
        with self._lock:
            for h in self.hosts:
                if self._missed[h.name] >= self.misses:
                    return (f"host {_label(h)} stopped answering (no connection for "
                            f"{self.misses * self.interval_s:.0f} s): its tag-worker died or the network failed")
        return None

    def stop(self) -> None:
        self._stop.set()
