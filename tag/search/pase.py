"""PaSE-style dynamic programming over op groups: one candidate per group minimising an additive cost.

PaSE (Elango, "PaSE: parallelization strategies for efficient DNN training") finds a parallelisation
per layer by dynamic programming over a vertex order of the layer graph whose *dependent sets* stay
small. Here the vertices are the op groups of a ``SearchEnv``, the configurations are their allowed
candidates (``env.allowed``), and the costs come from the environment's cost model. The DP is a fast,
deterministic, simulator-free proposal; its answer is then scored by the simulator like any other search
(``env.evaluate``), so it can be compared with the tree search and the built-ins at face value.

Why an additive model: the simulator's step time is not a sum over groups (overlap, contention,
memory), so it cannot drive a DP; the additive model below is what makes exact optimisation over
~48^64 choices tractable, and the simulator then tells how good the optimum of the proxy really is.

Example::

    from tag.search.env import SearchEnv
    from tag.search.pase import pase_dp
    env = SearchEnv(tg, topo, grouping)
    found = pase_dp(env)                       # max_dependent=2 by default
    found.choice, found.outcome.step_time, found.additive_cost, found.seconds
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tag.search.env import Choice, Outcome, SearchEnv
from tag.strategy.baselines import group_order
from tag.strategy.types import batch_shares

DEFAULT_MAX_DEPENDENT = 2
DEFAULT_NEGLIGIBLE_FRACTION = 1e-3


@dataclass
class PaseResult:
    choice: Choice                 # one candidate index per op group (indices into env.candidates)
    outcome: Outcome               # env.evaluate(choice): the simulator's verdict
    additive_cost: float           # the additive objective (seconds) at choice
    seconds: float                 # wall-clock time of cost tables + order + DP + the one simulation
    order: list[int]               # the vertex (op group) order of the DP
    max_dependent_set: int         # largest dependent set along the order (DP's graph, before the cap)
    dependent_sizes: list[int]     # |D_i| after each prefix of the order (DP's graph, before the cap)
    dropped: int                   # vertices pinned because a dependent set exceeded the cap
    ignored_edges: int             # negligible edges left out of the DP (still in additive_cost)
    ignored_bound: float           # their summed worst cases: the most they can cost the DP (seconds)
    cost_seconds: float            # building the cost tables (partition maps included)
    solve_seconds: float           # order + DP


@dataclass
class PaseCosts:
    """The additive model of one environment, over *positions* into ``env.allowed[g]``.

    ``node[g][i]``: seconds of group g under candidate ``env.allowed[g][i]`` (inf when impossible, e.g.
    more replicas than examples). ``edge[(u, v)]`` (u < v): array [len(allowed[u]), len(allowed[v])] of
    re-layout seconds between the two groups. ``neighbors[g]``: groups sharing an edge with g.
    """

    node: list[np.ndarray]
    edge: dict[tuple[int, int], np.ndarray]
    neighbors: list[set[int]]

    def edge_table(self, u: int, v: int) -> np.ndarray:
        """Edge costs oriented as [position of u, position of v]."""
        return self.edge[(u, v)] if u < v else self.edge[(v, u)].T

    def total(self, positions) -> float:
        """The additive cost of one position per group."""
        cost = sum(float(self.node[g][p]) for g, p in enumerate(positions))
        return cost + sum(float(t[positions[u], positions[v]]) for (u, v), t in self.edge.items())

    def lower_bound(self) -> float:
        """Sum over groups of their cheapest node cost (edges cost >= 0)."""
        return sum(float(c[np.isfinite(c)].min()) if np.isfinite(c).any() else 0.0 for c in self.node)

    def without_edges_below(self, threshold: float) -> tuple["PaseCosts", int, float]:
        """(these costs minus every edge whose largest entry is <= THRESHOLD, how many, their summed maxima)."""
        kept = {k: t for k, t in self.edge.items() if float(t.max()) > threshold}
        bound = sum(float(t.max()) for k, t in self.edge.items() if k not in kept)
        neighbors: list[set[int]] = [set() for _ in self.node]
        for u, v in kept:
            neighbors[u].add(v)
            neighbors[v].add(u)
        return PaseCosts(self.node, kept, neighbors), len(self.edge) - len(kept), bound


# ---------------------------------------------------------------------------------------------- costs
def _devices_of(env: SearchEnv, placement) -> list[int]:
    return [d for dg in placement for d in env.topology.groups[dg].devices]


def _group_sums(env: SearchEnv, cache: dict, device_group: int, batch: float) -> np.ndarray:
    """Seconds per op group on one device of DEVICE_GROUP at per-replica BATCH (all ops of each group)."""
    key = (int(device_group), float(batch))
    sums = cache.get(key)
    if sums is None:
        times = np.asarray(env.cost_model.op_times(device_group, batch), dtype=np.float64)
        sums = np.bincount(env.grouping.group_of_op, weights=times, minlength=env.num_groups)
        cache[key] = sums
    return sums


def _grad_bytes(env: SearchEnv) -> np.ndarray:
    """Bytes of trainable-variable gradients per op group (the group holding the variable op)."""
    out = np.zeros(env.num_groups)
    gof = env.grouping.group_of_op
    for v in env.graph.variables:
        if v.kind == "trainable":
            out[int(gof[v.op])] += v.nbytes
    return out


def _internal_edges(env: SearchEnv) -> list[list[tuple[int, int, float]]]:
    """Per group, its data edges between two of its own ops with bytes > 0 at the batch: (src, dst, bytes)."""
    gof = env.grouping.group_of_op
    out: list[list[tuple[int, int, float]]] = [[] for _ in range(env.num_groups)]
    for e in env.graph.edges:
        g = int(gof[e.src])
        nbytes = float(e.nbytes.at(env.batch_size))
        if g == int(gof[e.dst]) and nbytes > 0:
            out[g].append((int(e.src), int(e.dst), nbytes))
    return out


def _replicated_cost(env: SearchEnv, cache: dict, group: int, candidate: int, grad_bytes: float) -> float:
    """Slowest replica's compute at its batch share + gradient synchronisation over the placement."""
    action = env.candidates[candidate].action
    devices = _devices_of(env, action.placement)
    if env.batch_size < len(devices):
        return float("inf")
    shares = batch_shares([env.topology.devices[d].peak_flops for d in devices], env.batch_size)
    share_of = dict(zip(devices, shares, strict=True))
    compute = 0.0
    for dg in action.placement:
        batch = max(share_of[d] for d in env.topology.groups[dg].devices)
        compute = max(compute, float(_group_sums(env, cache, dg, batch)[group]))
    if len(devices) <= 1 or grad_bytes <= 0:
        return compute
    if action.mode == "ps":
        return compute + env.cost_model.ps_time(grad_bytes, devices, action.ps_device)
    key = ("allreduce", action.placement)
    if key not in cache:                  # CostModel.allreduce_time, with its coefficients kept per placement
        cache[key] = env.cost_model.allreduce_coeffs(devices)
    (ring_fixed, ring_per_byte), _ = cache[key]     # the flat ring: what the rewriter deploys and the simulator charges
    return compute + ring_fixed + ring_per_byte * grad_bytes


