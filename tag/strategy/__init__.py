"""Strategies as plain data: op groups, per-group actions, the grouping pass and the built-in baselines.

Example::

    from tag.strategy import Action, Strategy, builtin_strategy, group_ops
    grouping = group_ops(training_graph, target_groups=64)
    dp = builtin_strategy("dp_allreduce", training_graph, topology, grouping)
"""
from tag.strategy.baselines import BUILTIN_STRATEGIES, builtin_strategy
from tag.strategy.grouping import group_ops
from tag.strategy.types import MODES, Action, Grouping, Strategy, batch_shares

__all__ = ["BUILTIN_STRATEGIES", "MODES", "Action", "Grouping", "Strategy", "batch_shares", "builtin_strategy",
           "group_ops"]
