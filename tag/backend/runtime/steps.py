"""Timed training steps of a (rewritten) GraphDef on a TF cluster or in process: ``run_steps``.

Imports the graph into a fresh ``tf.Graph``, opens a session on the target with ``session_config()``,
runs the initializer, then times ``session.run([train_op, loss])`` step by step. Inputs are random
batches fed each step, caller-given feeds, or on-device synthetic batches (``synthetic=True``).

Example::

    import tag
    from tag.backend.runtime import LocalCluster, run_steps

    topo = tag.load_topology("topologies/localhost.pbtxt")
    with LocalCluster(topo) as cluster:          # one tag-worker process per host, stopped on exit
        result = run_steps(graph_def, cluster.target, steps=20, warmup=3)
    print(result.mean_step_time_s, result.losses[-1])
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tag.backend.runtime.checkpoint import Checkpointer
from tag.backend.runtime.cluster_spec import import_tf, session_config
from tag.backend.runtime.collective_keys import fresh_collective_keys
from tag.backend.runtime.containers import in_container, new_container
from tag.backend.runtime.guard import RunControl, RunEvent, close_quietly, guarded
from tag.backend.runtime.inputs import random_feed, remote_input_slices, start_synthetic_at, synthetic_input
from tag.errors import GraphError, TagError


@dataclass
class RunResult:
    """Timed training steps. ``mean_step_time_s`` is the mean of ``step_times[warmup:]``."""

    mean_step_time_s: float
    step_times: list[float]
    losses: list[float]
    warmup: int
    values: dict[str, np.ndarray] = field(default_factory=dict)  # fetched after the last step
    start_step: int = 0       # resumed from a checkpoint at this step (losses then hold the earlier ones too)
    run_metadata: Any = None  # step statistics of the step RunControl.trace_step names, when it ran

    def to_dict(self) -> dict:
        return {"mean_step_time_s": self.mean_step_time_s, "step_times": list(self.step_times),
                "losses": list(self.losses), "warmup": self.warmup, "start_step": self.start_step}


def _op_and_tensor(graph, name: str, what: str):
    """Resolve NAME ("loss", "loss:0" or an op name) in GRAPH to (op, tensor-or-None)."""
    op_name, _, idx = name.partition(":")
    try:
        op = graph.get_operation_by_name(op_name)
    except KeyError:
        raise GraphError(f"the graph has no op named {op_name!r} (the {what})") from None
    if idx:
        return op, graph.get_tensor_by_name(name)
    return op, (op.outputs[0] if op.outputs else None)


def _readable(graph, tensor):
    """A tensor whose value can be fetched: resource-variable handles get a ReadVariableOp beside them."""
    tf = import_tf()
    if tensor is None or tensor.dtype != tf.resource:
        return tensor
    with graph.as_default(), tf.device(tensor.op.device):
        return tf.raw_ops.ReadVariableOp(resource=tensor, dtype=tensor.op.get_attr("dtype"))


def _import_graph(graph_def: Any, *, synthetic: bool, fed_names: set[str], seed: int) -> tuple[Any, dict, list]:
    """(tf.Graph, input_map, synthetic initializers): GRAPH_DEF imported into a fresh graph.

    With SYNTHETIC, every Placeholder not in FED_NAMES is replaced (through ``input_map``, name ->
    tensor) by an on-device variable whose initializer is in the returned list.
    """
    tf = import_tf()
    graph = tf.Graph()
    input_map: dict[str, Any] = {}      # "placeholder:0" -> the synthetic batch standing in for it
    synthetic_init: list[Any] = []
    if synthetic:
        with graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            synthesized, made = {}, {}
            for node in graph_def.node:
                if node.op == "Placeholder" and node.name not in fed_names:
                    var_init, value = synthetic_input(node)
                    input_map[f"{node.name}:0"] = value
                    synthetic_init.append(var_init)
                    synthesized[node.name], made[node.name] = node, (var_init, value)
            for name, (node, source, begin, end) in remote_input_slices(graph_def, synthesized).items():
                var_init, value = synthetic_input(node, _slice_of(made[source], begin, end))
                input_map[f"{name}:0"] = value
                synthetic_init.append(var_init)
    with graph.as_default():
        try:
            tf.compat.v1.import_graph_def(graph_def, input_map=input_map or None, name="")
        except (ValueError, TypeError) as err:
            raise GraphError(f"cannot import the graph: {err}") from None
    return graph, input_map, synthetic_init


def _slice_of(made: tuple, begin, end) -> Callable[[], Any]:
    """INITIAL for ``synthetic_input``: rows BEGIN..END of every batch of the synthetic pool MADE (initializer,
    per-step value), read once that pool exists (so a replica's share is a slice of the same batches)."""
    tf = import_tf()
    source_init, source_value = made

    read = source_value.op
    while read.type not in ("ResourceGather", "ReadVariableOp") and read.inputs:    # under any identities
        read = read.inputs[0].op

    def initial():
        with tf.control_dependencies([source_init]):
            pool = tf.raw_ops.ReadVariableOp(resource=read.inputs[0], dtype=source_value.dtype)
        mask = (1 << len(begin)) - 1        # every batch of the pool, and every axis before the sliced one
        return tf.strided_slice(pool, np.concatenate([[0], begin]), np.concatenate([[0], end]),
                                begin_mask=mask, end_mask=mask)
    return initial


def _feeder(graph: Any, input_map: Mapping[str, Any], feeds: Mapping[str, Any] | None,
            input_fn: Callable[[int], Mapping[str, Any]] | None, seed: int) -> Callable[[int], dict]:
    """step -> feed_dict: FEEDS every step, INPUT_FN(step) on top, random batches for the other placeholders."""
    def to_tensor(name):
        if not isinstance(name, str):
            return name
        return _op_and_tensor(graph, name, "fed tensor")[1]

    fixed = {to_tensor(k): v for k, v in (feeds or {}).items()}
    placeholders = [op for op in graph.get_operations()
                    if op.type == "Placeholder" and f"{op.name}:0" not in input_map]
    rng = np.random.default_rng(seed)

    def feed_for(step: int) -> dict:
        fd = dict(fixed)
        if input_fn is not None:
            fd.update({to_tensor(k): v for k, v in input_fn(step).items()})
        for op in placeholders:
            if op.outputs[0] not in fd:
                fd[op.outputs[0]] = random_feed(op, rng)
        return fd

    return feed_for


def run_steps(graph_def: Any, target: str, *, train_op: str = "train_op", loss: str | None = "loss",
              init: str | None = "init", steps: int = 20, warmup: int = 3,
              feeds: Mapping[str, Any] | None = None,
              input_fn: Callable[[int], Mapping[str, Any]] | None = None,
              config: Any = None, seed: int = 0, fetch_after: Sequence[str] = (),
              renumber_collectives: bool = True, synthetic: bool = False,
              control: RunControl | None = None) -> RunResult:
    """Run STEPS training steps of GRAPH_DEF on TARGET ("grpc://host:port", or "" for in-process).

    Imports the graph into a fresh ``tf.Graph``, opens ``Session(target, config=session_config())``,
    runs INIT, then STEPS times ``[train_op, loss]``. Placeholders get fresh random batches each step
    (floats: standard normal; integers: values in [0, 2) so labels and token ids are valid), drawn
    from ``numpy.random.default_rng(seed)``, unless FEEDS (name -> value, every step) or
    ``INPUT_FN(step) -> {name: value}`` supply them. Only ``session.run`` is timed; the mean skips the
    first WARMUP steps. FETCH_AFTER names tensors (e.g. variables) read once after the last step
    into ``RunResult.values``. Collective keys are renumbered first (``fresh_collective_keys``) so
    that graphs run one after another on one cluster never clash; pass RENUMBER_COLLECTIVES=False to
    keep them.

    SYNTHETIC=True: instead of feeding, each placeholder (not in FEEDS) becomes a variable on the
    placeholder's own device holding one random batch of the same distribution, made at start-up and
    reused every step -- as synthetic-data benchmarks do, no input crosses the client connection or
    the network, so the step time is the training step alone. Every replica's slice of a placeholder
    that the rewrite sends to another device (``remote_input_slices``) becomes such a variable on the
    reading device too: each host makes its own share of the batch, as each worker's input pipeline
    does under MultiWorkerMirroredStrategy and as the simulator costs it.

    CONTROL (``tag.backend.runtime.guard.RunControl``): progress events, deadlines and a watchdog for
    every blocking call (a dead worker or a hung step is a ``RunError``, never a hang), checkpoints every
    K steps and resuming from one. Resumed, the run does steps ``k+1..STEPS`` and ``RunResult.losses``
    holds the whole curve (the checkpoint's losses first); ``start_step`` is k.
    """
    if steps < 1:
        raise TagError(f"steps must be >= 1, got {steps}")
    if not 0 <= warmup < steps:
        raise TagError(f"warmup must be in [0, steps) = [0, {steps}), got {warmup}")
    tf = import_tf()
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    if isinstance(graph_def, (bytes, bytearray)):
        gd = tf.compat.v1.GraphDef()
        gd.ParseFromString(bytes(graph_def))
        graph_def = gd
    if renumber_collectives:
        graph_def = fresh_collective_keys(graph_def)
    graph_def = in_container(graph_def, new_container())      # this run's variables are its own
    if synthetic and input_fn is not None:
        raise TagError("synthetic=True and input_fn= exclude each other")
    fed_names = {k.split(":")[0] for k in (feeds or {}) if isinstance(k, str)}
    graph, input_map, synthetic_init = _import_graph(graph_def, synthetic=synthetic, fed_names=fed_names, seed=seed)
    train = _op_and_tensor(graph, train_op, "training op")[0]
    loss_t = _op_and_tensor(graph, loss, "loss")[1] if loss else None
    init_op = _op_and_tensor(graph, init, "initializer")[0] if init else None
    after = [_readable(graph, _op_and_tensor(graph, n, "value to fetch")[1]) for n in fetch_after]
    feed_for = _feeder(graph, input_map, feeds, input_fn, seed)
    ckpt = Checkpointer(graph) if (ctl.checkpoint_every > 0 or ctl.resume_from) else None

    cfg = config if config is not None else session_config()
    if ctl.step_timeout_s:
        cfg.operation_timeout_in_ms = int(ctl.step_timeout_s * 1000)
    fetches = [train] + ([loss_t] if loss_t is not None else [])
    ctl.emit(RunEvent("phase", f"connecting to {target or 'an in-process session'}"))
    sess = tf.compat.v1.Session(target, graph=graph, config=cfg)
    try:
        start, losses = _set_up(sess, ctl, ckpt, synthetic_init, init_op, steps)
        traced: dict[str, Any] = {}
        times = _step_loop(sess, ctl, ckpt, fetches, feed_for, start, steps, losses, loss_t is not None, traced)
        values = {}
        if after:
            read = _guard(ctl, lambda: sess.run(after), "reading values", setup=True)
            values = dict(zip(fetch_after, read, strict=True))
    finally:
        close_quietly(sess)
    skip = min(warmup, max(0, len(times) - 1))
    return RunResult(float(np.mean(times[skip:])), times, losses, skip, values, start, traced.get("metadata"))


def _guard(ctl: RunControl, fn: Callable[[], Any], what: str, *, setup: bool = False) -> Any:
    return guarded(fn, what=what, timeout_s=ctl.setup_timeout_s if setup else ctl.step_timeout_s,
                   watchdog=ctl.watchdog, poll_s=ctl.poll_s)


def _set_up(sess: Any, ctl: RunControl, ckpt: "Checkpointer | None", synthetic_init: list, init_op: Any,
            steps: int) -> tuple[int, list[float]]:
    """Initialise (inputs, variables), restore a checkpoint when resuming; (first step, losses so far)."""
    ctl.emit(RunEvent("phase", "initialising variables"))
    if synthetic_init:
        _guard(ctl, lambda: sess.run(synthetic_init), "creating the input batches", setup=True)
    if init_op is not None:
        _guard(ctl, lambda: sess.run(init_op), "initialising the variables", setup=True)
    if not ctl.resume_from:
        return 0, []
    assert ckpt is not None
    start, losses = _guard(ctl, lambda: ckpt.restore(sess, ctl.resume_from), "restoring the checkpoint",
                           setup=True)
    if start >= steps:
        raise TagError(f"{ctl.resume_from}: the checkpoint is at step {start}, --steps is {steps}: nothing "
                       f"left to run (raise --steps)")
    start_synthetic_at(sess, sess.graph, start)
    ctl.emit(RunEvent("phase", f"resumed at step {start} from {ctl.resume_from}", step=start, steps=steps))
    return start, list(losses)


def _step_loop(sess: Any, ctl: RunControl, ckpt: "Checkpointer | None", fetches: list, feed_for: Callable,
               start: int, steps: int, losses: list[float], has_loss: bool, traced: dict) -> list[float]:
    """Steps START+1..STEPS, each timed and guarded; appends to LOSSES; returns the step times. The step
    ``ctl.trace_step`` runs with a full trace, its ``RunMetadata`` put in TRACED["metadata"]."""
    tf = import_tf()
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(ctl.step_timeout_s * 1000)) if ctl.step_timeout_s else None
    times: list[float] = []
    for step in range(start, steps):
        fd = feed_for(step)
        opts, meta = options, None
        if ctl.trace_step == step + 1:
            opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                           timeout_in_ms=options.timeout_in_ms if options is not None else 0)
            meta = traced["metadata"] = tf.compat.v1.RunMetadata()
        t0 = time.perf_counter()
        out = _guard(ctl, lambda fd=fd, opts=opts, meta=meta:
                     sess.run(fetches, feed_dict=fd, options=opts, run_metadata=meta), f"step {step + 1}")
        times.append(time.perf_counter() - t0)
        loss_value = float(np.mean(out[1])) if has_loss else None
        if loss_value is not None:
            losses.append(loss_value)
        ctl.emit(RunEvent("step", step=step + 1, steps=steps, step_time_s=times[-1], loss=loss_value))
        done = step + 1
        if ckpt is not None and ctl.checkpoint_every > 0 and ctl.checkpoint_path and (
                done % ctl.checkpoint_every == 0 or done == steps):
            prefix = _guard(ctl, lambda done=done: ckpt.save(sess, ctl.checkpoint_path, step=done, losses=losses,
                                                             meta=ctl.checkpoint_meta),
                            "saving a checkpoint", setup=True)
            ctl.emit(RunEvent("checkpoint", prefix, step=done, steps=steps))
    return times
