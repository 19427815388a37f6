"""The report of a plan: simulate the built-in strategies, collect the report keys (ARCHITECTURE.md), print a table.

``tag-deploy`` builds its ``--json`` report and its printed summary here, and ``tag.optimize``'s
``Plan.report()`` can reuse the same functions. numpy only (strategy and simulator stages); no
TensorFlow import.

Example::

    import tag
    from tag.cost import CostModel
    from tag.report import build_report, format_table, predict, report_json
    from tag.strategy import group_ops

    topo = tag.load_topology("topologies/localhost.pbtxt")
    graph = tag.analyze(tag.zoo.training_graph("mlp", batch_size=64))
    grouping = group_ops(graph, target_groups=64)
    pred = predict(topo, graph, grouping, CostModel(graph, topo), batch=64)
    report = build_report("mlp", topo, grouping, "dp_allreduce", pred["results"], batch=64)
    print(format_table(report, "zoo:mlp"))
    text = report_json(report)          # strict JSON: inf/nan become null
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from tag.cost.model import device_profiles
from tag.cost.speeds import device_speeds
from tag.files import finite
from tag.sim import Simulator
from tag.strategy import BUILTIN_STRATEGIES, builtin_strategy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.backend.runtime import RunResult
    from tag.cluster.topology import Topology
    from tag.cost.model import CostModel
    from tag.ir.types import TrainingGraph
    from tag.sim.result import SimResult
    from tag.strategy.types import Grouping, Strategy


# ----------------------------------------------------------------------------------------------
# Numbers for people and for strict JSON
# ----------------------------------------------------------------------------------------------

def report_json(report: dict) -> str:
    """REPORT as indented strict JSON text, ending in a newline."""
    return json.dumps(finite(report), indent=2) + "\n"


def format_time(s: float) -> str:
    """Seconds as "12.34 ms" (below 10 s), "12.34 s", or "inf"."""
    if not np.isfinite(s):
        return "inf"
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def format_bytes(b: float) -> str:
    """Bytes in the largest binary unit it reaches: "1.5 GiB", "12.0 KiB", "512 B"."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


# ----------------------------------------------------------------------------------------------
# Prediction and the report dict
# ----------------------------------------------------------------------------------------------

def predict(topology: "Topology", graph: "TrainingGraph", grouping: "Grouping", cost_model: "CostModel",
            batch: int) -> dict[str, Any]:
    """Simulate every built-in strategy; returns {"strategies": {name: Strategy}, "results": {name: SimResult},
    "simulator": Simulator}."""
    sim = Simulator(graph, topology, grouping, cost_model)
    speeds = device_speeds(cost_model, batch)
    strategies, results = {}, {}
    for name in BUILTIN_STRATEGIES:
        s = builtin_strategy(name, graph, topology, grouping, cost_model, speeds)
        strategies[name] = s
        results[name] = sim.evaluate(s, batch_size=batch)
    return {"strategies": strategies, "results": results, "simulator": sim}


def build_report(model: str, topology: "Topology", grouping: "Grouping", strategy_name: str, results: dict,
                 batch: int, cost_model: "CostModel | None" = None) -> dict:
    """The report dict (the report keys plus the strategy and per-device details).

    RESULTS is {strategy name: SimResult} and must hold STRATEGY_NAME and "dp_allreduce". COST_MODEL (the
    one the predictions used) names the profile serving each device type (``device_profiles``).
    """
    r = results[strategy_name]
    names = [d.name for d in topology.devices]
    step = float(r.step_time)
    dp = float(results["dp_allreduce"].step_time)
    peak = np.asarray(r.peak_memory, dtype=np.float64)
    util = np.asarray(r.utilisation, dtype=np.float64)
    return {
        "model": model,
        "topology": topology.name,
        "strategy": strategy_name,
        "batch_size": int(batch),
        "devices": topology.num_devices,
        "groups": grouping.num_groups,
        "predicted_step_time_s": step,
        "baselines": {n: float(res.step_time) for n, res in results.items()},
        "baselines_feasible": {n: bool(res.feasible) for n, res in results.items()},
        "speedup_vs_dp": (dp / step) if step > 0 else None,
        "search_seconds": 0.0,
        "peak_memory_bytes": {n: int(round(float(b))) for n, b in zip(names, peak, strict=True)},
        "memory_capacity_bytes": {d.name: int(d.memory_bytes) for d in topology.devices},
        "utilisation": {n: float(u) for n, u in zip(names, util, strict=True)},
        "communication_bytes": float(r.comm_bytes),
        "feasible": bool(r.feasible),
        "oom_devices": [names[int(d)] if not isinstance(d, str) else d for d in r.oom_devices],
        "sfb_gradients": [],
        "device_profiles": device_profiles(topology, cost_model),
    }


