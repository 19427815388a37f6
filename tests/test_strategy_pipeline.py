"""Pipeline data types: schedules, validation, JSON and proto round trips (tag/strategy/pipeline.py)."""
import numpy as np
import pytest

from tag.errors import StrategyError
from tag.strategy.pipeline import Pipeline, PipelineStage, max_in_flight, pipeline_schedule
from tag.strategy.types import Action, Grouping, Strategy


def _grouping(n=5):
    return Grouping(np.arange(n), [f"g{i}" for i in range(n)])


@pytest.mark.parametrize("kind", ["fill_drain", "1f1b"])
@pytest.mark.parametrize("stages,m", [(1, 1), (2, 3), (3, 4), (4, 2), (4, 8)])
def test_every_stage_runs_each_forward_before_its_backward(kind, stages, m):
    for steps in pipeline_schedule(stages, m, kind):
        assert sorted(steps) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        for i in range(m):
            assert steps.index(("F", i)) < steps.index(("B", i))


def test_1f1b_holds_at_most_the_remaining_stages_in_flight():
    assert [max_in_flight(s) for s in pipeline_schedule(3, 8, "1f1b")] == [3, 2, 1]
    assert [max_in_flight(s) for s in pipeline_schedule(3, 8, "fill_drain")] == [8, 8, 8]


def test_round_trips_and_old_strategies_load():
    p = Pipeline((PipelineStage((0, 1, 2), (0,)), PipelineStage((3, 4), (1, 2), "ps", 3)), 4, "fill_drain")
    s = Strategy.pipelined(_grouping(), p)
    assert s.actions[4] == Action((1, 2), "ps", 3)
    assert Strategy.from_json(s.to_json()).to_dict() == s.to_dict()
    assert Strategy.from_proto(s.to_proto().SerializeToString()).to_dict() == s.to_dict()
    old = Strategy(_grouping(), [Action((0,))] * 5)
    assert "pipeline" not in old.to_dict()
    assert Strategy.from_proto(old.to_proto().SerializeToString()).pipeline is None
    assert p.bubble_fraction() == pytest.approx(1 / 5)


def test_bad_pipelines_are_rejected_with_the_stage_named():
    with pytest.raises(StrategyError, match="op group 2 is in no stage"):
        Strategy.pipelined(_grouping(), Pipeline((PipelineStage((0, 1), (0,)), PipelineStage((3, 4), (1,))), 2))
    with pytest.raises(StrategyError, match="stage 1: op group 1 is already"):
        Pipeline((PipelineStage((0, 1), (0,)), PipelineStage((1, 2), (1,))), 2)
    with pytest.raises(StrategyError, match="schedule"):
        Pipeline((PipelineStage((0,), (0,)),), 2, "zigzag")
    p = Pipeline((PipelineStage((0, 1, 2), (0,)), PipelineStage((3, 4), (1,))), 2)
    with pytest.raises(StrategyError, match="op group 3"):
        Strategy(_grouping(), [Action((0,))] * 5, pipeline=p)


def test_one_micro_batch_on_the_same_devices_is_a_pipeline_in_name_only():
    stages = (PipelineStage((0, 1), (0, 1, 2), "ps", ps_device=0), PipelineStage((2, 3), (0, 1, 2)))
    assert Pipeline(stages, 1, "deferred_w").in_name_only
    assert not Pipeline(stages, 2).in_name_only                       # micro-batches overlap
    apart = (PipelineStage((0, 1), (0,)), PipelineStage((2, 3), (1, 2)))
    assert not Pipeline(apart, 1).in_name_only                        # stages on other devices


def test_stages_on_the_same_devices_are_on_one_placement_whatever_the_micro_batches():
    same = (PipelineStage((0, 1), (0, 1), "ps", ps_device=0), PipelineStage((2, 3), (0, 1)))
    assert Pipeline(same, 1).on_one_placement and Pipeline(same, 4, "1f1b").on_one_placement
    assert not Pipeline((PipelineStage((0, 1), (0, 1)), PipelineStage((2, 3), (0,))), 4).on_one_placement
