"""A Plan: the training step rewritten for a strategy, how it was chosen, and its files.

``prepare`` builds, once, everything a search or a rewrite needs (an ``Analysis``): the entry points
(``tag.frontend.entry_points``: the step op, the loss and the initialiser of any TF1 training graph), the IR
(``tag.analyze``), the op groups (``group_ops``) and the cost model (a ``Profile``, a path to one, or None for
the built-in defaults). ``plan_for`` makes a Plan of a given strategy: it simulates it beside the built-ins
(``strategy_report``) and rewrites the graph for it (``tag.backend.rewrite``). The search that chooses the
strategy (``tag.optimize``, ``tag.api.search_plan``) and the measured tuning step (``tag.tune``) both end here.

A saved plan is a directory of plain files (no pickle): ``graph.pb`` (the training step the plan was made for,
binary protobuf), ``strategy.pb`` (``Strategy.to_proto()``), ``topology.pbtxt`` (the cluster),
``report.json`` and ``plan.json`` (format 2: entry-point names, batch size, precision, hosts and the plan's
fingerprint). Each host builds its own program from these files (``Plan.program``); a directory an earlier
tag saved (format 1, one rewritten graph for the whole cluster) is refused with a line saying to save it
again. ``load_strategy`` reads the strategy back from a plan directory or a bare ``strategy.pb``.

Example::

    import tag
    from tag.plan import plan_for, prepare

    analysis = prepare(tag.zoo.training_graph("mlp", 32), "topologies/localhost.pbtxt")
    plan = plan_for(analysis, "dp_allreduce")        # a built-in name or a Strategy
    plan.save("plan/")                               # graph.pb, strategy.pb, topology.pbtxt, report.json, plan.json
    plan = tag.Plan.load("plan/")
    plan.program("cpu1").graph_def                   # one host's program, built on first use
    plan.run(steps=20)["measured_speedup_vs_dp"]     # timed beside data parallelism, as tag-deploy --run does
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tag.cluster.topology import Topology, format_topology, load_topology
from tag.cost.model import CostModel, Profile
from tag.cost.precision import check_plan_precision
from tag.cost.speeds import device_speeds
from tag.errors import GraphError, StrategyError, TagError
from tag.files import decode_json, finite, read_input_file, write_atomic
from tag.report import build_report, pipeline_fields
from tag.sim import Simulator
from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
from tag.strategy.grouping import group_ops
from tag.strategy.types import Grouping, Strategy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.backend.rewrite import RewriteResult
    from tag.backend.rewrite.programs import HostProgram
    from tag.ir.types import TrainingGraph

__all__ = ["Analysis", "Plan", "load_strategy", "make_plan", "plan_for", "plan_report", "prepare", "prepare_loaded",
           "strategy_report",
           "DEFAULT_GROUPS", "PLAN_FORMAT", "PLAN_VERSION"]

PLAN_FORMAT = "tag-plan"
PLAN_VERSION = 2
GRAPH_FILE, STRATEGY_FILE, REPORT_FILE, PLAN_FILE = "graph.pb", "strategy.pb", "report.json", "plan.json"
TOPOLOGY_FILE = "topology.pbtxt"
DEFAULT_GROUPS = 64
_MAX_FILE_BYTES = 2 << 30


@dataclass
class Plan:
    """A training step, the strategy chosen for it on a cluster, and how it was chosen (module docstring).

    ``step_graph``: the training step the plan was made for (the user's GraphDef with its entry points found and
    the precision applied): what a plan directory keeps, and what every host builds its program from.
    ``strategy``: the chosen ``Strategy``. ``cluster``: the ``Topology`` it was made for (``topology`` is its
    name). ``predicted_step_time``: seconds. ``baselines``: name -> predicted seconds of every built-in strategy
    and of each search step (``best_uniform``, ``mcts``). ``train_op`` / ``loss`` / ``init``: the step's entry
    points (the same names in the rewritten step). ``inputs``: its batch inputs (full global batches).
    ``method``: which step found the strategy. ``candidates``: name -> the best strategy of each search step and
    each built-in (a plan made by a search in this process; not saved), what the measured tuning step
    (``tag.tune``) chooses from.

    Each host runs a program of its own: ``plan.program(host)`` (a host name or task index) builds it on first
    use. ``plan.graph_def`` is the rewritten step as one graph where that is one program: a plan placed on one
    host (one device, or several devices of one machine); a plan over several hosts has no such graph.
    """

    step_graph: Any = field(repr=False)
    strategy: "Strategy" = field(repr=False)
    predicted_step_time: float
    baselines: dict[str, float]
    train_op: str
    loss: str | None
    init: str | None
    batch_size: int
    cluster: "Topology" = field(repr=False)
    inputs: list[str] = field(default_factory=list)
    method: str = ""
    notes: list[str] = field(default_factory=list)
    _report: dict = field(default_factory=dict, repr=False)
    precision: str = "fp32"
    xla: bool = False
    analysis: "Analysis | None" = field(default=None, repr=False, compare=False)   # not saved
    candidates: dict = field(default_factory=dict, repr=False, compare=False)      # not saved
    _rewritten: Any = field(default=None, repr=False, compare=False)                # built on first use

    @property
    def topology(self) -> str:
        """The name of the cluster the plan was made for."""
        return self.cluster.name

    def report(self) -> dict:
        """The plan's report: a JSON-serialisable dict (keys in ``tag.report``; a copy)."""
        return copy.deepcopy(self._report)

    def trace(self) -> dict:
        """The simulated step as a Chrome trace (chrome://tracing, Perfetto); needs ``analysis`` (a plan
        made in this process, not a loaded one)."""
        if self.analysis is None:
            raise TagError("a loaded plan has no analysis to simulate; run tag.optimize again for a trace")
        return self.analysis.simulator().trace(self.strategy, batch_size=self.batch_size)

    # -- programs ---------------------------------------------------------------------------------
    @property
    def rewritten(self) -> "RewriteResult":
        """The step rewritten for the strategy (``tag.backend.rewrite.RewriteResult``; built on first use)."""
        if self._rewritten is None:
            self._rewritten = rewrite_step(self.step_graph, self.strategy, self.cluster, batch_size=self.batch_size,
                                           train_op=self.train_op, loss=self.loss, init=self.init, xla=self.xla)
        return self._rewritten

    def programs(self) -> "dict[str, HostProgram]":
        """Host name -> that host's program (``tag.backend.rewrite.programs.HostProgram``), every host of the
        cluster (a host the strategy leaves idle gets an empty one)."""
        return self.rewritten.programs()

    def program(self, host: "str | int") -> "HostProgram":
        """HOST's program (a host name or task index); TagError naming the plan's hosts for one it lacks.

        Example::

            p = plan.program("cpu1")            # or plan.program(1)
            p.graph_def, p.step_op, p.init_op, p.loss, p.inputs
        """
        if isinstance(host, bool) or not isinstance(host, (str, int, np.integer)):
            raise TagError(f"host must be a host name or a task index, got {type(host).__name__}")
        return self.rewritten.program(int(host) if isinstance(host, np.integer) else host)

    @property
    def hosts(self) -> list[str]:
        """The cluster's hosts, in task order."""
        return [h.name for h in sorted(self.cluster.hosts, key=lambda h: h.task_index)]

    @property
    def graph_def(self) -> Any:
        """The rewritten step as one graph, for a plan on one host (run ``train_op``, ``loss`` and ``init`` in it);
        TagError for a plan over several hosts, where each host runs its own program (``program(host)``)."""
        rr = self.rewritten
        from tag.backend.rewrite.programs import task_of
        tasks = {task_of(d) for d in rr.devices}
        if len(tasks) > 1:
            raise TagError(f"this plan runs on {len(tasks)} hosts, each its own program: plan.program(host) gives one "
                           f"({', '.join(self.hosts)}); tag.train, tag-deploy --run and tag-worker --plan run them all")
        return rr.graph_def

    @property
    def fingerprint(self) -> str:
        """A digest of what the plan runs (the step, the strategy, the cluster, the batch and how it is compiled):
        every host checks it before a run, so hosts given different plans stop instead of waiting on each other."""
        return _fingerprint(self.step_graph.SerializeToString(deterministic=True),
                            self.strategy.to_proto().SerializeToString(deterministic=True),
                            format_topology(self.cluster), self._meta_for_fingerprint())

    def _meta_for_fingerprint(self) -> dict:
        return {"train_op": self.train_op, "loss": self.loss, "init": self.init, "batch_size": int(self.batch_size),
                "precision": self.precision, "xla": bool(self.xla)}

    # -- timing -----------------------------------------------------------------------------------
    def run(self, steps: int = 20, warmup: int = 3, *, topology: "Topology | str | os.PathLike | None" = None,
            target: str | None = None, step_timeout_s: float | None = 600.0,
            progress: "Callable[[str, Any], None] | None" = None) -> dict[str, Any]:
        """Time the plan beside tag's data parallelism on synthetic batches, as ``tag-deploy --run`` does, and
        return the report's ``measured_*`` keys (``tag.report.measured_fields``): the mean step time after
        WARMUP steps of STEPS, dp_allreduce's (timed for at most ``BASELINE_MAX_STEPS``), the speedup, the losses.

        The cluster: TOPOLOGY (default: the one the plan was made for), whose loopback hosts are started here and
        whose remote hosts must run ``tag-worker``; TARGET (a running cluster's ``grpc://host:port``) says its
        servers run already. No step waits past STEP_TIMEOUT_S. PROGRESS(name, RunEvent) hears every phase and
        step of both runs (name: the plan's method, then "dp_allreduce").

        Example::

            plan = tag.Plan.load("plan/")
            fields = plan.run(steps=20, warmup=3)
            print(fields["measured_step_time_s"], fields["measured_speedup_vs_dp"])
        """
        from tag.backend.runtime.guard import RunControl
        from tag.backend.runtime.measure import reach_cluster, run_on
        from tag.report import BASELINE_MAX_STEPS, measured_fields
        for key, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise TagError(f"{key} must be an integer >= {low}, got {value!r}")
        if warmup >= steps:
            raise TagError(f"warmup must be below steps ({steps}), got {warmup}")
        name = self.method or "plan"
        runs = [(name, self.rewritten, int(steps))]
        if name != "dp_allreduce":
            baseline_steps = min(int(steps), BASELINE_MAX_STEPS)
            runs.append(("dp_allreduce", self._baseline_rewrite(), baseline_steps))
        setup_s = max(step_timeout_s or 0.0, 120.0) if step_timeout_s else None
        results = []
        with reach_cluster(_topology(topology) if topology is not None else self.cluster, target) as cluster:
            for label, rewritten, n in runs:
                control = RunControl(step_timeout_s=step_timeout_s, setup_timeout_s=setup_s,
                                     watchdog=cluster.watchdog)
                if progress is not None:
                    control.progress = functools.partial(progress, label)
                results.append(run_on(cluster, rewritten, steps=n, warmup=min(int(warmup), n - 1), control=control))
        return measured_fields(results[0], results[-1])

    def _baseline_rewrite(self) -> "RewriteResult":
        """The plan's step rewritten for dp_allreduce on its cluster (for a loaded plan, batch shares by the
        built-in device speeds: a saved plan keeps no cost profile)."""
        analysis = self.analysis if self.analysis is not None else prepare_loaded(self)
        return analysis.rewrite(analysis.builtin("dp_allreduce"))

    # -- files ------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> str:
        """Write the plan into DIRECTORY (created if needed): the step, the strategy, the cluster, the report and
        the plan's description; returns its path. Every host builds its own program from these files."""
        directory = os.fspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise TagError(f"{directory}: exists and is not a directory")
        os.makedirs(directory, exist_ok=True)
        graph = self.step_graph.SerializeToString(deterministic=True)
        strategy = self.strategy.to_proto().SerializeToString(deterministic=True)
        cluster = format_topology(self.cluster)
        meta = {"format": PLAN_FORMAT, "version": PLAN_VERSION, **self._meta_for_fingerprint(),
                "fingerprint": _fingerprint(graph, strategy, cluster, self._meta_for_fingerprint()),
                "inputs": list(self.inputs), "topology": self.topology, "hosts": self.hosts, "method": self.method,
                "model": self._report.get("model", ""), "predicted_step_time_s": float(self.predicted_step_time),
                "notes": list(self.notes)}
        files = {GRAPH_FILE: graph, STRATEGY_FILE: strategy, TOPOLOGY_FILE: cluster.encode(),
                 REPORT_FILE: _json_text(self._report).encode(), PLAN_FILE: _json_text(meta).encode()}
        for name, data in files.items():      # the description last: a plan is complete once it is there
            write_atomic(os.path.join(directory, name), data)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Plan":
        """Read a plan written by ``save``; TagError naming the file that is missing or bad, or saying to re-save a
        plan an earlier tag wrote."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise TagError(f"{directory}: not a plan directory (expected {PLAN_FILE}, {GRAPH_FILE}, ...)")
        meta = _read_plan_json(os.path.join(directory, PLAN_FILE))
        report = _read_json(os.path.join(directory, REPORT_FILE), "plan report")
        if not isinstance(report, dict):
            raise TagError(f"{os.path.join(directory, REPORT_FILE)}: expected a JSON object")
        strategy = _read_strategy(os.path.join(directory, STRATEGY_FILE))
        graph_def = _read_graph_def(os.path.join(directory, GRAPH_FILE))
        cluster_path = os.path.join(directory, TOPOLOGY_FILE)
        cluster = load_topology(cluster_path)
        nodes = {n.name for n in graph_def.node}
        for key in ("train_op", "loss", "init"):
            if meta[key] is not None and meta[key] not in nodes:
                raise TagError(f"{os.path.join(directory, PLAN_FILE)}: {key} {meta[key]!r} is not in {GRAPH_FILE}")
        baselines = report.get("baselines") or {}
        plan = cls(graph_def, strategy, float(meta["predicted_step_time_s"]),
                   {str(k): (float(v) if v is not None else float("inf")) for k, v in baselines.items()},
                   meta["train_op"], meta["loss"], meta["init"], int(meta["batch_size"]), cluster,
                   list(meta.get("inputs", [])), str(meta.get("method", "")), list(meta.get("notes", [])), report,
                   str(meta.get("precision", "fp32")), bool(meta.get("xla", False)))
        if plan.fingerprint != meta["fingerprint"]:
            raise TagError(f"{directory}: its files changed after the plan was saved (fingerprint "
                           f"{plan.fingerprint[:12]}, saved {str(meta['fingerprint'])[:12]}); save the plan again")
        return plan


def _fingerprint(graph: bytes, strategy: bytes, cluster: str, meta: dict) -> str:
    digest = hashlib.sha256()
    for part in (graph, strategy, cluster.encode(), json.dumps(meta, sort_keys=True).encode()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def rewrite_step(step_graph: Any, strategy: "Strategy", cluster: "Topology", *, batch_size: int, train_op: str,
                 loss: str | None, init: str | None, xla: bool = False, graph: "TrainingGraph | None" = None,
                 ) -> "RewriteResult":
    """STEP_GRAPH (a plan's step) rewritten for STRATEGY on CLUSTER at BATCH_SIZE (``tag.backend.rewrite``), its
    XLA-costed ops marked for XLA when XLA; GRAPH: the step's IR when already analysed."""
    from tag.backend.rewrite import rewrite as rewrite_graph
    from tag.frontend.analyze import analyze
    ir = graph if graph is not None else analyze(step_graph, batch_size=batch_size)
    rr = rewrite_graph(step_graph, ir, strategy, cluster, batch_size=batch_size, train_op=train_op, loss=loss,
                       init=init)
    if xla:      # the deployed graph fuses what the cost model costs as fused
        from tag.frontend.precision import mark_for_xla
        mark_for_xla(rr.graph_def)
    return rr


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
            self._simulator = Simulator(self.graph, self.topology, self.grouping, self.cost_model)
        return self._simulator

    def builtin(self, name: str) -> "Strategy":
        """The built-in strategy NAME for this graph and topology."""
        return builtin_strategy(name, self.graph, self.topology, self.grouping, self.cost_model,
                                device_speeds(self.cost_model, self.batch))

    def rewrite(self, strategy: "Strategy") -> "RewriteResult":
        """The graph rewritten for STRATEGY (entry points as found or given)."""
        return rewrite_step(self.graph_def, strategy, self.topology, batch_size=self.batch,
                            train_op=self.entry.train_op, loss=self.entry.loss, init=self.entry.init, xla=self.xla,
                            graph=self.graph)


def prepare(graph_def: Any, topology: "Topology | str | os.PathLike", *, batch_size: int | None = None,
            profile: "Profile | str | os.PathLike | None" = None, groups: int = DEFAULT_GROUPS,
            grouping: "Grouping | None" = None, train_op: str | None = None, loss: str | None = None,
            init: str | None = None, name: str | None = None, precision: str | None = None,
            xla: bool = False) -> Analysis:
    """Entry points, IR, topology, op groups (``groups`` of them, or GROUPING as given: a saved strategy's)
    and cost model of GRAPH_DEF on TOPOLOGY; arguments as for ``tag.optimize``."""
    from tag.frontend.entry_points import find_entry_points
    from tag.frontend.graph_import import coerce_graph_def
    from tag.frontend.precision import apply_precision
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise TagError(f"groups must be a positive integer, got {groups!r}")
    precision = check_plan_precision(precision)
    topo = _topology(topology)
    prof, prof_source = _profile(profile)
    gd = coerce_graph_def(graph_def)
    entry = find_entry_points(gd, train_op=train_op, loss=loss, init=init)
    gd = entry.apply(gd)
    gd = apply_precision(gd, precision, train_op=entry.train_op, loss=entry.loss, init=entry.init)
    return _prepared(gd, entry, topo, prof, prof_source, batch_size=batch_size, groups=groups, grouping=grouping,
                     name=name, precision=precision, xla=xla)


def prepare_loaded(plan: Plan, topology: "Topology | str | os.PathLike | None" = None, *,
                   profile: "Profile | str | os.PathLike | None" = None, batch_size: int | None = None,
                   name: str | None = None, xla: bool | None = None) -> Analysis:
    """The Analysis of a loaded PLAN's step, as ``prepare`` made it when the plan was made (its entry points, its
    precision already applied, the strategy's op groups), on TOPOLOGY (default: the plan's cluster): for
    predicting or running a saved plan again without the model it was made from (``tag-deploy --strategy-file
    DIR`` without ``--model``). PROFILE, BATCH_SIZE, NAME (default: the report's model) and XLA as for
    ``prepare``; BATCH_SIZE and XLA default to the plan's.

    Example::

        analysis = prepare_loaded(tag.Plan.load("plan/"))
        strategy_report(analysis, tag.Plan.load("plan/").strategy)
    """
    from tag.frontend.entry_points import find_entry_points
    entry = find_entry_points(plan.step_graph, train_op=plan.train_op, loss=plan.loss, init=plan.init)
    prof, prof_source = _profile(profile)
    return _prepared(plan.step_graph, entry, _topology(topology) if topology is not None else plan.cluster, prof,
                     prof_source, batch_size=batch_size or plan.batch_size, groups=DEFAULT_GROUPS,
                     grouping=plan.strategy.grouping, name=name or plan._report.get("model") or None,
                     precision=plan.precision, xla=plan.xla if xla is None else xla)


def _prepared(gd: Any, entry: Any, topo: "Topology", prof: "Profile | None", prof_source: str | None, *,
              batch_size: int | None, groups: int, grouping: "Grouping | None", name: str | None, precision: str,
              xla: bool) -> Analysis:
    """``prepare``'s second half: GD (the step, its entry points ENTRY and precision applied) analysed, grouped
    and costed on TOPO."""
    from tag.frontend.analyze import analyze
    graph = analyze(gd, batch_size=batch_size, name=name or "")
    batch = int(batch_size if batch_size is not None else graph.batch_size)
    if batch < topo.num_devices:
        raise TagError(f"the global batch {batch} is smaller than the {topo.num_devices} devices of "
                       f"{topo.name}; data parallelism needs at least one example per device (a larger batch: "
                       "batch_size= in tag.optimize, --batch-size in tag-deploy)")
    if grouping is None:
        grouping = group_ops(graph, target_groups=int(groups))
    elif len(grouping.group_of_op) != len(graph.ops):
        raise StrategyError(f"the strategy was made for a graph of {len(grouping.group_of_op)} ops; this graph "
                            f"has {len(graph.ops)} (another model, or another batch size?)")
    model = name or graph.name or "model"
    cost_model = CostModel(graph, topo, prof, tf32=precision == "tf32", xla=bool(xla))
    return Analysis(model, gd, entry, graph, topo, grouping, cost_model, batch, prof_source, precision, bool(xla))


def _topology(topology: Any) -> "Topology":
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, bytes, os.PathLike)):
        return load_topology(topology)
    raise TagError(f"topology must be a tag.Topology or a path to a .pbtxt file, got {type(topology).__name__}")


