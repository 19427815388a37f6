"""Gradient fusion bucket size per plan, chosen on the simulator.

All-reduced op groups on the same devices are summed in fusion buckets (``tag.strategy.fusion``): a bucket's
collective starts once its last gradient exists. Where a bucket closes decides two costs that pull apart:

* every collective pays a fixed cost (a ring over n devices takes 2(n-1) steps, each a round trip of the
  runtime), so many buckets pay it many times: a ring over the 28 GPUs of ``topologies/cloud-slow-link.pbtxt``
  pays it 54 times per bucket, and BERT-base's 440 MB of gradients in 16 MB buckets (28 of them) is predicted
  1396 ms a data-parallel step, in 1 GB buckets 948 ms;
* one bucket starts only after the whole backward pass, so nothing overlaps it: on links a thousand times
  slower than a GPU's (the testbed's configuration G, 136 Mbit/s), a small transformer's 2 MB of gradients in
  one bucket took 559-597 ms a data-parallel step, in 256 KB buckets 505-518 ms (``scripts/bench_buckets.py``).

TensorFlow's MultiWorkerMirroredStrategy packs every gradient into one collective by default, PyTorch DDP uses
25 MB buckets and Horovod 64 MB with an autotuner. tag simulates the plan with each size of ``BUCKET_CHOICES``
and keeps the fastest (``Strategy.bucket_bytes``), unless no size is predicted ``MIN_BUCKET_GAIN`` faster than
the default ``FUSION_BUCKET_BYTES`` (then the plan keeps the default and its strategy is unchanged). The
rewriter builds the buckets the simulator costed. Pipelines keep one collective per stage and are left alone.

Example::

    from tag.search.buckets import choose_bucket_bytes
    chosen = choose_bucket_bytes(simulator, strategy, batch_size=64)
    if chosen is not None:
        strategy = chosen.strategy          # strategy.bucket_bytes is the size; chosen.step_times all sizes
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tag.sim.result import SimResult
from tag.sim.simulator import Simulator
from tag.strategy.fusion import FUSION_BUCKET_BYTES
from tag.strategy.types import Strategy

#: bucket sizes tried (bytes): from a few gradients per bucket to every gradient of a large model in one
BUCKET_CHOICES = tuple(float(2 ** k) for k in (18, 20, 22, 24, 26, 28, 30))
#: a size other than the default must be predicted at least this much faster to be kept
MIN_BUCKET_GAIN = 0.01


@dataclass
class BucketChoice:
    """The strategy with its chosen ``bucket_bytes``, its simulation, and every size's predicted step."""

    strategy: Strategy
    result: SimResult
    default_step_time: float
    step_times: dict[float, float]      # bucket bytes -> predicted seconds (feasible sizes only)

    @property
    def step_time(self) -> float:
        return float(self.result.step_time)


def fusable(strategy: Strategy) -> bool:
    """Whether STRATEGY has all-reduced op groups whose buckets a size could change (not a pipeline)."""
    if strategy.pipeline is not None:
        return False
    allreduced = [a for a in strategy.actions if a.mode == "allreduce"]
    return len(allreduced) >= 2


def size_text(nbytes: float) -> str:
    """A bucket size for people: 256 KB, 16 MB, 1 GB."""
    for unit, name in ((2 ** 30, "GB"), (2 ** 20, "MB"), (2 ** 10, "KB")):
        if nbytes >= unit:
            return f"{nbytes / unit:g} {name}"
    return f"{nbytes:g} B"


def choose_bucket_bytes(simulator: Simulator, strategy: Strategy, batch_size: int | None = None,
                        choices: tuple[float, ...] = BUCKET_CHOICES, min_gain: float = MIN_BUCKET_GAIN,
                        default: SimResult | None = None) -> BucketChoice | None:
    """STRATEGY with the fastest predicted bucket size of CHOICES, or None when STRATEGY has nothing to fuse or
    no size is predicted MIN_GAIN faster than the default (``FUSION_BUCKET_BYTES``). Among sizes predicted
    equally fast the largest is kept (the fewest collectives). DEFAULT: STRATEGY's simulation with the default
    size, when the caller already has it (not simulated again)."""
    if not fusable(strategy):
        return None
    if default is None:
        default = simulator.evaluate(dataclasses.replace(strategy, bucket_bytes=None), batch_size=batch_size)
    if not default.feasible:
        return None
    times: dict[float, float] = {FUSION_BUCKET_BYTES: float(default.step_time)}
    results: dict[float, SimResult] = {FUSION_BUCKET_BYTES: default}
    for size in choices:
        if size == FUSION_BUCKET_BYTES:
            continue
        r = simulator.evaluate(dataclasses.replace(strategy, bucket_bytes=size), batch_size=batch_size)
        if r.feasible:
            times[size], results[size] = float(r.step_time), r
    best_time = min(times.values())
    best = max(size for size, t in times.items() if t <= best_time * (1 + 1e-9))
    if best == FUSION_BUCKET_BYTES or best_time > times[FUSION_BUCKET_BYTES] * (1 - min_gain):
        return None
    return BucketChoice(dataclasses.replace(strategy, bucket_bytes=best), results[best],
                        times[FUSION_BUCKET_BYTES], dict(sorted(times.items())))
