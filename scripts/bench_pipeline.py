"""Pipelines measured: tag's pipelined plan vs its best uniform action vs tf.distribute, on a testbed whose
links carry what a GPU cluster's do per FLOP.

The testbed (``tag_bench.testbed``): three hosts in network namespaces with CFS CPU quotas ``QUOTAS``
(one fast host, two half-speed ones: every host has to be used to go faster than the fast one) and one
shaped link rate between every pair. How the links are sized: a V100 sustains about 15 TFLOP/s
(``GPU_FLOPS``) and a GPU cluster's hosts talk over 10-25 Gbit/s Ethernet, so a GPU cluster moves
``gpu_gbps / 8 / 15e12`` bytes per FLOP (8.3e-5 B/FLOP at 10 Gbit/s, 2.1e-4 at 25). The testbed keeps that
ratio: each link's rate is ``gpu_gbps * F / 15e12`` where F is the calibrated FLOP/s of the fastest
quota (e.g. 20 GFLOP/s and 25 Gbit/s -> 33 Mbit/s). The models are sized (``CASES``) so that the
activations crossing a stage boundary take less time on such a link than the stage's work, as in deep models
on GPU clusters (bytes per FLOP at a boundary of an MLP of width W with L layers per stage: 8W / (6 L W^2); a
20 x 2048 MLP at 3 stages: 9.8e-5; a d-wide transformer encoder: about 8d / (72 d^2 L), 1.1e-4 for 8 layers
of d=384 at 3 stages; BERT-large's 24 layers of d=1024 on 4 GPUs: 1.8e-5), with micro-batches large enough
to run near the host's full rate, at global batches where one host alone takes seconds (the transformer
about three at 96, the deep MLP about nine at 1536: at 384 its 48-row micro-batches ran below the MatMuls'
full rate, see ``CASES``);
all-reducing their weights over the same links takes tens of seconds. The third case, a VGG-style CNN
whose fully connected head holds 97% of the weights and whose convolutions do about 80% of the FLOPs, is
the shape where mixing must win: its convolutions want every host (few weights to all-reduce), its head one
host (too many), at a batch (384) where one host takes about 300 ms.

Calibration as the other testbed benchmarks do it (``tag_bench.cases``: ``tag-profile --sustained``
per quota with the recipe's calibration models, the runtime's network costs, then ``runtime_levels`` on the
running testbed); ``--profile F`` reuses a saved calibration (``--save-profile F`` writes one).
The runtime levels are also fitted on steps timed while the other hosts run their own copies, and the
simulator applies them to steps that keep other hosts busy (the recipe's ``calibration.levels_under_load``;
the testbed's hosts share one machine; ARCHITECTURE.md, "Hosts that share one machine"); ``--levels-alone``
fits the alone levels only.

Per case, side by side on one running testbed (every time the median of the timed steps; every worker one
intra-op thread):

- ``pipeline``: the fastest pipeline tag's search predicts (stages, devices, micro-batches, schedule; simulated),
  rewritten by ``tag.rewrite`` and run on TF servers in the namespaces: ``tag.search.pipeline_dp``'s answer, or
  the tree search's when it is predicted faster (``tag.search.search`` with ``--search-budget`` seconds, as
  ``tag.optimize`` runs it: the DP's pipelines are root candidates of the tree and each stage's action is chosen
  below them, so a stage may be replicated on another device set or mode than the DP gave it; the row's
  ``pipeline_source`` says which, ``predicted_pipeline_dp_s`` keeps the DP's prediction);
- ``uniform``: tag's best uniform action (``tag.search.best_uniform``: one candidate action for every op group);
- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (``tag_bench.mwms``, the same tf_keras
  architecture, batch and Adam) on every prefix of the hosts, fastest first, the best kept; its prediction is
  tag's simulation of ``dp_allreduce`` on the same hosts. A host set predicted over ``SKIP_FACTOR`` times
  slower than MWMS measured on one host is not run (all-reducing every weight over these links takes tens
  of seconds a step) and listed as skipped;
- ``schedule_ablation``: the searched pipeline's stages and M under the other way of computing weight
  gradients (``deferred_w`` against ``fill_drain``; a searched ``1f1b`` against ``deferred_w``), so
  ``deferred_w_speedup`` (measured: the time of the schedule that is not ``deferred_w`` over deferred_w's)
  says what deferring them gives on its own;
- ``tuned``: the measured tuning step as ``tag-deploy --run --tune`` runs it (``tag.tune``, default K) over the
  pipeline, the DP's pipeline when the tree's was chosen, the best uniform action, the DP's best pipeline of
  each other micro-batch count and its pipeline under each other schedule
  (``tag.search.pipeline_dp.pipeline_alternatives``; from run 20); the one it keeps is timed again in the
  interleaved rounds (``tuned_over_best_uniform``, ``tuned_over_best_mwms``);
- ``hand pipeline``: a hand-made pipeline (one stage per host, cuts by FLOPs in proportion to the quotas,
  ``--hand-micro-batches``), to tell the runtime's pipelining apart from the search's choice;
- ``max_rel_weight_diff``: one pipelined step on the testbed against the original graph on one local device,
  the same batch: the largest difference of a trainable weight, relative to the weight's largest magnitude;
  ``max_rel_grad_diff`` the same for the whole-batch gradients the optimizer ops take (``weight_diff`` says
  why both); variables whose gradient is zero by construction (attention key biases) are left out of both,
  as in the unit tests, and listed under ``zero_gradient_variables``. Both are measured on the same model
  built in float64 with the same pipeline (``exactness_float64``: float32 rounding of a deep ReLU network
  alone reaches 1e-2 of a gradient); the float32 graph's figures are kept as ``*_float32``.

Needs root (namespaces, tc, cgroup v1 cpu). The machine is shared: the load average is printed per case, and
the share of CPU time the VM's host stole while the case ran (``steal``, from /proc/stat).

Usage::

    python scripts/bench_pipeline.py                          # 3 cases; calibration included (~1 hour)
    python scripts/bench_pipeline.py --quick                  # the MLP only
    python scripts/bench_pipeline.py --json F --save-profile P   # F: rows and the issue's keys
    python scripts/bench_pipeline.py --profile P              # reuse a calibration

JSON keys: ``pipeline_over_best_uniform`` (measured, geomean over cases), ``pipeline_over_best_mwms``,
``median_abs_rel_error_pipeline``, ``max_rel_weight_diff``, ``max_rel_grad_diff``, ``max_micro_batch_rounding``
(``micro_batch_rounding``: what float32 summation order alone changes in the same architecture's gradients on
one device, M micro-batches against the whole batch), ``deferred_w_speedup`` (geomean of the rows'),
``tuned_over_best_uniform`` and ``tuned_over_best_mwms`` (geomeans, after the tuning step), ``rows``, ``link_gbps``,
``quotas``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from itertools import pairwise

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tag.api import prepare  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
from tag.search.driver import best_uniform, search  # noqa: E402
from tag.search.env import SearchEnv  # noqa: E402
from tag.search.pipeline_dp import pipeline_alternatives, pipeline_dp  # noqa: E402
from tag.strategy.pipeline import DEFERRED_W, Pipeline  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402
from tag.tune import BEST_UNIFORM, candidate_runner, choose, distinct_candidates, tune  # noqa: E402
from tag_bench.cases import (  # noqa: E402
    GPU_FLOPS,
    calibrate_testbed,
    device_type,
    gpu_ratio_link_gbps,
    load_recipe,
    measure_interleaved,
    runtime_levels,
    testbed_topology,
)
from tag_bench.exactness import exactness_float64, micro_batch_rounding, weight_diff  # noqa: E402
from tag_bench.machine import cpu_times, load_text, steal_fraction, steal_text  # noqa: E402
from tag_bench.mwms import model_options, run_mwms, tf1_graph  # noqa: E402
from tag_bench.records import Run, write_json  # noqa: E402
from tag_bench.stats import geomean  # noqa: E402
from tag_bench.testbed import Testbed, testbed_missing  # noqa: E402

QUOTAS = [1.0, 0.5, 0.5]     # CPU cores per host, fastest first
# (label, tag_bench.mwms model, width, depth, global batch: divisible by 1, 2 and 3 hosts for MWMS)
# Sized so that using every host must pay (the issue's condition), by the simulator on a saved calibration
# before any of them was measured: a micro-batch must be large enough that its MatMuls run near the CPU's
# full rate (one intra-op thread: 2048 x 2048 MatMuls at 77 GFLOP/s for 48 rows, 99 for 192, 104 for 384)
# and that per-op costs (tens of microseconds per kernel per micro-batch) stay small beside each op's work;
# and a stage must hold enough layers that its boundary moves little per FLOP. Until run 13 the cases were a
# 10 x 2048 MLP at batch 48, a 4-layer d=384 transformer at batch 12 and the VGG at 192, where the
# simulator predicted no pipeline faster than one host (0.88x measured in run 13, predicted within 3%).
# From run 27 the deep MLP runs at batch 1536 (384 until run 26): at 384 the simulator's best pipeline needs
# M >= 8 to shrink the three stages' bubble, and then each micro-batch is 48 rows, where its MatMuls run at
# three quarters of the rate; on run 26's calibration (before any measurement at 1536) the searched pipeline
# was predicted 1.02x one host at 384, 1.32x at 768 (M=4) and 1.57x at 1536 (M=8: 192-row micro-batches).
# From run 28 the transformer runs at batch 96 (48 until run 27), as bench_e2e's deep transformer does since
# December 1: at 48 its pipeline measured 0.97x one host here (run 26) and 0.97-1.15x in bench_e2e's G runs,
# within their noise; at 96 bench_e2e's G run of December 1 measured the same 3-stage pipeline (M=16) 1.27x
# faster than one host.
CASES = [
    ("deep-mlp", "mlp", 2048, 20, 1536),
    ("transformer", "transformer", 384, 8, 96),
    # a VGG-style CNN with a large fully connected head (tag_bench.mwms "vgg": 97% of the weights in the
    # head, ~80% of the FLOPs in the convolutions): the convolutions want every host, the head one host
    ("vgg", "vgg", None, None, 384),
]
SKIP_FACTOR = 10.0           # an MWMS host set predicted this much slower than MWMS on one host is not run
TARGETS = {"pipeline_over_best_uniform": 1.25, "best_case": 1.4, "median_abs_rel_error_pipeline": 0.15,
           "max_rel_weight_diff": 1e-5}


def tuning_step(an, tb: Testbed, pipe: Strategy, pipe_pred: float, uniform: Strategy, uni_pred: float, found):
    """``tag.tune`` on the running testbed as ``tag-deploy --run --tune`` does it (default K): the pipeline (the
    plan), the DP's answer when the plan is the tree search's pipeline, the best uniform action and
    ``pipeline_alternatives`` (other micro-batch counts, other schedules); the TuneResult."""
    strategies = {"pipeline": pipe, BEST_UNIFORM: uniform}
    predicted = {"pipeline": pipe_pred, BEST_UNIFORM: uni_pred}
    if found.strategy is not pipe:
        strategies["pipeline_dp"], predicted["pipeline_dp"] = found.strategy, found.outcome.step_time
    for name, (alternative, outcome) in pipeline_alternatives(found).items():
        strategies[name], predicted[name] = alternative, outcome.step_time
    chosen = choose(distinct_candidates("pipeline", strategies, predicted, {}, an.topology), None)
    return tune(chosen, candidate_runner(an, tb.target))


def hand_pipeline(env: SearchEnv, micro_batches: int, quotas: list[float], schedule: str = "1f1b") -> Strategy:
    """A hand-made pipeline, as a check of what the runtime does apart from the search: one stage per host
    (fastest first), the op groups in forward dependency order cut where each stage's share of the forward
    and backward FLOPs is closest to its host's share of the quotas."""
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tag_bench.exactness import forward_group_order
    order, rest = forward_group_order(env.graph, env.grouping)
    flops = np.zeros(env.grouping.num_groups)
    for i, op in enumerate(env.graph.ops):
        if op.phase in ("forward", "backward"):
            flops[int(env.grouping.group_of_op[i])] += op.flops.at(env.batch_size)
    cum = np.cumsum([flops[g] for g in order]) / max(flops.sum(), 1.0)
    targets = np.cumsum(quotas)[:-1] / sum(quotas)
    cuts = [0]
    for t in targets:
        cuts.append(max(cuts[-1] + 1, int(np.argmin(np.abs(cum - t))) + 1))
    cuts.append(len(order))
    stages = [list(order[a:b]) for a, b in pairwise(cuts)]
    stages[-1] += rest
    hosts = [g.index for g in env.topology.groups]
    pipe = Pipeline(tuple(PipelineStage(tuple(st), (hosts[s],)) for s, st in enumerate(stages)), micro_batches,
                    schedule)
    return Strategy.pipelined(env.grouping, pipe, name="hand_pipeline")


