"""One host's program, run beside its TF server: the per-host half of every tag run.

Every host of a plan runs its own program (``tag.backend.rewrite.programs.HostProgram``) in a session on its
own server; the hosts meet in collective ops and in the queues that carry tensors between their programs.
``run_host`` is that loop for one host. It is the same whether the host program runs in a process of its own
(``tag.backend.runtime.host_process``: ``tag-deploy --run``, ``tag.train``, ``tag-worker --plan``) or in a
thread beside the others (tests):

1. the program is made the run's own: every resource (variables, queues) in the container ``tag-run-<run id>``,
   so a plan, its baseline and tuning candidates on the same servers never see each other's state; every
   collective key mixed with the run id (``mask_collective_keys``) and given a timeout;
2. a handshake: a collective gather of every host's plan fingerprint (fixed keys, whatever the plan), so
   hosts that run different plans stop with one line naming them, and no host starts before all are there;
3. initialisation (or a checkpoint restored into this host's own copies), then a barrier;
4. the steps: this host's step op (and the loss, on the host that computes it), each under the run's
   deadlines and watchdog; at a checkpoint step every host waits at a barrier, the chief (the host of the
   lowest task) writes one checkpoint under the original variable names (reading every variable's first copy
   by name, wherever it lives), and a second barrier lets them go on;
5. a last barrier, then the container is released.

Example::

    from tag.backend.runtime.host_run import RunSpec, run_host

    spec = RunSpec.new(programs, fingerprint="f00d", steps=20, warmup=3)
    result = run_host(programs["cpu1"], "grpc://127.0.0.1:23452", spec)      # one thread per host
    result.step_times, result.losses       # losses only on the host holding the loss
"""
from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from tag.backend.runtime.checkpoint import Checkpointer, save_weights_checkpoint
from tag.backend.runtime.cluster_spec import import_tf, session_config
from tag.backend.runtime.collective_keys import mask_collective_keys
from tag.backend.runtime.containers import in_container, new_container
from tag.backend.runtime.guard import RunControl, RunEvent, close_quietly, guarded
from tag.backend.runtime.inputs import start_synthetic_at, synthetic_input, synthetic_share
from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover
    from tag.backend.rewrite.programs import HostProgram

HANDSHAKE_INSTANCE, BARRIER_INSTANCE = 1, 2   # fixed keys: below every masked key (2**30 and up)
HANDSHAKE_GROUP_SALT = 0x5A5A5A
FeedFn = Callable[[int], Mapping[str, np.ndarray]]   # step -> {original batch input: global batch}


@dataclass(frozen=True)
class RunSpec:
    """What every host of one run agrees on: the run id (container and collective keys), the hosts in task
    order ((task, name)), the plan's fingerprint, the chief (the task that holds the loss, else the first: it
    writes checkpoints), steps and deadlines."""

    run_id: str
    hosts: tuple[tuple[int, str], ...]
    fingerprint: str
    chief: int
    steps: int
    warmup: int = 0
    seed: int = 0
    join_timeout_s: float = 600.0

    @classmethod
    def new(cls, programs: Mapping[str, "HostProgram"], *, fingerprint: str, steps: int, warmup: int = 0,
            seed: int = 0, run_id: str | None = None, **kw: Any) -> "RunSpec":
        """A spec for PROGRAMS (host name -> program) with a fresh run id unless RUN_ID is given."""
        hosts = tuple(sorted((p.task, name) for name, p in programs.items()))
        chief = next((p.task for p in programs.values() if p.loss), hosts[0][0])
        return cls(run_id or secrets.token_hex(6), hosts, fingerprint, chief, int(steps), int(warmup), int(seed),
                   **kw)

    @property
    def container(self) -> str:
        return new_container(self.run_id)

    def host_cpus(self) -> list[str]:
        from tag.backend.rewrite.programs import host_cpu
        return [host_cpu(t) for t, _ in self.hosts]


@dataclass
class HostResult:
    """One host's run: its step times, the losses (host holding the loss; else empty), the step it started
    from, checkpoints it wrote (the chief) and VALUES read after the last step (original name -> array)."""

    host: str
    step_times: list[float]
    losses: list[float]
    start_step: int = 0
    checkpoints: list[str] = field(default_factory=list)
    values: list[dict[str, list[np.ndarray]]] = field(default_factory=list)
    steps_done: int = 0
    ended_early: bool = False
    run_metadata: bytes | None = None     # the step ``RunControl.trace_step`` names, traced (a RunMetadata)


