"""Candidate actions: a bounded set of (placement, mode) choices for an op group, built from the topology.

Enumerating every subset of device groups is hopeless (2^64 placements on the 64-host ready topology),
so the candidates are the placements a person would try, ranked by this graph's calibrated speed:

- every device group alone, and the single fastest device;
- all device groups;
- the k fastest device groups, by this graph's throughput on them (examples/s of the whole group);
- each host, the hosts in order of throughput (prefixes), all hosts but the worst-connected one;
- every device type across hosts (all V100s, ...).

Modes per placement: ``allreduce``; ``ps`` with the placement's best-connected device as the parameter
server (placements of more than one device); ``partition`` over the placement's devices (model parallel
inside the group). Duplicates are removed.

Scaling: identical device groups (same type, count, host interconnect and the same multiset of link
bandwidths to the other hosts) are interchangeable, so only one per *symmetry class* is listed alone, and
prefix lists grow geometrically (k = 1, 2, 4, 8, ...) once there are more than 8 groups or hosts. On the
512-GPU ``fabric-64x8`` topology (64 identical hosts of 8 A100s) that gives about 10 placements and
under 30 candidate actions; a topology of G distinct device groups on H hosts gets O(G + H + log G)
placements, capped at ``max_actions``.

Example::

    from tag.cost.speeds import device_speeds
    from tag.search.candidates import candidate_actions
    speeds = device_speeds(cost_model, batch=64)            # examples/s per device for this graph
    candidates = candidate_actions(topology, speeds)         # [Candidate(action, partition_devices), ...]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tag.strategy.types import Action

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology

DEFAULT_MAX_ACTIONS = 48


@dataclass(frozen=True)
class Candidate:
    """One choice for an op group: an ``Action``, and for mode ``partition`` the devices its ops are split
    over (all devices of the placement, or one device: "the whole group on the fastest device")."""

    action: Action
    partition_devices: tuple[int, ...] = ()

    def describe(self, topology: "Topology") -> str:
        """A short readable label, e.g. ``allreduce on host1/V100`` or ``single device host1/V100:0``."""
        a = self.action
        where = "+".join(topology.groups[g].name for g in a.placement)
        if a.mode == "partition" and len(self.partition_devices) == 1:
            return f"single device {topology.devices[self.partition_devices[0]].name}"
        if a.mode == "ps":
            return f"ps on {where} (server {topology.devices[a.ps_device].name})"
        return f"{a.mode} on {where}"


def _geometric_sizes(n: int) -> list[int]:
    """1..n when n <= 8, else 1, 2, 4, ..., n."""
    if n <= 8:
        return list(range(1, n + 1))
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _group_class(topology: "Topology", g: int) -> tuple:
    """Symmetry class of device group G: groups in one class are interchangeable for a strategy."""
    grp = topology.groups[g]
    first = grp.devices[0]
    host = topology.devices[first].host_index
    links = tuple(sorted(np.round(np.delete(topology.host_bandwidth[host], host), -6).tolist()))
    n_host_groups = sum(1 for other in topology.groups if topology.devices[other.devices[0]].host_index == host)
    return (grp.device_type, len(grp.devices), round(topology.hosts[host].intra_bandwidth, -6), links,
            n_host_groups)


def candidate_placements(topology: "Topology", speeds: np.ndarray) -> list[tuple[int, ...]]:
    """The placements (sorted tuples of device-group indices) described in the module docstring."""
    groups = topology.groups
    group_speed = np.array([float(speeds[list(g.devices)].sum()) for g in groups])
    by_speed = [int(g) for g in np.argsort(-group_speed, kind="stable")]
    placements: list[tuple[int, ...]] = []

    def add(p) -> None:
        t = tuple(sorted(set(int(x) for x in p)))
        if t and t not in placements:
            placements.append(t)

    seen_classes = set()
    for g in by_speed:                                   # each device group alone, one per symmetry class
        cls = _group_class(topology, g)
        if cls not in seen_classes:
            seen_classes.add(cls)
            add((g,))
    add(range(len(groups)))                              # everything
    for k in _geometric_sizes(len(groups)):              # the k fastest device groups
        add(by_speed[:k])

    host_groups: dict[int, list[int]] = {}               # host index -> its device groups
    for g in groups:
        host_groups.setdefault(topology.devices[g.devices[0]].host_index, []).append(g.index)
    host_speed = {h: float(group_speed[gs].sum()) for h, gs in host_groups.items()}
    hosts_by_speed = sorted(host_groups, key=lambda h: (-host_speed[h], h))
    seen_hosts = set()
    for h in hosts_by_speed:                             # each host, one per symmetry class
        cls = tuple(sorted(_group_class(topology, g) for g in host_groups[h]))
        if cls not in seen_hosts:
            seen_hosts.add(cls)
            add(host_groups[h])
    for k in _geometric_sizes(len(hosts_by_speed)):      # the k fastest hosts
        add([g for h in hosts_by_speed[:k] for g in host_groups[h]])
    if len(host_groups) > 1:                             # all but the worst-connected host
        bw = np.array(topology.host_bandwidth, dtype=np.float64, copy=True)
        np.fill_diagonal(bw, 0.0)
        worst = min(host_groups, key=lambda h: (float(bw[h].sum()), -h))
        add([g for h in host_groups if h != worst for g in host_groups[h]])
    by_type: dict[str, list[int]] = {}                   # every device type across hosts
    for g in groups:
        by_type.setdefault(g.device_type, []).append(g.index)
    if len(by_type) > 1:
        for gs in by_type.values():
            add(gs)
    return placements


def _best_connected(topology: "Topology", devices: list[int]) -> int:
    """The device of DEVICES with the most bandwidth to the others (ties: lowest index)."""
    bw = np.array(topology.bandwidth[np.ix_(devices, devices)], dtype=np.float64, copy=True)
    np.fill_diagonal(bw, 0.0)
    total = bw.sum(axis=1)
    return int(devices[int(np.flatnonzero(total == total.max())[0])])


def candidate_actions(topology: "Topology", speeds: np.ndarray,
                      max_actions: int = DEFAULT_MAX_ACTIONS) -> list[Candidate]:
    """Candidates, most promising placements first, at most MAX_ACTIONS (see module docstring).

    Besides the placements' modes, the fastest device alone ("single device": mode ``partition`` on its
    device group with every op on that one device) is always a candidate.
    """
    candidates: list[Candidate] = []
    for placement in candidate_placements(topology, speeds):
        devices = tuple(d for g in placement for d in topology.groups[g].devices)
        candidates.append(Candidate(Action(placement, "allreduce")))
        if len(devices) > 1:
            candidates.append(Candidate(Action(placement, "ps", ps_device=_best_connected(topology, list(devices)))))
            candidates.append(Candidate(Action(placement, "partition"), devices))
    fastest = int(np.argmax(speeds))
    candidates.insert(1, Candidate(Action((topology.devices[fastest].group,), "partition"), (fastest,)))
    return candidates[:max_actions]
