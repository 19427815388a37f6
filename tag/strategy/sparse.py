"""Sparse gradients summed as dense tables where that moves fewer bytes.

An embedding lookup's gradient is an ``IndexedSlices``: one row per looked-up id (its *values*) and the
ids (its *indices*), so it grows with the batch. Replicated with ``allreduce``, every replica's update
needs the whole batch's rows, and gathering them moves ``batch x row bytes`` through the ring. When those
rows outweigh twice the table (a ring all-reduce moves each byte of a dense tensor twice), the table is
summed densely instead: each replica adds its own rows into a dense copy of the table
(``UnsortedSegmentSum``), the copies are all-reduced, and the update reads the summed rows of the batch's
distinct ids from the result. Only the ids still cross the network. Why: the 2-layer transformer of
bench_e2e (a 1000 x 128 table, 12288 tokens a step at batch 384) gathered 6.3 MB of rows a step where
the table is 0.5 MB; on configuration G the rows took 80-210 ms of its 540 ms data-parallel step.

This applies to updates that first deduplicate the ids (TensorFlow's optimizers do, through ``Unique``
and ``UnsortedSegmentSum``, before every sparse apply but plain gradient descent's), so the update sees
the same rows and sums as on one device. The simulator (``tag.sim.memory``) and the rewriter
(``tag.backend.rewrite``) both decide with ``dense_sum_pays``, so what is costed is what is deployed.

Example::

    import tag
    from tag.strategy.sparse import dense_sum_pays, sparse_dedups
    tg = tag.analyze(graph_def)                       # a graph with an embedding table
    for name, d in sparse_dedups(tg).items():
        dense_sum_pays(d.values_bytes_per_example, d.table_bytes, batch=384)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.ir.types import TrainingGraph


@dataclass(frozen=True)
class SparseDedup:
    """A trainable variable whose sparse gradient its update deduplicates: ``segment_sum_op`` =
    ``UnsortedSegmentSum(values, unique_op:1, n)`` with ``unique_op`` = ``Unique(indices)``."""

    variable: str                   # the variable op's name
    values: str                     # the gradient rows tensor ("op:k")
    indices: str                    # the ids tensor ("op:k")
    unique_op: str
    segment_sum_op: str
    rows: int                       # rows of the table (its first dimension)
    table_bytes: float              # bytes of the table (what a dense all-reduce moves)
    values_bytes_per_example: float  # bytes of gradient rows per example


def _tensor(name: str) -> str:
    """NAME as "op:k" (a bare op name is its output 0)."""
    name = name.lstrip("^")
    return name if ":" in name else name + ":0"


def sparse_dedups(graph: "TrainingGraph") -> dict[str, SparseDedup]:
    """Per trainable variable whose update deduplicates a batch-sized (sparse) gradient: its gradient is, or
    is read only by, ``UnsortedSegmentSum(values, Unique(indices):1, n)``, and neither the rows nor
    ``Unique:1`` feed anything else. Other sparse gradients (plain gradient descent scatters its rows
    directly) are left out, and stay gathered."""
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            readers.setdefault(_tensor(t), []).append(i)
    out: dict[str, SparseDedup] = {}
    for v in graph.variables:
        if v.kind != "trainable" or not v.gradient or not v.shape or v.shape[0] <= 0 or v.nbytes <= 0:
            continue
        grad = _tensor(v.gradient)
        i = graph.op_index.get(grad.split(":")[0])
        if i is None:
            continue
        if graph.ops[i].type == "UnsortedSegmentSum":      # the update reads the deduplicated rows
            seg_i = i
        else:                                              # the update reads the rows, deduplicated first
            users = readers.get(grad, [])
            if len(users) != 1:
                continue
            seg_i = users[0]
        seg = graph.ops[seg_i]
        if seg.type != "UnsortedSegmentSum" or len(seg.inputs) < 3:
            continue
        values, ids = _tensor(seg.inputs[0]), _tensor(seg.inputs[1])
        producer, uniq_i = graph.op_index.get(values.split(":")[0]), graph.op_index.get(ids.split(":")[0])
        if producer is None or uniq_i is None or graph.ops[uniq_i].type != "Unique" or not ids.endswith(":1") \
                or readers.get(ids, []) != [seg_i] or readers.get(values, []) != [seg_i] \
                or not graph.ops[uniq_i].inputs:
            continue
        k = int(values.split(":")[1])
        outputs = graph.ops[producer].outputs
        if k >= len(outputs) or outputs[k].nbytes.per_example <= 0:
            continue                         # a dense gradient
        out[v.name] = SparseDedup(v.name, values, _tensor(graph.ops[uniq_i].inputs[0]), graph.ops[uniq_i].name,
                                  seg.name, int(v.shape[0]), float(v.nbytes), float(outputs[k].nbytes.per_example))
    return out


def grouped_dedups(graph: "TrainingGraph", group_of_op) -> dict[str, SparseDedup]:
    """``sparse_dedups`` whose variable and segment sum share an op group (GROUP_OF_OP: op index -> group), the
    only ones the rewriter can sum densely under one action; the simulator charges the same ones."""
    return {k: d for k, d in sparse_dedups(graph).items()
            if int(group_of_op[graph.op_index[d.variable]]) == int(group_of_op[graph.op_index[d.segment_sum_op]])}


def dense_sum_pays(values_bytes_per_example, table_bytes, batch):
    """Whether all-reducing the dense table moves fewer bytes than gathering BATCH examples' gradient rows:
    a ring all-gather moves each row once through every device, a ring all-reduce each table byte twice
    (the ids are gathered either way). Floats give a bool, numpy arrays an array of them."""
    return batch * values_bytes_per_example > 2.0 * table_bytes
