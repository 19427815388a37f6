"""Checks that a rewritten training step trains as the original does, shared by the exactness benchmarks
(``scripts/bench_sfb.py``, ``bench_pipeline.py``, ``bench_zoo.py``) and the tests.

- ``in_process_servers``: TF servers on loopback ports in this process, to run a rewritten step on;
- ``train_copies`` / ``train_host_programs``: the loss and every copy of every trainable variable after each step of a
  rewritten step, run as per-host programs (a thread and a session per host);
- ``zero_gradient_variables``: variables whose gradient is rounding noise by construction (left out of exactness
  comparisons);
- ``trained_variables``: the variables an optimizer updates, with their sizes;
- ``forward_group_order``: op groups in forward order, to cut a hand-made pipeline;
- ``weight_diff``: one step of a rewritten graph against the original on one device (weights and gradients);
- ``micro_batch_rounding``: what float32 summation order alone changes in a model's gradients (the scale of
  ``weight_diff``'s gradient figure for a pipeline);
- ``exactness_float64``: ``weight_diff`` of a pipeline on the same model built in float64 (``same_groups``: the
  float32 graph's op groups for it), where rounding no longer hides a rewrite's error.

Example::

    from tag_bench.exactness import in_process_servers, train_copies
    ports, servers = in_process_servers(3)
    copies = train_copies(rewritten, ir, batches)   # one dict per step (rewritten on a topology of those ports)
"""
from __future__ import annotations

import numpy as np

from tag.backend.runtime import free_ports, session_config

SESSION_TIMEOUT_S = 300.0   # a session.run on a cluster (a lost collective peer) fails after this
# (TensorFlow is imported where it is used: the tests' process helpers import ``bounded`` from here without it)


def bounded(config):
    """CONFIG (a ``ConfigProto`` for a session on a cluster) with every ``session.run`` bounded by
    SESSION_TIMEOUT_S: a hung collective is a DeadlineExceededError, not a hang."""
    config.operation_timeout_in_ms = int(SESSION_TIMEOUT_S * 1000)
    return config


def trained_variables(gd) -> dict[str, int]:
    """Variable name -> element count, for every variable an optimizer apply op of GraphDef GD updates."""
    nodes = {n.name: n for n in gd.node}
    out = {}
    for n in gd.node:
        if n.op.startswith(("ResourceApply", "Apply", "ResourceSparseApply", "SparseApply")):
            var = nodes[n.input[0]]
            assert var.op in ("VarHandleOp", "VariableV2"), (n.name, var.op)
            out[var.name] = int(np.prod([d.size for d in var.attr["shape"].shape.dim]))
    return out


def in_process_servers(count: int = 3) -> tuple[list[int], list]:
    """(ports, servers): COUNT TF servers of job "worker" started in this process on free loopback ports."""
    import tensorflow as tf
    ports = free_ports(count)
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
    servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, config=session_config(), start=True)
               for i in range(count)]
    return ports, servers


def train_copies(res, ir, batches, *, config=None) -> list[dict[str, list[np.ndarray]]]:
    """Run the rewritten step RES (a rewrite result with its topology) on BATCHES as per-host programs, one
    thread and one session per host on the servers its topology names, Grappler off; after each step the values
    of every copy of every trainable variable of IR, by variable name."""
    return [copies for _, copies in train_host_programs(res, ir, batches, config=config)]


def train_host_programs(res, ir, batches, *, config=None, trainable_only: bool = True
                        ) -> list[tuple[float | None, dict[str, list[np.ndarray]]]]:
    """Per step of BATCHES (original input name -> global batch): (the global loss, {variable: [every copy's
    value]}) of RES's host programs run in threads of this process (``run_in_threads``) on RES's topology."""
    from tag.backend.runtime.guard import RunControl
    from tag.backend.runtime.host_run import RunSpec
    from tag.backend.runtime.host_threads import run_in_threads
    programs = res.programs()
    hosts = {h.name: f"grpc://{h.address}:{h.port}" for h in res.topology.hosts}
    spec = RunSpec.new(programs, fingerprint="exactness", steps=len(batches), join_timeout_s=SESSION_TIMEOUT_S)
    if config is None:
        config = bounded(session_config())
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    feeds = [{k.split(":")[0]: v for k, v in fd.items()} for fd in batches]
    results = run_in_threads(programs, hosts, spec, feeds=lambda step: feeds[step], config=config,
                             read_values=True, control=RunControl(step_timeout_s=SESSION_TIMEOUT_S,
                                                                  setup_timeout_s=SESSION_TIMEOUT_S))
    wanted = {v.name for v in ir.variables if v.kind == "trainable"} if trainable_only else None
    losses = next((r.losses for r in results.values() if r.losses), [None] * len(batches))
    out = []
    for step in range(len(batches)):
        copies: dict[str, list[np.ndarray]] = {}
        for name in sorted(results):
            for v, values in results[name].values[step].items():
                if wanted is None or v in wanted:
                    copies.setdefault(v, []).extend(values)
        out.append((losses[step], copies))
    return out


