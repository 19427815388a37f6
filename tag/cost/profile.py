"""Profiles: measured numbers per device type and of the distributed runtime, as plain data (JSON).

A ``Profile`` is what ``tag-profile`` measures and ``tag.cost.model.CostModel`` applies; this module holds its
dataclasses, their validation and the JSON form, and no cost formulas.

Example::

    from tag.cost.profile import Profile
    prof = Profile.load("profile.json")          # TagError naming the file and field on bad input
    prof.devices["CPU"].peak_flops

Profile JSON::

    {"version": 1,
     "devices": {"CPU": {"peak_flops": 1.1e11, "memory_bandwidth": 9e9, "launch_overhead_s": 1.2e-5,
                         "efficiency": {"MatMul": 0.62, "Conv2D": 0.4, "default": 0.1},
                         "family_scale": {"conv": 0.8, "matmul": 1.1}, "level_fade_s": 0.002}},
     "source": "tag.profile on zoo:mlp, 20 steps"}

An optional ``"devices_under_load"`` object holds entries of the same form for device types timed while the
other hosts of one machine computed (a testbed's hosts share one machine; ``Profile.devices_under_load``).

How a profile applies to a device group of the topology: the entry named after the group's device type
(e.g. "V100", "CPU") is used if present, and its measured ``peak_flops`` / ``memory_bandwidth`` (when > 0)
replace the topology's spec numbers, because its efficiencies were fitted against them. Otherwise the
entry named "default" gives the efficiencies, launch overhead and family scales while the topology's
spec numbers give peak and bandwidth (other device types scale by their spec sheets). Without either,
built-in defaults for the group's TF device type (GPU or CPU) are used.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from tag.cluster.topology import Topology
from tag.cost.matmul_table import MatmulTable
from tag.cost.op_classes import FAMILIES
from tag.errors import TagError

PROFILE_VERSION = 1


@dataclass
class DeviceProfile:
    """Measured numbers for one device type. Zero peak/bandwidth: use the topology's spec numbers."""

    peak_flops: float = 0.0
    memory_bandwidth: float = 0.0
    launch_overhead_s: float | None = None
    efficiency: dict[str, float] = field(default_factory=dict)
    sustained_step_s: float | None = None    # the profiled model's median step over seconds (tag-profile --like)
    matmul_table: MatmulTable | None = None  # MatMul efficiency by shape (tag.cost.matmul_table), fractions of peak
    #: time multiplier per op family (``tag.cost.op_classes.FAMILIES``) on the roofline part of each op's
    #: time; an absent family is 1. Fitted on a runtime's measured steps (``runtime_levels``)
    family_scale: dict[str, float] = field(default_factory=dict)
    #: seconds of roofline time over which ``family_scale`` fades to 1 (None: it applies to every op in full).
    #: Why: the scales are fitted on small calibration models, whose short kernels lose the most to a
    #: runtime; applied in full to kernels of tens of milliseconds they charged the testbed's benchmark
    #: models 21-38% too much (bench_pipeline runs 30-31, where the unscaled profile was within 8%)
    level_fade_s: float | None = None

    def scaled(self, share: float, sustained_step_s: float | None = None) -> "DeviceProfile":
        """The same kernels on a device SHARE times as fast (a CPU quota, a shared GPU): peak and bandwidth
        times SHARE, launch overhead and sustained step divided by it (or SUSTAINED_STEP_S, when measured)."""
        return dataclasses.replace(
            self, peak_flops=self.peak_flops * share, memory_bandwidth=self.memory_bandwidth * share,
            launch_overhead_s=None if self.launch_overhead_s is None else self.launch_overhead_s / share,
            sustained_step_s=sustained_step_s if sustained_step_s is not None else (
                None if self.sustained_step_s is None else self.sustained_step_s / share))

    def to_dict(self) -> dict:
        d = {"peak_flops": float(self.peak_flops), "memory_bandwidth": float(self.memory_bandwidth),
             "efficiency": {k: float(v) for k, v in sorted(self.efficiency.items())}}
        if self.launch_overhead_s is not None:
            d["launch_overhead_s"] = float(self.launch_overhead_s)
        if self.sustained_step_s is not None:
            d["sustained_step_s"] = float(self.sustained_step_s)
        if self.matmul_table is not None:
            d["matmul_table"] = self.matmul_table.to_dict()
        if self.family_scale:
            d["family_scale"] = {k: float(v) for k, v in sorted(self.family_scale.items())}
        if self.level_fade_s is not None:
            d["level_fade_s"] = float(self.level_fade_s)
        return d


