"""Op grouping: coarsen a TrainingGraph's ops into layer-sized op groups, the unit a strategy decides.

Rules (deterministic, numpy only):

1. Forward and update ops group by name scope (the layer: ``conv2_block1_1_conv/Conv2D`` -> ``conv2_block1_1_conv``;
   top-level ops each start their own group).
2. Backward ops go with the forward op they differentiate: ``gradients/<fwd op>_grad/...`` (also
   ``gradients_1/...``) joins the group of ``<fwd op>``. Backward ops with no ``_grad`` part (``gradients/AddN_3``,
   the loss seed) join the group of their first consumer, else of their first producer.
3. Every ``TrainingGraph.colocation`` set (a variable, its reads, its optimizer op, its slots) ends up in one
   group, and so does the op producing each trainable variable's gradient.
4. Groups that would make the group-level dependency graph cyclic are merged: the graph whose nodes are
   (group, stage) pairs -- stage = the op's phase raised to the latest phase of its ancestors
   (``op_stages``) -- is always acyclic, which the simulator relies on.
5. While there are more than ``target_groups`` groups, the adjacent pair (in topological order of the
   groups' first ops) with the smallest combined cost (a nominal roofline time) is merged.

Group names are the layer scope of the group's costliest part, with ``(+k)`` when k more scopes were merged in.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    tg = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=32))
    grouping = group_ops(tg, target_groups=100)
    grouping.num_groups, grouping.names[:3]      # 100, ['conv1_pad', 'conv1_conv(+1)', 'pool1_pad(+1)']
"""
from __future__ import annotations

import re

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from tag.cost.model import ZERO_COST_TYPES
from tag.errors import TagError
from tag.ir.algorithms import UnionFind, dependency_arrays, op_levels, op_stages, topological_order
from tag.ir.types import TrainingGraph
from tag.strategy.types import Grouping

_GRAD_PREFIX = re.compile(r"^gradients(?:_\d+)?/(.+)$")
# nominal device for the grouping's cost proxy (roughly one V100): FLOP/s, bytes/s, seconds per op
_NOMINAL_FLOPS, _NOMINAL_BW, _NOMINAL_OVERHEAD = 1e13, 9e11, 5e-6


def nominal_op_cost(graph: TrainingGraph, batch: float | None = None) -> np.ndarray:
    """A device-independent cost per op (seconds on a nominal GPU), used to balance groups."""

    a = graph.arrays()
    b = graph.batch_size if batch is None else batch
    t = np.maximum(a.flops(b) / _NOMINAL_FLOPS, a.mem_bytes(b) / _NOMINAL_BW) + _NOMINAL_OVERHEAD
    zero = np.array([op.type in ZERO_COST_TYPES for op in graph.ops], dtype=bool)
    t[zero] = 0.0
    return t


def _scope(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else name


def _key(name: str) -> str:
    """Grouping key of an op name: its scope, or the op itself at top level (never a scope's key)."""
    return "scope:" + name.rsplit("/", 1)[0] if "/" in name else "op:" + name


def _forward_op_of_gradient(name: str) -> tuple[str | None, bool]:
    """For ``gradients/a/b/MatMul_grad/x``: ('a/b/MatMul', True). Non-gradient names: (None, False)."""
    m = _GRAD_PREFIX.match(name)
    if not m:
        return None, False
    parts = m.group(1).split("/")
    for k, p in enumerate(parts):
        if p.endswith("_grad") and len(p) > 5:
            return "/".join(parts[:k] + [p[:-5]]), True
    return None, True


def group_ops(graph: TrainingGraph, target_groups: int = 64) -> Grouping:
    """Coarsen GRAPH's ops into at most TARGET_GROUPS layer-sized groups (see the module docstring)."""
    if target_groups < 1:
        raise TagError(f"target_groups must be at least 1, got {target_groups}")
    n = len(graph.ops)
    if n == 0:
        return Grouping(np.zeros(0, dtype=np.int64), [])
    order = topological_order(graph)
    stage = op_stages(graph, order)
    src, dst = dependency_arrays(graph)
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    for s_, d_ in zip(src.tolist(), dst.tolist(), strict=True):
        succ[s_].append(d_)
        pred[d_].append(s_)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)

    pairs, key_ops, label, unresolved = _scope_keys(graph)                     # rules 1-2
    soft_sets = _variable_pairs(graph, pairs)                                  # rule 3
    _contiguous_scopes(n, pairs, key_ops, soft_sets, succ, pos, stage)
    cyc = _Cycles(graph, stage)
    uf = UnionFind(n)
    for x, y in pairs:
        uf.union(x, y)
    for i in _attach_unresolved(uf, unresolved, succ, pred, pos):
        label[i] = graph.ops[i].name
    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)
    roots = _make_acyclic(cyc, roots, uf)                                      # rule 4
    roots = _apply_colocation(cyc, roots, uf, soft_sets)
    cost = nominal_op_cost(graph)
    levels = op_levels(graph, order)
    roots = _attach_idle_sets(cyc, roots, uf, succ, pred, stage, levels, cost)
    # 5: merge adjacent cheapest groups until at most target_groups remain
    roots = _merge_to_target(cyc, roots, stage, levels, cost, target_groups, uf)
    return _number_and_name(graph, roots, stage, levels, cost, label)