def program_for_run(program: "HostProgram", spec: RunSpec) -> Any:
    """PROGRAM's GraphDef made the run's own: resources in the run's container, collective keys masked with the
    run id. Every collective is bounded by the deadline of the ``session.run`` it runs in (``RunOptions``): a
    step whose peer never comes ends in DeadlineExceeded, which aborts its collectives."""
    gd = in_container(mask_collective_keys(program.graph_def, spec.run_id), spec.container)
    for node in gd.node:
        if node.op.startswith("Collective") and "timeout_seconds" in node.attr:
            # bounded by the step's deadline instead: a collective's own timeout holds a thread of the server for
            # every execution (measured: two threads a step per host, kept), which a long run cannot afford
            node.attr["timeout_seconds"].f = 0.0
    return gd


def _fingerprint_words(fingerprint: str) -> np.ndarray:
    digest = hashlib.sha1(fingerprint.encode()).digest()
    return np.frombuffer(digest[:8], dtype=">i4").astype(np.int32).reshape(1, 2)


def _collectives(tf: Any, spec: RunSpec, my_cpu: str) -> tuple[Any, Any, Any]:
    """(fingerprint placeholder, handshake gather, barrier) ops of this host over every host's CPU."""
    from tag.backend.rewrite.collectives import collective_group_key
    cpus = spec.host_cpus()
    group = collective_group_key(cpus) ^ HANDSHAKE_GROUP_SALT
    with tf.device(my_cpu), tf.name_scope("tag_run/"):
        words = tf.compat.v1.placeholder(tf.int32, [1, 2], name="fingerprint")
        gather = tf.raw_ops.CollectiveGatherV2(input=words, group_size=len(cpus), group_key=group,
                                               instance_key=HANDSHAKE_INSTANCE, ordering_token=[],
                                               communication_hint="ring")
        barrier = tf.raw_ops.CollectiveReduceV2(input=tf.constant([1], tf.int32), group_size=len(cpus),
                                                group_key=group, instance_key=BARRIER_INSTANCE, ordering_token=[],
                                                merge_op="Add", final_op="Id", communication_hint="ring")
    return words, gather, barrier


@dataclass
class _HostGraph:
    """One host's program imported for a run, with the ops the run adds (handshake, barrier, checkpoints)."""

    graph: Any
    step_op: Any
    init_op: Any
    loss: Any                     # the global loss tensor (the host holding it) or None
    words: Any                    # fingerprint placeholder, and the handshake that gathers every host's
    gather: Any
    barrier: Any
    pull: Any                     # with an input pipeline: next batch, 0 once some host's data set ended
    input_init: Any
    synthetic_init: list
    placeholders: dict            # HostInput name -> its placeholder (fed runs)
    constants: dict               # placeholder tensor -> value fed every step
    own: Any                      # Checkpointer of this host's copies (restore, values), or None
    saver: Any                    # the chief's writer of checkpoints (original names), or None


def _build(tf: Any, program: "HostProgram", spec: RunSpec, ctl: RunControl, *, fed: bool,
           constants: Mapping[str, Any] | None, read_values: bool, chief_writes: bool) -> _HostGraph:
    """Import PROGRAM for the run: synthetic batches for its placeholders unless FED or it has a pipeline (a
    constant of CONSTANTS for those named there), the handshake and barrier, the chief's checkpoint reads."""
    graph = tf.Graph()
    gd = program_for_run(program, spec)
    constants = dict(constants or {})
    input_map, synthetic_init = {}, []
    if not fed and program.pull is None:
        shares = {i.name: i for i in program.inputs}
        with graph.as_default():
            tf.compat.v1.set_random_seed(spec.seed + program.task)
            for node in gd.node:
                if node.op == "Placeholder" and node.name not in constants:
                    share = shares.get(node.name)
                    init, value = synthetic_input(node) if share is None or not program.batch_size else \
                        synthetic_share(node, share.source, share.lo, share.hi, program.batch_size, spec.seed)
                    input_map[f"{node.name}:0"] = value
                    synthetic_init.append(init)
    with graph.as_default():
        try:
            tf.compat.v1.import_graph_def(gd, input_map=input_map or None, name="")
        except (ValueError, TypeError) as err:
            raise TagError(f"host {program.host}: its program does not import: "
                           f"{' '.join(str(err).split())[:300]}") from None
        words, gather, barrier = _collectives(tf, spec, program.cpu)
        own = Checkpointer(graph, copies=program.variables) if (ctl.resume_from or read_values) else None
        saver = _chief_reads(tf, graph, program, spec) if chief_writes else None
    names = {n.name for n in gd.node}
    return _HostGraph(
        graph, graph.get_operation_by_name(program.step_op), graph.get_operation_by_name(program.init_op),
        graph.get_tensor_by_name(_tensor(program.loss)) if program.loss else None, words, gather, barrier,
        graph.get_tensor_by_name(program.pull) if program.pull else None,
        graph.get_operation_by_name(program.input_init) if program.input_init else None, synthetic_init,
        {i.name: graph.get_tensor_by_name(f"{i.name}:0") for i in program.inputs} if fed else {},
        {graph.get_tensor_by_name(_tensor(k)): v for k, v in constants.items() if k.split(":")[0] in names},
        own, saver)


