"""Train a rewritten graph on the user's data: ``train_graph``, the loop behind ``tag.train``.

Each worker host runs its own ``tf.data`` pipeline (``tag.backend.runtime.input_pipeline``) and the
rewritten graph reads from it there; the client only sends the graph once and then asks for steps (a
scalar loss comes back). Every step's loss, time and examples per second go to TensorBoard scalars
(``train/...``) and to a progress bar; every ``eval_every`` steps (and after the last) ``eval_fn(weights,
step)`` gets one value per original variable and returns metrics (``{"loss": .., "accuracy": ..}``),
logged as ``eval/...``. Checkpoints are TensorFlow checkpoints under the original variable names
(``tag.backend.runtime.checkpoint``), every ``checkpoint_every`` steps and at the end; ``resume``
continues from the newest one. A data set that ends before ``steps`` ends the run cleanly: the steps
done are kept, checkpointed and reported (``TrainResult.ended_early``).

Example::

    from tag.backend.runtime.training import train_graph

    result = train_graph(plan.graph_def, "grpc://127.0.0.1:23451", dataset_fn, inputs=plan.inputs,
                         batch_size=plan.batch_size, steps=200, checkpoint_dir="ckpt/")
    result.losses[-1], result.examples_per_s, result.checkpoint
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tag.backend.runtime.checkpoint import Checkpointer, read_checkpoint_meta
from tag.backend.runtime.cluster_spec import import_tf, session_config
from tag.backend.runtime.collective_keys import fresh_collective_keys
from tag.backend.runtime.containers import in_container, new_container
from tag.backend.runtime.guard import RunControl, RunEvent, close_quietly, guarded
from tag.backend.runtime.input_pipeline import PipelineSpec, build_inputs
from tag.backend.runtime.steps import _op_and_tensor
from tag.backend.runtime.tensorboard import ScalarWriter
from tag.errors import GraphError, TagError

EvalFn = Callable[[dict, int], Mapping[str, float]]


@dataclass
class TrainResult:
    """A training run: ``steps_done`` (the last step, counting resumed ones), the loss of every step (a
    resumed run's earlier ones first), the step times of this run, median examples per second (steps
    after the first), evaluations ``[(step, {metric: value})]``, the last checkpoint's prefix, whether the
    data set ended first, and what the client sent (``client_bytes``: the graph, the feeds)."""

    steps_done: int
    start_step: int
    losses: list[float]
    step_times: list[float]
    examples_per_s: float
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    checkpoint: str | None = None
    ended_early: bool = False
    client_bytes: dict[str, int] = field(default_factory=dict)
    pipelines: list[PipelineSpec] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"steps_done": self.steps_done, "start_step": self.start_step, "losses": list(self.losses),
                "step_times": list(self.step_times), "examples_per_s": self.examples_per_s,
                "evals": [[s, dict(m)] for s, m in self.evals], "checkpoint": self.checkpoint,
                "ended_early": self.ended_early, "client_bytes": dict(self.client_bytes),
                "pipelines": [[p.task, p.lo, p.hi] for p in self.pipelines]}


class _Progress:
    """A tqdm bar (examples/s, time left) when PROGRESS is True and stderr is a terminal, or PROGRESS(event)."""

    def __init__(self, progress: Any, steps: int, start: int):
        from tqdm import tqdm
        self.callback = progress if callable(progress) else None
        show = progress is True and sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=start, desc="train", unit="step", disable=not show,
                        dynamic_ncols=True)

    def step(self, ev: RunEvent, examples_per_s: float) -> None:
        self.bar.set_postfix_str(f"loss {ev.loss:.4g}  {examples_per_s:,.0f} examples/s"
                                 if ev.loss is not None else f"{examples_per_s:,.0f} examples/s", refresh=False)
        self.bar.update(1)
        if self.callback is not None:
            self.callback(ev)

    def event(self, ev: RunEvent) -> None:
        if self.callback is not None:
            self.callback(ev)
        elif ev.kind != "step" and not self.bar.disable:
            self.bar.write(f"train: {ev.text}" if ev.kind == "phase" else f"train: checkpoint at step {ev.step}: "
                           f"{ev.text}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def _other_feeds(graph: Any, mapped: set[str], feeds: Mapping[str, Any] | None) -> dict:
    """Feed dict for the placeholders the pipelines do not fill; GraphError naming one nobody fills."""
    out = {}
    for key, value in (feeds or {}).items():
        out[_op_and_tensor(graph, key, "fed tensor")[1]] = value
    fed = {t.op.name for t in out}
    for op in graph.get_operations():
        if op.type == "Placeholder" and not op.name.startswith(("tag_checkpoint/", "tag_input/")) \
                and op.name not in mapped and op.name not in fed:
            consumers = [c for c in op.outputs[0].consumers() if not c.name.startswith("tag/slice/")]
            if consumers:
                raise GraphError(f"placeholder {op.name!r} is not a batch input the data set fills; pass "
                                 f"feeds={{{op.name!r}: value}}")
    return out


def train_graph(graph_def: Any, target: str, dataset_fn: Callable[[Any], Any], *, inputs: Sequence[str],
                batch_size: int, steps: int, train_op: str = "train_op", loss: str | None = "loss",
                init: str | None = "init", checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                resume: bool = False, eval_fn: EvalFn | None = None, eval_every: int = 0,
                logdir: str | None = None, progress: Any = True, feeds: Mapping[str, Any] | None = None,
                control: RunControl | None = None, checkpoint_meta: dict | None = None,
                config: Any = None, seed: int = 0) -> TrainResult:
    """Train the rewritten GRAPH_DEF on TARGET for STEPS steps (the total, counting resumed ones), the batch
    INPUTS filled by DATASET_FN's per-host pipelines (module docstring). CHECKPOINT_DIR gets a checkpoint
    every CHECKPOINT_EVERY steps (0: only at the end); RESUME restores its newest first. EVAL_FN(weights,
    step) -> metrics runs every EVAL_EVERY steps (0: only at the end). LOGDIR (default CHECKPOINT_DIR)
    gets the TensorBoard scalars. PROGRESS: True for a progress bar on a terminal, a callable for
    ``RunEvent``s, False for silence. FEEDS: values of other placeholders (a learning rate). CONTROL:
    deadlines and the watchdog (``RunControl``; its checkpoint fields are not used)."""
    tf = import_tf()
    if steps < 1:
        raise TagError(f"steps must be >= 1, got {steps}")
    for what, k in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
        if k < 0:
            raise TagError(f"{what} must be >= 0, got {k}")
    if resume and not checkpoint_dir:
        raise TagError("resume needs checkpoint_dir (where the checkpoints are)")
    ctl = control or RunControl()
    if isinstance(graph_def, (bytes, bytearray)):
        gd = tf.compat.v1.GraphDef()
        gd.ParseFromString(bytes(graph_def))
        graph_def = gd
    graph_def = in_container(fresh_collective_keys(graph_def), new_container())   # this run's state is its own
    start, losses = 0, []
    if resume:
        meta = read_checkpoint_meta(checkpoint_dir)
        start = int(meta["step"])
        if start >= steps:
            raise TagError(f"{meta['prefix']}: the checkpoint is at step {start}, steps is {steps}: nothing left "
                           f"to run (steps is the total; raise it)")
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
    built = build_inputs(graph, graph_def, list(inputs), batch_size, dataset_fn, start_step=start)
    with graph.as_default():
        try:
            tf.compat.v1.import_graph_def(built.graph_def, input_map=built.input_map, name="")
        except (ValueError, TypeError) as err:
            raise GraphError(f"the data set's batches do not fit the graph: {' '.join(str(err).split())[:300]}") \
                from None
    train = _op_and_tensor(graph, train_op, "training op")[0]
    loss_t = _op_and_tensor(graph, loss, "loss")[1] if loss else None
    init_op = _op_and_tensor(graph, init, "initializer")[0] if init else None
    ckpt = Checkpointer(graph) if (checkpoint_dir or eval_fn is not None) else None
    fixed = _other_feeds(graph, set(inputs), feeds)
    client_bytes = {"graph": graph.as_graph_def().ByteSize(), "feeds": 0}
    cfg = config if config is not None else session_config()
    if ctl.step_timeout_s:
        cfg.operation_timeout_in_ms = int(ctl.step_timeout_s * 1000)
    curves = None
    if logdir or checkpoint_dir:
        curves = ScalarWriter(logdir or checkpoint_dir)
    bar = _Progress(progress, steps, start)
    result = TrainResult(start, start, losses, [], 0.0, client_bytes=client_bytes, pipelines=list(built.specs))

    def guard(fn: Callable[[], Any], what: str, setup: bool = False) -> Any:
        return guarded(fn, what=what, timeout_s=ctl.setup_timeout_s if setup else ctl.step_timeout_s,
                       watchdog=ctl.watchdog, poll_s=ctl.poll_s)

    bar.event(RunEvent("phase", f"connecting to {target or 'an in-process session'}; "
                                f"{len(built.specs)} input pipeline(s): " +
                       ", ".join(f"task {s.task} examples {s.lo}..{s.hi - 1}" for s in built.specs)))
    sess = tf.compat.v1.Session(target, graph=graph, config=cfg)
    try:
        if init_op is not None:
            guard(lambda: sess.run(init_op), "initialising the variables", setup=True)
        guard(lambda: sess.run(built.initializers), "starting the input pipelines", setup=True)
        if resume:
            assert ckpt is not None
            _, old = guard(lambda: ckpt.restore(sess, checkpoint_dir), "restoring the checkpoint", setup=True)
            losses.extend(old)
            bar.event(RunEvent("phase", f"resumed at step {start} from {checkpoint_dir}", step=start, steps=steps))
        _loop(sess, tf, guard, train, loss_t, fixed, start, steps, batch_size, result, bar, curves, ckpt,
              checkpoint_dir, checkpoint_every, checkpoint_meta, eval_fn, eval_every)
    finally:
        bar.close()
        if curves is not None:
            curves.close()
        close_quietly(sess)
    times = result.step_times[1:] or result.step_times
    result.examples_per_s = float(batch_size / np.median(times)) if times else 0.0
    return result


def _loop(sess: Any, tf: Any, guard: Callable, train: Any, loss_t: Any, fixed: dict, start: int, steps: int,
          batch_size: int, result: TrainResult, bar: _Progress, curves: Any, ckpt: Checkpointer | None,
          checkpoint_dir: str | None, checkpoint_every: int, checkpoint_meta: dict | None,
          eval_fn: EvalFn | None, eval_every: int) -> None:
    """Steps START+1..STEPS with curves, evaluations and checkpoints; fills RESULT."""
    fetches = [train] + ([loss_t] if loss_t is not None else [])
    feed_bytes = int(sum(np.asarray(v).nbytes for v in fixed.values()))
    ended = object()

    def one_step():
        try:
            return sess.run(fetches, feed_dict=fixed or None)
        except tf.errors.OutOfRangeError:
            return ended

    def checkpoint(done: int) -> None:
        if ckpt is None or not checkpoint_dir:
            return
        prefix = guard(lambda: ckpt.save(sess, checkpoint_dir, step=done, losses=result.losses,
                                         meta=checkpoint_meta), "saving a checkpoint", setup=True)
        result.checkpoint = prefix
        bar.event(RunEvent("checkpoint", prefix, step=done, steps=steps))

    def evaluate(done: int) -> None:
        if eval_fn is None or ckpt is None:
            return
        weights = guard(lambda: ckpt.weights(sess), "reading the weights", setup=True)
        metrics = {str(k): float(v) for k, v in dict(eval_fn(weights, done) or {}).items()}
        result.evals.append((done, metrics))
        if curves is not None and metrics:
            curves.add(done, {f"eval/{k}": v for k, v in metrics.items()})
        bar.event(RunEvent("phase", f"step {done}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
                           step=done, steps=steps))

    done = start
    for step in range(start, steps):
        t0 = time.perf_counter()
        out = guard(one_step, f"step {step + 1}")
        elapsed = time.perf_counter() - t0
        if out is ended:
            result.ended_early = True
            bar.event(RunEvent("phase", f"the data set ended after step {done} of {steps}", step=done, steps=steps))
            break
        done = step + 1
        result.client_bytes["feeds"] += feed_bytes
        result.step_times.append(elapsed)
        loss_value = float(np.mean(out[1])) if loss_t is not None else None
        if loss_value is not None:
            result.losses.append(loss_value)
        rate = batch_size / elapsed if elapsed > 0 else 0.0
        bar.step(RunEvent("step", step=done, steps=steps, step_time_s=elapsed, loss=loss_value), rate)
        if curves is not None:
            values = {"train/step_time_s": elapsed, "train/examples_per_s": rate}
            if loss_value is not None:
                values["train/loss"] = loss_value
            curves.add(done, values)
        result.steps_done = done
        if checkpoint_every and done % checkpoint_every == 0 and done != steps:
            checkpoint(done)
        if eval_every and done % eval_every == 0 and done != steps:
            evaluate(done)
    if done > start or result.checkpoint is None:
        if not (result.evals and result.evals[-1][0] == done):
            evaluate(done)
        if done > start:
            checkpoint(done)


# ------------------------------------------------------------------------------------------------ per-host programs
def train_programs(programs: Mapping[str, Any], cluster: Any, dataset_fn: Callable[[Any], Any], *,
                   fingerprint: str, inputs: Sequence[str], batch_size: int, steps: int,
                   checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                   eval_fn: EvalFn | None = None, eval_every: int = 0, logdir: str | None = None,
                   progress: Any = True, feeds: Mapping[str, Any] | None = None, control: RunControl | None = None,
                   checkpoint_meta: dict | None = None, seed: int = 0) -> TrainResult:
    """Train a plan's host programs (PROGRAMS: host name -> ``HostProgram``) on CLUSTER for STEPS steps (the
    total, counting resumed ones), each host reading its own examples from DATASET_FN's pipeline on that host
    (``attach_pipeline``); arguments as for ``train_graph``. The chief host writes the checkpoints (every
    CHECKPOINT_EVERY steps and at the end) and, every EVAL_EVERY steps and at the end, the weights EVAL_FN
    gets; every host restores its own copies when RESUME. FINGERPRINT: the plan's (``Plan.fingerprint``)."""
    import tempfile

    from tag.backend.runtime.checkpoint import read_weights
    from tag.backend.runtime.host_process import run_in_processes
    from tag.backend.runtime.host_run import RunSpec
    from tag.backend.runtime.host_threads import run_in_threads
    from tag.backend.runtime.input_pipeline import attach_pipeline, host_pipeline_specs
    from tag.backend.runtime.measure import cluster_targets, host_launcher
    if steps < 1:
        raise TagError(f"steps must be >= 1, got {steps}")
    for what, k in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
        if k < 0:
            raise TagError(f"{what} must be >= 0, got {k}")
    if resume and not checkpoint_dir:
        raise TagError("resume needs checkpoint_dir (where the checkpoints are)")
    start = 0
    if resume:
        meta = read_checkpoint_meta(checkpoint_dir)
        start = int(meta["step"])
        if start >= steps:
            raise TagError(f"{meta['prefix']}: the checkpoint is at step {start}, steps is {steps}: nothing left "
                           f"to run (steps is the total; raise it)")
    base = control or RunControl()
    spec = RunSpec.new(programs, fingerprint=fingerprint, steps=steps, seed=seed,
                       **({"join_timeout_s": base.setup_timeout_s} if base.setup_timeout_s else {}))
    specs = host_pipeline_specs(programs)
    if not specs:
        raise GraphError("the plan has no batch inputs (placeholders of the batch) for a data set to fill")
    order = sorted(specs, key=lambda h: specs[h].lo)
    from tag.backend.rewrite.collectives import collective_group_key
    group = collective_group_key(spec.host_cpus()) ^ 0x3C3C3C
    attached = {name: attach_pipeline(p, dataset_fn, spec=specs.get(name), pipeline_id=order.index(name)
                                      if name in specs else -1, pipelines=len(order), global_batch=batch_size,
                                      inputs=list(inputs), host_cpus=spec.host_cpus(), group_key=group,
                                      start_step=start, seed=seed)
                for name, p in programs.items()}
    curves = ScalarWriter(logdir or checkpoint_dir) if (logdir or checkpoint_dir) else None
    bar = _Progress(progress, steps, start)
    result = TrainResult(start, start, [], [], 0.0, pipelines=[specs[h] for h in order],
                         client_bytes={"graph": sum(p.graph_def.ByteSize() for p in attached.values()), "feeds": 0})
    bar.event(RunEvent("phase", f"{len(order)} input pipeline(s): " + ", ".join(
        f"{h} examples {specs[h].lo}..{specs[h].hi - 1}" for h in order)))

    def hear(ev: RunEvent) -> None:
        if ev.kind == "step":
            rate = batch_size / ev.step_time_s if ev.step_time_s > 0 else 0.0
            bar.step(ev, rate)
            if curves is not None:
                values = {"train/step_time_s": ev.step_time_s, "train/examples_per_s": rate}
                if ev.loss is not None:
                    values["train/loss"] = ev.loss
                curves.add(ev.step, values)
        elif ev.kind == "weights" and eval_fn is not None:
            metrics = {str(k): float(v) for k, v in dict(eval_fn(read_weights(ev.text), ev.step) or {}).items()}
            result.evals.append((ev.step, metrics))
            if curves is not None and metrics:
                curves.add(ev.step, {f"eval/{k}": v for k, v in metrics.items()})
            bar.event(RunEvent("phase", f"step {ev.step}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
                               step=ev.step, steps=steps))
        else:
            if ev.kind == "checkpoint":
                result.checkpoint = ev.text
            bar.event(ev)

    ctl = RunControl(progress=hear, watchdog=base.watchdog, step_timeout_s=base.step_timeout_s,
                     setup_timeout_s=base.setup_timeout_s, poll_s=base.poll_s,
                     checkpoint_every=(checkpoint_every or steps) if checkpoint_dir else 0,
                     checkpoint_path=checkpoint_dir, checkpoint_meta=dict(checkpoint_meta or {}),
                     resume_from=checkpoint_dir if resume else None)
    try:
        with tempfile.TemporaryDirectory(prefix="tag-eval-") as eval_dir:
            evals = {"eval_every": (eval_every or steps) if eval_fn is not None else 0,
                     "eval_dir": eval_dir if eval_fn is not None else None, "constants": feeds}
            launch = host_launcher(cluster)
            if launch is not None:
                runs = run_in_processes(attached, {n: launch(n) for n in attached}, spec, control=ctl, **evals)
            else:
                runs = run_in_threads(attached, cluster_targets(cluster), spec, control=ctl, **evals)
    finally:
        bar.close()
        if curves is not None:
            curves.close()
    chief = next(name for task, name in spec.hosts if task == spec.chief)
    count = min(len(r.step_times) for r in runs.values())
    result.step_times = [max(r.step_times[k] for r in runs.values()) for k in range(count)]
    result.losses = list(runs[chief].losses)
    result.steps_done = runs[chief].steps_done
    result.ended_early = any(r.ended_early for r in runs.values())
    times = result.step_times[1:] or result.step_times
    result.examples_per_s = float(batch_size / np.median(times)) if times else 0.0
    if result.checkpoint is None and checkpoint_dir and runs[chief].checkpoints:
        result.checkpoint = runs[chief].checkpoints[-1]
    return result