def _scope_keys(graph: TrainingGraph) -> tuple[list[tuple[int, int]], dict[str, list[int]], list[str], list[int]]:
    """Rules 1-2: (unions that always hold (a backward op with its forward op), grouping key -> its ops,
    readable scope name per op (for group names), backward ops with no forward op)."""
    index = graph.op_index
    pairs: list[tuple[int, int]] = []
    key_ops: dict[str, list[int]] = {}
    label = [""] * len(graph.ops)
    unresolved = []
    for i, op in enumerate(graph.ops):
        fwd, is_grad = _forward_op_of_gradient(op.name)
        if is_grad:
            if fwd is None:
                unresolved.append(i)
                continue
            j = index.get(fwd)
            label[i] = _scope(fwd)
            if j is not None and j != i:
                pairs.append((i, j))
                continue
            key = _key(fwd)
        else:
            key = _key(op.name)
            label[i] = _scope(op.name)
        key_ops.setdefault(key, []).append(i)
    return pairs, key_ops, label, unresolved


def _variable_pairs(graph: TrainingGraph, pairs: list[tuple[int, int]]) -> list[list[int]]:
    """Rule 3: add to PAIRS the unions of each trainable variable with its reads, optimizer op, slots and the
    op producing its gradient (hard); return the ``TrainingGraph.colocation`` sets (sorted op indices,
    soft: kept unless they close a cycle of groups -- TF also colocates gradient plumbing (an AddN with the
    first gradient it sums) and Adam's beta powers with the first variable, read by every update op and
    updated after all of them)."""
    index = graph.op_index
    for v in graph.variables:
        if v.kind != "trainable":
            continue
        members = [v.op] + [index[nm] for nm in [*v.read_ops, v.apply_op or "", *v.slots] if nm in index]
        for sv in graph.variables:
            if sv.name in v.slots:
                members.extend(index[nm] for nm in sv.read_ops if nm in index)
        pairs.extend((v.op, j) for j in members[1:])
        if v.gradient:
            j = index.get(v.gradient.rsplit(":", 1)[0].lstrip("^"))
            if j is not None:
                pairs.append((v.op, j))
    soft_sets = []
    for names in graph.colocation:
        idx = sorted({index[nm] for nm in names if nm in index})
        if len(idx) > 1:
            soft_sets.append(idx)
    return soft_sets


def _contiguous_scopes(n: int, pairs: list[tuple[int, int]], key_ops: dict[str, list[int]],
                       soft_sets: list[list[int]], succ: list[list[int]], pos: np.ndarray, stage: np.ndarray) -> None:
    """Add to PAIRS the unions of each scope's ops, where that keeps each stage of it contiguous in the
    dataflow (no path leaves it and comes back): a transformer layer's scope holding the residual adds
    around its sub-layers is not. Such a scope splits into its directly connected parts, and parts that
    are still not contiguous into single ops."""
    hard = UnionFind(n)
    for x, y in pairs:
        hard.union(x, y)
    hard_root = [hard.find(i) for i in range(n)]
    hard_members: dict[int, list[int]] = {}      # hard set root -> its ops
    for i, r in enumerate(hard_root):
        hard_members.setdefault(r, []).append(i)
    pos_l, stage_l = pos.tolist(), stage.tolist()
    coloc_of: dict[int, list[int]] = {}          # op -> the ops of its (small) colocation sets
    for idx in soft_sets:
        if len(idx) <= 64:      # a variable's own reads and updates, not a hub like Adam's beta powers
            for i in idx:
                coloc_of.setdefault(i, []).extend(idx)

    def contiguous(key_members: list[int]) -> bool:
        closure = {i for m in key_members for i in hard_members[hard_root[m]]}
        closure.update(j for m in key_members for j in coloc_of.get(m, ()))
        return _is_convex(sorted(closure), succ, pos_l, stage_l)

    for members in key_ops.values():
        if len(members) == 1:
            continue
        if contiguous(members):
            pairs.extend((members[0], j) for j in members[1:])
            continue
        for comp in _components(members, succ):
            if len(comp) > 1 and contiguous(comp):
                pairs.extend((comp[0], j) for j in comp[1:])


