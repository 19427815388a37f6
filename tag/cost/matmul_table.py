"""MatMul speed by shape: a measured table of efficiencies, and the shape of every MatMul op of a graph.

Why a table: on a CPU one efficiency per op type cannot follow how MatMul speed depends on its shape and
transposes. Measured on one core (TensorFlow 2.21, Eigen): at 96 rows the forward product ``x . W`` of a
2048 x 2048 layer runs at about 33 GFLOP/s, its input gradient ``dy . W^T`` at 11, and the same input
gradient of a 512 x 512 layer at 23; halving the rows costs the input gradient a third of its speed and
the forward product almost nothing. Profiles fitted on MLPs of other widths therefore predicted one host's
step of a 2048-wide MLP 8-28% too fast, and of a 512-wide one up to 60% too slow. The table holds, per
variant, the efficiency (FLOP/s over the profile's peak) on a grid of shapes; a MatMul op is costed at the
efficiency interpolated at its own shape, at the batch it runs at.

An ``Einsum`` that is one 2-D product (``einsum_as_matmul``: Keras' ``EinsumDense``, ``"abc,cde->abde"``, and
its gradients) is looked up like the MatMul it amounts to. Measured on one core at d_model 384 (deep transformer,
batch 96), such Einsums ran at 0.9 of what the table gives, while attention's Einsums (a batch of 32 x 96 products
per example and head) ran at 0.11-0.24 of peak at any width from 64 to 384; one per-type efficiency fitted over
both kinds costed the first 1.7x too slow and the second 3-6x too fast. Batched Einsums keep the per-type
efficiency, fitted over them alone (``tag.cost.fitting.fit_profile``).

Variants (``VARIANTS``): ``nn`` = ``A . B`` (a forward product), ``nt`` = ``A . B^T`` (an input gradient),
``tn`` = ``A^T . B`` (a weight gradient); ``A^T . B^T`` is costed as ``nt``. Dimensions: ``m`` rows of
the result, ``k`` the contracted side, ``n`` columns of the result. Lookup interpolates the logarithm of
the efficiency multilinearly in ``(log m, log k, log n)``, clamped to the grid. numpy only.

JSON (a device entry's ``matmul_table`` in a profile)::

    {"sides": [16, 32, ..., 4096],
     "efficiency": {"nn": [[[0.41, ...], ...], ...], "nt": ..., "tn": ...}}   # [m][k][n], each in (0, 1]

Example::

    from tag.cost.matmul_table import MatmulTable, matmul_dims
    dims = matmul_dims(training_graph)                      # the graph's MatMul ops and their shapes
    m, k, n = dims.at(batch=32.0)
    eff = table.lookup(dims.variant, m, k, n)               # one efficiency per MatMul op
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.ir.types import TrainingGraph

VARIANTS = ("nn", "nt", "tn")
#: the grid's side lengths, for m, k and n alike (a MatMul's sides are model widths or batch rows)
DEFAULT_SIDES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MATMUL_OP_TYPES = frozenset({"MatMul", "_FusedMatMul"})


def variant_of(transpose_a: bool, transpose_b: bool) -> int:
    """Index into VARIANTS of a MatMul with these transposes (both transposed: costed as ``nt``)."""
    if transpose_a and not transpose_b:
        return VARIANTS.index("tn")
    return VARIANTS.index("nt") if transpose_b else VARIANTS.index("nn")


@dataclass
class MatmulTable:
    """Efficiency per variant on a grid: ``efficiency[v][i, j, l]`` at m = sides[i], k = sides[j], n = sides[l]."""

    sides: tuple[int, ...]
    efficiency: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        self._log_sides = np.log2(np.asarray(self.sides, dtype=np.float64))
        self._log_eff = np.stack([np.log(self.efficiency[v]) for v in VARIANTS])   # [variant, m, k, n]

    def lookup(self, variant: np.ndarray, m: np.ndarray, k: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Efficiency of each MatMul (arrays of equal length; VARIANT holds indices into VARIANTS)."""
        coords = []
        for dim in (m, k, n):
            x = np.clip(np.log2(np.maximum(np.asarray(dim, dtype=np.float64), 1.0)),
                        self._log_sides[0], self._log_sides[-1])
            i = np.clip(np.searchsorted(self._log_sides, x, side="right") - 1, 0, len(self.sides) - 2)
            w = (x - self._log_sides[i]) / (self._log_sides[i + 1] - self._log_sides[i])
            coords.append((i, w))
        v = np.asarray(variant, dtype=np.int64)
        out = np.zeros(len(v))
        for corner in range(8):
            weight = np.ones(len(v))
            idx = []
            for axis, (i, w) in enumerate(coords):
                upper = (corner >> axis) & 1
                weight = weight * (w if upper else 1.0 - w)
                idx.append(i + upper)
            out += weight * self._log_eff[v, idx[0], idx[1], idx[2]]
        return np.exp(out)

    def scaled(self, factor: float) -> "MatmulTable":
        """The table with every efficiency times FACTOR (clipped to 1): the level of a training step's MatMuls."""
        return MatmulTable(self.sides, {v: np.clip(a * factor, 1e-6, 1.0) for v, a in self.efficiency.items()})

    def to_dict(self) -> dict:
        def significant(a: np.ndarray) -> list:      # 5 significant digits: small efficiencies stay positive
            return np.vectorize(lambda x: float(f"{x:.5g}"))(a).tolist()
        return {"sides": [int(s) for s in self.sides],
                "efficiency": {v: significant(self.efficiency[v]) for v in VARIANTS}}

    @classmethod
    def from_dict(cls, data: object, where: str) -> "MatmulTable":
        """Validate plain data (as loaded from JSON); TagError naming WHERE on anything malformed."""
        if not isinstance(data, dict) or set(data) != {"sides", "efficiency"}:
            raise TagError(f"{where}: expected an object with 'sides' and 'efficiency'")
        sides = data["sides"]
        if (not isinstance(sides, list) or len(sides) < 2
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sides)
                or any(a >= b for a, b in pairwise(sides))):
            raise TagError(f"{where}.sides: expected at least two increasing positive integers")
        eff = data["efficiency"]
        if not isinstance(eff, dict) or set(eff) != set(VARIANTS):
            raise TagError(f"{where}.efficiency: expected the variants {', '.join(VARIANTS)}")
        shape = (len(sides),) * 3
        arrays = {}
        for v in VARIANTS:
            try:
                a = np.asarray(eff[v], dtype=np.float64)
            except (TypeError, ValueError):
                raise TagError(f"{where}.efficiency.{v}: expected a {shape} grid of numbers") from None
            if a.shape != shape:
                raise TagError(f"{where}.efficiency.{v}: expected a {shape} grid, got {a.shape}")
            if not (np.isfinite(a).all() and (a > 0).all() and (a <= 1).all()):
                raise TagError(f"{where}.efficiency.{v}: every efficiency must be in (0, 1]")
            arrays[v] = a
        return cls(tuple(int(s) for s in sides), arrays)