def _profile(profile: Any) -> tuple["Profile | None", str | None]:
    if profile is None or isinstance(profile, Profile):
        return profile, (profile.source or "given") if profile is not None else None
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile), os.fspath(profile)
    raise TagError(f"profile must be a tag Profile, a path to a profile JSON file or None, "
                   f"got {type(profile).__name__}")


# ------------------------------------------------------------------------------------------------ a given strategy
def strategy_report(analysis: Analysis, strategy: "Strategy | str", *, name: str | None = None,
                    ) -> tuple[str, "Strategy", dict]:
    """Simulate a given STRATEGY (a Strategy or a built-in name) beside the built-ins, without search or
    rewrite: (its name in the report, the Strategy, the report). NAME labels it (default: the strategy's
    name, or "given")."""
    if isinstance(strategy, str):
        name, strategy = strategy, analysis.builtin(strategy)
    name = name or strategy.name or "given"
    sim = analysis.simulator()
    results = {n: sim.evaluate(analysis.builtin(n), batch_size=analysis.batch) for n in BUILTIN_STRATEGIES}
    results.setdefault(name, sim.evaluate(strategy, batch_size=analysis.batch))
    sfb_fields = {}
    if strategy.sfb:
        plain = sim.evaluate(dataclasses.replace(strategy, sfb=[]), batch_size=analysis.batch)
        applied = sim.sfb.plan(strategy, strategy.actions, sim.layouts, analysis.batch).variables
        sfb_fields = {"sfb_gradients": list(applied),
                      "sfb_bytes_saved": int(round(plain.comm_bytes - results[name].comm_bytes))}
    report = plan_report(analysis, name, results, {n: float(r.step_time) for n, r in results.items()},
                         {n: bool(r.feasible) for n, r in results.items()},
                         {"search_seconds": 0.0, "evaluations": len(results), "method": name,
                          "reference": "dp_allreduce", "notes": [], **sfb_fields,
                          **pipeline_fields(strategy, analysis.topology, results[name])})
    return name, strategy, report