def _partition_cost(env: SearchEnv, group: int, candidate: int,
                    internal: list[tuple[int, int, float]]) -> float:
    """Slowest device's share of the partition map at the full batch + transfers between its devices."""
    op_device = env.partition_map(group, candidate)
    busy: dict[int, float] = {}
    for op, d in op_device.items():
        dg = env.topology.devices[d].group
        busy[d] = busy.get(d, 0.0) + float(env.cost_model.op_times(dg, env.batch_size)[op])
    moves = sum(env.cost_model.transfer_time(nbytes, op_device[s], op_device[t]) for s, t, nbytes in internal)
    return max(busy.values(), default=0.0) + moves


def node_costs(env: SearchEnv) -> list[np.ndarray]:
    """Per group, the additive cost of each allowed candidate (PaseCosts.node)."""
    cache: dict = {}
    grads = _grad_bytes(env)
    internal = _internal_edges(env)
    out = []
    for g in range(env.num_groups):
        row = []
        for k in env.allowed[g]:
            if env.candidates[k].action.mode == "partition":
                row.append(_partition_cost(env, g, k, internal[g]))
            else:
                row.append(_replicated_cost(env, cache, g, k, float(grads[g])))
        out.append(np.array(row, dtype=np.float64))
    return out


class _Layouts:
    """Where a tensor lives: ``("rep", devices)`` (split by batch shares over several devices) or
    ``("dev", d)`` (whole on one device); per-byte seconds and latency between any two layouts."""

    def __init__(self, env: SearchEnv):
        self.env = env
        self.ids: dict[tuple, int] = {}
        self.devices: list[tuple[int, ...]] = []

    def of_replicated(self, placement) -> int:
        devices = tuple(_devices_of(self.env, placement))
        return self._id(("dev", devices[0]) if len(devices) == 1 else ("rep", devices), devices)

    def of_device(self, device: int) -> int:
        return self._id(("dev", int(device)), (int(device),))

    def _id(self, key: tuple, devices: tuple[int, ...]) -> int:
        if key not in self.ids:
            self.ids[key] = len(self.devices)
            self.devices.append(devices)
        return self.ids[key]

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per byte, latency) from layout a to layout b: the slowest link between a device of a and
        a different device of b; 0 between a layout and itself."""
        topo = self.env.cost_model.topology
        n = len(self.devices)
        per_byte, latency = np.zeros((n, n)), np.zeros((n, n))
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                src, dst = np.array(self.devices[a]), np.array(self.devices[b])
                differ = src[:, None] != dst[None, :]
                bw = topo.bandwidth[np.ix_(src, dst)][differ]
                per_byte[a, b] = float(np.max(1.0 / bw))
                latency[a, b] = float(np.max(topo.latency[np.ix_(src, dst)][differ]))
        return per_byte, latency


def _cross_edges(env: SearchEnv) -> dict[tuple[int, int], tuple[np.ndarray, ...]]:
    """(producer group, consumer group) -> arrays (src ops, dst ops, tensor ids, bytes) of its data edges."""
    gof = env.grouping.group_of_op
    tensor_id: dict[str, int] = {}
    lists: dict[tuple[int, int], list] = {}
    for e in env.graph.edges:
        u, v = int(gof[e.src]), int(gof[e.dst])
        nbytes = float(e.nbytes.at(env.batch_size))
        if u != v and nbytes > 0:
            t = tensor_id.setdefault(e.tensor, len(tensor_id))
            lists.setdefault((u, v), []).append((int(e.src), int(e.dst), t, nbytes))
    return {k: tuple(np.array(col) for col in zip(*rows, strict=True)) for k, rows in lists.items()}


def _edge_layouts(env: SearchEnv, layouts: _Layouts, group: int, ops: np.ndarray) -> np.ndarray:
    """[len(allowed[group]), len(ops)] layout id of each op's output (or input) under each candidate."""
    out = np.empty((len(env.allowed[group]), len(ops)), dtype=np.int64)
    for i, k in enumerate(env.allowed[group]):
        action = env.candidates[k].action
        if action.mode == "partition":
            op_device = env.partition_map(group, k)
            out[i] = [layouts.of_device(op_device[int(op)]) for op in ops]
        else:
            out[i] = layouts.of_replicated(action.placement)
    return out


