"""Search over strategies: candidate actions per op group, cached evaluation, MCTS, decision orders, PaSE DP,
pipelines by DP.

Every search scores strategies with the simulator (``tag.sim``) through one ``SearchEnv`` and the best
strategy seen is kept. ``search(env, ...)`` runs the whole portfolio and returns a ``SearchResult``.

Example::

    from tag.search import SearchEnv, search
    env = SearchEnv(tg, topo, grouping, cost_model=cm)
    found = search(env, budget_s=30, seed=0)
    found.strategy, found.step_time, found.baselines      # baselines: name -> predicted seconds
"""
from tag.search.driver import SearchProgress, SearchResult, best_uniform, search
from tag.search.env import Outcome, SearchEnv
from tag.search.local import refine
from tag.search.mcts import mcts
from tag.search.pase import pase_dp
from tag.search.pipeline_dp import PipelineSearchResult, pipeline_dp
from tag.search.random_search import random_search

__all__ = ["Outcome", "SearchEnv", "SearchProgress", "SearchResult", "best_uniform", "mcts", "pase_dp",
           "PipelineSearchResult", "pipeline_dp", "random_search", "refine", "search"]
