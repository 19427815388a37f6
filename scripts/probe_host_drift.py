"""One host's training step timed in turn on a bare CPU, in a testbed host's cgroup, through tag's server and by MWMS:
is the testbed's full-core host slower than the CPU it is pinned to, or is the machine drifting?

Why: run 39 of bench_e2e measured the transformer's one-host step (batch 384) at 574 ms on configuration G's
full-core host, where a probe on one CPU outside the testbed measured 454 ms after the run; the README read that
as tag's runtime running 26% over its kernels on the testbed. Timings minutes apart on this shared machine are not
comparable, so every round here times each mode once, in turn (the order reversed every other round): the ratios
within a round are free of the machine's drift, and the spread of one mode over the rounds is the drift.

Modes (each a fresh process but ``server``, every one with one intra-op and two inter-op threads, synthetic
batches, ops as TensorFlow schedules them):

- ``bare``: ``taskset -c CPU`` outside the testbed, CPU the one configuration G pins its full-core host to;
- ``cgroup``: the same command inside that host's network namespace, CFS quota and cpuset (``launch_prefix``);
- ``server``: the step placed on that host by tag's rewrite, run through its TF server from a client session,
  the way bench_e2e times tag's one-host program (``--fresh-servers``: the servers started afresh every round,
  as bench_e2e does since run 44);
- ``mwms``: MultiWorkerMirroredStrategy with one worker on that host, the way bench_e2e times its one-host anchor
  (``bench_e2e.run_mwms``; the tf_keras model and a ``tf.function`` step);
- ``keras``: MWMS's program without the strategy, in the host's cgroup as ``cgroup``: the same tf_keras model,
  Adam and ``tf.function`` step in one process. Beside ``cgroup`` it says whether the two programs differ, beside
  ``mwms`` what the strategy adds;
- ``alone``: tag's rewritten one-host program as bench_e2e and ``tag-deploy`` run it since December 4: a process
  of its own on the host, started as its worker is, with no server in between
  (``tag.backend.runtime.one_device``; ``measure.run_on``). Beside ``server`` it says what the server cost.

Why ``mwms``: bench_e2e's tag-on-one-host over MWMS-on-one-host ratio came out 0.89-1.11 over its runs 37-45,
in both directions, for different models in one run. Timing both with ``bare`` and ``cgroup`` in the same
rounds says whether the two programs differ (a ratio steady over the rounds) or whether one fresh process
differs from the next by that much (``cgroup``'s own spread over the rounds, a fresh process each).

Usage (needs root, as the testbed does)::

    python scripts/probe_host_drift.py --model transformer --batch 384 --rounds 4 --json F
    python scripts/probe_host_drift.py --model vgg --batch 384 --profile P
    python scripts/probe_host_drift.py --model vgg --batch 384 --modes cgroup,server,mwms --fresh-servers --rounds 6
    python scripts/probe_host_drift.py --model transformer --batch 384 --modes cgroup,keras,server,mwms --fresh-servers
    python scripts/probe_host_drift.py --model transformer --batch 384 --modes alone,cgroup,server,mwms --fresh-servers
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

DEFAULT_PROFILE = "docs/measured/issue22-e2e/e2e_g3_amd_run39.profile.json"
MODES = ("bare", "cgroup", "server", "mwms", "keras", "alone")
CHILD_TIMEOUT_S = 900


def in_process_steps(model: str, batch: int, steps: int, warmup: int) -> list[float]:
    """Step times (s) of the model's single-device training step in this process (no server)."""
    from tag_bench.mwms import tf1_graph
    from tag.backend.runtime import run_steps
    from tag.backend.runtime.cluster_spec import session_config
    config = session_config(intra_op_threads=1, inter_op_threads=2)
    res = run_steps(tf1_graph(model, batch), "", steps=warmup + steps, warmup=warmup, synthetic=True, config=config)
    return [float(t) for t in res.step_times[warmup:]]


