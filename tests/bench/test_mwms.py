"""tag_bench.mwms: the models tag and the tf.distribute anchor both train, as TF1 training graphs."""
from __future__ import annotations


def test_mlp_graph_has_the_entry_points_and_about_8m_parameters():
    from tag.frontend.analyze import analyze
    from tag_bench.mwms import tf1_graph
    gd = tf1_graph("mlp", 96)
    names = {n.name for n in gd.node}
    assert {"input", "labels", "loss", "train_op", "init"} <= names
    tg = analyze(gd, batch_size=96)
    params = sum(v.nbytes for v in tg.variables if v.kind == "trainable") // 4
    assert 7.5e6 < params < 8.5e6


def test_vgg_graph_keeps_most_weights_in_the_head_and_most_flops_in_the_convolutions():
    from tag.frontend.analyze import analyze
    from tag_bench.mwms import tf1_graph
    tg = analyze(tf1_graph("vgg", 6), batch_size=6)
    weights = {v.name: v.nbytes // 4 for v in tg.variables if v.kind == "trainable"}
    head = sum(n for name, n in weights.items() if "dense" in name)
    assert 2.0e6 < sum(weights.values()) < 2.5e6 and head / sum(weights.values()) > 0.9
    conv = sum(o.flops.per_example for o in tg.ops if o.type.startswith("Conv2D"))
    dense = sum(o.flops.per_example for o in tg.ops if o.type == "MatMul")
    assert conv > 4 * dense             # about 80% of the FLOPs


def test_float64_build_has_float64_weights_and_inputs_and_leaves_keras_in_float32():
    import tensorflow as tf
    import tf_keras

    from tag_bench.mwms import tf1_graph
    # even under a global policy pinned to float32 (as a test that restores the policy leaves it)
    old = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy("float32")
    try:
        gd = tf1_graph("mlp", 8, width=32, depth=2, floatx="float64")
        assert tf_keras.mixed_precision.global_policy().name == "float32"
    finally:
        tf_keras.mixed_precision.set_global_policy(old)
    nodes = {n.name: n for n in gd.node}
    assert nodes["input"].attr["dtype"].type == tf.float64.as_datatype_enum
    kernels = [n for n in gd.node if n.op == "VarHandleOp" and n.name.endswith("kernel")]
    assert kernels and all(n.attr["dtype"].type == tf.float64.as_datatype_enum for n in kernels)
    matmuls = [n for n in gd.node if n.op == "MatMul"]
    assert matmuls and all(n.attr["T"].type == tf.float64.as_datatype_enum for n in matmuls)
    assert tf_keras.backend.floatx() == "float32"                 # restored for the next build
    gd32 = tf1_graph("mlp", 8, width=32, depth=2)
    # the same ops; float64 adds the optimizer's casts of its hyperparameters (and reads them there)
    assert {n.name for n in gd32.node if n.op != "ReadVariableOp"} <= set(nodes)
