"""Precision in the cost model (tag.cost.precision) and the mixed-precision graph rewrite
(tag.frontend.precision): tensor-core peaks by dtype, TF32, XLA fusion, the rewritten graph's step."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tag.cost.model import CostModel
from tag.cost.precision import fusion_bytes, gradient_bytes_factor, op_precisions
from tag.errors import TagError
from tiny import DeviceSpec, GraphBuilder, make_topology, mlp_graph


def _graph(dtype: str):
    """x -> MatMul (256x256x256) -> BiasAdd -> Relu -> Identity, all in DTYPE."""
    size = 2 if dtype in ("half", "bfloat16") else 4
    b = GraphBuilder(batch_size=256)
    b.op("x", "Placeholder", out_pe=256 * size, dtype=dtype)
    b.op("mm", "MatMul", inputs=("x",), flops=2e11, out_pe=256 * size, dtype=dtype)
    b.op("bias", "BiasAdd", inputs=("mm",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    b.op("relu", "Relu", inputs=("bias",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    b.op("out", "Square", inputs=("relu",), flops_pe=256, out_pe=256 * size, dtype=dtype)
    tg = b.build()
    for op in tg.ops[:2]:
        op.outputs[0].shape = (256, 256)
    return tg


def _topo(device_type: str = "A100", peak: float = 19.5e12):
    return make_topology([("h0", [(device_type, 1)])],
                         specs={device_type: DeviceSpec(peak_flops=peak, memory_bandwidth=1555e9)})



def _two_loopback_hosts():
    """Two in-process TF servers on loopback and a topology of one CPU host each: (ports, servers, topology)."""
    import tag
    from helpers import in_process_servers
    ports, servers = in_process_servers(2)
    topo = tag.parse_topology("\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU memory_gib: 2 '
        f'peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}' for i, p in enumerate(ports))
        + "\nfabric { bandwidth_gbps: 10 }\n")
    return ports, servers, topo

def test_half_matmuls_run_at_the_tensor_core_peak_and_tf32_only_where_enabled():
    fp32, half = _graph("float32"), _graph("half")
    assert op_precisions(half)[1] == "fp16" and op_precisions(fp32)[1] == "fp32"
    topo = _topo()
    t32 = CostModel(fp32, topo).op_times(0, 256)
    t16 = CostModel(half, topo).op_times(0, 256)
    ttf = CostModel(fp32, topo, tf32=True).op_times(0, 256)
    r = CostModel(half, topo).rates(0)
    assert r.peak_for("fp16") == pytest.approx(312e12) and r.peak_for("tf32") == pytest.approx(156e12)
    # the MatMul: FP32 peak x class efficiency vs the FP16 tensor-core peak x its efficiency
    assert t16[1] < t32[1] / 4 and t16[1] < ttf[1] < t32[1] / 2
    # memory-bound ops at the bytes of their dtype: half the bytes of FP32
    assert (t32[3] - r.launch_overhead_s) == pytest.approx(2 * (t16[3] - r.launch_overhead_s))
    # a GPU with no TF32 (V100) keeps its FP32 time with tf32=True
    v100 = _topo("V100", 15.7e12)
    with_tf32 = CostModel(fp32, v100, tf32=True).op_times(0, 256)[1]
    assert with_tf32 == pytest.approx(CostModel(fp32, v100).op_times(0, 256)[1])


def test_gradients_cast_to_16_bits_halve_the_allreduce_bytes_of_float32_weights():
    """CostModel(gradient_dtype="fp16"): a runtime that all-reduces float32 gradients as float16
    (tf_cnn_benchmarks --use_fp16, Horovod's fp16 compression) moves half the bytes; the fixed cost stays."""
    g = mlp_graph(batch=8, widths=(64, 128, 10))
    assert gradient_bytes_factor(g, None) == 1.0 and gradient_bytes_factor(g, "fp32") == 1.0
    assert gradient_bytes_factor(g, "fp16") == pytest.approx(0.5)
    topo = make_topology([("h0", [("V100", 4)])],
                         specs={"V100": DeviceSpec(peak_flops=15.7e12, memory_bandwidth=900e9)})
    (a32, b32), (ha32, hb32) = CostModel(g, topo).allreduce_coeffs(range(4))
    (a16, b16), (ha16, hb16) = CostModel(g, topo, gradient_dtype="fp16").allreduce_coeffs(range(4))
    assert b32 > 0 and b16 == pytest.approx(b32 / 2) and a16 == pytest.approx(a32)
    assert hb16 == pytest.approx(hb32 / 2) and ha16 == pytest.approx(ha32)
    assert CostModel(g, topo, gradient_dtype="fp16").allreduce_time(1e8, range(4)) < \
        CostModel(g, topo).allreduce_time(1e8, range(4))
    with pytest.raises(TagError, match="unknown gradient dtype 'int8'"):
        CostModel(g, topo, gradient_dtype="int8")


def test_xla_fuses_elementwise_chains_into_one_pass_over_memory():
    tg = _graph("float32")
    fixed, per, fused = fusion_bytes(tg)
    # BiasAdd reads the MatMul output (not fusible: paid) and hands on to Relu (not written);
    # Relu reads and writes nothing outside; Square writes the chain's output
    assert list(fused) == [False, False, False, True, True]
    assert per[2] == pytest.approx(256 * 4) and per[3] == 0.0 and per[4] == pytest.approx(256 * 4)
    topo = _topo()
    plain = CostModel(tg, topo).op_times(0, 256)
    xla = CostModel(tg, topo, xla=True).op_times(0, 256)
    assert xla[1] == plain[1]                      # the MatMul is untouched
    assert xla[2:].sum() < plain[2:].sum() / 2     # three passes and launches become one


def test_xla_chain_reads_an_outside_tensor_once_and_recomputes_element_wise_results_across_phases():
    """A fused kernel loads each parameter once: the MatMul output that three ops of one forward chain read
    (Mul(mm, mm), Relu(mm)) is paid once. The chain's result `out`, which only a backward chain reads, is
    not written: the backward chain recomputes it from mm (which it reads once) instead of reading it;
    `kept`, which a MatMul also reads, is written and read. An Identity between two ops does not break
    their chain."""
    b = GraphBuilder(batch_size=256)
    b.op("x", "Placeholder", out_pe=1024)
    b.op("mm", "MatMul", inputs=("x",), flops=2e11, out_pe=1024)
    b.op("mul", "Mul", inputs=("mm", "mm"), flops_pe=256, out_pe=1024)
    b.op("relu", "Relu", inputs=("mm",), flops_pe=256, out_pe=1024)
    b.op("add", "AddV2", inputs=("mul", "relu"), flops_pe=256, out_pe=1024)
    b.op("out", "Square", inputs=("add",), flops_pe=256, out_pe=1024)
    b.op("kept", "Tanh", inputs=("mm",), flops_pe=256, out_pe=1024)
    b.op("mm2", "MatMul", inputs=("kept",), flops=2e11, out_pe=1024)
    b.op("gmul", "Mul", "backward", inputs=("mm", "out"), flops_pe=256, out_pe=1024)
    b.op("dep", "Identity", "backward", inputs=("gmul",), out_pe=1024)     # tf.gradients' control_dependency
    b.op("gneg", "Neg", "backward", inputs=("dep", "mm", "kept"), flops_pe=256, out_pe=1024)
    tg = b.build()
    fixed, per, fused = fusion_bytes(tg)
    ix = tg.op_index
    assert tg.ops[ix["mul"]].mem_bytes.per_example == pytest.approx(3 * 1024)     # unfused: mm read twice
    # forward: mm read once by the chain {mul, relu, add, out}; `out` is not written
    assert per[ix["mul"]] + per[ix["relu"]] + per[ix["add"]] + per[ix["out"]] == pytest.approx(1024)
    # `kept` (another chain) reads mm and is written for the MatMul
    assert per[ix["kept"]] == pytest.approx(2 * 1024)
    # backward: mm once (out recomputed from it), kept once, the result written once
    assert per[ix["gmul"]] + per[ix["gneg"]] == pytest.approx(3 * 1024)
    assert list(fused[ix["mul"]:ix["kept"]]) == [False, False, True, True]
    assert fused[ix["gneg"]] and not fused[ix["gmul"]]


def test_xla_batch_norm_makes_a_second_pass_over_its_batch_sized_inputs():
    """Batch norm in training needs its statistics over the batch before it can normalise, so under XLA it reads
    its input twice; an input a chain produced itself is then written for that second pass."""
    b = GraphBuilder(batch_size=256)
    b.op("x", "Placeholder", out_pe=1024)
    b.op("conv", "Conv2D", inputs=("x",), flops=2e11, out_pe=1024)
    b.op("bn", "FusedBatchNormV3", inputs=("conv",), flops_pe=256, out_pe=1024)
    b.op("relu", "Relu", inputs=("bn",), flops_pe=256, out_pe=1024)
    b.op("bn2", "FusedBatchNormV3", inputs=("relu",), flops_pe=256, out_pe=1024)
    b.op("out", "Square", inputs=("bn2",), flops_pe=256, out_pe=1024)
    tg = b.build()
    _, per, _ = fusion_bytes(tg)
    ix = tg.op_index
    assert per[ix["bn"]] == pytest.approx(2 * 1024)       # the convolution's output, read twice
    assert per[ix["relu"]] == 0.0
    assert per[ix["bn2"]] == pytest.approx(2 * 1024)      # relu's output written, then read once more
    assert per[ix["out"]] == pytest.approx(1024)


# ------------------------------------------------------------------------------------------------
# the mixed-precision rewrite of a GraphDef, and a plan made for it
# ------------------------------------------------------------------------------------------------

MLP = dict(input_dim=20, hidden=(32, 16), num_classes=5)


def _half_ops(gd) -> dict[str, int]:
    import tensorflow as tf
    out: dict[str, int] = {}
    for n in gd.node:
        if n.op in ("MatMul", "Conv2D") and "T" in n.attr:
            name = tf.as_dtype(n.attr["T"].type).name
            out[name] = out.get(name, 0) + 1
    return out


@pytest.mark.parametrize("precision, dtype, rtol", [("mixed_bfloat16", "bfloat16", 5e-2),
                                                    ("mixed_float16", "float16", 1e-2)])
def test_mixed_precision_plan_matches_the_single_device_mixed_step(precision, dtype, rtol):
    """The graph rewritten by TF's mixed-precision pass has half-precision MatMuls (with FP16 loss scaling),
    the IR costs them at the tensor-core peak, and tag's data-parallel plan of it trains like the
    rewritten graph on one device: over 3 steps every weight within RTOL of the reference's update so far
    (half-precision tolerance: bfloat16 has an 8-bit mantissa, float16 10 bits, and the replicas' half-size
    batches round differently; measured 1.3% and 0.14%)."""
    import tensorflow as tf

    import tag
    from helpers import train_copies
    from tag.api import prepare
    ports, servers, topo = _two_loopback_hosts()
    gd = tag.zoo.training_graph("mlp", batch_size=8, **MLP)
    analysis = prepare(gd, topo, precision=precision)
    assert _half_ops(analysis.graph_def).get(dtype, 0) >= 6
    # forward products and input gradients in half precision; weight gradients too where TensorFlow's own
    # pass ran (tag's fallback on CPUs without AVX-512 BF16 keeps them float32: tag/frontend/precision.py)
    assert all(tf.as_dtype(n.attr["T"].type).name == dtype for n in analysis.graph_def.node
               if n.op == "MatMul" and not n.attr["transpose_a"].b)
    assert "fp16" in op_precisions(analysis.graph) or "bf16" in op_precisions(analysis.graph)
    if precision == "mixed_float16":      # static loss scaling: a scaled seed, an unscale per update
        names = [n.name for n in analysis.graph_def.node]
        assert any(n.endswith("/loss_scale") for n in names) and sum(n.endswith("/unscale") for n in names) == 6
    # gradients reach the optimizer (and the all-reduce) in float32, as the variables are
    assert {v.dtype for v in analysis.graph.variables if v.kind == "trainable"} == {"float32"}
    from tag.strategy.baselines import builtin_strategy
    rr = analysis.rewrite(builtin_strategy("dp_allreduce", analysis.graph, topo, analysis.grouping,
                                           analysis.cost_model))
    rng = np.random.RandomState(0)
    batches = [{"input:0": rng.randn(8, 20).astype(np.float32), "labels:0": rng.randint(0, 5, 8).astype(np.int32)}
               for _ in range(3)]
    trained = [v for v in analysis.graph.variables if v.kind == "trainable"]
    # the rewritten graph on one device
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(analysis.graph_def, name="")
        reads = [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(v.name + ":0"), dtype=tf.float32)
                 for v in trained]
    cfg = tf.compat.v1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    ref = []
    with tf.compat.v1.Session(graph=g, config=cfg) as s:
        s.run(analysis.entry.init)
        initial = s.run(reads)
        for fd in batches:
            loss, _ = s.run([analysis.entry.loss + ":0", analysis.entry.train_op], fd)
            ref.append((float(loss), s.run(reads)))
    got = train_copies(rr, analysis.graph, batches)
    worst = 0.0
    for copies, (_, weights) in zip(got, ref, strict=True):
        for v, w, w0 in zip(trained, weights, initial, strict=True):
            moved = float(np.max(np.abs(w - w0)))       # the reference's update so far
            assert moved > 0
            for c in copies[v.name]:
                worst = max(worst, float(np.max(np.abs(c - w))) / moved)
    print(precision, "largest weight difference / update", worst)
    assert worst <= rtol