def plan_for(analysis: Analysis, strategy: "Strategy | str", *, name: str | None = None) -> Plan:
    """A Plan for a given STRATEGY (``strategy_report``, then the graph rewritten for it)."""
    _, strategy, report = strategy_report(analysis, strategy, name=name)
    return make_plan(analysis, strategy, report)


def make_plan(analysis: Analysis, strategy: "Strategy", report: dict) -> Plan:
    """The Plan of STRATEGY with REPORT (``plan_report``'s keys): the step rewritten and cut into its hosts'
    programs (so that what cannot be deployed fails here), the notes of both."""
    rr = analysis.rewrite(strategy)
    programs = rr.programs()
    report["rewritten"] = {"train_op": rr.train_op, "loss": rr.loss, "init": rr.init, "inputs": list(rr.inputs),
                           "nodes": len(rr.graph_def.node),
                           "nodes_per_host": {name: p.nodes for name, p in programs.items()}}
    notes = list(report["notes"]) + list(rr.notes)
    plan = Plan(analysis.graph_def, strategy, float(report["predicted_step_time_s"]), dict(report["baselines"]),
                rr.train_op, rr.loss, rr.init, analysis.batch, analysis.topology, list(rr.inputs),
                report["method"], notes, report, analysis.precision, analysis.xla)
    plan.analysis = analysis
    plan._rewritten = rr
    return plan


