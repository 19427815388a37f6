"""Pipelines at the root of the tree search: each one a root candidate beside the per-group candidates,
with one tree level per stage below it that chooses the stage's action.

``tag.search.mcts`` decides one op group per level. With ``PipelineRoots``, the root also has one child
per pipeline (its stages, micro-batches and schedule as ``tag.search.pipeline_dp`` found them); below such a
child, level s chooses stage s's action (where it runs and how it replicates: an ``allreduce`` or ``ps``
candidate action of the search environment), the pipeline's own action first. A node is completed as the
per-group nodes are: undecided stages keep the pipeline's own action. So per-group strategies and
pipelines compete for the same playouts, scored by the same simulator (``SearchEnv.evaluate`` and
``SearchEnv.evaluate_pipeline``), and the search spends its playouts where the values are.

Prefixes (the tree's node keys) of the pipeline subtrees start with ``-(i + 1)`` for pipeline i; the
entries after it index ``PipelineRoots.options``.

Example::

    from tag.search.env import SearchEnv
    from tag.search.mcts import mcts
    from tag.search.pipeline_dp import pipeline_dp
    from tag.search.pipeline_tree import PipelineRoots
    env = SearchEnv(tg, topo, grouping)
    roots = PipelineRoots.of(env, pipeline_dp(env))
    tree = mcts(env, playouts=300, pipelines=roots)
    tree.pipeline, tree.pipeline_outcome, tree.pipeline_wins
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tag.strategy.pipeline import STAGE_MODES, Pipeline, PipelineStage
from tag.strategy.types import Action

if TYPE_CHECKING:  # pragma: no cover
    from tag.search.env import SearchEnv
    from tag.search.pipeline_dp import PipelineSearchResult

ROOT_PIPELINES = 4        # the best distinct pipelines of the pipeline search put at the root


@dataclass
class PipelineRoots:
    """The pipelines at the root and the stage actions the levels below them choose from."""

    pipelines: list[Pipeline]
    options: list[Action]          # stage actions: every pipeline's own ones, then the env's allreduce/ps ones

    @classmethod
    def of(cls, env: "SearchEnv", found: "PipelineSearchResult | None", count: int = ROOT_PIPELINES
           ) -> "PipelineRoots":
        """The COUNT best distinct feasible pipelines FOUND simulated (its answer first), with ENV's
        candidate actions that can run a stage."""
        pipelines: list[Pipeline] = []
        if found is not None and found.strategy is not None:
            pipelines.append(found.strategy.pipeline)
            ranked = sorted((t for t in found.tried if t[2].feasible), key=lambda t: t[2].rank, reverse=True)
            for p, _, _ in ranked:
                if len(pipelines) >= count:
                    break
                if p not in pipelines:
                    pipelines.append(p)
        return cls.over(env, pipelines[:count])

    @classmethod
    def over(cls, env: "SearchEnv", pipelines: list[Pipeline]) -> "PipelineRoots":
        """PIPELINES at the root; stage actions: theirs, then ENV's ``allreduce`` and ``ps`` candidates."""
        options: list[Action] = []
        for p in pipelines:
            for st in p.stages:
                if st.action() not in options:
                    options.append(st.action())
        for c in env.candidates:
            if c.action.mode in STAGE_MODES and c.action not in options:
                options.append(c.action)
        return cls(list(pipelines), options)

    def __len__(self) -> int:
        return len(self.pipelines)

    @staticmethod
    def key(index: int) -> int:
        """The root-level entry of pipeline INDEX in a prefix."""
        return -(index + 1)

    @staticmethod
    def index(prefix: tuple[int, ...]) -> int | None:
        """The pipeline a prefix descends into, or None for a per-group prefix."""
        return -prefix[0] - 1 if prefix and prefix[0] < 0 else None

    def depth(self, index: int) -> int:
        """Levels below pipeline INDEX's root child: one per stage."""
        return self.pipelines[index].num_stages

    def allowed(self, index: int, stage: int) -> list[int]:
        """Option indices stage STAGE of pipeline INDEX may take, its own action first."""
        own = self.options.index(self.pipelines[index].stages[stage].action())
        return [own] + [k for k in range(len(self.options)) if k != own]

    def build(self, index: int, decided: tuple[int, ...]) -> Pipeline:
        """Pipeline INDEX with stage s running option DECIDED[s] (later stages keep their own action)."""
        p = self.pipelines[index]
        stages = []
        for s, st in enumerate(p.stages):
            a = self.options[decided[s]] if s < len(decided) else st.action()
            stages.append(PipelineStage(st.groups, a.placement, a.mode, a.ps_device))
        return Pipeline(tuple(stages), p.micro_batches, p.schedule)
