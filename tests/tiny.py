"""Tiny hand-made TrainingGraphs and Topologies for unit tests (no TensorFlow needed).

Other test modules may import these builders::

    from tiny import GraphBuilder, make_topology, mlp_graph   # pytest puts tests/ on sys.path
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-B", 1)])], inter_bandwidth=1e9)
    tg = mlp_graph(batch=8, widths=(16, 32, 4))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tag.cluster.topology import Device, DeviceGroup, Host, Topology
from tag.ir.types import Edge, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo


@dataclass
class DeviceSpec:
    tf_device_type: str = "GPU"
    memory_bytes: int = 16 << 30
    peak_flops: float = 10e12
    memory_bandwidth: float = 900e9


def make_topology(hosts: list[tuple[str, list[tuple[str, int]]]], *,
                  specs: dict[str, DeviceSpec] | None = None,
                  intra_bandwidth: float = 100e9, intra_latency: float = 2e-6,
                  inter_bandwidth: float = 1.25e9, inter_latency: float = 20e-6,
                  host_links: dict[tuple[str, str], tuple[float, float]] | None = None,
                  name: str = "tiny") -> Topology:
    """A Topology from [(host name, [(device type, count), ...]), ...].

    SPECS gives per-type numbers (default DeviceSpec()); HOST_LINKS overrides (bandwidth, latency) for
    given host pairs, every other pair uses INTER_BANDWIDTH / INTER_LATENCY.
    """
    specs = specs or {}
    host_objs, groups, devices = [], [], []
    for hi, (hname, dtypes) in enumerate(hosts):
        host_objs.append(Host(hname, "127.0.0.1", 23400 + hi, hi, intra_bandwidth, intra_latency))
        local = {}
        for dtype, count in dtypes:
            sp = specs.get(dtype, DeviceSpec())
            idx = tuple(range(len(devices), len(devices) + count))
            groups.append(DeviceGroup(len(groups), f"{hname}/{dtype}", hname, dtype, sp.tf_device_type, idx,
                                      sp.memory_bytes, sp.peak_flops, sp.memory_bandwidth))
            for _ in range(count):
                li = local.get(sp.tf_device_type, 0)
                local[sp.tf_device_type] = li + 1
                devices.append(Device(len(devices), f"{hname}/{dtype}:{li}", hname, hi, len(groups) - 1,
                                      sp.tf_device_type, li, dtype, sp.memory_bytes, sp.peak_flops,
                                      sp.memory_bandwidth))
    nh = len(host_objs)
    hbw = np.full((nh, nh), inter_bandwidth, dtype=np.float64)
    hlat = np.full((nh, nh), inter_latency, dtype=np.float64)
    names = [h.name for h in host_objs]
    for (a, b), (bw, lat) in (host_links or {}).items():
        i, j = names.index(a), names.index(b)
        hbw[i, j] = hbw[j, i] = bw
        hlat[i, j] = hlat[j, i] = lat
    np.fill_diagonal(hbw, np.inf)
    np.fill_diagonal(hlat, 0.0)
    hidx = np.array([d.host_index for d in devices])
    bw = hbw[hidx[:, None], hidx[None, :]].copy()
    lat = hlat[hidx[:, None], hidx[None, :]].copy()
    same = hidx[:, None] == hidx[None, :]
    bw[same] = intra_bandwidth
    lat[same] = intra_latency
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(lat, 0.0)
    return Topology(name, "", host_objs, groups, devices, bw, lat, hbw, hlat)


class GraphBuilder:
    """Build a TrainingGraph op by op. Each op has one output tensor ``name:0``."""

    def __init__(self, batch_size: int, name: str = "tiny"):
        self.batch_size = batch_size
        self.name = name
        self.ops: list[OpInfo] = []
        self.variables: list[VariableInfo] = []
        self.colocation: list[list[str]] = []
        self._index: dict[str, int] = {}

    def op(self, name: str, type: str, phase: str = "forward", inputs: tuple[str, ...] = (), *,
           flops: float = 0.0, flops_pe: float = 0.0, out_bytes: float = 0.0, out_pe: float = 0.0,
           control: tuple[str, ...] = (), dtype: str = "float32") -> str:
        """Add an op; INPUTS are op names (their output 0). Returns NAME."""
        out = TensorInfo(f"{name}:0", dtype, None, 0 if out_pe > 0 else None, Linear(out_bytes, out_pe))
        in_fixed = sum(self.ops[self._index[i]].outputs[0].nbytes.fixed for i in inputs)
        in_pe = sum(self.ops[self._index[i]].outputs[0].nbytes.per_example for i in inputs)
        self._index[name] = len(self.ops)
        self.ops.append(OpInfo(name, type, "", phase, [f"{i}:0" for i in inputs], list(control), [out],
                               Linear(flops, flops_pe), Linear(in_fixed + out_bytes, in_pe + out_pe)))
        return name

    def variable(self, name: str, nbytes: int, kind: str = "trainable", **kw) -> str:
        """Add a VarHandleOp NAME (forward phase) and its VariableInfo."""
        self.op(name, "VarHandleOp", "forward", dtype="resource")
        self.variables.append(VariableInfo(name, self._index[name], (nbytes // 4,), "float32", nbytes, kind, **kw))
        return name

    def build(self) -> TrainingGraph:
        edges, control = [], []
        for j, op in enumerate(self.ops):
            for t in op.inputs:
                src = self._index[t.rsplit(":", 1)[0]]
                edges.append(Edge(src, j, t, self.ops[src].outputs[0].nbytes))
            for c in op.control_inputs:
                control.append((self._index[c], j))
        for ci, names in enumerate(self.colocation):
            for n in names:
                self.ops[self._index[n]].colocation_group = ci
        inputs = [op.name for op in self.ops if op.type == "Placeholder"]
        return TrainingGraph(self.ops, edges, control, self.variables, self.batch_size, inputs,
                             self.colocation, name=self.name)


def chain_graph(flops: list[float], batch: int = 1, act_bytes_pe: float = 0.0) -> TrainingGraph:
    """Forward-only chain op0 -> op1 -> ...; op i does FLOPS[i] (fixed) and emits ACT_BYTES_PE per example."""
    b = GraphBuilder(batch, "chain")
    prev: tuple[str, ...] = ()
    for i, f in enumerate(flops):
        name = b.op(f"layer{i}/op", "MatMul", "forward", prev, flops=f, out_pe=act_bytes_pe)
        prev = (name,)
    return b.build()


def mlp_graph(batch: int = 8, widths: tuple[int, ...] = (16, 32, 4), optimizer: str = "Adam",
              name: str = "mlp") -> TrainingGraph:
    """A TF1-style MLP training step: forward, gradients/ backward, Adam updates, train_op.

    Layer i is ``dense_i`` with kernel [widths[i], widths[i+1]]; FLOPs and bytes as TensorFlow would count
    them (float32, 2 FLOPs per multiply-add).
    """
    b = GraphBuilder(batch, name)
    x = b.op("input", "Placeholder", "forward", out_pe=4 * widths[0])
    b.op("labels", "Placeholder", "forward", out_pe=4 * widths[-1])
    acts = [x]
    reads = []
    for i in range(len(widths) - 1):
        n_in, n_out = widths[i], widths[i + 1]
        var = b.variable(f"dense_{i}/kernel", 4 * n_in * n_out, "trainable",
                         apply_op=f"{optimizer}/update_dense_{i}/kernel/ResourceApply{optimizer}",
                         gradient=f"gradients/dense_{i}/MatMul_grad/MatMul_1:0", slot_bytes=8 * n_in * n_out)
        rd = b.op(f"dense_{i}/MatMul/ReadVariableOp", "ReadVariableOp", "forward", (var,), out_bytes=4 * n_in * n_out)
        reads.append(rd)
        mm = b.op(f"dense_{i}/MatMul", "MatMul", "forward", (acts[-1], rd), flops_pe=2 * n_in * n_out,
                  out_pe=4 * n_out)
        acts.append(mm)
    loss = b.op("loss", "Mean", "forward", (acts[-1], "labels"), flops_pe=2 * widths[-1], out_bytes=4)
    grad = b.op("gradients/Fill", "Fill", "backward", (loss,), out_bytes=4)
    grad = b.op("gradients/loss_grad/Tile", "Tile", "backward", (grad,), flops_pe=widths[-1], out_pe=4 * widths[-1])
    applies = []
    for i in reversed(range(len(widths) - 1)):
        n_in, n_out = widths[i], widths[i + 1]
        gw = b.op(f"gradients/dense_{i}/MatMul_grad/MatMul_1", "MatMul", "backward", (acts[i], grad),
                  flops_pe=2 * n_in * n_out, out_bytes=4 * n_in * n_out)
        if i > 0:
            grad = b.op(f"gradients/dense_{i}/MatMul_grad/MatMul", "MatMul", "backward", (grad, reads[i]),
                        flops_pe=2 * n_in * n_out, out_pe=4 * n_in)
        ap = b.op(f"{optimizer}/update_dense_{i}/kernel/ResourceApply{optimizer}", f"ResourceApply{optimizer}",
                  "update", (f"dense_{i}/kernel", gw), flops=10 * n_in * n_out)
        applies.append(ap)
        b.colocation.append([f"dense_{i}/kernel", reads[i], ap])
    b.op("train_op", "NoOp", "update", control=tuple(applies))
    return b.build()


# Small options for every zoo model: graphs that build and run in seconds (tests of the zoo and the IR).
TINY_ZOO_OPTIONS = {
    "mlp": dict(input_dim=20, hidden=(32, 16), num_classes=5),
    "vgg19": dict(image_size=32, num_classes=10),
    # 1000 classes and global pooling: the parameter count equals the full-size model's.
    "resnet50": dict(image_size=32),
    "inception_v3": dict(image_size=75),
    "mobilenet_v2": dict(image_size=32),
    "transformer": dict(seq_len=8, vocab_size=50, num_layers=2, d_model=16, d_ff=32, num_heads=4),
    "bert_base": dict(seq_len=8, vocab_size=50, num_layers=2, hidden_size=16, num_heads=4,
                      intermediate_size=32, max_position=16),
    "bert_large": dict(seq_len=8, vocab_size=50, num_layers=1, hidden_size=16, num_heads=2,
                       intermediate_size=24, max_position=16, num_classes=3),
}