def test_fp16_loss_scale_unscaling_is_a_backward_op_so_allreduces_overlap_the_backward_pass():
    """The 1 / LOSS_SCALE Mul each gradient gets before its update sits in the gradient's scope: a backward
    op (each replica unscales its own gradient), so a gradient's all-reduce is issued as soon as the
    gradient exists, not after the whole backward pass (update tasks run last)."""
    import tag
    from tag.frontend.precision import apply_precision
    from tag.sim.simulator import Simulator
    from tag.sim.task_graph import UPDATE_STAGE
    from tag.strategy.grouping import group_ops
    gd = apply_precision(tag.zoo.training_graph("mlp", batch_size=8, **MLP), "mixed_float16",
                         train_op="train_op", loss="loss")
    tg = tag.analyze(gd)
    unscale = [op for op in tg.ops if op.name.endswith("/unscale")]
    assert len(unscale) == 6 and {op.phase for op in unscale} == {"backward"}
    index = tg.op_index
    for v in tg.variables:
        if v.kind == "trainable":
            assert tg.ops[index[v.gradient.split(":")[0]]].phase == "backward"
    topo = _topo()
    grouping = group_ops(tg, target_groups=4)
    tasks = Simulator(tg, topo, grouping).tasks
    stages = tasks.task_stage_list
    with_grads = {int(tasks.group_of_op[v.op]) for v in tg.variables if v.kind == "trainable" and v.gradient}
    assert with_grads and all(stages[tasks.coll_after[g]] < UPDATE_STAGE for g in with_grads)


