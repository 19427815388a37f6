"""Inputs of the GNN policy: normalised features of one search state, as plain numpy arrays.

A *search state* is a node of the tree search: the decision order, the candidates chosen so far (the
prefix) and the group decided next. Its completion (``tag.search.mcts.complete``) is a full strategy,
simulated once, so the features mix three sources:

- the IR and the cost model (per op group: compute share, slow/fast device ratio, parameter, gradient and
  activation bytes against device memory, all-reduce cost; per device group: speed, memory, host links);
- the state (decided / deciding-next flags, each group's current action, placement edges from op groups
  to the device groups of their current action);
- the simulator's feedback on the completed state (``SimResult.group_makespan`` and ``group_idle_after``
  over the step time, peak-memory share and utilisation per device group, the state's speedup).

Everything is a ratio or a log-scale so graphs and clusters of other sizes give inputs of the same
range, and nothing depends on how device groups are numbered (device groups enter only as nodes, links
and pooled placements). Static parts (independent of the state) are computed once per environment
(``StaticFeatures``, cached per ``SearchEnv``).

``PolicyInput`` holds one state: node features, edge lists with edge features and the candidate set of
the group decided next (features + the device groups each candidate places on). ``batch_inputs``
concatenates several for training.

Example::

    from tag.gnn.features import state_input
    x = state_input(env, order, prefix=(), allowed=env.allowed[order[0]])
    x.op_x.shape, x.dev_x.shape, x.cand_x.shape      # (groups, F_OP), (device groups, F_DEV), (candidates, F_CAND)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tag.search.env import SearchEnv

F_OP = 19      # op-group node features
F_DEV = 14     # device-group node features
F_FLOW = 3     # data-flow edge features
F_LINK = 4     # device-link edge features
F_PLACE = 5    # placement edge features
F_CAND = 18    # candidate features
F_GLOBAL = 6   # per-state features
MODES = ("allreduce", "ps", "partition")


def _log_ratio(a: np.ndarray | float, b: np.ndarray | float, clip: float = 6.0) -> np.ndarray:
    """log(a / b), both floored at a tiny positive number, clipped to [-clip, clip]."""
    a = np.maximum(np.asarray(a, dtype=np.float64), 1e-30)
    b = np.maximum(np.asarray(b, dtype=np.float64), 1e-30)
    return np.clip(np.log(a / b), -clip, clip)


@dataclass
class PolicyInput:
    """One search state as arrays (module docstring). Edge lists are (source, destination) node indices."""

    op_x: np.ndarray                # [G, F_OP]
    dev_x: np.ndarray               # [D, F_DEV]
    flow_src: np.ndarray            # op -> op, forward data flow (the model adds the reverse relation)
    flow_dst: np.ndarray
    flow_x: np.ndarray              # [E, F_FLOW]
    link_src: np.ndarray            # device group -> device group, every ordered pair
    link_dst: np.ndarray
    link_x: np.ndarray              # [L, F_LINK]
    place_src: np.ndarray           # op group -> device group of its current action
    place_dst: np.ndarray
    place_x: np.ndarray             # [P, F_PLACE]
    global_x: np.ndarray            # [F_GLOBAL]
    target: int                     # the op group decided next
    cand_x: np.ndarray              # [C, F_CAND]
    member_cand: np.ndarray         # (candidate, device group, weight) triples: the candidates' placements
    member_dev: np.ndarray
    member_w: np.ndarray            # share of the candidate's devices in that device group

    @property
    def num_candidates(self) -> int:
        return int(self.cand_x.shape[0])


class StaticFeatures:
    """Everything about an environment's graph, cluster and candidates that no state changes."""

    def __init__(self, env: "SearchEnv"):
        topo = env.topology
        self.num_groups, self.num_dev_groups = env.num_groups, len(topo.groups)
        self.dev_group = np.array([d.group for d in topo.devices], dtype=np.int64)
        self.dg_size = np.array([len(g.devices) for g in topo.groups], dtype=np.float64)
        self._common = (topo, env.cost_model, env.graph, env.num_groups, len(topo.groups), len(env.candidates),
                        float(env.batch_size), np.asarray(env.grouping.group_of_op, dtype=np.int64),
                        topo.num_devices, self.dev_group,
                        np.array([d.host_index for d in topo.devices], dtype=np.int64),
                        np.array([topo.devices[g.devices[0]].host_index for g in topo.groups], dtype=np.int64),
                        self.dg_size, np.asarray(env.speeds, dtype=np.float64),
                        np.array([g.memory_bytes for g in topo.groups], dtype=np.float64))
        self._op_features(env)
        self._device_features(env)
        self._link_features(env)
        self._flow_features(env)
        self._candidate_features(env)
        del self._common                      # the environment's objects: not kept beyond construction

    def _op_features(self, env: "SearchEnv") -> None:
        """Per op group: compute, bytes, synchronisation (``op_static``); [G, D] compute times."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        share = max(1.0, B / n_dev)
        t1 = np.stack([np.bincount(gof, weights=cm.op_times(d, 1.0), minlength=G) for d in range(D)], axis=1)
        tb = np.stack([np.bincount(gof, weights=cm.op_times(d, B), minlength=G) for d in range(D)], axis=1)
        self.t1, self.tb, self.batch = t1, tb, B
        t_share = self.group_time(share)                                  # [G, D]
        t_fast = t_share.min(axis=1)
        total_fast = max(float(t_fast.sum()), 1e-12)

        param = np.zeros(G)
        slots = np.zeros(G)
        for v in graph.variables:
            if v.kind == "trainable":
                param[gof[v.op]] += v.nbytes
                slots[gof[v.op]] += v.slot_bytes
            else:
                slots[gof[v.op]] += v.nbytes
        act_fixed, act_pe = np.zeros(G), np.zeros(G)
        for i, op in enumerate(graph.ops):
            if op.phase == "forward":
                act_fixed[gof[i]] += sum(t.nbytes.fixed for t in op.outputs)
                act_pe[gof[i]] += sum(t.nbytes.per_example for t in op.outputs)
        self.static_bytes = 2 * param + slots                         # weights, gradients, slots
        self.act_fixed, self.act_pe = act_fixed, act_pe
        self.grad_bytes = param
        mem = np.array([g.memory_bytes for g in topo.groups], dtype=np.float64)
        min_mem = float(mem.min())
        all_devices = list(range(n_dev))
        ar_a, ar_b = _best_linear(cm.allreduce_coeffs(all_devices))
        sync_all = np.where(param > 0, ar_a + ar_b * param, 0.0)
        n_ops = np.bincount(gof, minlength=G).astype(np.float64)
        from tag.strategy.baselines import group_order
        rank = np.empty(G)
        rank[[int(g) for g in group_order(graph, env.grouping)]] = np.arange(G)
        self.op_static = np.stack([
            _log_ratio(t_fast * G, total_fast),
            _log_ratio(t_share.max(axis=1), t_fast),
            np.log1p(param * G / max(param.sum(), 1.0)),
            np.log1p(10 * self.static_bytes / min_mem),
            np.log1p(10 * (act_fixed + act_pe * share) / min_mem),
            np.log1p(sync_all / np.maximum(t_fast, 1e-9)),
            np.log1p(sync_all * G / total_fast),
            np.log1p(n_ops) / 5.0,
            rank / max(G - 1, 1),
            (param > 0).astype(np.float64),
        ], axis=1)

    def _device_features(self, env: "SearchEnv") -> None:
        """Per device group: speed, memory, host links (``dev_static``)."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        per_dev_speed = np.array([speeds[list(g.devices)].mean() for g in topo.groups])
        group_speed = per_dev_speed * dg_size
        hb = np.array(topo.host_bandwidth, dtype=np.float64, copy=True)
        np.fill_diagonal(hb, 0.0)
        nic = hb.max(axis=1) if hb.shape[0] > 1 else np.zeros(1)
        groups_on_host = np.bincount(dg_host, minlength=len(topo.hosts))[dg_host]
        intra = np.array([topo.hosts[h].intra_bandwidth for h in dg_host], dtype=np.float64)
        intra = np.where(np.isfinite(intra) & (intra > 0), intra, 1e12)     # one device: no interconnect
        total_static = max(float(self.static_bytes.sum()), 1.0)
        self.dev_static = np.stack([
            per_dev_speed / per_dev_speed.max(),
            group_speed / group_speed.sum(),
            dg_size / n_dev,
            _log_ratio(mem, mem.max()),
            _log_ratio(mem, total_static) / 3.0,
            (np.log10(intra) - 10.0) / 2.0,
            np.where(nic[dg_host] > 0, (np.log10(np.maximum(nic[dg_host], 1.0)) - 10.0) / 2.0, 0.0),
            groups_on_host / D,
            np.full(D, 1.0 / len(topo.hosts)),
            np.array([g.tf_device_type == "GPU" for g in topo.groups], dtype=np.float64),
        ], axis=1)

    def _link_features(self, env: "SearchEnv") -> None:
        """Links between device groups, every ordered pair of distinct groups."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        src, dst = np.meshgrid(np.arange(D), np.arange(D), indexing="ij")
        keep = src != dst
        self.link_src, self.link_dst = src[keep].astype(np.int64), dst[keep].astype(np.int64)
        first = np.array([g.devices[0] for g in topo.groups])
        bw = np.asarray(topo.bandwidth, dtype=np.float64)[first[self.link_src], first[self.link_dst]]
        lat = np.asarray(topo.latency, dtype=np.float64)[first[self.link_src], first[self.link_dst]]
        finite = bw[np.isfinite(bw)]
        max_bw = float(finite.max()) if len(finite) else 1.0
        self.link_x = np.stack([
            (np.log10(np.maximum(bw, 1.0)) - 10.0) / 2.0,
            _log_ratio(bw, max_bw) / 3.0,
            (np.log10(np.maximum(lat, 1e-9)) + 5.0) / 2.0,
            (dg_host[self.link_src] == dg_host[self.link_dst]).astype(np.float64),
        ], axis=1) if len(self.link_src) else np.zeros((0, F_LINK))

    def _flow_features(self, env: "SearchEnv") -> None:
        """Forward data flow between op groups (bytes at the batch)."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        flow: dict[tuple[int, int], float] = {}
        for e in graph.edges:
            a, b = int(gof[e.src]), int(gof[e.dst])
            if a != b:
                flow[(a, b)] = flow.get((a, b), 0.0) + e.nbytes.fixed + e.nbytes.per_example * B
        pairs = sorted(flow)
        self.flow_src = np.array([p[0] for p in pairs], dtype=np.int64)
        self.flow_dst = np.array([p[1] for p in pairs], dtype=np.int64)
        fb = np.array([flow[p] for p in pairs], dtype=np.float64)
        mean_fb = float(fb.mean()) if len(fb) else 1.0
        self.flow_x = np.stack([np.log1p(fb / max(mean_fb, 1.0)), (np.log10(np.maximum(fb, 1.0)) - 6.0) / 3.0,
                                (self.flow_src < self.flow_dst).astype(np.float64)],
                               axis=1) if len(pairs) else np.zeros((0, F_FLOW))
        self.flow_bytes = fb
        self.neighbour_w = self._neighbour_weights(G)

    def _candidate_features(self, env: "SearchEnv") -> None:
        """Candidates: placement membership and cost-model estimates per (group, candidate)."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        self.cand_devices: list[np.ndarray] = []
        self.cand_mode = np.zeros(C, dtype=np.int64)
        self.cand_placement: list[tuple[int, ...]] = []
        members_c, members_d, members_w = [], [], []
        compute = np.zeros((G, C))
        sync = np.zeros((G, C))
        mem_need = np.zeros((G, C))
        cand_mem = np.zeros(C)
        for k, cand in enumerate(env.candidates):
            a = cand.action
            devices = np.array(cand.partition_devices if a.mode == "partition"
                               else [d for g in a.placement for d in topo.groups[g].devices], dtype=np.int64)
            self.cand_devices.append(devices)
            self.cand_mode[k] = MODES.index(a.mode)
            self.cand_placement.append(tuple(sorted(set(int(dev_group[d]) for d in devices))))
            dgs, counts = np.unique(dev_group[devices], return_counts=True)
            members_c += [k] * len(dgs)
            members_d += dgs.tolist()
            members_w += (counts / len(devices)).tolist()
            cand_mem[k] = mem[dgs].min()
            compute[:, k], sync[:, k], mem_need[:, k] = self._estimate(cm, cand, devices, dgs, speeds)
        keys = [(int(m), p) for m, p in zip(self.cand_mode, self.cand_placement)]
        self.cand_key = np.array([sorted(set(keys)).index(k) for k in keys], dtype=np.int64)   # same mode and place
        self.cand_dev_groups = [np.unique(dev_group[d], return_counts=True) for d in self.cand_devices]
        self.member_cand = np.array(members_c, dtype=np.int64)
        self.member_dev = np.array(members_d, dtype=np.int64)
        self.member_w = np.array(members_w, dtype=np.float64)
        est = compute + sync
        uniform = est.sum(axis=0)
        uniform_mem = mem_need.sum(axis=0) / cand_mem
        n_hosts = len(topo.hosts)
        sizes = np.array([len(d) for d in self.cand_devices], dtype=np.float64)
        self.cand_static = np.stack([
            np.eye(3)[self.cand_mode][:, 0], np.eye(3)[self.cand_mode][:, 1], np.eye(3)[self.cand_mode][:, 2],
            ((self.cand_mode == 2) & (sizes == 1)).astype(np.float64),
            sizes / n_dev,
            np.log2(sizes) / np.log2(n_dev + 1),
            np.array([speeds[d].sum() for d in self.cand_devices]) / speeds.sum(),
            np.array([len(set(dev_host[d].tolist())) for d in self.cand_devices]) / n_hosts,
            _log_ratio(uniform, uniform.min()),
            _log_ratio(uniform_mem, 1.0) / 2.0,
        ], axis=1)
        self.group_cand = np.stack([                               # [G, C, 4]
            _log_ratio(est, est.min(axis=1, keepdims=True)),
            compute / np.maximum(est, 1e-12),
            np.log1p(est * G / max(float(uniform.min()), 1e-12)),
            _log_ratio(mem_need / cand_mem[None, :], 1.0) / 2.0,
        ], axis=2)

    def group_time(self, batch: float) -> np.ndarray:
        """Seconds of each op group on one device of each device group at per-device BATCH: [G, D]."""
        if self.batch <= 1:
            return self.tb.copy()
        w = (batch - 1.0) / (self.batch - 1.0)
        return self.t1 + (self.tb - self.t1) * w

    def _estimate(self, cm, cand, devices: np.ndarray, dgs: np.ndarray,
                  speeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op group under candidate CAND: compute seconds, synchronisation seconds, bytes per device."""
        B = self.batch
        mode = cand.action.mode
        if mode == "partition":
            rates = 1.0 / np.maximum(self.tb[:, self.dev_group[devices]], 1e-12)      # [G, n]
            compute = 1.0 / rates.sum(axis=1)
            need = (self.static_bytes + self.act_fixed + self.act_pe * B) / len(devices)
            return compute, np.zeros_like(compute), need
        dev_speed = speeds[devices]
        shares = B * dev_speed / dev_speed.sum()
        compute = np.zeros(self.num_groups)
        for d, b in zip(self.dev_group[devices], shares):
            compute = np.maximum(compute, self.group_time(max(1.0, float(b)))[:, d])
        if mode == "ps":
            a, b = cm.ps_coeffs(devices.tolist(), int(cand.action.ps_device))
            sync = np.where(self.grad_bytes > 0, 2 * (a + b * self.grad_bytes), 0.0)
        else:
            a, b = _best_linear(cm.allreduce_coeffs(devices.tolist()))
            sync = np.where(self.grad_bytes > 0, a + b * self.grad_bytes, 0.0)
        need = self.static_bytes + self.act_fixed + self.act_pe * float(shares.max())
        return compute, sync, need

    def _neighbour_weights(self, G: int) -> np.ndarray:
        """[G, G] share of each group's data-flow bytes (both directions) exchanged with each other group."""
        w = np.zeros((G, G))
        np.add.at(w, (self.flow_src, self.flow_dst), self.flow_bytes)
        w = w + w.T
        return w / np.maximum(w.sum(axis=1, keepdims=True), 1e-30)