def keras_steps(model: str, batch: int, steps: int, warmup: int) -> list[float]:
    """Step times (s) of MWMS's training step without the strategy in this process: the tf_keras model, tf_keras
    Adam and a ``tf.function`` step, threads as ``in_process_steps``."""
    import tensorflow as tf
    import tf_keras
    from tag_bench.mwms import LEARNING_RATE, _synthetic_batch, keras_model
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:  # TensorFlow already ran in this process (a test): its threads stay as they are
        pass
    tf.random.set_seed(0)
    net = keras_model(model, tf_keras)
    opt = tf_keras.optimizers.Adam(LEARNING_RATE, epsilon=1e-7)
    x, y = _synthetic_batch(tf, model, batch, seed=1)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = net(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        opt.apply_gradients(zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables))
        return loss

    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def child_steps(prefix: list[str], args, program: str = "graph") -> list[float]:
    """Step times of ``in_process_steps`` (PROGRAM "graph") or ``keras_steps`` ("keras") run as a child process
    behind PREFIX (taskset, or a testbed host)."""
    cmd = prefix + [sys.executable, os.path.abspath(__file__), "--child", program, "--model", args.model,
                    "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"child {' '.join(cmd[:3])}... failed (rc {out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(lines[-1])["step_times"]


def spread(values: list[float]) -> float:
    """Largest over smallest of VALUES."""
    return float(max(values) / min(values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer", help="a tag_bench.mwms model (mlp, cnn, transformer, vgg)")
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="the calibration that sizes configuration G and predicts the step")
    p.add_argument("--modes", default=",".join(MODES[:3]),
                   help=f"comma-separated modes to time, the first the reference of the ratios (of {', '.join(MODES)})")
    p.add_argument("--fresh-servers", action="store_true",
                   help="start tag's TF servers afresh before every round's server mode (bench_e2e's default)")
    p.add_argument("--json", help="write the rounds and the summary here")
    p.add_argument("--child", choices=("graph", "keras"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        steps_of = in_process_steps if args.child == "graph" else keras_steps
        print(json.dumps({"step_times": steps_of(args.model, args.batch, args.steps, args.warmup)}))
        return 0
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be positive, --warmup not negative")
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        p.error(f"--modes {args.modes}: give distinct modes of {', '.join(MODES)}")
    ref = modes[0]
    from _common import cpu_times, git_commit, steal_fraction, testbed_missing, write_json
    from tag.cost.model import Profile
    from tag.errors import TagError
    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError, TagError) as err:
        print(f"probe_host_drift: --profile {args.profile}: {err}", file=sys.stderr)
        return 2
    if testbed_missing("probe_host_drift"):
        return 2
    import bench_e2e
    from _testbed_cases import load_recipe, testbed_topology
    from tag.api import prepare
    from tag_bench.mwms import tf1_graph
    from tag.backend.runtime import run_steps
    from tag.backend.runtime.measure import run_on
    from tag_bench.testbed import Testbed
    recipe = bench_e2e.config_recipe(load_recipe(), profile, 25.0)
    cfg = recipe["configs"][bench_e2e.GPU_CONFIG]
    _, topology = testbed_topology(recipe, bench_e2e.GPU_CONFIG, profile)
    analysis = prepare(tf1_graph(args.model, args.batch), topology, batch_size=args.batch, profile=profile,
                       name=args.model)
    single = analysis.builtin("single")
    predicted = analysis.simulator().evaluate(single, batch_size=args.batch).step_time
    program = analysis.rewrite(single)
    commit = git_commit()
    print(f"commit {commit}; {args.model} at batch {args.batch}: one host predicted {predicted * 1e3:.0f} ms "
          f"(profile {args.profile}, without runtime levels)", flush=True)
    rounds = []
    with Testbed(topology, cpu_quota=cfg["quotas"]) as tb:
        cpu = tb.cpu_pinning.get(topology.hosts[0].name)
        if cpu is None:
            print("probe_host_drift: the testbed did not pin its hosts (no cpuset controller)", file=sys.stderr)
            return 2
        tb.start_workers(threads_per_worker=1)
        try:
            for r in range(args.rounds):
                stolen_from, throttled_from = cpu_times(), tb.cpu_stat(0)
                medians = {}
                for mode in bench_e2e.round_order(r, modes):
                    if mode == "server":
                        if args.fresh_servers and r > 0:
                            tb.stop_workers()
                            tb.start_workers(threads_per_worker=1)
                        res = run_steps(program.graph_def, tb.target, train_op=program.train_op, loss=program.loss,
                                        init=program.init, steps=args.warmup + args.steps, warmup=args.warmup,
                                        synthetic=True)
                        times = res.step_times[args.warmup:]
                    elif mode == "alone":
                        res = run_on(tb, program.graph_def, train_op=program.train_op, loss=program.loss,
                                     init=program.init, steps=args.warmup + args.steps, warmup=args.warmup)
                        times = res.step_times[args.warmup:]
                    elif mode == "mwms":
                        times = bench_e2e.run_mwms(tb, args.model, args.batch, args.warmup + args.steps, args.warmup,
                                                   hosts=1)
                    else:
                        prefix = ["taskset", "-c", cpu] if mode == "bare" else tb.launch_prefix(0)
                        times = child_steps(prefix, args, "keras" if mode == "keras" else "graph")
                    medians[mode] = float(np.median(times))
                throttled = {k: v - throttled_from.get(k, 0) for k, v in tb.cpu_stat(0).items()}
                row = {"round": r, "median_s": medians, "load": list(os.getloadavg()),
                       "steal": steal_fraction(stolen_from, cpu_times()), "throttled": throttled,
                       "over_ref": {m: medians[m] / medians[ref] for m in modes}}
                rounds.append(row)
                print(f"round {r}: " + "  ".join(f"{m} {medians[m] * 1e3:6.0f} ms ({row['over_ref'][m]:.2f})"
                                                 for m in modes)
                      + f"  load {row['load'][0]:.1f}  throttled {throttled.get('nr_throttled', 0)} of "
                        f"{throttled.get('nr_periods', 0)} periods", flush=True)
        finally:
            tb.stop_workers()
    summary = {m: {"median_s": float(np.median([x["median_s"][m] for x in rounds])),
                   "spread_over_rounds": spread([x["median_s"][m] for x in rounds]),
                   "over_ref_median": float(np.median([x["over_ref"][m] for x in rounds])),
                   "over_ref_range": [float(min(x["over_ref"][m] for x in rounds)),
                                      float(max(x["over_ref"][m] for x in rounds))]} for m in modes}
    for m in modes:
        s = summary[m]
        print(f"{m:<7} median {s['median_s'] * 1e3:6.0f} ms, largest/smallest round {s['spread_over_rounds']:.2f}, "
              f"over {ref} {s['over_ref_median']:.2f} ({s['over_ref_range'][0]:.2f}-{s['over_ref_range'][1]:.2f})")
    write_json(args.json, {"commit": commit, "model": args.model, "batch": args.batch, "profile": args.profile,
                           "modes": list(modes), "reference": ref, "fresh_servers": args.fresh_servers,
                           "predicted_one_host_s": predicted, "steps": args.steps, "warmup": args.warmup,
                           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
