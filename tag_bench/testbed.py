"""A multi-host testbed on one Linux machine: a network namespace per host, shaped links, TF servers.

Each host of a topology gets its own network namespace with one interface, ``eth0``, plugged into a
bridge in the root namespace through a veth pair. Addresses come from the benchmarking range
198.18.0.0/15 (RFC 2544), one /24 per testbed (bridge ``.1``, hosts ``.2``, ``.3``, ...), so the
testbed never collides with real networks. On every host's ``eth0`` egress an HTB qdisc holds one
parent class, the host's NIC, at the NIC rate (by default the host's fastest declared link, as
``CostModel.nic_bandwidth`` takes it; ``nic_gbps`` overrides it), and under it one class per destination
host, selected by a u32 filter on the destination address, whose ceiling is the bandwidth the topology
declares for that pair. A lone transfer to one destination therefore runs at the pair's bandwidth, and
concurrent transfers from one host share its NIC (their sum is capped at the NIC rate), as the
simulator's serialised NIC send resource assumes. The receive side is shaped too: the root-namespace end
of each host's veth carries what the host receives, and an HTB class at the host's NIC rate there, fed
by a u32 filter on the other hosts' source addresses, caps what it receives from several hosts at once
(the simulator's NIC receive resource). Sending and receiving do not share a cap (full duplex).
Latency: the topology's ``latency_us`` is one-way, so each direction gets a netem delay equal to it
(round trip = twice) -- when the kernel has ``sch_netem``. Without it (e.g. minimal VM kernels) links are
bandwidth-shaped only, ``Testbed.latency_shaped`` is False and a warning says so; veth adds only tens of
microseconds.
Traffic to and from the root namespace (the client session) is not shaped.

Rates are link rates, as on a real NIC: TCP goodput is about 1448/1514 = 95.6% of them (Ethernet,
IP and TCP headers at MTU 1500).
Both ends of every shaped veth take segmentation-offload packets of at most 16 KB (``GSO_MAX_BYTES``):
HTB lets a packet of any size leave while its class has tokens, so with the kernel's 64 KB packets the
first 64 KB of a tensor sent after an idle gap left at veth speed.

Hosts of unequal, repeatable speed: ``cpu_quota`` gives each host a CFS bandwidth quota (cgroup v1
``cpu.cfs_quota_us`` over a 10 ms ``cpu.cfs_period_us``, ``CFS_PERIOD_US``) in cores, e.g. 1.0, 0.5 and
0.25: a host never gets more CPU time than that, whatever else runs. The hosts with a quota are also pinned
to the machine's CPUs (cgroup v1 ``cpuset``, ``cpu_pinning="auto"``, the default): largest quota first, each on
the least-loaded CPUs whose quotas still sum to at most one core, e.g. 1.0 on one CPU and 0.5 + 0.25 on
another. Why: an unpinned host of quota 1.0 runs its threads on two cores at once, spends its 10 ms of CPU
in 5 ms and is then frozen for 5 ms; the same program measured in 12-step sessions then ran 55-68 ms (two
modes), pinned 55-56 ms. When the quotas do not pack onto the CPUs, nothing is pinned and a warning says so.
Optional CPU shares per host (``cpu.shares``)
only weigh hosts against each other under contention -- a coarser stand-in for slower devices.

Needs root and iproute2 (``ip``, ``tc``); nothing is installed. Everything is torn down on exit, even
after an error, and when the process is stopped: while a testbed is up, SIGTERM and SIGINT (a time
limit, ``kill``, Ctrl-C) first tear down every live testbed of the process, then end it as the signal
would have (``SystemExit(143)`` for SIGTERM, ``KeyboardInterrupt`` for SIGINT; a signal that was ignored
stays ignored, a handler of the program's own runs after the teardown). A process killed with SIGKILL
cannot clean up: ``cleanup_stale()`` removes what it left (names ``tag<pid>t<n>...`` of dead pids), and
every testbed start calls it.

Example::

    import tag
    from tag_bench.testbed import Testbed
    from tag.backend.runtime import run_steps

    topo = tag.load_topology("topologies/localhost.pbtxt")
    with Testbed(topo, cpu_quota=[1.0, 0.5]) as tb:   # namespaces, bridge, shaped veths, CPU quotas
        print(tb.measure_bandwidth("cpu0", "cpu1") * 8 / 1e9, "Gbit/s")
        tb.start_workers()                        # one tag-worker per namespace
        result = run_steps(graph_def, tb.target, steps=20)
"""
from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Mapping, Sequence