def edge_costs(env: SearchEnv) -> dict[tuple[int, int], np.ndarray]:
    """(u, v) with u < v -> re-layout seconds between the two groups per pair of allowed candidates.

    Per tensor crossing from a producer group to a consumer group: 0 where both ends lay it out alike,
    else bytes (at the full batch) x the slowest link's seconds per byte between the two layouts' devices;
    a tensor is counted once per distinct consumer layout (consumers on one device share one copy); one
    latency (the largest) per group pair and candidate pair.
    """
    layouts = _Layouts(env)
    cross = _cross_edges(env)
    prepared = []
    for (u, v), (src, dst, tensor, nbytes) in cross.items():
        prepared.append((u, v, _edge_layouts(env, layouts, u, src), _edge_layouts(env, layouts, v, dst),
                         tensor, nbytes))
    per_byte, latency = layouts.matrices()
    tables: dict[tuple[int, int], np.ndarray] = {}
    for u, v, src_layout, dst_layout, tensor, nbytes in prepared:
        first_copy = np.zeros(dst_layout.shape, dtype=bool)     # first edge of each (tensor, consumer layout)
        for j in range(dst_layout.shape[0]):
            _, first = np.unique(tensor * len(layouts.devices) + dst_layout[j], return_index=True)
            first_copy[j, first] = True
        pb = per_byte[src_layout[:, None, :], dst_layout[None, :, :]]       # [Ku, Kv, E]
        seconds = (pb * (nbytes * first_copy)[None, :, :]).sum(axis=2)
        seconds += latency[src_layout[:, None, :], dst_layout[None, :, :]].max(axis=2)
        key = (u, v) if u < v else (v, u)
        oriented = seconds if u < v else seconds.T
        tables[key] = tables[key] + oriented if key in tables else oriented
    return tables


