"""Training cases for the GNN policy: generated clusters and random layered training graphs.

Self-play must not memorise the ready topology files or the validation models, so it runs on:

- ``random_topology_text(rng)``: a cluster description (``proto/topology.proto`` text format, parsed with
  ``tag.parse_topology``) with 1-5 hosts, a random mix of device types (GPUs of several generations, now and
  then CPUs), 1-8 devices per type, NVLink or PCIe inside hosts and 1-200 Gbit/s links between them
  (a fabric plus some faster or slower pairs);
- ``random_layered_graph(rng, batch)``: a TF1-style training step (forward, ``gradients/`` backward,
  optimizer updates) of 4-16 layers with independent, log-uniform parameter bytes, FLOPs and activation
  sizes per layer (embedding-like, convolution-like and dense-like layers), with skip connections now and
  then; built directly as a ``TrainingGraph`` (no TensorFlow);
- small zoo models (``TRAIN_ZOO``; the validation models inception_v3, mobilenet_v2 and bert_large are
  left out) at small options, whose IRs ``zoo_graph`` builds once per process.

Example::

    import numpy as np, tag
    from tag.gnn.cases import random_layered_graph, random_topology_text
    rng = np.random.default_rng(0)
    topo = tag.parse_topology(random_topology_text(rng))
    tg = random_layered_graph(rng, batch=32)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tag.ir.types import Edge, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology

# type, kind, memory GiB, peak TFLOP/s, memory GB/s (public spec sheets, fp32)
DEVICE_CATALOG = [
    ("K80", "GPU", 12, 4.1, 240), ("P100", "GPU", 16, 9.3, 732), ("GTX1080Ti", "GPU", 11, 11.3, 484),
    ("T4", "GPU", 16, 8.1, 320), ("V100", "GPU", 32, 15.7, 900), ("RTX2080Ti", "GPU", 11, 13.4, 616),
    ("RTX3090", "GPU", 24, 35.6, 936), ("A10", "GPU", 24, 31.2, 600), ("A100", "GPU", 40, 19.5, 1555),
    ("L4", "GPU", 24, 30.3, 300), ("H100", "GPU", 80, 67.0, 3350), ("CPU", "CPU", 64, 1.5, 100),
]
# zoo models self-play may use, at small options (the validation models are not here)
TRAIN_ZOO = {
    "mlp": dict(input_dim=64, hidden=(256, 128), num_classes=10),
    "vgg19": dict(image_size=32, num_classes=10),
    "resnet50": dict(image_size=32),
    "transformer": dict(seq_len=16, vocab_size=500, num_layers=2, d_model=64, d_ff=128, num_heads=4),
    "bert_base": dict(seq_len=16, vocab_size=500, num_layers=2, hidden_size=64, num_heads=4,
                      intermediate_size=128, max_position=32),
}
VALIDATION_ZOO = ("inception_v3", "mobilenet_v2", "bert_large")


def random_topology_text(rng: np.random.Generator, max_devices: int = 24, name: str = "generated") -> str:
    """A random cluster in topology text format (module docstring)."""
    n_hosts = int(rng.integers(1, 6))
    lines = [f'name: "{name}"', ""]
    total = 0
    for h in range(n_hosts):
        lines += ["host {", f'  name: "host{h}"', f'  address: "10.0.0.{h + 1}"', "  port: 2222"]
        n_types = 1 if rng.random() < 0.75 else 2
        kinds = rng.choice(len(DEVICE_CATALOG) - 1 if rng.random() < 0.9 else len(DEVICE_CATALOG),
                           size=n_types, replace=False)
        for k in kinds:
            dtype, kind, mem, tflops, membw = DEVICE_CATALOG[int(k)]
            count = int(min(rng.choice([1, 2, 2, 4, 4, 8]), max(1, max_devices - total)))
            total += count
            lines.append(f'  device {{ type: "{dtype}" kind: {kind} count: {count} memory_gib: {mem} '
                         f'peak_tflops: {tflops} memory_bandwidth_gbs: {membw} }}')
        if rng.random() < 0.4:
            lines.append(f"  interconnect {{ kind: NVLINK bandwidth_gbs: {int(rng.choice([25, 50, 150, 300]))} "
                         f"latency_us: 2 }}")
        else:
            lines.append(f"  interconnect {{ kind: PCIE bandwidth_gbs: {int(rng.choice([8, 16, 32]))} latency_us: 5 }}")
        lines.append("}")
    fabric = float(np.exp(rng.uniform(np.log(1.0), np.log(200.0))))
    for a in range(n_hosts):
        for b in range(a + 1, n_hosts):
            if rng.random() < 0.25:
                bw = fabric * float(np.exp(rng.uniform(-1.5, 1.5)))
                lines.append(f'link {{ a: "host{a}" b: "host{b}" bandwidth_gbps: {bw:.2f} '
                             f'latency_us: {rng.uniform(5, 60):.1f} }}')
    lines.append(f"fabric {{ bandwidth_gbps: {fabric:.2f} latency_us: {rng.uniform(5, 100):.1f} }}")
    return "\n".join(lines) + "\n"


def random_topology(rng: np.random.Generator, max_devices: int = 24) -> "Topology":
    """``tag.parse_topology(random_topology_text(rng))``."""
    from tag.cluster.topology import parse_topology
    return parse_topology(random_topology_text(rng, max_devices))


class _Builder:
    """Ops with one output each, added by name (a training step in the TF1 naming scheme)."""

    def __init__(self):
        self.ops: list[OpInfo] = []
        self.index: dict[str, int] = {}
        self.variables: list[VariableInfo] = []
        self.colocation: list[list[str]] = []

    def op(self, name: str, type_: str, phase: str, inputs: tuple[str, ...] = (), *, flops: Linear = Linear(),
           out: Linear = Linear(), control: tuple[str, ...] = ()) -> str:
        tensor = TensorInfo(f"{name}:0", "float32", None, 0 if out.per_example > 0 else None, out)
        in_bytes = [self.ops[self.index[i]].outputs[0].nbytes for i in inputs]
        mem = Linear(sum(b.fixed for b in in_bytes) + out.fixed, sum(b.per_example for b in in_bytes) + out.per_example)
        self.index[name] = len(self.ops)
        self.ops.append(OpInfo(name, type_, "", phase, [f"{i}:0" for i in inputs], list(control), [tensor], flops, mem))
        return name

    def build(self, batch: int, name: str) -> TrainingGraph:
        edges, control = [], []
        for j, op in enumerate(self.ops):
            for t in op.inputs:
                src = self.index[t.rsplit(":", 1)[0]]
                edges.append(Edge(src, j, t, self.ops[src].outputs[0].nbytes))
            control += [(self.index[c], j) for c in op.control_inputs]
        for ci, names in enumerate(self.colocation):
            for n in names:
                self.ops[self.index[n]].colocation_group = ci
        inputs = [op.name for op in self.ops if op.type == "Placeholder"]
        return TrainingGraph(self.ops, edges, control, self.variables, batch, inputs, self.colocation, name=name)


def random_layered_graph(rng: np.random.Generator, batch: int = 32, name: str = "layered") -> TrainingGraph:
    """A random TF1-style training step of dense-like layers (module docstring)."""
    b = _Builder()
    n_layers = int(rng.integers(4, 17))
    kind_of = rng.choice(["dense", "conv", "embedding"], size=n_layers, p=[0.45, 0.4, 0.15])
    act = [b.op("input", "Placeholder", "forward", out=Linear(0, float(np.exp(rng.uniform(np.log(1e3), np.log(1e6))))))]
    reads, kinds = [], []
    for i, kind in enumerate(kind_of):
        if kind == "embedding":
            params = np.exp(rng.uniform(np.log(1e6), np.log(4e8)))
            flops_pe = np.exp(rng.uniform(np.log(1e4), np.log(1e6)))
        elif kind == "conv":
            params = np.exp(rng.uniform(np.log(1e4), np.log(1e7)))
            flops_pe = np.exp(rng.uniform(np.log(1e7), np.log(5e9)))
        else:
            params = np.exp(rng.uniform(np.log(1e5), np.log(1e8)))
            flops_pe = params / 2.0                       # 2 FLOPs per multiply-add of a float32 weight
        params = float(int(params) // 4 * 4)
        act_pe = float(np.exp(rng.uniform(np.log(1e2), np.log(3e6 if kind == "conv" else 3e4))))
        op_type = {"dense": "MatMul", "conv": "Conv2D", "embedding": "MatMul"}[str(kind)]
        scope = f"layer_{i}"
        var = f"{scope}/kernel"
        apply = f"SGD/update_{scope}/kernel/ResourceApplyMomentum"
        b.op(var, "VarHandleOp", "forward")
        b.variables.append(VariableInfo(var, b.index[var], (int(params) // 4,), "float32", int(params), "trainable",
                                        apply_op=apply, gradient=f"gradients/{scope}/{op_type}_grad/{op_type}_1:0",
                                        slot_bytes=int(params)))
        rd = b.op(f"{scope}/{op_type}/ReadVariableOp", "ReadVariableOp", "forward", (var,), out=Linear(params, 0))
        inputs = (act[-1], rd)
        main = b.op(f"{scope}/{op_type}", op_type, "forward", inputs, flops=Linear(0, flops_pe), out=Linear(0, act_pe))
        out = b.op(f"{scope}/Relu", "Relu", "forward", (main,), flops=Linear(0, act_pe / 4), out=Linear(0, act_pe))
        if i >= 2 and rng.random() < 0.25:
            out = b.op(f"{scope}/add", "AddV2", "forward", (out, act[-2]), flops=Linear(0, act_pe / 4),
                       out=Linear(0, act_pe))
        act.append(out)
        reads.append(rd)
        kinds.append((op_type, params, flops_pe, act_pe))
    loss = b.op("loss", "Mean", "forward", (act[-1],), flops=Linear(0, 100.0), out=Linear(4, 0))
    grad = b.op("gradients/Fill", "Fill", "backward", (loss,), out=Linear(4, 0))
    applies = []
    for i in reversed(range(n_layers)):
        op_type, params, flops_pe, act_pe = kinds[i]
        scope = f"layer_{i}"
        grad = b.op(f"gradients/{scope}/Relu_grad/ReluGrad", "ReluGrad", "backward", (grad, act[i + 1]),
                    flops=Linear(0, act_pe / 4), out=Linear(0, act_pe))
        gw = b.op(f"gradients/{scope}/{op_type}_grad/{op_type}_1", op_type, "backward", (act[i], grad),
                  flops=Linear(0, flops_pe), out=Linear(params, 0))
        if i > 0:
            prev_pe = b.ops[b.index[act[i]]].outputs[0].nbytes.per_example
            grad = b.op(f"gradients/{scope}/{op_type}_grad/{op_type}", op_type, "backward", (grad, reads[i]),
                        flops=Linear(0, flops_pe), out=Linear(0, prev_pe))
        ap = b.op(f"SGD/update_{scope}/kernel/ResourceApplyMomentum", "ResourceApplyMomentum", "update",
                  (f"{scope}/kernel", gw), flops=Linear(4 * params / 4, 0))
        applies.append(ap)
        b.colocation.append([f"{scope}/kernel", reads[i], ap])
    b.op("train_op", "NoOp", "update", control=tuple(applies))
    return b.build(batch, name)


_ZOO_IRS: dict[tuple, TrainingGraph] = {}


def zoo_graph(name: str, options: dict | None = None, batch_size: int = 32) -> TrainingGraph:
    """The IR of zoo model NAME at OPTIONS (default ``TRAIN_ZOO[name]``), built once per process."""
    options = dict(TRAIN_ZOO.get(name, {}) if options is None else options)
    key = (name, batch_size, tuple(sorted(options.items())))
    tg = _ZOO_IRS.get(key)
    if tg is None:
        from tag.frontend import analyze, zoo
        tg = _ZOO_IRS[key] = analyze(zoo.training_graph(name, batch_size=batch_size, **options),
                                     batch_size=batch_size)
    return tg