def _attach_unresolved(uf: UnionFind, unresolved: list[int], succ: list[list[int]], pred: list[list[int]],
                       pos: np.ndarray) -> set[int]:
    """Backward ops without a forward op join their first consumer, else their first producer; returns
    those that stay alone."""
    pending = set(unresolved)
    for sweep in ("consumers", "producers"):
        seq = sorted(pending, key=lambda i: -pos[i] if sweep == "consumers" else pos[i])
        for i in seq:
            for j in sorted(succ[i] if sweep == "consumers" else pred[i]):
                if j not in pending:
                    uf.union(i, j)
                    pending.discard(i)
                    break
    return pending


def _apply_colocation(cyc: "_Cycles", roots: np.ndarray, uf: UnionFind, soft_sets: list[list[int]]) -> np.ndarray:
    """Colocation sets: all at once if that stays acyclic, else the harmless ones at once and the rest one
    by one, each only if it keeps the group graph acyclic. Returns the new set id per op."""
    n = len(roots)

    def with_sets(r: np.ndarray, sets: list[list[int]]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        u = UnionFind(n)
        links = []
        for idx in sets:
            for j in idx[1:]:
                a_, b_ = int(r[idx[0]]), int(r[j])
                if u.find(a_) != u.find(b_):
                    u.union(a_, b_)
                    links.append((a_, b_))
        if not links:
            return r, links
        uniq = np.unique(r)
        mapped = np.array([u.find(int(x)) for x in uniq], dtype=np.int64)
        return mapped[np.searchsorted(uniq, r)], links

    def accept(links: list[tuple[int, int]]) -> np.ndarray:
        for a_, b_ in links:
            uf.union(a_, b_)
        return _relabel(roots, uf)

    trial, links = with_sets(roots, soft_sets)
    sccs = cyc.sccs(trial) if links else []
    if not sccs:
        return accept(links)
    bad = set(np.concatenate(sccs).tolist())
    suspicious = [idx for idx in soft_sets if bad.intersection(trial[idx].tolist())]
    harmless = [idx for idx in soft_sets if not bad.intersection(trial[idx].tolist())]
    trial, links = with_sets(roots, harmless)
    if links and not cyc.sccs(trial):
        roots = accept(links)
    else:
        suspicious = soft_sets
    for idx in sorted(suspicious, key=lambda x: (len(x), x[0])):
        trial, links = with_sets(roots, [idx])
        if links and not cyc.sccs(trial):
            roots = accept(links)
    return roots


def _attach_idle_sets(cyc: "_Cycles", roots: np.ndarray, uf: UnionFind, succ: list[list[int]],
                      pred: list[list[int]], stage: np.ndarray, levels: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Sets that do no work (plumbing: shapes, reads of shared state, control ops) join the set of their
    first consumer, else of their first producer, where that keeps the group graph acyclic."""
    set_ids, inv = np.unique(roots, return_inverse=True)
    set_cost = np.bincount(inv, weights=cost, minlength=len(set_ids))
    idle = [int(r) for r, c in zip(set_ids.tolist(), set_cost.tolist(), strict=True) if c == 0]
    if len(set_ids) <= 1:
        return roots
    members_of: dict[int, list[int]] = {}      # set id -> its ops
    for i, r in enumerate(roots.tolist()):
        members_of.setdefault(r, []).append(i)
    for r in sorted(idle, key=lambda x: _position_key(np.asarray(members_of[x]), stage, levels, cost)):
        cur = uf.find(r)
        inside = set(members_of[r])
        cands = []
        for nbrs in ([j for i in sorted(inside) for j in sorted(succ[i])],
                     [j for i in sorted(inside) for j in sorted(pred[i])]):
            for j in nbrs:
                t = int(roots[j])
                if j not in inside and t != cur and t not in cands:
                    cands.append(t)
        for t in cands[:3]:
            trial = np.where(roots == cur, t, roots)
            if not cyc.sccs(trial):
                uf.union(cur, t)
                roots = _relabel(roots, uf)
                break
    return roots


def _number_and_name(graph: TrainingGraph, roots: np.ndarray, stage: np.ndarray, levels: np.ndarray,
                     cost: np.ndarray, label: list[str]) -> Grouping:
    """Number the groups in topological order of their first op; name each after its costliest scope."""
    ops = graph.ops
    set_ids = np.unique(roots)
    key_of = {int(r): _position_key(np.flatnonzero(roots == r), stage, levels, cost) for r in set_ids}
    ordered = sorted(set_ids.tolist(), key=lambda r: key_of[r])
    gid = {r: g for g, r in enumerate(ordered)}
    group_of_op = np.array([gid[int(r)] for r in roots], dtype=np.int64)
    names = []
    used: dict[str, int] = {}
    for r in ordered:
        members = np.flatnonzero(roots == r)
        members = members[stage[members] == stage[members].min()]   # name after the earliest stage's ops
        if (cost[members] > 0).any():                               # ... that do some work
            members = members[cost[members] > 0]
        scope_cost: dict[str, float] = {}
        for i in members.tolist():
            lab = label[i] or _scope(ops[i].name)
            scope_cost[lab] = scope_cost.get(lab, 0.0) + float(cost[i])
        best = max(sorted(scope_cost), key=lambda s: scope_cost[s])
        name = best if len(scope_cost) == 1 else f"{best}(+{len(scope_cost) - 1})"
        if name in used:
            used[name] += 1
            name = f"{name}#{used[name]}"
        else:
            used[name] = 1
        names.append(name)
    return Grouping(group_of_op, names)


def _relabel(roots: np.ndarray, uf: UnionFind) -> np.ndarray:
    """ROOTS with every set id replaced by its current union-find root."""
    uniq, inv = np.unique(roots, return_inverse=True)
    return np.array([uf.find(int(x)) for x in uniq], dtype=np.int64)[inv]


def _is_convex(members: list[int], succ: list[list[int]], pos: list[int], stage: list[int]) -> bool:
    """True when, in every stage, no dependency path leaves MEMBERS and comes back into them.

    Stages never decrease along a path, so a path between two ops of one stage stays in that stage.
    """
    inside = set(members)
    by_stage: dict[int, list[int]] = {}
    for i in members:
        by_stage.setdefault(stage[i], []).append(i)
    for st, group in by_stage.items():
        last = max(pos[i] for i in group)
        stack = [j for i in group for j in succ[i] if j not in inside and pos[j] < last and stage[j] == st]
        seen = set(stack)
        while stack:
            x = stack.pop()
            for y in succ[x]:
                if y in inside:
                    if stage[y] == st:
                        return False
                    continue
                if y not in seen and pos[y] < last and stage[y] == st:
                    seen.add(y)
                    stack.append(y)
    return True


def _components(members: list[int], succ: list[list[int]]) -> list[list[int]]:
    """Weakly connected components of the subgraph induced by MEMBERS (each sorted, in order of first op)."""
    inside = set(members)
    adj: dict[int, list[int]] = {i: [] for i in members}
    for i in members:
        for j in succ[i]:
            if j in inside:
                adj[i].append(j)
                adj[j].append(i)
    seen: set[int] = set()
    out = []
    for i in sorted(members):
        if i in seen:
            continue
        comp, stack = [], [i]
        seen.add(i)
        while stack:
            x = stack.pop()
            comp.append(x)
            for y in adj[x]:
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        out.append(sorted(comp))
    return out


def _position_key(members: np.ndarray, stage: np.ndarray, levels: np.ndarray,
                  cost: np.ndarray) -> tuple[int, int, int]:
    """Where a set of ops sits in the step: (earliest stage, shallowest depth below the inputs of its
    ops there that do work, first index). Ops no input reaches, or that do no work, count only when the
    set has nothing else in that stage."""
    s = int(stage[members].min())
    here = members[stage[members] == s]
    lv = levels[here]
    working = (lv >= 0) & (cost[here] > 0)
    if working.any():
        return s, int(lv[working].min()), int(members.min())
    lv = lv[lv >= 0]
    return s, int(lv.min()) if len(lv) else 1 << 40, int(members.min())


class _Cycles:
    """Finds cycles of the (set, stage) task graph for a given op -> set labelling (set ids are op indices)."""

    def __init__(self, graph: TrainingGraph, stage: np.ndarray):
        self.src, self.dst = dependency_arrays(graph)
        self.s_src = stage[self.src].astype(np.int64)
        self.s_dst = stage[self.dst].astype(np.int64)
        self.m = 3 * len(graph.ops)

    def sccs(self, roots: np.ndarray) -> list[np.ndarray]:
        """Strongly connected components with more than one task, as arrays of the set ids involved."""
        a = roots[self.src] * 3 + self.s_src
        b = roots[self.dst] * 3 + self.s_dst
        keep = a != b
        a, b = a[keep], b[keep]
        if len(a) == 0:
            return []
        mat = csr_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(self.m, self.m))
        ncomp, lab = connected_components(mat, directed=True, connection="strong")
        if ncomp == self.m:
            return []
        counts = np.bincount(lab, minlength=ncomp)
        out = []
        for c in np.flatnonzero(counts > 1):
            out.append(np.unique(np.flatnonzero(lab == c) // 3))
        return out


def _make_acyclic(cyc: _Cycles, roots: np.ndarray, uf: UnionFind) -> np.ndarray:
    """Merge sets until the (set, stage) task graph has no cycle."""
    while True:
        sccs = cyc.sccs(roots)
        if not sccs:
            return roots
        for sets in sccs:
            for r in sets[1:].tolist():
                uf.union(int(sets[0]), r)
        roots = np.array([uf.find(i) for i in range(len(roots))], dtype=np.int64)


def _merge_to_target(cyc: _Cycles, roots: np.ndarray, stage: np.ndarray, levels: np.ndarray,
                     cost: np.ndarray, target: int, uf: UnionFind) -> np.ndarray:
    """Merge the cheapest adjacent pair of sets (in topological order) until at most TARGET sets remain.

    A merge that would close a cycle of (set, stage) tasks is skipped (that pair stays apart for good:
    later merges cannot remove the path between them). If no pair can merge safely, the cheapest pair
    merges anyway together with everything on the cycle it closes.
    """
    set_ids = np.unique(roots)
    if len(set_ids) <= target:
        return roots
    seq = sorted(set_ids.tolist(), key=lambda r: _position_key(np.flatnonzero(roots == r), stage, levels, cost))
    totals = np.bincount(np.searchsorted(set_ids, roots), weights=cost, minlength=len(set_ids))
    set_cost = {int(r): float(totals[k]) for k, r in enumerate(set_ids.tolist())}
    blocked: set[tuple[int, int]] = set()
    while len(seq) > target:
        cands = sorted(range(len(seq) - 1), key=lambda k: (set_cost[seq[k]] + set_cost[seq[k + 1]], k))
        chosen = None
        for k in cands:
            a, b = seq[k], seq[k + 1]
            if (a, b) in blocked:
                continue
            if cyc.sccs(np.where(roots == b, a, roots)):
                blocked.add((a, b))
                continue
            chosen = k
            break
        forced = chosen is None
        k = cands[0] if forced else chosen
        a, b = seq[k], seq[k + 1]
        r = uf.union(a, b)
        merged_cost = set_cost.pop(a) + set_cost.pop(b)
        seq[k:k + 2] = [r]
        set_cost[r] = merged_cost
        roots = np.where((roots == a) | (roots == b), r, roots)
        if forced:
            roots = _make_acyclic(cyc, roots, uf)
            new_seq, new_cost = [], {}
            for s in seq:   # absorbed sets leave the sequence; survivors keep their first position
                rr = uf.find(s)
                if rr in new_cost:
                    new_cost[rr] += set_cost[s]
                else:
                    new_seq.append(rr)
                    new_cost[rr] = set_cost[s]
            seq, set_cost = new_seq, new_cost
            blocked = {(x, y) for x, y in blocked if uf.find(x) == x and uf.find(y) == y}
    return roots