def test_virtual_gpu_runs_tensorflows_cuda_pass_whatever_the_cpu():
    """apply_precision(..., virtual_gpu=True) runs TensorFlow's CUDA pass on a Grappler virtual GPU: the graph
    a GPU machine gets, with weight gradients and the ReLUs between half-precision MatMuls in half too
    (the CPU fallback keeps both float32), on any machine."""
    import tensorflow as tf

    import tag
    from tag.frontend.precision import apply_precision
    gd = apply_precision(tag.zoo.training_graph("mlp", batch_size=8, **MLP), "mixed_float16",
                         train_op="train_op", loss="loss", virtual_gpu=True)
    half = tf.float16.as_datatype_enum
    weight_grads = [n for n in gd.node if n.op == "MatMul" and n.attr["transpose_a"].b]
    assert weight_grads and all(n.attr["T"].type == half for n in weight_grads)
    assert any(n.op in ("Relu", "ReluGrad") and n.attr["T"].type == half for n in gd.node)
    assert sum(n.name.endswith("/unscale") for n in gd.node) == 6


def test_bad_precision_names_are_one_line_errors(capsys):
    from tag.cli.deploy import main
    from tag.cost.precision import check_plan_precision
    from tag.errors import TagError
    with pytest.raises(TagError, match="unknown precision 'fp8': choose one of fp32, tf32, mixed_float16"):
        check_plan_precision("fp8")
    topo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "topologies", "localhost.pbtxt")
    assert main(["--topo", topo, "--model", "zoo:mlp", "--precision", "half"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown precision 'half'" in err[0]


@pytest.mark.parametrize("policy, prec", [("mixed_float16", "fp16"), ("mixed_bfloat16", "bf16")])
def test_a_keras_mixed_policy_graph_is_costed_as_it_is(policy, prec):
    """A tf_keras model built under a mixed policy: its Dense MatMuls are half precision in the IR (and
    costed at the tensor-core peak); variables and the gradients their updates receive (what tag
    all-reduces) stay float32."""
    import tf_keras

    import tag
    from tag.frontend.keras import training_graph_def

    def build():
        return tf_keras.Sequential([tf_keras.layers.Input((32,)), tf_keras.layers.Dense(256, activation="relu"),
                                    tf_keras.layers.Dense(10, dtype="float32")])

    old = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(policy)
    try:
        gd = training_graph_def(build, "sparse_categorical_crossentropy", "sgd", 16)
    finally:
        tf_keras.mixed_precision.set_global_policy(old)
    tg = tag.analyze(gd)
    precs = op_precisions(tg)
    matmuls = [p for op, p in zip(tg.ops, precs, strict=True) if op.type == "MatMul"]
    assert prec in matmuls and "fp32" in matmuls            # the float32 output layer stays FP32
    dtype_of = {t.name: t.dtype for op in tg.ops for t in op.outputs}
    trained = [v for v in tg.variables if v.kind == "trainable"]
    assert {v.dtype for v in trained} == {"float32"}
    assert {dtype_of[v.gradient] for v in trained} == {"float32"}


def test_tf32_and_xla_options_reach_the_cost_model_and_the_report():
    import tag
    from tag.api import plan_for, prepare
    topo = tag.parse_topology('host { name: "a" address: "10.0.0.1" port: 2222 device { type: "A100" kind: GPU '
                              'count: 2 memory_gib: 40 peak_tflops: 19.5 memory_bandwidth_gbs: 1555 } '
                              'interconnect { kind: NVLINK bandwidth_gbs: 300 } }')
    gd = tag.zoo.training_graph("mlp", batch_size=8, **MLP)
    plain = prepare(gd, topo)
    fast = prepare(gd, topo, precision="tf32", xla=True)
    assert fast.graph_def is plain.graph_def or fast.graph_def == plain.graph_def   # TF32: the graph as given
    assert fast.cost_model.tf32 and fast.cost_model.xla and not plain.cost_model.tf32
    assert fast.cost_model.compute_time(0, 4) < plain.cost_model.compute_time(0, 4)
    report = plan_for(fast, "dp_allreduce").report()
    assert report["precision"] == "tf32" and report["xla"] is True


def test_xla_plan_marks_fused_ops_and_trains_like_the_plain_plan():
    """With xla=True the rewritten graph's element-wise ops carry XLA's clustering attributes (one scope per
    device) and TensorFlow compiles them: 3 steps match the same plan without XLA to float rounding."""
    import tensorflow as tf

    import tag
    from helpers import train_copies
    from tag.api import prepare
    from tag.strategy.baselines import builtin_strategy
    ports, servers, topo = _two_loopback_hosts()
    gd = tag.zoo.training_graph("mlp", batch_size=8, **MLP)
    rng = np.random.RandomState(1)
    batches = [{"input:0": rng.randn(8, 20).astype(np.float32), "labels:0": rng.randint(0, 5, 8).astype(np.int32)}
               for _ in range(3)]
    runs = []
    for xla in (False, True):
        analysis = prepare(gd, topo, xla=xla)
        rr = analysis.rewrite(builtin_strategy("dp_allreduce", analysis.graph, topo, analysis.grouping,
                                               analysis.cost_model))
        marked = [n for n in rr.graph_def.node if n.attr["_XlaCompile"].b]
        assert bool(marked) == xla
        if xla:
            assert {n.attr["_XlaScope"].s.decode() for n in marked} == {f"tag_xla:{n.device}" for n in marked}
            assert len({n.device for n in marked}) == 2
        runs.append(train_copies(rr, analysis.graph, batches))
    for plain, fused in zip(*runs, strict=True):
        for name, copies in plain.items():
            for a, b in zip(copies, fused[name], strict=True):
                assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(a))))
    del tf