def forward_group_order(ir, grouping) -> tuple[list[int], list[int]]:
    """(groups with forward ops in a topological order of their forward data edges, the other groups).

    A hand-made pipeline cuts the first list into contiguous stages; the second (loss seed, optimizer
    bookkeeping: no forward op) can join the last stage."""
    group = np.asarray(grouping.group_of_op)
    fwd = {int(group[i]) for i, op in enumerate(ir.ops) if op.phase == "forward"}
    first = {}
    for i, op in enumerate(ir.ops):
        if op.phase == "forward":
            first.setdefault(int(group[i]), i)
    succ = {g: set() for g in fwd}
    indeg = {g: 0 for g in fwd}
    for e in ir.edges:
        a, b = int(group[e.src]), int(group[e.dst])
        if a != b and ir.ops[e.src].phase == "forward" and ir.ops[e.dst].phase == "forward" and b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    ready = sorted((g for g in fwd if indeg[g] == 0), key=first.get)
    order = []
    while ready:
        g = ready.pop(0)
        order.append(g)
        for b in succ[g]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
        ready.sort(key=first.get)
    rest = [g for g in range(grouping.num_groups) if g not in fwd]
    return order, rest


ROUNDING_NOISE = 1e-6   # a variable whose largest gradient is below this fraction of the largest of all


def zero_gradient_variables(names, grads) -> set[str]:
    """NAMES whose reference gradient (GRADS, one array each, same order) is zero by construction, so that
    what a run computes for it is float32 rounding noise: its largest element is at most ``ROUNDING_NOISE``
    of the largest gradient element of all. Examples: an attention key bias (softmax over the keys ignores
    a term constant over them: ``q . (k + b) = q . k + q . b``), a convolution bias before BatchNorm.
    Relative differences of such a variable compare two rounding noises, any value from 0 to 2; they say
    nothing about the rewrite, so exactness checks leave them out (and bound what they may do instead)."""
    names, grads = list(names), [np.asarray(g) for g in grads]
    largest = [float(np.max(np.abs(g))) if g.size else 0.0 for g in grads]
    gmax = max(largest, default=0.0)
    return {n for n, m in zip(names, largest, strict=True) if m <= ROUNDING_NOISE * gmax}


def random_feed(ir, gd, seed: int = 0) -> dict:
    """A batch for the graph's inputs: token ids and labels in 0..1, floats standard normal."""
    import tensorflow as tf
    nodes = {n.name: n for n in gd.node}
    rng = np.random.RandomState(seed)
    feed = {}
    for name in ir.inputs:
        shape = [d.size for d in nodes[name].attr["shape"].shape.dim]
        if nodes[name].attr["dtype"].type == tf.int32.as_datatype_enum:
            feed[name] = rng.randint(0, 2, shape).astype(np.int32)
        else:   # the placeholder's own float type (float64 graphs for the exactness check)
            feed[name] = rng.randn(*shape).astype(tf.as_dtype(nodes[name].attr["dtype"].type).as_numpy_dtype)
    return feed


def relative_diff(a, b) -> float:
    """The largest |A - B| over B's largest magnitude (1 when B is all zeros)."""
    return float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) or 1.0)


