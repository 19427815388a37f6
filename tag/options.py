"""SearchOptions: how a plan is searched and tuned, in one object whose fields are checked once.

``tag.optimize``, ``tag.api.search_plan`` and ``tag-deploy`` read the search's settings from one frozen
``SearchOptions``: how long the tree search runs (``budget_s`` / ``playouts``), in which decision order
(``order``, ``seed``), what guides it (``prior``), what it may choose (``sfb``, ``pipeline``,
``fuse_buckets``), the margins a searched strategy must beat (``min_gain``, ``mixed_min_gain``) and how many
candidates the measured tuning step runs (``tune_k``, ``tag.tune``). Every field is checked when the object
is made: a bad value is an ``OptionError``, a one-line ``TagError`` naming the field and what it allows,
before any graph is built (``tag-deploy`` words it with the flag's name, exit code 2).

``SearchOptions.of(options, **keywords)`` is how the entry points take both: the options given (default: all
defaults) with each keyword that is not None replacing its field, so ``tag.optimize(gd, topo, playouts=50)``
and ``tag.optimize(gd, topo, options=SearchOptions(playouts=50))`` search alike, and a keyword given beside
``options`` wins over the object's field.

Example::

    import tag
    opts = tag.SearchOptions(playouts=200, seed=1, prior="gnn", mixed_min_gain=0.0)
    plan = tag.optimize(graph_def, "topologies/localhost.pbtxt", options=opts)
    plan = tag.optimize(graph_def, "topologies/localhost.pbtxt", options=opts, seed=2)    # seed 2 wins
    tag.SearchOptions(min_gain=-0.1)  # OptionError: min_gain must be between 0 and 10 (a fraction: ...), got -0.1
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tag.errors import OptionError
from tag.search.driver import DEFAULT_MIN_GAIN, MIXED_MIN_GAIN
from tag.search.orders import ORDERS

__all__ = ["MAX_GAIN", "PRIORS", "SearchOptions", "check_k"]

#: what guides the tree search: the uniform strategies' speedups, or the shipped graph neural network (tag.gnn)
PRIORS: tuple[str, ...] = ("uniform", "gnn")
#: a margin is a fraction of the slower time (0.05 = 5% faster); 10 (an 11x speedup) is more than any plan offers
MAX_GAIN = 10.0


@dataclass(frozen=True)
class SearchOptions:
    """The search's and the tuning step's settings (module docstring); checked when made.

    ``budget_s``: seconds of tree search (None: ``playouts`` decide). ``playouts``: simulated tree-search playouts
    (neither: the search's default playouts). ``order``: decision order (``tag.search.orders.ORDERS``) or "auto"
    (per model family). ``seed``: makes the search repeatable. ``prior``: ``"uniform"`` (the speedups of the
    uniform strategies; free) or ``"gnn"`` (the shipped graph neural network, ``tag.gnn``). ``sfb``: after the
    search, send the gradients that pay as sufficient factors (``tag.compress``). ``pipeline``: search pipelines
    of op-group stages too (``tag.search.pipeline_dp``). ``fuse_buckets``: choose the plan's gradient fusion
    bucket size (``tag.search.buckets``). ``min_gain``: a searched strategy replaces the best feasible built-in
    only when predicted at least this much faster (default ``tag.search.driver.DEFAULT_MIN_GAIN``, 0.05: the
    simulator's error on real runs; 0 keeps the fastest predicted). ``mixed_min_gain``: a mixed strategy or a
    pipeline replaces the best uniform action only when predicted this much faster (default
    ``tag.search.driver.MIXED_MIN_GAIN``, 0.10). ``tune_k``: how many distinct candidates the measured tuning step
    runs (None: as many as cost about 30 steps of the slowest; ``tag.tune``).
    """

    budget_s: float | None = None
    playouts: int | None = None
    order: str = "auto"
    seed: int = 0
    prior: str = "uniform"
    sfb: bool = True
    pipeline: bool = True
    fuse_buckets: bool = True
    min_gain: float = DEFAULT_MIN_GAIN
    mixed_min_gain: float = MIXED_MIN_GAIN
    tune_k: int | None = None

    def __post_init__(self) -> None:
        if self.budget_s is not None and not (_real(self.budget_s) and self.budget_s > 0):
            raise OptionError("budget_s", f"{{name}} must be a positive number of seconds, got {_shown(self.budget_s)}")
        if self.playouts is not None and not (_integer(self.playouts) and self.playouts >= 1):
            raise OptionError("playouts",
                              f"{{name}} must be a positive number of playouts, got {_shown(self.playouts)}")
        if self.order != "auto" and self.order not in ORDERS:
            raise OptionError("order", f"unknown {{name}} {self.order!r} (known: auto, {', '.join(ORDERS)})")
        if not (_integer(self.seed) and self.seed >= 0):
            raise OptionError("seed", f"{{name}} must be a non-negative integer, got {_shown(self.seed)}")
        if self.prior not in PRIORS:
            raise OptionError("prior", f"unknown {{name}} {self.prior!r} (known: {', '.join(PRIORS)})")
        for name in ("sfb", "pipeline", "fuse_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"{{name}} must be True or False, got {getattr(self, name)!r}")
        for name, example in (("min_gain", "0.05 = 5%"), ("mixed_min_gain", "0.10 = 10%")):
            value = getattr(self, name)
            if not (_real(value) and 0 <= value < MAX_GAIN):
                raise OptionError(name, f"{{name}} must be between 0 and {MAX_GAIN:g} (a fraction: {example}), "
                                        f"got {_shown(value)}")
        check_k(self.tune_k)

    @classmethod
    def of(cls, options: "SearchOptions | None" = None, **keywords: Any) -> "SearchOptions":
        """OPTIONS (None: the defaults) with every keyword that is not None replacing its field (checked
        again); TypeError for a keyword that names no field, as for any unexpected keyword argument."""
        unknown = sorted(set(keywords) - set(FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (search options: {', '.join(FIELDS)})")
        if options is not None and not isinstance(options, cls):
            raise OptionError("options", f"{{name}} must be a tag.SearchOptions, got {type(options).__name__}")
        given = {k: v for k, v in keywords.items() if v is not None}
        base = cls() if options is None else options
        return dataclasses.replace(base, **given) if given else base


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SearchOptions))


def check_k(k: Any, what: str = "tune_k") -> int | None:
    """K as a positive int of candidates to measure (None: the default K); ``OptionError`` naming WHAT else."""
    if k is not None and not (_integer(k) and k >= 1):
        raise OptionError(what, f"{{name}} must be a positive number of candidates to measure, got {k!r}")
    return k


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """VALUE as a message shows it: a float as ``%g`` (0.0 -> "0"), an int as itself, anything else as its repr."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if _integer(value) else repr(value)