from tag.backend.runtime.live import LiveRegistry
from tag_bench.signal_teardown import TeardownOnSignal
from tag_bench.testbed_hosts import CGROUP_CPUSET, TestbedError, parse_pinning, parse_quota, parse_shares

if TYPE_CHECKING:  # pragma: no cover
    from tag.backend.runtime import LocalCluster
    from tag.cluster.topology import Host, Topology

NET = ipaddress.ip_network("198.18.0.0/15")     # RFC 2544 benchmarking range
BLOCK_PREFIX = 24
CGROUP_CPU = "/sys/fs/cgroup/cpu"
CFS_PERIOD_US = 10_000     # short slices: a quota slows every kernel alike, as a slower device would
PREFIX = "tag"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)t(\d+)(?:h\d+|br|r\d+)?$")
_LOCK_PATH = os.path.join(tempfile.gettempdir(), "tag-testbed.lock")


#: the depth of each HTB class's token bucket, in seconds at its ceiling rate (``Testbed._htb_class``)
BURST_S = 0.0002

#: the largest packet TCP hands a shaped interface (``gso_max_size`` of both ends of every veth; see ``Testbed``)
GSO_MAX_BYTES = 16384


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"{cmd[0]} not found: the testbed needs iproute2 (ip, tc)") from None
    if check and res.returncode != 0:
        msg = " ".join((res.stderr or res.stdout).split())
        raise TestbedError(f"`{' '.join(cmd)}` failed: {msg}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_AVAILABLE: tuple[bool, str] | None = None


def testbed_available() -> tuple[bool, str]:
    """(True, "") when this machine can build a testbed, else (False, why). Cached; creates and removes
    one probe namespace."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    if sys.platform != "linux":
        _AVAILABLE = (False, "the testbed needs Linux network namespaces")
    elif os.geteuid() != 0:
        _AVAILABLE = (False, "the testbed needs root (network namespaces, tc)")
    elif not (shutil.which("ip") and shutil.which("tc")):
        _AVAILABLE = (False, "the testbed needs iproute2's `ip` and `tc` on PATH")
    else:
        probe = f"{PREFIX}{os.getpid()}t99h0"
        res = _run(["ip", "netns", "add", probe], check=False)
        if res.returncode != 0:
            _AVAILABLE = (False, f"cannot create a network namespace: {' '.join(res.stderr.split())}")
        else:
            _run(["ip", "netns", "del", probe], check=False)
            _AVAILABLE = (True, "")
    return _AVAILABLE


testbed_available.__test__ = False  # type: ignore[attr-defined]


def testbed_missing(prog: str) -> bool:
    """True (after saying why on stderr, as PROG) when the testbed cannot run here: a benchmark's early exit."""
    ok, why = testbed_available()
    if not ok:
        print(f"{prog}: the testbed is not available here: {why}", file=sys.stderr)
    return not ok


testbed_missing.__test__ = False  # type: ignore[attr-defined]


def _used_blocks() -> set[int]:
    """Indices of the /24 blocks of 198.18.0.0/15 already routed in the root namespace."""
    used = set()
    out = _run(["ip", "-4", "-o", "route", "show", "table", "all"], check=False).stdout
    out += _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for m in re.finditer(r"(\d+\.\d+\.\d+\.\d+)(?:/(\d+))?", out):
        try:
            net = ipaddress.ip_network(f"{m.group(1)}/{m.group(2) or 32}", strict=False)
        except ValueError:
            continue
        if not net.overlaps(NET):
            continue
        lo = max(int(net.network_address), int(NET.network_address))
        hi = min(int(net.broadcast_address), int(NET.broadcast_address))
        for k in range((lo - int(NET.network_address)) >> 8, ((hi - int(NET.network_address)) >> 8) + 1):
            used.add(k)
    return used


_RECEIVER = r"""
import json, socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
s.settimeout(float(sys.argv[2]))
c, _ = s.accept(); c.settimeout(float(sys.argv[2]))
n, t0, t1 = 0, None, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t1 = time.perf_counter()
    if t0 is None:
        t0, first = t1, len(b)
    n += len(b)
print(json.dumps({"bytes": n, "first": first if t0 else 0, "seconds": (t1 - t0) if t0 else 0.0}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf, limit, budget = b"\0" * (1 << 16), float(sys.argv[3]), int(sys.argv[4])
t, sent = time.perf_counter(), 0
while time.perf_counter() - t < limit and sent < budget:
    c.sendall(buf); sent += len(buf)
c.close()
"""


_ECHO = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
s.settimeout(60)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1)
    if not b:
        break
    c.sendall(b)
