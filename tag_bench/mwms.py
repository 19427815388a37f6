"""The tf.distribute anchor: the same small models trained by tag and by MultiWorkerMirroredStrategy.

``scripts/bench_e2e.py`` compares tag's plans with what a TensorFlow user would run without tag:
``tf.distribute.MultiWorkerMirroredStrategy`` (RING collectives) with a ``tf.function`` training step that
calls ``strategy.run``, one worker per host. For the comparison to be fair both sides train the *same*
architecture, loss, optimizer and global batch, so the models are defined once here, with tf_keras
layers (Keras 2, which builds both TF1 graphs and TF2 models; Keras 3's ``model.fit`` fails under
MWMS here, so the anchor uses a custom loop):

- ``tf1_graph(name, batch)``: the TF1 training GraphDef tag optimizes (placeholders ``input`` and
  ``labels``, ``loss``, ``train_op`` = ``tf.compat.v1.train.AdamOptimizer``, ``init``);
- ``python -m tag_bench.mwms --model NAME --batch B ...`` with ``TF_CONFIG`` set: one MWMS worker
  (tf_keras Adam with the same hyper-parameters, the global batch split evenly over the workers,
  synthetic on-device batches as ``run_steps(synthetic=True)`` uses). Task 0 prints one JSON line,
  ``{"step_times": [...]}``;
- ``run_mwms(tb, name, batch, steps, warmup)``: those workers started in a testbed's hosts, one per host (the
  first HOSTS), and the chief's timed steps (``model_options``: a case's width and depth as worker options).

Models (``MODELS``): ``mlp`` (784-2048-2048-1024-10, ~7.9M parameters), ``cnn`` (a tiny ResNet at
32x32: a stem and three residual stages of 16/32/64 channels, no BatchNorm), ``transformer`` (a 2-layer
encoder, d_model 128, 4 heads, sequence 32, vocabulary 1000, mean-pooled into a 10-class head), ``vgg``
(a VGG-style CNN at 32x32: three stages of two 3x3 convolutions of 16/32/64 channels and a max-pool, then a
fully connected head 1024-1024-1024-10, ~2.2M parameters, 97% of them in the head). ``tf1_graph``'s and
``keras_model``'s WIDTH, DEPTH and VOCAB make other members of these families (bench_fidelity's held-out
transformer: DEPTH 4, VOCAB 16384).

Example::

    from tag_bench.mwms import run_mwms, tf1_graph
    gd = tf1_graph("mlp", 96)                     # for tag.optimize / tag.rewrite
    # one worker per host (the benchmark starts them inside the testbed's namespaces):
    #   TF_CONFIG='{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}}' \\
    #   python -m tag_bench.mwms --model mlp --batch 96 --steps 15
    times = run_mwms(tb, "mlp", 96, steps=15, warmup=3, hosts=2)   # tb: a running tag_bench.testbed.Testbed
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tag_bench.testbed import Testbed

MODELS = ("mlp", "cnn", "transformer", "vgg")
VGG_HEAD = 1024   # units of each of the VGG-style CNN's two hidden fully connected layers
LEARNING_RATE = 1e-3
NUM_CLASSES = 10
SEQ_LEN, VOCAB = 32, 1000


def input_spec(name: str) -> tuple[tuple[int, ...], str]:
    """(per-example input shape, dtype name) of model NAME."""
    if name == "mlp":
        return (784,), "float32"
    if name in ("cnn", "vgg"):
        return (32, 32, 3), "float32"
    if name == "transformer":
        return (SEQ_LEN,), "int32"
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def _residual(k: Any, x: Any, channels: int, stride: int) -> Any:
    L = k.layers
    y = L.Conv2D(channels, 3, strides=stride, padding="same", activation="relu")(x)
    y = L.Conv2D(channels, 3, padding="same")(y)
    if stride != 1 or int(x.shape[-1]) != channels:
        x = L.Conv2D(channels, 1, strides=stride, padding="same")(x)
    return L.Activation("relu")(L.Add()([x, y]))


def _encoder_layer(k: Any, x: Any, d_model: int, heads: int, d_ff: int) -> Any:
    L = k.layers
    att = L.MultiHeadAttention(num_heads=heads, key_dim=d_model // heads)(x, x)
    x = L.LayerNormalization(epsilon=1e-6)(L.Add()([x, att]))
    ff = L.Dense(d_ff, activation="relu")(x)
    ff = L.Dense(d_model)(ff)
    return L.LayerNormalization(epsilon=1e-6)(L.Add()([x, ff]))


def keras_model(name: str, k: Any, inputs: Any = None, width: int | None = None, depth: int | None = None,
                vocab: int | None = None) -> Any:
    """Model NAME built with the tf_keras module K (logits, NUM_CLASSES wide); INPUTS: a tensor to build on.
    WIDTH (default: the models above) sets the MLP's first layer (the others half of it), the CNN's first
    stage's channels (then 2x and 4x) or the transformer's d_model: calibration graphs of the same families.
    DEPTH (deep models for pipelines): the MLP gets DEPTH hidden layers all WIDTH wide (default 2048), the
    transformer DEPTH encoder layers (default 2). VOCAB: the transformer's vocabulary (default ``VOCAB``; a large
    one makes the embedding most of the weights)."""
    shape, dtype = input_spec(name)
    x0 = k.Input(shape=shape, dtype=dtype) if inputs is None else k.Input(tensor=inputs)
    L = k.layers
    if name == "mlp":
        x = x0
        if depth is not None:
            units_list = (width or 2048,) * depth
        else:
            units_list = (2048, 2048, 1024) if width is None else (width, width, width // 2)
        for units in units_list:
            x = L.Dense(units, activation="relu")(x)
    elif name == "cnn":
        c = 16 if width is None else width
        x = L.Conv2D(c, 3, padding="same", activation="relu")(x0)
        for channels, stride in ((c, 1), (2 * c, 2), (4 * c, 2)):
            x = _residual(k, x, channels, stride)
        x = L.GlobalAveragePooling2D()(x)
    elif name == "vgg":
        # VGG-style: three stages of two 3x3 convolutions and a max-pool (WIDTH, 2x, 4x channels; default
        # 16), flattened into a large fully connected head (4*4*4*WIDTH -> VGG_HEAD -> VGG_HEAD): the
        # convolutions hold the FLOPs and few weights, the head most weights and few FLOPs
        c = 16 if width is None else width
        x = x0
        for channels in (c, 2 * c, 4 * c):
            x = L.Conv2D(channels, 3, padding="same", activation="relu")(x)
            x = L.Conv2D(channels, 3, padding="same", activation="relu")(x)
            x = L.MaxPooling2D(2)(x)
        x = L.Flatten()(x)
        for _ in range(2):
            x = L.Dense(VGG_HEAD, activation="relu")(x)
    else:
        d_model = 128 if width is None else width
        x = L.Embedding(VOCAB if vocab is None else vocab, d_model)(x0)
        for _ in range(2 if depth is None else depth):
            x = _encoder_layer(k, x, d_model, 4, 4 * d_model)
        x = L.GlobalAveragePooling1D()(x)
    return k.Model(x0, L.Dense(NUM_CLASSES)(x))


def tf1_graph(name: str, batch: int, seed: int = 0, width: int | None = None, depth: int | None = None,
              vocab: int | None = None, floatx: str = "float32") -> Any:
    """The TF1 training step of model NAME at global batch BATCH (GraphDef; see the module docstring);
    WIDTH, DEPTH, VOCAB: ``keras_model``'s. FLOATX="float64": the same model with float64 weights, inputs
    and arithmetic, for checking a rewrite's exactness where float32 rounding alone is large (a 20-layer MLP's
    float32 gradient differs from its float64 one by about 1e-2 of its largest element)."""
    import tensorflow as tf
    import tf_keras
    v1 = tf.compat.v1
    shape, dtype = input_spec(name)
    if dtype == "float32":
        dtype = floatx
    g = tf.Graph()
    # the layers' dtype policy too: a global policy set once (even to float32, as restoring one does) no longer
    # follows floatx, and a float64 build would then compute in float32
    before, policy = tf_keras.backend.floatx(), tf_keras.mixed_precision.global_policy()
    tf_keras.backend.set_floatx(floatx)
    tf_keras.mixed_precision.set_global_policy(floatx)
    try:
        with g.as_default():
            v1.set_random_seed(seed)
            x = v1.placeholder(dtype, [batch, *shape], name="input")
            labels = v1.placeholder(tf.int32, [batch], name="labels")
            logits = keras_model(name, tf_keras, inputs=x, width=width, depth=depth, vocab=vocab).output
            loss = tf.identity(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits)), name="loss")
            v1.train.AdamOptimizer(LEARNING_RATE, epsilon=1e-7).minimize(loss, name="train_op")
            v1.variables_initializer(v1.global_variables(), name="init")
    finally:
        tf_keras.backend.set_floatx(before)
        tf_keras.mixed_precision.set_global_policy(policy)
    return g.as_graph_def()


def _synthetic_batch(tf: Any, name: str, batch: int, seed: int) -> tuple[Any, Any]:
    shape, dtype = input_spec(name)
    gen = tf.random.Generator.from_seed(seed)
    if dtype == "int32":
        x = gen.uniform([batch, *shape], 0, 2, dtype=tf.int32)
    else:
        x = gen.normal([batch, *shape])
    return x, gen.uniform([batch], 0, 2, dtype=tf.int32)


MWMS_PORT = 24600         # the first worker's port (run_mwms)


def model_options(width: int | None, depth: int | None) -> tuple[str, ...]:
    """``tag_bench.mwms`` options for a case's WIDTH and DEPTH (those given)."""
    return tuple(a for k, v in (("--width", width), ("--depth", depth)) if v is not None for a in (k, str(v)))