def host_prefix_strategy(env: SearchEnv, hosts: int) -> Strategy:
    """dp_allreduce over the first HOSTS hosts (every op group): what MWMS on those hosts runs."""
    first = {h.name for h in env.topology.hosts[:hosts]}
    groups = tuple(g.index for g in env.topology.groups if g.host in first)
    return Strategy(env.grouping, [Action(groups, "allreduce")] * env.grouping.num_groups, name=f"dp{hosts}")


def run_case(tb: Testbed, label: str, model: str, width: int, depth: int, batch: int, profile: Profile,
             args) -> dict:
    stolen_from = cpu_times()
    gd = tf1_graph(model, batch, width=width, depth=depth)
    an = prepare(gd, tb.topology, batch_size=batch, profile=profile, name=label)
    env = SearchEnv(an.graph, an.topology, an.grouping, cost_model=an.cost_model, batch_size=batch,
                    simulator=an.simulator())
    t0 = time.perf_counter()
    found = pipeline_dp(env)
    if found.strategy is None:
        raise RuntimeError("pipeline_dp found no feasible pipeline")
    pipe, pipe_pred, source = found.strategy, found.outcome.step_time, "pipeline_dp"
    if args.search_budget > 0:
        searched = search(env, budget_s=args.search_budget, seed=0)
        tree_pipe = searched.candidates.get("mcts_pipeline")
        if tree_pipe is not None and searched.baselines_feasible["mcts_pipeline"] \
                and searched.baselines["mcts_pipeline"] < pipe_pred:
            pipe, pipe_pred, source = tree_pipe, searched.baselines["mcts_pipeline"], "mcts_pipeline"
    search_s = time.perf_counter() - t0
    pipe_result = found.result if pipe is found.strategy else env.simulator.evaluate(pipe, batch_size=batch)
    choice, uni_out = best_uniform(env)
    uniform, uni_pred = env.strategy(choice, name="best_uniform"), uni_out.step_time
    hand = hand_pipeline(env, args.hand_micro_batches, args.quotas)
    hand_pred = env.simulator.evaluate(hand, batch_size=batch).step_time
    # the same stages and M under the other way of computing weight gradients (deferred_w <-> fill_drain)
    p = pipe.pipeline
    other = Pipeline(p.stages, p.micro_batches, "fill_drain" if p.schedule == DEFERRED_W else DEFERRED_W)
    ablation = Strategy.pipelined(pipe.grouping, other)
    ablation_pred = env.simulator.evaluate(ablation, batch_size=batch).step_time
    budget = args.budget
    tb.start_workers(threads_per_worker=1)
    try:
        pipe_res = an.rewrite(pipe)
        diff32, grad_diff32, zero_grad = weight_diff(an, pipe_res, tb.target)
        diff, grad_diff = exactness_float64(model, batch, width, depth, an, pipe.pipeline, profile, tb)
        tuned = tuning_step(an, tb, pipe, pipe_pred, uniform, uni_pred, found)
        kept = tuned.kept.candidate
        # side by side, in interleaved rounds (the tuning step's choice timed afresh: its own figures are the
        # fastest of several noisy candidates)
        runs = {"pipe": (pipe_res, pipe_pred), "uniform": (an.rewrite(uniform), uni_pred),
                "hand": (an.rewrite(hand), hand_pred), "ablation": (an.rewrite(ablation), ablation_pred)}
        if kept.name not in ("pipeline", BEST_UNIFORM):
            runs["tuned"] = (an.rewrite(kept.strategy), kept.predicted_s)
        timed = measure_interleaved(tb, runs, budget)
        pipe_s, uni_s, hand_s, ablation_s = timed["pipe"], timed["uniform"], timed["hand"], timed["ablation"]
        tuned_s = timed.get("tuned", pipe_s if kept.name == "pipeline" else uni_s)
    finally:
        tb.stop_workers()
    mwms, skipped, failed = {}, {}, {}
    for k in range(1, len(tb.topology.hosts) + 1):
        pred = env.simulator.evaluate(host_prefix_strategy(env, k), batch_size=batch).step_time
        if k > 1 and pred > SKIP_FACTOR * mwms[1][1]:
            skipped[k] = pred          # all-reducing every weight over the slow links: minutes of steps
            continue
        try:
            meas = float(np.median(run_mwms(tb, model, batch, args.mwms_steps, args.warmup, hosts=k,
                                            model_args=model_options(width, depth))))
        except RuntimeError as err:
            if k == 1:
                raise
            # MWMS over several slow links can fail on its own (a coordination-service heartbeat past its
            # deadline during a 30-second all-reduce, run 17): recorded, not the case's end
            failed[k] = " ".join(str(err).split())[-300:]
            print(f"{label:<12} MWMS on {k} hosts failed: {failed[k]}", flush=True)
            continue
        mwms[k] = (pred, meas)
    best_k = min(mwms, key=lambda k: mwms[k][1])
    rounding = micro_batch_rounding(model, batch, width, depth, p.micro_batches)
    row = {"case": label, "model": model, "width": width, "depth": depth, "batch": batch,
           "pipeline": p.to_dict(), "pipeline_stages": [len(s.placement) for s in p.stages],
           "pipeline_source": source, "predicted_pipeline_dp_s": found.outcome.step_time,
           "predicted_pipeline_s": pipe_pred, "measured_pipeline_s": pipe_s,
           "predicted_bubble_fraction": pipe_result.bubble_fraction if pipe_result is not None else None,
           "best_uniform_action": uniform.actions[0].to_dict(), "predicted_uniform_s": uni_pred,
           "measured_uniform_s": uni_s,
           "mwms": {str(k): {"predicted_s": v[0], "measured_s": v[1]} for k, v in mwms.items()},
           "mwms_skipped_predicted_s": {str(k): v for k, v in skipped.items()},
           "mwms_failed": {str(k): v for k, v in failed.items()},
           "mwms_best_hosts": best_k, "measured_mwms_s": mwms[best_k][1], "predicted_mwms_s": mwms[best_k][0],
           "pipeline_over_best_uniform": uni_s / pipe_s, "pipeline_over_best_mwms": mwms[best_k][1] / pipe_s,
           "rel_error_pipeline": (pipe_pred - pipe_s) / pipe_s, "rel_error_uniform": (uni_pred - uni_s) / uni_s,
           "hand_pipeline": hand.pipeline.to_dict(), "predicted_hand_pipeline_s": hand_pred,
           "measured_hand_pipeline_s": hand_s, "hand_pipeline_over_best_uniform": uni_s / hand_s,
           "schedule_ablation": {"schedule": other.schedule, "predicted_s": ablation_pred, "measured_s": ablation_s},
           "deferred_w_speedup": (ablation_s / pipe_s if p.schedule == DEFERRED_W else pipe_s / ablation_s),
           "tuned": {"kept": kept.name, "strategy_pipeline": kept.strategy.pipeline.to_dict()
                     if kept.strategy.pipeline is not None else None,
                     "predicted_s": kept.predicted_s, "measured_s": tuned_s, "tune_seconds": tuned.seconds,
                     "candidates": [{"name": m.candidate.name, "predicted_s": m.candidate.predicted_s,
                                     "tune_median_s": m.median_s, "tune_mad_s": m.mad_s} for m in tuned.measured]},
           "tuned_over_best_uniform": uni_s / tuned_s, "tuned_over_best_mwms": mwms[best_k][1] / tuned_s,
           "max_rel_weight_diff": diff, "max_rel_grad_diff": grad_diff,
           "max_rel_weight_diff_float32": diff32, "max_rel_grad_diff_float32": grad_diff32,
           "micro_batch_rounding": rounding,
           "zero_gradient_variables": zero_grad, "search_s": search_s, "load": list(os.getloadavg()),
           "steal": steal_fraction(stolen_from, cpu_times())}
    print(f"{label:<12} B={batch:<3} pipeline {pipe_s * 1e3:7.1f} ms (pred {pipe_pred * 1e3:7.1f}; "
          f"{source}: {len(p.stages)} stages on {row['pipeline_stages']} hosts, M={p.micro_batches} {p.schedule})  "
          f"uniform {uni_s * 1e3:7.1f} ms (pred {uni_pred * 1e3:7.1f}; {uniform.actions[0].to_dict()})  "
          f"mwms {mwms[best_k][1] * 1e3:7.1f} ms on {best_k} host(s) (pred {mwms[best_k][0] * 1e3:7.1f}; all: "
          f"{', '.join(f'{k}:{v[1] * 1e3:.0f}' for k, v in mwms.items())}"
          f"{''.join(f', {k}: skipped, pred {v:.1f} s' for k, v in skipped.items())})  "
          f"hand pipeline {hand_s * 1e3:7.1f} ms (pred {hand_pred * 1e3:7.1f}; {len(hand.pipeline.stages)} stages, "
          f"M={args.hand_micro_batches})  same stages {other.schedule} {ablation_s * 1e3:7.1f} ms (pred "
          f"{ablation_pred * 1e3:7.1f})  "
          f"x{row['pipeline_over_best_uniform']:.2f} vs uniform, x{row['pipeline_over_best_mwms']:.2f} vs mwms  "
          f"tuned: {kept.name} {tuned_s * 1e3:7.1f} ms (x{row['tuned_over_best_uniform']:.2f} vs uniform)  "
          f"float64 weights {diff:.1e} (gradients {grad_diff:.1e}); float32 weights {diff32:.1e} (gradients "
          f"{grad_diff32:.1e}; float32 order alone {rounding:.1e})  "
          f"load {load_text()}{steal_text(row['steal'])}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the deep MLP only")
    p.add_argument("--cases", help="comma-separated subset of " + ",".join(c[0] for c in CASES))
    p.add_argument("--gpu-gbps", type=float, default=25.0,
                   help="the GPU cluster's Ethernet rate whose bytes per FLOP the links keep (default 25)")
    p.add_argument("--budget", type=float, default=6.0, help="seconds of timed steps per tag run")
    p.add_argument("--search-budget", type=float, default=20.0,
                   help="seconds of tag's search (tag.optimize's portfolio) whose tree may find a faster pipeline "
                        "than the DP's (0: the DP's answer only)")
    p.add_argument("--mwms-steps", type=int, default=8, help="MWMS steps per host set (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hand-micro-batches", type=int, default=4,
                   help="micro-batches of the hand-made pipeline measured beside the searched one")
    p.add_argument("--quotas", help="CPU cores per host, fastest first (default "
                   + ",".join(f"{q:g}" for q in QUOTAS) + "; their sum should leave the machine a spare core "
                   "for the runtime's network and client work)")
    p.add_argument("--profile", help="a saved calibration (Profile JSON) instead of calibrating")
    p.add_argument("--save-profile", help="write the calibration here")
    p.add_argument("--no-levels", action="store_true", help="skip runtime_levels on the running testbed")
    levels = p.add_mutually_exclusive_group()
    levels.add_argument("--levels-under-load", action="store_true",
                   help="also fit runtime_levels on steps timed while the other hosts run their own copies (the "
                        "recipe's default since calibration.levels_under_load)")
    levels.add_argument("--levels-alone", action="store_true",
                   help="fit runtime_levels on steps timed alone only, without the levels under load that the "
                        "recipe's calibration.levels_under_load adds (the testbed's hosts share one machine: "
                        "tag_bench.cases.runtime_levels)")
    p.add_argument("--json", help="write rows and the summary keys to this file")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    if testbed_missing("bench_pipeline"):
        return 2
    recipe = load_recipe()
    quotas = args.quotas = [float(q) for q in args.quotas.split(",")] if args.quotas else QUOTAS
    recipe["configs"] = {"P": {"quotas": quotas, "links_gbps": [1.0, 1.0, 1.0]}}
    t0 = time.time()
    print(f"commit {this_run.commit}; load {load_text()}", flush=True)
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        with tempfile.TemporaryDirectory() as workdir:
            profile = calibrate_testbed(recipe, workdir, ["P"])
        if args.save_profile:
            profile.save(args.save_profile)
    fastest = profile.devices[device_type(max(quotas))].peak_flops
    link = gpu_ratio_link_gbps(profile, max(quotas), args.gpu_gbps)
    recipe["configs"]["P"]["links_gbps"] = [round(link, 6)] * 3
    print(f"links: {args.gpu_gbps:g} Gbit/s per {GPU_FLOPS / 1e12:g} TFLOP/s GPU -> {link * 1e3:.1f} Mbit/s per "
          f"{fastest / 1e9:.1f} GFLOP/s host ({args.gpu_gbps / 8e-9 / GPU_FLOPS:.2e} bytes per FLOP)", flush=True)
    _, topo = testbed_topology(recipe, "P", profile)
    rows = []
    cases = CASES[:1] if args.quick else CASES
    if args.cases:
        cases = [c for c in CASES if c[0] in args.cases.split(",")]
    with Testbed(topo, cpu_quota=quotas) as tb:
        if not args.no_levels:
            tb.start_workers(threads_per_worker=1)
            try:
                under_load = True if args.levels_under_load else False if args.levels_alone else None
                profile = runtime_levels(tb, recipe, profile, under_load=under_load)
            finally:
                tb.stop_workers()
        for case in cases:
            try:
                rows.append(run_case(tb, *case, profile, args))
            except Exception as err:  # noqa: BLE001 - report the case, go on with the others
                tb.stop_workers()
                print(f"{case[0]:<12} FAILED: {type(err).__name__}: {' '.join(str(err).split())[:1500]}", flush=True)
                continue
            if args.json:        # after every case: a run cut short keeps the cases it finished
                write_json(args.json, {**summarise(rows), "rows": rows, "link_gbps": link, "gpu_gbps": args.gpu_gbps,
                                       "quotas": quotas, "profile_source": profile.source}, this_run, indent=2)
    if not rows:
        print("bench_pipeline: no case ran", file=sys.stderr)
        return 1
    summary = summarise(rows)
    best = max(r["pipeline_over_best_uniform"] for r in rows)
    print(f"\n{len(rows)} cases in {time.time() - t0:.0f} s: pipeline / best uniform "
          f"{summary['pipeline_over_best_uniform']:.2f}x geomean (target >= 1.25), best case {best:.2f}x (>= 1.4); "
          f"pipeline / best MWMS {summary['pipeline_over_best_mwms']:.2f}x; median |rel error| of the pipeline's "
          f"prediction {summary['median_abs_rel_error_pipeline']:.3f} (<= 0.15); max rel weight diff "
          f"{summary['max_rel_weight_diff']:.1e} in float64 (<= 1e-5; gradients {summary['max_rel_grad_diff']:.1e}; "
          f"float32: {summary['max_rel_weight_diff_float32']:.1e}, gradients "
          f"{summary['max_rel_grad_diff_float32']:.1e}, "
          f"float32 summation order alone {summary['max_micro_batch_rounding']:.1e}); deferred_w / the other schedule "
          f"{summary['deferred_w_speedup']:.2f}x; after the tuning step / best uniform "
          f"{summary['tuned_over_best_uniform']:.2f}x, / best MWMS {summary['tuned_over_best_mwms']:.2f}x; "
          f"load {load_text()}")
    return 0      # the JSON, if asked for, was written after the last case that ran


