"""tag.zoo: every model builds a real TF1 training step, parameter counts match the literature,
steps run in a real Session, and user GraphDef files load or fail with one-line PATH: errors.

Parameters are counted straight from the GraphDef (sizes of the variables that ResourceApply* ops
update), so these tests do not depend on the graph analysis (tag.frontend).
"""
from __future__ import annotations

import functools
import os
from itertools import pairwise

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from helpers import trained_variables
from tag import zoo  # noqa: E402
from tag.errors import GraphError  # noqa: E402
from tiny import TINY_ZOO_OPTIONS

BATCH = 2
TINY = TINY_ZOO_OPTIONS


@functools.lru_cache(maxsize=None)
def tiny(name: str) -> tf.compat.v1.GraphDef:
    return zoo.training_graph(name, batch_size=BATCH, **TINY[name])


def _shape(node) -> list[int]:
    return [d.size for d in node.attr["shape"].shape.dim]


def num_params(gd) -> int:
    return sum(trained_variables(gd).values())


# Analytic counts, checked against the graphs at tiny sizes and used to cross-check the defaults.
def mlp_params(input_dim=784, hidden=(2048, 2048), num_classes=10) -> int:
    dims = [input_dim, *hidden, num_classes]
    return sum(a * b + b for a, b in pairwise(dims))


