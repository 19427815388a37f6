"""Which weight gradients can travel as sufficient factors: ``dW = A^T B`` summed over the batch.

For a weight ``W`` (m x n) whose gradient is one ``MatMul`` of two batch-carrying tensors that contracts
their batch axes, the gradient over the whole batch is ``sum_r A_r^T B_r`` over the replicas' row
blocks ``A_r`` (rows x m) and ``B_r`` (rows x n). Instead of all-reducing ``dW`` (m*n numbers), every
replica can gather all ``A_r`` and ``B_r`` (rows*(m+n) numbers per replica) and compute the product
itself: sufficient-factor broadcasting (SFB). It holds for Dense layers and for the reshaped 2-D
MatMuls of attention and feed-forward blocks (``[B*len, d]`` inputs: ``len`` rows per example).

The IR keeps no op attributes, so the orientation is read from the batch axes: the gradient has no
batch axis, so each operand's batch axis is the axis the MatMul contracts (``transpose_a`` is set iff
the first operand's batch axis is 0, ``transpose_b`` iff the second's is 1). Operands with their batch
axis first are gathered as they are; a 2-D operand with the batch on axis 1 is transposed first (the
rewriter reads the real attributes and checks them against this). Not eligible: gradients made of
several terms (an ``AddN`` with weight decay), sparse (IndexedSlices) gradients, convolutions, and
MatMuls whose operands lack a static, per-example row count.

Part of ``tag.strategy`` because the simulator (``tag.sim.sfb``), the selection (``tag.compress``) and the
rewriter (``tag.backend.rewrite.sfb``) all read it: it sits below each of them.

Example::

    import tag
    from tag.strategy.sfb_eligibility import eligible_gradients
    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    for f in eligible_gradients(tg):
        f.variable, f.weight_bytes, f.factor_bytes_per_example
"""
from __future__ import annotations

from dataclasses import dataclass

from tag.ir.types import TensorInfo, TrainingGraph

__all__ = ["SufficientFactors", "eligible_gradients", "gradient_source"]

_PASS_THROUGH = ("Identity", "Snapshot")
_FLOAT_DTYPES = ("float32", "float16", "float64")     # what CollectiveGatherV2 takes


@dataclass(frozen=True)
class SufficientFactors:
    """One SFB-eligible weight gradient and the two factors it is the product of."""

    variable: str                     # the trainable variable's name
    gradient_op: int                  # IR index of the MatMul computing the gradient
    factors: tuple[str, str]          # its two operand tensors (A, B): dW = A^T B over batch rows
    batch_axes: tuple[int, int]       # each operand's batch axis (the contracted one)
    rows_per_example: tuple[int, int]
    weight_bytes: float               # bytes of the gradient (= of the weight)
    factor_bytes_per_example: float   # bytes of both factors per example (A's row + B's row, times rows)
    dtype: str


def gradient_source(graph: TrainingGraph, gradient: str) -> int | None:
    """IR index of the op computing GRADIENT, looking through Identity ops (None if not in the IR)."""
    index = graph.op_index
    name = gradient.lstrip("^").rsplit(":", 1)[0]
    for _ in range(64):
        i = index.get(name)
        if i is None:
            return None
        op = graph.ops[i]
        if op.type not in _PASS_THROUGH or not op.inputs:
            return i
        name = op.inputs[0].lstrip("^").rsplit(":", 1)[0]
    return None


def _tensor_info(graph: TrainingGraph) -> dict[str, TensorInfo]:
    return {t.name: t for op in graph.ops for t in op.outputs}


def _rows_per_example(info: TensorInfo, batch: int) -> int | None:
    shape, ax = info.shape, info.batch_axis
    if shape is None or ax is None or len(shape) != 2 or any(s is None for s in shape) or shape[ax] % batch:
        return None
    return shape[ax] // batch


def _canonical(name: str) -> str:
    name = name.lstrip("^")
    return name if ":" in name else name + ":0"


def eligible_gradients(graph: TrainingGraph) -> list[SufficientFactors]:
    """The trainable variables of GRAPH whose gradient is one batch-contracting MatMul (module docstring)."""
    info = _tensor_info(graph)
    batch = max(int(graph.batch_size), 1)
    out: list[SufficientFactors] = []
    for v in graph.variables:
        if v.kind != "trainable" or not v.gradient or len(v.shape) != 2 or v.dtype not in _FLOAT_DTYPES:
            continue
        i = gradient_source(graph, v.gradient)
        if i is None or graph.ops[i].type != "MatMul" or len(graph.ops[i].inputs) != 2:
            continue
        op = graph.ops[i]
        out_info = op.outputs[0] if op.outputs else None
        if out_info is None or out_info.batch_axis is not None or tuple(out_info.shape or ()) != tuple(v.shape):
            continue
        a, b = (info.get(_canonical(t)) for t in op.inputs)
        if a is None or b is None or a.dtype != v.dtype or b.dtype != v.dtype:
            continue
        rows = (_rows_per_example(a, batch), _rows_per_example(b, batch))
        if None in rows or rows[0] != rows[1]:
            continue
        m, n = v.shape
        # the non-batch axis of A gives dW's rows, that of B its columns
        if a.shape[1 - a.batch_axis] != m or b.shape[1 - b.batch_axis] != n:
            continue
        per_example = float(a.nbytes.per_example + b.nbytes.per_example)
        if per_example <= 0 or a.nbytes.fixed > 0 or b.nbytes.fixed > 0:
            continue
        out.append(SufficientFactors(v.name, i, (a.name, b.name), (a.batch_axis, b.batch_axis),
                                     (rows[0], rows[1]), float(v.nbytes), per_example, v.dtype))
    return out
