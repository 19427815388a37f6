"""Does one program per host cost step time? The same frozen plans, run by an earlier commit and by this one.

Until issue 69 the rewriter built one GraphDef for the whole cluster and one client session drove every
server through it; now each host runs its own program in its own process (``tag.backend.rewrite.programs``).
This benchmark runs the same strategies both ways on configuration G's testbed (a GPU cluster's bytes per
FLOP; quotas 1.0 / 0.5 / 0.5, ``tag_bench.cases``) and compares their median steps:

- the cases are bench_e2e's five at ``--batch-scale 4`` (vgg, deep-mlp, deep-transformer, transformer, cnn);
- per case, tag's rows that do not depend on tuning: the plan ``tag.optimize`` returns (no tuning), the best
  uniform action and data parallelism on all hosts, each made ONCE by this commit and saved as
  ``strategy.pb`` before anything is timed (frozen), so both commits run exactly the same strategies;
- the base commit runs from a temporary ``git worktree``; each (case, commit) is one child process that builds
  its own testbed, rewrites every strategy of the case with its own code and times it on fresh TF servers
  (strategies in turn, the order reversed every other round); rounds take the two commits in turn, which
  goes first alternating, so drift on this shared machine falls on both alike.

Prints every child's medians with the load average, then per row the median over rounds of each commit and
their ratio (new / base; the target: at most 1.05), the worst row beside the geomean. ``--json FILE`` writes
the frozen cases, every sample and the summary (``provenance`` included). Needs root (namespaces, tc, cgroups).

Usage::

    python scripts/bench_host_programs.py --base ade04de --rounds 3 --json host_programs.json
    python scripts/bench_host_programs.py --cases cnn --rounds 1        # a quick look
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CASE_NAMES = ("vgg", "deep-mlp", "deep-transformer", "transformer", "cnn")
ROWS = ("plan", "uniform", "dp_all")
DEFAULT_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "measured", "e2e",
                               "e2e_g5_amd_run55.profile.json")
CHILD_TIMEOUT_S = 1800
TARGET_RATIO = 1.05


# ------------------------------------------------------------------------------------------------ the child
def child_main(spec: dict) -> None:
    """Time every strategy of one case with the code on this process's path; prints one JSON line."""
    import numpy as np
    from tensorflow.core.framework import graph_pb2

    import tag
    from tag.api import prepare
    from tag.backend.runtime.measure import run_on
    from tag.strategy.types import Strategy
    try:
        from tag_bench.testbed import Testbed
    except ImportError:          # commits before the harness left the library
        from tag.backend.testbed import Testbed
    gd = graph_pb2.GraphDef()
    with open(spec["graph"], "rb") as f:
        gd.ParseFromString(f.read())
    topo = tag.parse_topology(spec["topology"])
    whole_graph_api = "graph_def" in inspect.signature(run_on).parameters
    medians = {}
    with Testbed(topo, cpu_quota=spec["quotas"]) as tb:
        an = prepare(gd, tb.topology, batch_size=spec["batch"])
        names = list(spec["strategies"])
        for name in (names if spec["round"] % 2 == 0 else names[::-1]):
            with open(spec["strategies"][name], "rb") as f:
                strategy = Strategy.from_proto(f.read())
            x = an.rewrite(strategy)
            tb.start_workers(threads_per_worker=1)
            try:
                steps = spec["warmup"] + spec["timed"]
                if whole_graph_api:
                    res = run_on(tb, x.graph_def, train_op=x.train_op, loss=x.loss, init=x.init, steps=steps,
                                 warmup=spec["warmup"])
                else:
                    res = run_on(tb, x, steps=steps, warmup=spec["warmup"])
            finally:
                tb.stop_workers()
            medians[name] = float(np.median(res.step_times[spec["warmup"]:]))
    print("RESULT " + json.dumps({"tag": os.path.dirname(tag.__file__), "medians": medians}), flush=True)


