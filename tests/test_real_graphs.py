"""Real training graphs (tag.frontend.real_graphs, tag.frontend.keras): read right, rewritten exactly.

Fast tests check what ``tag.analyze`` reads (every parameter, slots, update ops, batch axes of folded
constants, loop costs and grouping) and that every rewrite imports. The slow tests run each graph under
dp_allreduce, ps, partition and a mixed strategy on three local TF servers (one cluster for the whole
module) and compare loss and updated weights with the original graph on one device over 3 steps
(1e-5 relative).
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from bounded import bounded  # noqa: E402
from helpers import in_process_servers  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.runtime import session_config  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.errors import GraphError, RewriteError  # noqa: E402
from tag.frontend import real_graphs as rg  # noqa: E402
from tag.frontend.analyze import analyze  # noqa: E402
from tag.frontend.keras import training_graph_def  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402

tf1 = tf.compat.v1
STEPS = 3
RTOL = 1e-5
B = 8
MODES = ("allreduce", "ps", "partition", "mixed")
OPTIMIZER_CASES = [(o, sparse, resource) for o in sorted(rg.OPTIMIZERS) for sparse in (False, True)
                   for resource in (True, False)]


def _id(case) -> str:
    o, sparse, resource = case
    return f"{o}-{'sparse' if sparse else 'dense'}-{'resource' if resource else 'ref'}"


def topology(ports, tflops):
    hosts = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU memory_gib: 2 '
        f'peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}' for i, (p, f) in enumerate(zip(ports, tflops, strict=True)))
    return parse_topology(f'name: "rg"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n')


FAKE = topology([23501, 23502, 23503], [0.1, 0.05, 0.05])   # shares 4:2:2 of a batch of 8


def keras_mlp():
    import tf_keras

    init = tf_keras.initializers.GlorotUniform
    return tf_keras.Sequential([tf_keras.Input((5,)), tf_keras.layers.Dense(6, activation="tanh",
                                                                             kernel_initializer=init(seed=1)),
                                tf_keras.layers.Dense(3, kernel_initializer=init(seed=2))])


@lru_cache(maxsize=None)
def graph(name: str):
    """(GraphDef, IR) of a named test graph at batch B."""
    if isinstance(name, tuple):
        o, sparse, resource, *batch = name          # a fourth item: a batch other than B
        gd = rg.optimizer_graph(o, sparse=sparse, resource=resource, batch_size=batch[0] if batch else B)
    elif name == "causal_lm":
        gd = rg.causal_lm_graph(batch_size=B)
    elif name == "causal_lm_sequence":
        gd = rg.causal_lm_graph(batch_size=B, loss_form="sequence")
    elif name == "recommender":
        gd = rg.recommender_graph(batch_size=B)
    elif name == "lstm_lm":
        gd = rg.lstm_lm_graph(batch_size=B)
    elif name == "keras_mlp":
        gd = training_graph_def(keras_mlp, "sparse_categorical_crossentropy", "momentum", B)
    else:
        raise KeyError(name)
    return gd, analyze(gd)


def feeds(gd, ir, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """STEPS batches: token ids below the smallest embedding table / vocabulary, labels in range."""
    nodes = {n.name: n for n in gd.node}
    tables = [v.shape[0] for v in ir.variables if len(v.shape) == 2 and any(
        k in v.name for k in ("emb", "table", "wte"))]
    rows = min(tables) if tables else 3
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(STEPS):
        fd = {}
        for name in ir.inputs:
            node = nodes[name]
            shape = [d.size for d in node.attr["shape"].shape.dim]
            if node.attr["dtype"].type == tf.int32.as_datatype_enum:
                high = 3 if name == "labels" and len(shape) == 1 else rows
                fd[name + ":0"] = rng.randint(0, high, shape).astype(np.int32)
            elif name == "labels":
                fd[name + ":0"] = rng.randint(0, 2, shape).astype(np.float32)
            else:
                fd[name + ":0"] = rng.randn(*shape).astype(np.float32)
        out.append(fd)
    return out


def strategy(mode: str, ir, topo) -> Strategy:
    grouping = group_ops(ir, 8)
    everything = tuple(g.index for g in topo.groups)
    ps_device = topo.num_devices - 1
    if mode == "allreduce":
        return builtin_strategy("dp_allreduce", ir, topo, grouping)
    if mode == "ps":
        return Strategy(grouping, [Action(everything, "ps", ps_device=ps_device)] * grouping.num_groups)
    part = builtin_strategy("partition", ir, topo, grouping)
    if mode == "partition":
        return part
    actions, partition = [], {}
    for g in range(grouping.num_groups):
        kind = ("allreduce", "ps", "partition")[g % 3]
        actions.append(Action(everything, kind, ps_device=ps_device if kind == "ps" else None))
        if kind == "partition":
            partition.update({int(i): part.partition[int(i)] for i in grouping.members(g)})
    return Strategy(grouping, actions, partition)


# ------------------------------------------------------------------------------------------------
# fast: what analyze reads, and that every rewrite imports
# ------------------------------------------------------------------------------------------------

def _tf_trainable_sizes(gd) -> dict[str, int]:
    """Trainable variables as TensorFlow built them: the variables a gradient reaches (not slots)."""
    sizes = {}
    for n in gd.node:
        if n.op in ("VarHandleOp", "VariableV2") and not any(
                n.name.endswith(s) for s in ("/Adam", "/Adam_1", "/Momentum", "/Adagrad", "/RMSProp", "/RMSProp_1",
                                             "/Ftrl", "/Ftrl_1", "/Adadelta", "/Adadelta_1", "_power")):
            sizes[n.name] = int(np.prod([d.size for d in n.attr["shape"].shape.dim]))
    return sizes


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=_id)
def test_every_optimizer_reads_all_parameters(case):
    """Every tf.compat.v1.train optimizer, dense and sparse, resource and ref: every weight is trainable
    (with its update op, gradient and slots), slots are slots, FLOPs and memory are counted."""
    gd, ir = graph(case)
    o, sparse, resource = case
    sizes = _tf_trainable_sizes(gd)
    trainable = {v.name: v for v in ir.variables if v.kind == "trainable"}
    assert set(trainable) == set(sizes) and ir.num_parameters == sum(sizes.values())
    for v in trainable.values():
        assert v.apply_op in ir.op_index and v.gradient, v.name
        assert ir.ops[ir.op_index[v.apply_op]].phase == "update"
    slots_per_weight = {"sgd": 0, "momentum": 1, "adam": 2, "adagrad": 1, "rmsprop": 2, "ftrl": 2, "adadelta": 2}
    assert all(len(v.slots) == slots_per_weight[o] for v in trainable.values())
    assert sum(v.kind == "slot" for v in ir.variables) == slots_per_weight[o] * len(trainable)
    if sparse:   # the table's update touches the looked-up rows: FLOPs scale with the batch
        table = trainable["emb"]
        assert table.slot_bytes == slots_per_weight[o] * table.nbytes
        update_ops = [op for op in ir.ops if op.phase == "update" and op.colocation_group is not None
                      and op.colocation_group == ir.ops[table.op].colocation_group]
        assert sum(op.flops.per_example for op in update_ops) > 0
    assert not ir.unknown_op_types


@pytest.mark.parametrize("name", ["causal_lm", "causal_lm_sequence", "recommender", "lstm_lm", "keras_mlp"])
def test_models_rewrite_and_import(name):
    """Every strategy's rewrite of the language models, the recommender, the LSTM and the Keras model
    imports (shapes check out on every replica)."""
    gd, ir = graph(name)
    for mode in MODES:
        res = rewrite(gd, ir, strategy(mode, ir, FAKE), FAKE)
        assert res.loss and res.train_op


def test_recommender_reads_tables_and_folded_zeros_like():
    """Four embedding tables updated by TF1 Adam's scatters are trainable with their Adam slots; the
    zeros_like TF folded into a Const [B] has the batch axis, and each replica gets its share of it."""
    gd, ir = graph("recommender")
    trainable = {v.name for v in ir.variables if v.kind == "trainable"}
    assert {f"table_{t}" for t in range(4)} <= trainable and ir.num_parameters == 4 * 50 * 4 + 16 * 8 + 8
    zeros = ir.ops[ir.op_index["logistic_loss/zeros_like"]]
    assert zeros.type == "Const" and zeros.outputs[0].batch_axis == 0 and zeros.outputs[0].nbytes.fixed == 0
    res = rewrite(gd, ir, strategy("allreduce", ir, FAKE), FAKE)
    consts = {n.name: n for n in res.graph_def.node if n.name.startswith("logistic_loss/zeros_like/")}
    assert sorted(len(tf.make_ndarray(n.attr["value"].tensor)) for n in consts.values()) == [2, 2, 4]


def test_undecided_batch_axis_error_names_the_op():
    """Where a batch-sized tensor's batch axis is not known, the error names the op and says what to change."""
    import copy

    gd, ir = graph("recommender")
    broken = copy.deepcopy(ir)
    broken.ops[broken.op_index["logistic_loss/zeros_like"]].outputs[0].batch_axis = None
    with pytest.raises(RewriteError, match=r"'logistic_loss/GreaterEqual'.*unknown batch dimension") as err:
        rewrite(gd, broken, strategy("allreduce", broken, FAKE), FAKE)
    assert "\n" not in str(err.value)