def _best_linear(coeffs: tuple[tuple[float, float], tuple[float, float]]) -> tuple[float, float]:
    """Of (ring, hierarchical) linear models, the one with the smaller per-byte cost."""
    (a1, b1), (a2, b2) = coeffs
    return (a1, b1) if b1 <= b2 else (a2, b2)


_STATIC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def static_features(env: "SearchEnv") -> StaticFeatures:
    """The environment's StaticFeatures (computed on first use, cached while ENV lives)."""
    s = _STATIC.get(env)
    if s is None:
        s = _STATIC[env] = StaticFeatures(env)
    return s


def state_input(env: "SearchEnv", order: Sequence[int], prefix: Sequence[int],
                allowed: Sequence[int]) -> PolicyInput:
    """The policy's input for deciding group ``order[len(prefix)]`` among ALLOWED after PREFIX."""
    from tag.search.mcts import complete
    st = static_features(env)
    G, D = st.num_groups, st.num_dev_groups
    depth = len(prefix)
    target = int(order[depth])
    allowed = np.asarray(allowed, dtype=np.int64)
    if depth:
        choice = np.asarray(complete(env, order, prefix), dtype=np.int64)
        result = env.result(tuple(int(k) for k in choice))
        outcome = env.outcome_of(result)
        step = max(float(result.step_time), 1e-12)
        makespan = np.asarray(result.group_makespan, dtype=np.float64) / step
        idle = np.asarray(result.group_idle_after, dtype=np.float64) / step
        capacity = np.array([d.memory_bytes for d in env.topology.devices], dtype=np.float64)
        peak = np.asarray(result.peak_memory, dtype=np.float64) / capacity
        util = np.asarray(result.utilisation, dtype=np.float64)
        dev_peak = np.zeros(D)
        np.maximum.at(dev_peak, st.dev_group, peak)
        dev_util = np.bincount(st.dev_group, weights=util, minlength=D) / st.dg_size
        speedup = outcome.value if outcome.feasible else 0.0
        feasible = float(outcome.feasible)
    else:                                     # the root: nothing decided, no state to simulate
        choice = np.full(G, -1, dtype=np.int64)
        makespan, idle = np.zeros(G), np.zeros(G)
        dev_peak, dev_util = np.zeros(D), np.zeros(D)
        speedup, feasible = 0.0, 0.0
    decided = np.zeros(G)
    decided[np.asarray(order[:depth], dtype=np.int64)] = 1.0
    nxt = np.zeros(G)
    nxt[target] = 1.0
    has_action = choice >= 0
    mode_1h = np.zeros((G, 3))
    mode_1h[has_action, st.cand_mode[choice[has_action]]] = 1.0
    n_dev = float(len(st.dev_group))
    size = np.array([len(st.cand_devices[k]) / n_dev if k >= 0 else 0.0 for k in choice])
    op_x = np.concatenate([st.op_static, np.stack([decided, nxt, np.full(G, depth / G)], axis=1), mode_1h,
                           size[:, None], np.stack([np.minimum(makespan, 4.0), np.minimum(idle, 4.0)], axis=1)],
                          axis=1)
    place_src, place_dst, place_x = _placement_edges(st, choice)
    on_dev = np.bincount(place_dst, minlength=D) / G if len(place_dst) else np.zeros(D)
    in_current = np.zeros(D)
    if choice[target] >= 0:
        in_current[list(st.cand_placement[choice[target]])] = 1.0
    dev_x = np.concatenate([st.dev_static, np.stack([np.minimum(dev_peak, 4.0), dev_util, on_dev, in_current],
                                                    axis=1)], axis=1)
    cand_x = _candidate_features(st, choice, prefix, target, allowed)
    keep = np.isin(st.member_cand, allowed)
    position = np.full(len(st.cand_devices), -1, dtype=np.int64)
    position[allowed] = np.arange(len(allowed))
    global_x = np.array([np.log(max(speedup, 1e-3)) / 3.0 if feasible else -1.0, feasible, depth / G,
                         np.log(G) / 5.0, np.log(n_dev) / 5.0, len(allowed) / 48.0])
    return PolicyInput(_finite(op_x), _finite(dev_x), st.flow_src, st.flow_dst, _finite(st.flow_x), st.link_src,
                       st.link_dst, _finite(st.link_x), place_src, place_dst, _finite(place_x), _finite(global_x),
                       target, _finite(cand_x), position[st.member_cand[keep]], st.member_dev[keep],
                       st.member_w[keep].astype(np.float32))