def pase_costs(env: SearchEnv) -> PaseCosts:
    """The additive model of ENV (node and edge tables, group adjacency)."""
    node = node_costs(env)
    edge = edge_costs(env)
    neighbors: list[set[int]] = [set() for _ in range(env.num_groups)]
    for u, v in edge:
        neighbors[u].add(v)
        neighbors[v].add(u)
    return PaseCosts(node, edge, neighbors)


# ---------------------------------------------------------------------------------------------- order
def dependent_order(neighbors: list[set[int]], rank: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """Greedy vertex order keeping dependent sets small: (order, |D_i| after each prefix).

    D_i = the vertices of the first i+1 of the order that have a neighbour not among them. Each step
    takes the unordered vertex that makes the next dependent set smallest; ties go to the lowest RANK
    (the step order of the groups; vertex index when None).
    """
    n = len(neighbors)
    rank = np.arange(n) if rank is None else np.asarray(rank)
    unordered_degree = np.array([len(s) for s in neighbors], dtype=np.int64)   # neighbours not yet ordered
    placed = np.zeros(n, dtype=bool)
    dependent: set[int] = set()
    order, sizes = [], []
    for _ in range(n):
        best_key, best = None, -1
        for v in range(n):
            if placed[v]:
                continue
            leaving = sum(1 for u in neighbors[v] if u in dependent and unordered_degree[u] == 1)
            size = len(dependent) + (1 if unordered_degree[v] > 0 else 0) - leaving
            key = (size, int(rank[v]))
            if best_key is None or key < best_key:
                best_key, best = key, v
        placed[best] = True
        for u in neighbors[best]:
            unordered_degree[u] -= 1
        dependent = {u for u in dependent | {best} if unordered_degree[u] > 0}
        order.append(best)
        sizes.append(len(dependent))
    return order, sizes


# ---------------------------------------------------------------------------------------------- DP
class _Table:
    """The DP table: minimum prefix cost per assignment of ``members`` (one axis each, in order)."""

    def __init__(self):
        self.members: list[int] = []
        self.values = np.zeros(())
        self.trail: list[tuple[int, list[int] | None, np.ndarray | int]] = []   # eliminations, in order

    def add(self, v: int, node: np.ndarray, costs: PaseCosts) -> None:
        """Put vertex V on a new last axis with its node costs and its edges to the members."""
        self.values = self.values[..., None] + node
        for axis, u in enumerate(self.members):
            if v in costs.neighbors[u]:
                shape = [1] * self.values.ndim
                shape[axis], shape[-1] = costs.node[u].size, node.size
                self.values = self.values + costs.edge_table(u, v).reshape(shape)
        self.members.append(v)

    def eliminate(self, w: int) -> None:
        """Minimise over W (its best position remembered per assignment of the remaining members)."""
        axis = self.members.index(w)
        best = np.argmin(self.values, axis=axis)
        self.values = np.take_along_axis(self.values, np.expand_dims(best, axis), axis).squeeze(axis)
        self.members.pop(axis)
        self.trail.append((w, list(self.members), best))

    def pin(self, w: int, position: int) -> None:
        """Fix W at POSITION and take it off the table."""
        axis = self.members.index(w)
        self.values = np.take(self.values, position, axis=axis)
        self.members.pop(axis)
        self.trail.append((w, None, position))

    def backtrack(self, n: int) -> list[int]:
        positions = [-1] * n
        for w, members, best in reversed(self.trail):
            positions[w] = int(best) if members is None else int(best[tuple(positions[m] for m in members)])
        return positions


def _future_weight(costs: PaseCosts, w: int, future: set[int]) -> float:
    """How much W's edges to unordered vertices can cost: the sum of their tables' ranges (max - min)."""
    total = 0.0
    for y in future:
        t = costs.edge_table(w, y)
        total += float(t.max() - t.min())
    return total


def _pin_choice(table: _Table, costs: PaseCosts, node: list[np.ndarray], w: int, future: set[int]) -> int:
    """W's best position: its best prefix cost plus, per unordered neighbour, the cheapest edge + node."""
    axis = table.members.index(w)
    other = tuple(i for i in range(table.values.ndim) if i != axis)
    score = table.values.min(axis=other) if other else table.values.copy()
    for y in future:
        score = score + (costs.edge_table(w, y) + node[y][None, :]).min(axis=1)
    return int(np.argmin(score))


def solve(costs: PaseCosts, order: list[int],
          max_dependent: int = DEFAULT_MAX_DEPENDENT) -> tuple[list[int], float, int]:
    """The DP of ``pase_dp``'s docstring over ORDER: (position per group, its cost, groups pinned).

    Every group of COSTS must appear in ORDER once. The cost is COSTS' objective at the positions
    (``PaseCosts.total``); it is the minimum when no group was pinned.
    """
    n = len(order)
    node = [c.copy() for c in costs.node]               # pinned neighbours' edges get added here
    future = [set(nb) for nb in costs.neighbors]        # neighbours not yet ordered
    table = _Table()
    pinned = 0
    for v in order:
        table.add(v, node[v], costs)
        for u in costs.neighbors[v]:
            future[u].discard(v)
        for w in [m for m in table.members if not future[m]]:
            table.eliminate(w)
        while len(table.members) > max_dependent:
            w = min(table.members, key=lambda m: (_future_weight(costs, m, future[m]), table.members.index(m)))
            position = _pin_choice(table, costs, node, w, future[w])
            table.pin(w, position)
            for y in future[w]:
                node[y] = node[y] + costs.edge_table(w, y)[position]
                future[y].discard(w)
            future[w] = set()
            pinned += 1
    return table.backtrack(n), float(table.values), pinned


def pase_dp(env: SearchEnv, *, max_dependent: int = DEFAULT_MAX_DEPENDENT,
            negligible_fraction: float = DEFAULT_NEGLIGIBLE_FRACTION) -> PaseResult:
    """Minimise the additive cost over one allowed candidate per op group by DP, then simulate the answer.

    Problem. Variables: x_g in env.allowed[g] for every op group g. Constraints: none beyond the
    allowed sets. Objective: minimise

        A(x) = sum_g node_g(x_g) + sum_{u~v} edge_uv(x_u, x_v)

    where u~v ranges over pairs of groups joined by a data edge (either direction), and

    - node_g(k): compute + gradient sync. Replicated modes (allreduce, ps): the slowest device group of
      the placement running all of g's ops at its largest batch share (shares by peak FLOP/s, as the
      simulator splits the batch), plus ``allreduce_time`` / ``ps_time`` of g's trainable gradient bytes
      over the placement's devices (0 for one device). Partition: the busiest device of the partition
      map running its ops at the full batch, plus the serial sum of ``transfer_time`` of the group's
      own edges that cross devices (no sync). Impossible candidates (more replicas than examples) cost inf.
    - edge_uv(a, b): ``edge_costs``: 0 when both ends lay a tensor out alike (same replicated devices, or
      the same single device; a multi-device partition places each op on its own device of the map),
      else its bytes over the *slowest* link between the two layouts' devices plus one latency.
      Approximation: this ignores that a re-layout between device sets can use several links in
      parallel and that the simulator overlaps transfers with compute; it is a pessimistic proxy.

    The objective sums times as if the step ran one group after another (PaSE's model): overlap,
    contention and memory are left to the simulator, which scores the answer (``outcome``).
    ``additive_cost`` is A at the answer, every edge included.

    Negligible edges. Optimiser hyperparameters (learning rate, betas: scalar constants) and similar
    tiny tensors join one group to every other group; each such edge costs at most one link latency,
    yet it would keep that group in every dependent set. Edges whose largest entry is at most
    ``negligible_fraction`` x (sum over groups of the cheapest node cost) are left out of the DP (not
    out of ``additive_cost``): the answer is then optimal up to ``ignored_bound`` (their summed worst
    cases). ``negligible_fraction=0`` keeps every edge with a non-zero cost.

    Method. ``dependent_order`` picks a vertex order v_1..v_n. D_i, the dependent set of the prefix
    P_i = {v_1..v_i}, holds the ordered groups with an edge to an unordered one. The table T_i maps each
    assignment of D_i to the least cost of P_i's nodes and of the edges inside P_i over the other
    prefix groups; T_{i+1} adds v_{i+1} (its node and its edges to D_i, which holds all its ordered
    neighbours) and minimises out the groups that just left the dependent set. Exact (for the kept
    edges) while every |D_i| <= ``max_dependent``; states number prod |allowed| over D_i (48^2 = 2304
    at the default cap; the largest intermediate table has one more axis).

    Cap (the approximation when a dependent set is wider): the member whose edges to unordered groups
    can cost least (sum of their tables' max - min) is *pinned*: fixed at the position minimising its
    prefix cost plus, per unordered neighbour y, min over y of edge + node (a myopic choice: it does
    not see what y's own later neighbours prefer); its edges to the unordered groups are then charged
    to those groups' node costs at that pinned position. The DP's value is then exactly the objective
    (kept edges) at its answer, but the answer may miss the optimum; ``dropped`` counts pinned groups.
    """
    t0 = time.perf_counter()
    costs = pase_costs(env)
    t1 = time.perf_counter()
    pruned, ignored, bound = costs.without_edges_below(negligible_fraction * costs.lower_bound())
    step = [int(g) for g in group_order(env.graph, env.grouping)]
    rank = np.empty(env.num_groups, dtype=np.int64)
    rank[step] = np.arange(env.num_groups)
    order, sizes = dependent_order(pruned.neighbors, rank)
    positions, _, pinned = solve(pruned, order, max_dependent)
    t2 = time.perf_counter()
    choice = tuple(int(env.allowed[g][p]) for g, p in enumerate(positions))
    outcome = env.evaluate(choice)
    return PaseResult(choice, outcome, costs.total(positions), time.perf_counter() - t0, order,
                      max(sizes, default=0), sizes, pinned, ignored, bound, t1 - t0, t2 - t1)
