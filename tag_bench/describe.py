"""A strategy in a few words, and the hosts it uses: the words benchmark tables and README rows print.

Example::

    from tag_bench.describe import describe
    describe(plan.strategy, plan.topology)     # "pipeline 2 stages [h0+h1+h2 ps | h0], M=2 deferred_w"
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tag.search.buckets import size_text

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.strategy.types import Strategy


def describe(strategy: "Strategy", topology: "Topology") -> str:
    """Devices, stages and modes of STRATEGY, in a few words (the README's "why")."""
    if strategy.pipeline is not None:
        p = strategy.pipeline
        # a replicated stage's mode (all-reduce or parameter server) says how its devices share the stage
        stages = " | ".join("+".join(topology.groups[g].host for g in s.placement)
                            + (f" {s.mode}" if len(s.placement) > 1 else "") for s in p.stages)
        return f"pipeline {len(p.stages)} stages [{stages}], M={p.micro_batches} {p.schedule}"
    if len(hosts_used(strategy, topology)) == 1:
        return f"one device on {hosts_used(strategy, topology).pop()}"
    counts: dict[str, int] = {}
    for g in range(len(strategy.actions)):
        a = strategy.actions[g]
        key = f"{a.mode}@{'+'.join(sorted(group_hosts(strategy, topology, g)))}"
        counts[key] = counts.get(key, 0) + 1
    text = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if strategy.bucket_bytes is not None:
        text += f" ({size_text(strategy.bucket_bytes)} buckets)"
    return text


def group_hosts(strategy: "Strategy", topology: "Topology", group: int) -> set[str]:
    """The hosts op group GROUP runs on under STRATEGY (a partitioned group: where its ops are placed)."""
    a = strategy.actions[group]
    if a.mode == "partition":
        ops = (int(i) for i in strategy.grouping.members(group))
        return {topology.devices[strategy.partition[i]].host for i in ops if i in strategy.partition}
    return {topology.groups[x].host for x in a.placement}


def hosts_used(strategy: "Strategy", topology: "Topology") -> set[str]:
    """Every host STRATEGY runs anything on."""
    if strategy.pipeline is not None:
        return {topology.groups[x].host for st in strategy.pipeline.stages for x in st.placement}
    return set().union(*(group_hosts(strategy, topology, g) for g in range(len(strategy.actions))))
