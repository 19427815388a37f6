"""Inputs of the GNN policy, as plain numpy arrays: a graph encoded once per search, a few features per node.

The network (``tag.gnn.model``) has two parts, so its inputs have two parts:

- ``EncoderInput`` (once per ``SearchEnv``, cached): the heterograph of op groups and device groups with
  everything no search state changes -- per op group: compute share, slow/fast device ratio, parameter,
  gradient and activation bytes against device memory, all-reduce cost, position in the step; per device
  group: speed, memory, host links; data-flow edges between op groups (bytes) and link edges between
  device groups (bandwidth, latency, same host). Plus, per candidate action, its placement (device groups
  and device shares, for pooling their embeddings) and static features, and per (op group, candidate) the
  cost model's estimates (compute, synchronisation, memory need).
- ``NodeInput`` (once per tree node; no simulator run): the group decided next, its allowed candidates and
  the few features that change with the partial strategy: whether a candidate is the group's current
  action in the node's completion (``tag.search.mcts.complete``) or the first decision, the share of the
  group's data-flow bytes exchanged with groups already doing the same (same mode and placement), the
  share of decided groups that chose it; per node: depth, the completion's value (already simulated by the
  search: a cache hit) and the candidate's uniform strategy's value (simulated once per search by the
  portfolio's ``best_uniform`` and the default prior: cache hits too). The uniform values also give
  ``prior_logit``, the default prior's logits (``tag.search.mcts.uniform_value_prior``): the network's
  scores are added to them, so an untrained network is the default prior.

Everything is a ratio or a log-scale so graphs and clusters of other sizes give inputs of the same range,
and nothing depends on how device groups are numbered (device groups enter only as nodes, links and
pooled placements). Modes are one-hot over ``MODES``, which already has a slot for pipeline stages (a
mode the search does not offer yet: its estimates follow partition, ops split over the devices).

Example::

    from tag.gnn.features import encoder_input, node_input
    enc = encoder_input(env)
    enc.op_x.shape, enc.dev_x.shape                 # (groups, F_OP), (device groups, F_DEV)
    x = node_input(env, order, prefix=(), allowed=env.allowed[order[0]])
    x.cand_x.shape, x.global_x.shape                # (candidates, F_CAND), (F_GLOBAL,)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tag.search.env import SearchEnv

MODES = ("allreduce", "ps", "partition", "pipeline")
F_OP = 10                   # op-group node features
F_DEV = 10                  # device-group node features
F_FLOW = 3                  # data-flow edge features
F_LINK = 4                  # device-link edge features
F_CAND_STATIC = len(MODES) + 7 + 4   # candidate features (mode, size, speed, hosts, estimates) + group estimates
F_CAND = F_CAND_STATIC + 6  # + per-node candidate features
F_GLOBAL = 6                # per-node features
PRIOR_TEMPERATURE = 0.25    # of the default prior's softmax over uniform values (tag.search.mcts)


def mode_index(mode: str) -> int:
    """Column of MODE in the mode one-hot (``MODES``)."""
    return MODES.index(mode) if mode in MODES else MODES.index("partition")


def _log_ratio(a: np.ndarray | float, b: np.ndarray | float, clip: float = 6.0) -> np.ndarray:
    """log(a / b), both floored at a tiny positive number, clipped to [-clip, clip]."""
    a = np.maximum(np.asarray(a, dtype=np.float64), 1e-30)
    b = np.maximum(np.asarray(b, dtype=np.float64), 1e-30)
    return np.clip(np.log(a / b), -clip, clip)


@dataclass
class EncoderInput:
    """The static heterograph of one environment (module docstring). Edge lists are (source, destination)
    node indices; ``member_*`` are (candidate, device group, share of its devices) triples."""

    op_x: np.ndarray            # [G, F_OP]
    dev_x: np.ndarray           # [D, F_DEV]
    flow_src: np.ndarray        # op -> op, forward data flow (the model adds the reverse relation)
    flow_dst: np.ndarray
    flow_x: np.ndarray          # [E, F_FLOW]
    link_src: np.ndarray        # device group -> device group, every ordered pair
    link_dst: np.ndarray
    link_x: np.ndarray          # [L, F_LINK]
    member_cand: np.ndarray
    member_dev: np.ndarray
    member_w: np.ndarray
    num_candidates: int


@dataclass
class NodeInput:
    """One tree node: the group decided next and its candidates' features (module docstring)."""

    target: int                 # the op group decided next
    allowed: np.ndarray         # candidate indices (into env.candidates)
    cand_x: np.ndarray          # [A, F_CAND]
    global_x: np.ndarray        # [F_GLOBAL]
    prior_logit: np.ndarray     # [A] the default prior's logits

    @property
    def num_candidates(self) -> int:
        return int(len(self.allowed))


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
        self.uniform_values: np.ndarray | None = None     # filled by ``uniform_values`` (simulated)

    def _op_features(self, env: "SearchEnv") -> None:
        """Per op group: compute, bytes, synchronisation (``op_static``); [G, D] compute times."""
        topo, cm, graph, G, D, C, B, gof, n_dev, dev_group, dev_host, dg_host, dg_size, speeds, mem = self._common
        share = max(1.0, B / n_dev)
        same_rates: dict[str, int] = {}             # device groups of equal rates: computed once
        rep = np.array([same_rates.setdefault(repr(cm.rates(d)), d) for d in range(D)])
        t1u = {d: np.bincount(gof, weights=cm.op_times(d, 1.0), minlength=G) for d in set(rep.tolist())}
        tbu = {d: np.bincount(gof, weights=cm.op_times(d, B), minlength=G) for d in set(rep.tolist())}
        t1 = np.stack([t1u[d] for d in rep.tolist()], axis=1)
        tb = np.stack([tbu[d] for d in rep.tolist()], axis=1)
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
        rank = np.empty(G)
        rank[_group_order(graph, env.grouping)] = np.arange(G)
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
            self.cand_mode[k] = mode_index(a.mode)
            self.cand_placement.append(tuple(sorted(set(int(dev_group[d]) for d in devices))))
            dgs, counts = np.unique(dev_group[devices], return_counts=True)
            members_c += [k] * len(dgs)
            members_d += dgs.tolist()
            members_w += (counts / len(devices)).tolist()
            cand_mem[k] = mem[dgs].min()
            compute[:, k], sync[:, k], mem_need[:, k] = self._estimate(cm, cand, devices, dgs, speeds)
        keys = [(int(m), p) for m, p in zip(self.cand_mode, self.cand_placement, strict=True)]
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
            *np.eye(len(MODES))[self.cand_mode].T,
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

    def group_column(self, batch: float, d: int) -> np.ndarray:
        """``group_time(batch)[:, d]`` without the other columns."""
        if self.batch <= 1:
            return self.tb[:, d].copy()
        w = (batch - 1.0) / (self.batch - 1.0)
        return self.t1[:, d] + (self.tb[:, d] - self.t1[:, d]) * w

    def _estimate(self, cm, cand, devices: np.ndarray, dgs: np.ndarray,
                  speeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op group under candidate CAND: compute seconds, synchronisation seconds, bytes per device."""
        B = self.batch
        mode = cand.action.mode
        if mode not in ("allreduce", "ps"):           # partition (and stage-like modes): ops split over devices
            rates = 1.0 / np.maximum(self.tb[:, self.dev_group[devices]], 1e-12)      # [G, n]
            compute = 1.0 / rates.sum(axis=1)
            need = (self.static_bytes + self.act_fixed + self.act_pe * B) / len(devices)
            return compute, np.zeros_like(compute), need
        dev_speed = speeds[devices]
        shares = B * dev_speed / dev_speed.sum()
        compute = np.zeros(self.num_groups)
        seen: set[tuple[int, float]] = set()
        for d, b in zip(self.dev_group[devices].tolist(), shares.tolist(), strict=True):
            if (d, b) not in seen:                    # devices of one group and speed: one column
                seen.add((d, b))
                compute = np.maximum(compute, self.group_column(max(1.0, b), d))
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
_GROUP_ORDER: dict[int, tuple] = {}


def _group_order(graph, grouping) -> np.ndarray:
    """``tag.strategy.baselines.group_order``, cached per (graph, grouping) while both live: environments
    of one graph share it."""
    from tag.strategy.baselines import group_order
    key = (id(graph), id(grouping))
    hit = _GROUP_ORDER.get(key)
    if hit is None or hit[0]() is not graph or hit[1]() is not grouping:
        if len(_GROUP_ORDER) > 64:
            _GROUP_ORDER.clear()
        hit = _GROUP_ORDER[key] = (weakref.ref(graph), weakref.ref(grouping),
                                   np.asarray(group_order(graph, grouping), dtype=np.int64))
    return hit[2]


def static_features(env: "SearchEnv") -> StaticFeatures:
    """The environment's StaticFeatures (computed on first use, cached while ENV lives)."""
    s = _STATIC.get(env)
    if s is None:
        s = _STATIC[env] = StaticFeatures(env)
    return s


def encoder_input(env: "SearchEnv") -> EncoderInput:
    """ENV's static heterograph for the encoder (no simulator run)."""
    st = static_features(env)
    return EncoderInput(_finite(st.op_static), _finite(st.dev_static), st.flow_src, st.flow_dst, _finite(st.flow_x),
                        st.link_src, st.link_dst, _finite(st.link_x), st.member_cand, st.member_dev,
                        st.member_w.astype(np.float32), len(st.cand_devices))


def uniform_values(env: "SearchEnv") -> np.ndarray:
    """Value of every candidate's uniform strategy (``env.evaluate``: simulated once per environment, then
    cache hits; the portfolio's ``best_uniform`` has simulated them all before the tree search starts)."""
    st = static_features(env)
    if st.uniform_values is None:
        st.uniform_values = np.array([env.evaluate(env.uniform_choice(k)).value for k in range(len(env.candidates))],
                                     dtype=np.float64)
    return st.uniform_values


def node_input(env: "SearchEnv", order: Sequence[int], prefix: Sequence[int], allowed: Sequence[int]) -> NodeInput:
    """The head's input for deciding group ``order[len(prefix)]`` among ALLOWED after PREFIX (no simulator
    run: the completion's value is a cache hit in a tree search, which simulates a node before expanding it)."""
    from tag.search.mcts import complete
    st = static_features(env)
    G = st.num_groups
    depth = len(prefix)
    target = int(order[depth])
    allowed = np.asarray(allowed, dtype=np.int64)
    values = uniform_values(env)
    best = max(float(values.max()), 1e-9)
    v_allowed = values[allowed]
    prior_logit = (v_allowed / best) / PRIOR_TEMPERATURE
    if depth:
        choice = np.asarray(complete(env, order, prefix), dtype=np.int64)
        node_value = env.evaluate(tuple(choice.tolist())).value
        current, first = int(choice[target]), int(prefix[0])
        keys = st.cand_key[choice]
        decided = np.asarray(prefix, dtype=np.int64)
        neigh = st.neighbour_w[target]
        same = (st.cand_key[allowed][:, None] == keys[None, :]).astype(np.float64) @ neigh
        chosen = np.bincount(decided, minlength=len(st.cand_devices))[allowed] / depth
    else:
        node_value, current, first = 0.0, -1, -1
        same, chosen = np.zeros(len(allowed)), np.zeros(len(allowed))
    dyn = np.stack([(allowed == current).astype(np.float64), (allowed == first).astype(np.float64), same, chosen,
                    np.where(v_allowed > 0, v_allowed / best, -1.0), (v_allowed > 0).astype(np.float64)], axis=1)
    cand_x = np.concatenate([st.cand_static[allowed], st.group_cand[target, allowed], dyn], axis=1)
    feasible = node_value > 0
    global_x = np.array([np.log(max(node_value / best, 1e-3)) if feasible else -1.0, float(feasible), depth / G,
                         np.log(G) / 5.0, np.log(len(st.dev_group)) / 5.0, len(allowed) / 48.0])
    return NodeInput(target, allowed, _finite(cand_x), _finite(global_x), prior_logit.astype(np.float64))


def _finite(a: np.ndarray, bound: float = 20.0) -> np.ndarray:
    """float32 copy with NaN as 0 and everything clipped to [-bound, bound] (a guard: no feature should need it)."""
    return np.clip(np.nan_to_num(np.asarray(a, dtype=np.float64), nan=0.0, posinf=bound, neginf=-bound),
                   -bound, bound).astype(np.float32)


def batch_encoders(inputs: Sequence[EncoderInput]) -> dict[str, np.ndarray]:
    """Disjoint union of several environments' graphs: node, edge and candidate indices offset, plus
    ``op_graph`` / ``dev_graph`` (environment of each node) and ``op_offset`` / ``cand_offset`` (first index
    of each environment's op groups and candidates)."""
    keys = ("op_x", "dev_x", "flow_src", "flow_dst", "flow_x", "link_src", "link_dst", "link_x", "member_cand",
            "member_dev", "member_w", "op_graph", "dev_graph", "op_offset", "cand_offset")
    out: dict[str, list] = {k: [] for k in keys}
    op_off = dev_off = cand_off = 0
    for i, x in enumerate(inputs):
        G, D = len(x.op_x), len(x.dev_x)
        for key in ("op_x", "dev_x", "flow_x", "link_x", "member_w"):
            out[key].append(getattr(x, key))
        out["flow_src"].append(x.flow_src + op_off)
        out["flow_dst"].append(x.flow_dst + op_off)
        out["link_src"].append(x.link_src + dev_off)
        out["link_dst"].append(x.link_dst + dev_off)
        out["member_cand"].append(x.member_cand + cand_off)
        out["member_dev"].append(x.member_dev + dev_off)
        out["op_graph"].append(np.full(G, i, dtype=np.int64))
        out["dev_graph"].append(np.full(D, i, dtype=np.int64))
        out["op_offset"].append(np.array([op_off], dtype=np.int64))
        out["cand_offset"].append(np.array([cand_off], dtype=np.int64))
        op_off, dev_off, cand_off = op_off + G, dev_off + D, cand_off + x.num_candidates
    b = {k: np.concatenate(v) for k, v in out.items()}
    b["num_candidates"] = np.array(cand_off)
    return b


def batch_nodes(nodes: Sequence[NodeInput], env_index: Sequence[int], op_offset: np.ndarray,
                cand_offset: np.ndarray) -> dict[str, np.ndarray]:
    """Several tree nodes over a ``batch_encoders`` batch (node i of environment ENV_INDEX[i]): their
    targets and candidates as global indices into that batch, ``cand_node`` (node of each candidate) and
    ``node_env`` (environment of each node)."""
    env_index = np.asarray(env_index, dtype=np.int64)
    return {
        "targets": np.array([x.target for x in nodes], dtype=np.int64) + op_offset[env_index],
        "cands": np.concatenate([x.allowed + cand_offset[e] for x, e in zip(nodes, env_index, strict=True)]),
        "cand_x": np.concatenate([x.cand_x for x in nodes]),
        "global_x": np.stack([x.global_x for x in nodes]),
        "prior_logit": np.concatenate([x.prior_logit for x in nodes]).astype(np.float32),
        "cand_node": np.concatenate([np.full(x.num_candidates, i, dtype=np.int64) for i, x in enumerate(nodes)]),
        "node_env": env_index,
    }
