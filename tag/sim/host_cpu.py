"""The distributed runtime's own CPU work, on hosts whose device is their CPU.

TensorFlow's runtime spends CPU on every step that spans hosts: each worker on another host takes part in
the step's graph launch, and every tensor that crosses hosts is serialised, copied and handed over at both
ends. ``NetworkProfile`` (``tag-profile --network``) measures that work between two one-thread workers
(``worker_step_cpu_s``, ``master_step_cpu_s``, ``tensor_cpu_s``, ``byte_cpu_s``, on a CPU of
``cpu_flops``). The calibrated transfer and collective costs already include it at that speed. A host whose
device is a slower CPU (a CPU quota, a smaller core) does the same work at ``s = min(peak / cpu_flops, 1)``
of the speed, so each tensor and byte it sends or receives costs ``1 / s - 1`` times the measured CPU on
top of the calibrated cost: three times more for a quarter-core host. Devices that are not CPUs (GPUs) cost
nothing extra: their host's CPU works beside them.

Where it is charged (``tag.sim.routing.Routing.collective``, the same coefficients for both kernels):

* a parameter-server group: every worker on another host receives each variable and sends each gradient,
  and the PS does both for every such worker, so a pull or push of ``n`` variables and ``W`` bytes costs
  ``(n * tensor_cpu_s + W * byte_cpu_s) * (max_w x_w + remote * x_ps)`` more (``x = 1/s - 1``);
* an all-reduce or all-gather across hosts: each ring step sends and receives a message on every device, so
  ``2 tensor_cpu_s * max x`` more per step and ``2 byte_cpu_s * max x`` per byte on the wire of a device.

Taking part in a step (``step_offsets``): a worker on a host other than the session's (host 0) spends
``worker_step_cpu_s / s`` launching its part before it computes or receives anything, and the session's
host ``master_step_cpu_s / s`` per such worker before it computes. Not charged yet: activations sent
between hosts by mixed and partitioned plans, and pipelined steps (``Simulator._run_pipeline``).

Synchronisation beside compute (``sync_serial``): on such a host the runtime's work for a gradient all-reduce
or a parameter-server push that runs while the host computes competes with that compute for the host's CPU
quota, so the two do not overlap as separate lanes would. A collective or push started at ``st`` that would
end at ``end`` while a lane of one of its CPU devices is busy until ``free`` delays that lane, and itself, by
``sigma * (min(end, free) - st)``, with ``sigma`` the profile's ``sync_serial_allreduce`` or
``sync_serial_ps`` (``NetworkProfile``). On the testbed a ring all-reduce of one convolution's gradient,
issued mid-backward on hosts of one and two quarter cores, took 70-80 ms beside the backward pass instead of
about 20 ms after it; the step ran 133-136 ms against 115-130 ms when that gradient went to the parameter server
like the others (a one-off probe of the testbed; its figures are kept in docs/).

Example::

    from tag.sim.host_cpu import cpu_extra, step_offsets, sync_serial
    x = cpu_extra(topology, profile.network)          # per device: 1/s - 1 (0: no extra)
    sigma = sync_serial(topology, profile.network)    # per device: [all-reduce, push] or None
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.cost.model import NetworkProfile
    from tag.sim.layouts import Lanes

SESSION_HOST = 0          # the host whose task the session connects to (``LocalCluster.target``: task 0)


def cpu_speed(topology: "Topology", net: "NetworkProfile") -> np.ndarray:
    """Per device: how fast its host does the runtime's CPU work relative to the worker it was measured on
    (``min(peak / cpu_flops, 1)`` for a CPU device; 1 for others, whose host's CPU is not their device)."""
    out = np.ones(topology.num_devices)
    if net.cpu_flops > 0:
        for d in topology.devices:
            if d.tf_device_type == "CPU":
                out[d.index] = min(max(d.peak_flops, 1.0) / net.cpu_flops, 1.0)
    return out


def cpu_extra(topology: "Topology", net: "NetworkProfile | None") -> np.ndarray:
    """Per device: ``1 / s - 1``, how many times the measured runtime CPU work a tensor or byte it sends or
    receives costs beyond the calibrated transfer (0 without a measurement)."""
    if net is None or not net.host_cpu:
        return np.zeros(topology.num_devices)
    return 1.0 / cpu_speed(topology, net) - 1.0


def sync_serial(topology: "Topology", net: "NetworkProfile | None") -> np.ndarray | None:
    """Per device, [all-reduce or all-gather, parameter-server push]: the fraction of a synchronisation's time
    beside the device's compute that both lose (the profile's ``sync_serial_*`` on CPU devices, 0 elsewhere);
    None when nothing is charged."""
    if net is None or (net.sync_serial_allreduce <= 0 and net.sync_serial_ps <= 0):
        return None
    out = np.zeros((topology.num_devices, 2))
    for d in topology.devices:
        if d.tf_device_type == "CPU":
            out[d.index] = (net.sync_serial_allreduce, net.sync_serial_ps)
    return out if out.any() else None


def ps_extra(net: "NetworkProfile | None", extra: np.ndarray, host_of: Sequence[int], workers: Sequence[int],
             ps_device: int) -> tuple[float, float]:
    """(seconds per variable, seconds per byte) that a parameter-server pull or push of WORKERS costs beyond
    the calibrated transfer: the slowest remote worker's CPU, plus the PS's for every remote worker."""
    if net is None or not net.host_cpu:
        return 0.0, 0.0
    remote = [w for w in workers if host_of[w] != host_of[ps_device]]
    if not remote:
        return 0.0, 0.0
    k = max(extra[w] for w in remote) + len(remote) * extra[ps_device]
    return net.tensor_cpu_s * k, net.byte_cpu_s * k


def ring_extra(net: "NetworkProfile | None", extra: np.ndarray, devices: Sequence[int]) -> tuple[float, float]:
    """(seconds per ring step, seconds per byte on one device's wire) that a ring collective over DEVICES of
    several hosts costs beyond the calibrated one: each step sends and receives one message per device."""
    if net is None or not net.host_cpu or not len(devices):
        return 0.0, 0.0
    k = max(extra[d] for d in devices)
    return 2.0 * net.tensor_cpu_s * k, 2.0 * net.byte_cpu_s * k


def step_offsets(topology: "Topology", net: "NetworkProfile | None", speed: np.ndarray | None, lanes: "Lanes",
                 used: Collection[int], num_resources: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(per lane, per communication resource) when each is first free in a step that runs on the devices USED
    (``tag.strategy.baselines.action_devices`` of its actions): a worker on another host than the session's
    launches its part first (its lanes and its NIC's two sides), the session's host coordinates every such
    worker first (its lanes). None when nothing is charged."""
    if net is None or not net.host_cpu or speed is None:
        return None
    host_of = [d.host_index for d in topology.devices]
    remote_hosts = {host_of[d] for d in used} - {SESSION_HOST}
    if not remote_hosts:
        return None
    H = len(topology.hosts)
    device_s = np.zeros(topology.num_devices)
    resource_s = np.zeros(num_resources)
    for d in used:
        h = host_of[d]
        if h in remote_hosts:
            device_s[d] = net.worker_step_cpu_s / speed[d]
            for r in (H + h, 2 * H + h):
                resource_s[r] = max(resource_s[r], device_s[d])
    for d in topology.devices:
        if d.host_index == SESSION_HOST:
            device_s[d.index] = net.master_step_cpu_s * len(remote_hosts) / speed[d.index]
    lane_s = np.array([max(device_s[list(devs)]) for devs in lanes.lanes])
    return lane_s, resource_s
