"""The published training-throughput data (``data/published_throughput.csv``): its rows, the GPU systems they
ran on, each row's model built as an IR (cached) and its dp_allreduce throughput predicted without a profile.

``scripts/bench_published.py`` compares the predictions with the published figures; ``scripts/fit_gpu_defaults.py``
fits tag's shipped GPU profiles on them and ``scripts/breakdown_published.py`` splits a row's predicted step.

Usage::

    from tag_bench.published import build_ir, predict, read_rows
    rows = read_rows()                                  # the data file's rows, numbers converted
    result = predict(rows[0], build_ir(rows[0], cache="ir-cache/"))   # {"predicted", "published", "rel_error", ...}
"""
from __future__ import annotations

import csv
import os
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "published_throughput.csv")
IR_BATCH = 8          # reference batch the IRs are built at (costs scale per example)
GROUPS = 64           # tag-deploy's default number of op groups
#: models the bench builds itself whose IR file names say how (older caches held Keras' biased ResNet50)
#: the ResNets the bench builds itself: bottleneck blocks per stage, and whether a block strides in its 3x3
#: convolution (v1.5, NVIDIA's) or in its first 1x1 (v1, tf_cnn_benchmarks' resnet50 and resnet152)
RESNETS: dict[str, tuple[tuple[int, int, int, int], bool]] = {
    "resnet50": ((3, 4, 6, 3), False), "resnet50_v1.5": ((3, 4, 6, 3), True), "resnet152": ((3, 8, 36, 3), False)}
IR_NAMES = {model: f"{model.split('_')[0]}-{'v1.5' if in_3x3 else 'v1'}-nobias"
            for model, (_, in_3x3) in RESNETS.items()}

#: the machines of the data file: GPU spec sheet (FP32 peak, memory bandwidth, memory) and the
#: interconnect between the GPUs of the host as its vendor lists it (GB/s each way per GPU)
SYSTEMS: dict[str, dict[str, Any]] = {
    # DGX-1 (P100 SXM2): 10.6 TFLOP/s, 732 GB/s HBM2; 4 NVLink 1 links x 20 GB/s per GPU
    "dgx1-p100": dict(type="P100-SXM2", tflops=10.6, gbs=732, gib=16, link="NVLINK", link_gbs=80),
    # DGX-1 (V100 SXM2): 15.7 TFLOP/s, 900 GB/s; 6 NVLink 2 links x 25 GB/s per GPU (hybrid cube mesh)
    "dgx1-v100-16g": dict(type="V100-SXM2-16GB", tflops=15.7, gbs=900, gib=16, link="NVLINK", link_gbs=150),
    "dgx1-v100-32g": dict(type="V100-SXM2-32GB", tflops=15.7, gbs=900, gib=32, link="NVLINK", link_gbs=150),
    # DGX-2 / Lambda Hyperplane (V100 SXM3 32 GB on NVSwitch): 6 x 25 GB/s per GPU to the switches
    "dgx2-v100": dict(type="V100-SXM3-32GB", tflops=15.7, gbs=900, gib=32, link="NVLINK", link_gbs=150),
    "lambda-v100": dict(type="V100-SXM3-32GB", tflops=15.7, gbs=900, gib=32, link="NVLINK", link_gbs=150),
    # DGX A100 (A100 SXM4 40 GB): 19.5 TFLOP/s FP32, 1555 GB/s; NVLink 3 through NVSwitch, 300 GB/s each way;
    # tensor-core peaks from tag's shipped A100 class (156 TF32, 312 FP16/BF16)
    "dgx-a100": dict(type="A100-SXM4-40GB", tflops=19.5, gbs=1555, gib=40, link="NVLINK", link_gbs=300),
    # Lambda servers with PCIe 4.0 x16 (31.5 GB/s each way): A100 PCIe 40 GB (its peaks from the A100 class)
    # and RTX A6000 (38.7 FP32; tensor cores from its data sheet, dense: 77.4 TF32, 154.8 FP16/BF16 with
    # FP32 accumulation -- a workstation card, full rate, unlike the GeForce RTX 3090 tag's class models; tag's
    # defaults for the RTX A-series family now give the same without the declaration)
    "lambda-a100-pcie": dict(type="A100-PCIe-40GB", tflops=19.5, gbs=1555, gib=40, link="PCIE", link_gbs=31.5),
    "lambda-a6000": dict(type="RTXA6000", tflops=38.7, gbs=768, gib=48, link="PCIE", link_gbs=31.5,
                         peaks=dict(tf32=77.4, fp16=154.8, bf16=154.8)),
    # Quadro RTX 8000 (Turing, 16.3 TFLOP/s FP32, 672 GB/s): FP16 tensor cores with FP32 accumulation at full
    # rate, 130.5 TFLOP/s (Turing whitepaper), twice the GeForce rate tag's RTX 2080 Ti class has (its
    # Titan / Quadro RTX family in tag's defaults now gives the same); PCIe 3.0
    "lambda-rtx8000": dict(type="QuadroRTX8000", tflops=16.3, gbs=672, gib=48, link="PCIE", link_gbs=15.75,
                           peaks=dict(fp16=130.5)),
    # Lambda workstations / 8-GPU PCIe server (PCIe 3.0 x16: 15.75 GB/s each way)
    "lambda-2080ti": dict(type="RTX2080Ti", tflops=13.4, gbs=616, gib=11, link="PCIE", link_gbs=15.75),
    "lambda-2080ti-pcie": dict(type="RTX2080Ti", tflops=13.4, gbs=616, gib=11, link="PCIE", link_gbs=15.75),
    "lambda-1080ti": dict(type="GTX1080Ti", tflops=11.3, gbs=484, gib=11, link="PCIE", link_gbs=15.75),
}


