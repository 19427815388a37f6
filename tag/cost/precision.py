"""Numeric precision in the cost model: which precision each op computes in, each device's peak in it,
and which element-wise / normalisation ops XLA fuses into one pass over memory.

The IR already holds what precision means for an op: its tensors' dtypes (``half`` and ``bfloat16``
MatMuls and convolutions after a ``mixed_float16`` / ``mixed_bfloat16`` policy or TensorFlow's automatic
mixed-precision rewrite, the ``Cast`` ops between them), and their byte sizes (so memory-bound ops are
already charged at their dtype's bytes, and collectives at the gradient dtype's bytes). This module
reads the compute precision of each op from those dtypes and gives a device's peak FLOP/s in it:

- MatMuls, batched matmuls and convolutions (``tag.cost.op_classes``: every class but depthwise) in
  ``half`` / ``bfloat16`` run on tensor cores at the ``fp16`` / ``bf16`` peak; in ``float32`` at the FP32
  peak, or at the ``tf32`` peak where TF32 math is on (``CostModel(..., tf32=True)``, Ampere and later);
- every other op runs on the ordinary FP32 units (element-wise ops are memory-bound anyway).

A device's peak in a precision (``device_peak``): the topology's ``peak_<precision>_tflops`` where the
file declares it; else, for a GPU tag ships a class for (``tag.cost.gpu_defaults``), the class's spec
sheet ratio of that precision's peak to its FP32 peak (or the related family's own ratio: a Quadro RTX
8000 runs FP16 at 8x its FP32 peak where the GeForce class serving it runs 4x) times the device's own
FP32 peak (so a file giving
only "A100-80G" and 19.5 TFLOP/s plans an A100 at 156 TF32 / 312 FP16 / 312 BF16 TFLOP/s); else the
FP32 peak (a CPU, a GPU tag does not know, a precision the GPU has no tensor cores for).

Example::

    from tag.cost.precision import op_precisions, device_peak, fusion_bytes
    precs = op_precisions(training_graph)          # 'fp32' / 'fp16' / 'bf16' / None per op
    device_peak(topology.groups[0], "fp16")        # FLOP/s
    mem_fixed, mem_per_example, fused = fusion_bytes(training_graph)   # XLA's one pass per fused chain
    gradient_bytes_factor(training_graph, "fp16")   # 0.5 for float32 weights: all-reduced as 16-bit values
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tag.cost.gpu_defaults import resolve
from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import DeviceGroup
    from tag.ir.types import TrainingGraph

#: compute precisions the cost model tells apart
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
#: what ``tag.optimize(precision=...)`` / ``tag-deploy --precision`` accept
PLAN_PRECISIONS = ("fp32", "tf32", "mixed_float16", "mixed_bfloat16")
#: IR dtype name -> compute precision
DTYPE_PRECISION = {"float32": "fp32", "half": "fp16", "float16": "fp16", "bfloat16": "bf16"}
#: dtypes gradients may travel in through collectives (``CostModel(gradient_dtype=...)``), bytes per element
GRADIENT_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: bytes per element of the IR's floating-point dtypes
DTYPE_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "half": 2, "float16": 2, "bfloat16": 2}

#: ops XLA fuses into their neighbours: element-wise arithmetic, activations and their gradients, bias
#: additions and batch/layer normalisation pieces (what a layer's epilogue is made of)
FUSIBLE_TYPES = frozenset("""
Abs Neg Sign Reciprocal Square Sqrt Rsqrt Exp Expm1 Log Log1p Tanh Sigmoid Relu Relu6 Elu Selu Softplus
LeakyRelu Erf Erfc Floor Ceil Round Cast Gelu Add AddV2 AddN Sub Mul MulNoNan Div DivNoNan RealDiv Maximum
Minimum Pow SquaredDifference Select SelectV2 BiasAdd BiasAddV1 BiasAddGrad ReluGrad Relu6Grad
LeakyReluGrad EluGrad SeluGrad SigmoidGrad TanhGrad RsqrtGrad SqrtGrad ReciprocalGrad GeluGrad ClipByValue
FusedBatchNorm FusedBatchNormV2 FusedBatchNormV3 FusedBatchNormGrad FusedBatchNormGradV2
FusedBatchNormGradV3 Mean Sum Softmax LogSoftmax""".split())


#: fusible ops that reduce (or normalise over) an axis: XLA does not duplicate them into other fusions, so
#: their results are written once and read from memory by every later chain
REDUCTION_TYPES = frozenset("""
Mean Sum Softmax LogSoftmax BiasAddGrad FusedBatchNorm FusedBatchNormV2 FusedBatchNormV3 FusedBatchNormGrad
FusedBatchNormGradV2 FusedBatchNormGradV3""".split())


#: batch normalisation in training: statistics over the batch first, then the element-wise pass
BATCH_NORM_TYPES = frozenset("""FusedBatchNorm FusedBatchNormV2 FusedBatchNormV3 FusedBatchNormGrad FusedBatchNormGradV2
FusedBatchNormGradV3""".split())


def check_plan_precision(precision: str | None) -> str:
    """PRECISION as ``tag.optimize`` accepts it (None: "fp32"); TagError naming the choices otherwise."""
    if precision is None:
        return "fp32"
    if precision not in PLAN_PRECISIONS:
        raise TagError(f"unknown precision {precision!r}: choose one of {', '.join(PLAN_PRECISIONS)}")
    return precision


def op_precisions(graph: "TrainingGraph") -> list[str | None]:
    """The precision each op of GRAPH computes in, from its first output's dtype (None: not floating point)."""
    return [DTYPE_PRECISION.get(op.outputs[0].dtype) if op.outputs else None for op in graph.ops]