def run_mwms(tb: Testbed, model: str, batch: int, steps: int, warmup: int, hosts: int | None = None,
             model_args: tuple[str, ...] = ()) -> list[float]:
    """The timed step times (after WARMUP of STEPS) of the MWMS anchor, one worker per testbed host (the first
    HOSTS hosts when given; MODEL_ARGS: more ``tag_bench.mwms`` options, such as ``--width``)."""
    n = len(tb.topology.hosts) if hosts is None else int(hosts)
    workers = [f"{tb.address(i)}:{MWMS_PORT + i}" for i in range(n)]
    procs = []
    for i in range(n):
        env = dict(os.environ,
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen(tb.launch_prefix(i) + [sys.executable, "-m", "tag_bench.mwms", "--model",
                                                             model, "--batch", str(batch), "--steps", str(steps),
                                                             *model_args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
    return [float(t) for t in json.loads(lines[-1])["step_times"][warmup:]]


#: heartbeat timeout of TensorFlow's coordination service for the MWMS anchor (TensorFlow's default is 10 s)
HEARTBEAT_TIMEOUT_S = 600.0


def patient_coordination(cluster: dict, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """Configure TensorFlow's coordination service as MultiWorkerMirroredStrategy would, with a longer heartbeat
    timeout; call before creating the strategy (it keeps a service that is already configured).

    Why: over links shaped to a few hundred Mbit/s a worker's heartbeat waits behind a step's all-reduce, and at
    the default timeout MWMS on three hosts aborted the 20 x 2048 MLP at batch 1536 (28 s a step; bench_e2e run
    38: "heartbeat timeout"). A user whose MWMS dies that way raises the timeout; the anchor should be that run."""
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    spec = tf.train.ClusterSpec(cluster)
    jobs = [coordination_config_pb2.CoordinatedJob(name=j, num_tasks=spec.num_tasks(j))
            for j in ("chief", "worker") if j in spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=multi_worker_util.coordination_leader(spec),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000), coordinated_jobs=jobs)


def worker_main(argv: list[str] | None = None) -> int:
    """One MWMS worker (TF_CONFIG names the cluster and this task); task 0 prints the step times."""
    p = argparse.ArgumentParser(description="one MultiWorkerMirroredStrategy worker of the tag anchor")
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--batch", type=int, required=True, help="global batch (split evenly over the workers)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--width", type=int, default=None, help="keras_model's WIDTH (default: the model's own)")
    p.add_argument("--depth", type=int, default=None, help="keras_model's DEPTH (default: the model's own)")
    p.add_argument("--vocab", type=int, default=None, help="keras_model's VOCAB (default: the model's own)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    p.add_argument("--inter-threads", type=int, default=None,
                   help="inter-op threads per worker (default: as tag's servers, as many as --threads, at least 2)")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_keras
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    from tag.backend.runtime.server import MIN_INTER_THREADS
    tf.config.threading.set_inter_op_parallelism_threads(
        args.inter_threads if args.inter_threads is not None else max(args.threads, MIN_INTER_THREADS))
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    patient_coordination(json.loads(os.environ["TF_CONFIG"])["cluster"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    n = strategy.num_replicas_in_sync
    if args.batch % n:
        raise SystemExit(f"global batch {args.batch} is not divisible by {n} workers")
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tf.random.set_seed(0)
    with strategy.scope():
        model = keras_model(args.model, tf_keras, width=args.width, depth=args.depth, vocab=args.vocab)
        opt = tf_keras.optimizers.Adam(LEARNING_RATE, epsilon=1e-7)
    x, y = _synthetic_batch(tf, args.model, args.batch // n, seed=1 + int(task))

    def replica_step():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_sum(per_example) / args.batch
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step():
        return strategy.run(replica_step)

    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = train_step()
        strategy.experimental_local_results(out)[0].numpy()
        times.append(time.perf_counter() - t0)
    if task == 0:
        print(json.dumps({"step_times": times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