def pipeline_fields(strategy: "Strategy", topology: "Topology", result: "SimResult | None" = None) -> dict:
    """The report's ``pipeline`` key for a pipelined STRATEGY ({} otherwise): per stage its op groups (first
    and last name, indices) and devices, M, the schedule, the ideal bubble (S - 1) / (M + S - 1) and the
    simulator's predicted bubble (RESULT)."""
    p = strategy.pipeline
    if p is None:
        return {}
    names = strategy.grouping.names
    stages = []
    for st in p.stages:
        first, last = names[st.groups[0]], names[st.groups[-1]]
        stages.append({"groups": f"{first} .. {last}" if len(st.groups) > 1 else first,
                       "group_indices": [int(g) for g in st.groups],
                       "devices": [topology.devices[d].name for g in st.placement for d in topology.groups[g].devices],
                       "mode": st.mode})
    predicted = None if result is None or result.bubble_fraction is None else float(result.bubble_fraction)
    return {"pipeline": {"stages": stages, "micro_batches": p.micro_batches, "schedule": p.schedule,
                         "bubble_fraction_ideal": p.bubble_fraction(), "bubble_fraction_predicted": predicted}}


def oom_stages(report: dict) -> list[int]:
    """The pipeline stages (of the report's ``pipeline``) holding a device that runs out of memory."""
    oom = set(report.get("oom_devices") or ())
    return [i for i, st in enumerate((report.get("pipeline") or {}).get("stages", ())) if oom & set(st["devices"])]


def _pipeline_lines(report: dict) -> list[str]:
    """The pipeline block of the printed table (empty for strategies without a pipeline)."""
    p = report.get("pipeline")
    if not p:
        return []
    bubble = p.get("bubble_fraction_predicted")
    lines = [f"pipeline             {len(p['stages'])} stages, {p['micro_batches']} micro-batches, schedule "
             f"{p['schedule']}, predicted bubble "
             f"{'n/a' if bubble is None else f'{bubble * 100:.1f}%'} (ideal {p['bubble_fraction_ideal'] * 100:.1f}%)"]
    for i, st in enumerate(p["stages"]):
        lines.append(f"  stage {i}: {st['groups']} ({len(st['group_indices'])} op groups) on "
                     f"{', '.join(st['devices'])}" + (f" [{st['mode']}]" if st["mode"] != "allreduce" else ""))
    return lines


#: a measured run times the dp_allreduce baseline for at most this many steps (it is timed, not trained)
BASELINE_MAX_STEPS = 20


def measured_fields(mine: "RunResult", baseline: "RunResult") -> dict[str, Any]:
    """The report keys of a measured run: the plan (MINE) beside the dp_allreduce BASELINE on TensorFlow
    (``tag-deploy --run``, ``Plan.run``)."""
    return {"measured_step_time_s": mine.mean_step_time_s,
            "measured_baseline_step_time_s": baseline.mean_step_time_s,
            "measured_speedup_vs_dp": baseline.mean_step_time_s / mine.mean_step_time_s,
            "measured_steps": len(mine.step_times), "measured_warmup_steps": mine.warmup,
            "measured_losses": [float(x) for x in mine.losses], "measured_start_step": mine.start_step,
            "measured_baseline_steps": len(baseline.step_times)}


def format_tune(fields: Mapping[str, Any]) -> list[str]:
    """The report's ``tune`` keys (``tag.tune.tune_fields``) as lines: a header, then per candidate its
    predicted and measured step time (median +- MAD), the simulator's error and why it was measured."""
    kept = fields["kept"]
    verdict = "the plan" if kept == fields["plan"] else f"{kept}, overriding the simulator's {fields['plan']}"
    extra = fields.get("extra_rounds", 0)
    extra_text = f" (+{extra} of those within the noise)" if extra else ""
    lines = [f"measured {len(fields['candidates'])} candidates in {fields['rounds']} interleaved rounds"
             f"{extra_text} of {fields['warmup_per_round']}+{fields['steps_per_round']} steps "
             f"({fields['seconds']:.1f} s); "
             f"kept {verdict}"]
    width = max(len(r["name"]) for r in fields["candidates"])
    for r in fields["candidates"]:
        why = ", ".join(r["roles"] + ([f"same as {', '.join(r['aliases'])}"] if r["aliases"] else []))
        mark = "  <- kept" if r["name"] == kept else ""
        lines.append(f"  {r['name']:<{width}}  predicted {format_time(r['predicted_ms'] / 1e3):>10}  measured "
                     f"{format_time(r['measured_ms'] / 1e3):>10} +- {format_time(r['mad_ms'] / 1e3):>9}  "
                     f"({r['error'] * 100:+.0f}%, {r['steps']} steps){'  ' + why if why else ''}{mark}")
    return lines


# ----------------------------------------------------------------------------------------------
# The printed table
# ----------------------------------------------------------------------------------------------