# ------------------------------------------------------------------------------------------------ the parent
def freeze_cases(names: Sequence[str], batch_scale: int, profile, topo, budget_s: float, workdir: str) -> list[dict]:
    """Each case's graph and its rows' strategies, written to WORKDIR once (this commit's search)."""
    import tag
    from tag.tune import BEST_UNIFORM, best_uniform_of, strategy_key
    from tag_bench.cases import E2E_CASES
    from tag_bench.describe import describe
    from tag_bench.mwms import tf1_graph
    cases = []
    for label, model, batch, width, depth in E2E_CASES:
        if label not in names:
            continue
        batch *= batch_scale
        gd = tf1_graph(model, batch, width=width, depth=depth)
        t0 = time.perf_counter()
        plan = tag.optimize(gd, topo, batch_size=batch, profile=profile, budget_s=budget_s, name=label)
        an = plan.analysis
        chosen = {"plan": plan.strategy, "uniform": plan.candidates.get(BEST_UNIFORM) or best_uniform_of(an)[0],
                  "dp_all": an.builtin("dp_allreduce")}
        files, seen = {}, {}
        for row, strategy in chosen.items():     # rows that are one program are measured once
            key = strategy_key(strategy, topo)
            if key in seen:
                continue
            seen[key] = row
            files[row] = os.path.join(workdir, f"{label}-{row}.pb")
            with open(files[row], "wb") as f:
                f.write(strategy.to_proto().SerializeToString(deterministic=True))
        graph_file = os.path.join(workdir, f"{label}.graph.pb")
        with open(graph_file, "wb") as f:
            f.write(gd.SerializeToString(deterministic=True))
        same = {row: seen[strategy_key(s, topo)] for row, s in chosen.items()}
        cases.append({"case": label, "batch": batch, "graph": graph_file, "strategies": files, "same_as": same,
                      "described": {row: describe(s, topo) for row, s in chosen.items()},
                      "search_s": round(time.perf_counter() - t0, 1)})
        print(f"frozen {label} (batch {batch}): " + "; ".join(f"{r}: {t}" for r, t in cases[-1]["described"].items()),
              flush=True)
    return cases


def base_tree(base: str, workdir: str) -> str:
    """A worktree of commit BASE under WORKDIR with this checkout's compiled protos (the .proto files must match)."""
    repo = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    if subprocess.run(["git", "-C", repo, "diff", "--quiet", base, "HEAD", "--", "proto/"]).returncode != 0:
        raise SystemExit(f"bench_host_programs: proto/ changed since {base}; its compiled classes cannot be reused")
    tree = os.path.join(workdir, "base")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, base], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.copytree(os.path.join(repo, "tag", "_proto"), os.path.join(tree, "tag", "_proto"), dirs_exist_ok=True)
    return tree


def run_child(tree: str, spec: dict) -> dict | None:
    """One child with TREE's code first on its path; its RESULT, or None (printed why) when it failed."""
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                             cwd=tree, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"    {spec['case']}: no result within {CHILD_TIMEOUT_S} s", flush=True)
        return None
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"    {spec['case']} failed (exit {out.returncode}): {' '.join(out.stderr.split())[-800:]}", flush=True)
    return None


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def portable(cases: list[dict]) -> list[dict]:
    """CASES with file names instead of this machine's temporary paths (what the JSON records)."""
    return [{**c, "graph": os.path.basename(c["graph"]),
             "strategies": {k: os.path.basename(v) for k, v in c["strategies"].items()}} for c in cases]


