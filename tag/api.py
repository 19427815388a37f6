"""The user-facing entry point: ``tag.optimize(graph_def, topology) -> Plan``.

A training script builds its step as usual, hands the GraphDef and a cluster file to ``tag.optimize``
and gets back a ``Plan``: the graph rewritten for the fastest strategy the search found (replicas,
collectives, parameter servers, partitions, device strings), the strategy itself, and a report that
compares it with every built-in strategy. Example::

    import tensorflow as tf
    import tag

    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [64, 784], name="x")
        y = v1.placeholder(tf.int32, [64], name="y")
        h = tf.nn.relu(tf.matmul(x, v1.get_variable("w1", [784, 512])))
        logits = tf.matmul(h, v1.get_variable("w2", [512, 10]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        v1.train.AdamOptimizer(1e-3).minimize(loss)
        v1.global_variables_initializer()

    plan = tag.optimize(g.as_graph_def(), "topologies/lab-v100-1080ti.pbtxt", budget_s=30)
    print(plan.report()["speedup_vs_dp"], plan.train_op, plan.loss)
    plan.save("plan/")                       # graph.pb, strategy.pb, report.json, plan.json
    plan = tag.Plan.load("plan/")            # later, or on the cluster's first host
    # sess.run(plan.init); sess.run([plan.train_op, plan.loss], {"x:0": xs, "y:0": ys})

What ``optimize`` does (``prepare`` then ``search_plan``): find the entry points
(``tag.frontend.entry_points``: the step op, the loss and the initialiser of any TF1 training graph),
analyse the graph (``tag.analyze``), group its ops (``group_ops``), build the cost model (a
``Profile``, a path to one, or None for the built-in defaults), search (``tag.search.search``:
built-ins, best uniform action, PaSE DP, tree search, local refinement) and rewrite the graph for the
winner (``tag.backend.rewrite``); ``plan_for`` makes a Plan of a given strategy instead. The plan is
never predicted slower than the best feasible baseline, except that a built-in on fewer devices predicted
within ``min_gain`` (5%) of it is preferred (a gain smaller than the simulator's error does not pay for more
hosts), and a mixed or pipelined strategy must be predicted ``mixed_min_gain`` (10%) faster than the best uniform
action (``tag.search.driver.is_mixed``); when nothing evaluated fits in memory,
``tag.MemoryBudgetError`` names the smallest shortfall. ``tag.rewrite`` rewrites a graph for a given strategy (a built-in name, a ``Strategy``, a
saved ``strategy.pb`` or a plan directory).

A saved plan is a directory of plain files (no pickle): ``graph.pb`` (the rewritten GraphDef, binary
protobuf), ``strategy.pb`` (``Strategy.to_proto()``), ``report.json`` and ``plan.json`` (format
version, entry-point names, batch size, topology name).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tag.errors import GraphError, MemoryBudgetError, StrategyError, TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.backend.rewrite import RewriteResult
    from tag.cluster.topology import Topology
    from tag.cost.model import CostModel, Profile
    from tag.ir.types import TrainingGraph
    from tag.search.driver import SearchProgress, SearchResult
    from tag.search.env import SearchEnv
    from tag.sim import Simulator
    from tag.strategy.types import Grouping, Strategy

__all__ = ["Analysis", "Plan", "optimize", "plan_for", "prepare", "rewrite", "search_plan", "load_strategy",
           "strategy_report",
           "PLAN_FORMAT", "PLAN_VERSION"]

PLAN_FORMAT = "tag-plan"
PLAN_VERSION = 1
GRAPH_FILE, STRATEGY_FILE, REPORT_FILE, PLAN_FILE = "graph.pb", "strategy.pb", "report.json", "plan.json"
DEFAULT_GROUPS = 64
_MAX_FILE_BYTES = 2 << 30
_TIME_SLACK = 1e-9   # relative: a plan may equal, never exceed, the best feasible baseline


@dataclass
class Plan:
    """A rewritten training step and how it was chosen (module docstring).

    ``graph_def``: the rewritten GraphDef (every node on a ``/job:worker/task:T/device:...`` device).
    ``strategy``: the chosen ``Strategy``. ``predicted_step_time``: seconds. ``baselines``: name ->
    predicted seconds of every built-in strategy and of each search step (``best_uniform``, ``mcts``).
    ``train_op`` / ``loss`` / ``init``: names to run in ``graph_def``. ``inputs``: the batch inputs to
    feed (full global batches). ``method``: which step found the strategy. ``candidates``: name -> the
    best strategy of each search step and each built-in (a plan made by a search in this process; not saved),
    what the measured tuning step (``tag.tune``) chooses from.
    """

    graph_def: Any = field(repr=False)
    strategy: "Strategy" = field(repr=False)
    predicted_step_time: float
    baselines: dict[str, float]
    train_op: str
    loss: str | None
    init: str | None
    batch_size: int
    topology: str
    inputs: list[str] = field(default_factory=list)
    method: str = ""
    notes: list[str] = field(default_factory=list)
    _report: dict = field(default_factory=dict, repr=False)
    analysis: "Analysis | None" = field(default=None, repr=False, compare=False)   # not saved
    candidates: dict = field(default_factory=dict, repr=False, compare=False)      # not saved

    def report(self) -> dict:
        """The plan's report: a JSON-serialisable dict (keys in ``tag.report``; a copy)."""
        return copy.deepcopy(self._report)

    def trace(self) -> dict:
        """The simulated step as a Chrome trace (chrome://tracing, Perfetto); needs ``analysis`` (a plan
        made in this process, not a loaded one)."""
        if self.analysis is None:
            raise TagError("a loaded plan has no analysis to simulate; run tag.optimize again for a trace")
        return self.analysis.simulator().trace(self.strategy, batch_size=self.batch_size)

    def save(self, directory: str | os.PathLike) -> str:
        """Write the plan's four files into DIRECTORY (created if needed); returns its path."""
        directory = os.fspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise TagError(f"{directory}: exists and is not a directory")
        os.makedirs(directory, exist_ok=True)
        meta = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "train_op": self.train_op, "loss": self.loss,
                "init": self.init, "inputs": list(self.inputs), "batch_size": int(self.batch_size),
                "topology": self.topology, "method": self.method, "model": self._report.get("model", ""),
                "predicted_step_time_s": float(self.predicted_step_time), "notes": list(self.notes)}
        files = {GRAPH_FILE: self.graph_def.SerializeToString(deterministic=True),
                 STRATEGY_FILE: self.strategy.to_proto().SerializeToString(deterministic=True),
                 REPORT_FILE: _json_text(self._report).encode(),
                 PLAN_FILE: _json_text(meta).encode()}
        from tag.files import write_atomic
        for name, data in files.items():
            write_atomic(os.path.join(directory, name), data)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Plan":
        """Read a plan written by ``save``; TagError naming the file that is missing or bad."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise TagError(f"{directory}: not a plan directory (expected {PLAN_FILE}, {GRAPH_FILE}, ...)")
        meta = _read_plan_json(os.path.join(directory, PLAN_FILE))
        report = _read_json(os.path.join(directory, REPORT_FILE), "plan report")
        if not isinstance(report, dict):
            raise TagError(f"{os.path.join(directory, REPORT_FILE)}: expected a JSON object")
        strategy = _read_strategy(os.path.join(directory, STRATEGY_FILE))
        graph_def = _read_graph_def(os.path.join(directory, GRAPH_FILE))
        nodes = {n.name for n in graph_def.node}
        for key in ("train_op", "loss", "init"):
            if meta[key] is not None and meta[key] not in nodes:
                raise TagError(f"{os.path.join(directory, PLAN_FILE)}: {key} {meta[key]!r} is not in {GRAPH_FILE}")
        baselines = report.get("baselines") or {}
        return cls(graph_def, strategy, float(meta["predicted_step_time_s"]),
                   {str(k): (float(v) if v is not None else float("inf")) for k, v in baselines.items()},
                   meta["train_op"], meta["loss"], meta["init"], int(meta["batch_size"]), meta["topology"],
                   list(meta.get("inputs", [])), str(meta.get("method", "")), list(meta.get("notes", [])), report)


# ------------------------------------------------------------------------------------------------ optimize
def optimize(graph_def: Any, topology: "Topology | str | os.PathLike", *, batch_size: int | None = None,
             budget_s: float | None = None, playouts: int | None = None, order: str = "auto", seed: int = 0,
             profile: "Profile | str | os.PathLike | None" = None, groups: int = DEFAULT_GROUPS,
             train_op: str | None = None, loss: str | None = None, init: str | None = None,
             progress: "Callable[[SearchProgress], None] | None" = None, name: str | None = None,
             sfb: bool = True, prior: str = "uniform", tune_target: Any = None, tune_k: int | None = None,
             min_gain: float | None = None, pipeline: bool = True, precision: str | None = None,
             xla: bool = False, mixed_min_gain: float | None = None) -> Plan:
    """Search a fast strategy for GRAPH_DEF (a GraphDef, ``tf.Graph`` or serialised bytes) on TOPOLOGY
    (a ``Topology`` or a .pbtxt path) and return the rewritten Plan (module docstring).

    ``batch_size``: the global batch (default: the graph's). ``budget_s`` / ``playouts``: how long the
    tree search runs (seconds / simulated playouts; neither: the search's default playouts). ``order``:
    decision order (``tag.search.orders``) or "auto"; ``seed`` makes the search repeatable. ``profile``:
    a cost ``Profile``, a path to one, or None (built-in defaults). ``groups``: target number of op
    groups. ``train_op`` / ``loss`` / ``init``: op names, found automatically when None. ``progress``:
    called with a ``SearchProgress`` after each playout. ``name``: the model's name in the report.
    ``sfb``: after the search, send the gradients that pay as sufficient factors (``tag.compress``; the
    report's ``sfb_gradients`` and ``sfb_bytes_saved``); False keeps every gradient all-reduced.
    ``pipeline``: search pipelines too (``tag.search.pipeline_dp``: stages of op groups on hosts with
    micro-batches; the report's ``pipeline`` and ``pipeline_search``); False searches per-group actions only.
    ``prior``: what guides the tree search: ``"uniform"`` (the speedups of the uniform strategies; free) or
    ``"gnn"`` (the shipped graph neural network, ``tag.gnn``: a graph encoder once per search, then about a
    millisecond per new tree node; ``scripts/bench_gnn.py`` compares the two at equal time).
    ``tune_target``: where to measure before returning (``tag.tune.tune_plan``): a session target
    ("grpc://host:port"), a running cluster (``LocalCluster``, ``Testbed``) or a ``Topology`` (its cluster
    is opened for it); the ``tune_k`` most promising distinct candidates (the plan, the best built-in, the
    best uniform action, then the next fastest predicted; None: as many as cost about 30 steps of the
    slowest, none predicted over 3x the fastest) run there in interleaved rounds on synthetic batches and
    the one measured fastest is returned, its report's ``tune`` keys listing every candidate's predicted and
    measured time. ``min_gain``: a searched strategy replaces the best feasible built-in only when
    predicted at least this much faster (default 0.05: smaller gains are within the simulator's error on
    real runs; 0 keeps the fastest predicted). ``mixed_min_gain``: a mixed strategy (op groups with different
    actions) or a pipeline replaces the best uniform action only when predicted at least this much faster
    (default 0.10, ``tag.search.driver.MIXED_MIN_GAIN``: the simulator errs more on mixed plans; 0 keeps the
    fastest predicted). Either way the tuning step (``tune_target``) still measures the searched strategy.
    ``precision``: ``"mixed_float16"`` / ``"mixed_bfloat16"`` rewrite the graph with TensorFlow's automatic
    mixed-precision pass first (FP16 with static loss scaling; ``tag.frontend.precision``), so the plan is
    made for, and deploys, the graph that will run; ``"tf32"`` costs FP32 MatMuls and convolutions at the
    devices' TF32 tensor-core peak; None / ``"fp32"``: the graph as given. ``xla``: cost element-wise and
    normalisation chains as XLA fuses them (one pass over memory) and mark those ops of the rewritten graph
    for XLA (``tag.frontend.precision.mark_for_xla``), so TensorFlow compiles them when the plan runs.

    Raises GraphError (graph), TopologyError, StrategyError, RewriteError, and MemoryBudgetError when no
    strategy evaluated fits the devices' memory; TagError for a bad ``tune_k``.
    """
    from tag.tune import check_k, tune_plan
    check_k(tune_k)
    analysis = prepare(graph_def, topology, batch_size=batch_size, profile=profile, groups=groups,
                       train_op=train_op, loss=loss, init=init, name=name, precision=precision, xla=xla)
    plan = search_plan(analysis, budget_s=budget_s, playouts=playouts, order=order, seed=seed, progress=progress,
                       sfb=sfb, prior=prior, min_gain=min_gain, pipeline=pipeline, mixed_min_gain=mixed_min_gain)
    return plan if tune_target is None else tune_plan(plan, tune_target, k=tune_k)


@dataclass
class Analysis:
    """Everything a search or a rewrite needs, built once (``prepare``); a Plan made in this process keeps
    it as ``plan.analysis`` (a loaded plan has none)."""

    model: str
    graph_def: Any             # the user's graph plus the entry points' made-up nodes
    entry: Any                 # tag.frontend.entry_points.EntryPoints
    graph: "TrainingGraph"
    topology: "Topology"
    grouping: "Grouping"
    cost_model: "CostModel"
    batch: int
    profile_source: str | None
    precision: str = "fp32"    # tag.cost.precision.PLAN_PRECISIONS: what the graph was rewritten / costed for
    xla: bool = False          # element-wise chains costed as XLA fuses them
    _simulator: Any = field(default=None, repr=False)

    def simulator(self) -> "Simulator":
        """The step simulator of this graph, grouping and topology (built on first use)."""
        if self._simulator is None:
            from tag.sim import Simulator
            self._simulator = Simulator(self.graph, self.topology, self.grouping, self.cost_model)
        return self._simulator

    def builtin(self, name: str) -> "Strategy":
        """The built-in strategy NAME for this graph and topology."""
        from tag.cost.speeds import device_speeds
        from tag.strategy.baselines import builtin_strategy
        return builtin_strategy(name, self.graph, self.topology, self.grouping, self.cost_model,
                                device_speeds(self.cost_model, self.batch))

    def rewrite(self, strategy: "Strategy") -> "RewriteResult":
        """The graph rewritten for STRATEGY (entry points as found or given)."""
        from tag.backend.rewrite import rewrite as rewrite_graph
        rr = rewrite_graph(self.graph_def, self.graph, strategy, self.topology, batch_size=self.batch,
                           train_op=self.entry.train_op, loss=self.entry.loss, init=self.entry.init)
        if self.xla:      # the deployed graph fuses what the cost model costs as fused
            from tag.frontend.precision import mark_for_xla
            mark_for_xla(rr.graph_def)
        return rr


def prepare(graph_def: Any, topology: "Topology | str | os.PathLike", *, batch_size: int | None = None,
            profile: "Profile | str | os.PathLike | None" = None, groups: int = DEFAULT_GROUPS,
            grouping: "Grouping | None" = None, train_op: str | None = None, loss: str | None = None,
            init: str | None = None, name: str | None = None, precision: str | None = None,
            xla: bool = False) -> Analysis:
    """Entry points, IR, topology, op groups (``groups`` of them, or GROUPING as given: a saved strategy's)
    and cost model of GRAPH_DEF on TOPOLOGY; arguments as for ``optimize``."""
    from tag.cost.model import CostModel
    from tag.cost.precision import check_plan_precision
    from tag.frontend.analyze import analyze
    from tag.frontend.precision import apply_precision
    from tag.frontend.entry_points import find_entry_points
    from tag.frontend.graph_import import coerce_graph_def
    from tag.strategy.grouping import group_ops
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise TagError(f"groups must be a positive integer, got {groups!r}")
    precision = check_plan_precision(precision)
    topo = _topology(topology)
    prof, prof_source = _profile(profile)
    gd = coerce_graph_def(graph_def)
    entry = find_entry_points(gd, train_op=train_op, loss=loss, init=init)
    gd = entry.apply(gd)
    gd = apply_precision(gd, precision, train_op=entry.train_op, loss=entry.loss, init=entry.init)
    graph = analyze(gd, batch_size=batch_size, name=name or "")
    batch = int(batch_size if batch_size is not None else graph.batch_size)
    if batch < topo.num_devices:
        raise TagError(f"the global batch {batch} is smaller than the {topo.num_devices} devices of "
                       f"{topo.name}; data parallelism needs at least one example per device (a larger batch: "
                       "batch_size= in tag.optimize, --batch in tag-deploy)")
    if grouping is None:
        grouping = group_ops(graph, target_groups=int(groups))
    elif len(grouping.group_of_op) != len(graph.ops):
        raise StrategyError(f"the strategy was made for a graph of {len(grouping.group_of_op)} ops; this graph "
                            f"has {len(graph.ops)} (another model, or another batch size?)")
    model = name or graph.name or "model"
    cost_model = CostModel(graph, topo, prof, tf32=precision == "tf32", xla=bool(xla))
    return Analysis(model, gd, entry, graph, topo, grouping, cost_model, batch, prof_source, precision, bool(xla))


PRIORS: tuple[str, ...] = ("uniform", "gnn")


def search_prior(name: str):
    """The tree search's prior called NAME (``PRIORS``): None for the built-in uniform-value prior, or the
    shipped GNN's ``tag.gnn.gnn_prior`` (DGL is imported only then)."""
    if name == "uniform":
        return None
    if name == "gnn":
        from tag.gnn import gnn_prior
        return gnn_prior
    raise StrategyError(f"unknown prior {name!r} (known: {', '.join(PRIORS)})")


def search_plan(analysis: Analysis, *, budget_s: float | None = None, playouts: int | None = None,
                order: str = "auto", seed: int = 0,
                progress: "Callable[[SearchProgress], None] | None" = None, sfb: bool = True,
                prior: str = "uniform", min_gain: float | None = None, pipeline: bool = True,
                fuse_buckets: bool = True, mixed_min_gain: float | None = None) -> Plan:
    """Search ANALYSIS's graph (``tag.search.search``), then (with SFB) pick the gradients that travel as
    sufficient factors (``tag.compress.select_sfb``: a MILP confirmed by the simulator, kept only when
    faster), and return the rewritten winner as a Plan. ``min_gain``: how much faster than the best
    built-in a searched strategy must be predicted (default ``tag.search.driver.DEFAULT_MIN_GAIN``);
    ``mixed_min_gain``: how much faster than the best uniform action a mixed or pipelined one must be (default
    ``tag.search.driver.MIXED_MIN_GAIN``).
    ``pipeline``: search pipelines too. When a pipeline wins, the best per-group answer with SFB replaces
    it if predicted faster (SFB is not deployed inside pipeline stages). ``fuse_buckets``: then choose where the
    plan's gradient fusion buckets close (``tag.search.buckets``; the plan with the default size stays a tuning
    candidate, ``default_buckets``, and so does ``dp_allreduce`` with its own size, ``dp_allreduce_buckets``)."""
    from tag.report import pipeline_fields
    from tag.search.buckets import choose_bucket_bytes, size_text
    from tag.search.driver import DEFAULT_MIN_GAIN, MIXED_MIN_GAIN
    from tag.strategy.fusion import FUSION_BUCKET_BYTES
    from tag.search import SearchEnv, search
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch, simulator=analysis.simulator())
    margin = DEFAULT_MIN_GAIN if min_gain is None else min_gain
    found = search(env, budget_s=budget_s, playouts=playouts, order=order, seed=seed, progress=progress,
                   prior=search_prior(prior), min_gain=margin, use_pipeline=pipeline,
                   mixed_min_gain=MIXED_MIN_GAIN if mixed_min_gain is None else mixed_min_gain)
    if not found.outcome.feasible:
        raise _memory_error(env, found)
    _check_not_slower(found, margin)
    results = dict(env.builtin_results)
    results.setdefault(found.method, found.result)
    baselines, feasible = dict(found.baselines), dict(found.baselines_feasible)
    strategy, notes, sfb_fields = found.strategy, list(found.notes), {}
    method = found.method
    candidates = dict(found.candidates)
    if sfb:
        from tag.compress import select_sfb
        if strategy.pipeline is None:
            chosen = select_sfb(env.simulator, found.strategy, analysis.batch)
        else:
            # SFB is not deployed inside pipeline stages: the best per-group answer with SFB may still win
            chosen = None
            if found.per_group is not None:
                name, plain, _ = found.per_group
                alternative = select_sfb(env.simulator, plain, analysis.batch)
                if alternative.chosen and alternative.result.feasible and \
                        alternative.step_time < found.step_time:
                    chosen, method, strategy = alternative, name, plain
                    results.setdefault(name, found.per_group[2])
                    notes.append(f"{name} with sufficient factors ({alternative.step_time * 1e3:.3g} ms) is "
                                 f"predicted faster than the pipeline ({found.step_time * 1e3:.3g} ms)")
    if sfb and chosen is not None:
        if chosen.chosen:
            candidates[method], candidates["without_sfb"] = chosen.strategy, strategy
            strategy = chosen.strategy
            results[method] = chosen.result
            baselines[method] = chosen.step_time
            baselines["without_sfb"], feasible["without_sfb"] = chosen.base_step_time, True
            notes.append(f"sfb: {len(chosen.chosen)} gradients travel as sufficient factors "
                         f"({chosen.base_step_time * 1e3:.3g} ms -> {chosen.step_time * 1e3:.3g} ms predicted)")
        sfb_fields = {"sfb_gradients": list(chosen.chosen), "sfb_bytes_saved": int(round(chosen.bytes_saved))}
    # the plan's own simulation is its default-size one: the search and SFB never set a bucket size
    buckets = choose_bucket_bytes(env.simulator, strategy, analysis.batch,
                                  default=results[method]) if fuse_buckets else None
    bucket_fields = {}
    if buckets is not None:
        candidates[DEFAULT_BUCKETS] = strategy
        baselines[DEFAULT_BUCKETS], feasible[DEFAULT_BUCKETS] = buckets.default_step_time, True
        strategy = candidates[method] = buckets.strategy
        results[method], baselines[method] = buckets.result, buckets.step_time
        notes.append(f"gradient buckets of {size_text(strategy.bucket_bytes)}: "
                     f"{buckets.default_step_time * 1e3:.3g} ms -> {buckets.step_time * 1e3:.3g} ms predicted "
                     f"(default {size_text(FUSION_BUCKET_BYTES)})")
        bucket_fields = {"bucket_bytes": float(strategy.bucket_bytes),
                         "bucket_step_times_s": {size_text(b): float(t) for b, t in buckets.step_times.items()}}
    if fuse_buckets and method != "dp_allreduce" and "dp_allreduce" in candidates:
        # data parallelism with its own bucket size: a candidate the measured tuning step may run
        dp = choose_bucket_bytes(env.simulator, candidates["dp_allreduce"], analysis.batch,
                                 default=results.get("dp_allreduce"))
        if dp is not None:
            candidates[DP_BUCKETS], baselines[DP_BUCKETS], feasible[DP_BUCKETS] = dp.strategy, dp.step_time, True
    report = _plan_report(analysis, method, results, baselines, feasible, {
        "search_seconds": float(found.search_seconds), "evaluations": int(found.evaluations),
        "method": method, "reference": found.reference, "notes": notes,
        "search": {"order": order, "seed": int(seed), "playouts": playouts, "budget_s": budget_s}, **sfb_fields,
        **bucket_fields,
        **_pipeline_search_fields(found), **pipeline_fields(strategy, analysis.topology, results[method])})
    plan = _make_plan(analysis, strategy, report)
    plan.candidates = candidates
    return plan


DEFAULT_BUCKETS = "default_buckets"   # the plan with FUSION_BUCKET_BYTES buckets, when another size was chosen
DP_BUCKETS = "dp_allreduce_buckets"   # dp_allreduce with its chosen bucket size (a tuning candidate)


def _pipeline_search_fields(found: "SearchResult") -> dict:
    """What the pipeline search did (the report's ``pipeline_search``), whether or not a pipeline won."""
    piped = found.pipeline
    if piped is None:
        return {}
    best = None if piped.strategy is None else {**piped.strategy.pipeline.to_dict(),
                                                 "predicted_step_time_s": float(piped.outcome.step_time)}
    return {"pipeline_search": {"simulated": int(piped.evaluated), "seconds": float(piped.seconds), "best": best}}


def strategy_report(analysis: Analysis, strategy: "Strategy | str", *, name: str | None = None,
                    ) -> tuple[str, "Strategy", dict]:
    """Simulate a given STRATEGY (a Strategy or a built-in name) beside the built-ins, without search or
    rewrite: (its name in the report, the Strategy, the report). NAME labels it (default: the strategy's
    name, or "given")."""
    from tag.report import pipeline_fields
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    if isinstance(strategy, str):
        name, strategy = strategy, analysis.builtin(strategy)
    name = name or strategy.name or "given"
    sim = analysis.simulator()
    results = {n: sim.evaluate(analysis.builtin(n), batch_size=analysis.batch) for n in BUILTIN_STRATEGIES}
    results.setdefault(name, sim.evaluate(strategy, batch_size=analysis.batch))
    sfb_fields = {}
    if strategy.sfb:
        import dataclasses
        plain = sim.evaluate(dataclasses.replace(strategy, sfb=[]), batch_size=analysis.batch)
        applied = sim.sfb.plan(strategy, strategy.actions, sim.layouts, analysis.batch).variables
        sfb_fields = {"sfb_gradients": list(applied),
                      "sfb_bytes_saved": int(round(plain.comm_bytes - results[name].comm_bytes))}
    report = _plan_report(analysis, name, results, {n: float(r.step_time) for n, r in results.items()},
                          {n: bool(r.feasible) for n, r in results.items()},
                          {"search_seconds": 0.0, "evaluations": len(results), "method": name,
                           "reference": "dp_allreduce", "notes": [], **sfb_fields,
                           **pipeline_fields(strategy, analysis.topology, results[name])})
    return name, strategy, report


def plan_for(analysis: Analysis, strategy: "Strategy | str", *, name: str | None = None) -> Plan:
    """A Plan for a given STRATEGY (``strategy_report``, then the graph rewritten for it)."""
    _, strategy, report = strategy_report(analysis, strategy, name=name)
    return _make_plan(analysis, strategy, report)


def _make_plan(analysis: Analysis, strategy: "Strategy", report: dict) -> Plan:
    rr = analysis.rewrite(strategy)
    report["rewritten"] = {"train_op": rr.train_op, "loss": rr.loss, "init": rr.init, "inputs": list(rr.inputs),
                           "nodes": len(rr.graph_def.node)}
    notes = list(report["notes"]) + list(rr.notes)
    plan = Plan(rr.graph_def, strategy, float(report["predicted_step_time_s"]), dict(report["baselines"]),
                rr.train_op, rr.loss, rr.init, analysis.batch, analysis.topology.name, list(rr.inputs),
                report["method"], notes, report)
    plan.analysis = analysis
    return plan


def _topology(topology: Any) -> "Topology":
    from tag.cluster.topology import Topology, load_topology
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, bytes, os.PathLike)):
        return load_topology(topology)
    raise TagError(f"topology must be a tag.Topology or a path to a .pbtxt file, got {type(topology).__name__}")


def _profile(profile: Any) -> tuple["Profile | None", str | None]:
    from tag.cost.model import Profile
    if profile is None or isinstance(profile, Profile):
        return profile, (profile.source or "given") if profile is not None else None
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile), os.fspath(profile)
    raise TagError(f"profile must be a tag Profile, a path to a profile JSON file or None, "
                   f"got {type(profile).__name__}")


def _check_not_slower(found: "SearchResult", margin: float) -> None:
    """The search's guarantee, checked: the plan is at least as fast as every feasible built-in (a searched
    strategy less than ``min_gain`` faster than the best built-in is not taken, so only built-ins bound it),
    except that a built-in on fewer devices predicted within MARGIN (``min_gain``) of the fastest built-in is
    preferred to it (``tag.search.driver.simplest_builtin``)."""
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    feasible = [t for n, t in found.baselines.items() if found.baselines_feasible.get(n) and n in BUILTIN_STRATEGIES]
    allowed = margin if found.method in BUILTIN_STRATEGIES else 0.0
    if feasible and found.step_time > min(feasible) * (1 + allowed + _TIME_SLACK):
        raise AssertionError(f"search returned {found.method!r} at {found.step_time:.6g} s, slower than the "
                             f"best feasible baseline ({min(feasible):.6g} s)")


def _memory_error(env: "SearchEnv", found: "SearchResult") -> MemoryBudgetError:
    """MemoryBudgetError naming the smallest shortfall among the strategies evaluated."""
    from tag.report import format_bytes
    candidates = dict(env.builtin_results)
    candidates[found.method] = found.result
    if env.best_choice is not None:
        candidates.setdefault("searched", env.result(env.best_choice))
    capacity = np.array([d.memory_bytes for d in env.topology.devices], dtype=np.float64)
    best = None
    for strategy_name, r in candidates.items():
        over = np.asarray(r.peak_memory, dtype=np.float64) - capacity
        worst = int(np.argmax(over))
        if best is None or over[worst] < best[0]:
            best = (float(over[worst]), worst, strategy_name, float(r.peak_memory[worst]))
    over, dev, strategy_name, peak = best
    device = env.topology.devices[dev]
    return MemoryBudgetError(
        f"no strategy fits in memory ({env.evaluations + len(env.builtin_results)} evaluated); the closest, "
        f"{strategy_name}, needs {format_bytes(peak)} on {device.name}, {format_bytes(over)} over its "
        f"{format_bytes(capacity[dev])}: use devices with more memory, more devices or a smaller batch",
        shortfall_bytes=int(round(over)), device=device.name, strategy=strategy_name)


# ------------------------------------------------------------------------------------------------ report
def _plan_report(analysis: Analysis, name: str, results: dict, baselines: dict, feasible: dict,
                 extra: dict) -> dict:
    """tag.report's keys for strategy NAME (RESULTS: name -> SimResult, with NAME and the built-ins),
    every compared strategy's time (BASELINES, FEASIBLE) and what EXTRA adds."""
    from tag.report import build_report, finite
    report = build_report(analysis.model, analysis.topology, analysis.grouping, name, results, analysis.batch)
    report.update({
        "baselines": {n: float(t) for n, t in baselines.items()},
        "baselines_feasible": {n: bool(f) for n, f in feasible.items()},
        "sfb_bytes_saved": 0,
        "profile": analysis.profile_source,
        "precision": analysis.precision, "xla": analysis.xla,
        "entry_points": {"train_op": analysis.entry.train_op, "loss": analysis.entry.loss,
                         "init": analysis.entry.init, "found": list(analysis.entry.notes)},
        **extra})
    return finite(report)


# ------------------------------------------------------------------------------------------------ rewrite
def rewrite(graph_def: Any, topology: "Topology | str | os.PathLike", strategy: "Strategy | str | os.PathLike", *,
            batch_size: int | None = None, groups: int = DEFAULT_GROUPS,
            profile: "Profile | str | os.PathLike | None" = None, train_op: str | None = None,
            loss: str | None = None, init: str | None = None) -> "RewriteResult":
    """Rewrite GRAPH_DEF to run STRATEGY on TOPOLOGY; returns ``tag.backend.rewrite.RewriteResult``.

    STRATEGY: a built-in name (``dp_allreduce``, ``ps``, ``single``, ``partition``; grouped with
    ``groups`` and the cost model of ``profile``), a ``Strategy``, or a path to a saved ``strategy.pb``
    or plan directory (whose batch size is the default). Entry points are found as in ``optimize``.
    """
    strategy, saved_batch = _strategy_arg(strategy)
    analysis = prepare(graph_def, topology, batch_size=saved_batch if batch_size is None else batch_size,
                       profile=profile, groups=groups, train_op=train_op, loss=loss, init=init,
                       grouping=None if isinstance(strategy, str) else strategy.grouping)
    return analysis.rewrite(analysis.builtin(strategy) if isinstance(strategy, str) else strategy)


def _strategy_arg(strategy: Any) -> tuple["Strategy | str", int | None]:
    """(a Strategy or a built-in name, the saved plan's batch size or None)."""
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    from tag.strategy.types import Strategy
    if isinstance(strategy, Strategy):
        return strategy, None
    if isinstance(strategy, str) and strategy in BUILTIN_STRATEGIES:
        return strategy, None
    if isinstance(strategy, (str, os.PathLike)):
        if os.path.exists(strategy):
            return load_strategy(strategy)
        raise StrategyError(f"unknown strategy {os.fspath(strategy)!r}: not a built-in "
                            f"({', '.join(BUILTIN_STRATEGIES)}) and no such file or plan directory")
    raise StrategyError(f"strategy must be a built-in name, a Strategy or a path, got {type(strategy).__name__}")


def load_strategy(path: str | os.PathLike) -> tuple["Strategy", int | None]:
    """The Strategy saved at PATH (a ``strategy.pb`` file or a plan directory) and, for a plan directory,
    the batch size it was planned for (None for a bare strategy file). TagError names a bad file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        meta = _read_plan_json(os.path.join(path, PLAN_FILE))
        return _read_strategy(os.path.join(path, STRATEGY_FILE)), int(meta["batch_size"])
    if not os.path.exists(path):
        raise StrategyError(f"{path}: no such file or plan directory")
    return _read_strategy(path), None


# ------------------------------------------------------------------------------------------------ files
def _json_text(obj: Any) -> str:
    from tag.report import finite
    return json.dumps(finite(obj), indent=2) + "\n"


def _read_bytes(path: str, what: str) -> bytes:
    from tag.files import read_input_file
    return read_input_file(path, what=what, limit=_MAX_FILE_BYTES)


def _read_json(path: str, what: str) -> Any:
    from tag.files import decode_json
    return decode_json(_read_bytes(path, what), path, not_text=f"not UTF-8 text ({what})", not_json="not valid JSON")


def _read_plan_json(path: str) -> dict:
    meta = _read_json(path, "plan description")
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT:
        raise TagError(f"{path}: not a tag plan description (no \"format\": \"{PLAN_FORMAT}\")")
    if meta.get("version") != PLAN_VERSION:
        raise TagError(f"{path}: unsupported plan version {meta.get('version')!r} (this tag reads {PLAN_VERSION})")
    for key, types in (("train_op", (str,)), ("loss", (str, type(None))), ("init", (str, type(None))),
                       ("batch_size", (int,)), ("topology", (str,)), ("predicted_step_time_s", (int, float))):
        if not isinstance(meta.get(key), types) or isinstance(meta.get(key), bool):
            raise TagError(f"{path}: {key!r} is missing or has the wrong type")
    if meta["batch_size"] < 1:
        raise TagError(f"{path}: batch_size must be positive, got {meta['batch_size']}")
    return meta


def _read_strategy(path: str) -> "Strategy":
    from tag.strategy.types import Strategy
    data = _read_bytes(path, "saved strategy")
    try:
        strategy = Strategy.from_proto(data)
    except TagError as err:
        raise StrategyError(f"{path}: {err}") from None
    if not strategy.actions:
        raise StrategyError(f"{path}: not a saved tag strategy (no actions)")
    return strategy


def _read_graph_def(path: str) -> Any:
    from tag.frontend.graph_import import coerce_graph_def
    data = _read_bytes(path, "rewritten GraphDef")
    try:
        gd = coerce_graph_def(data)
    except GraphError as err:
        raise GraphError(f"{path}: {err}") from None
    if not gd.node:
        raise GraphError(f"{path}: the GraphDef has no nodes")
    return gd