def read_rows(path: str = DATA) -> list[dict[str, Any]]:
    """The data file's rows (comment lines skipped), numbers converted."""
    with open(path, encoding="utf-8") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for r in rows:
        r["xla"] = r.get("xla") in ("1", "true", "True")
        r["grad_dtype"] = r.get("grad_dtype") or "fp32"
        if r["grad_dtype"] not in ("fp32", "fp16"):
            raise SystemExit(f"{path}: row {r['id']}: grad_dtype must be fp32 or fp16")
        if r["precision"] not in ("fp32", "tf32", "mixed"):
            raise SystemExit(f"{path}: row {r['id']}: precision must be fp32, tf32 or mixed")
        r["gpu_count"] = int(r["gpu_count"])
        r["per_gpu_batch"] = int(r["per_gpu_batch"])
        r["seq_len"] = int(r["seq_len"]) if r["seq_len"] else None
        r["throughput"] = float(r["throughput"])
        if r["system"] not in SYSTEMS:
            raise SystemExit(f"{path}: row {r['id']}: unknown system {r['system']!r}")
    return rows


def _vgg16_graph_def(batch_size: int):
    """VGG-16 training step in the zoo's conventions (the zoo ships VGG-19 only)."""
    import tensorflow as tf
    import tf_keras
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [batch_size, 224, 224, 3], name="input")
        labels = v1.placeholder(tf.int32, [batch_size], name="labels")
        model = tf_keras.applications.VGG16(weights=None, input_tensor=x, classes=1000, classifier_activation=None)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=model.output)
        loss = tf.identity(tf.reduce_mean(xent), name="loss")
        v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train_op")
        v1.variables_initializer(v1.global_variables(), name="init")
    return g.as_graph_def()


def _resnet_graph_def(batch_size: int, stride_in_3x3: bool, stages: tuple[int, ...] = (3, 4, 6, 3)):
    """ResNet training step (bottleneck blocks, STAGES blocks per stage: ResNet-50 by default, ResNet-152 with
    (3, 8, 36, 3)) as the sources build it: convolutions followed by batch norm carry no bias
    (tf_cnn_benchmarks' models/resnet_model.py passes ``bias=None`` with ``use_batch_norm=True``; NVIDIA's
    ConvNets model/blocks/conv2d_block.py uses ``use_bias=not use_batch_norm``), unlike Keras' ResNet50,
    whose 53 biased convolutions add a bias pass and its gradient per convolution. v1 (tf_cnn_benchmarks'
    ``resnet50`` and ``resnet152``) strides a block's first 1x1 convolution; v1.5 (NVIDIA's) its 3x3 one. The zoo's
    conventions otherwise (placeholders, mean cross-entropy, Momentum 0.9)."""
    import tensorflow as tf
    import tf_keras

    from tag.frontend.zoo import _finish, _xent
    v1 = tf.compat.v1
    layers = tf_keras.layers
    g = tf.Graph()
    bns: list = []

    def conv_bn(x, filters, kernel, stride, relu=True):
        x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False)(x)
        bn = layers.BatchNormalization(epsilon=1e-5)
        bns.append(bn)
        x = bn(x, training=True)
        return layers.ReLU()(x) if relu else x

    with g.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [batch_size, 224, 224, 3], name="input")
        labels = v1.placeholder(tf.int32, [batch_size], name="labels")
        y = conv_bn(x, 64, 7, 2)
        y = layers.MaxPooling2D(3, 2, padding="same")(y)
        channels = 64
        for width, blocks, stride in zip((64, 128, 256, 512), stages, (1, 2, 2, 2), strict=True):
            for b in range(blocks):
                s = stride if b == 0 else 1
                short = conv_bn(y, 4 * width, 1, s, relu=False) if channels != 4 * width else y
                z = conv_bn(y, width, 1, 1 if stride_in_3x3 else s)
                z = conv_bn(z, width, 3, s if stride_in_3x3 else 1)
                z = conv_bn(z, 4 * width, 1, 1, relu=False)
                y = layers.ReLU()(layers.Add()([short, z]))
                channels = 4 * width
        logits = layers.Dense(1000)(layers.GlobalAveragePooling2D()(y))
        # the zoo's loss, optimizer step (train_op waits for the moving statistics) and init
        _finish(_xent(logits, labels), v1.train.MomentumOptimizer(0.01, 0.9), [u for bn in bns for u in bn.updates])
    return g.as_graph_def()