def weight_diff(analysis, res, target: str) -> tuple[float, float, list[str]]:
    """One step of rewrite RES on TARGET vs the original graph on one local device, same batch: (the largest
    |difference| of an updated weight over the weight's largest magnitude, the same for the whole-batch
    gradient each optimizer update op takes, the variables left out).

    Left out, as the unit tests do (``zero_gradient_variables``): variables whose exact gradient is zero by
    construction, such as the transformer's attention key biases. Their gradients are float32
    rounding noise (about 1e-11 of the largest gradient), and two noises differ by any fraction of their
    size: comparing them gave the 11/12 "gradient bug" of the searched 3-stage transformer pipeline
    (``tests/test_rewrite_pipeline.py::test_bench_transformer_pipeline_gradients_are_exact``).

    Why both: the gradients agree to float32 rounding (summation order differs with micro-batches), but
    Adam's first step moves a weight by about lr * g / (|g| + eps) whatever g's size, so where |g| is near
    eps (1e-7; many elements of a deep ReLU network) rounding of g changes the step visibly."""
    import tensorflow as tf

    from tag.backend.rewrite.graph_edit import canonical
    tf1 = tf.compat.v1
    feed = {k + ":0": v for k, v in random_feed(analysis.graph, analysis.graph_def).items()}
    vs = [v for v in analysis.graph.variables if v.kind == "trainable"]
    orig = {n.name: n for n in analysis.graph_def.node}
    out = {n.name: n for n in res.graph_def.node}
    grad_inputs, grad_vars = [], []    # the rewritten update ops' gradient inputs, of these variables
    for v in vs:
        inputs = [canonical(i) for i in orig[v.apply_op].input]
        if canonical(v.gradient) not in inputs:   # reaches the update through other ops (a densified sparse one)
            continue
        slot = inputs.index(canonical(v.gradient))
        # every replica's input: fetching one replica's all-reduced gradient alone would leave its peers'
        # collective instances unlaunched, and the run would wait for them forever
        applies = [n for n in (v.apply_op, *(f"{v.apply_op}/replica_{d}" for d in range(64))) if n in out]
        grad_inputs.append([t if ":" in t else t + ":0" for t in (out[a].input[slot] for a in applies)])
        grad_vars.append(v)
    from tag.backend.runtime.containers import in_container, new_container
    g = tf.Graph()
    # the whole step in one client graph (its inner gradients are fetched), in a container of its own
    with g.as_default():
        tf.graph_util.import_graph_def(in_container(res.graph_def, new_container()), name="")
    cfg = tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    cfg.operation_timeout_in_ms = 600_000          # a step that cannot finish fails instead of waiting forever
    with tf1.Session(target, graph=g, config=cfg) as s:
        s.run(res.init)
        # with the training op: every replica's collectives launch (a pipeline stage replicated over hosts
        # names its per-replica update inputs apart, and fetching some of them alone waited forever)
        got_grads = [copies[0] for copies in s.run([grad_inputs, res.train_op], feed)[0]]
    got = train_copies(res, analysis.graph, [feed])[0]
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(analysis.graph_def, name="")
        reads = [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(v.name + ":0"),
                                           dtype=g.get_operation_by_name(v.name).get_attr("dtype")) for v in vs]
    with tf1.Session(graph=g, config=cfg) as s:
        s.run(analysis.entry.init)
        all_grads = s.run([v.gradient for v in vs], feed)
        s.run(analysis.entry.train_op, feed)
        ref = s.run(reads)
    noise = zero_gradient_variables([v.name for v in vs], all_grads)
    ref_grads = dict(zip([v.name for v in vs], all_grads, strict=True))

    weights = max((relative_diff(c, r) for v, r in zip(vs, ref, strict=True) if v.name not in noise
                   for c in got[v.name]), default=0.0)
    grads = max((relative_diff(a, ref_grads[v.name]) for v, a in zip(grad_vars, got_grads, strict=True)
                 if v.name not in noise), default=0.0)
    return weights, grads, sorted(noise)


