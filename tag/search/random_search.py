"""Random search over per-group candidates: the baseline any smarter search must beat at an equal budget.

With E evaluations (simulator calls through ``env.evaluate``), the first ceil(E/2) choices are drawn
*uniformly at random per group*: every op group independently takes one of its allowed candidates
(``env.allowed[g]``) with equal probability. The remaining floor(E/2) are *random mutations of the best
choice so far*: copy the best, pick between 1 and ``MAX_MUTATED_GROUPS`` groups at random (uniformly,
without repetition) and give each a different allowed candidate chosen uniformly (a group with a single
allowed candidate keeps it). Choices are ranked like everywhere in the search: higher value (speedup
over the reference; infeasible ones negative), then the shorter step.

A choice drawn twice is answered by the environment's cache but still counts against the budget, so the
budget is in proposals, as the tree search's is in playouts. Deterministic for a seed.

Example::

    from tag.search.env import SearchEnv
    from tag.search.random_search import random_search
    env = SearchEnv(tg, topo, grouping)
    found = random_search(env, evaluations=400, seed=0)
    found.choice, found.outcome.step_time, found.evaluations
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tag.search.env import Choice, Outcome, SearchEnv

MAX_MUTATED_GROUPS = 4


@dataclass
class RandomResult:
    choice: Choice          # the best choice evaluated
    outcome: Outcome        # its outcome
    evaluations: int        # choices evaluated (calls to env.evaluate, cached ones included)


def random_choice(env: SearchEnv, rng: np.random.Generator) -> Choice:
    """One allowed candidate per group, uniformly at random (a random mixed strategy: ``env.strategy(choice)``)."""
    return tuple(int(allowed[rng.integers(len(allowed))]) for allowed in env.allowed)


def _mutation(env: SearchEnv, base: Choice, rng: np.random.Generator) -> Choice:
    """BASE with 1..MAX_MUTATED_GROUPS random groups moved to another allowed candidate."""
    n = env.num_groups
    count = int(rng.integers(1, min(MAX_MUTATED_GROUPS, n) + 1))
    choice = list(base)
    for g in rng.choice(n, size=count, replace=False):
        others = [k for k in env.allowed[int(g)] if k != choice[g]]
        if others:
            choice[g] = int(others[rng.integers(len(others))])
    return tuple(choice)


def random_search(env: SearchEnv, evaluations: int = 400, seed: int = 0) -> RandomResult:
    """Evaluate EVALUATIONS random choices (module docstring) and return the best."""
    if evaluations < 1:
        raise ValueError(f"random search needs at least one evaluation, got {evaluations}")
    rng = np.random.default_rng(seed)
    best_choice, best_outcome = None, None
    uniform_draws = (evaluations + 1) // 2
    for i in range(evaluations):
        choice = random_choice(env, rng) if i < uniform_draws else _mutation(env, best_choice, rng)
        outcome = env.evaluate(choice)
        if best_outcome is None or outcome.rank > best_outcome.rank:
            best_choice, best_outcome = choice, outcome
    return RandomResult(best_choice, best_outcome, evaluations)
