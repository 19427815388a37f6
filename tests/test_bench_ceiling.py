"""bench_ceiling's arithmetic (no testbed): the batch split by speed and the bounded concurrent run."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_ceiling  # noqa: E402


def test_speed_shares_follow_the_quotas_and_sum_to_the_batch():
    assert bench_ceiling.speed_shares(384, [1.0, 0.5, 0.5]) == [192, 96, 96]
    assert bench_ceiling.speed_shares(10, [1.0, 0.5, 0.5]) == [6, 2, 2]      # the remainder to the fastest
    assert sum(bench_ceiling.speed_shares(97, [0.75, 0.5, 0.25])) == 97


def test_concurrently_reports_a_failed_share_and_never_waits_past_its_deadline(monkeypatch):
    def fake_steps(tb, program, steps):
        if program == "bad":
            raise RuntimeError("worker died")
        return [program] * steps
    monkeypatch.setattr(bench_ceiling, "timed_steps", fake_steps)
    assert bench_ceiling.concurrently(None, [0.1, 0.2], 2) == [[0.1, 0.1], [0.2, 0.2]]
    with pytest.raises(RuntimeError, match="worker died"):
        bench_ceiling.concurrently(None, [0.1, "bad"], 2)
    import threading
    stuck = threading.Event()
    monkeypatch.setattr(bench_ceiling, "timed_steps", lambda tb, program, steps: stuck.wait(5) and [])
    monkeypatch.setattr(bench_ceiling, "JOIN_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="did not finish"):
        bench_ceiling.concurrently(None, [0.1], 1)
    stuck.set()