def vgg19_params(image_size=224, num_classes=1000) -> int:
    convs = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256)] + [(256, 256)] * 3 + [(256, 512)] \
        + [(512, 512)] * 7
    feat = (image_size // 32) ** 2 * 512
    return sum(9 * a * b + b for a, b in convs) + feat * 4096 + 4096 + 4096 * 4096 + 4096 \
        + 4096 * num_classes + num_classes


def transformer_params(seq_len=64, vocab_size=37000, num_layers=6, d_model=512, d_ff=2048, num_heads=8) -> int:
    d = d_model
    attn, ffn, norm = 4 * (d * d + d), d * d_ff + d_ff + d_ff * d + d, 2 * d
    return vocab_size * d + num_layers * (attn + ffn + 2 * norm) + num_layers * (2 * attn + ffn + 3 * norm)


def bert_params(seq_len=128, vocab_size=30522, num_layers=12, hidden_size=768, num_heads=12,
                intermediate_size=3072, max_position=512, type_vocab_size=2, num_classes=2) -> int:
    h, i = hidden_size, intermediate_size
    emb = (vocab_size + max_position + type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + h * i + i + i * h + h + 2 * h
    return emb + num_layers * layer + (h * h + h) + h * num_classes + num_classes


BERT_LARGE = dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096)
FORMULA = {
    "mlp": mlp_params,
    "vgg19": vgg19_params,
    "transformer": transformer_params,
    "bert_base": bert_params,
    "bert_large": lambda **kw: bert_params(**{**BERT_LARGE, **kw}),
}


def expected_tiny_params(name: str) -> int:
    if name in FORMULA:
        return FORMULA[name](**TINY[name])
    return zoo.model_info(name)["parameters"]


# ------------------------------------------------------------------------------------------------

def test_names_are_the_eight_models():
    assert zoo.names() == ["mlp", "vgg19", "resnet50", "inception_v3", "mobilenet_v2", "transformer",
                           "bert_base", "bert_large"]


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(GraphError, match=r"unknown model 'alexnet' \(known: mlp, vgg19, .*bert_large\)"):
        zoo.training_graph("alexnet")
    with pytest.raises(GraphError, match="unknown model"):
        zoo.model_info("alexnet")


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_is_a_full_training_step(name):
    gd = tiny(name)
    nodes = {n.name: n for n in gd.node}
    # Named entry points.
    assert nodes["loss"].op == "Identity"
    assert nodes["init"].op == "NoOp" and nodes["train_op"].op == "NoOp"
    # Placeholders: the documented names, all with a concrete batch dimension.
    placeholders = {n.name: n for n in gd.node if n.op == "Placeholder"}
    expected = {"input", "labels"} | ({"input_mask", "segment_ids"} if name.startswith("bert") else set()) \
        | ({"target_input"} if name == "transformer" else set())
    assert set(placeholders) == expected
    for node in placeholders.values():
        shape = _shape(node)
        assert shape[0] == BATCH and all(d > 0 for d in shape), (node.name, shape)
    # Gradients under "gradients/", one optimizer apply op per trainable weight.
    assert any(n.name.startswith("gradients/") for n in gd.node)
    applies = [n for n in gd.node if n.op.startswith("ResourceApply")]
    assert {n.op for n in applies} == ({"ResourceApplyMomentum"} if name in ("vgg19", "resnet50", "inception_v3",
                                                                               "mobilenet_v2")
                                       else {"ResourceApplyAdam"})
    assert len(trained_variables(gd)) == len(applies)
    # No dropout: the step is deterministic.
    assert not any("dropout" in n.name.lower() for n in gd.node)
    assert num_params(gd) == expected_tiny_params(name)


@pytest.mark.parametrize("name", ["resnet50", "inception_v3", "mobilenet_v2"])
def test_batchnorm_models_make_train_op_wait_for_moving_statistics(name):
    gd = tiny(name)
    nodes = {n.name: n for n in gd.node}
    controls = {i[1:] for i in nodes["train_op"].input if i.startswith("^")}
    updates = {n.name for n in gd.node if n.op == "AssignSubVariableOp" and "moving_" in n.input[0]}
    assert updates and updates <= controls
    # Batch statistics in training mode: no learning-phase cond in the graph.
    assert not any(n.op in ("If", "StatelessIf", "Switch") for n in gd.node)


def test_analytic_counts_agree_with_model_info_and_the_literature():
    for name, formula in FORMULA.items():
        info = zoo.model_info(name)
        assert formula() == info["parameters"], name
        assert abs(info["parameters"] - info["published_parameters"]) <= 0.03 * info["published_parameters"], name
    for name in ("resnet50", "inception_v3", "mobilenet_v2"):   # tiny builds keep the full count
        info = zoo.model_info(name)
        assert abs(info["parameters"] - info["published_parameters"]) <= 0.03 * info["published_parameters"]


def test_model_info_describes_each_model():
    for name in zoo.names():
        info = zoo.model_info(name)
        assert info["name"] == name and info["description"] and "\n" not in info["description"]
        assert info["options"]["seed"] == 0
    assert zoo.model_info("inception_v3")["options"]["image_size"] == 299
    assert zoo.model_info("bert_large")["options"]["hidden_size"] == 1024
    assert zoo.model_info("bert_large")["options"]["seq_len"] == 128
    assert zoo.model_info("transformer")["options"]["seq_len"] == 64


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_default_size_parameter_counts(name):
    gd = zoo.training_graph(name, batch_size=8)
    info = zoo.model_info(name)
    assert num_params(gd) == info["parameters"]
    assert abs(num_params(gd) - info["published_parameters"]) <= 0.03 * info["published_parameters"]


# ------------------------------------------------------------------------------------------------
# Running steps in a real Session

def feeds(gd, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every placeholder: floats ~N(0,1), ids below the model's vocabulary/class count."""
    rng = np.random.default_rng(seed)
    options = {}
    for n in gd.node:   # infer small integer ranges from the graph itself
        if n.op == "VarHandleOp" and n.name.endswith(("word_embeddings", "shared_embedding")):
            options["vocab"] = _shape(n)[0]
    out = {}
    for n in gd.node:
        if n.op != "Placeholder":
            continue
        shape = _shape(n)
        if n.attr["dtype"].type == tf.float32.as_datatype_enum:
            out[n.name + ":0"] = rng.standard_normal(shape).astype(np.float32)
        elif n.name == "input_mask":
            out[n.name + ":0"] = np.ones(shape, np.int32)
        elif n.name in ("segment_ids",):
            out[n.name + ":0"] = rng.integers(0, 2, shape).astype(np.int32)
        elif n.name == "labels" and len(shape) == 1:
            out[n.name + ":0"] = rng.integers(0, 2, shape).astype(np.int32)
        else:
            out[n.name + ":0"] = rng.integers(0, options.get("vocab", 2), shape).astype(np.int32)
    return out


def run_steps(gd, steps: int, read_variable: str | None = None):
    """Import GD, initialise, run STEPS training steps; return the losses and VARIABLE's values."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(gd, name="")
        fetch_extra = None
        if read_variable:
            fetch_extra = tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(read_variable + ":0"),
                                                    dtype=tf.float32)
    losses, extra = [], []
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run("init")
        feed = feeds(gd)
        for _ in range(steps):
            if fetch_extra is not None:
                extra.append(sess.run(fetch_extra))
            loss, _ = sess.run(["loss:0", "train_op"], feed)
            losses.append(float(loss))
        if fetch_extra is not None:
            extra.append(sess.run(fetch_extra))
    return losses, extra


@pytest.mark.parametrize("name", ["mlp", "bert_base", "transformer"])
def test_training_step_runs_and_changes_the_loss(name):
    losses, _ = run_steps(tiny(name), 3)
    assert all(np.isfinite(losses))
    assert losses[1] != losses[0] and losses[2] != losses[1]


def test_resnet50_step_runs_and_updates_batchnorm_statistics():
    gd = tiny("resnet50")
    losses, means = run_steps(gd, 2, read_variable="conv1_bn/moving_mean")
    assert all(np.isfinite(losses)) and losses[1] != losses[0]
    assert not np.allclose(means[0], means[1])      # train_op ran the moving-statistics update


def test_seed_makes_initial_weights_reproducible():
    opts = dict(batch_size=BATCH, **TINY["mlp"])
    a, b = zoo.training_graph("mlp", cache=False, **opts), zoo.training_graph("mlp", cache=False, **opts)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    first = run_steps(a, 1)[0][0]
    assert run_steps(b, 1)[0][0] == first
    assert run_steps(zoo.training_graph("mlp", seed=7, **opts), 1)[0][0] != first


def test_keras_models_are_reproducible_and_leave_python_random_alone():
    import random
    opts = dict(batch_size=BATCH, image_size=32, num_classes=10, cache=False)
    random.seed(11)
    expected_next = random.random()
    random.seed(11)
    a = zoo.training_graph("vgg19", **opts)
    assert random.random() == expected_next           # the caller's random stream is untouched
    b = zoo.training_graph("vgg19", **opts)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert zoo.training_graph("vgg19", seed=3, **opts) != a


def test_cache_returns_independent_copies():
    opts = dict(batch_size=3, input_dim=5, hidden=(7,), num_classes=2)
    first = zoo.training_graph("mlp", **opts)
    first.node[0].name = "mutated"
    again = zoo.training_graph("mlp", **opts)
    assert again.node[0].name != "mutated"
    assert again == zoo.training_graph("mlp", cache=False, **opts)
    # Spelling out a default option is the same graph.
    assert zoo.training_graph("mlp", num_classes=2, seed=0, input_dim=5, hidden=[7], batch_size=3) == again


@pytest.mark.parametrize("name, options, message", [
    ("mlp", {"colour": 3}, r"unknown option 'colour' for model 'mlp' \(known: .*hidden"),
    ("mlp", {"hidden": (8, 0)}, "hidden layer width must be a positive integer"),
    ("mlp", {"learning_rate": float("nan")}, "learning_rate"),
    ("resnet50", {"image_size": 16}, "image_size 16 is below its minimum 32"),
    ("inception_v3", {"image_size": 64}, "below its minimum 75"),
    ("bert_base", {"seq_len": 600}, "seq_len 600 exceeds max_position 512"),
    ("bert_base", {"hidden_size": 30, "num_layers": 1}, "not divisible by num_heads 12"),
    ("transformer", {"num_layers": -1}, "num_layers"),
    ("transformer", {"d_model": 33, "num_heads": 3}, "d_model must be even"),
    ("vgg19", {"num_classes": 2.5}, "num_classes"),
])
def test_bad_options_raise_graph_error(name, options, message):
    with pytest.raises(GraphError, match=message):
        zoo.training_graph(name, batch_size=2, **options)


@pytest.mark.parametrize("batch", [0, -4, 2.0, True, "8"])
def test_bad_batch_size(batch):
    with pytest.raises(GraphError, match="batch_size must be a positive integer"):
        zoo.training_graph("mlp", batch_size=batch)


# ------------------------------------------------------------------------------------------------
# User GraphDef files

def _write(path, data: bytes | str):
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return str(path)


def test_load_graph_def_round_trip(tmp_path):
    gd = tiny("mlp")
    binary = _write(tmp_path / "m.pb", gd.SerializeToString())
    text = _write(tmp_path / "m.pbtxt", str(gd))
    other = _write(tmp_path / "m.graph", gd.SerializeToString())
    for path in (binary, text, other):
        assert zoo.load_graph_def(path) == gd
    # A text file named .pb (and the reverse) still loads: the other format is tried second.
    assert zoo.load_graph_def(_write(tmp_path / "t.pb", str(gd))) == gd
    assert zoo.load_graph_def(_write(tmp_path / "b.pbtxt", gd.SerializeToString())) == gd


def test_graph_written_in_raw_tf_ops_loads(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_sum(tf.matmul(x, w))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    path = _write(tmp_path / "user.pbtxt", str(g.as_graph_def()))
    loaded = zoo.load_graph_def(path)
    assert trained_variables(loaded) == {"w": 3}
    assert zoo.resolve_model(path)[0] == "user"


@pytest.mark.parametrize("case, content, message", [
    ("empty", b"", "empty file"),
    ("blank", b"  \n\n", "empty file"),
    ("garbage", bytes(range(256)) * 4, "truncated or not a GraphDef"),
    ("text_typo", 'node {\n  name: "a"\n  op: "Const"\n}\nnode {\n  nme: "b"\n}\n',
     r":6: not a text GraphDef: .*nme"),
    ("json", '{"node": [{"name": "a"}]}', r":1: not a text GraphDef"),
    ("yaml", "node:\n  - name: a\n    op: Const\n", r":2: not a text GraphDef"),
    ("no_nodes", 'versions { producer: 1 }\n', "no nodes: not a TensorFlow GraphDef"),
    ("dangling", 'node { name: "a" op: "Identity" input: "missing:0" }\n',
     r"node 'a' reads 'missing:0', which is not in the graph"),
    ("duplicate", 'node { name: "a" op: "NoOp" }\nnode { name: "a" op: "NoOp" }\n', "node name 'a' appears twice"),
    ("no_op", 'node { name: "a" }\n', "a node without a name or op"),
])
def test_load_graph_def_errors_are_one_line_with_the_path(tmp_path, case, content, message):
    path = _write(tmp_path / f"{case}.pbtxt", content)
    with pytest.raises(GraphError, match=message) as err:
        zoo.load_graph_def(path)
    text = str(err.value)
    assert text.startswith(path + ":") and "\n" not in text


def test_truncated_and_invalid_binary_files(tmp_path):
    data = tiny("mlp").SerializeToString()
    for cut in (len(data) // 2, len(data) - 3, 7):
        path = _write(tmp_path / f"cut{cut}.pb", data[:cut])
        with pytest.raises(GraphError) as err:
            zoo.load_graph_def(path)
        assert str(err.value).startswith(path + ": ") and "\n" not in str(err.value)
    # Nodes only, cut before the trailing versions field: parses, but is not a whole TF graph.
    no_versions = tf.compat.v1.GraphDef()
    no_versions.node.extend(tiny("mlp").node)
    path = _write(tmp_path / "noversions.pb", no_versions.SerializeToString())
    with pytest.raises(GraphError, match="no 'versions' field"):
        zoo.load_graph_def(path)
    path = _write(tmp_path / "latin1.pbtxt", "node { name: \"caf\xe9\" }".encode("latin-1") + b"\xff\xfe")
    with pytest.raises(GraphError, match="not a GraphDef|truncated"):
        zoo.load_graph_def(path)


def test_unreadable_paths(tmp_path):
    with pytest.raises(GraphError, match=r": no such file$"):
        zoo.load_graph_def(tmp_path / "nope.pb")
    with pytest.raises(GraphError, match="is a directory"):
        zoo.load_graph_def(tmp_path)


def test_resolve_model_specs(tmp_path):
    name, gd = zoo.resolve_model("zoo:mlp,input_dim=6,hidden=8x4,num_classes=3,learning_rate=0.5", batch_size=5)
    assert name == "mlp"
    assert trained_variables(gd) == {"mlp/dense_0/kernel": 48, "mlp/dense_0/bias": 8, "mlp/dense_1/kernel": 32,
                                     "mlp/dense_1/bias": 4, "mlp/logits/kernel": 12, "mlp/logits/bias": 3}
    assert _shape({n.name: n for n in gd.node}["input"]) == [5, 6]
    assert _shape({n.name: n for n in zoo.resolve_model("zoo:mlp,hidden=8")[1].node}["input"])[0] \
        == zoo.DEFAULT_BATCH_SIZE
    path = _write(tmp_path / "net.pb", gd.SerializeToString())
    assert zoo.resolve_model(path) == ("net", gd)
    for spec, message in [("", "empty --model"), ("zoo:nope", "unknown model 'nope'"),
                          ("zoo:mlp,hidden", "bad option 'hidden'"), ("zoo:mlp,hidden=big", "expected a number"),
                          ("zoo:mlp,depth=3", "unknown option 'depth'"),
                          (str(tmp_path / "missing.pbtxt"), "no such file")]:
        with pytest.raises(GraphError, match=message):
            zoo.resolve_model(spec)