@dataclass
class NetworkProfile:
    """Measured costs of TensorFlow's distributed runtime between hosts (``tag-profile --network``).

    ``step_overhead_s``: fixed cost of one ``session.run`` of a step that spans several tasks (client RPC,
    per-task graph launch). ``transfer_latency_s`` / ``transfer_bytes_per_s``: a tensor sent between two
    tasks costs ``transfer_latency_s + bytes / transfer_bytes_per_s`` of runtime work (gRPC serialisation and
    copies) on top of the link itself, so an inter-host link of bandwidth ``b`` is used at
    ``1 / (1/b + 1/transfer_bytes_per_s)`` with ``transfer_latency_s`` added to its latency.
    ``per_tensor_s``: what each further tensor of one transfer costs (TF sends every tensor as its own
    request: rendezvous, serialisation), charged per tensor on the hosts' network resources; a
    parameter-server group pays it per variable and remote worker, each way. Measured on the testbed
    (``scripts/bench_transfers.py``): 64 tensors of 1 KB took 6 ms and 512 took 65 ms, where one flow of
    their bytes would take under 5 ms.

    ``sync_serial_allreduce`` / ``sync_serial_ps``: on hosts whose device is their CPU, the fraction of the time a
    gradient all-reduce (a ring of ``CollectiveReduceV2``) or a parameter-server push spends beside the host's
    compute that compute and synchronisation lose to each other (0: they overlap fully, as separate lanes; 1:
    they run one after the other). Measured on the running testbed with a calibration pattern
    (``tag.calibration.measure_sync_serial``: a 256 KB-4 MB gradient synchronised over every host while each
    host runs a MatMul chain); ``tag.sim.host_cpu.sync_serial`` applies it. On the testbed's quota-limited hosts
    the ring overlapped 0.01-0.65 of the shorter side and the push 0.43-0.77 (``scripts/bench_transfers.py --only
    sync_overlap``); between two full-core hosts 0.52-0.86 and 0.89-0.98. ``tag-profile --network`` leaves both 0
    (its two local workers share no CPU quota with compute); 0 in profiles from before they existed.

    CPU that the runtime itself spends, measured from the two workers' thread CPU time (``host_cpu``): a
    worker that takes part in a step from another host spends ``worker_step_cpu_s`` on it (its share of the
    step's graph launch) and the session's host ``master_step_cpu_s`` per such worker; each tensor sent between
    hosts costs ``tensor_cpu_s`` at each end, and each byte ``byte_cpu_s`` at each end (serialisation, copies).
    ``cpu_flops`` is the FLOP/s of the one-thread worker these were measured on: on a host whose device is its
    CPU the work competes with the host's own compute, at the host's speed relative to ``cpu_flops``
    (``tag.sim.host_cpu``). Between two one-thread workers on the testbed machine: a remote worker about 0.6
    ms per step, the session's host 0.39 ms per remote worker, about 31 us per tensor and 0.3 ns per byte at
    each end; a quarter-core host takes four times as long, which is what parameter-server steps of a small
    CNN lost there.
    """

    step_overhead_s: float = 0.0
    transfer_latency_s: float = 0.0
    transfer_bytes_per_s: float = math.inf
    collective_latency_s: float = 0.0
    collective_bytes_per_s: float = math.inf
    per_tensor_s: float = 0.0
    worker_step_cpu_s: float = 0.0
    master_step_cpu_s: float = 0.0
    tensor_cpu_s: float = 0.0
    byte_cpu_s: float = 0.0
    cpu_flops: float = 0.0
    sync_serial_allreduce: float = 0.0
    sync_serial_ps: float = 0.0

    #: the fields that say what the runtime's own CPU work costs (zero in profiles from before they existed)
    HOST_CPU_FIELDS = ("worker_step_cpu_s", "master_step_cpu_s", "tensor_cpu_s", "byte_cpu_s", "cpu_flops")
    #: fractions in [0, 1] of synchronisation beside a CPU host's compute that does not overlap it
    SYNC_FIELDS = ("sync_serial_allreduce", "sync_serial_ps")

    @property
    def host_cpu(self) -> bool:
        """Whether the runtime's CPU work was measured (and is charged to CPU hosts)."""
        return self.cpu_flops > 0 and (self.worker_step_cpu_s > 0 or self.tensor_cpu_s > 0 or self.byte_cpu_s > 0)

    def to_dict(self) -> dict:
        def rate(x: float):
            return float(x) if math.isfinite(x) else None
        return {"step_overhead_s": float(self.step_overhead_s), "transfer_latency_s": float(self.transfer_latency_s),
                "transfer_bytes_per_s": rate(self.transfer_bytes_per_s),
                "collective_latency_s": float(self.collective_latency_s),
                "collective_bytes_per_s": rate(self.collective_bytes_per_s), "per_tensor_s": float(self.per_tensor_s),
                **{k: float(getattr(self, k)) for k in self.HOST_CPU_FIELDS + self.SYNC_FIELDS}}

    def collective_extra(self) -> tuple[float, float]:
        """(seconds per ring step, seconds per byte) that TF's collective all-reduce costs beyond plain transfers
        over the calibrated links (both measured between the same two tasks)."""
        per_byte = max(1.0 / self.collective_bytes_per_s - 1.0 / self.transfer_bytes_per_s, 0.0)
        # a two-device ring has 2 steps: spread the measured fixed cost over them
        per_step = max(self.collective_latency_s - 2 * self.transfer_latency_s, 0.0) / 2
        return per_step, per_byte

    def calibrate(self, topology: Topology) -> Topology:
        """A copy of TOPOLOGY whose inter-host links carry the runtime's transfer costs."""
        host = np.array([d.host_index for d in topology.devices], dtype=np.int64)
        inter_dev = host[:, None] != host[None, :]
        inter_host = ~np.eye(len(topology.hosts), dtype=bool)

        def with_runtime(bw: np.ndarray, lat: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            bw, lat = bw.copy(), lat.copy()
            bw[mask] = 1.0 / (1.0 / bw[mask] + 1.0 / self.transfer_bytes_per_s)
            lat[mask] = lat[mask] + self.transfer_latency_s
            return bw, lat

        bw, lat = with_runtime(topology.bandwidth, topology.latency, inter_dev)
        hbw, hlat = with_runtime(topology.host_bandwidth, topology.host_latency, inter_host)
        return dataclasses.replace(topology, bandwidth=bw, latency=lat, host_bandwidth=hbw, host_latency=hlat)


def _device_entry(dtype: str, entry: object, key: str, where: str) -> DeviceProfile:
    """One validated entry of a profile's KEY ("devices" or "devices_under_load") object; TagError naming WHERE."""
    def bad(msg: str) -> TagError:
        return TagError(f"{where}: {msg}")

    if not isinstance(entry, dict):
        raise bad(f"{key}.{dtype} must be an object")
    unknown = set(entry) - {"peak_flops", "memory_bandwidth", "launch_overhead_s", "efficiency",
                            "sustained_step_s", "matmul_table", "family_scale", "level_fade_s"}
    if unknown:
        raise bad(f"{key}.{dtype}: unknown field {sorted(unknown)[0]!r}")
    nums = {}
    for name in ("peak_flops", "memory_bandwidth", "launch_overhead_s", "sustained_step_s"):
        if name not in entry or entry[name] is None:
            continue
        v = entry[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(f"{key}.{dtype}.{name} must be a finite number >= 0, got {v!r}")
        nums[name] = float(v)
    eff = entry.get("efficiency", {})
    if not isinstance(eff, dict):
        raise bad(f"{key}.{dtype}.efficiency must be an object")
    effs = {}
    for op_type, e in eff.items():
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or not 0 < e <= 1:
            raise bad(f"{key}.{dtype}.efficiency.{op_type} must be in (0, 1], got {e!r}")
        effs[str(op_type)] = float(e)
    table = (MatmulTable.from_dict(entry["matmul_table"], f"{where}: {key}.{dtype}.matmul_table")
             if entry.get("matmul_table") is not None else None)
    fam = entry.get("family_scale")
    fam = {} if fam is None else fam
    if not isinstance(fam, dict):
        raise bad(f"{key}.{dtype}.family_scale must be an object mapping op family to a time scale")
    scales = {}
    for family, v in fam.items():
        if family not in FAMILIES:
            raise bad(f"{key}.{dtype}.family_scale: unknown op family {family!r} "
                      f"(known: {', '.join(FAMILIES)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad(f"{key}.{dtype}.family_scale.{family} must be a finite number > 0, got {v!r}")
        scales[family] = float(v)
    fade = entry.get("level_fade_s")
    if fade is not None and (isinstance(fade, bool) or not isinstance(fade, (int, float)) or not math.isfinite(fade)
                             or fade <= 0):
        raise bad(f"{key}.{dtype}.level_fade_s must be a finite number > 0 (seconds), got {fade!r}")
    return DeviceProfile(nums.get("peak_flops", 0.0), nums.get("memory_bandwidth", 0.0), nums.get("launch_overhead_s"),
                         effs, nums.get("sustained_step_s"), table, scales,
                         None if fade is None else float(fade))


@dataclass
class Profile:
    """Per-device-type calibration of the compute model (see the module docstring for the JSON format),
    and optionally of the distributed runtime (``network``)."""

    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    source: str = ""
    version: int = PROFILE_VERSION
    network: NetworkProfile | None = None
    #: device types' entries as timed while every other host of the calibration's machine ran its own
    #: steps (testbed hosts share one machine's cores, caches and memory bandwidth; ``runtime_levels``).
    #: The simulator costs a step that keeps several hosts busy between ``devices`` and these, by how busy
    #: the other hosts are (``tag.sim.simulator``, "Hosts that share one machine"). Empty on real clusters
    devices_under_load: dict[str, DeviceProfile] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"version": int(self.version),
             "devices": {k: v.to_dict() for k, v in sorted(self.devices.items())},
             "source": self.source}
        if self.network is not None:
            d["network"] = self.network.to_dict()
        if self.devices_under_load:
            d["devices_under_load"] = {k: v.to_dict() for k, v in sorted(self.devices_under_load.items())}
        return d

    def under_load(self) -> "Profile | None":
        """This profile with ``devices_under_load`` in place of the matching ``devices`` entries; None without
        them."""
        if not self.devices_under_load:
            return None
        return Profile({**self.devices, **self.devices_under_load}, self.source, self.version, self.network)

    @classmethod
    def from_dict(cls, data: object, where: str = "profile") -> "Profile":
        """Validate plain data (as loaded from JSON); raise TagError naming WHERE on anything malformed."""
        def bad(msg: str) -> TagError:
            return TagError(f"{where}: {msg}")

        if not isinstance(data, dict):
            raise bad("expected a JSON object with 'version' and 'devices'")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise bad(f"unsupported profile version {version!r} (expected {PROFILE_VERSION})")
        devices = data.get("devices")
        if not isinstance(devices, dict):
            raise bad("'devices' must be an object mapping device type to its numbers")
        source = data.get("source", "")
        if not isinstance(source, str):
            raise bad("'source' must be a string")
        out = {str(dtype): _device_entry(dtype, entry, "devices", where) for dtype, entry in devices.items()}
        loaded = data.get("devices_under_load") or {}
        if not isinstance(loaded, dict):
            raise bad("'devices_under_load' must be an object mapping device type to its numbers")
        under_load = {str(dtype): _device_entry(dtype, entry, "devices_under_load", where)
                      for dtype, entry in loaded.items()}
        network = None
        if data.get("network") is not None:
            net = data["network"]
            if not isinstance(net, dict):
                raise bad("'network' must be an object")
            unknown = set(net) - {"step_overhead_s", "transfer_latency_s", "transfer_bytes_per_s",
                                  "collective_latency_s", "collective_bytes_per_s", "per_tensor_s",
                                  *NetworkProfile.HOST_CPU_FIELDS, *NetworkProfile.SYNC_FIELDS}
            if unknown:
                raise bad(f"network: unknown field {sorted(unknown)[0]!r}")
            vals = {}
            for key, v in net.items():
                is_rate = key.endswith("_bytes_per_s")
                if v is None and is_rate:
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                        is_rate and v == 0):
                    raise bad(f"network.{key} must be a finite number >= 0 (> 0 for a rate), got {v!r}")
                if key in NetworkProfile.SYNC_FIELDS and v > 1:
                    raise bad(f"network.{key} is a fraction in [0, 1], got {v!r}")
                vals[key] = float(v)
            network = NetworkProfile(**vals)
        return cls(out, source, PROFILE_VERSION, network, under_load)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        """Read a profile JSON file; TagError with the path on any problem."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(64 << 20)
        except FileNotFoundError:
            raise TagError(f"{path}: profile file not found") from None
        except IsADirectoryError:
            raise TagError(f"{path}: is a directory, expected a profile JSON file") from None
        except OSError as err:
            raise TagError(f"{path}: cannot read profile: {err.strerror or err}") from None
        from tag.files import decode_json
        data = decode_json(raw, path, not_text="profile is not UTF-8 text", not_json="profile is not valid JSON")
        return cls.from_dict(data, where=path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (to a temporary file first, then renamed into place)."""
        from tag.files import write_atomic
        write_atomic(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    def entry_for(self, device_type: str) -> tuple[DeviceProfile | None, bool]:
        """(entry, exact): the profile entry for DEVICE_TYPE, else the "default" entry, else None."""
        if device_type in self.devices:
            return self.devices[device_type], True
        return self.devices.get("default"), False
