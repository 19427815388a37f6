"""Routes of data between layouts, and the resources and coefficients of collectives (cached).

The simulator's communication resources are numbered: ``0..H-1`` are the hosts' interconnects (bus),
``H..2H-1`` their network interfaces' send sides (NIC egress), ``2H..3H-1`` their receive sides (NIC
ingress), then one per ordered pair of hosts whose link is slower than both hosts' NICs. A transfer between
two devices of one host holds that host's bus; across hosts it holds the sender's egress and the receiver's
ingress for its bytes at each NIC's own rate, and the pair's link, if it has one, for its bytes at the
link's rate (``link_holds``): a host whose NIC runs at 1 Gbit/s sends to a host behind a 0.2 Gbit/s link
and, beside it, to a third host with what the NIC has left, as the testbed's shaping and a real switch do.
Before, every transfer held the sender's NIC for its whole time at the pair's rate. NICs and links are full
duplex: a host sends and receives at once, so transfers in opposite directions between two hosts do not wait
for each other. Tensors crossing
layouts move as the strategy semantics say (batch-axis tensors: the examples that change device; others:
the whole tensor from one producer device, the best-connected one). ``Routing`` works out, once per pair
of layouts, which lanes wait for which and which routes carry how many examples and whole copies; the
schedule only multiplies by bytes.

Example::

    import tag
    from tag.cost.model import CostModel
    from tag.strategy.grouping import group_ops
    from tag.sim.routing import Routing
    from tag.sim.task_graph import TaskGraph
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    topo = tag.load_topology("topologies/h100-2x8-infiniband.pbtxt")
    routing = Routing(topo, CostModel(tg, topo), TaskGraph(tg, group_ops(tg, target_groups=8)))
    routing.route(0, 9)                          # ((NIC of host 0, NIC of host 1), latency, s/byte)
    placement = tuple(range(len(topo.groups)))
    devices = [d for g in placement for d in topo.groups[g].devices]
    routing.collective("allreduce", devices, placement, None)   # (ring a, b, ring a, b, resources, x, 0, resources)
"""
from __future__ import annotations

import numpy as np

from tag.cluster.topology import Topology
from tag.cost.model import CostModel
from tag.sim.host_cpu import cpu_extra, ps_extra, ring_extra
from tag.sim.layouts import Layout
from tag.sim.task_graph import TaskGraph


def _overlaps(sources: list[tuple], destinations: list[tuple]) -> list[list[tuple]]:
    """Per destination holding (device, first example, end example, lane): the source holdings whose
    example ranges overlap it. Replicated layouts hold disjoint ranges in order, so one merge finds them
    (O(n + m) instead of every pair); other layouts are compared pair by pair."""
    def ordered(hs: list[tuple]) -> bool:
        return all(hs[i][2] <= hs[i + 1][1] and hs[i][1] <= hs[i][2] for i in range(len(hs) - 1))

    if not (ordered(sources) and ordered(destinations)):
        return [[p for p in sources if min(c[2], p[2]) - max(c[1], p[1]) > 0] for c in destinations]
    out = []
    j, m = 0, len(sources)
    for (_, clo, chi, _) in destinations:
        while j < m and sources[j][2] <= clo:
            j += 1
        mine = []
        k = j
        while k < m and sources[k][1] < chi:
            p = sources[k]
            if min(chi, p[2]) - max(clo, p[1]) > 0:
                mine.append(p)
            k += 1
        out.append(mine)
    return out


