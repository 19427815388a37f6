"""The training-graph IR: plain data describing one training step, no TensorFlow needed to read it.

``tag.frontend.analyze`` builds it from a GraphDef; every later stage (grouping, cost model, simulator,
search, rewriter) reads only this. Sizes that grow with the batch are kept symbolic as
``fixed + per_example * batch`` so costs can be re-evaluated at any per-replica batch size.

Example::

    tg = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    tg.num_parameters, len(tg.ops), tg.total_flops(batch=32)
    flops = tg.arrays().flops(batch=8)       # numpy vector, one entry per op
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

Phase = Literal["forward", "backward", "update"]
PHASES: tuple[str, ...] = ("forward", "backward", "update")


@dataclass(frozen=True)
class Linear:
    """A quantity ``fixed + per_example * batch`` (bytes or FLOPs)."""

    fixed: float = 0.0
    per_example: float = 0.0

    def at(self, batch: float) -> float:
        return self.fixed + self.per_example * batch


@dataclass
class TensorInfo:
    """One output tensor of an op. ``shape`` is at the reference batch; ``batch_axis`` marks the batch dim."""

    name: str                       # "op_name:0"
    dtype: str                      # "float32", "int32", "resource", ...
    shape: tuple[int | None, ...] | None   # None: unknown rank
    batch_axis: int | None          # axis that scales with the batch, None if none
    nbytes: Linear                  # size in bytes as a function of the batch


@dataclass
class OpInfo:
    """One op of the training step."""

    name: str
    type: str
    device: str                     # the device the GraphDef requested ("" if none)
    phase: Phase
    inputs: list[str]               # data input tensor names ("producer:idx")
    control_inputs: list[str]       # op names
    outputs: list[TensorInfo]
    flops: Linear                   # floating-point operations
    mem_bytes: Linear               # bytes read + written (for the roofline's memory term)
    has_flop_rule: bool = True      # False: byte-based fallback was used
    colocation_group: int | None = None   # index into TrainingGraph.colocation
    attrs: dict[str, bool | str] = field(default_factory=dict)   # attributes the cost model reads (MatMul
    #                                                                  transposes, an Einsum's equation)


@dataclass
class Edge:
    """A data edge: tensor ``tensor`` flows from op ``src`` to op ``dst`` (indices into ``ops``)."""

    src: int
    dst: int
    tensor: str
    nbytes: Linear


@dataclass
class VariableInfo:
    """A variable of the graph. ``kind``: trainable weight, optimizer slot, or other state."""

    name: str                       # the variable op (VarHandleOp / VariableV2) name
    op: int                         # index of the variable op in ``ops``
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: Literal["trainable", "slot", "state"]
    apply_op: str | None = None     # the optimizer op that updates it (trainable weights)
    gradient: str | None = None     # the gradient tensor that reaches the apply op
    slots: list[str] = field(default_factory=list)   # slot variable names (trainable weights)
    slot_bytes: int = 0             # bytes of its optimizer slots
    read_ops: list[str] = field(default_factory=list)


@dataclass
class TrainingGraph:
    """The IR of one training step (ops reachable from the optimizer's apply ops)."""

    ops: list[OpInfo]
    edges: list[Edge]
    control_edges: list[tuple[int, int]]
    variables: list[VariableInfo]
    batch_size: int                 # the reference (global) batch the graph was analysed at
    inputs: list[str]               # batch-carrying input ops (Placeholders, iterators)
    colocation: list[list[str]]     # op-name sets that must share a device
    unknown_op_types: dict[str, int] = field(default_factory=dict)  # type -> count, fallback cost used
    name: str = ""
    unknown_shape_tensors: int = 0  # numeric tensors whose shape TF could not infer (counted as 0 bytes)

    @cached_property
    def op_index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    @property
    def num_parameters(self) -> int:
        """Trainable weights the optimizer updates (slots and moving statistics excluded)."""
        return int(sum(int(np.prod(v.shape)) if v.shape else 1 for v in self.variables if v.kind == "trainable"))

    def total_flops(self, batch: float | None = None, phases: tuple[str, ...] = PHASES) -> float:
        b = self.batch_size if batch is None else batch
        return float(sum(op.flops.at(b) for op in self.ops if op.phase in phases))

    def arrays(self) -> "GraphArrays":
        return GraphArrays.from_graph(self)


@dataclass
class GraphArrays:
    """Column view of a TrainingGraph for vectorised cost evaluation (the simulator's hot path)."""

    flops_fixed: np.ndarray
    flops_per_example: np.ndarray
    mem_fixed: np.ndarray
    mem_per_example: np.ndarray
    phase: np.ndarray               # int: index into PHASES
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes_fixed: np.ndarray
    edge_bytes_per_example: np.ndarray

    @classmethod
    def from_graph(cls, tg: TrainingGraph) -> "GraphArrays":
        f = np.array([[o.flops.fixed, o.flops.per_example, o.mem_bytes.fixed, o.mem_bytes.per_example]
                      for o in tg.ops], dtype=np.float64).reshape(-1, 4)
        e = np.array([[x.src, x.dst, x.nbytes.fixed, x.nbytes.per_example] for x in tg.edges],
                     dtype=np.float64).reshape(-1, 4)
        return cls(f[:, 0], f[:, 1], f[:, 2], f[:, 3],
                   np.array([PHASES.index(o.phase) for o in tg.ops], dtype=np.int8),
                   e[:, 0].astype(np.int64), e[:, 1].astype(np.int64), e[:, 2], e[:, 3])

    def flops(self, batch: float) -> np.ndarray:
        return self.flops_fixed + self.flops_per_example * batch

    def mem_bytes(self, batch: float) -> np.ndarray:
        return self.mem_fixed + self.mem_per_example * batch