def test_causal_lm_shifted_positions_carry_the_batch():
    """logits[:, :-1] flattened to B x (S-1) positions: the flattened logits, the shifted targets and the
    loss's gradient all carry the batch."""
    for name in ("causal_lm", "causal_lm_sequence"):
        gd, ir = graph(name)
        grads = [op for op in ir.ops if op.type == "SparseSoftmaxCrossEntropyWithLogits"]
        assert grads and all(t.batch_axis == 0 for t in grads[0].outputs)
        assert ir.num_parameters == 16 * 8 + 8 * 8 + 8 * 24 + 8 * 8


def test_lstm_reads_loop_weights_and_costs_loops():
    """The tf_keras LSTM language model: every weight (the embedding updated sparsely, the LSTM kernels
    read inside the While bodies) is trainable; TensorList ops have a rule; each loop costs its body
    times its trips and is one colocation unit with its gradient loop."""
    import tf_keras  # noqa: F401

    gd, ir = graph("lstm_lm")
    model = rg.lstm_lm_model()
    assert ir.num_parameters == model.count_params() == 12 * 8 + 2 * (4 * 8 * 16 + 32) + 8 * 12 + 12
    assert not ir.unknown_op_types
    loops = [op for op in ir.ops if op.type in ("While", "StatelessWhile")]
    assert len(loops) == 4
    for fwd in (op for op in loops if op.phase == "forward"):
        grad = next(op for op in loops if op.phase == "backward" and fwd.name in op.name)
        assert fwd.colocation_group is not None and fwd.colocation_group == grad.colocation_group
        assert fwd.flops.per_example > 0
    first = ir.ops[ir.op_index["model/lstm/while"]]
    assert first.flops.per_example >= 6 * 2 * (8 * 32)        # 6 steps, at least the input projection
    grouping = group_ops(ir, 6)
    for fwd in (op for op in loops if op.phase == "forward"):
        grad = next(op for op in loops if op.phase == "backward" and fwd.name in op.name)
        assert grouping.group_of_op[ir.op_index[fwd.name]] == grouping.group_of_op[ir.op_index[grad.name]]


