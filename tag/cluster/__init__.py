"""Cluster topology: load and validate the protobuf text description of hosts, device groups and links.

Example::

    from tag.cluster import load_topology
    topo = load_topology("topologies/lab-v100-1080ti.pbtxt")
    topo.num_devices, [g.name for g in topo.groups]
"""
from tag.cluster.topology import Device, DeviceGroup, Host, Topology, load_topology, parse_topology

__all__ = ["Device", "DeviceGroup", "Host", "Topology", "load_topology", "parse_topology"]