class Routing:
    """Routes, movements between layouts and collective coefficients for one topology and task graph."""

    def __init__(self, topology: Topology, cost: CostModel, tasks: TaskGraph):
        self.topology, self.cost, self.tasks = topology, cost, tasks
        self.num_hosts = len(topology.hosts)
        self._device_host = [d.host_index for d in topology.devices]
        self._bandwidth = cost.topology.bandwidth      # with the profile's network calibration, if any
        self._latency = cost.topology.latency
        self.resource_names = ([f"{h.name} interconnect" for h in topology.hosts] +
                               [f"{h.name} network send" for h in topology.hosts] +
                               [f"{h.name} network receive" for h in topology.hosts])
        # seconds per byte at each host's NIC; the links slower than both ends' NICs get a resource each
        H = self.num_hosts
        nic_s = np.array([1.0 / cost.nic_bandwidth(h) for h in range(H)], dtype=np.float64)
        self._nic_s_per_byte = nic_s
        self._pair_resource: dict[tuple[int, int], int] = {}
        host_bw = np.asarray(cost.topology.host_bandwidth, dtype=np.float64)
        usable = (host_bw > 0) & np.isfinite(host_bw) & ~np.eye(H, dtype=bool)
        link_s = np.divide(1.0, host_bw, out=np.zeros_like(host_bw), where=usable)
        slower = usable & (link_s > np.maximum(nic_s[:, None], nic_s[None, :]) * (1 + 1e-9))
        # row-major: (0, 1), (0, 2), ... as the names list them
        for a, b in zip(*np.nonzero(slower), strict=True):
            self._pair_resource[(int(a), int(b))] = len(self.resource_names)
            self.resource_names.append(f"{topology.hosts[a].name} -> {topology.hosts[b].name} link")
        # movement caches, keyed by layout ids (cleared with the layouts, see LayoutCache)
        self.moves: dict[tuple, tuple] = {}
        self._collectives: dict[tuple, tuple] = {}
        # what slower CPU hosts pay for the runtime's own work on each tensor and byte (tag.sim.host_cpu)
        self._net = cost.profile.network
        self._cpu_extra = cpu_extra(topology, self._net)

    def route(self, p: int, c: int) -> tuple[tuple[int, ...], float, float]:
        """(resources, latency, seconds per byte) of a transfer from device P to device C."""
        hp, hc = self._device_host[p], self._device_host[c]
        H = self.num_hosts
        res = (hp,) if hp == hc else (H + hp, 2 * H + hc)
        return res, float(self._latency[p, c]), 1.0 / float(self._bandwidth[p, c])

    def link_holds(self, res: tuple[int, ...]) -> tuple[int, float, float]:
        """For a transfer between hosts holding RES = (sender's NIC send side, receiver's NIC receive side):
        (the pair's link resource or -1, seconds per byte the send side is held, the same for the receive
        side). The link and the transfer itself take the route's seconds per byte."""
        H = self.num_hosts
        a, b = res[0] - H, res[1] - 2 * H
        return self._pair_resource.get((a, b), -1), float(self._nic_s_per_byte[a]), float(self._nic_s_per_byte[b])

    def best_source(self, sources: list[int], c: int) -> int:
        """The device of SOURCES with the fastest link to C (ties: the lowest index)."""
        return max(sources, key=lambda p: (float(self._bandwidth[p, c]), -p))

    def movement(self, ls: Layout, ld: Layout) -> tuple:
        """(deps, routes) for a tensor bundle from layout LS to layout LD (cached):
        deps = [(dst lane, (src lanes...))]; routes = [(src lane, dst lane, resources, latency,
        seconds per byte, examples moved, whole copies moved)]."""
        k = (ls.id, ld.id)
        mv = self.moves.get(k)
        if mv is not None:
            return mv
        deps: dict[int, set] = {}
        # (src lane, dst lane, resources) -> [examples, whole copies, latency, seconds per byte]
        routes: dict[tuple, list] = {}
        src_dev = {h[0]: h for h in ls.holdings}
        src_list = [h[0] for h in ls.holdings]
        best_source = self._best_sources(src_list, [h[0] for h in ld.holdings if h[0] not in src_dev])
        for (c, clo, chi, cl), overlapping in zip(ld.holdings, _overlaps(ls.holdings, ld.holdings), strict=True):
            dset = deps.setdefault(cl, set())
            for (p, plo, phi, pl) in overlapping:
                ov = min(chi, phi) - max(clo, plo)
                dset.add(pl)
                if p != c:
                    res, lat, ipb = self.route(p, c)
                    r = routes.setdefault((pl, cl, res), [0.0, 0.0, 0.0, 0.0])
                    r[0] += ov
                    r[2] = max(r[2], lat)
                    r[3] = max(r[3], ipb)
            if c in src_dev:
                dset.add(src_dev[c][3])
            else:
                p = best_source[c]
                pl = src_dev[p][3]
                dset.add(pl)
                res, lat, ipb = self.route(p, c)
                r = routes.setdefault((pl, cl, res), [0.0, 0.0, 0.0, 0.0])
                r[1] += 1
                r[2] = max(r[2], lat)
                r[3] = max(r[3], ipb)
        mv = ([(dl, tuple(sorted(s))) for dl, s in sorted(deps.items())],
              [(k_[0], k_[1], k_[2], v[2], v[3], v[0], v[1]) for k_, v in sorted(routes.items())])
        self.moves[k] = mv
        return mv

    def _best_sources(self, sources: list[int], destinations: list[int]) -> dict[int, int]:
        """``best_source(SOURCES, c)`` for every c of DESTINATIONS at once (numpy: a cluster of 1,024 GPUs
        asks this for every pair of its devices)."""
        if not destinations:
            return {}
        src = np.asarray(sources, dtype=np.int64)
        dst = np.asarray(destinations, dtype=np.int64)
        bw = np.asarray(self._bandwidth, dtype=np.float64)[np.ix_(src, dst)]      # [source, destination]
        best = bw == bw.max(axis=0, keepdims=True)
        lowest = np.where(best, src[:, None], np.iinfo(np.int64).max).min(axis=0)
        return dict(zip(destinations, lowest.tolist(), strict=True))

    def compiled_moves(self, key: tuple, ls: Layout, ld: Layout) -> tuple:
        """``movement`` from LS to LD with its routes split by how many resources they hold:
        (deps, [(sl, dl, r, lat, s/byte, examples, copies)], [(sl, dl, r1, r2, link or -1, send s/byte,
        receive s/byte, lat, s/byte, examples, copies)], all routes in that order) (cached under KEY)."""
        deps, routes = self.movement(ls, ld)
        r1 = [(sl, dl, res[0], lat, ipb, ex, cnt) for (sl, dl, res, lat, ipb, ex, cnt) in routes if len(res) == 1]
        r2 = [(sl, dl, res[0], res[1], *self.link_holds(res), lat, ipb, ex, cnt)
              for (sl, dl, res, lat, ipb, ex, cnt) in routes if len(res) == 2]
        full = [r for r in routes if len(r[2]) == 1] + [r for r in routes if len(r[2]) == 2]
        cm = (deps, r1, r2, full)
        self.moves[key] = cm
        return cm

    def _holders(self, lay: Layout, op: int, plans: dict) -> list:
        """Holdings of LAY that hold OP's outputs (a split task: only the device running OP)."""
        if lay.kind == "split":
            d = plans[self.tasks.task_group_list[self.tasks.task_of_op[op]]]["dev_of"][op]
            return [h for h in lay.holdings if h[0] == d]
        return lay.holdings

    def split_moves(self, b: int, ls: Layout, ld: Layout, plans: dict) -> tuple:
        """(deps, transfers) of bundle B between layouts LS and LD when either is a split partition task:
        deps = [(dst lane, src lanes)], transfers = [(src device, src lane, dst device, dst lane, bytes)]."""
        key = (b, ls.id, ld.id)
        mv = self.moves.get(key)
        if mv is not None:
            return mv
        deps: dict[int, set] = {h[3]: set() for h in ld.holdings}
        moved: dict[tuple, float] = {}       # (src device, src lane, dst device, dst lane) -> bytes
        sent: set = set()                    # (tensor, src, dst, "P") / (tensor, dst, "F") already moved
        for (so, do, per_example, fixed, name) in self.tasks.bundle_edges[b] or [(None, None, 0.0, 0.0, None)]:
            src_h = ls.holdings if so is None else self._holders(ls, so, plans)
            dst_h = ld.holdings if do is None else self._holders(ld, do, plans)
            src_lane = {h[0]: h[3] for h in src_h}
            for (c, clo, chi, cl) in dst_h:
                for (p, plo, phi, pl) in src_h:
                    ov = min(chi, phi) - max(clo, plo)
                    if ov <= 0:
                        continue
                    deps[cl].add(pl)
                    if p != c and per_example > 0 and (name, p, c, "P") not in sent:
                        sent.add((name, p, c, "P"))
                        moved[(p, pl, c, cl)] = moved.get((p, pl, c, cl), 0.0) + per_example * ov
                if c in src_lane:
                    deps[cl].add(src_lane[c])
                elif src_lane:
                    p = self.best_source(list(src_lane), c)
                    deps[cl].add(src_lane[p])
                    if fixed > 0 and (name, c, "F") not in sent:
                        sent.add((name, c, "F"))
                        moved[(p, src_lane[p], c, cl)] = moved.get((p, src_lane[p], c, cl), 0.0) + fixed
        mv = ([(dl, tuple(sorted(x))) for dl, x in sorted(deps.items())],
              [(k[0], k[1], k[2], k[3], v) for k, v in sorted(moved.items()) if v > 0])
        self.moves[key] = mv
        return mv

    def split_internal_moves(self, t: int, parts: list, lay: Layout) -> dict[tuple[int, int], float]:
        """{(src device, dst device): bytes} moved between the sub-tasks of split partition task T (cached)."""
        key = ("split-internal", lay.id)
        moved = self.moves.get(key)
        if moved is None:
            dev_of_op = {}
            for d, ops in parts:
                for i in ops.tolist():
                    dev_of_op[i] = d
            batch = lay.insts[0][2]
            moved = {}
            seen = set()
            for (so, do, per_example, fixed, name) in self.tasks.internal_edges[t]:
                ds, dd = dev_of_op[so], dev_of_op[do]
                if ds == dd or (name, dd) in seen:
                    continue
                seen.add((name, dd))
                moved[(ds, dd)] = moved.get((ds, dd), 0.0) + per_example * batch + fixed
            self.moves[key] = moved
        return moved

    def collective(self, kind: str, devices: list[int], placement: tuple[int, ...], ps_device: int | None) -> tuple:
        """(fixed s, s per byte, alt fixed, alt s per byte, resources, bytes multiplier, seconds per variable
        (ps only: the per-tensor cost for each worker on another host than the parameter server, and the
        runtime's CPU work on slower CPU hosts; else 0), resources after the backward pass) of a collective
        of KIND ("allreduce", "allgather" or "ps") over DEVICES (those of PLACEMENT), cached by placement.
        Across hosts the coefficients include what slower CPU hosts pay for the runtime's own work
        (``tag.sim.host_cpu``).

        All-reduce and all-gather are charged as the rewriter deploys them: one flat TF collective
        (``CollectiveReduceV2`` / ``CollectiveGatherV2``, ring) over every device of the group, so only
        the ring models of ``CostModel.allreduce_coeffs`` / ``allgather_coeffs`` are used (both slots hold
        them); the hierarchical models are not deployed, so they are not charged. The bytes multiplier
        turns a device's payload into bytes on the wire: 2(n-1) for an all-reduce, n(n-1) for an
        all-gather of one block per device."""
        k = (kind, placement, ps_device)
        c = self._collectives.get(k)
        if c is not None:
            return c
        H = self.num_hosts
        if kind in ("allreduce", "allgather"):
            by_host = self.topology.devices_by_host(devices)
            n = len(devices)
            if kind == "allreduce":
                (a1, b1), _ = self.cost.allreduce_coeffs(devices)
                wire = 2.0 * (n - 1)
            else:
                (a1, b1), _ = self.cost.allgather_coeffs(devices)
                wire = float(n * (n - 1))
            # a ring across hosts sends and receives on every host's NIC
            res = tuple(sorted([h for h, devs in by_host.items() if len(devs) > 1] +
                               ([r for h in by_host for r in (H + h, 2 * H + h)] if len(by_host) > 1 else [])))
            if len(by_host) > 1 and n > 1:
                per_step, per_byte = ring_extra(self._net, self._cpu_extra, devices)
                steps, device_wire = (2.0 * (n - 1), 2.0 * (n - 1) / n) if kind == "allreduce" else (n - 1.0, n - 1.0)
                a1, b1 = a1 + steps * per_step, b1 + device_wire * per_byte
            c = (a1, b1, a1, b1, res, wire, 0.0, res)
        else:
            workers = [d for d in devices if d != ps_device]
            a, b = self.cost.ps_coeffs(devices, ps_device)
            ph = self._device_host[ps_device]
            # NICs are full duplex: the pull holds the PS host's send side and the workers' receive sides,
            # the push the other way round, so one group's push and another's pull can overlap
            pull, push = set(), set()
            for w in workers:
                wh = self._device_host[w]
                if wh == ph:
                    pull.add(ph)
                    push.add(ph)
                else:
                    pull.update((H + ph, 2 * H + wh))
                    push.update((H + wh, 2 * H + ph))
            remote = sum(1 for w in workers if self._device_host[w] != ph)
            var_s, byte_s = ps_extra(self._net, self._cpu_extra, self._device_host, workers, ps_device)
            var_s += self.cost.per_tensor_s * remote
            b += byte_s
            c = (a, b, a, b, tuple(sorted(pull)), float(len(workers)), var_s, tuple(sorted(push)))
        self._collectives[k] = c
        return c