def device_peak(group: "DeviceGroup", precision: str) -> float:
    """Peak FLOP/s of one device of GROUP in PRECISION (see the module docstring for the fallbacks)."""
    declared = group.declared_peak(precision)
    if declared is not None:
        return float(declared)
    if group.tf_device_type == "GPU" and precision != "fp32":
        res = resolve(group.device_type)
        ratio = res.peak_ratio(precision) if res is not None else None
        if ratio is not None:
            return float(group.peak_flops * ratio)
    return float(group.peak_flops)


def gradient_bytes_factor(graph: "TrainingGraph", gradient_dtype: str | None) -> float:
    """Bytes a collective moves per byte of GRAPH's trainable variables when gradients travel as
    GRADIENT_DTYPE (None: as the variables' own dtype, 1.0). A runtime may cast float32 gradients to 16
    bits for their all-reduce only (tf_cnn_benchmarks' ``compact_gradient_transfer``, on by default with
    ``--use_fp16``; Horovod's ``Compression.fp16``): 0.5 for float32 weights; never above 1."""
    if gradient_dtype is None:
        return 1.0
    if gradient_dtype not in GRADIENT_DTYPES:
        raise TagError(f"unknown gradient dtype {gradient_dtype!r}: choose one of {', '.join(GRADIENT_DTYPES)}")
    width = GRADIENT_DTYPES[gradient_dtype]
    own = moved = 0.0
    for v in graph.variables:
        if v.kind == "trainable" and v.nbytes > 0:
            own += v.nbytes
            moved += v.nbytes * min(width / DTYPE_BYTES.get(v.dtype, width), 1.0)
    return moved / own if own > 0 else 1.0


#: ops that only rename a tensor (no kernel, no copy): XLA sees through them, so a chain does too
ALIAS_TYPES = frozenset("Identity IdentityN Snapshot StopGradient PreventGradient EnsureShape Reshape Squeeze "
                        "ExpandDims".split())


def _alias_sources(ops) -> dict[str, str]:
    """Output tensor name -> the input tensor it renames, for every op of ALIAS_TYPES (IdentityN: output k
    renames input k; the others: output 0 renames input 0)."""
    out: dict[str, str] = {}
    for op in ops:
        if op.type in ALIAS_TYPES and op.inputs:
            for k, t in enumerate(op.outputs if op.type == "IdentityN" else op.outputs[:1]):
                if k < len(op.inputs):
                    out[t.name] = op.inputs[k]
    return out


def _source(alias: dict[str, str], name: str) -> str:
    """The tensor NAME renames through a chain of aliases (NAME itself when it is no alias's output)."""
    for _ in range(64):
        if name not in alias:
            return name
        name = alias[name]
    return name