# ------------------------------------------------------------------------------------------------ report
def plan_report(analysis: Analysis, name: str, results: dict, baselines: dict, feasible: dict,
                 extra: dict) -> dict:
    """The plan report: tag.report's keys for strategy NAME (RESULTS: name -> SimResult, with NAME and the built-ins),
    every compared strategy's time (BASELINES, FEASIBLE) and what EXTRA adds."""
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
    return json.dumps(finite(obj), indent=2) + "\n"


def _read_bytes(path: str, what: str) -> bytes:
    return read_input_file(path, what=what, limit=_MAX_FILE_BYTES)


def _read_json(path: str, what: str) -> Any:
    return decode_json(_read_bytes(path, what), path, not_text=f"not UTF-8 text ({what})", not_json="not valid JSON")


def _read_plan_json(path: str) -> dict:
    meta = _read_json(path, "plan description")
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT:
        raise TagError(f"{path}: not a tag plan description (no \"format\": \"{PLAN_FORMAT}\")")
    if meta.get("version") == 1:
        raise TagError(f"{os.path.dirname(path) or '.'}: a plan saved by an earlier tag (format 1, one graph for the "
                       f"whole cluster); this tag runs a program per host: make and save the plan again "
                       f"(tag-deploy ... --save-plan DIR, or plan.save(DIR))")
    if meta.get("version") != PLAN_VERSION:
        raise TagError(f"{path}: unsupported plan version {meta.get('version')!r} (this tag reads {PLAN_VERSION})")
    if not isinstance(meta.get("fingerprint"), str):
        raise TagError(f"{path}: 'fingerprint' is missing or has the wrong type")
    for key, types in (("train_op", (str,)), ("loss", (str, type(None))), ("init", (str, type(None))),
                       ("batch_size", (int,)), ("topology", (str,)), ("predicted_step_time_s", (int, float))):
        if not isinstance(meta.get(key), types) or isinstance(meta.get(key), bool):
            raise TagError(f"{path}: {key!r} is missing or has the wrong type")
    if meta["batch_size"] < 1:
        raise TagError(f"{path}: batch_size must be positive, got {meta['batch_size']}")
    return meta


def _read_strategy(path: str) -> "Strategy":
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