def run_host(program: "HostProgram", target: str, spec: RunSpec, *, control: RunControl | None = None,
             feeds: FeedFn | None = None, constants: Mapping[str, Any] | None = None, config: Any = None,
             read_values: bool = False, eval_every: int = 0, eval_dir: str | None = None) -> HostResult:
    """Run PROGRAM (this host's part of the plan) for SPEC's steps in a session on TARGET, this host's server
    (module docstring).

    Inputs: FEEDS(step) gives global batches by original input name (each host takes its own examples); a
    program with an input pipeline (``attach_pipeline``) reads its own, and every host stops at the step where
    one data set ended (``HostResult.ended_early``); otherwise every placeholder is a synthetic batch made on its
    device at start-up. CONSTANTS: values of other placeholders, fed every step. CONTROL: deadlines, watchdog,
    progress, checkpoints (the chief writes them; every host restores its own copies). EVAL_EVERY K > 0: every K
    steps and after the last, the chief writes the weights under EVAL_DIR and says so in a "weights" event.
    READ_VALUES: after every step, read every copy of this host's variables (``HostResult.values``)."""
    tf = import_tf()
    ctl = control or RunControl(step_timeout_s=None, setup_timeout_s=None)
    chief = program.task == spec.chief
    writes = (ctl.checkpoint_every > 0 and bool(ctl.checkpoint_path)) or (eval_every > 0 and bool(eval_dir))
    g = _build(tf, program, spec, ctl, fed=feeds is not None, constants=constants, read_values=read_values,
               chief_writes=chief and writes)
    cfg = config if config is not None else session_config()
    if ctl.step_timeout_s:
        cfg.operation_timeout_in_ms = int(ctl.step_timeout_s * 1000)
    # Runs with collectives carry the run's collective graph key (``_run_options``): every host makes the same
    # keyed runs in the same order (handshake, init, barriers, pulls, steps); runs without collectives (input
    # batches, restores, the chief's checkpoint reads) are unkeyed.
    run_options = _run_options(tf, spec, ctl.step_timeout_s)          # a step
    setup_options = _run_options(tf, spec, ctl.setup_timeout_s)       # initialisation, barriers
    join_options = _run_options(tf, spec, spec.join_timeout_s)        # the handshake: hosts may start apart
    local_options = _run_options(tf, spec, ctl.setup_timeout_s, keyed=False)   # nothing another host takes part in

    def guard(fn, what: str, setup: bool = False):
        return guarded(fn, what=f"{what} on {program.host}",
                       timeout_s=ctl.setup_timeout_s if setup else ctl.step_timeout_s,
                       watchdog=ctl.watchdog, poll_s=ctl.poll_s)

    def sync(what: str) -> None:
        guard(lambda: sess.run(g.barrier, options=setup_options), f"waiting for every host ({what})", setup=True)

    def write(done: int, final: bool) -> None:
        """At a checkpoint or evaluation step: every host waits while the chief writes."""
        ckpt = ctl.checkpoint_every > 0 and ctl.checkpoint_path and (done % ctl.checkpoint_every == 0 or final)
        weights = eval_every > 0 and eval_dir and (done % eval_every == 0 or final)
        if not (ckpt or weights):
            return
        sync(f"writing at step {done}")
        if g.saver is not None:
            if ckpt:
                prefix = guard(lambda: g.saver(sess, ctl.checkpoint_path, done, result.losses, ctl.checkpoint_meta),
                               "saving a checkpoint", setup=True)
                result.checkpoints.append(prefix)
                ctl.emit(RunEvent("checkpoint", prefix, step=done, steps=spec.steps))
            if weights:
                prefix = guard(lambda: g.saver(sess, eval_dir, done, result.losses, {}), "saving the weights",
                               setup=True)
                ctl.emit(RunEvent("weights", prefix, step=done, steps=spec.steps))
        sync(f"written at step {done}")

    ctl.emit(RunEvent("phase", f"{program.host}: connecting to {target}"))
    sess = guard(lambda: tf.compat.v1.Session(target, graph=g.graph, config=cfg), "opening a session", setup=True)
    result = HostResult(program.host, [], [])
    try:
        ctl.emit(RunEvent("phase", f"{program.host}: waiting for the other hosts"))
        seen = guarded(lambda: sess.run(g.gather, {g.words: _fingerprint_words(spec.fingerprint)},
                                        options=join_options),
                       what=f"the hosts' handshake on {program.host}", timeout_s=spec.join_timeout_s + 30,
                       watchdog=ctl.watchdog, poll_s=ctl.poll_s)
        _check_same_plan(seen, spec)
        ctl.emit(RunEvent("phase", f"{program.host}: initialising"))
        if g.synthetic_init:
            guard(lambda: sess.run(g.synthetic_init, options=local_options), "making the input batches", setup=True)
        guard(lambda: sess.run(g.init_op, options=setup_options), "initialising the variables", setup=True)
        if g.input_init is not None:
            guard(lambda: sess.run(g.input_init, options=local_options), "starting the input pipeline", setup=True)
        start, losses = 0, []
        if ctl.resume_from:
            start, losses = guard(lambda: g.own.restore(sess, ctl.resume_from), "restoring the checkpoint",
                                  setup=True)
            if start >= spec.steps:
                raise TagError(f"{ctl.resume_from}: the checkpoint is at step {start}, --steps is {spec.steps}: "
                               f"nothing left to run (raise --steps)")
            start_synthetic_at(sess, g.graph, start)
            ctl.emit(RunEvent("phase", f"resumed at step {start} from {ctl.resume_from}", step=start,
                              steps=spec.steps))
        result.start_step = result.steps_done = start
        result.losses = list(losses) if g.loss is not None else []
        sync("initialised")
        fetches = [g.step_op] + ([g.loss] if g.loss is not None else [])
        for step in range(start, spec.steps):
            if g.pull is not None and not int(np.min(guard(lambda: sess.run(g.pull, options=run_options),
                                                           f"reading batch {step + 1}"))):
                result.ended_early = True
                ctl.emit(RunEvent("phase", f"the data set ended after step {step} of {spec.steps}", step=step,
                                  steps=spec.steps))
                break
            fd = _feed(feeds, step, program, g.placeholders) if feeds else {}
            fd.update(g.constants)
            options, meta = run_options, None
            if ctl.trace_step == step + 1:
                options = _run_options(tf, spec, ctl.step_timeout_s)
                options.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
                meta = tf.compat.v1.RunMetadata()
            t0 = time.perf_counter()
            out = guard(lambda fd=fd, options=options, meta=meta:
                        sess.run(fetches, feed_dict=fd or None, options=options, run_metadata=meta),
                        f"step {step + 1}")
            result.step_times.append(time.perf_counter() - t0)
            if meta is not None:
                result.run_metadata = meta.SerializeToString()
            loss = float(np.mean(out[1])) if g.loss is not None else None
            if loss is not None:
                result.losses.append(loss)
            result.steps_done = step + 1
            ctl.emit(RunEvent("step", step=step + 1, steps=spec.steps, step_time_s=result.step_times[-1], loss=loss))
            if read_values and g.own is not None:
                result.values.append(guard(lambda: g.own.all_copies(sess), "reading the variables", setup=True))
            if step + 1 < spec.steps:
                write(step + 1, final=False)
        if result.steps_done > start:
            write(result.steps_done, final=True)
        sync("done")
    finally:
        close_quietly(sess)
    return result