def _finite(a: np.ndarray, bound: float = 20.0) -> np.ndarray:
    """float32 copy with NaN as 0 and everything clipped to [-bound, bound] (a guard: no feature should need it)."""
    return np.clip(np.nan_to_num(np.asarray(a, dtype=np.float64), nan=0.0, posinf=bound, neginf=-bound),
                   -bound, bound).astype(np.float32)


def _placement_edges(st: StaticFeatures, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges op group -> device group for every decided placement (features: mode, device share, speed)."""
    src, dst, feats = [], [], []
    t_full = st.tb
    for g, k in enumerate(choice.tolist()):
        if k < 0:
            continue
        devices = st.cand_devices[k]
        dgs, counts = st.cand_dev_groups[k]
        mode = np.eye(3)[st.cand_mode[k]]
        fastest = max(float(t_full[g].min()), 1e-12)
        for d, c in zip(dgs.tolist(), counts.tolist()):
            src.append(g)
            dst.append(d)
            feats.append([*mode, c / len(devices), float(_log_ratio(t_full[g, d], fastest))])
    if not src:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, F_PLACE))
    return np.array(src, np.int64), np.array(dst, np.int64), np.array(feats, np.float64)


def _candidate_features(st: StaticFeatures, choice: np.ndarray, prefix: Sequence[int], target: int,
                        allowed: np.ndarray) -> np.ndarray:
    """[len(allowed), F_CAND]: static candidate features, the target group's estimates and state flags."""
    current = int(choice[target])
    first = int(prefix[0]) if len(prefix) else -1
    neigh = st.neighbour_w[target]
    same_placement = np.zeros(len(allowed))
    if current >= 0 and neigh.sum() > 0:      # share of the target's data-flow bytes to groups doing the same
        keys = st.cand_key[choice]
        same_placement = (st.cand_key[allowed][:, None] == keys[None, :]).astype(np.float64) @ neigh
    flags = np.stack([(allowed == current).astype(np.float64), (allowed == first).astype(np.float64),
                      same_placement, np.full(len(allowed), float(len(prefix) == 0))], axis=1)
    return np.concatenate([st.cand_static[allowed], st.group_cand[target, allowed], flags], axis=1)


def batch_inputs(inputs: Sequence[PolicyInput]) -> dict[str, np.ndarray]:
    """Concatenate states into one disjoint union: node and candidate indices offset, plus
    ``cand_graph`` (state of each candidate), ``targets`` (global index of each state's deciding group),
    ``op_graph`` / ``dev_graph`` (state of each node)."""
    out: dict[str, list] = {k: [] for k in ("op_x", "dev_x", "flow_src", "flow_dst", "flow_x", "link_src",
                                            "link_dst", "link_x", "place_src", "place_dst", "place_x",
                                            "global_x", "cand_x", "member_cand", "member_dev", "member_w",
                                            "cand_graph", "targets", "op_graph", "dev_graph")}
    op_off = dev_off = cand_off = 0
    for i, x in enumerate(inputs):
        G, D, C = len(x.op_x), len(x.dev_x), x.num_candidates
        for key in ("op_x", "dev_x", "flow_x", "link_x", "place_x", "cand_x", "member_w"):
            out[key].append(getattr(x, key))
        out["global_x"].append(x.global_x[None, :])
        out["flow_src"].append(x.flow_src + op_off)
        out["flow_dst"].append(x.flow_dst + op_off)
        out["link_src"].append(x.link_src + dev_off)
        out["link_dst"].append(x.link_dst + dev_off)
        out["place_src"].append(x.place_src + op_off)
        out["place_dst"].append(x.place_dst + dev_off)
        out["member_cand"].append(x.member_cand + cand_off)
        out["member_dev"].append(x.member_dev + dev_off)
        out["cand_graph"].append(np.full(C, i, dtype=np.int64))
        out["targets"].append(np.array([x.target + op_off], dtype=np.int64))
        out["op_graph"].append(np.full(G, i, dtype=np.int64))
        out["dev_graph"].append(np.full(D, i, dtype=np.int64))
        op_off, dev_off, cand_off = op_off + G, dev_off + D, cand_off + C
    return {k: np.concatenate(v) for k, v in out.items()}
