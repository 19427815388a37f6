"""End-to-end speedups on a heterogeneous multi-host testbed: tag's plan vs tf.distribute, side by side.

For every (testbed configuration, model) case, in one run and on the same testbed (network namespaces,
HTB-shaped links with one shared egress per NIC, CFS CPU quotas per host; ``tag.backend.testbed``):

- ``mwms``: the anchor, ``tf.distribute.MultiWorkerMirroredStrategy`` (RING collectives; the same
  tf_keras architecture, global batch and Adam; a ``tf.function`` step with ``strategy.run``; one worker
  per host in its namespace with ``TF_CONFIG``; ``tag.backend.mwms``);
- ``dp``: tag's ``dp_allreduce`` (``tag.rewrite``) run with ``run_steps`` on TF servers in the namespaces;
- ``plan``: the plan ``tag.optimize`` returns for the testbed topology, and its predicted step time. The
  topology and profile come from ``scripts/testbed_recipe.json`` (``_testbed_cases.py``): each quota is
  profiled by ``tag-profile --sustained`` inside a cgroup of that quota (one device type per quota), plus
  the runtime's network costs (``profile_network``);
- the measured tuning step: ``tag.tune.tune_plan`` measures ``--tune K`` candidates (the plan, the best
  built-in, the best uniform action, then the next fastest predicted; default: as many as cost about 30
  steps of the slowest) in interleaved rounds and keeps the fastest measured; the row says whether it
  overrode the simulator, what it cost, and every candidate's predicted and measured time (``tune``).

Each time is the median of the steps after warm-up; every worker runs one intra-op thread. The machine
is shared, so the 1-minute load average is printed beside each row: compare the columns of a row (run
minutes apart at most), not rows of different runs. Needs root (namespaces, tc, cgroup v1 cpu).

Usage::

    python scripts/bench_e2e.py                  # 3 models x 2 configurations
    python scripts/bench_e2e.py --quick          # the MLP on configuration A
    python scripts/bench_e2e.py --json e2e.json  # {"rows", "geomean_speedup_vs_mwms", "worst_speedup_vs_mwms",
                                                 #  "dp_over_mwms", "guard_overrides", "guard_mean_seconds"}
                                                 # and the calibration's profile in e2e.profile.json (each
                                                 # configuration then applies its runtime levels: --out-dir)
    python scripts/bench_e2e.py --out-dir tb/    # also write tb/testbed-A.pbtxt, tb/profile-A.json, ...
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

import tag  # noqa: E402
from tag.tune import tune_plan  # noqa: E402
from tag.backend.mwms import tf1_graph  # noqa: E402
from tag.backend.runtime import run_steps  # noqa: E402
from tag.backend.testbed import Testbed  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from _testbed_cases import calibrate_testbed, load_recipe, runtime_levels, testbed_topology  # noqa: E402

# (model, global batch): divisible by 3 hosts, as MWMS needs
CASES = [("mlp", 96), ("cnn", 48), ("transformer", 48)]
MWMS_PORT = 24600


def run_mwms(tb: Testbed, model: str, batch: int, steps: int, warmup: int, hosts: int | None = None,
             model_args: tuple[str, ...] = ()) -> float:
    """Median step time of the MWMS anchor, one worker per testbed host (the first HOSTS hosts when given;
    MODEL_ARGS: more ``tag.backend.mwms`` options, such as ``--width``)."""
    n = len(tb.topology.hosts) if hosts is None else int(hosts)
    workers = [f"{tb.address(i)}:{MWMS_PORT + i}" for i in range(n)]
    procs = []
    for i in range(n):
        env = dict(os.environ, PYTHONPATH=REPO,
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen(tb.launch_prefix(i) + [sys.executable, "-m", "tag.backend.mwms", "--model",
                                                             model, "--batch", str(batch), "--steps", str(steps),
                                                             *model_args],
                                      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=900)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if procs[0].returncode != 0 or not lines:
        raise RuntimeError(f"MWMS chief failed (rc {procs[0].returncode}): {err.strip()[-2000:]}")
    return float(np.median(json.loads(lines[-1])["step_times"][warmup:]))


def run_tag(tb: Testbed, gd, res_or_plan, steps: int, warmup: int) -> float:
    r = run_steps(res_or_plan.graph_def, tb.target, train_op=res_or_plan.train_op, loss=res_or_plan.loss,
                  init=res_or_plan.init, steps=steps, warmup=warmup, synthetic=True)
    return float(np.median(r.step_times[warmup:]))


def run_case(tb: Testbed, cfg: dict, name: str, model: str, batch: int, profile: Profile, steps: int, warmup: int,
             budget_s: float, tune_k: int | None) -> dict:
    """One row: MWMS, tag's dp_allreduce and tag's plan for MODEL on the running testbed TB, and what the
    measured tuning step (``tag.tune.tune_plan``) keeps."""
    gd = tf1_graph(model, batch)
    plan = tag.optimize(gd, tb.topology, batch_size=batch, profile=profile, budget_s=budget_s, name=model)
    dp_res = tag.rewrite(gd, tb.topology, "dp_allreduce", batch_size=batch, profile=profile)
    tb.start_workers(threads_per_worker=1)
    try:
        dp = run_tag(tb, gd, dp_res, steps, warmup)
        planned = run_tag(tb, gd, plan, steps, warmup)
        t0 = time.perf_counter()
        guarded = tune_plan(plan, tb, k=tune_k)
        guard_s = time.perf_counter() - t0
    finally:
        tb.stop_workers()
    mwms = run_mwms(tb, model, batch, steps, warmup)
    overrode = guarded.method != plan.method
    row = {"config": name, "model": model, "batch": batch, "quotas": list(cfg["quotas"]),
           "links_gbps": list(cfg["links_gbps"]),
           "mwms_s": mwms, "dp_s": dp, "plan_s": planned, "plan_method": plan.method,
           "plan_device_groups": sorted({int(d) for a in plan.strategy.actions for d in a.placement}),
           "predicted_plan_s": plan.predicted_step_time, "predicted_dp_s": plan.baselines.get("dp_allreduce"),
           "speedup_vs_mwms": mwms / planned, "dp_over_mwms": dp / mwms,
           "guard_kept": guarded.method if overrode else plan.method, "guard_overrode": overrode,
           "guard_seconds": guard_s, "guard_note": guarded.notes[-1] if guarded.notes else "",
           "tune": guarded.report()["tune"],
           "load1": os.getloadavg()[0]}
    print(f"{name:<3} {model:<12} {batch:>4}  mwms {mwms * 1e3:8.1f} ms  dp {dp * 1e3:8.1f} ms  "
          f"plan {planned * 1e3:8.1f} ms (pred {plan.predicted_step_time * 1e3:7.1f}, {plan.method})  "
          f"speedup {row['speedup_vs_mwms']:5.2f}x  dp/mwms {row['dp_over_mwms']:4.2f}  "
          f"guard {'overrode: ' + row['guard_kept'] if overrode else 'kept the plan'} ({guard_s:.0f} s)  "
          f"load {row['load1']:.1f}", flush=True)
    from tag.report import format_tune
    for line in format_tune(row["tune"]):
        print(f"    tune: {line}", flush=True)
    return row


def run_config(recipe: dict, name: str, profile: Profile, cases, args) -> list[dict]:
    cfg = recipe["configs"][name]
    text, topo = testbed_topology(recipe, name, profile)
    rows = []
    with Testbed(topo, cpu_quota=cfg["quotas"]) as tb:
        tb.start_workers(threads_per_worker=1)
        try:
            profile = runtime_levels(tb, recipe, profile)
        finally:
            tb.stop_workers()
        if args.out_dir:   # the testbed's topology and calibrated profile, for tag-deploy / tag.optimize by hand
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"testbed-{name}.pbtxt"), "w") as f:
                f.write(text)
            profile.save(os.path.join(args.out_dir, f"profile-{name}.json"))
        for model, batch in cases:
            try:
                row = run_case(tb, cfg, name, model, batch, profile, args.steps, args.warmup, args.budget,
                               args.tune)
            except Exception as err:  # noqa: BLE001 - report the case and go on with the others
                tb.stop_workers()
                print(f"{name:<3} {model:<12} {batch:>4}  FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            rows.append(row)
    return rows


def geomean(values) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=np.float64)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the MLP on configuration A only")
    p.add_argument("--steps", type=int, default=13, help="steps per run (the first --warmup are not timed)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=20.0, help="tag.optimize search budget per case (s)")
    p.add_argument("--tune", type=int, default=None, metavar="K",
                   help="candidates the measured tuning step runs (default: as many as cost about 30 steps of "
                        "the slowest)")
    p.add_argument("--models", help="comma-separated subset of " + ",".join(m for m, _ in CASES))
    p.add_argument("--configs", help="comma-separated subset of the recipe's configurations")
    p.add_argument("--recipe", default=None, help="testbed recipe (default scripts/testbed_recipe.json)")
    p.add_argument("--json", help="write the rows and summary figures to this file (the profile beside it)")
    p.add_argument("--out-dir", help="also write each configuration's topology and the profile here")
    args = p.parse_args(argv)
    from _common import testbed_missing
    if testbed_missing("bench_e2e"):
        return 2
    recipe = load_recipe(args.recipe) if args.recipe else load_recipe()
    cases = CASES[:1] if args.quick else CASES
    configs = ["A"] if args.quick else list(recipe["configs"])
    if args.models:
        cases = [c for c in CASES if c[0] in args.models.split(",")]
    if args.configs:
        configs = [c for c in recipe["configs"] if c in args.configs.split(",")]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        profile = calibrate_testbed(recipe, workdir, configs)
    if args.json:
        profile.save(os.path.splitext(args.json)[0] + ".profile.json")
    rows = []
    for name in configs:
        rows += run_config(recipe, name, profile, cases, args)
    if not rows:
        print("bench_e2e: no case ran", file=sys.stderr)
        return 1
    g = geomean([r["speedup_vs_mwms"] for r in rows])
    w = min(r["speedup_vs_mwms"] for r in rows)
    dpm = geomean([r["dp_over_mwms"] for r in rows])
    overrides = sum(r["guard_overrode"] for r in rows)
    guard_s = float(np.mean([r["guard_seconds"] for r in rows]))
    print(f"\n{len(rows)} cases in {time.time() - t0:.0f} s: geomean speedup vs MWMS {g:.2f}x (target >= 1.5), "
          f"worst {w:.2f}x (>= 0.95), tag dp / MWMS {dpm:.2f} (<= 1.1); the guard overrode the simulator in "
          f"{overrides} of {len(rows)} cases, {guard_s:.1f} s per case")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "geomean_speedup_vs_mwms": g, "worst_speedup_vs_mwms": w, "dp_over_mwms": dpm,
                       "guard_overrides": overrides, "guard_mean_seconds": guard_s}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