def test_keras_helper_graph_and_errors():
    """training_graph_def: zoo names, the declared batch, one-line GraphErrors for what it cannot use."""
    gd, ir = graph("keras_mlp")
    nodes = {n.name: n for n in gd.node}
    assert {"input", "labels", "loss", "train_op", "init"} <= set(nodes)
    assert [d.size for d in nodes["input"].attr["shape"].shape.dim] == [B, 5]
    assert ir.batch_size == B and ir.num_parameters == 5 * 6 + 6 + 6 * 3 + 3
    with pytest.raises(GraphError, match="unknown optimizer 'nope'"):
        training_graph_def(keras_mlp, "mse", "nope", 4)
    with pytest.raises(GraphError, match="batch_size"):
        training_graph_def(keras_mlp, "mse", "sgd", 0)
    with pytest.raises(GraphError, match="tf_keras.Model"):
        training_graph_def(42, "mse", "sgd", 4)
    built = keras_mlp()   # a built model is cloned into the training graph
    gd2 = training_graph_def(built, "mse", "adam", 4, label_shape=(3,))
    assert analyze(gd2).num_parameters == built.count_params()


# ------------------------------------------------------------------------------------------------
# slow: same training as the original graph on one device
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    ports, servers = in_process_servers(3)
    return topology(ports, [0.1, 0.05, 0.05]), servers[0].target, servers