def _device_lines(report: dict) -> list[str]:
    """One line per device: memory used / capacity, utilisation, OOM flag."""
    width = max([len("device")] + [len(n) for n in report["peak_memory_bytes"]])
    lines = [f"{'device':<{width}}  {'memory used / capacity':>28}  {'util':>6}"]
    for name, used in report["peak_memory_bytes"].items():
        cap = report["memory_capacity_bytes"][name]
        flag = "  OOM" if name in report["oom_devices"] else ""
        mem = f"{format_bytes(used)} / {format_bytes(cap)}"
        lines.append(f"{name:<{width}}  {mem:>28}  {report['utilisation'][name] * 100:5.1f}%{flag}")
    return lines


def _measured_lines(report: dict) -> list[str]:
    """The measured-on-TensorFlow block (empty when the report has no measurement)."""
    if "measured_step_time_s" not in report:
        return []
    lines = ["", f"measured on TensorFlow ({report['measured_steps']} steps, "
                 f"{report['measured_warmup_steps']} warm-up):",
             f"  {report['strategy']:<14} {format_time(report['measured_step_time_s']):>12}"]
    if report["strategy"] != "dp_allreduce":
        lines.append(f"  {'dp_allreduce':<14} {format_time(report['measured_baseline_step_time_s']):>12}")
    lines.append(f"measured speedup vs dp_allreduce: {report['measured_speedup_vs_dp']:.3g}x")
    return lines


def _search_lines(report: dict) -> list[str]:
    """How the plan was found: the search's figures and notes, or the file a saved strategy came from, and
    ``--tune``'s measurements."""
    lines = []
    if report.get("search_seconds"):
        lines.append(f"search               {report.get('evaluations', 0)} strategies simulated in "
                     f"{report['search_seconds']:.2f} s; the plan is {report.get('method', report['strategy'])!r}")
    if report.get("strategy_file"):
        lines.append(f"strategy file        {report['strategy_file']}")
    if report.get("tune"):
        first, *rest = format_tune(report["tune"])
        lines += [f"tune                 {first}", *rest]
    return lines + [f"  note: {n}" for n in report.get("notes", [])]


def _strategy_lines(report: dict) -> list[str]:
    """Every strategy compared: predicted step time, speedup over dp_allreduce, this plan, out of memory."""
    dp = report["baselines"].get("dp_allreduce")
    lines = ["strategies (predicted step time, speedup vs dp_allreduce):"]
    width = max([14] + [len(n) for n in report["baselines"]])
    for name, t in report["baselines"].items():
        notes = []
        if name == report["strategy"]:
            notes.append("this plan")
        if not report["baselines_feasible"].get(name, True):
            notes.append("out of memory")
        fast = f"{dp / t:7.3g}x" if dp is not None and t and np.isfinite(t) and np.isfinite(dp) else "    n/a"
        lines.append(f"  {name:<{width}} {format_time(t):>12} {fast}{'   (' + ', '.join(notes) + ')' if notes else ''}")
    return lines


def _cost_model_line(report: dict) -> str:
    """Which profile served which device type (``profile_use``: device type -> what served it)."""
    use = report.get("profile_use")
    if not report.get("profile"):
        return "cost model           no profile file (calibrate: tag-profile --model ...)"
    if not use:
        return f"cost model           profile {report['profile']}"
    served = "; ".join(f"{dtype}: {how}" for dtype, how in use.items())
    unused = "" if any(how != "built-in defaults" for how in use.values()) else \
        "   (the profile matches no device type)"
    return f"cost model           {served}{unused}"


def format_table(report: dict, model_spec: str, *, measured: bool = True) -> str:
    """The human-readable summary tag-deploy prints (a prediction, a given strategy or a searched plan); its
    first line says what was costed (precision, XLA). MEASURED: with the measured block (``format_measured``)."""
    xla = ", XLA" if report.get("xla") else ""
    lines = [f"{report['model']} ({model_spec}) on {report['topology']}: {report['devices']} devices, "
             f"batch {report['batch_size']}, {report['groups']} op groups, strategy {report['strategy']}, "
             f"precision {report.get('precision') or 'fp32'}{xla}",
             f"predicted step time  {format_time(report['predicted_step_time_s'])}"
             f"{'' if report['feasible'] else '   (OUT OF MEMORY on ' + ', '.join(report['oom_devices']) + ')'}",
             f"communication        {format_bytes(report['communication_bytes'])} per step",
             _cost_model_line(report)]
    for dtype, source in (report.get("device_profiles") or {}).items():
        lines.append(f"  {dtype:19}{source}")
    lines += _pipeline_lines(report)
    lines += _search_lines(report) + [""]
    lines += _device_lines(report)
    lines += [""] + _strategy_lines(report)
    sp = report["speedup_vs_dp"]
    lines.append(f"speedup vs dp_allreduce: {sp:.3g}x" if sp is not None else "speedup vs dp_allreduce: n/a")
    if measured:
        lines += _measured_lines(report)
    return "\n".join(lines)


def format_measured(report: dict) -> str:
    """The measured-on-TensorFlow block of the summary ("" without a measurement): what ``tag-deploy --run``
    prints after the run, the table having been printed before it."""
    return "\n".join(_measured_lines(report)).lstrip("\n")
