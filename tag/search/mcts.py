"""Monte Carlo tree search over per-group actions, as TAG does it.

The problem: choose one candidate (``SearchEnv.candidates``) per op group to maximise the simulated speedup
over the reference strategy. The tree has one level per op group, in a decision order
(``tag.search.orders``): a node at depth d has decided groups order[0..d-1]; its children are the allowed
candidates of order[d]. A node is scored by completing its partial choice -- every undecided group follows
the *first* decision (where that candidate is not allowed for a group, the group's first allowed one) --
and simulating it. So the root's children are the uniform strategies, and deeper levels refine the
costliest groups (in TAG's cost-descending order) one at a time.

One playout: from the root, descend by PUCT,

    score(child) = Q(child) + c_puct * P(child) * sqrt(N(node)) / (1 + N(child)),

where Q is the child's mean value (values normalised by the best value seen, so Q <= 1 for feasible
strategies; negative for strategies that run out of memory), P the prior over the group's candidates and N
visit counts; unvisited children take Q = the parent's mean minus ``fpu_reduction``. The first unvisited
child reached is expanded, its completion simulated, and the value backed up the path. Ties are broken by
a seeded random jitter, so a run is deterministic for a seed (with a playout budget; a seconds budget stops
wherever the clock says). The best strategy seen at any node is kept by the environment.

Pipelines (``pipelines=``, a ``tag.search.pipeline_tree.PipelineRoots``): the root also gets one child per
pipeline, with one level per stage below it choosing the stage's action; a pipeline node is completed with
the pipeline's own actions for undecided stages and simulated like any other (``SearchEnv.evaluate_pipeline``).
The best pipeline seen is ``TreeResult.pipeline``; ``TreeResult.pipeline_wins`` says whether it beat the best
per-group choice. The default prior then also covers the pipelines: one softmax over the uniform strategies'
and the pipelines' values (a given prior keeps its mass over the per-group children in proportion to their
number, and the pipelines share the rest by the same softmax).

Prior: a callable ``prior(env, order, prefix, allowed) -> probabilities over allowed`` for the group
``order[len(prefix)]`` given the decisions so far (the GNN of ``tag.gnn`` plugs in here; ``uniform_prior`` is
the blind one). Without one, ``uniform_value_prior`` is used: a softmax over the speedups of the uniform
strategies, which the search has already simulated (so it costs nothing).

Example::

    from tag.search.env import SearchEnv
    from tag.search.mcts import mcts
    env = SearchEnv(tg, topo, grouping)
    tree = mcts(env, order="cost_descending", playouts=500, seed=0)
    tree.choice, tree.outcome.step_time, tree.playouts
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tag.search.env import Choice, Outcome, SearchEnv
from tag.search.orders import decision_order
from tag.search.pipeline_tree import PipelineRoots
from tag.strategy.pipeline import Pipeline

C_PUCT = 1.5
FPU_REDUCTION = 0.2
# prior(env, order, prefix, allowed) -> probabilities over ALLOWED (candidate indices) for group order[len(prefix)],
# given the decision order and the candidates already chosen for order[:len(prefix)]
PriorFn = Callable[[SearchEnv, Sequence[int], tuple[int, ...], Sequence[int]], np.ndarray]


@dataclass
class TreeResult:
    choice: Choice                  # the best completed choice seen during the search
    outcome: Outcome
    playouts: int
    seconds: float
    order: list[int]
    depth_reached: int              # deepest level expanded
    # with keep_visits: prefix -> (allowed candidates, visit count per candidate) of every expanded node
    visits: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = field(default_factory=dict)
    pipeline: Pipeline | None = None        # with pipelines at the root: the best pipeline seen
    pipeline_outcome: Outcome | None = None

    @property
    def pipeline_wins(self) -> bool:
        """Did the best pipeline seen rank above the best per-group choice?"""
        return self.pipeline_outcome is not None and (
            self.outcome is None or self.pipeline_outcome.rank > self.outcome.rank)


@dataclass
class _Node:
    depth: int                                  # number of decided groups
    prefix: tuple[int, ...]                     # candidate per decided group, in decision order
    allowed: list[int]                          # candidate indices for the group decided here
    prior: np.ndarray                           # prior over allowed
    visits: np.ndarray                          # per child
    value_sum: np.ndarray                       # per child
    children: dict[int, "_Node"] = field(default_factory=dict)   # position in allowed -> child node
    total_visits: int = 0


def _softmax_of_values(values: Sequence[float], temperature: float = 0.25) -> np.ndarray:
    """Softmax of VALUES normalised by the best (the uniform-value prior's formula)."""
    values = np.asarray(values, dtype=np.float64)
    best = max(values.max(), 1e-9)
    z = (values / best) / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


def uniform_prior(env: SearchEnv, order: Sequence[int], prefix: tuple[int, ...], allowed: Sequence[int]) -> np.ndarray:
    """Equal probability for every allowed candidate."""
    return np.full(len(allowed), 1.0 / len(allowed))


def uniform_value_prior(env: SearchEnv, order: Sequence[int], prefix: tuple[int, ...], allowed: Sequence[int],
                        temperature: float = 0.25) -> np.ndarray:
    """Softmax of the uniform strategies' values (simulated, cached) over ALLOWED."""
    return _softmax_of_values([env.evaluate(env.uniform_choice(k)).value for k in allowed], temperature)


def complete(env: SearchEnv, order: Sequence[int], prefix: Sequence[int]) -> Choice:
    """The full choice of a partial one: undecided groups follow the first decision."""
    first = prefix[0]
    choice = list(env.uniform_choice(first))
    for g, k in zip(order, prefix, strict=False):      # the prefix decides ORDER's first len(PREFIX) groups
        choice[g] = k
    return tuple(choice)


def mcts(env: SearchEnv, *, order: str | Sequence[int] = "auto", playouts: int | None = None,
         budget_s: float | None = None, seed: int = 0, prior: PriorFn | None = None,
         progress: Callable | None = None, start: Choice | None = None,
         c_puct: float = C_PUCT, keep_visits: bool = False, pipelines: PipelineRoots | None = None,
         admit_pipeline: Callable[[Pipeline], bool] | None = None) -> TreeResult:
    """Run the tree search on ENV (module docstring); stops after PLAYOUTS or BUDGET_S, whichever first.

    ``order``: a decision-order name (``tag.search.orders``) or an explicit list of group indices.
    ``start``: a choice already known to be good (for example the best uniform one), evaluated first so
    that the best seen is never worse than it.
    ``keep_visits``: return every expanded node's visit counts in ``TreeResult.visits`` (self-play
    training targets for the GNN policy of ``tag.gnn``).
    ``pipelines``: pipelines as root candidates with per-stage actions below them (module docstring).
    ``admit_pipeline``: which pipelines may be ``TreeResult.pipeline`` (the others are still searched below;
    ``tag.search.driver.pipeline_admitted``); None admits every one.
    """
    if isinstance(order, str):
        order = decision_order(order, env.graph, env.topology, env.grouping, env.cost_model, env.batch_size)
    order = [int(g) for g in order]
    if playouts is None and budget_s is None:
        playouts = 400
    roots = pipelines if pipelines is not None and len(pipelines) else None
    default_prior = prior is None
    if prior is None:
        # the uniform-value prior depends only on the allowed set: computed once per distinct set
        by_allowed: dict[tuple[int, ...], np.ndarray] = {}

        def prior(env: SearchEnv, order, prefix, allowed) -> np.ndarray:
            key = tuple(allowed)
            if key not in by_allowed:
                by_allowed[key] = uniform_value_prior(env, order, prefix, allowed)
            return by_allowed[key]
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    best_choice, best_outcome = None, None
    best_pipeline, best_pipeline_outcome = None, None
    failed = Outcome(float("inf"), False, -1.0, float("inf"))     # a pipeline the rewriter would refuse

    def consider(choice: Choice) -> Outcome:
        nonlocal best_choice, best_outcome
        out = env.evaluate(choice)
        if best_outcome is None or out.rank > best_outcome.rank:
            best_choice, best_outcome = choice, out
        return out

    def consider_pipeline(pipeline: Pipeline) -> Outcome:
        nonlocal best_pipeline, best_pipeline_outcome
        out = env.evaluate_pipeline(pipeline) or failed
        if (best_pipeline_outcome is None or out.rank > best_pipeline_outcome.rank) and (
                out is failed or admit_pipeline is None or admit_pipeline(pipeline)):
            best_pipeline, best_pipeline_outcome = pipeline, out
        return out

    def evaluate_prefix(prefix: tuple[int, ...]) -> Outcome:
        i = PipelineRoots.index(prefix)
        if i is None:
            return consider(complete(env, order, prefix))
        return consider_pipeline(roots.build(i, prefix[1:]))

    def is_leaf(prefix: tuple[int, ...]) -> bool:
        i = PipelineRoots.index(prefix)
        return len(prefix) == (n_groups if i is None else 1 + roots.depth(i))

    if start is not None:
        consider(tuple(start))
    elif roots is not None:          # a per-group answer even if every playout goes to the pipelines
        consider(env.uniform_choice(env.allowed[order[0]][0]))

    def new_node(depth: int, prefix: tuple[int, ...]) -> _Node:
        i = PipelineRoots.index(prefix)
        if i is not None:           # a pipeline's stage level: its own action first, a uniform prior
            allowed = roots.allowed(i, depth - 1)
            p = np.full(len(allowed), 1.0 / len(allowed))
            return _Node(depth, prefix, allowed, p, np.zeros(len(allowed)), np.zeros(len(allowed)))
        group = order[depth]
        allowed = list(env.allowed[group])
        p = np.asarray(prior(env, order, prefix, allowed), dtype=np.float64)
        p = p / p.sum() if p.sum() > 0 else np.full(len(allowed), 1.0 / len(allowed))
        if depth == 0 and roots is not None:
            pipe_values = [consider_pipeline(roots.build(j, ())).value for j in range(len(roots))]
            if default_prior:
                p = _softmax_of_values([env.evaluate(env.uniform_choice(k)).value for k in allowed] + pipe_values)
            else:
                share = len(allowed) / (len(allowed) + len(roots))
                p = np.concatenate([p * share, _softmax_of_values(pipe_values) * (1.0 - share)])
            allowed = allowed + [PipelineRoots.key(j) for j in range(len(roots))]
        return _Node(depth, prefix, allowed, p, np.zeros(len(allowed)), np.zeros(len(allowed)))

    root = new_node(0, ())
    done, deepest = 0, 0
    n_groups = len(order)
    while True:
        if playouts is not None and done >= playouts:
            break
        if budget_s is not None and time.perf_counter() - t0 >= budget_s:
            break
        best_value = max((o.value for o in (best_outcome, best_pipeline_outcome) if o is not None), default=0.0)
        scale = max(best_value, 1e-9) if best_value > 0 else 1.0
        node, path = root, []
        while True:
            parent_q = (node.value_sum.sum() / node.visits.sum()) if node.visits.sum() > 0 else 0.0
            q = np.where(node.visits > 0, node.value_sum / np.maximum(node.visits, 1), parent_q - FPU_REDUCTION)
            u = c_puct * node.prior * math.sqrt(node.total_visits + 1) / (1.0 + node.visits)
            score = q + u + rng.random(len(q)) * 1e-9
            pick = int(np.argmax(score))
            path.append((node, pick))
            child = node.children.get(pick)
            prefix = node.prefix + (node.allowed[pick],)
            if child is None or node.visits[pick] == 0 or is_leaf(prefix):
                break
            node = child
        out = evaluate_prefix(prefix)
        value = out.value / scale if out.value > 0 else out.value
        if not is_leaf(prefix) and pick not in node.children:
            node.children[pick] = new_node(len(prefix), prefix)
            deepest = max(deepest, len(prefix))
        for n, k in path:
            n.visits[k] += 1
            n.value_sum[k] += value
            n.total_visits += 1
        done += 1
        if progress is not None:
            progress(done, playouts, time.perf_counter() - t0,
                     best_pipeline_outcome if best_outcome is None or (
                         best_pipeline_outcome is not None and best_pipeline_outcome.rank > best_outcome.rank)
                     else best_outcome)
    visits: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = {}
    stack = [root] if keep_visits else []
    while stack:
        node = stack.pop()
        visits[node.prefix] = (list(node.allowed), node.visits.copy())
        stack.extend(node.children.values())
    return TreeResult(best_choice, best_outcome, done, time.perf_counter() - t0, order, deepest, visits,
                      best_pipeline, best_pipeline_outcome)