def summarise(rows: list[dict]) -> dict:
    """The issue's keys over ROWS (geomeans of the measured ratios, the largest weight differences)."""
    return {"pipeline_over_best_uniform": geomean([r["pipeline_over_best_uniform"] for r in rows]),
            "pipeline_over_best_mwms": geomean([r["pipeline_over_best_mwms"] for r in rows]),
            "median_abs_rel_error_pipeline": float(np.median([abs(r["rel_error_pipeline"]) for r in rows])),
            "max_rel_weight_diff": max(r["max_rel_weight_diff"] for r in rows),
            "max_rel_grad_diff": max(r["max_rel_grad_diff"] for r in rows),
            "max_rel_weight_diff_float32": max(r["max_rel_weight_diff_float32"] for r in rows),
            "max_rel_grad_diff_float32": max(r["max_rel_grad_diff_float32"] for r in rows),
            "max_micro_batch_rounding": max(r["micro_batch_rounding"] for r in rows),
            "deferred_w_speedup": geomean([r["deferred_w_speedup"] for r in rows]),
            "tuned_over_best_uniform": geomean([r["tuned_over_best_uniform"] for r in rows]),
            "tuned_over_best_mwms": geomean([r["tuned_over_best_mwms"] for r in rows])}


if __name__ == "__main__":
    raise SystemExit(main())
