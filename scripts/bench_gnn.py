"""Benchmark the GNN prior where it would be used: ``tag.optimize``'s search with the GNN prior against the
same search with the default prior, at equal wall time and at equal playouts.

For every --model x every --topo (both repeatable; default: the validation models inception_v3,
mobilenet_v2 and bert_large, full size, on every ready topology file -- none of which training saw), it runs the
search portfolio ``tag.optimize`` runs (``tag.search.driver.search``: built-ins, best uniform action, PaSE, tree
search seeded with the best so far, refinement; decision order ``auto``, seed 0, SFB off, the 5% ``min_gain``
rule, but not the 10% ``mixed_min_gain`` one, which would hide the priors' mixed answers) on a fresh environment
and simulator per run (built before the clock starts; a shared simulator's caches would favour whichever arm runs
second), once per arm -- ``gnn`` (the shipped weights, or --weights) and ``default`` (the uniform-value prior) --
per budget: each of --budgets seconds (equal wall time) and --playouts playouts (equal playouts: the tree
search's simulator runs are then equal up to cache hits, refinement gets the same cap; ``tag.optimize``'s own
default is 400), and with --tree-playouts N the tree search alone at N playouts (what the prior does without the
rest of the portfolio: key ``gnn_over_default_treeNplayouts``, left out of worst_case_ratio). The two arms of a
case run back to back, the first alternating from case to case (the machine may be shared: load averages are
printed beside each row). Every simulator run is counted (``SearchEnv.evaluations``: the GNN's features run none
of their own; the uniform strategies they read are the portfolio's cache hits).

Per case and budget: each arm's predicted speedup over ``dp_allreduce`` and the ratio gnn / default.
Summary per budget: geometric mean of the ratios over the cases where the two arms differ (and over all
cases). The GNN's cost per new tree node is timed on bert_large at 64 op groups, on
``lab-v100-1080ti`` and on the 512-GPU ``fabric-64x8`` (a 400-playout tree search with the GNN prior:
milliseconds per prior call, the one-off encoder spread over the calls; the encoder's seconds apart).

JSON (``--json``): ``rows``, ``gnn_over_default_10s``, ``gnn_over_default_60s`` (per budget in --budgets:
``gnn_over_default_<B>s``), ``gnn_over_default_<P>playouts``, ``worst_case_ratio`` (smallest ratio over every
case and budget), ``default_60s_over_default_10s`` (the headroom: what six times the time gains the default
prior), ``ms_per_node_lab``, ``ms_per_node_512``, ``encode_s_lab``, ``encode_s_512``. Targets:
both geomeans >= 1.03, worst_case_ratio >= 0.99, ms_per_node_lab <= 5, ms_per_node_512 <= 20.

Usage::

    python scripts/bench_gnn.py --json gnn.json                   # the full run (about an hour)
    python scripts/bench_gnn.py --quick                           # bert_large on two topologies, 10 s
    python scripts/bench_gnn.py --budgets 10 --model zoo:mobilenet_v2 --topo topologies/lab-v100-1080ti.pbtxt
    python scripts/bench_gnn.py --resummarise gnn.json            # the summary of a run's rows so far
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import tag
from tag.gnn import load_policy
from tag.search.driver import search
from tag.search.env import SearchEnv
from tag.search.mcts import mcts
from tag.strategy.grouping import group_ops
from tag_bench.machine import load1
from tag_bench.records import Run, write_json
from tag_bench.stats import figure_text, geomean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

DEFAULT_MODELS = ["zoo:inception_v3", "zoo:mobilenet_v2", "zoo:bert_large"]
GROUPS = 64
LAB, BIG = "lab-v100-1080ti.pbtxt", "fabric-64x8.pbtxt"


def build_ir(spec: str):
    """The IR of a --model SPEC (zoo:NAME[,key=value...] at batch 32, or a GraphDef file)."""
    from tag.frontend.zoo import resolve_model
    name, graph_def = resolve_model(spec, 32 if spec.startswith("zoo:") else None)
    return name, tag.analyze(graph_def, batch_size=32 if spec.startswith("zoo:") else None, name=name)


def run_arm(tg, grouping, topo, batch: int, simulator, prior, budget_s: float | None, playouts: int | None,
            seed: int, tree_only: bool = False) -> dict:
    """One search as tag.optimize runs it (SFB off) on a fresh environment (SIMULATOR, or a fresh one when
    None): speedup, method, seconds, runs.
    TREE_ONLY: the tree search alone (no seeding, no refinement, no min_gain rule), PLAYOUTS playouts."""
    env = SearchEnv(tg, topo, grouping, batch_size=batch, simulator=simulator)
    dp = env.builtin_results["dp_allreduce"]
    calls0 = getattr(prior, "calls", 0)
    t0 = time.perf_counter()
    if tree_only:
        tree = mcts(env, order="auto", playouts=playouts, seed=seed, prior=prior)
        outcome, method = tree.outcome, "mcts"
    else:
        found = search(env, budget_s=budget_s, playouts=playouts, seed=seed, prior=prior, mixed_min_gain=0.0)
        outcome, method = found.outcome, found.method
    seconds = time.perf_counter() - t0
    ok = bool(outcome.feasible)
    return {"speedup": float(dp.step_time / outcome.step_time) if ok else 0.0, "feasible": ok,
            "method": method, "step_s": float(outcome.step_time), "seconds": round(seconds, 2),
            "evaluations": int(env.evaluations), "prior_calls": getattr(prior, "calls", 0) - calls0,
            "load": round(load1(), 2)}


def ratio(row: dict) -> float | None:
    g, d = row["gnn"]["speedup"], row["default"]["speedup"]
    return g / d if g > 0 and d > 0 else None


def node_cost(policy, tg, grouping, topo, batch: int, playouts: int = 400) -> dict:
    """The GNN's milliseconds per new tree node: a tree search with the GNN prior, after the portfolio's
    best-uniform step (as in tag.optimize, so the uniform values the features read are cached)."""
    from tag.search.driver import best_uniform
    env = SearchEnv(tg, topo, grouping, batch_size=batch)
    start, _ = best_uniform(env)
    policy.calls, policy.encode_seconds, policy.node_seconds = 0, 0.0, 0.0
    evals = env.evaluations
    t0 = time.perf_counter()
    tree = mcts(env, order="auto", playouts=playouts, seed=0, prior=policy, start=start)
    return {"ms_per_node": round(policy.ms_per_node, 3), "ms_per_node_without_encoder":
            round(1e3 * policy.node_seconds / max(policy.calls, 1), 3), "encode_s": round(policy.encode_seconds, 3),
            "nodes": policy.calls, "tree_seconds": round(time.perf_counter() - t0, 2),
            "tree_evaluations": env.evaluations - evals, "playouts": tree.playouts, "load": round(load1(), 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", metavar="SPEC", help="zoo:NAME[,key=value...] or a GraphDef file")
    p.add_argument("--topo", action="append", metavar="FILE", help="a topology file (default: topologies/*.pbtxt)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--per-device", type=int, default=8, help="global batch = this x the topology's devices")
    p.add_argument("--budgets", type=float, nargs="*", default=[10.0, 60.0], help="seconds per search (each)")
    p.add_argument("--playouts", type=int, default=400, help="the equal-playouts comparison (0: none)")
    p.add_argument("--tree-playouts", type=int, default=0,
                   help="also compare the tree search alone (no seeding or refinement) at this many playouts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", help="policy weights (.npz); default: the shipped ones")
    p.add_argument("--quick", action="store_true", help="bert_large on the lab and 512-GPU topologies, 10 s")
    p.add_argument("--no-timing", action="store_true", help="skip the per-node timing")
    p.add_argument("--resummarise", metavar="JSON", help="recompute the summary of an earlier --json file's rows "
                   "(a run stopped early) and print it; runs nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.model = args.model or ["zoo:bert_large"]
        args.topo = args.topo or [os.path.join(ROOT, "topologies", t) for t in (LAB, BIG)]
        args.budgets = [10.0]
    args.model = args.model or DEFAULT_MODELS
    args.topo = args.topo or sorted(glob.glob(os.path.join(ROOT, "topologies", "*.pbtxt")))
    return args


def build_irs(models: list[str]) -> list[tuple]:
    """(spec, name, IR, grouping) per --model."""
    irs = []
    for spec in models:
        t0 = time.perf_counter()
        name, tg = build_ir(spec)
        grouping = group_ops(tg, target_groups=GROUPS)
        irs.append((spec, name, tg, grouping))
        print(f"{name}: IR {len(tg.ops)} ops, {grouping.num_groups} groups ({time.perf_counter() - t0:.0f} s, "
              f"load {load1():.2f})", flush=True)
    return irs


def budget_keys(args: argparse.Namespace) -> list[tuple[str, float | None, int | None]]:
    """(row key, seconds, playouts) per comparison; keys starting with "tree" run the tree search alone."""
    keys = [(f"{b:g}s", float(b), None) for b in args.budgets]
    if args.playouts:
        keys.append((f"{args.playouts}playouts", None, int(args.playouts)))
    if args.tree_playouts:
        keys.append((f"tree{args.tree_playouts}playouts", None, int(args.tree_playouts)))
    return keys


def summarise(rows: list[dict], keys: list[str]) -> dict:
    out: dict = {}
    worst = None
    for key in keys:
        rs = [ratio(r[key]) for r in rows if key in r]
        rs = [x for x in rs if x is not None]
        differ = [x for x in rs if abs(x - 1.0) > 1e-9]
        out[f"gnn_over_default_{key}"] = geomean(differ) if differ else (1.0 if rs else None)
        out[f"gnn_over_default_{key}_all_cases"] = geomean(rs)
        out[f"cases_differing_{key}"] = len(differ)
        out[f"cases_{key}"] = len(rs)
        if rs and not key.startswith("tree"):
            worst = min(rs) if worst is None else min(worst, min(rs))
    out["worst_case_ratio"] = worst
    timed = sorted((k for k in keys if k.endswith("s") and not k.endswith("playouts") and not k.startswith("tree")),
                   key=lambda k: float(k[:-1]))
    if len(timed) >= 2:           # headroom: what the default prior gains from the longest budget over the shortest
        short, long_ = timed[0], timed[-1]
        gains = [r[long_]["default"]["speedup"] / r[short]["default"]["speedup"] for r in rows
                 if short in r and long_ in r
                 and r[short]["default"]["speedup"] > 0 and r[long_]["default"]["speedup"] > 0]
        out[f"default_{long_}_over_default_{short}"] = geomean(gains)
        out[f"cases_default_{long_}_beats_{short}"] = sum(g > 1 + 1e-9 for g in gains)
    return out


def run_bench(args: argparse.Namespace, irs: list[tuple], this_run: Run) -> dict:
    """Every case, topology-major (a run stopped early covers every model); the JSON summary (written to --json
    after every case, with THIS_RUN's provenance)."""
    policy = load_policy(args.weights)
    budgets = budget_keys(args)
    rows: list[dict] = []
    timing: dict = {}

    def summary() -> dict:
        s = {"cases": len(rows), "rows": rows, **summarise(rows, [k for k, _, _ in budgets]), **timing,
             "budgets_s": args.budgets, "playouts": args.playouts, "load_average_end": load1()}
        return s

    if not args.no_timing:
        bert = [ir for ir in irs if ir[1].startswith("bert_large")] or build_irs(["zoo:bert_large"])
        _, _, tg, grouping = bert[0]
        for key, fname in (("lab", LAB), ("512", BIG)):
            topo = tag.load_topology(os.path.join(ROOT, "topologies", fname))
            t = node_cost(policy, tg, grouping, topo, args.per_device * topo.num_devices)
            timing[f"ms_per_node_{key}"], timing[f"encode_s_{key}"] = t["ms_per_node"], t["encode_s"]
            timing[f"node_timing_{key}"] = t
            print(f"GNN cost per new tree node, bert_large ({grouping.num_groups} groups) on {fname}: "
                  f"{t['ms_per_node']:.2f} ms ({t['ms_per_node_without_encoder']:.2f} ms without the one-off "
                  f"encoder of {t['encode_s']:.2f} s; {t['nodes']} nodes, {t['tree_evaluations']} simulator runs "
                  f"in {t['tree_seconds']:.1f} s); load {t['load']:.2f}", flush=True)
    case = 0
    for path in args.topo:
        topo = tag.load_topology(path)
        batch = args.per_device * topo.num_devices
        for spec, name, tg, grouping in irs:
            base = SearchEnv(tg, topo, grouping, batch_size=batch)
            row = {"model": spec, "topology": os.path.basename(path), "batch": batch,
                   "groups": grouping.num_groups, "candidates": len(base.candidates)}
            for key, budget_s, playouts in budgets:
                arms = [("gnn", policy), ("default", None)]
                if case % 2:
                    arms.reverse()
                cell = {}
                for arm, prior in arms:
                    cell[arm] = run_arm(tg, grouping, topo, batch, None, prior, budget_s, playouts,
                                        args.seed, tree_only=key.startswith("tree"))
                cell["first"] = arms[0][0]
                row[key] = cell
                r = ratio(cell)
                print(f"  {name} on {row['topology']} (batch {batch}) {key}: "
                      + "  ".join(f"{a} {cell[a]['speedup']:.3f}x ({cell[a]['method']}, {cell[a]['evaluations']} "
                                  f"sims, {cell[a]['prior_calls']} prior calls, load {cell[a]['load']:.2f})"
                                  for a in ("gnn", "default"))
                      + f"  ratio {'n/a' if r is None else f'{r:.4f}'}", flush=True)
            case += 1
            rows.append(row)
            if args.json:                        # after every case: a long run stopped early keeps its rows
                write_json(args.json, summary(), this_run)
    return summary()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    this_run = Run(__file__, argv)
    if args.resummarise:
        import json
        with open(args.resummarise) as f:
            old = json.load(f)
        keys = sorted({k for r in old["rows"] for k, v in r.items() if isinstance(v, dict) and "gnn" in v})
        old.update(summarise(old["rows"], keys))
        print(json.dumps({k: v for k, v in old.items() if k != "rows" and not k.startswith("node_timing")}, indent=1))
        write_json(args.json, old, this_run)     # the run's own provenance kept
        return 0
    print(f"tag.optimize's search, GNN prior vs default prior; {len(args.model)} model(s) x {len(args.topo)} "
          f"topolog(y/ies), budgets {args.budgets} s and {args.playouts} playouts; load average {load1():.2f} "
          f"(2-core machine shared with other work)", flush=True)
    out = run_bench(args, build_irs(args.model), this_run)
    def fmt(v: float | None) -> str:
        return figure_text(v, ".4f")
    for key, _, _ in budget_keys(args):
        print(f"gnn/default at {key}: geomean {fmt(out[f'gnn_over_default_{key}'])} over the "
              f"{out[f'cases_differing_{key}']} case(s) where they differ, "
              f"{fmt(out[f'gnn_over_default_{key}_all_cases'])} "
              f"over all {out[f'cases_{key}']} (target >= 1.03)")
    print(f"worst case ratio {fmt(out['worst_case_ratio'])} (target >= 0.99); ms per node: lab "
          f"{fmt(out.get('ms_per_node_lab'))} (target <= 5), 512-GPU {fmt(out.get('ms_per_node_512'))} (target <= 20); "
          f"load {load1():.2f}")
    write_json(args.json, out, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