def model_key(row: dict[str, Any]) -> str:
    """The IR a row needs: its model (and sequence length), mixed-precision rows their rewritten graph
    (``-mixed-gpu``: TensorFlow's CUDA mixed-precision pass, on a virtual GPU where the machine has none,
    and the loss scale's unscaling as a backward op; older caches' ``-mixed`` IRs came from the CPU's pass
    or tag's fallback and had the unscaling as an update op, which held every all-reduce until the end of
    the backward pass)."""
    return IR_NAMES.get(row["model"], row["model"]) + (f"-s{row['seq_len']}" if row["seq_len"] else "") + (
        "-mixed-gpu" if row["precision"] == "mixed" else "")


def build_ir(row: dict[str, Any], cache: str | None = None):
    """The IR of ROW's model at IR_BATCH (from CACHE when present there)."""
    key = model_key(row)
    from tag.ir.serialize import load_training_graph, save_training_graph
    path = os.path.join(cache, f"{key}-b{IR_BATCH}.ir.json.gz") if cache else None
    if path and os.path.exists(path):
        return load_training_graph(path)
    import tag
    if row["model"] == "vgg16":
        gd = _vgg16_graph_def(IR_BATCH)
    elif row["model"] in RESNETS:
        stages, stride_in_3x3 = RESNETS[row["model"]]
        gd = _resnet_graph_def(IR_BATCH, stride_in_3x3=stride_in_3x3, stages=stages)
    else:
        opts = {"seq_len": row["seq_len"]} if row["seq_len"] else {}
        gd = tag.zoo.training_graph(row["model"], batch_size=IR_BATCH, **opts)
    if row["precision"] == "mixed":
        from tag.frontend.precision import apply_precision
        # TensorFlow's CUDA pass (the sources ran on GPUs), on a virtual GPU where this machine has none
        gd = apply_precision(gd, "mixed_float16", train_op="train_op", loss="loss", init="init", virtual_gpu=True)
    tg = tag.analyze(gd, name=key)
    if path:
        os.makedirs(cache, exist_ok=True)
        save_training_graph(tg, path)
    return tg


def topology_text(system: str, n: int) -> str:
    """A one-host topology of N GPUs of SYSTEM (protobuf text)."""
    s = SYSTEMS[system]
    latency_us = 2 if s["link"] == "NVLINK" else 5
    link = (f'interconnect {{ kind: {s["link"]} bandwidth_gbs: {s["link_gbs"]} latency_us: {latency_us} }}'
            if n > 1 else "")
    peaks = " ".join(f"peak_{p}_tflops: {v}" for p, v in s.get("peaks", {}).items())
    return (f'name: "{system}-x{n}"\nhost {{ name: "node" address: "10.0.0.1" port: 2222\n'
            f'  device {{ type: "{s["type"]}" kind: GPU count: {n} memory_gib: {s["gib"]} '
            f'peak_tflops: {s["tflops"]} memory_bandwidth_gbs: {s["gbs"]} {peaks} }}\n  {link}\n}}\n')


def predict(row: dict[str, Any], graph) -> dict[str, Any]:
    """Simulated dp_allreduce throughput of ROW's configuration (no profile)."""
    import tag
    from tag.cost.model import CostModel
    from tag.sim.simulator import Simulator
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    n, per = row["gpu_count"], row["per_gpu_batch"]
    topo = tag.parse_topology(topology_text(row["system"], n), path=f"<{row['system']}>")
    grouping = group_ops(graph, target_groups=GROUPS)
    cm = CostModel(graph, topo, tf32=row["precision"] == "tf32", xla=row["xla"],
                   gradient_dtype=None if row["grad_dtype"] == "fp32" else row["grad_dtype"])
    strategy = builtin_strategy("dp_allreduce", graph, topo, grouping, cm)
    res = Simulator(graph, topo, grouping, cm).evaluate(strategy, batch_size=n * per)
    pred = n * per / res.step_time
    return {"id": row["id"], "split": row["split"], "model": row["model"], "gpu": row["gpu"], "gpus": n,
            "per_gpu_batch": per, "seq_len": row["seq_len"], "precision": row["precision"], "xla": row["xla"],
            "grad_dtype": row["grad_dtype"],
            "system": row["system"], "published": row["throughput"],
            "predicted": pred, "rel_error": pred / row["throughput"] - 1.0, "unit": row["unit"],
            "profile": cm.profile_source(0), "source_id": row["source_id"]}
