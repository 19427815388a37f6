"""End-to-end: tag's plan against the best a user can do with tf.distribute, on heterogeneous testbeds.

For every (testbed configuration, case), in one run and on the same testbed (network namespaces, HTB-shaped
links with one shared egress per NIC, CFS CPU quotas per host; ``tag_bench.testbed``), each figure the
median of at least 10 timed steps after warm-up (``--steps``/``--warmup``; a cheap step gets more, 20 s worth
and at most 45: ``MIN_TIMED_S``, ``MAX_TIMED_STEPS``; every worker one intra-op thread), the 1-minute load
average beside each row and the share of CPU time the VM's host stole during the row (``steal``, from
/proc/stat: noise the load average cannot see):

- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (RING collectives; the same tf_keras architecture,
  global batch and Adam; a ``tf.function`` step with ``strategy.run``; one worker per host with TF_CONFIG;
  ``tag_bench.mwms``) on every prefix of the hosts ordered fastest first (1, 2, ... all hosts: what a user
  with one fast and some slow machines would try by listing fewer workers). The best is ``mwms_best_s``
  (on ``mwms_best_hosts``), the all-hosts time is ``mwms_all_s``;
- ``uniform``: tag's best uniform action (one candidate action for every op group, the simulator's pick),
  measured: the best a user of tag could pick by hand;
- ``dp_all`` / ``dp_same``: tag's ``dp_allreduce`` over all hosts, and over the same hosts as MWMS's best
  set (one host: the whole graph on the fastest host's device);
- ``plan``: the plan ``tag.optimize`` returns (searched per-group actions, pipelines and built-ins), measured;
- ``tuned``: that plan after the measured tuning step (``tag.tune.tune_plan``, ``--tune K``: the plan, the
  best built-in, the best uniform action and the next fastest predicted candidates, in interleaved rounds;
  it looks at built-ins too), then measured as the others.
  tag's strategies of a case (uniform, dp_all, dp_same, plan, tuned) are timed together in
  ``INTERLEAVED_ROUNDS`` interleaved rounds, one measurement per program (strategies that run every op group
  on the same single devices, like the best uniform action and dp on one host, are one program): timed
  apart, one program measured 41 and 50 ms in one run. MWMS on every host prefix is timed in the same rounds,
  before tag's programs in even rounds and after them in odd ones (its workers started afresh each time, and
  tag's servers afresh before each of tag's programs: ``--fresh-servers``), so that drift between minutes falls
  on the anchors as on tag, and neither side keeps a process through the case that the other restarts. Why
  fresh servers per program: a deployment runs one plan on its servers, and each MWMS anchor is one program in
  fresh processes; until run 45 tag's one-host program shared its servers with the round's other programs, and
  its pair with MWMS on one host came out 0.89-1.11 over runs 37-45, while timed alone in fresh servers against
  MWMS in the same rounds (a host-drift probe; its figures are kept in docs/) it ran 552 against 552 ms and
  357 against 354 (the transformer and the VGG-style CNN at 384, medians of six rounds each, on December 3).
  A program on one device (dp on one host, a uniform action there) runs as a process of its own on its host,
  no server in between, as ``tag-deploy`` runs it (``tag.backend.runtime.measure.run_on``; run 55 on): through
  its server the transformer's one-device step ran 586 ms against 557 in a process of its own (run 54's probe).

Testbeds: ``tag_bench/testbed_recipe.json``'s configurations A (1.0 / 0.5 / 0.25 of a core; 1 Gbit/s between
the first two hosts, 0.2 Gbit/s to the third) and B (1.0 / 0.25 / 0.25; 0.3 Gbit/s), and G, a GPU cluster's
ratio of communication to computation: quotas 1.0 / 0.5 / 0.5 (bench_pipeline's) and every link at the rate
that gives the fastest host the bytes per FLOP of a V100 (15 TFLOP/s) on 25 Gbit/s Ethernet
(``--gpu-gbps``): ``25 Gbit/s * F / 15 TFLOP/s``, F the calibrated FLOP/s of the full-core host (e.g.
20 GFLOP/s -> 33 Mbit/s, 2.1e-4 bytes per FLOP). Hosts are listed fastest first, so MWMS's prefixes are the
fastest hosts. The topologies and profile come from the recipe (``tag_bench.cases``: ``tag-profile
--sustained`` per quota in a cgroup of that quota, the runtime's network costs, runtime levels on the
running testbed); every quota of G is one of A's, so G costs no extra calibration.

Cases (global batches divisible by 1, 2 and 3 hosts for MWMS): the three models of issue 11 (MLP
784-2048-2048-1024 at 96, a small ResNet at 48, a 2-layer transformer at 96, 48 until November 29),
``vgg`` (three stages of two 3x3 convolutions, 16/32/64 channels, then a 1024-1024 fully connected head: 97%
of the weights in the head, about 80% of the FLOPs in the convolutions; 96) and bench_pipeline's deep MLP
(20 x 2048; 384, 96 until bench_pipeline run 27) and transformer (8 layers, d=384; 12); ``--batch-scale 4``
gives the last three bench_pipeline's batches.

Summary keys (``--json``): ``geomean_speedup_vs_best_mwms`` and ``worst_speedup_vs_best_mwms`` (the tuned
plan against the best MWMS), ``mixed_wins`` (cases where a measured plan that is not a uniform action --
mixed per-group actions or a pipeline -- ran at least 1.10x faster than the best uniform action),
``worst_dp_over_mwms_same_hosts``, ``geomean_speedup_vs_mwms`` (the tuned plan against MWMS on all hosts),
``dp_over_mwms`` (geomean of dp_all / MWMS on all hosts), ``rows`` and ``provenance``. MWMS that fails on a
set of hosts is left out of that case's anchors (its row's ``mwms_failed`` says why, the table "failed"), and a
case where it failed on all hosts out of the last two keys. Needs root
(namespaces, tc, cgroup v1 cpu). The machine may be shared: compare the columns of a row, not rows of
different runs.

Usage::

    python scripts/bench_e2e.py                            # 6 cases x 3 configurations, with calibration
    python scripts/bench_e2e.py --quick                    # configuration G, the VGG-style CNN and the small CNN
    python scripts/bench_e2e.py --json e2e.json            # summary keys and rows; the profile in e2e.profile.json
    python scripts/bench_e2e.py --profile e2e.profile.json # reuse a calibration
    python scripts/bench_e2e.py --out-dir tb/              # also write tb/testbed-A.pbtxt, tb/profile-A.json, ...
    python scripts/bench_e2e.py --table e2e.json           # the README table of a saved result
    python scripts/bench_e2e.py --table a.json,b.json      # cases of several runs in one table (each row keeps its run)
    python scripts/bench_e2e.py --configs G --cases vgg --batch-scale 4   # more compute per byte of weights
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tag  # noqa: E402
from tag.backend.runtime.measure import run_on  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402
from tag.tune import BEST_UNIFORM, best_uniform_of, strategy_key, tune_plan  # noqa: E402
from tag_bench.cases import (  # noqa: E402
    E2E_CASES,
    GPU_CONFIG,
    GPU_QUOTAS,
    calibrate_testbed,
    config_recipe,
    load_recipe,
    main_configs,
    runtime_levels,
    split_steps,
    testbed_topology,
)
from tag_bench.describe import describe, hosts_used  # noqa: E402
from tag_bench.machine import cpu_times, load_text, steal_fraction, steal_text  # noqa: E402
from tag_bench.mwms import model_options, run_mwms, tf1_graph  # noqa: E402
from tag_bench.records import Run, commit_of, write_json  # noqa: E402
from tag_bench.stats import figure_text, geomean  # noqa: E402
from tag_bench.testbed import Testbed, testbed_missing  # noqa: E402

QUICK_CASES = ("vgg", "cnn")
MIXED_WIN = 1.10
TARGETS = {"geomean_speedup_vs_best_mwms": ">= 1.3", "worst_speedup_vs_best_mwms": ">= 0.97", "mixed_wins": ">= 3",
           "worst_dp_over_mwms_same_hosts": "<= 1.0"}


INTERLEAVED_ROUNDS = 4      # rounds in which tag's strategies of one case are timed in turn (3 until run 45)
FRESH_SERVER_MODES = ("program", "round", "case")   # when run_interleaved restarts tag's servers
MIN_TIMED_S = 20.0          # timed seconds each program gets at least (as steps allow), summed over the rounds
MAX_TIMED_STEPS = 45        # ... up to this many timed steps


def timed_steps_after_first_round(first_round: list[float], timed: int, min_timed_s: float = MIN_TIMED_S,
                                  max_timed: int = MAX_TIMED_STEPS) -> int:
    """How many timed steps a program gets in all (at least TIMED, the ``--steps`` share), given its timed step
    times of the first round: enough for MIN_TIMED_S seconds, at most MAX_TIMED (never below TIMED). Why: a
    one-host CNN step of 0.2 s timed 10 times swung its row by 10% between runs (run 40: MWMS on one host 189 ms
    and on three 190, tag's one-host program 208; run 41: 218 / 168 / 131), while a deep MLP's 7 s steps need no
    more than the 10 the issue asks. It narrows each median; it did not settle the one-host rows, whose ratio
    still moved between runs (run 42's transformer: 630 ms against MWMS's 581 over 35 steps each; run 41: 540
    against 609)."""
    if not first_round:
        return timed
    step = float(np.median(first_round))
    wanted = int(np.ceil(min_timed_s / step)) if step > 0 else max_timed
    return max(timed, min(wanted, max_timed))


def run_interleaved(tb: Testbed, runnables: dict, steps: int, warmup: int, rounds: int = INTERLEAVED_ROUNDS,
                    mwms: dict | None = None, fresh_servers: str = "program") -> tuple[dict, dict, dict]:
    """({key: median step} of every RUNNABLES value (key -> a ``tag.rewrite`` result or a Plan), {hosts: median
    step} of every MWMS anchor that ran (hosts -> (model, batch, model_args) for ``run_mwms``), {hosts: why} of
    every anchor that failed), timed in ROUNDS rounds that take the MWMS anchors and the runnables in turn
    (each side's order reversed every other round, and which side goes first too: ``round_order``), each
    round WARMUP untimed steps and its share of the timed ones: STEPS - WARMUP in all, or more for a cheap
    step (``timed_steps_after_first_round``: MIN_TIMED_S seconds, at most MAX_TIMED_STEPS), decided per
    program after the first round. Why: on this shared machine one program timed a few minutes apart measured
    41 and 50 ms, and MWMS on one host 211 and 250 ms (docs/measured/issue22-e2e);
    interleaving spreads the drift over tag's programs and the anchors alike. An anchor that fails is not run
    again: a user whose MWMS fails on a set of hosts runs it on another (run 38's deep MLP: MWMS on all three
    hosts, at 28 s a step over the slow links, aborted when TensorFlow's coordination service timed out a
    worker's heartbeat). FRESH_SERVERS (``FRESH_SERVER_MODES``): tag's TF servers are started afresh before each
    program (``program``: as a deployment runs one plan on its servers, and as MWMS's workers run one program),
    before every round's programs (``round``) or not at all (``case``: they live through the case, the tuning step
    and every round)."""
    timed = max(steps - warmup, rounds)
    per_round = split_steps(timed, rounds)
    samples: dict = {k: [] for k in runnables}
    anchors: dict = {k: [] for k in (mwms or {})}
    plans: dict = {}        # ("mwms" or "tag", key) -> timed steps of every round, set after the first round
    failed: dict = {}
    keys = list(runnables)

    def steps_in(which: str, k, done: list[float], r: int) -> int:
        """Timed steps of program K in round R: the first round's even share, then MIN_TIMED_S's worth."""
        if r == 0:
            return per_round[0]
        if (which, k) not in plans:
            total = timed_steps_after_first_round(done, timed)
            plans[which, k] = [per_round[0]] + split_steps(max(total - len(done), rounds - 1), rounds - 1)
        return plans[which, k][r]

    def run_anchors(r: int) -> None:
        for k in round_order(r, list(anchors)):
            if k in failed:
                continue
            model, batch, model_args = mwms[k]
            try:
                n = steps_in("mwms", k, anchors[k], r)
                anchors[k] += run_mwms(tb, model, batch, warmup + n, warmup, hosts=k, model_args=model_args)
            except RuntimeError as err:
                failed[k] = " ".join(str(err).split())[-500:]
                print(f"    MWMS on {k} host(s) failed, not run again: {failed[k][-300:]}", flush=True)

    def restart_servers() -> None:
        tb.stop_workers()
        tb.start_workers(threads_per_worker=1)

    def run_tag(r: int) -> None:
        if fresh_servers == "round":
            restart_servers()
        for k in round_order(r, keys):
            if fresh_servers == "program":
                restart_servers()
            x = runnables[k]
            n = steps_in("tag", k, samples[k], r)
            res = run_on(tb, x, steps=warmup + n, warmup=warmup)
            samples[k] += list(res.step_times[warmup:])

    for r in range(rounds):
        for block in round_order(r, [run_anchors, run_tag]):
            block(r)
    print(f"    timed steps: MWMS {', '.join(f'{k} host(s) {len(v)}' for k, v in anchors.items() if k not in failed)}; "
          f"tag {', '.join(str(len(v)) for v in samples.values())}", flush=True)
    return ({k: float(np.median(v)) for k, v in samples.items()},
            {k: float(np.median(v)) for k, v in anchors.items() if k not in failed}, failed)


def round_order(r: int, items: list) -> list:
    """ITEMS in the order they run in interleaved round R: as given in even rounds, reversed in odd ones. Used
    for the programs of each side and for the two sides (MWMS's anchors, tag's programs), so that nothing always
    follows the same neighbour (run 42's transformer measured tag's one-host program 8% slower than MWMS on
    that host, always timed right after MWMS's workers exited)."""
    return list(items) if r % 2 == 0 else list(items)[::-1]


def uniform_keys(analysis) -> set[str]:
    """``action_key`` of every uniform action of ANALYSIS: each search candidate applied to every op group
    (where it is not allowed, the group's first allowed one, as ``tag.search.driver.best_uniform`` takes it),
    every built-in and dp_allreduce over each prefix of the hosts."""
    from tag.search import SearchEnv
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch, simulator=analysis.simulator())
    keys = {action_key(env.strategy(env.uniform_choice(k))) for k in range(len(env.candidates))}
    keys |= {action_key(analysis.builtin(n)) for n in BUILTIN_STRATEGIES}
    keys |= {action_key(host_prefix_strategy(analysis, k)) for k in range(1, len(analysis.topology.hosts) + 1)}
    return keys


def action_key(strategy: Strategy) -> str:
    """``strategy_key`` of STRATEGY's actions, whatever its gradient buckets: data parallelism with 256 KB buckets
    is still one action for every op group (run 39 counted the CNN's bucketed ``dp_allreduce`` as a mixed plan)."""
    return strategy_key(dataclasses.replace(strategy, bucket_bytes=None))


def host_prefix_strategy(analysis, hosts: int) -> Strategy:
    """dp_allreduce over the first HOSTS hosts (what MWMS on those hosts runs); one host: every op on its
    first device."""
    topo = analysis.topology
    if hosts == 1:
        from tag.strategy.baselines import on_one_device
        first = next(g for g in topo.groups if g.host == topo.hosts[0].name)
        return on_one_device(analysis.grouping, topo, len(analysis.graph.ops), first.devices[0], name="dp1")
    first = {h.name for h in topo.hosts[:hosts]}
    groups = tuple(g.index for g in topo.groups if g.host in first)
    return Strategy(analysis.grouping, [Action(groups, "allreduce")] * analysis.grouping.num_groups,
                    name=f"dp{hosts}")


def run_case(tb: Testbed, cfg: dict, config: str, case: tuple, profile: Profile, args) -> dict:
    """One row: MWMS on every host prefix, then tag's uniform, dp, plan and tuned plan on the running testbed."""
    label, model, batch, width, depth = case
    model_args = model_options(width, depth)
    steps, warmup = args.steps, args.warmup
    stolen_from = cpu_times()
    gd = tf1_graph(model, batch, width=width, depth=depth)
    t0 = time.perf_counter()
    plan = tag.optimize(gd, tb.topology, batch_size=batch, profile=profile, budget_s=args.budget, name=label)
    search_s = time.perf_counter() - t0
    an = plan.analysis
    n_hosts = len(tb.topology.hosts)
    uniform = plan.candidates.get(BEST_UNIFORM) or best_uniform_of(an)[0]
    # dp over every prefix of the hosts: the one on MWMS's best hosts is dp_same (known once MWMS is measured)
    strategies = {"uniform": uniform, "dp_all": an.builtin("dp_allreduce"), "plan": plan.strategy,
                  **{f"dp{k}": host_prefix_strategy(an, k) for k in range(1, n_hosts)}}
    tb.start_workers(threads_per_worker=1)
    try:
        t1 = time.perf_counter()
        tuned = tune_plan(plan, tb, k=args.tune)
        tune_s = time.perf_counter() - t1
        strategies["tuned"] = tuned.strategy
        # one measurement per program (strategies that run on the same single devices are one), interleaved
        # with MWMS on every host prefix
        key_of = {name: strategy_key(s, tb.topology) for name, s in strategies.items()}
        runnables: dict[str, object] = {}
        for name, s in strategies.items():
            runnables.setdefault(key_of[name], plan if name == "plan" else tuned if name == "tuned" else an.rewrite(s))
        measured, mwms, mwms_failed = run_interleaved(
            tb, runnables, steps, warmup, mwms={k: (model, batch, model_args) for k in range(1, n_hosts + 1)},
            fresh_servers=args.fresh_servers)
        times = {name: measured[key_of[name]] for name in strategies}
    finally:
        tb.stop_workers()
    if not mwms:
        raise RuntimeError(f"MWMS failed on every set of hosts: {mwms_failed[n_hosts]}")
    best_k = min(mwms, key=mwms.get)     # of the sets of hosts it ran on
    mwms_all = mwms.get(n_hosts)         # None: it failed on all of them
    same = "dp_all" if best_k == n_hosts else f"dp{best_k}"
    times["dp_same"], strategies["dp_same"] = times[same], strategies[same]
    uniform_set = uniform_keys(an)
    # a uniform action, or everything on one host (modes mixed on one device are not a mixed plan)
    is_uniform = {n: action_key(s) in uniform_set or len(hosts_used(s, tb.topology)) == 1
                  for n, s in strategies.items()}
    mixed = {n: times[n] for n in ("plan", "tuned") if not is_uniform[n]}
    best_mixed = min(mixed.values()) if mixed else None
    row = {"config": config, "case": label, "model": model, "batch": batch, "width": width, "depth": depth,
           "quotas": list(cfg["quotas"]), "links_gbps": list(cfg["links_gbps"]),
           "mwms_s": {str(k): mwms.get(k) for k in range(1, n_hosts + 1)}, "mwms_best_hosts": best_k,
           "mwms_best_s": mwms[best_k], "mwms_all_s": mwms_all,
           "mwms_failed": {str(k): why for k, why in mwms_failed.items()},
           "uniform_s": times["uniform"], "uniform": describe(uniform, tb.topology),
           "dp_all_s": times["dp_all"], "dp_same_s": times["dp_same"],
           "plan_s": times["plan"], "plan_method": plan.method, "plan": describe(plan.strategy, tb.topology),
           "predicted_plan_s": plan.predicted_step_time,
           "tuned_s": times["tuned"], "tuned_method": tuned.method, "tuned": describe(tuned.strategy, tb.topology),
           "tuned_is_uniform": is_uniform["tuned"], "plan_is_uniform": is_uniform["plan"],
           "tune_seconds": tune_s, "search_seconds": search_s, "tune": tuned.report()["tune"],
           "speedup_vs_best_mwms": mwms[best_k] / times["tuned"],
           "speedup_vs_mwms": None if mwms_all is None else mwms_all / times["tuned"],
           "plan_speedup_vs_best_mwms": mwms[best_k] / times["plan"],
           "dp_over_mwms": None if mwms_all is None else times["dp_all"] / mwms_all,
           "dp_same_over_mwms": times["dp_same"] / mwms[best_k],
           "mixed_over_uniform": None if best_mixed is None else times["uniform"] / best_mixed,
           "mixed_win": best_mixed is not None and times["uniform"] / best_mixed >= MIXED_WIN,
           "steps": steps, "warmup": warmup, "load": list(os.getloadavg()),
           "steal": steal_fraction(stolen_from, cpu_times())}
    print(f"{config:<2} {label:<12} {batch:>3}  mwms {'/'.join(anchor_texts(row['mwms_s']))} ms "
          f"(best {best_k})  uniform {times['uniform'] * 1e3:7.1f}  dp {times['dp_all'] * 1e3:7.1f} "
          f"dp_same {times['dp_same'] * 1e3:7.1f}  plan {times['plan'] * 1e3:7.1f} "
          f"(pred {plan.predicted_step_time * 1e3:6.1f}, {plan.method})  tuned {times['tuned'] * 1e3:7.1f} "
          f"({tuned.method}, {tune_s:.0f} s)  vs best mwms {row['speedup_vs_best_mwms']:.2f}x  "
          f"mixed/uniform {row['mixed_over_uniform'] or 0:.2f}  load {row['load'][0]:.1f}{steal_text(row['steal'])}",
          flush=True)
    print(f"    plan: {row['plan']}; tuned: {row['tuned']}; uniform: {row['uniform']}", flush=True)
    from tag.report import format_tune
    for line in format_tune(row["tune"]):
        print(f"    tune: {line}", flush=True)
    return row


def run_config(recipe: dict, name: str, profile: Profile, cases, args, rows: list[dict], saved) -> None:
    """Every case of E2E_CASES on configuration NAME's testbed, each row appended to ROWS, then SAVED()."""
    cfg = recipe["configs"][name]
    if list(cfg["quotas"]) != sorted(cfg["quotas"], reverse=True):
        raise SystemExit(f"bench_e2e: configuration {name}: hosts must be listed fastest first")
    text, topo = testbed_topology(recipe, name, profile)
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
        for case in cases:
            try:
                rows.append(run_case(tb, cfg, name, case, profile, args))
                saved()
            except Exception as err:  # noqa: BLE001 - report the case and go on with the others
                tb.stop_workers()
                print(f"{name:<2} {case[0]:<12} FAILED: {type(err).__name__}: {' '.join(str(err).split())[:1500]}",
                      flush=True)


def anchor_texts(mwms_s: dict) -> list[str]:
    """Each MWMS anchor's step in ms, in host-count order; "failed" where it did not run."""
    return ["failed" if v is None else f"{v * 1e3:.0f}" for v in mwms_s.values()]


def without_buckets(text: str) -> str:
    """A ``describe`` text without its gradient buckets ("allreduce@h0+h1 x9 (256 KB buckets)" -> "allreduce@h0+h1
    x9"): the same actions for every op group are one uniform action, whatever the buckets (rows saved before
    ``action_key`` flagged a bucketed data parallelism as not uniform)."""
    return re.sub(r" \([^()]* buckets\)$", "", text)


def mixed_over_uniform(row: dict) -> float | None:
    """The best uniform action's time over the fastest measured plan of ROW (the plan or the tuned plan)
    that is not a uniform action and runs on more than one host; None when there is none."""
    mixed = [row[f"{n}_s"] for n in ("plan", "tuned")
             if not row[f"{n}_is_uniform"] and not row[n].startswith("one device on")
             and without_buckets(row[n]) != without_buckets(row["uniform"])]
    return row["uniform_s"] / min(mixed) if mixed else None


def summary(rows: list[dict]) -> dict:
    for r in rows:
        r["mixed_over_uniform"] = mixed_over_uniform(r)
        r["mixed_win"] = r["mixed_over_uniform"] is not None and r["mixed_over_uniform"] >= MIXED_WIN
    def known(key: str) -> list[float]:       # an anchor that failed on all hosts has no ratio to it
        return [r[key] for r in rows if r.get(key) is not None]

    return {"geomean_speedup_vs_best_mwms": geomean([r["speedup_vs_best_mwms"] for r in rows]),
            "worst_speedup_vs_best_mwms": min(r["speedup_vs_best_mwms"] for r in rows),
            "mixed_wins": sum(bool(r["mixed_win"]) for r in rows),
            "worst_dp_over_mwms_same_hosts": max(r["dp_same_over_mwms"] for r in rows),
            "geomean_speedup_vs_mwms": geomean(known("speedup_vs_mwms")),
            "dp_over_mwms": geomean(known("dp_over_mwms")),
            "geomean_plan_speedup_vs_best_mwms": geomean([r["plan_speedup_vs_best_mwms"] for r in rows]),
            "tune_overrides": sum(r["tuned_method"] != r["plan_method"] for r in rows),
            "tune_mean_seconds": float(np.mean([r["tune_seconds"] for r in rows])),
            "cases": len(rows)}


def markdown_table(result: dict) -> str:
    """The README's table of a ``--json`` RESULT: both MWMS anchors, tag's uniform / dp / plan / tuned times
    (ms), the speedups, what the tuned plan runs and the load average."""
    head = ("| config | case (batch) | MWMS 1 / 2 / 3 hosts | MWMS best | uniform | dp same hosts | plan | tuned "
            "| vs best MWMS | vs MWMS all | mixed / uniform | the tuned plan runs | load |\n" + "|---" * 13 + "|")
    lines = [head]
    for r in result["rows"]:
        tuned = r["tuned"].replace("|", "\\|")      # a pipeline's stages are listed with "|"
        vs_all = figure_text(r.get("speedup_vs_mwms"), ".2f", "x")
        mixed = "" if r["mixed_over_uniform"] is None else f"{r['mixed_over_uniform']:.2f}" + \
            (" (win)" if r["mixed_win"] else "")
        lines.append(
            f"| {r['config']} | {r['case']} ({r['batch']}) | {' / '.join(anchor_texts(r['mwms_s']))} "
            f"| {r['mwms_best_s'] * 1e3:.0f} ({r['mwms_best_hosts']}) | {r['uniform_s'] * 1e3:.0f} "
            f"| {r['dp_same_s'] * 1e3:.0f} | {r['plan_s'] * 1e3:.0f} ({r['plan_method']}) "
            f"| {r['tuned_s'] * 1e3:.0f} ({r['tuned_method']}) | {r['speedup_vs_best_mwms']:.2f}x "
            f"| {vs_all} | {mixed} | {tuned} | {r['load'][0]:.1f} |")
    return "\n".join(lines)


def combined_results(paths: list[str]) -> dict:
    """The saved ``--json`` result of PATHS[0], or with several PATHS their rows in one result: each row gets
    its run's ``run_commit`` and ``run_file``, and ``runs`` lists every run's file, commit, seconds and whether it
    completed. Raises ValueError when a case is in more than one run (which row would count?), OSError and
    ValueError on a file that is not a saved result."""
    results = []
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
            raise ValueError(f"{path}: not a saved bench_e2e --json result (no rows)")
        results.append(result)
    if len(results) == 1:
        return results[0]
    rows, seen = [], {}
    for path, result in zip(paths, results, strict=True):
        for row in result["rows"]:
            key = (row["config"], row["case"], row["batch"])
            if key in seen:
                raise ValueError(f"{row['config']}/{row['case']} at batch {row['batch']} is in both {seen[key]} "
                                 f"and {path}")
            seen[key] = path
            rows.append({**row, "run_commit": commit_of(result), "run_file": os.path.basename(path)})
    runs = [{"file": os.path.basename(p), "commit": commit_of(r), "provenance": r.get("provenance"),
             "seconds": r.get("seconds"),
             "complete": r.get("complete"), "cases": len(r["rows"])} for p, r in zip(paths, results, strict=True)]
    return {**{k: v for k, v in results[0].items() if k not in ("rows", "commit", "provenance", "seconds", "complete")},
            "runs": runs, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="configuration G, the VGG-style CNN and the small CNN")
    p.add_argument("--steps", type=int, default=13, help="steps per run (the first --warmup are not timed)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=20.0, help="tag.optimize search budget per case (s)")
    p.add_argument("--fresh-servers", choices=FRESH_SERVER_MODES, default="program",
                   help="start tag's TF servers afresh before each program it times (program, the default since "
                        "run 46), before every interleaved round's programs (round, runs 44-45) or never (case)")
    p.add_argument("--no-fresh-servers", dest="fresh_servers", action="store_const", const="case",
                   help="the same as --fresh-servers case: the servers live through the case")
    p.add_argument("--tune", type=int, default=None, metavar="K",
                   help="candidates the measured tuning step runs (default: as many as cost about 30 steps of "
                        "the slowest)")
    p.add_argument("--gpu-gbps", type=float, default=25.0,
                   help="configuration G: the GPU cluster's Ethernet rate whose bytes per FLOP its links keep")
    p.add_argument("--batch-scale", type=int, default=1, metavar="K",
                   help="multiply every case's global batch by K (more compute per byte of weights)")
    p.add_argument("--cases", help="comma-separated subset of " + ",".join(c[0] for c in E2E_CASES))
    p.add_argument("--configs", help="comma-separated subset of A,B,G")
    p.add_argument("--recipe", default=None, help="testbed recipe (default tag_bench/testbed_recipe.json)")
    p.add_argument("--profile", help="a saved calibration (Profile JSON) instead of calibrating")
    p.add_argument("--json", help="write the rows and summary figures to this file (the profile beside it)")
    p.add_argument("--out-dir", help="also write each configuration's topology and the profile here")
    p.add_argument("--table", metavar="JSON[,JSON...]",
                   help="print the README table and summary of saved --json results: several files (comma-separated) "
                        "are combined case by case, each row keeping its run's commit and file (with --json F: "
                        "write the result to F with the summary recomputed)")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    if args.table:
        try:
            result = combined_results(args.table.split(","))
            result.update(summary(result["rows"]))   # the summary keys as this version computes them
            table = markdown_table(result)
        except (OSError, ValueError) as err:
            print(f"bench_e2e --table: {err}", file=sys.stderr)
            return 2
        except KeyError as err:
            print(f"bench_e2e --table {args.table}: a row has no key {err} (not a saved bench_e2e --json result)",
                  file=sys.stderr)
            return 2
        print(table)
        print("\n" + json.dumps({k: v for k, v in result.items() if k != "rows" and not isinstance(v, dict)}))
        write_json(args.json, result, this_run, indent=2)   # one saved run keeps its own provenance
        return 0
    if args.steps - args.warmup < 10:
        p.error("--steps minus --warmup must leave at least 10 timed steps")
    if testbed_missing("bench_e2e"):
        return 2
    recipe = load_recipe(args.recipe) if args.recipe else load_recipe()
    configs = [GPU_CONFIG, *main_configs(recipe)]     # the held-out configurations are bench_fidelity's
    cases = E2E_CASES
    if args.quick:
        configs, cases = [GPU_CONFIG], [c for c in E2E_CASES if c[0] in QUICK_CASES]
    if args.cases:
        cases = [c for c in E2E_CASES if c[0] in args.cases.split(",")]
    if args.configs:
        configs = [c for c in configs if c in args.configs.split(",")]
    if args.batch_scale != 1:
        if args.batch_scale < 1:
            p.error("--batch-scale must be a positive integer")
        cases = [(label, model, batch * args.batch_scale, w, d) for label, model, batch, w, d in cases]
    t0 = time.time()
    print(f"commit {this_run.commit}; load {load_text()}", flush=True)
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        # every quota the run's configurations use, G's included (its links need the profile; its quotas not)
        cal_recipe = {**recipe, "configs": {**recipe["configs"],
                                            GPU_CONFIG: {"quotas": GPU_QUOTAS, "links_gbps": [1.0] * 3}}}
        with tempfile.TemporaryDirectory() as workdir:
            profile = calibrate_testbed(cal_recipe, workdir, configs)
    if args.json:
        profile.save(os.path.splitext(args.json)[0] + ".profile.json")
    recipe = config_recipe(recipe, profile, args.gpu_gbps)
    g = recipe["configs"][GPU_CONFIG]
    print(f"configuration G: links {g['links_gbps'][0] * 1e3:.1f} Mbit/s ({args.gpu_gbps:g} Gbit/s per 15 TFLOP/s "
          f"GPU, {args.gpu_gbps / 8e-9 / 15e12:.2e} bytes per FLOP)", flush=True)
    rows: list[dict] = []

    def save(final: bool) -> None:
        """The JSON so far (after every row, so that a run stopped at a deadline keeps its finished cases)."""
        if rows:
            write_json(args.json, {**summary(rows), "targets": TARGETS, "complete": final,
                           "seconds": time.time() - t0, "gpu_gbps": args.gpu_gbps, "fresh_servers": args.fresh_servers,
                           "configs": {n: recipe["configs"][n] for n in configs}, "profile_source": profile.source,
                           "rows": rows}, this_run, indent=2)

    for name in configs:
        run_config(recipe, name, profile, cases, args, rows, lambda: save(False))
    if not rows:
        print("bench_e2e: no case ran", file=sys.stderr)
        return 1
    s = summary(rows)
    print(f"\n{len(rows)} cases in {time.time() - t0:.0f} s: tuned plan vs best MWMS geomean "
          f"{s['geomean_speedup_vs_best_mwms']:.2f}x (target >= 1.3), worst {s['worst_speedup_vs_best_mwms']:.2f}x "
          f"(>= 0.97); mixed wins {s['mixed_wins']} (>= 3); worst dp / MWMS on MWMS's best hosts "
          f"{s['worst_dp_over_mwms_same_hosts']:.2f} (<= 1.0); vs MWMS on all hosts "
          f"{figure_text(s['geomean_speedup_vs_mwms'], '.2f', 'x')}, dp / MWMS all hosts "
          f"{figure_text(s['dp_over_mwms'])}; "
          f"the tuning step "
          f"overrode the plan in {s['tune_overrides']} cases ({s['tune_mean_seconds']:.0f} s per case); "
          f"load {load_text()}")
    save(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
