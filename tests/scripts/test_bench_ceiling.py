"""scripts/bench_ceiling.py without a testbed: the bounded concurrent run of the hosts' shares."""
import pytest

from helpers import load_script

bench_ceiling = load_script("bench_ceiling")


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