@dataclass
class MatmulDims:
    """The 2-D MatMul ops of a graph whose shapes are known: op indices, variant, and each side as
    ``fixed + per_example * batch`` (a side grows with the batch when it holds the batch rows)."""

    ops: np.ndarray
    variant: np.ndarray
    fixed: np.ndarray          # [ops, 3]: m, k, n at batch 0
    per_example: np.ndarray    # [ops, 3]

    def at(self, batch: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sides = np.maximum(self.fixed + self.per_example * float(batch), 1.0)
        return sides[:, 0], sides[:, 1], sides[:, 2]


def matmul_dims(graph: "TrainingGraph") -> MatmulDims:
    """Shapes of GRAPH's MatMul ops (those with 2-D operands of known shape), from the IR's tensor shapes
    (at the reference batch) and the ops' ``transpose_a`` / ``transpose_b`` attributes; and of its Einsum ops
    that are one 2-D product (``einsum_as_matmul``: a dense layer on a 3-D input, its gradients)."""
    tensors = {t.name: t for op in graph.ops for t in op.outputs}
    ref = float(max(graph.batch_size, 1))
    ops, variants, fixed, per_example = [], [], [], []
    for i, op in enumerate(graph.ops):
        if not op.inputs or not op.outputs:
            continue
        if op.type == "Einsum":
            placed = _einsum_dims(op, tensors)
            if placed is None:
                continue
            variant, sides = placed
        elif op.type in MATMUL_OP_TYPES:
            a, out = tensors.get(op.inputs[0]), op.outputs[0]
            if a is None or not _known_2d(a.shape) or not _known_2d(out.shape):
                continue
            ta, tb = bool(op.attrs.get("transpose_a", False)), bool(op.attrs.get("transpose_b", False))
            k_axis = 0 if ta else 1
            variant = variant_of(ta, tb)
            sides = [(out.shape[0], out.batch_axis == 0), (a.shape[k_axis], a.batch_axis == k_axis),
                     (out.shape[1], out.batch_axis == 1)]
        else:
            continue
        ops.append(i)
        variants.append(variant)
        fixed.append([0.0 if grows else float(s) for s, grows in sides])
        per_example.append([float(s) / ref if grows else 0.0 for s, grows in sides])
    return MatmulDims(np.array(ops, dtype=np.int64), np.array(variants, dtype=np.int64),
                      np.array(fixed, dtype=np.float64).reshape(-1, 3),
                      np.array(per_example, dtype=np.float64).reshape(-1, 3))


def _known_2d(shape) -> bool:
    return shape is not None and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)