def summarise(cases: list[dict], samples: list[dict]) -> dict:
    """Per row: the median over rounds of each commit's median step, and new / base."""
    rows = []
    for case in cases:
        for row in case["strategies"]:
            per = {v: [s["medians"][row] for s in samples if s["case"] == case["case"] and s["version"] == v
                       and row in s["medians"]] for v in ("base", "new")}
            if not per["base"] or not per["new"]:
                continue
            base_s, new_s = statistics.median(per["base"]), statistics.median(per["new"])
            rows.append({"case": case["case"], "row": row, "also": [r for r, s in case["same_as"].items()
                                                                    if s == row and r != row],
                         "base_s": base_s, "new_s": new_s, "ratio": new_s / base_s, "rounds": len(per["new"]),
                         "strategy": case["described"][row]})
    ratios = [r["ratio"] for r in rows]
    return {"rows": rows, "geomean_ratio": geomean(ratios) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None,
            "within_target": bool(ratios) and max(ratios) <= TARGET_RATIO, "target_ratio": TARGET_RATIO}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="ade04de", help="the commit to compare with (default ade04de, issue 69's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every (case, commit) (default 3)")
    p.add_argument("--cases", default=",".join(CASE_NAMES), help="comma-separated, of " + ", ".join(CASE_NAMES))
    p.add_argument("--batch-scale", type=int, default=4, help="bench_e2e's --batch-scale (default 4)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="the calibrated profile (default: bench_e2e run 55's)")
    p.add_argument("--gpu-gbps", type=float, default=25.0, help="configuration G's Ethernet per GPU (default 25)")
    p.add_argument("--budget", type=float, default=20.0, help="tag.optimize search budget per case (s)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timed", type=int, default=10, help="timed steps per strategy and child (default 10)")
    p.add_argument("--json", default=None, help="write cases, samples and summary here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    names = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(names) - set(CASE_NAMES))
    if unknown or args.rounds < 1 or args.batch_scale < 1 or args.timed < 3:
        p.error(f"unknown cases {unknown}" if unknown else "--rounds, --batch-scale >= 1 and --timed >= 3")
    from tag.cost.model import Profile
    from tag_bench.cases import GPU_CONFIG, config_recipe, load_recipe, testbed_topology
    from tag_bench.machine import load1
    from tag_bench.records import Run, write_json
    from tag_bench.testbed import testbed_missing
    if testbed_missing("bench_host_programs"):
        return 2
    run = Run(__file__, argv)
    repo = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    profile = Profile.load(args.profile)
    recipe = config_recipe(load_recipe(), profile, args.gpu_gbps)
    text, topo = testbed_topology(recipe, GPU_CONFIG, profile)
    quotas = recipe["configs"][GPU_CONFIG]["quotas"]
    out: dict = {"base": args.base, "config": GPU_CONFIG, "links_gbps": recipe["configs"][GPU_CONFIG]["links_gbps"],
                 "quotas": quotas, "batch_scale": args.batch_scale, "warmup": args.warmup, "timed": args.timed}
    with tempfile.TemporaryDirectory(prefix="tag-host-programs-") as workdir:
        tree = base_tree(args.base, workdir)
        try:
            cases = freeze_cases(names, args.batch_scale, profile, topo, args.budget, workdir)
            out["cases"] = portable(cases)
            samples: list[dict] = []
            out["samples"] = samples
            trees = {"base": tree, "new": repo}
            for r in range(args.rounds):
                for i, case in enumerate(cases):
                    for version in (("base", "new") if (r + i) % 2 == 0 else ("new", "base")):
                        spec = {"case": case["case"], "graph": case["graph"], "strategies": case["strategies"],
                                "batch": case["batch"], "topology": text, "quotas": quotas, "round": r,
                                "warmup": args.warmup, "timed": args.timed}
                        t0, load = time.perf_counter(), load1()
                        res = run_child(trees[version], spec)
                        if res is None:
                            continue
                        samples.append({"case": case["case"], "version": version, "round": r,
                                        "medians": res["medians"], "load": round(load, 2),
                                        "seconds": round(time.perf_counter() - t0, 1)})
                        print(f"round {r} {case['case']:<16} {version:<4} " + "  ".join(
                            f"{k} {v * 1e3:8.1f} ms" for k, v in res["medians"].items()) + f"  load {load:.2f}",
                            flush=True)
                        out.update(summarise(cases, samples))
                        write_json(args.json, out, run)
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    out.update(summarise(cases, samples))
    write_json(args.json, out, run)
    print(f"\n{'case':<16} {'row':<8} {'base ms':>9} {'new ms':>9} {'new/base':>9}")
    for row in out["rows"]:
        print(f"{row['case']:<16} {row['row']:<8} {row['base_s'] * 1e3:9.1f} {row['new_s'] * 1e3:9.1f} "
              f"{row['ratio']:9.3f}" + (f"  (also {', '.join(row['also'])})" if row["also"] else ""))
    if out["rows"]:
        print(f"geomean new/base {out['geomean_ratio']:.3f}, worst {out['worst_ratio']:.3f} "
              f"(target <= {TARGET_RATIO}); load {load1():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
