"""Strategy data types: batch shares and serialisation."""
import numpy as np
import pytest

from tag.errors import StrategyError
from tag.strategy.types import Action, Grouping, Strategy, batch_shares


def test_batch_shares_proportional_and_exact():
    assert batch_shares([1, 1], 10) == [5, 5]
    assert batch_shares([3, 1], 8) == [6, 2]
    s = batch_shares([15.7, 11.3, 9.3], 64)
    assert sum(s) == 64 and s[0] > s[1] > s[2]


def test_batch_shares_at_least_one_each():
    s = batch_shares([1000, 1, 1], 3)
    assert s == [1, 1, 1]
    with pytest.raises(StrategyError):
        batch_shares([1, 1, 1], 2)


def test_strategy_json_round_trip():
    g = Grouping(np.array([0, 0, 1]), ["a", "b"])
    s = Strategy(g, [Action((1, 0), "allreduce"), Action((0,), "ps", ps_device=0)], sfb=["w"])
    t = Strategy.from_json(s.to_json())
    assert t.actions == s.actions and t.actions[0].placement == (0, 1)
    assert list(t.grouping.group_of_op) == [0, 0, 1] and t.sfb == ["w"]


def test_bucket_bytes_round_trips_through_json_and_protobuf_and_is_validated():
    g = Grouping(np.array([0, 0, 1]), ["a", "b"])
    acts = [Action((0, 1), "allreduce"), Action((0, 1), "allreduce")]
    s = Strategy(g, acts, bucket_bytes=2 ** 20)
    assert Strategy.from_json(s.to_json()).bucket_bytes == 2.0 ** 20
    assert Strategy.from_proto(s.to_proto().SerializeToString()).bucket_bytes == 2.0 ** 20
    plain = Strategy(g, acts)           # the default: absent from JSON, 0 in the message, None either way back
    assert "bucket_bytes" not in plain.to_dict()
    assert Strategy.from_proto(plain.to_proto()).bucket_bytes is None
    assert Strategy.from_dict({k: v for k, v in s.to_dict().items() if k != "bucket_bytes"}).bucket_bytes is None
    for bad in (0, -1.0, float("nan"), float("inf"), True, "16MB"):
        with pytest.raises(StrategyError, match="bucket_bytes"):
            Strategy(g, acts, bucket_bytes=bad)


def test_action_validation():
    with pytest.raises(StrategyError):
        Action((), "allreduce")
    with pytest.raises(StrategyError):
        Action((0,), "ps")