def einsum_as_matmul(equation: str) -> tuple[str, str, str, int] | None:
    """(m labels, k labels, n labels, variant index) of a two-operand EQUATION that is one 2-D product, else None.

    One 2-D product: no label is kept from both operands (no batch of products, as attention's scores have),
    none is summed within one operand alone, at least one label is contracted, no ellipsis. ``m`` holds the
    first operand's kept labels, ``n`` the second's, ``k`` the contracted ones, each in operand order. The
    variant follows the operands' layouts as MatMul's transposes would: the first operand read as ``[k, m]``
    is ``tn``, the second read as ``[n, k]`` is ``nt`` (``"abc,cde->abde"``, a dense layer on a 3-D input:
    ``nn``; ``"abde,cde->abc"``, its input gradient: ``nt``; ``"abc,abde->cde"``, its weight gradient: ``tn``).
    """
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->", 1)
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    a, b = terms
    if set(out) - set(a) - set(b) or set(a) & set(b) & set(out):
        return None
    if (set(a) - set(b) - set(out)) or (set(b) - set(a) - set(out)):
        return None
    k = "".join(c for c in a if c in b)
    m = "".join(c for c in a if c not in b)
    n = "".join(c for c in b if c not in a)
    if not k:
        return None
    ta = bool(m) and max(a.index(c) for c in k) < min(a.index(c) for c in m)
    tb = bool(n) and max(b.index(c) for c in n) < min(b.index(c) for c in k)
    return m, k, n, variant_of(ta, tb)


def _einsum_dims(op, tensors) -> tuple[int, list[tuple[float, bool]]] | None:
    """(variant, [(side, grows with the batch)] for m, k, n) of an Einsum op that is one 2-D product, else None."""
    equation = str(op.attrs.get("equation", "")).replace(" ", "")
    placed = einsum_as_matmul(equation)
    if placed is None or len(op.inputs) != 2:
        return None
    m, k, n, variant = placed
    extent: dict[str, int] = {}
    batch_label = None
    for term, name in zip(equation.split("->")[0].split(","), op.inputs, strict=True):
        t = tensors.get(name)
        if t is None or t.shape is None or len(t.shape) != len(term):
            return None
        if not all(isinstance(d, int) and d > 0 for d in t.shape):
            return None
        extent.update(zip(term, t.shape, strict=True))
        if t.batch_axis is not None and batch_label is None:
            batch_label = term[t.batch_axis]
    sides = [(float(np.prod([extent[c] for c in labels], dtype=np.float64)) if labels else 1.0,
              batch_label is not None and batch_label in labels) for labels in (m, k, n)]
    return variant, sides


#: the largest product the table times (FLOPs); larger grid points copy the largest timed m
GRID_MAX_FLOPS = 2.0 ** 32


def grid_shapes(sides=DEFAULT_SIDES, max_flops: float = GRID_MAX_FLOPS) -> list[tuple[str, int, int, int]]:
    """(variant, m, k, n) of every grid point worth timing: those of at most MAX_FLOPS (larger ones take the
    efficiency of the largest timed m with the same k and n).

    Why 2^32 and not less: speed can still jump with m at a gigaFLOP. On one core of an AMD EPYC host
    (TensorFlow 2.21), a 2048 x 2048 forward product ran at 45 GFLOP/s at 256 rows and 75 at 512, its input
    gradient at 22 and 45; with the cap at 2^30 (m <= 128 at that width) the table held the small-row speed
    for every batch, and the 20 x 2048 MLP's one-host step at batch 384 was predicted 61% too slow while its
    96-row micro-batches were costed right, so a pipeline measured 0.54x one host was predicted 1.23x
    (``bench_pipeline`` run 16). The larger cap adds 147 grid points, about 15% more calibration time."""
    return [(v, m, k, n) for v in VARIANTS for m in sides for k in sides for n in sides
            if 2.0 * m * k * n <= max_flops]


def table_from_rates(rates: dict[tuple[str, int, int, int], float], peak: float,
                     sides=DEFAULT_SIDES) -> MatmulTable:
    """A MatmulTable from measured FLOP/s per (variant, m, k, n) grid point, as fractions of PEAK (clipped to
    (0, 1]); untimed points copy the largest timed m of their (variant, k, n)."""
    if not math.isfinite(peak) or peak <= 0:
        raise TagError(f"peak FLOP/s must be positive, got {peak!r}")
    eff = {}
    for v in VARIANTS:
        a = np.zeros((len(sides),) * 3)
        for ki, k in enumerate(sides):
            for ni, n in enumerate(sides):
                last = None
                for mi, m in enumerate(sides):
                    r = rates.get((v, m, k, n))
                    last = r if r is not None else last
                    if last is None:
                        raise TagError(f"MatMul table: no timing for {v} m={m} k={k} n={n}")
                    a[mi, ki, ni] = last
        eff[v] = np.clip(a / peak, 1e-6, 1.0)
    return MatmulTable(tuple(sides), eff)