def micro_batch_rounding(model: str, batch: int, width: int | None, depth: int | None, micro_batches: int,
                         seed: int = 0) -> float:
    """What float32 summation order alone does to the gradients, with no pipeline and no rewrite: the largest
    |difference| between the whole-batch gradient of the same tf_keras architecture on one device (plain
    TensorFlow, eager) and the sum of its MICRO_BATCHES micro-batch gradients (each of the mean loss over its
    slice, over M), relative to each weight's largest gradient magnitude: the scale of ``max_rel_grad_diff``.
    Variables with a zero gradient by construction are left out, as there. A pipelined step may differ from
    the single-device step by about this much without any error in the rewrite: deep ReLU networks carry
    float32 rounding far above 1e-5 (a 20 x 2048 MLP at batch 384: 1.2e-3 to 9.5e-3 between initialisations;
    its float32 whole-batch gradient itself differs from the float64 one by 9.5e-3)."""
    if micro_batches <= 1:
        return 0.0
    import tensorflow as tf
    import tf_keras

    from tag_bench.mwms import input_spec, keras_model
    tf.random.set_seed(seed)
    net = keras_model(model, tf_keras, width=width, depth=depth)
    shape, dtype = input_spec(model)
    rng = np.random.RandomState(seed)
    x = rng.randint(0, 2, (batch, *shape)).astype(np.int32) if dtype == "int32" else \
        rng.randn(batch, *shape).astype(np.float32)
    y = rng.randint(0, int(net.output.shape[-1]), batch).astype(np.int32)

    def grads(lo: int, hi: int, scale: float) -> list:
        with tf.GradientTape() as tape:
            loss = scale * tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y[lo:hi], logits=net(x[lo:hi], training=True)))
        # an embedding's gradient is IndexedSlices: densified, as the whole-batch comparison needs
        return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, net.trainable_variables)]
    whole = grads(0, batch, 1.0)
    step = batch // micro_batches
    summed = [sum(gs) for gs in zip(*(grads(m * step, (m + 1) * step, 1.0 / micro_batches)
                                      for m in range(micro_batches)), strict=True)]
    names = [v.name for v in net.trainable_variables]
    noise = zero_gradient_variables(names, whole)
    return max((relative_diff(a, b) for n, a, b in zip(names, summed, whole, strict=True) if n not in noise),
               default=0.0)


def same_groups(graph, analysis):
    """A Grouping of GRAPH (the float64 build of ANALYSIS's model) with ANALYSIS's groups: each op in the group of
    the float32 op of the same name; an op the float32 graph lacks (the optimizer's casts of its float32
    hyperparameters, ``train_op/update_dense/kernel/Cast_2``) in the group of the float32 ops under the longest
    name scope it shares with them (that variable's update)."""
    from tag.strategy.types import Grouping
    group_of = {op.name: int(g) for op, g in zip(analysis.graph.ops, analysis.grouping.group_of_op, strict=True)}
    groups = []
    for op in graph.ops:
        scope = op.name
        while scope not in group_of and "/" in scope:
            scope = scope.rsplit("/", 1)[0]
            under = next((n for n in group_of if n.startswith(scope + "/")), None)
            if under is not None:
                scope = under
        if scope not in group_of:
            raise RuntimeError(f"{op.name}: no op of the float32 graph shares its name scope")
        groups.append(group_of[scope])
    return Grouping(np.asarray(groups, dtype=np.int64), list(analysis.grouping.names))


def exactness_float64(model: str, batch: int, width: int | None, depth: int | None, analysis, pipeline,
                      profile, tb) -> tuple[float, float]:
    """``weight_diff`` of PIPELINE (its stages, M and schedule) rewritten on the same model built in float64:
    (weights, gradients). Why: in float32 a deep ReLU network's rounding alone reaches 1e-2 of a gradient (the
    20 x 2048 MLP's float32 whole-batch gradient differs from its float64 one by 9.5e-3, and Adam turns that into
    15% of an update where |g| is near eps), so a float32 comparison cannot tell a rewrite's error from
    rounding; in float64 the rounding is about 1e-9 lower and what is left is the rewrite's. The float64 graph
    is given the float32 graph's op groups (``same_groups``), so the same pipeline applies. TB: where to run
    (its ``topology`` and ``target``: a running testbed, or servers in this process)."""
    from tag.api import prepare
    from tag.strategy.types import Strategy
    from tag_bench.mwms import tf1_graph
    gd = tf1_graph(model, batch, width=width, depth=depth, floatx="float64")
    an = prepare(gd, tb.topology, batch_size=batch, profile=profile, name=f"{model}-float64")
    an = prepare(gd, tb.topology, batch_size=batch, profile=profile, name=f"{model}-float64",
                 grouping=same_groups(an.graph, analysis))
    res = an.rewrite(Strategy.pipelined(an.grouping, pipeline))
    weights, grads, _ = weight_diff(an, res, tb.target)
    return weights, grads