def _fusion_groups(ops, fusible: np.ndarray, producer: dict) -> list[int]:
    """Per op, the representative of its fusion chain: fusible ops of one phase joined through the
    tensors one produces and the other reads (union-find); every other op is its own chain."""
    parent = list(range(len(ops)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, op in enumerate(ops):
        if not fusible[i]:
            continue
        for name in op.inputs:
            src = producer.get(name)
            if src is not None and fusible[src[0]] and ops[src[0]].phase == op.phase:
                a, b = find(i), find(src[0])
                if a != b:
                    parent[a] = b
    return [find(i) for i in range(len(ops))]


def fusion_bytes(graph: "TrainingGraph") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory bytes fixed, per example, fused mask) per op when XLA fuses FUSIBLE_TYPES chains.

    A chain of fusible ops reads its outside inputs once and writes the outputs that leave it once: an
    op does not pay for an input another fusible op of the same phase produced, nor for an output that
    only fusible ops of its phase read (those stay in registers). ``fused`` marks ops that are not the
    first of their chain (they launch no kernel of their own). A chain is a connected group of fusible ops
    of one phase (joined by the tensors one hands the other); an outside tensor that several of its ops
    read is paid once, by the first of them: a fused kernel loads each of its parameters once, however
    many of its element-wise ops use it (a GELU's or a layer norm's gradient reads the forward input in
    many terms). An element-wise result of one phase that only fusible ops read (a GELU's ``tanh`` that its
    gradient uses) is not written: XLA duplicates such cheap producers into the fusions that read them, so
    a chain of another phase pays instead for the written tensors it is recomputed from (``roots``: the
    outputs of MatMuls, convolutions, reductions (``REDUCTION_TYPES``) and other ops XLA does not duplicate).
    Ops that only rename a tensor (``ALIAS_TYPES``: the ``Identity`` of every ``tuple/control_dependency``
    that ``tf.gradients`` puts between two gradient ops, reshapes) do not break a chain. Batch norm
    (``BATCH_NORM_TYPES``) reduces over the batch before its element-wise pass, so it reads its batch-sized
    inputs a second time (and a chain writes an input it produced itself for that pass)."""
    ops = graph.ops
    fusible = np.array([op.type in FUSIBLE_TYPES for op in ops], dtype=bool)
    alias = _alias_sources(ops)
    producer: dict[str, tuple[int, object]] = {}
    for i, op in enumerate(ops):
        for t in op.outputs:
            producer[t.name] = (i, t)
    for name in alias:                        # an alias's output is its source's tensor
        src = _source(alias, name)
        if src in producer:
            producer[name] = producer[src]
    consumers: dict[str, list[int]] = {}     # readers of each tensor, through aliases (aliases not listed)
    for i, op in enumerate(ops):
        if op.type not in ALIAS_TYPES:
            for name in op.inputs:
                consumers.setdefault(_source(alias, name), []).append(i)
    mem_fixed = np.array([op.mem_bytes.fixed for op in ops], dtype=np.float64)
    mem_per = np.array([op.mem_bytes.per_example for op in ops], dtype=np.float64)
    fused = np.zeros(len(ops), dtype=bool)
    group = _fusion_groups(ops, fusible, producer)
    nbytes = {name: t.nbytes for name, (_, t) in producer.items()}

    def recomputable(name: str) -> bool:
        """An element-wise result that only fusible ops read: XLA duplicates it into each reader's fusion."""
        src = producer.get(name)
        return (src is not None and fusible[src[0]] and ops[src[0]].type not in REDUCTION_TYPES
                and all(fusible[j] for j in consumers.get(name, [])))

    roots_memo: dict[str, frozenset[str]] = {}

    def roots(name: str) -> frozenset[str]:
        """The written tensors a recomputable tensor is recomputed from."""
        if name not in roots_memo:
            roots_memo[name] = frozenset()            # a cycle (none in a step graph) reads nothing more
            out: set[str] = set()
            for u in ops[producer[name][0]].inputs:
                u = _source(alias, u)
                if u in producer:
                    out |= roots(u) if recomputable(u) else {u}
            roots_memo[name] = frozenset(out)
        return roots_memo[name]

    paid: set[tuple[int, str]] = set()         # (chain, outside tensor) already read by the chain

    def pay(i: int, names) -> None:
        for u in names:
            if (group[i], u) not in paid:
                paid.add((group[i], u))
                mem_fixed[i] += nbytes[u].fixed
                mem_per[i] += nbytes[u].per_example

    own = {t.name: t for op in ops for t in op.outputs}   # each tensor as its readers counted it
    for i, op in enumerate(ops):
        if not fusible[i]:
            continue
        for listed in op.inputs:
            name = _source(alias, listed)
            src = producer.get(name)
            if src is None or listed not in own:
                continue
            mem_fixed[i] -= own[listed].nbytes.fixed  # the op's own bytes count each input: re-charged below
            mem_per[i] -= own[listed].nbytes.per_example
            if fusible[src[0]] and ops[src[0]].phase == op.phase:
                fused[i] = True
            elif recomputable(name):
                pay(i, roots(name))                   # another phase's element-wise result, recomputed
            else:
                pay(i, (name,))
        for t in op.outputs:
            readers = consumers.get(t.name, [])
            if readers and (all(fusible[j] and ops[j].phase == op.phase for j in readers) or recomputable(t.name)):
                mem_fixed[i] -= t.nbytes.fixed
                mem_per[i] -= t.nbytes.per_example
    # batch norm reduces over the batch before it can normalise: a second pass over its batch-sized inputs,
    # which a chain must have written for it when they were its own intermediates
    for i, op in enumerate(ops):
        if op.type not in BATCH_NORM_TYPES:
            continue
        for name in op.inputs:
            name = _source(alias, name)
            src = producer.get(name)
            if src is None or src[1].nbytes.per_example <= 0:
                continue
            internal = fusible[src[0]] and ops[src[0]].phase == op.phase
            mem_per[i] += src[1].nbytes.per_example * (2 if internal else 1)
    return np.maximum(mem_fixed, 0.0), np.maximum(mem_per, 0.0), fused
