"""Benchmark the strategy search: every zoo model x every ready topology x a small and a large global batch.

For each case it prints the predicted step time of every built-in strategy, of the best uniform action
(one candidate for every op group), of PaSE DP, of random search (at the tree search's evaluation
count), of MCTS alone and of the full search (``tag.search.search``: all of them plus refinement), the
speedups of the full search over data parallelism and over the best uniform action, and the search
seconds (IR building excluded). The small batch is 4 examples per device; the large one 64 per device
for CNNs and MLPs, 16 sequences per device for transformers, halved until some strategy fits in memory.

Heterogeneous topologies (more than one device type, or unequal links between hosts) make the headline
figures: ``geomean_speedup_vs_dp_heterogeneous``, ``geomean_speedup_vs_best_uniform_heterogeneous``, and
``cases_below_a_baseline`` (cases where the search's answer is slower than a feasible built-in or the
best uniform action; must be 0). With ``--mixed`` every heterogeneous case is searched again on the graph
after TensorFlow's ``mixed_float16`` rewrite (``tag.frontend.precision``) and
``heterogeneous_cases_plan_changed_mixed`` counts the cases whose chosen plan differs (some op of the
FP32 graph gets another placement or mode; ``median_share_of_ops_changed_mixed``: how many of them),
beside the same counts for the FP32 graph searched again with another seed (the search's own noise).

Pipelines (``tag.search.pipeline_dp``): the ``pipe`` column is the best simulated pipeline (of the pipeline
search, or of the tree search, where pipelines are root candidates: ``mcts_pipeline``). On the
large-batch heterogeneous cases the search is also run without pipelines (``use_pipeline=False``), and
``geomean_speedup_vs_best_uniform_large_heterogeneous_with_pipeline`` / ``..._without_pipeline`` compare the
plan's predicted speedup over the best uniform action with and without them.

Usage::

    python scripts/bench_search.py --quick --json search.json      # CI-sized subset
    python scripts/bench_search.py --json search.json               # everything (hours on 2 cores)
    python scripts/bench_search.py --models resnet50 --topologies lab-v100-1080ti --batches large
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import tag
from tag.search import SearchEnv, random_search, search
from tag.search.mcts import mcts
from tag.search.orders import model_family
from tag.strategy.grouping import group_ops
from tag_bench.machine import load1
from tag_bench.records import Run, write_json
from tag_bench.stats import figure_text, geomean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

TOPOLOGIES = ["lab-v100-1080ti", "a100-8x-nvlink", "h100-2x8-infiniband", "cloud-slow-link",
              "consumer-lab-4host", "fabric-64x8", "localhost"]
QUICK_MODELS = ["mlp", "resnet50", "bert_base"]
QUICK_TOPOLOGIES = ["lab-v100-1080ti", "cloud-slow-link", "consumer-lab-4host"]
GROUPS = 64


def heterogeneous(topo) -> bool:
    """More than one device type, or links between hosts of unequal bandwidth."""
    if len({g.device_type for g in topo.groups}) > 1:
        return True
    hb = np.asarray(topo.host_bandwidth, dtype=np.float64)
    off = hb[~np.eye(len(hb), dtype=bool)]
    return len(off) > 0 and float(off.max()) > float(off.min()) * 1.01


def batches(tg, topo, which: list[str]) -> dict[str, int]:
    n = topo.num_devices
    family = model_family(tg)
    large_per_device = 16 if family == "transformer" else 64
    out = {}
    if "small" in which:
        out["small"] = 4 * n
    if "large" in which:
        out["large"] = large_per_device * n
    return out


def run_case(tg, grouping, topo, batch: int, playouts: int, budget_s: float | None, seed: int,
             without_pipeline: bool = False) -> dict:
    env = SearchEnv(tg, topo, grouping, batch_size=batch)
    while not any(r.feasible for r in env.builtin_results.values()) and batch > topo.num_devices:
        batch //= 2                                       # lower the batch until something fits
        env = SearchEnv(tg, topo, grouping, batch_size=batch)
    t0 = time.perf_counter()
    # min_gain=0 and mixed_min_gain=0: this measures the search's predicted optimum; tag.optimize's default
    # margins (a searched strategy replaces the best built-in only when predicted 5% faster, a mixed one the
    # best uniform action only when 10% faster) are deployment choices about the simulator's error on real
    # runs (bench_fidelity), not part of the search's quality.
    found = search(env, playouts=playouts, budget_s=budget_s, seed=seed, min_gain=0.0, mixed_min_gain=0.0)
    search_s = time.perf_counter() - t0
    evals = env.evaluations
    # MCTS alone and random search, each on a fresh environment, at the same number of simulator runs
    tree_env = SearchEnv(tg, topo, grouping, batch_size=batch, simulator=env.simulator)
    tree = mcts(tree_env, playouts=playouts, seed=seed)
    rnd_env = SearchEnv(tg, topo, grouping, batch_size=batch, simulator=env.simulator)
    rnd = random_search(rnd_env, evaluations=max(1, tree_env.evaluations), seed=seed)
    base = found.baselines
    feas = found.baselines_feasible
    ref_time = env.reference_time
    simple = [base[n] for n in ("dp_allreduce", "ps", "single", "partition", "best_uniform") if feas[n]]
    row = {"batch": batch, "devices": topo.num_devices, "heterogeneous": heterogeneous(topo),
           "reference": env.reference_name, "method": found.method,
           **{f"{n}_s": base[n] for n in base}, "random_s": rnd.outcome.step_time,
           "mcts_alone_s": tree.outcome.step_time, "search_s": found.step_time, "feasible": found.outcome.feasible,
           "speedup_vs_dp": (base["dp_allreduce"] if feas["dp_allreduce"] else ref_time) / found.step_time,
           "speedup_vs_best_uniform": base["best_uniform"] / found.step_time,
           "below_a_baseline": bool(simple) and found.step_time > min(simple) * (1 + 1e-9),
           "search_seconds": search_s, "evaluations": evals, "mcts_alone_evaluations": tree_env.evaluations,
           "pipeline_s": min(base.get("pipeline", float("nan")), base.get("mcts_pipeline", float("inf"))),
           "pipeline": found.strategy.pipeline.to_dict() if found.strategy.pipeline is not None
           else found.pipeline.strategy.pipeline.to_dict() if found.pipeline and found.pipeline.strategy
           else None, "load_average": load1(), "_strategy": found.strategy}
    if without_pipeline:
        plain = search(SearchEnv(tg, topo, grouping, batch_size=batch, simulator=env.simulator), playouts=playouts,
                       budget_s=budget_s, seed=seed, min_gain=0.0, mixed_min_gain=0.0, use_pipeline=False)
        row["search_without_pipeline_s"] = plain.step_time
        row["speedup_vs_best_uniform_without_pipeline"] = base["best_uniform"] / plain.step_time
    return row


def mixed_ir(model: str):
    """(IR, grouping) of MODEL after the mixed_float16 rewrite."""
    from tag.frontend.precision import apply_precision
    gd = apply_precision(tag.zoo.training_graph(model, batch_size=32), "mixed_float16", train_op="train_op",
                         loss="loss", init="init")
    tg = tag.analyze(gd)
    return tg, group_ops(tg, target_groups=GROUPS)


def op_actions(tg, strategy) -> dict[str, tuple]:
    """Op name -> (placement, mode, partition device) in STRATEGY."""
    part = strategy.partition or {}
    acts = strategy.actions
    return {op.name: (acts[int(g)].placement, acts[int(g)].mode, acts[int(g)].ps_device, part.get(i))
            for i, (op, g) in enumerate(zip(tg.ops, strategy.grouping.group_of_op, strict=True))}


def plan_changed(tg, strategy, tg_mixed, grouping_mixed, topo, batch: int, args, seed: int | None = None) -> float:
    """The share of the FP32 graph's ops that the search's plan for the mixed-precision graph places or
    runs otherwise than STRATEGY (the FP32 graph's plan); 0 when the plan is the same."""
    env = SearchEnv(tg_mixed, topo, grouping_mixed, batch_size=batch)
    found = search(env, playouts=args.playouts, budget_s=args.budget, seed=args.seed if seed is None else seed,
                   min_gain=0.0, mixed_min_gain=0.0)
    mixed = op_actions(tg_mixed, found.strategy)
    fp32 = op_actions(tg, strategy)
    return sum(mixed.get(name, action) != action for name, action in fp32.items()) / max(len(fp32), 1)


def row_text(model: str, name: str, row: dict) -> str:
    """One printed line of the table: step times in ms, speedups, search seconds, load, the method."""
    def ms(key: str) -> str:
        return f"{row[key] * 1e3:9.1f}"
    return (f"{model:<13} {name:<20} {row['batch']:>6} {ms('dp_allreduce_s')} {ms('ps_s')} "
            f"{ms('single_s')} {ms('partition_s')} {ms('best_uniform_s')} {ms('pase_dp_s')} {ms('pipeline_s')} "
            f"{ms('random_s')} {ms('mcts_alone_s')} {ms('search_s')} {row['speedup_vs_dp']:6.2f} "
            f"{row['speedup_vs_best_uniform']:6.2f} {row['search_seconds']:6.1f} "
            f"{row['load_average']:5.1f}  {row['method']}{'' if row['feasible'] else ' (OOM)'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"models {QUICK_MODELS} on {QUICK_TOPOLOGIES}")
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--topologies", nargs="*", default=None)
    p.add_argument("--batches", nargs="*", default=["small", "large"], choices=["small", "large"])
    p.add_argument("--playouts", type=int, default=200)
    p.add_argument("--budget", type=float, default=None, help="seconds per search (default: playouts only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--mixed", action="store_true",
                   help="search heterogeneous cases again in mixed_float16 and count changed plans")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    models = args.models or (QUICK_MODELS if args.quick else list(tag.zoo.names()))
    topologies = args.topologies or (QUICK_TOPOLOGIES if args.quick else TOPOLOGIES)
    rows = []
    header = (f"{'model':<13} {'topology':<20} {'batch':>6} {'dp':>9} {'ps':>9} {'single':>9} {'partition':>9} "
              f"{'uniform':>9} {'pase':>9} {'pipe':>9} {'random':>9} {'mcts':>9} {'search':>9} {'x dp':>6} "
              f"{'x unif':>6} {'secs':>6} {'load':>5}  method")
    print(header)
    for model in models:
        t0 = time.perf_counter()
        tg = tag.analyze(tag.zoo.training_graph(model, batch_size=32))
        grouping = group_ops(tg, target_groups=GROUPS)
        print(f"# {model}: IR and grouping in {time.perf_counter() - t0:.1f} s ({len(tg.ops)} ops, "
              f"{grouping.num_groups} groups)", flush=True)
        mixed = mixed_ir(model) if args.mixed else None
        for name in topologies:
            topo = tag.load_topology(os.path.join(ROOT, "topologies", f"{name}.pbtxt"))
            for label, batch in batches(tg, topo, args.batches).items():
                row = {"model": model, "topology": name, "batch_kind": label,
                       **run_case(tg, grouping, topo, batch, args.playouts, args.budget, args.seed,
                                  without_pipeline=label == "large" and heterogeneous(topo))}
                strategy = row.pop("_strategy")
                if mixed is not None and row["heterogeneous"]:
                    row["plan_changed_mixed"] = plan_changed(tg, strategy, *mixed, topo, row["batch"], args)
                    # the noise floor: the same FP32 graph searched with another seed
                    row["plan_changed_seed"] = plan_changed(tg, strategy, tg, grouping, topo, row["batch"], args,
                                                            seed=args.seed + 1)
                rows.append(row)
                print(row_text(model, name, row), flush=True)
    het = [r for r in rows if r["heterogeneous"]]
    large_het = [r for r in het if "speedup_vs_best_uniform_without_pipeline" in r]
    summary = {"rows": rows,
               "geomean_speedup_vs_best_uniform_large_heterogeneous_with_pipeline":
                   geomean([r["speedup_vs_best_uniform"] for r in large_het]),
               "geomean_speedup_vs_best_uniform_large_heterogeneous_without_pipeline":
                   geomean([r["speedup_vs_best_uniform_without_pipeline"] for r in large_het]),
               "large_heterogeneous_cases_won_by_pipeline": sum(1 for r in large_het
                                                             if r["method"] in ("pipeline", "mcts_pipeline")),
               "geomean_speedup_vs_dp_heterogeneous": geomean([r["speedup_vs_dp"] for r in het]),
               "geomean_speedup_vs_best_uniform_heterogeneous": geomean([r["speedup_vs_best_uniform"] for r in het]),
               "cases_below_a_baseline": sum(1 for r in rows if r["below_a_baseline"]),
               "cases": len(rows), "heterogeneous_cases": len(het), "playouts": args.playouts,
               "budget_s": args.budget}
    if args.mixed:
        changed = [r["plan_changed_mixed"] for r in het if "plan_changed_mixed" in r]
        summary["heterogeneous_cases_plan_changed_mixed"] = sum(1 for c in changed if c > 0)
        summary["median_share_of_ops_changed_mixed"] = float(np.median(changed)) if changed else None
        noise = [r["plan_changed_seed"] for r in het if "plan_changed_seed" in r]
        summary["heterogeneous_cases_plan_changed_other_seed"] = sum(1 for c in noise if c > 0)
        summary["median_share_of_ops_changed_other_seed"] = float(np.median(noise)) if noise else None
        print(f"heterogeneous cases whose plan changes in mixed_float16: "
              f"{summary['heterogeneous_cases_plan_changed_mixed']} of {len(het)} (median share of ops placed or "
              f"run otherwise: {100 * (summary['median_share_of_ops_changed_mixed'] or 0):.0f}%); FP32 again with "
              f"another seed: {summary['heterogeneous_cases_plan_changed_other_seed']} "
              f"({100 * (summary['median_share_of_ops_changed_other_seed'] or 0):.0f}%)")
    print(f"\nheterogeneous cases: {len(het)}; geomean speedup vs dp_allreduce "
          f"{figure_text(summary['geomean_speedup_vs_dp_heterogeneous'], '.2f', 'x')}, vs best uniform "
          f"{figure_text(summary['geomean_speedup_vs_best_uniform_heterogeneous'], '.3f', 'x')}; cases below a "
          f"baseline: {summary['cases_below_a_baseline']}")
    with_pipe = summary["geomean_speedup_vs_best_uniform_large_heterogeneous_with_pipeline"]
    without_pipe = summary["geomean_speedup_vs_best_uniform_large_heterogeneous_without_pipeline"]
    print(f"large-batch heterogeneous cases: {len(large_het)}; geomean speedup vs best uniform with pipelines "
          f"{figure_text(with_pipe, '.3f', 'x')}, without {figure_text(without_pipe, '.3f', 'x')}; the plan is a "
          f"pipeline in {summary['large_heterogeneous_cases_won_by_pipeline']}")
    write_json(args.json, summary, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
