"""Gradient fusion buckets: which ``allreduce`` op groups have their gradients summed by one collective.

Every collective pays a fixed cost on top of its bytes: a ring all-reduce over n devices takes 2(n-1)
steps, each a round trip of TensorFlow's collective runtime (about 2.5 ms over three testbed hosts, from
``tag-profile --network``). One collective per op group pays it once per group: 25 times a step for a
small ResNet whose 78k weights cross the links in 11 ms. So op groups replicated on the same devices are
summed together, in buckets of up to ``FUSION_BUCKET_BYTES`` formed in backward order (the last forward
group first, as its gradients are ready first), as Horovod's tensor fusion and PyTorch DDP's gradient
buckets do: a bucket's collective starts once its last gradient exists, so buckets keep the overlap of
communication with the rest of the backward pass while sparing most fixed costs.

The simulator (``tag.sim.schedule``) and the rewriter (``tag.backend.rewrite.collectives``) both take
their buckets from ``fusion_buckets``, so what is costed is what is deployed.

Example::

    from tag.strategy.fusion import fusion_buckets
    from tag.strategy.types import Action, Strategy

    # strategy: 3 op groups all-reduced over device groups 0 and 1; sizes in bytes
    buckets = fusion_buckets(strategy.actions, [4e6, 1e6, 2e6], replicated=[True] * 3)
    # -> [(2, 1, 0)]: one bucket, the last group first (7 MB < FUSION_BUCKET_BYTES)
"""
from __future__ import annotations

from typing import Sequence

from tag.strategy.types import Action

#: a bucket closes once it holds this many bytes of gradients (PyTorch DDP's default bucket is 25 MB,
#: Horovod's fusion buffer 64 MB; smaller keeps more overlap with the backward pass)
FUSION_BUCKET_BYTES = 16 * 2 ** 20


def fusion_buckets(actions: Sequence[Action], group_bytes: Sequence[float], replicated: Sequence[bool],
                   exclude: set[int] | frozenset[int] = frozenset(),
                   cap: float | None = None) -> list[tuple[int, ...]]:
    """Buckets (tuples of op groups, last forward group first) of the ``allreduce`` groups of ACTIONS that
    are REPLICATED on more than one device and have gradients (GROUP_BYTES: trainable bytes per group),
    EXCLUDE left out (e.g. groups with SFB gradients): groups with the same placement, taken in
    descending index order, a bucket closed once it reaches CAP bytes. Groups in no bucket keep one
    collective each; a bucket of one group is that group's own collective. CAP: FUSION_BUCKET_BYTES."""
    cap = FUSION_BUCKET_BYTES if cap is None else float(cap)
    open_bucket: dict[tuple[int, ...], list[int]] = {}
    open_bytes: dict[tuple[int, ...], float] = {}
    buckets: list[tuple[int, ...]] = []
    for g in range(len(actions) - 1, -1, -1):
        a = actions[g]
        if a.mode != "allreduce" or not replicated[g] or group_bytes[g] <= 0 or g in exclude:
            continue
        key = a.placement
        bucket = open_bucket.setdefault(key, [])
        bucket.append(g)
        open_bytes[key] = open_bytes.get(key, 0.0) + float(group_bytes[g])
        if open_bytes[key] >= cap:
            buckets.append(tuple(bucket))
            del open_bucket[key], open_bytes[key]
    buckets.extend(tuple(b) for b in open_bucket.values())
    return buckets


def bucket_cap(strategy) -> float:
    """The bytes at which STRATEGY's fusion buckets close: its ``bucket_bytes``, else FUSION_BUCKET_BYTES."""
    return FUSION_BUCKET_BYTES if strategy.bucket_bytes is None else strategy.bucket_bytes


def bucket_leaders(buckets: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """Op group -> the first group of its bucket (the name the rewriter files the fused collective under)."""
    return {g: b[0] for b in buckets for g in b}
