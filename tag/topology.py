"""Cluster topology: load a .pbtxt cluster description, validate it, expose it as plain data.

Example::

    topo = tag.load_topology("topologies/lab-v100-1080ti.pbtxt")
    topo.num_devices, [g.name for g in topo.groups]
    topo.bandwidth[0, 5]     # bytes/s between device 0 and device 5
    topo.tf_device(5)        # "/job:worker/task:1/device:GPU:1"

Units inside tag are SI: bytes, bytes/s, FLOP/s, seconds. The .pbtxt uses the units people read on
spec sheets (GiB of memory, TFLOP/s, GB/s of memory bandwidth, Gbit/s links, microseconds latency);
the loader converts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tag.errors import TopologyError  # noqa: F401  (re-exported for callers)


@dataclass(frozen=True)
class Host:
    name: str
    address: str                    # where its TF server listens
    port: int
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

    def cluster_spec(self) -> dict[str, list[str]]:
        """``{"worker": ["addr:port", ...]}`` in task order, for tf.train.ClusterSpec."""
        return {"worker": [f"{h.address}:{h.port}" for h in sorted(self.hosts, key=lambda h: h.task_index)]}
