"""Helpers shared by test modules (and a few benchmark scripts) that need TensorFlow.

    from helpers import in_process_servers, trained_variables   # pytest puts tests/ on sys.path
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from bounded import bounded
from tag.backend.runtime import free_ports, session_config

tf1 = tf.compat.v1


def trained_variables(gd) -> dict[str, int]:
    """Variable name -> element count, for every variable an optimizer apply op of GraphDef GD updates."""
    nodes = {n.name: n for n in gd.node}
    out = {}
    for n in gd.node:
        if n.op.startswith(("ResourceApply", "Apply", "ResourceSparseApply", "SparseApply")):
            var = nodes[n.input[0]]
            assert var.op in ("VarHandleOp", "VariableV2"), (n.name, var.op)
            out[var.name] = int(np.prod([d.size for d in var.attr["shape"].shape.dim]))
    return out


def in_process_servers(count: int = 3) -> tuple[list[int], list]:
    """(ports, servers): COUNT TF servers of job "worker" started in this process on free loopback ports."""
    ports = free_ports(count)
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
    servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, config=session_config(), start=True)
               for i in range(count)]
    return ports, servers


def train_copies(res, target: str, ir, batches) -> list[dict[str, list[np.ndarray]]]:
    """Run the rewritten step RES (a rewrite result) on BATCHES at TARGET, Grappler off; after each step
    the values of every copy of every trainable variable of IR, by variable name."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(res.graph_def, name="")
        reads = {v.name: [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(c + ":0"),
                                                    dtype=g.get_operation_by_name(c).get_attr("dtype"))
                          for c in res.variables[v.name]] for v in ir.variables if v.kind == "trainable"}
    cfg = bounded(session_config())
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    out = []
    with tf1.Session(target, graph=g, config=cfg) as s:
        s.run(res.init)
        for fd in batches:
            s.run(res.train_op, fd)
            out.append(s.run(reads))
    return out


def forward_group_order(ir, grouping) -> tuple[list[int], list[int]]:
    """(groups with forward ops in a topological order of their forward data edges, the other groups).

    A hand-made pipeline cuts the first list into contiguous stages; the second (loss seed, optimizer
    bookkeeping: no forward op) can join the last stage."""
    group = np.asarray(grouping.group_of_op)
    fwd = {int(group[i]) for i, op in enumerate(ir.ops) if op.phase == "forward"}
    first = {}
    for i, op in enumerate(ir.ops):
        if op.phase == "forward":
            first.setdefault(int(group[i]), i)
    succ = {g: set() for g in fwd}
    indeg = {g: 0 for g in fwd}
    for e in ir.edges:
        a, b = int(group[e.src]), int(group[e.dst])
        if a != b and ir.ops[e.src].phase == "forward" and ir.ops[e.dst].phase == "forward" and b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    ready = sorted((g for g in fwd if indeg[g] == 0), key=first.get)
    order = []
    while ready:
        g = ready.pop(0)
        order.append(g)
        for b in succ[g]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
        ready.sort(key=first.get)
    rest = [g for g in range(grouping.num_groups) if g not in fwd]
    return order, rest


ROUNDING_NOISE = 1e-6   # a variable whose largest gradient is below this fraction of the largest of all


def zero_gradient_variables(names, grads) -> set[str]:
    """NAMES whose reference gradient (GRADS, one array each, same order) is zero by construction, so that
    what a run computes for it is float32 rounding noise: its largest element is at most ``ROUNDING_NOISE``
    of the largest gradient element of all. Examples: an attention key bias (softmax over the keys ignores
    a term constant over them: ``q . (k + b) = q . k + q . b``), a convolution bias before BatchNorm.
    Relative differences of such a variable compare two rounding noises, any value from 0 to 2; they say
    nothing about the rewrite, so exactness checks leave them out (and bound what they may do instead)."""
    names, grads = list(names), [np.asarray(g) for g in grads]
    largest = [float(np.max(np.abs(g))) if g.size else 0.0 for g in grads]
    gmax = max(largest, default=0.0)
    return {n for n, m in zip(names, largest) if m <= ROUNDING_NOISE * gmax}


def kept_within_noise(tune: dict) -> bool:
    """Whether a plan report's ``tune`` keys kept the candidate measured fastest or one within its noise
    (``tag.tune.keep``: of those, the one on the fewest hosts, then the plan)."""
    from tag.tune import within_noise
    rows = tune["candidates"]
    fastest = min(rows, key=lambda r: r["measured_ms"])
    kept = next(r for r in rows if r["name"] == tune["kept"])
    return within_noise(kept["measured_ms"], kept["mad_ms"], fastest["measured_ms"] + 1e-9, fastest["mad_ms"],
                        steps=kept["steps"], fastest_steps=fastest["steps"])


def allowed_slack(baseline: str) -> float:
    """How much slower than the search's BASELINE (a ``SearchResult.baselines`` name) the plan may be predicted:
    nothing for a built-in; ``min_gain`` for the best uniform action (a built-in within the margin is
    preferred); for a searched (possibly mixed or pipelined) strategy, the mixed margin over the best uniform
    action and then ``min_gain`` over a built-in (``tag.search.driver.search``)."""
    from tag.search.driver import DEFAULT_MIN_GAIN, MIXED_MIN_GAIN
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    if baseline in BUILTIN_STRATEGIES:
        return 1e-9
    if baseline == "best_uniform":
        return DEFAULT_MIN_GAIN + 1e-9
    return (1 + DEFAULT_MIN_GAIN) * (1 + MIXED_MIN_GAIN) - 1 + 1e-9