"""

_PING = r"""
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[3]) + 2):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); times.append(time.perf_counter() - t)
c.close()
print(statistics.median(times[2:]))
"""


# ----------------------------------------------------------------------------------------------
# Testbed
# ----------------------------------------------------------------------------------------------

_LIVE = LiveRegistry("close")   # testbeds set up and not yet closed; closed at interpreter exit
_COUNTER = 0                     # testbeds set up so far in this process (names their interfaces)


_SIGNALS = TeardownOnSignal(_LIVE)   # SIGTERM/SIGINT close every live testbed first


class Testbed:
    """Network namespaces, a bridge and shaped veth links that emulate TOPOLOGY's hosts and links.

    ``with Testbed(topo) as tb:`` builds it; ``tb.topology`` is a copy of the topology whose host
    addresses are the namespaces' IPs; ``tb.start_workers()`` runs one TF server per host inside its
    namespace and returns ``tb.target`` (task 0, reachable from the root namespace);
    ``tb.measure_bandwidth(a, b)`` measures a TCP stream between two hosts. ``shape_links=False``
    leaves links at veth speed. ``cpu_shares``: host name -> cgroup v1 cpu.shares (1024 = normal),
    or a list in host order. ``cpu_quota``: host name -> cores (CFS quota; None: unlimited), or a
    list in host order. ``cpu_pinning``: "auto" (pin the hosts with a quota to CPUs, see the module
    docstring), "off", or host name -> CPU list ("0", "1-3"; or a list in host order; None: not pinned).
    ``nic_gbps``: host name -> NIC rate in Gbit/s (or a list); default: each
    host's fastest declared link. ``gso_max_bytes``: the largest segmentation-offload packet on a shaped
    veth (``GSO_MAX_BYTES``; None: the kernel's 64 KB). HTB lets a packet leave whenever its class has any
    tokens and then runs a debt, so after an idle gap a whole offload packet leaves at veth speed: with
    64 KB packets a 115 KB tensor crossed a 0.2 Gbit/s link in 2.8 ms (324 Mbit/s) inside a busy
    training step, and 4.7 ms with 16 KB (the wire: 4.6 ms); 1.5 KB packets (no offload) cost the
    quota-limited hosts so much CPU that the same step ran 1.6x slower. ``tb.launch_prefix(host)`` is the
    argv prefix that runs a command in a host's namespace and cgroup (for servers other than tag-worker,
    e.g. tf.distribute workers).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, topology: "Topology", shape_links: bool = True,
                 cpu_shares: Mapping[str, int] | Sequence[int] | None = None,
                 cpu_quota: Mapping[str, float | None] | Sequence[float | None] | None = None,
                 nic_gbps: Mapping[str, float] | Sequence[float] | None = None,
                 cpu_pinning: str | Mapping[str, str | None] | Sequence[str | None] = "auto",
                 gso_max_bytes: int | None = GSO_MAX_BYTES):
        if not topology.hosts:
            raise TestbedError(f"topology {topology.name!r} has no hosts")
        if len(topology.hosts) > 250:
            raise TestbedError(f"the testbed supports at most 250 hosts, the topology has {len(topology.hosts)}")
        self.source = topology
        self.shape_links = bool(shape_links)
        if gso_max_bytes is not None and not 1500 <= int(gso_max_bytes) <= 65536:
            raise TestbedError(f"gso_max_bytes must be within 1500..65536, got {gso_max_bytes}")
        self.gso_max_bytes = None if gso_max_bytes is None else int(gso_max_bytes)
        self.cpu_shares = parse_shares(cpu_shares, topology.hosts)
        self.cpu_quota = parse_quota(cpu_quota, topology.hosts)
        self.nic_rates = self._nic_rates(nic_gbps)   # bytes/s per host index
        self.cpu_pinning = parse_pinning(cpu_pinning, self.cpu_quota, topology.hosts)  # host -> CPU list
        self.latency_shaped = False
        self.topology: "Topology | None" = None
        self.target: str | None = None
        self.cluster: "LocalCluster | None" = None
        self._token: str | None = None
        self._block: ipaddress.IPv4Network | None = None
        self._created: list[tuple[str, str]] = []  # ("netns"|"link"|"cgroup", name) in creation order
        self._hosts_by_name: dict[str, int] = {h.name: i for i, h in enumerate(topology.hosts)}

    # -- naming --------------------------------------------------------------------------------
    def namespace(self, host: str | int) -> str:
        """Network-namespace name of a host (by name or index in ``topology.hosts``)."""
        return f"{PREFIX}{self._token}h{self._index(host)}"

    def address(self, host: str | int) -> str:
        """IP address of a host inside the testbed."""
        assert self._block is not None, "testbed not set up"
        return str(self._block.network_address + 2 + self._index(host))

    def _index(self, host: str | int) -> int:
        if isinstance(host, int):
            if not 0 <= host < len(self.source.hosts):
                raise TestbedError(f"host index {host} out of range (0..{len(self.source.hosts) - 1})")
            return host
        if host not in self._hosts_by_name:
            raise TestbedError(f"unknown host {host!r}; known hosts: {', '.join(self._hosts_by_name)}")
        return self._hosts_by_name[host]

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self._token}br"

    def _veth(self, i: int) -> str:
        return f"{PREFIX}{self._token}r{i}"

    def _cgroup(self, i: int | None = None, root: str = CGROUP_CPU) -> str:
        base = os.path.join(root, f"{PREFIX}{self._token}")
        return base if i is None else os.path.join(base, f"h{i}")

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self.setup()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def setup(self) -> "Testbed":
        """Build namespaces, bridge, veths, shaping and cgroups. On any failure, tears down and raises."""
        ok, why = testbed_available()
        if not ok:
            raise TestbedError(why)
        if self._token is not None:
            raise TestbedError("this testbed is already set up")
        cleanup_stale()           # what a killed (SIGKILL) run left behind
        global _COUNTER
        with _LIVE.lock:
            self._token = f"{os.getpid()}t{_COUNTER}"
            _COUNTER += 1
            _LIVE.add(self)
            _SIGNALS.arm()
        if len(f"{PREFIX}{self._token}r{len(self.source.hosts) - 1}") > 15:
            raise TestbedError("interface names would exceed 15 characters (too many testbeds in one process)")
        try:
            self._build_network()
            if self.shape_links:
                self._shape()
            if self.cpu_shares is not None or self.cpu_quota is not None:
                self._make_cgroups()
            if self.cpu_pinning:
                self._make_cpusets()
            hosts = [dataclasses.replace(h, address=self.address(i)) for i, h in enumerate(self.source.hosts)]
            self.topology = dataclasses.replace(self.source, hosts=hosts)
        except BaseException:
            self.close()
            raise
        return self

    def _build_network(self) -> None:
        with open(_LOCK_PATH, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one subnet per testbed, across processes
            used = _used_blocks()
            n_blocks = 1 << (BLOCK_PREFIX - NET.prefixlen)
            start = (os.getpid() * 7 + int(self._token.split("t")[1])) % n_blocks
            for off in range(n_blocks):
                k = (start + off) % n_blocks
                if k not in used:
                    break
            else:
                raise TestbedError("no free /24 left in 198.18.0.0/15 for a testbed")
            self._block = ipaddress.ip_network(f"{NET.network_address + (k << 8)}/{BLOCK_PREFIX}")
            br = self.bridge
            _run(["ip", "link", "add", br, "type", "bridge"])
            self._created.append(("link", br))
            _run(["ip", "addr", "add", f"{self._block.network_address + 1}/{BLOCK_PREFIX}", "dev", br])
            _run(["ip", "link", "set", br, "up"])
        for i in range(len(self.source.hosts)):
            ns, veth = self.namespace(i), self._veth(i)
            _run(["ip", "netns", "add", ns])
            self._created.append(("netns", ns))
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._created.append(("link", veth))
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/{BLOCK_PREFIX}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", veth, "master", br, "up"])
            if self.shape_links and self.gso_max_bytes is not None:
                size = str(self.gso_max_bytes)
                _run(["ip", "-n", ns, "link", "set", "dev", "eth0", "gso_max_size", size])
                _run(["ip", "link", "set", "dev", veth, "gso_max_size", size])

    def _nic_rates(self, nic_gbps) -> list[float]:
        """Bytes/s of each host's NIC: NIC_GBPS where given, else the host's fastest declared link."""
        hosts, bw = self.source.hosts, self.source.host_bandwidth
        n = len(hosts)
        rates = []
        for i in range(n):
            others = [float(bw[i, j]) for j in range(n) if j != i and 0 < float(bw[i, j]) < float("inf")]
            rates.append(max(others) if others else float("inf"))
        if nic_gbps is None:
            return rates
        names = [h.name for h in hosts]
        if isinstance(nic_gbps, Mapping):
            unknown = [k for k in nic_gbps if k not in names]
            if unknown:
                raise TestbedError(f"nic_gbps names unknown hosts {unknown}; known hosts: {', '.join(names)}")
            given = {names.index(k): v for k, v in nic_gbps.items()}
        else:
            values = list(nic_gbps)
            if len(values) != n:
                raise TestbedError(f"nic_gbps has {len(values)} entries for {n} hosts")
            given = dict(enumerate(values))
        for i, v in given.items():
            if v is not None:
                if not float(v) > 0:
                    raise TestbedError(f"nic_gbps of host {names[i]!r} must be > 0, got {v}")
                rates[i] = float(v) * 1e9 / 8
        return rates

    @staticmethod
    def _htb_class(tc: list[str], parent: str, classid: str, rate: float, ceil: float, dev: str = "eth0") -> None:
        bits, cbits = (max(8_000, int(round(r * 8))) for r in (rate, ceil))
        quantum = int(min(max(rate / 100, 1514), 200_000))
        # 0.2 ms worth at the ceiling, at least two frames. A real link sends at its rate; HTB's token bucket lets
        # a burst leave at the veth's speed after an idle gap, and a 2 ms bucket made a lone 256 KB tensor over
        # 0.3 Gbit/s take 5.1 ms against 7.0 ms on the wire, and random mixed plans run 6-7% faster than with
        # 0.2 ms (scripts/bench_transfers.py; the rate itself held at 0.185-1 Gbit/s with 0.2 ms)
        burst = int(max(ceil * BURST_S, 3028))
        _run(tc + ["class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
                   "rate", f"{bits}bit", "ceil", f"{cbits}bit", "burst", str(burst),
                   "cburst", str(burst), "quantum", str(quantum)])

    def _shape(self) -> None:
        n = len(self.source.hosts)
        bw, lat = self.source.host_bandwidth, self.source.host_latency
        netem_ok: bool | None = None
        wants_latency = False
        for i in range(n):
            ns = self.namespace(i)
            tc = ["tc", "-n", ns]
            # No default class: unclassified traffic (to the root namespace) leaves unshaped.
            _run(tc + ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb"])
            nic = self.nic_rates[i]
            pairs = [j for j in range(n) if j != i and 0 < float(bw[i, j]) < float("inf")]
            if not pairs:
                continue
            nic = min(nic, sum(float(bw[i, j]) for j in pairs))  # a NIC faster than every link together is moot
            # The NIC: one parent class; each destination's class is guaranteed only its fair share of the
            # NIC (so the guarantees never add up past it) and may borrow up to the pair's bandwidth.
            self._htb_class(tc, "1:", "1:1", nic, nic)
            for j in pairs:
                rate = float(bw[i, j])
                minor = f"{j + 16:x}"
                self._htb_class(tc, "1:1", f"1:{minor}", min(rate, nic / len(pairs)), min(rate, nic))
                delay = float(lat[i, j])
                if delay > 0:
                    wants_latency = True
                    if netem_ok is not False:
                        netem_ok = self._netem(tc, ns, minor, rate, delay, netem_ok)
                self._u32_filter(tc, "eth0", "dst", self.address(j), f"1:{minor}")
            self._shape_receive(i, nic, pairs)
        self.latency_shaped = bool(netem_ok) or not wants_latency
        if wants_latency and not netem_ok:
            warnings.warn("this kernel has no sch_netem: testbed links are bandwidth-shaped only; the declared "
                          "latencies are not added", RuntimeWarning, stacklevel=3)

    def _shape_receive(self, i: int, nic: float, senders: list[int]) -> None:
        """Cap what host I receives from SENDERS together at its NIC rate: an HTB class on the egress of the
        root-namespace end of its veth (the bridge sends the host's incoming frames through it). Traffic from
        the root namespace (the client session) is not classified, so it passes unshaped."""
        tc, veth = ["tc"], self._veth(i)
        _run(tc + ["qdisc", "add", "dev", veth, "root", "handle", "1:", "htb"])
        self._htb_class(tc, "1:", "1:1", nic, nic, dev=veth)
        for j in senders:
            self._u32_filter(tc, veth, "src", self.address(j), "1:1")

    @staticmethod
    def _u32_filter(tc: list[str], dev: str, field: str, address: str, flowid: str) -> None:
        """Send DEV's packets whose IP FIELD ("src" or "dst") is ADDRESS to HTB class FLOWID."""
        _run(tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                   "match", "ip", field, f"{address}/32", "flowid", flowid])

    @staticmethod
    def _netem(tc: list[str], ns: str, minor: str, rate: float, delay: float, netem_ok: bool | None) -> bool:
        """Add a netem delay under class 1:MINOR; False when the kernel has no sch_netem."""
        limit = max(1000, int(2 * rate * delay / 1500) + 100)
        res = _run(tc + ["qdisc", "add", "dev", "eth0", "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
                         "delay", f"{delay * 1e6:.0f}us", "limit", str(limit)], check=False)
        if res.returncode == 0:
            return True
        if netem_ok is None and "unknown" in res.stderr.lower():
            return False
        raise TestbedError(f"tc netem on {ns} failed: {' '.join(res.stderr.split())}")

    def _make_cgroups(self) -> None:
        if not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.shares")):
            raise TestbedError(f"cpu_shares / cpu_quota need the cgroup v1 cpu controller at {CGROUP_CPU}")
        if self.cpu_quota is not None and not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
            raise TestbedError(f"cpu_quota needs CFS bandwidth control (cpu.cfs_quota_us) at {CGROUP_CPU}")
        os.mkdir(self._cgroup())
        self._created.append(("cgroup", self._cgroup()))
        for i, h in enumerate(self.source.hosts):
            path = self._cgroup(i)
            os.mkdir(path)
            self._created.append(("cgroup", path))
            if self.cpu_shares is not None:
                with open(os.path.join(path, "cpu.shares"), "w") as f:
                    f.write(str(self.cpu_shares[h.name]))
            q = self.cpu_quota.get(h.name) if self.cpu_quota is not None else None
            if q is not None:
                with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                    f.write(str(CFS_PERIOD_US))
                with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                    f.write(str(max(1000, int(round(q * CFS_PERIOD_US)))))

    def _make_cpusets(self) -> None:
        """One cgroup v1 cpuset per pinned host (``self.cpu_pinning``) under one for the testbed."""
        if not os.path.isfile(os.path.join(CGROUP_CPUSET, "cpuset.cpus")):
            raise TestbedError(f"cpu_pinning needs the cgroup v1 cpuset controller at {CGROUP_CPUSET}; "
                               "pass cpu_pinning='off'")
        mems = _read(os.path.join(CGROUP_CPUSET, "cpuset.mems"))
        base = self._cgroup(root=CGROUP_CPUSET)
        os.mkdir(base)
        self._created.append(("cgroup", base))
        _write(os.path.join(base, "cpuset.cpus"), _read(os.path.join(CGROUP_CPUSET, "cpuset.cpus")))
        _write(os.path.join(base, "cpuset.mems"), mems)
        for i, h in enumerate(self.source.hosts):
            cpus = self.cpu_pinning.get(h.name)
            if cpus is None:
                continue
            path = self._cgroup(i, root=CGROUP_CPUSET)
            os.mkdir(path)
            self._created.append(("cgroup", path))
            try:
                _write(os.path.join(path, "cpuset.cpus"), cpus)
            except OSError as err:
                raise TestbedError(f"cannot pin host {h.name!r} to CPUs {cpus!r}: {err}") from None
            _write(os.path.join(path, "cpuset.mems"), mems)

    def launch_prefix(self, host: str | int) -> list[str]:
        """Argv prefix that runs a command inside HOST's namespace (and its cgroup and cpuset, when it has
        them)."""
        if self.topology is None:
            raise TestbedError("set up the testbed first (use it as a context manager)")
        i = self._index(host)
        groups = []
        if self.cpu_shares is not None or self.cpu_quota is not None:
            groups.append(os.path.join(self._cgroup(i), "cgroup.procs"))
        if self.cpu_pinning.get(self.source.hosts[i].name) is not None:
            groups.append(os.path.join(self._cgroup(i, root=CGROUP_CPUSET), "cgroup.procs"))
        # join the host's cgroups first: `ip netns exec` remounts /sys, hiding the cgroup tree
        join = "".join(f'echo $$ > "${k}" && ' for k in range(1, len(groups) + 1))
        prefix = ["sh", "-c", f'{join}shift {len(groups)} && exec "$@"', "sh", *groups] if groups else []
        return prefix + ["ip", "netns", "exec", self.namespace(i)]

    # -- workers ---------------------------------------------------------------------------------
    def start_workers(self, *, threads_per_worker: int | None = None, inter_threads_per_worker: int | None = None,
                      startup_timeout_s: float = 90.0) -> str:
        """Start one TF server per host inside its namespace (and cgroup); returns ``self.target``.
        ``threads_per_worker`` / ``inter_threads_per_worker``: intra- / inter-op threads (``LocalCluster``)."""
        if self.topology is None:
            raise TestbedError("set up the testbed first (use it as a context manager)")
        if self.cluster is not None:
            raise TestbedError("workers already running; stop_workers() first")
        from tag.backend.runtime import LocalCluster

        def launcher(host: "Host") -> list[str]:
            return self.launch_prefix(host.name)

        cluster = LocalCluster(self.topology, threads_per_worker=threads_per_worker,
                               inter_threads_per_worker=inter_threads_per_worker,
                               startup_timeout_s=startup_timeout_s, allow_remote=True, launcher=launcher)
        cluster.start()
        self.cluster = cluster
        self.target = cluster.target
        return self.target

    def stop_workers(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
            self.target = None

    # -- measuring -------------------------------------------------------------------------------
    def exec(self, host: str | int, argv: Sequence[str], *, timeout: float = 60.0,
             check: bool = True) -> subprocess.CompletedProcess:
        """Run ARGV inside a host's namespace and return the completed process (text output)."""
        return _run(["ip", "netns", "exec", self.namespace(host), *argv], check=check, timeout=timeout)

    def measure_bandwidth(self, a: str | int, b: str | int, *, seconds: float = 1.0,
                          max_bytes: int = 4 << 30) -> float:
        """Bytes/s of one TCP stream from host A to host B (python sockets, between their namespaces).

        Bounded by SECONDS and MAX_BYTES; the receiver times from its first to its last byte. The
        result is TCP goodput, about 95.6% of the link rate the topology declares (header overhead).
        """
        if self._block is None:
            raise TestbedError("set up the testbed first (use it as a context manager)")
        ia, ib = self._index(a), self._index(b)
        if ia == ib:
            raise TestbedError("measure_bandwidth needs two different hosts")
        wait = seconds + 30.0
        recv = subprocess.Popen(["ip", "netns", "exec", self.namespace(ib), sys.executable, "-c", _RECEIVER,
                                 self.address(ib), str(wait)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            port = recv.stdout.readline().strip()
            if not port.isdigit():
                raise TestbedError(f"bandwidth receiver in {self.namespace(ib)} failed: {recv.stderr.read().strip()}")
            self.exec(ia, [sys.executable, "-c", _SENDER, self.address(ib), port, str(seconds), str(max_bytes)],
                      timeout=wait)
            out, err = recv.communicate(timeout=wait)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        try:
            stats = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise TestbedError(f"bandwidth receiver gave no result: {err.strip()}") from None
        if stats["seconds"] <= 0:
            raise TestbedError("bandwidth measurement received too little data to time")
        return (stats["bytes"] - stats["first"]) / stats["seconds"]

    def measure_rtt(self, a: str | int, b: str | int, *, rounds: int = 20) -> float:
        """Median seconds of a 1-byte TCP request/response from host A to host B and back."""
        if self._block is None:
            raise TestbedError("set up the testbed first (use it as a context manager)")
        ia, ib = self._index(a), self._index(b)
        if ia == ib:
            raise TestbedError("measure_rtt needs two different hosts")
        echo = subprocess.Popen(["ip", "netns", "exec", self.namespace(ib), sys.executable, "-c", _ECHO,
                                 self.address(ib)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = echo.stdout.readline().strip()
            if not port.isdigit():
                raise TestbedError(f"echo server in {self.namespace(ib)} failed: {echo.stderr.read().strip()}")
            res = self.exec(ia, [sys.executable, "-c", _PING, self.address(ib), port, str(int(rounds))])
            return float(res.stdout.strip().splitlines()[-1])
        finally:
            if echo.poll() is None:
                echo.kill()
            echo.wait()

    def cpu_stat(self, host: str | int) -> dict[str, int]:
        """HOST's CFS counters (``nr_periods``, ``nr_throttled``, ``throttled_time`` in ns, ...) from its cgroup's
        ``cpu.stat``; empty when the host has no CPU cgroup (no quota, no shares)."""
        if self.cpu_shares is None and self.cpu_quota is None:
            return {}
        try:
            with open(os.path.join(self._cgroup(self._index(host)), "cpu.stat")) as f:
                return {k: int(v) for k, v in (line.split() for line in f if line.strip())}
        except OSError:
            return {}

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop workers and remove namespaces, veths, bridge and cgroups. Safe to call twice. SIGTERM and
        SIGINT wait until it is done (a signal that cut a teardown short would leave the rest behind)."""
        with _SIGNALS.held():
            self._close()

    def _close(self) -> None:
        errors: list[str] = []
        try:
            self.stop_workers()
        except Exception as err:  # noqa: BLE001 - keep tearing down
            errors.append(f"stopping workers: {err}")
        created, self._created = self._created, []
        for kind, name in created:
            if kind == "netns":
                _kill_netns_processes(name)
            elif kind == "cgroup":
                _kill_cgroup_processes(name)     # one started a moment ago may not be in its namespace yet
        for kind, name in reversed(created):
            try:
                if kind == "netns":
                    _run(["ip", "netns", "del", name], check=False)
                elif kind == "link":
                    if _run(["ip", "link", "show", name], check=False).returncode == 0:
                        _run(["ip", "link", "del", name])
                elif kind == "cgroup":
                    _rmdir_cgroup(name)
            except Exception as err:  # noqa: BLE001
                errors.append(str(err))
        with _LIVE.lock:
            _LIVE.discard(self)
            if not _LIVE.members():
                _SIGNALS.disarm()
        self.topology = None
        if errors:
            warnings.warn(f"testbed teardown left something behind: {'; '.join(errors)}", RuntimeWarning,
                          stacklevel=2)


def _kill_netns_processes(ns: str) -> None:
    res = _run(["ip", "netns", "pids", ns], check=False)
    for tok in res.stdout.split():
        if tok.isdigit():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _kill_cgroup_processes(path: str) -> None:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(tok) for tok in f.read().split() if tok.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _rmdir_cgroup(path: str) -> None:
    if not os.path.isdir(path):
        return
    for _ in range(50):  # processes killed a moment ago may still be leaving the group
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)
    os.rmdir(path)


def cleanup_stale() -> list[str]:
    """Remove namespaces, links and cgroups that testbeds of dead processes left behind.

    Only names with tag's prefix whose owning process id is no longer alive are touched; returns
    what was removed.
    """
    ok, why = testbed_available()
    if not ok:
        raise TestbedError(why)
    removed: list[str] = []

    def stale(name: str) -> bool:
        m = _NAME_RE.match(name)
        return bool(m) and not _pid_alive(int(m.group(1)))

    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(name):
            _kill_netns_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(f"netns {name}")
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if stale(name) and _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"link {name}")
    for root in (CGROUP_CPU, CGROUP_CPUSET):
        if not os.path.isdir(root):
            continue
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if os.path.isdir(path) and stale(name):
                for child in os.listdir(path):
                    if os.path.isdir(os.path.join(path, child)):
                        _kill_cgroup_processes(os.path.join(path, child))
                        try:
                            _rmdir_cgroup(os.path.join(path, child))
                        except OSError:
                            pass
                try:
                    _rmdir_cgroup(path)
                    removed.append(f"cgroup {path}")
                except OSError:
                    pass
    return removed