def _tensor(name: str) -> str:
    return name if ":" in name else name + ":0"


def _run_options(tf: Any, spec: RunSpec, timeout_s: float | None, *, keyed: bool = True) -> Any:
    """RunOptions of a run of this host's program: the run's collective graph key when KEYED and a deadline of
    TIMEOUT_S (None: none).

    TensorFlow numbers the runs of one graph key alike on every host, so their collectives meet: a host fetches
    the number from the collective leader at its first run of the key, then counts on by itself. So the key is
    the run id's alone (hosts given different plans still meet in the handshake and learn it there), the
    handshake is every host's first keyed run (no host can count on before all have fetched), and every host
    makes the same keyed runs in the same order after it."""
    options = tf.compat.v1.RunOptions()
    if keyed:
        options.experimental.collective_graph_key = _graph_key(spec)
    if timeout_s:
        options.timeout_in_ms = int(timeout_s * 1000)
    return options


def _graph_key(spec: RunSpec) -> int:
    return 1 + int.from_bytes(hashlib.sha1(f"tag-run|{spec.run_id}".encode()).digest()[:4], "big") % (2 ** 31 - 2)


def _check_same_plan(seen: np.ndarray, spec: RunSpec) -> None:
    """TagError naming the hosts whose plan fingerprint differs from the chief's."""
    rows = [tuple(int(x) for x in r) for r in np.asarray(seen).reshape(-1, 2)]
    mine = tuple(int(x) for x in _fingerprint_words(spec.fingerprint)[0])
    names = [name for _, name in spec.hosts]
    other = [names[k] for k, r in enumerate(rows) if r != mine and k < len(names)]
    if other:
        raise TagError(f"hosts run different plans: {', '.join(other)} differ from this host's plan "
                       f"({spec.fingerprint[:12]}); deploy the same plan directory on every host")