def _config(base=None):
    cfg = base or tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    return cfg


def _import(gd) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    return g


def _value_tensors(g, names):
    out = []
    with g.as_default():
        for n in names:
            op = g.get_operation_by_name(n)
            if op.type == "VarHandleOp":
                out.append(tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=op.get_attr("dtype")))
            else:
                out.append(tf.identity(op.outputs[0]))
    return out


@lru_cache(maxsize=None)
def _reference(name):
    gd, ir = graph(name)
    weights = [v.name for v in ir.variables if v.kind == "trainable"]
    g = _import(gd)
    reads = _value_tensors(g, weights)
    out = []
    with tf1.Session(graph=g, config=_config()) as s:
        s.run("init")
        for fd in feeds(gd, ir):
            loss = s.run(["loss:0", "train_op"], fd)[0]
            out.append((float(loss), s.run(reads)))
    return weights, out


def check_same_training(name, cluster_fixture, modes=MODES, expect_note: str | None = None):
    """Every mode of MODES: loss and every trainable weight (every copy) within RTOL of the original's.
    EXPECT_NOTE: a rewrite note every mode's rewrite must carry."""
    topo, target, _ = cluster_fixture
    gd, ir = graph(name)
    weights, ref = _reference(name)
    for mode in modes:
        res = rewrite(gd, ir, strategy(mode, ir, topo), topo)
        if expect_note is not None:
            assert any(expect_note in n for n in res.notes), (mode, res.notes)
        g = _import(res.graph_def)
        copies = [c for v in weights for c in res.variables[v]]
        reads = dict(zip(copies, _value_tensors(g, copies), strict=True))
        with tf1.Session(target, graph=g, config=bounded(_config(session_config()))) as s:
            s.run(res.init)
            for step, fd in enumerate(feeds(gd, ir)):
                loss = float(s.run([res.loss + ":0", res.train_op], fd)[0])
                ref_loss, ref_weights = ref[step]
                assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (mode, step, loss, ref_loss)
                got = s.run(reads)
                for v, r in zip(weights, ref_weights, strict=True):
                    scale = float(np.max(np.abs(r))) or 1.0
                    for c in res.variables[v]:
                        err = float(np.max(np.abs(got[c] - r)))
                        assert err <= RTOL * scale, f"{mode} step {step}: {c} differs by {err / scale:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=_id)
def test_optimizers_train_exactly(cluster, case):
    """Each optimizer x {dense, sparse} x {resource, ref}: every strategy trains like one device."""
    check_same_training(case, cluster)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in OPTIMIZER_CASES if c[1] and c[0] != "sgd"], ids=_id)
def test_sparse_gradients_summed_as_tables_train_exactly(cluster, case):
    """At a batch whose embedding rows (32 x 3 ids x 6 floats) outweigh twice the 20 x 6 table, every
    optimizer that deduplicates its sparse gradient gets it all-reduced as a dense table
    (``tag.strategy.sparse``) under dp_allreduce, and trains like one device."""
    o, sparse, resource = case
    check_same_training((o, sparse, resource, 32), cluster, modes=("allreduce",),
                        expect_note="summed as a dense 20-row table")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal_lm", "causal_lm_sequence", "recommender", "lstm_lm", "keras_mlp"])
def test_models_train_exactly(cluster, name):
    """The causal LM (shifted tokens, both loss forms), the recommender (sparse tables, folded
    zeros_like), the tf_keras LSTM LM (While loops) and a Keras model through training_graph_def:
    every strategy trains like one device."""
    check_same_training(name, cluster)
