"""Cluster topology: load a .pbtxt cluster description, validate it, expose it as plain data.

Example::

    topo = tag.load_topology("topologies/lab-v100-1080ti.pbtxt")
    topo.num_devices, [g.name for g in topo.groups]
    topo.bandwidth[0, 5]     # bytes/s between device 0 and device 5
    topo.tf_device(5)        # "/job:worker/task:1/device:GPU:1"

    # the same from text (tests, generated clusters):
    topo = parse_topology('host { name: "a" address: "127.0.0.1" port: 2222 '
                          'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 '
                          'memory_bandwidth_gbs: 10 } }')

Units inside tag are SI: bytes, bytes/s, FLOP/s, seconds. The .pbtxt uses the units people read on
spec sheets (GiB of memory, TFLOP/s, GB/s of memory bandwidth, Gbit/s links, microseconds latency);
the loader converts. proto/topology.proto documents every field.

Ordering (stable, relied on by the rest of tag): hosts in file order (task index = order), device
groups in file order within a host, devices numbered consecutively group by group;
``Device.tf_local_index`` counts a host's devices per TF device type ("GPU"/"CPU").
Device names are "HOST/TYPE:LOCAL" (LOCAL counts within the group), group names "HOST/TYPE".
A device type may appear once per host (give its count instead of repeating it).

Every problem with the file -- unreadable, not text, not protobuf text format, or a semantic error --
raises ``TopologyError`` with a one-line message ``PATH:LINE: what is wrong`` (``PATH: ...`` when no
line applies).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tag.errors import TopologyError

MAX_FILE_BYTES = 2 * 2**20      # larger files are rejected before parsing: protobuf's Python text
                                # parser takes seconds per MiB; 512 hosts with a fabric are ~100 KiB
MAX_DEVICES = 4096              # tag keeps dense device x device matrices
MAX_GROUP_COUNT = 4096

# Unit conversions from the .pbtxt's spec-sheet units to SI.
GIB = 2**30
TFLOPS = 1e12
GBYTES_PER_S = 1e9
GBITS_PER_S = 1e9 / 8
MICROSECOND = 1e-6
#: tensor-core precisions a device entry may give a peak for (``peak_<precision>_tflops``)
TENSOR_PRECISIONS = ("tf32", "fp16", "bf16")
#: a host's ``port: 0``: a free port chosen when tag starts the (loopback) host
FREE_PORT = 0

@dataclass(frozen=True)
class Host:
    name: str
    address: str                    # where its TF server listens
    port: int                       # 0 (loopback hosts only): a free port chosen when the host is started
    task_index: int                 # its task index in the "worker" job (order in the file)
    intra_bandwidth: float          # bytes/s between devices of this host (NVLink / PCIe)
    intra_latency: float            # seconds


@dataclass(frozen=True)
class DeviceGroup:
    """Same-type devices on one host (TAG's "task")."""

    index: int
    name: str                       # "HOST/TYPE", unique
    host: str
    device_type: str                # "V100", "A100", "CPU", ...
    tf_device_type: str             # "GPU" or "CPU"
    devices: tuple[int, ...]        # global device indices
    memory_bytes: int               # per device
    peak_flops: float               # per device, FLOP/s
    memory_bandwidth: float         # per device, bytes/s
    #: tensor-core peaks the file declares, FLOP/s per device: (("tf32", x), ("fp16", y), ...); others omitted
    declared_peaks: tuple[tuple[str, float], ...] = ()

    def declared_peak(self, precision: str) -> float | None:
        """The peak FLOP/s the file declares for PRECISION ("fp32", "tf32", "fp16", "bf16"), or None."""
        if precision == "fp32":
            return self.peak_flops
        return dict(self.declared_peaks).get(precision)


@dataclass(frozen=True)
class Device:
    index: int                      # global index, 0..num_devices-1
    name: str                       # "HOST/TYPE:LOCAL"
    host: str
    host_index: int
    group: int                      # device-group index
    tf_device_type: str             # "GPU" or "CPU"
    tf_local_index: int             # index among this host's devices of tf_device_type
    device_type: str
    memory_bytes: int
    peak_flops: float
    memory_bandwidth: float


@dataclass
class Topology:
    name: str
    path: str
    hosts: list[Host]
    groups: list[DeviceGroup]
    devices: list[Device]
    bandwidth: np.ndarray           # [num_devices, num_devices] bytes/s (diagonal: inf)
    latency: np.ndarray             # [num_devices, num_devices] seconds (diagonal: 0)
    host_bandwidth: np.ndarray      # [num_hosts, num_hosts] bytes/s between hosts (diagonal: inf)
    host_latency: np.ndarray        # [num_hosts, num_hosts] seconds
    comment: str = ""               # the file's leading comment (what it models, sources)
    extra: dict = field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def tf_device(self, device_index: int) -> str:
        """The TF device string of a device, e.g. ``/job:worker/task:1/device:GPU:0``."""
        d = self.devices[device_index]
        return f"/job:worker/task:{self.hosts[d.host_index].task_index}/device:{d.tf_device_type}:{d.tf_local_index}"

    def devices_by_host(self, devices=None) -> dict[int, list[int]]:
        """Host index -> the given global device indices on that host (all devices when None), in order."""
        by_host: dict[int, list[int]] = {}
        for d in (range(len(self.devices)) if devices is None else devices):
            by_host.setdefault(self.devices[int(d)].host_index, []).append(int(d))
        return by_host

    def cluster_spec(self) -> dict[str, list[str]]:
        """``{"worker": ["addr:port", ...]}`` in task order, for tf.train.ClusterSpec."""
        return {"worker": [f"{h.address}:{h.port}" for h in sorted(self.hosts, key=lambda h: h.task_index)]}

    @property
    def free_port_hosts(self) -> list[str]:
        """The hosts whose port is 0: a free port is chosen for each when tag starts them (loopback hosts only)."""
        return [h.name for h in self.hosts if h.port == FREE_PORT]

    def with_ports(self, ports: dict[str, int]) -> "Topology":
        """A copy whose hosts named in PORTS (host name -> port) listen on those ports: a started cluster's
        topology, where ``port: 0`` became the free port chosen for it."""
        hosts = [dataclasses.replace(h, port=int(ports[h.name])) if h.name in ports else h for h in self.hosts]
        return dataclasses.replace(self, hosts=hosts)


# ----------------------------------------------------------------------------------------------
# Loading


def load_topology(path: str | os.PathLike) -> Topology:
    """Read, parse and validate a .pbtxt cluster file; raises TopologyError on any problem."""
    shown = os.fspath(path)
    if isinstance(shown, bytes):
        shown = os.fsdecode(shown)
    return parse_topology(_read_text(shown), path=shown)


def parse_topology(text: str, path: str = "<string>") -> Topology:
    """Parse and validate cluster TEXT (protobuf text format); PATH only names it in messages."""
    from google.protobuf import text_format

    from tag._proto import topology_pb2

    cluster = topology_pb2.Cluster()
    try:
        text_format.Parse(text, cluster)
    except text_format.ParseError as e:
        line = e.GetLine() if e.GetLine() and e.GetLine() > 0 else None
        raise _error(path, line, _parse_error_message(e, text, topology_pb2)) from None
    except RecursionError:
        raise _error(path, None, "nesting too deep to be a topology file") from None
    except Exception as e:  # noqa: BLE001 - the parser's own failures are still bad input
        raise _error(path, None, f"cannot parse as protobuf text format: {type(e).__name__}: {e}") from None
    return _build(cluster, text, path, _Lines(text, cluster.DESCRIPTOR))


def format_topology(topology: Topology) -> str:
    """TOPOLOGY as cluster-file text (protobuf text format) that ``parse_topology`` reads back to the same hosts,
    devices, links and fabric: how a plan directory carries the cluster it was made for. The leading comment is
    kept; the text is generated, so its other comments and field order are not the original file's."""
    kinds = topology.extra.get("interconnect", {})
    out = [f"# {line}".rstrip() for line in topology.comment.splitlines()]
    out.append(f"name: {_pb_string(topology.name)}")
    for h in sorted(topology.hosts, key=lambda h: h.task_index):
        out.append("host {")
        out.append(f"  name: {_pb_string(h.name)}")
        out.append(f"  address: {_pb_string(h.address)}")
        out.append(f"  port: {h.port}")
        for g in topology.groups:
            if g.host != h.name:
                continue
            fields = [f"type: {_pb_string(g.device_type)}", f"kind: {g.tf_device_type}", f"count: {len(g.devices)}",
                      f"memory_gib: {g.memory_bytes / GIB!r}", f"peak_tflops: {g.peak_flops / TFLOPS!r}",
                      f"memory_bandwidth_gbs: {g.memory_bandwidth / GBYTES_PER_S!r}"]
            fields += [f"peak_{prec}_tflops: {peak / TFLOPS!r}" for prec, peak in g.declared_peaks]
            out.append("  device { " + " ".join(fields) + " }")
        if h.name in kinds:
            out.append(f"  interconnect {{ kind: {kinds[h.name]} bandwidth_gbs: {h.intra_bandwidth / GBYTES_PER_S!r} "
                       f"latency_us: {h.intra_latency / MICROSECOND!r} }}")
        out.append("}")
    for link in topology.extra.get("links", []):
        out.append(f"link {{ a: {_pb_string(link['a'])} b: {_pb_string(link['b'])} bandwidth_gbps: "
                   f"{link['bandwidth'] / GBITS_PER_S!r} latency_us: {link['latency'] / MICROSECOND!r} }}")
    fabric = topology.extra.get("fabric")
    if fabric:
        out.append(f"fabric {{ bandwidth_gbps: {fabric['bandwidth'] / GBITS_PER_S!r} "
                   f"latency_us: {fabric['latency'] / MICROSECOND!r} }}")
    return "\n".join(out) + "\n"


def _pb_string(value: Any) -> str:
    """VALUE as a protobuf text-format string literal."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _read_text(path: str) -> str:
    from tag.files import read_input_file
    data = read_input_file(path, what="topology file", limit=MAX_FILE_BYTES, error=TopologyError)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise _error(path, line, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                                 "is this a binary file?") from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise _error(path, line, "contains a NUL character; is this a binary file?")
    if not text.strip():
        raise _error(path, None, "empty file: expected a cluster in protobuf text format (host { ... })")
    return text


# ----------------------------------------------------------------------------------------------
# Errors


def _error(path: str, line: int | None, message: str) -> TopologyError:
    message = " ".join(str(message).split())
    if len(message) > 400:
        message = message[:397] + "..."
    return TopologyError(f"{path}:{line}: {message}" if line else f"{path}: {message}")


def _q(value: Any) -> str:
    """A user-written value quoted for a message, shortened."""
    s = str(value)
    if len(s) > 60:
        s = s[:57] + "..."
    return repr(s)


_UNKNOWN_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "([^"]*)"')
_UNKNOWN_ENUM = re.compile(r'Enum type "([\w.]+)" has no value named (.*?)\.?$')


def _parse_error_message(e: Exception, text: str, pb2: Any) -> str:
    """The parser's message without its position prefix and echoed source line, plus hints."""
    msg = str(e)
    msg = re.sub(r"^\d+:\d+ : ", "", msg)
    line = e.GetLine() if hasattr(e, "GetLine") else None
    if line and msg.startswith("'"):
        lines = text.split("\n")
        if 0 < line <= len(lines):
            for candidate in (lines[line - 1], lines[line - 1] + "\n"):
                if msg.startswith(f"'{candidate}': "):
                    msg = msg[len(candidate) + 4:]
                    break
            else:
                # The parser echoes the current line; drop it when it is not the one we expected.
                cut = msg.find("': ")
                if cut > 0:
                    msg = msg[cut + 3:]
    m = _UNKNOWN_FIELD.search(msg)
    if m:
        try:
            desc = pb2.DESCRIPTOR.pool.FindMessageTypeByName(m.group(1))
            msg = (f"unknown field {_q(m.group(2))} in {desc.name} "
                   f"(its fields: {', '.join(f.name for f in desc.fields)})")
        except KeyError:
            pass
        if m.group(1) == "tag.Interconnect" and m.group(2) == "bandwidth_gbps":
            msg += "; inside a host bandwidth is in GB/s: bandwidth_gbs"
        elif m.group(1) in ("tag.Link", "tag.Fabric") and m.group(2) == "bandwidth_gbs":
            msg += "; between hosts bandwidth is in Gbit/s: bandwidth_gbps"
    m = _UNKNOWN_ENUM.search(msg)
    if m:
        try:
            enum = pb2.DESCRIPTOR.pool.FindEnumTypeByName(m.group(1))
            allowed = [v.name for v in enum.values if v.number != 0]
            msg = (f"unknown {enum.full_name.removeprefix('tag.')} value {_q(m.group(2))} "
                   f"(expected one of: {', '.join(allowed)})")
        except KeyError:
            pass
    head = text.lstrip()[:1]
    if head in ("{", "["):
        msg += " -- this looks like JSON, but topology files are protobuf text format: host { name: \"a\" ... }"
    elif text.lstrip().startswith("---") or re.search(r"^[ \t]*(- \w+:|\w+:[ \t]*$)", text, re.M):
        msg += " -- this looks like YAML, but topology files are protobuf text format: host { name: \"a\" ... }"
    return msg


# ----------------------------------------------------------------------------------------------
# Source lines of fields (protobuf's Python text parser reports no positions for parsed fields)

_TOKEN = re.compile(r"""
    (?P<nl>\n) | (?P<ws>[ \t\r\f\v]+) | (?P<comment>\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<word>[A-Za-z0-9_.+\-]+) | (?P<other>.)
""", re.X)


class _Lines:
    """Maps field paths such as ("host", 2, "device", 0, "count") to 1-based source lines.

    Built from text that protobuf already parsed, walking it with the message descriptors. A
    repeated message field gets one entry per element: path + (name, index); a singular message
    field path + (name, 0); a scalar path + (name,). Lookup falls back to the closest enclosing
    entry; when the walk fails (it should not) every lookup gives None.
    """

    def __init__(self, text: str, descriptor: Any):
        self.lines: dict[tuple, int] = {}
        tokens: list[tuple[str, int, bool]] = []
        line = 1
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            if kind == "nl":
                line += 1
            elif kind in ("str", "word", "other"):
                tokens.append((m.group(), line, kind == "str"))
        self._tokens = tokens
        self._pos = 0
        try:
            self._message(descriptor, (), None)
        except (IndexError, KeyError, ValueError):
            self.lines = {}

    def __call__(self, *path: Any) -> int | None:
        for k in range(len(path), 0, -1):
            line = self.lines.get(tuple(path[:k]))
            if line is not None:
                return line
        return None

    def _next(self) -> str:
        tok = self._tokens[self._pos][0]
        self._pos += 1
        return tok

    def _peek(self) -> str | None:
        return self._tokens[self._pos][0] if self._pos < len(self._tokens) else None

    def _message(self, desc: Any, path: tuple, closer: str | None) -> None:
        counts: dict[str, int] = {}
        while True:
            tok = self._peek()
            if tok is None:
                if closer is not None:
                    raise ValueError("unbalanced")
                return
            if tok == closer:
                self._pos += 1
                return
            if tok in (";", ","):
                self._pos += 1
                continue
            name_line = self._tokens[self._pos][1]
            name = self._next()
            fd = desc.fields_by_name[name]
            if self._peek() == ":":
                self._pos += 1
            if fd.message_type is not None:
                elements = self._peek() == "["
                if elements:
                    self._pos += 1
                while True:
                    if elements and self._peek() == ",":
                        self._pos += 1
                        continue
                    if elements and self._peek() == "]":
                        self._pos += 1
                        break
                    i = counts.get(name, 0)
                    counts[name] = i + 1
                    opener_line = self._tokens[self._pos][1] if elements else name_line
                    self.lines.setdefault(path + (name,), opener_line)
                    self.lines[path + (name, i)] = opener_line
                    opener = self._next()
                    self._message(fd.message_type, path + (name, i), "}" if opener == "{" else ">")
                    if not elements:
                        break
            else:
                self.lines[path + (name,)] = name_line
                if self._peek() == "[":
                    while self._next() != "]":
                        pass
                    continue
                if self._peek() == "-":
                    self._pos += 1
                is_string = self._tokens[self._pos][2]
                self._pos += 1
                while is_string and self._pos < len(self._tokens) and self._tokens[self._pos][2]:
                    self._pos += 1   # adjacent string literals are concatenated


# ----------------------------------------------------------------------------------------------
# Validation and construction

_HOST_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_TYPE_NAME = re.compile(r"[A-Za-z0-9_.+\-]{1,64}")
_DNS_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?")


def is_loopback_address(address: str) -> bool:
    """Is ADDRESS (as a cluster file gives it) a loopback address by its text: 127.0.0.0/8, ::1, localhost?"""
    bare = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    if bare in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _normalise_address(address: str) -> str | None:
    """The address as it goes into "address:port" (IPv6 in brackets), or None when unparseable."""
    bare = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        pass
    else:
        return f"[{ip}]" if ip.version == 6 else str(ip)
    if bare is not address or len(address) > 253:
        return None
    labels = address.split(".")
    if not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return None
    if labels[-1].isdigit():   # all-numeric last label: a mistyped IPv4 address, not a hostname
        return None
    return address


class _Checker:
    """Shared helpers for the semantic checks: numbers with units, positions."""

    def __init__(self, path: str, where: _Lines):
        self.path = path
        self.where = where

    def fail(self, loc: tuple, message: str) -> TopologyError:
        return _error(self.path, self.where(*loc), message)

    def positive(self, msg: Any, name: str, loc: tuple, what: str, limit: float, low: float = 1e-6) -> float:
        """A required number in (0, LIMIT]; values below LOW are rejected as typos (1e-300 GiB, ...)."""
        if not msg.HasField(name):
            raise self.fail(loc, f"{what}: missing {name}")
        value = float(getattr(msg, name))
        loc = loc + (name,)
        if not math.isfinite(value):
            raise self.fail(loc, f"{what}: {name} must be a finite number, got {value}")
        if value <= 0:
            raise self.fail(loc, f"{what}: {name} must be positive, got {value:g}")
        if value > limit:
            raise self.fail(loc, f"{what}: {name} = {value:g} is implausibly large (limit {limit:,.0f})")
        if value < low:
            raise self.fail(loc, f"{what}: {name} = {value:g} is implausibly small (at least {low:g})")
        return value

    def latency(self, msg: Any, loc: tuple, what: str) -> float:
        if not msg.HasField("latency_us"):
            return 0.0
        value = float(msg.latency_us)
        loc = loc + ("latency_us",)
        if not math.isfinite(value):
            raise self.fail(loc, f"{what}: latency_us must be a finite number, got {value}")
        if value < 0:
            raise self.fail(loc, f"{what}: latency_us must not be negative, got {value:g}")
        if value > 1e9:
            raise self.fail(loc, f"{what}: latency_us = {value:g} is implausibly large (limit 1,000,000,000)")
        return value * MICROSECOND


def _build(cluster: Any, text: str, path: str, where: _Lines) -> Topology:
    """Validate a parsed cluster message and build the Topology (hosts, then links, then the matrices)."""
    from tag._proto import topology_pb2

    check = _Checker(path, where)
    if not cluster.host:
        raise check.fail((), "no hosts: a cluster needs at least one host { ... } with a device")
    name = cluster.name or os.path.splitext(os.path.basename(path))[0] or "cluster"
    if len(name) > 200 or not name.isprintable():
        raise check.fail(("name",), "cluster name must be printable text of at most 200 characters")

    hosts = _HostBuilder(check, topology_pb2)
    for hi, h in enumerate(cluster.host):
        hosts.add(hi, h)
    host_bw, host_lat, links = _host_links(cluster, hosts.hosts, check)
    fabric = _fabric(cluster, hosts.hosts, host_bw, host_lat, check)
    bandwidth, latency = _device_matrices(hosts.hosts, hosts.devices, host_bw, host_lat)
    return Topology(
        name=name, path=path, hosts=hosts.hosts, groups=hosts.groups, devices=hosts.devices,
        bandwidth=bandwidth, latency=latency, host_bandwidth=host_bw, host_latency=host_lat,
        comment=_leading_comment(text),
        extra={"interconnect": hosts.interconnect_kinds, "links": links, "fabric": fabric})


class _HostBuilder:
    """Validates the host { ... } entries one by one and collects hosts, device groups and devices
    (numbered in file order)."""

    def __init__(self, check: _Checker, pb2: Any):
        self.check = check
        self.pb2 = pb2                                        # the topology_pb2 module (enum names)
        self.hosts: list[Host] = []
        self.groups: list[DeviceGroup] = []
        self.devices: list[Device] = []
        self.host_line: dict[str, int | None] = {}            # host name -> its line in the file
        self.endpoints: dict[tuple[str, int], str] = {}       # (address, port) -> host name
        self.interconnect_kinds: dict[str, str] = {}          # host name -> interconnect kind name

    def add(self, hi: int, h: Any) -> None:
        """Check host #HI (message H), then its devices and its interconnect; append it."""
        loc = ("host", hi)
        what, address = self._identity(hi, h, loc)
        host_first_device = len(self.devices)
        self._add_devices(hi, h, loc, what)
        intra_bw, intra_lat = self._interconnect(h, loc, what, len(self.devices) - host_first_device)
        self.hosts.append(Host(name=h.name, address=address, port=int(h.port), task_index=hi,
                               intra_bandwidth=intra_bw, intra_latency=intra_lat))

    def _identity(self, hi: int, h: Any, loc: tuple) -> tuple[str, str]:
        """(how messages name the host, its normalised address) after checking name, address and port."""
        check = self.check
        if not h.name:
            raise check.fail(loc, f"host #{hi + 1} has no name")
        if not _HOST_NAME.fullmatch(h.name):
            raise check.fail(loc + ("name",), f"host name {_q(h.name)} may use only letters, digits, "
                                              "'_', '.', '-' (at most 128)")
        what = f"host {_q(h.name)}"
        if h.name in self.host_line:
            first = self.host_line[h.name]
            raise check.fail(loc + ("name",), f"duplicate host name {_q(h.name)}"
                                              + (f" (first on line {first})" if first else ""))
        self.host_line[h.name] = check.where("host", hi)
        if not h.address:
            raise check.fail(loc, f"{what}: missing address (hostname or IP address of its TF server)")
        address = _normalise_address(h.address)
        if address is None:
            hint = ""
            if re.fullmatch(r"[^:]+:\d+", h.address):
                hint = " (give the port in port:, not in the address)"
            raise check.fail(loc + ("address",), f"{what}: address {_q(h.address)} is neither an IP "
                                                 f"address nor a valid hostname{hint}")
        if not h.HasField("port"):
            raise check.fail(loc, f"{what}: missing port")
        if h.port == FREE_PORT and not is_loopback_address(address):
            raise check.fail(loc + ("port",), f"{what}: port 0 (a free port chosen at start) is only for loopback "
                                              f"hosts (127.0.0.1, ::1, localhost), not {address}: give its port")
        if not (1 <= h.port <= 65535 or h.port == FREE_PORT):
            raise check.fail(loc + ("port",), f"{what}: port must be in 1..65535 (or 0 on a loopback host), "
                                              f"got {h.port}")
        endpoint = (address, int(h.port))
        if h.port != FREE_PORT and endpoint in self.endpoints:
            raise check.fail(loc + ("port",), f"{what}: {address}:{h.port} is already the address of "
                                              f"host {_q(self.endpoints[endpoint])}")
        self.endpoints[endpoint] = h.name
        if not h.device:
            raise check.fail(loc, f"{what} has no devices (add device {{ type: ... kind: GPU ... }})")
        return what, address

    def _add_devices(self, hi: int, h: Any, loc: tuple, what: str) -> None:
        """One DeviceGroup per device entry of host #HI, and its devices."""
        seen_types: dict[str, int] = {}    # device type -> its entry index on this host
        tf_counts: dict[str, int] = {}     # TF device type ("GPU"/"CPU") -> devices of it so far on this host
        for di, d in enumerate(h.device):
            dloc = loc + ("device", di)
            if not d.type:
                raise self.check.fail(dloc, f"{what}: device entry #{di + 1} has no type")
            if not _TYPE_NAME.fullmatch(d.type):
                raise self.check.fail(dloc + ("type",), f"{what}: device type {_q(d.type)} may use only "
                                                        "letters, digits, '_', '.', '+', '-' (at most 64)")
            if d.type in seen_types:
                raise self.check.fail(dloc + ("type",), f"{what} lists device type {_q(d.type)} twice "
                                                        f"(entries #{seen_types[d.type] + 1} and #{di + 1}); "
                                                        "give one entry with its count, or name different "
                                                        "models differently")
            seen_types[d.type] = di
            group = self._group(h, d, dloc, f"{what} device {_q(d.type)}")
            self.groups.append(group)
            for local in range(len(group.devices)):
                tf_type = group.tf_device_type
                self.devices.append(Device(
                    index=len(self.devices), name=f"{group.name}:{local}", host=h.name, host_index=hi,
                    group=group.index, tf_device_type=tf_type, tf_local_index=tf_counts.get(tf_type, 0),
                    device_type=d.type, memory_bytes=group.memory_bytes, peak_flops=group.peak_flops,
                    memory_bandwidth=group.memory_bandwidth))
                tf_counts[tf_type] = tf_counts.get(tf_type, 0) + 1

    def _group(self, h: Any, d: Any, dloc: tuple, dwhat: str) -> DeviceGroup:
        """The checked DeviceGroup of device entry D of host H (its devices numbered after those so far)."""
        check, kinds = self.check, self.pb2.DeviceGroup
        if d.kind == kinds.KIND_UNSPECIFIED:
            raise check.fail(dloc, f"{dwhat}: missing kind (GPU or CPU)")
        if d.kind not in (kinds.GPU, kinds.CPU):
            raise check.fail(dloc + ("kind",), f"{dwhat}: unknown kind {d.kind} (GPU or CPU)")
        tf_type = kinds.Kind.Name(d.kind)
        count = int(d.count) if d.HasField("count") else 1
        if count <= 0:
            raise check.fail(dloc + ("count",), f"{dwhat}: count must be positive, got {count}")
        if count > MAX_GROUP_COUNT:
            raise check.fail(dloc + ("count",), f"{dwhat}: count {count} is over the limit of "
                                                f"{MAX_GROUP_COUNT}")
        memory = check.positive(d, "memory_gib", dloc, dwhat, 2**20, low=1e-3)
        tflops = check.positive(d, "peak_tflops", dloc, dwhat, 1e6)
        membw = check.positive(d, "memory_bandwidth_gbs", dloc, dwhat, 1e7)
        peaks = tuple((prec, check.positive(d, f"peak_{prec}_tflops", dloc, dwhat, 1e6) * TFLOPS)
                      for prec in TENSOR_PRECISIONS if d.HasField(f"peak_{prec}_tflops"))
        first = len(self.devices)
        if first + count > MAX_DEVICES:
            raise check.fail(dloc + ("count",), f"the cluster has more than {MAX_DEVICES} devices, "
                                                "tag's limit")
        return DeviceGroup(
            index=len(self.groups), name=f"{h.name}/{d.type}", host=h.name, device_type=d.type,
            tf_device_type=tf_type, devices=tuple(range(first, first + count)),
            memory_bytes=int(round(memory * GIB)), peak_flops=tflops * TFLOPS,
            memory_bandwidth=membw * GBYTES_PER_S, declared_peaks=peaks)

    def _interconnect(self, h: Any, loc: tuple, what: str, n_host_devices: int) -> tuple[float, float]:
        """(bytes/s, seconds) between devices of host H; records its interconnect kind."""
        check = self.check
        if h.HasField("interconnect"):
            iloc = loc + ("interconnect", 0)
            iwhat = f"{what} interconnect"
            intra_bw = check.positive(h.interconnect, "bandwidth_gbs", iloc, iwhat, 1e7) * GBYTES_PER_S
            intra_lat = check.latency(h.interconnect, iloc, iwhat)
            kind = h.interconnect.kind
            kinds = self.pb2.Interconnect.Kind
            if kind not in kinds.values():
                names = ", ".join(n for n in kinds.keys() if n != "INTERCONNECT_UNSPECIFIED")
                raise check.fail(iloc + ("kind",), f"{iwhat}: unknown kind {kind} ({names})")
            self.interconnect_kinds[h.name] = kinds.Name(kind)
            return intra_bw, intra_lat
        if n_host_devices > 1:
            raise check.fail(loc, f"{what} has {n_host_devices} devices but no interconnect "
                                  "{ kind: ... bandwidth_gbs: ... }")
        return math.inf, 0.0   # a single device: no transfers inside the host


def _host_links(cluster: Any, hosts: list[Host],
                check: _Checker) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """(host x host bytes/s, host x host seconds, one dict per link) from the link { ... } entries;
    pairs without a link are NaN."""
    index = {h.name: i for i, h in enumerate(hosts)}
    n = len(hosts)
    host_bw = np.full((n, n), np.nan)
    host_lat = np.full((n, n), np.nan)
    links = []
    link_line: dict[tuple[int, int], int | None] = {}   # (host i, host j), i < j -> line of their link
    for li, link in enumerate(cluster.link):
        loc = ("link", li)
        for end in ("a", "b"):
            value = getattr(link, end)
            if not value:
                raise check.fail(loc, f"link #{li + 1}: missing {end} (a host name)")
            if value not in index:
                raise check.fail(loc + (end,), f"link #{li + 1}: unknown host {_q(value)}")
        what = f"link {link.a} - {link.b}"
        if link.a == link.b:
            raise check.fail(loc, f"link #{li + 1} connects host {_q(link.a)} to itself")
        i, j = sorted((index[link.a], index[link.b]))
        if (i, j) in link_line:
            first = link_line[(i, j)]
            raise check.fail(loc, f"duplicate link between {_q(link.a)} and {_q(link.b)}"
                                  + (f" (first on line {first})" if first else ""))
        link_line[(i, j)] = check.where(*loc)
        bw = check.positive(link, "bandwidth_gbps", loc, what, 1e9) * GBITS_PER_S
        lat = check.latency(link, loc, what)
        host_bw[i, j] = host_bw[j, i] = bw
        host_lat[i, j] = host_lat[j, i] = lat
        links.append({"a": link.a, "b": link.b, "bandwidth": bw, "latency": lat})
    return host_bw, host_lat, links


def _fabric(cluster: Any, hosts: list[Host], host_bw: np.ndarray, host_lat: np.ndarray,
            check: _Checker) -> dict[str, float] | None:
    """The fabric { ... } (bandwidth, latency), if any; fills the host pairs without a link with it, in place."""
    fabric = None
    if cluster.HasField("fabric"):
        loc = ("fabric", 0)
        fbw = check.positive(cluster.fabric, "bandwidth_gbps", loc, "fabric", 1e9) * GBITS_PER_S
        flat = check.latency(cluster.fabric, loc, "fabric")
        fabric = {"bandwidth": fbw, "latency": flat}
    missing = np.isnan(host_bw)
    np.fill_diagonal(missing, False)
    if missing.any():
        if fabric is None:
            i, j = (int(x) for x in np.argwhere(missing)[0])
            raise check.fail(("host", j), f"hosts {_q(hosts[i].name)} and {_q(hosts[j].name)} have no link and "
                                          "there is no fabric { bandwidth_gbps: ... } to connect them")
        host_bw[missing] = fabric["bandwidth"]
        host_lat[missing] = fabric["latency"]
    return fabric


def _device_matrices(hosts: list[Host], devices: list[Device], host_bw: np.ndarray,
                     host_lat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Device x device (bytes/s, seconds); sets the host matrices' diagonals (inf, 0) in place.

    Indexes a host x host table whose diagonal holds each host's interconnect (no loops over device
    pairs: a 512-device cluster loads in milliseconds)."""
    intra_bw = np.array([h.intra_bandwidth for h in hosts], dtype=float)
    intra_lat = np.array([h.intra_latency for h in hosts], dtype=float)
    table_bw, table_lat = host_bw.copy(), host_lat.copy()
    np.fill_diagonal(table_bw, intra_bw)
    np.fill_diagonal(table_lat, intra_lat)
    device_host = np.array([d.host_index for d in devices], dtype=np.intp)
    bandwidth = table_bw[device_host[:, None], device_host[None, :]]
    latency = table_lat[device_host[:, None], device_host[None, :]]
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(host_bw, np.inf)
    np.fill_diagonal(host_lat, 0.0)
    return bandwidth, latency


def _leading_comment(text: str) -> str:
    """The '#' comment block the file opens with, without the '#' marks."""
    out = []
    for line in text.lstrip("\ufeff").splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            if stripped or out:
                break
            continue
        body = stripped[1:]
        out.append(body[1:] if body.startswith(" ") else body)
    return "\n".join(out).strip("\n")