def _feed(feeds: FeedFn, step: int, program: "HostProgram", placeholders: Mapping[str, Any]) -> dict:
    """This host's examples of step STEP's global batches."""
    batch = feeds(step)
    fd = {}
    for hi in program.inputs:
        if hi.source not in batch:
            raise TagError(f"no batch for input {hi.source!r} at step {step + 1}")
        value = np.asarray(batch[hi.source])
        index = [slice(None)] * value.ndim
        if value.ndim:
            index[hi.axis] = slice(hi.lo, hi.hi)
        fd[placeholders[hi.name]] = value[tuple(index)]
    return fd


def _chief_reads(tf: Any, graph: Any, program: "HostProgram", spec: RunSpec) -> Callable[..., str]:
    """The chief's writer of checkpoints: a read of every variable's first copy (reached by name in the run's
    container, wherever it lives), written under the original names: ``save(sess, directory, step, losses,
    meta) -> prefix``. Run without the run's collective graph key, so its reads of other hosts' variables do not
    share a step id with their own steps."""
    from tensorflow.core.framework import node_def_pb2
    reads, names = [], []
    with graph.as_default(), tf.name_scope("tag_checkpoint_read/"):
        for original in sorted(program.primary):
            copy_name, device, dtype = program.primary[original][:3]
            try:
                handle = graph.get_operation_by_name(copy_name).outputs[0]
            except KeyError:
                node = node_def_pb2.NodeDef()
                node.ParseFromString(program.primary[original][3])
                node.attr["container"].s = spec.container.encode()
                node.name = f"tag_checkpoint_handle/{copy_name}"
                tf.compat.v1.import_graph_def(_one_node_graph(tf, node), name="")
                handle = graph.get_operation_by_name(node.name).outputs[0]
            with tf.device(device):
                if handle.dtype == tf.resource:
                    reads.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.as_dtype(dtype)))
                else:
                    reads.append(tf.identity(handle))
            names.append(original)

    def save(sess: Any, directory: str, step: int, losses: list, meta: dict) -> str:
        values = sess.run(reads)
        weights = {n: np.asarray(v) for n, v in zip(names, values, strict=True)}
        return save_weights_checkpoint(weights, directory, step=step,
                                       losses=losses, meta=meta)
    return save


def _one_node_graph(tf: Any, node: Any) -> Any:
    gd = tf.compat.v1.GraphDef()
    gd.node.add().CopyFrom(node)
    return gd


def env_run_id() -> str | None:
    """The run id a launcher passed in the environment (``TAG_RUN_ID``), if any."""
    return os.environ.get("TAG_RUN_ID") or None
