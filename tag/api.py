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
    plan = tag.optimize(g.as_graph_def(), "topologies/lab-v100-1080ti.pbtxt",
                        options=tag.SearchOptions(budget_s=30, prior="gnn"))     # the same settings as one object
    print(plan.report()["speedup_vs_dp"], plan.train_op, plan.loss)
    plan.save("plan/")                       # graph.pb, strategy.pb, report.json, plan.json
    plan = tag.Plan.load("plan/")            # later, or on the cluster's first host
    # sess.run(plan.init); sess.run([plan.train_op, plan.loss], {"x:0": xs, "y:0": ys})

What ``optimize`` does (``tag.plan.prepare`` then ``search_plan``): find the entry points, analyse the graph,
group its ops and build the cost model (``prepare``: an ``Analysis``), search (``tag.search.search``: built-ins,
best uniform action, PaSE DP, tree search, local refinement, pipelines) with the settings of a
``tag.SearchOptions`` (``tag.options``), pick the gradients that travel as sufficient factors, choose the
gradient buckets, and rewrite the graph for the winner (``tag.plan.make_plan``); ``tag.plan.plan_for`` makes a
Plan of a given strategy instead. The plan is never predicted slower than the best feasible baseline, except
that a built-in on fewer devices predicted within ``min_gain`` (5%) of it is preferred (a gain smaller than the
simulator's error does not pay for more hosts), and a mixed or pipelined strategy must be predicted
``mixed_min_gain`` (10%) faster than the best uniform action (``tag.search.driver.is_mixed``); when nothing
evaluated fits in memory, ``tag.MemoryBudgetError`` names the smallest shortfall. With a ``tune_target`` the
measured tuning step (``tag.tune``) then keeps the candidate measured fastest. ``tag.rewrite`` rewrites a graph
for a given strategy (a built-in name, a ``Strategy``, a saved ``strategy.pb`` or a plan directory).

What a Plan holds and its files: ``tag.plan`` (``Plan``, ``Analysis``, ``prepare``, ``plan_for``,
``strategy_report`` and ``load_strategy`` are re-exported here).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tag.compress import select_sfb
from tag.errors import MemoryBudgetError, StrategyError
from tag.options import PRIORS, SearchOptions
from tag.plan import (  # noqa: F401  (re-exported: tag.api.Plan ...)
    DEFAULT_GROUPS,
    PLAN_FORMAT,
    PLAN_VERSION,
    Analysis,
    Plan,
    load_strategy,
    make_plan,
    plan_for,
    plan_report,
    prepare,
    strategy_report,
)
from tag.report import format_bytes, pipeline_fields
from tag.search import SearchEnv, search
from tag.search.buckets import choose_bucket_bytes, size_text
from tag.strategy.baselines import BUILTIN_STRATEGIES
from tag.strategy.fusion import FUSION_BUCKET_BYTES
from tag.strategy.types import Strategy
from tag.tune import tune_plan

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.backend.rewrite import RewriteResult
    from tag.cluster.topology import Topology
    from tag.cost.model import Profile
    from tag.search.driver import SearchProgress, SearchResult

__all__ = ["Analysis", "Plan", "SearchOptions", "optimize", "plan_for", "prepare", "rewrite", "search_plan",
           "load_strategy", "strategy_report", "PLAN_FORMAT", "PLAN_VERSION"]

_TIME_SLACK = 1e-9   # relative: a plan may equal, never exceed, the best feasible baseline


# ------------------------------------------------------------------------------------------------ optimize
def optimize(graph_def: Any, topology: "Topology | str | os.PathLike", *, options: SearchOptions | None = None,
             batch_size: int | None = None, profile: "Profile | str | os.PathLike | None" = None,
             groups: int = DEFAULT_GROUPS, train_op: str | None = None, loss: str | None = None,
             init: str | None = None, progress: "Callable[[SearchProgress], None] | None" = None,
             name: str | None = None, tune_target: Any = None, precision: str | None = None, xla: bool = False,
             **search_options: Any) -> Plan:
    """Search a fast strategy for GRAPH_DEF (a GraphDef, ``tf.Graph`` or serialised bytes) on TOPOLOGY
    (a ``Topology`` or a .pbtxt path) and return the rewritten Plan (module docstring).

    ``options``: the search's settings, a ``tag.SearchOptions`` (budget, playouts, order, seed, prior, SFB,
    pipelines, buckets, margins, tuning K; its docstring says what each does); SEARCH_OPTIONS: the same
    settings as keywords (``budget_s=30``, ``playouts=200``, ``prior="gnn"``, ``tune_k=3`` ...), each one that is
    not None replacing that field of ``options`` (``SearchOptions.of``). All are checked before anything is built.
    ``batch_size``: the global batch (default: the graph's). ``profile``: a cost ``Profile``, a path to one, or
    None (built-in defaults). ``groups``: target number of op groups. ``train_op`` / ``loss`` / ``init``: op
    names, found automatically when None. ``progress``: called with a ``SearchProgress`` after each playout.
    ``name``: the model's name in the report. ``tune_target``: where to measure before returning
    (``tag.tune.tune_plan``): a session target ("grpc://host:port"), a running cluster (``LocalCluster``,
    ``Testbed``) or a ``Topology`` (its cluster is opened for it); the ``tune_k`` most promising distinct
    candidates (the plan, the best built-in, the best uniform action, then the next fastest predicted; None: as
    many as cost about 30 steps of the slowest, none predicted over 3x the fastest) run there in interleaved
    rounds on synthetic batches and the one measured fastest is returned, its report's ``tune`` keys listing
    every candidate's predicted and measured time; the tuning step measures the searched strategy whatever the
    margins. ``precision``: ``"mixed_float16"`` / ``"mixed_bfloat16"`` rewrite the graph with TensorFlow's
    automatic mixed-precision pass first (FP16 with static loss scaling; ``tag.frontend.precision``), so the
    plan is made for, and deploys, the graph that will run; ``"tf32"`` costs FP32 MatMuls and convolutions at
    the devices' TF32 tensor-core peak; None / ``"fp32"``: the graph as given. ``xla``: cost element-wise and
    normalisation chains as XLA fuses them (one pass over memory) and mark those ops of the rewritten graph
    for XLA (``tag.frontend.precision.mark_for_xla``), so TensorFlow compiles them when the plan runs.

    Raises OptionError (a search option out of range), GraphError (graph), TopologyError, StrategyError,
    RewriteError, and MemoryBudgetError when no strategy evaluated fits the devices' memory.
    """
    opts = SearchOptions.of(options, **search_options)
    analysis = prepare(graph_def, topology, batch_size=batch_size, profile=profile, groups=groups,
                       train_op=train_op, loss=loss, init=init, name=name, precision=precision, xla=xla)
    plan = search_plan(analysis, options=opts, progress=progress)
    return plan if tune_target is None else tune_plan(plan, tune_target, k=opts.tune_k)


def search_prior(name: str):
    """The tree search's prior called NAME (``PRIORS``): None for the built-in uniform-value prior, or the
    shipped GNN's ``tag.gnn.gnn_prior`` (DGL is imported only then)."""
    if name == "uniform":
        return None
    if name == "gnn":
        from tag.gnn import gnn_prior
        return gnn_prior
    raise StrategyError(f"unknown prior {name!r} (known: {', '.join(PRIORS)})")


def search_plan(analysis: Analysis, *, options: SearchOptions | None = None,
                progress: "Callable[[SearchProgress], None] | None" = None, **search_options: Any) -> Plan:
    """Search ANALYSIS's graph (``tag.search.search``) with OPTIONS (a ``SearchOptions``; keywords as for
    ``optimize``), then (with SFB) pick the gradients that travel as sufficient factors
    (``tag.compress.select_sfb``: a MILP confirmed by the simulator, kept only when faster), and return the
    rewritten winner as a Plan. When a pipeline wins, the best per-group answer with SFB replaces it if predicted
    faster (SFB is not deployed inside pipeline stages). With ``fuse_buckets``, then choose where the plan's
    gradient fusion buckets close (``tag.search.buckets``; the plan with the default size stays a tuning
    candidate, ``default_buckets``, and so does ``dp_allreduce`` with its own size, ``dp_allreduce_buckets``)."""
    opts = SearchOptions.of(options, **search_options)
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch, simulator=analysis.simulator())
    found = search(env, budget_s=opts.budget_s, playouts=opts.playouts, order=opts.order, seed=opts.seed,
                   progress=progress, prior=search_prior(opts.prior), min_gain=opts.min_gain,
                   use_pipeline=opts.pipeline, mixed_min_gain=opts.mixed_min_gain)
    if not found.outcome.feasible:
        raise _memory_error(env, found)
    _check_not_slower(found, opts.min_gain)
    results = dict(env.builtin_results)
    results.setdefault(found.method, found.result)
    baselines, feasible = dict(found.baselines), dict(found.baselines_feasible)
    strategy, notes, sfb_fields = found.strategy, list(found.notes), {}
    method = found.method
    candidates = dict(found.candidates)
    if opts.sfb:
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
    if opts.sfb and chosen is not None:
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
                                  default=results[method]) if opts.fuse_buckets else None
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
    if opts.fuse_buckets and method != "dp_allreduce" and "dp_allreduce" in candidates:
        # data parallelism with its own bucket size: a candidate the measured tuning step may run
        dp = choose_bucket_bytes(env.simulator, candidates["dp_allreduce"], analysis.batch,
                                 default=results.get("dp_allreduce"))
        if dp is not None:
            candidates[DP_BUCKETS], baselines[DP_BUCKETS], feasible[DP_BUCKETS] = dp.strategy, dp.step_time, True
    report = plan_report(analysis, method, results, baselines, feasible, {
        "search_seconds": float(found.search_seconds), "evaluations": int(found.evaluations),
        "method": method, "reference": found.reference, "notes": notes,
        "search": {"order": opts.order, "seed": int(opts.seed), "playouts": opts.playouts, "budget_s": opts.budget_s},
        **sfb_fields,
        **bucket_fields,
        **_pipeline_search_fields(found), **pipeline_fields(strategy, analysis.topology, results[method])})
    plan = make_plan(analysis, strategy, report)
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


def _check_not_slower(found: "SearchResult", margin: float) -> None:
    """The search's guarantee, checked: the plan is at least as fast as every feasible built-in (a searched
    strategy less than ``min_gain`` faster than the best built-in is not taken, so only built-ins bound it),
    except that a built-in on fewer devices predicted within MARGIN (``min_gain``) of the fastest built-in is
    preferred to it (``tag.search.driver.simplest_builtin``)."""
    feasible = [t for n, t in found.baselines.items() if found.baselines_feasible.get(n) and n in BUILTIN_STRATEGIES]
    allowed = margin if found.method in BUILTIN_STRATEGIES else 0.0
    if feasible and found.step_time > min(feasible) * (1 + allowed + _TIME_SLACK):
        raise AssertionError(f"search returned {found.method!r} at {found.step_time:.6g} s, slower than the "
                             f"best feasible baseline ({min(feasible):.6g} s)")


def _memory_error(env: "SearchEnv", found: "SearchResult") -> MemoryBudgetError:
    """MemoryBudgetError naming the smallest shortfall among the strategies evaluated."""
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
