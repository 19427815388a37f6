"""scripts/bench_e2e.py without a testbed: its summary keys, the README table of saved runs, what counts as a
mixed win, how steps are timed and in what order the two sides run."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import load_script


def _saved_row(case: str, plan_s: float) -> dict:
    """One bench_e2e row as --json saves it (the keys summary() and markdown_table() read)."""
    return {"config": "G", "case": case, "batch": 48, "mwms_s": {"1": 0.1, "2": 0.2, "3": 0.3}, "mwms_best_s": 0.1,
            "mwms_best_hosts": 1, "uniform_s": 0.1, "uniform": "one device on h0", "dp_same_s": 0.1,
            "dp_same_over_mwms": 1.0, "plan_s": plan_s,
            "plan_method": "pipeline", "plan_is_uniform": False, "plan": "[h0 | h1] M=4", "tuned_s": plan_s,
            "tuned_method": "pipeline", "tuned_is_uniform": False, "tuned": "[h0 | h1] M=4",
            "speedup_vs_best_mwms": 0.1 / plan_s, "speedup_vs_mwms": 0.3 / plan_s, "dp_over_mwms": 1.0,
            "plan_speedup_vs_best_mwms": 0.1 / plan_s, "tune_seconds": 10.0, "load": [1.0, 1.0, 1.0]}


def test_the_readme_table_shows_both_anchors():
    """--table renders a row with both MWMS anchors and the mixed win."""
    row = {**_saved_row("vgg", 0.08), "uniform_s": 0.12, "dp_same_s": 0.11, "plan_method": "mcts",
           "tuned_method": "mcts", "mixed_over_uniform": 1.5, "mixed_win": True, "tuned": "allreduce@h0+h1 x9",
           "load": [3.0, 3.0, 3.0]}
    assert (row["speedup_vs_best_mwms"], row["speedup_vs_mwms"]) == pytest.approx((1.25, 3.75))
    table = load_script("bench_e2e").markdown_table({"rows": [row]})
    assert "| G | vgg (48) | 100 / 200 / 300 | 100 (1) |" in table and "1.50 (win)" in table


def test_an_mwms_anchor_that_failed_is_named_and_left_out_of_the_all_hosts_keys():
    """MWMS that failed on all three hosts: the row's table says "failed" there and n/a against it; the best
    MWMS is of the prefixes that ran, and the all-hosts keys average over the other cases."""
    bench_e2e = load_script("bench_e2e")
    failed = {**_saved_row("deep-mlp", 0.05), "mwms_s": {"1": 0.1, "2": 0.2, "3": None},
              "mwms_failed": {"3": "MWMS chief failed (rc 1): heartbeat timeout"}, "speedup_vs_mwms": None,
              "dp_over_mwms": None}
    other = {**_saved_row("vgg", 0.1), "dp_over_mwms": 2.0}
    s = bench_e2e.summary([failed, other])
    assert s["geomean_speedup_vs_mwms"] == pytest.approx(3.0) and s["dp_over_mwms"] == pytest.approx(2.0)
    assert s["geomean_speedup_vs_best_mwms"] == pytest.approx((2.0 * 1.0) ** 0.5)
    table = bench_e2e.markdown_table({"rows": [failed]})
    assert "| G | deep-mlp (48) | 100 / 200 / failed | 100 (1) |" in table and "| 2.00x | n/a |" in table
    assert bench_e2e.summary([failed])["geomean_speedup_vs_mwms"] is None


def test_bucketed_data_parallelism_is_a_uniform_action_not_a_mixed_win():
    """Data parallelism with its gradient buckets sized is still one action for every op group: neither a saved
    row that flagged it mixed nor a strategy compared by ``action_key`` counts it as a mixed win."""
    bench_e2e = load_script("bench_e2e")
    row = {**_saved_row("cnn", 0.1), "uniform": "allreduce@h0+h1+h2 x25", "uniform_s": 0.13,
           "plan": "allreduce@h0+h1+h2 x25 (256 KB buckets)", "tuned": "allreduce@h0+h1+h2 x25 (256 KB buckets)"}
    assert bench_e2e.summary([row])["mixed_wins"] == 0 and row["mixed_over_uniform"] is None
    mixed = {**row, "plan": "allreduce@h0+h1+h2 x12, allreduce@h0 x13 (256 KB buckets)", "tuned_is_uniform": True}
    assert bench_e2e.summary([mixed])["mixed_wins"] == 1 and mixed["mixed_over_uniform"] == pytest.approx(1.3)
    from tag.strategy.types import Action, Grouping, Strategy
    grouping = Grouping(np.array([0, 0, 1]), ["a", "b"])
    dp = Strategy(grouping, [Action((0, 1), "allreduce")] * 2, name="dp")
    bucketed = Strategy(grouping, [Action((0, 1), "allreduce")] * 2, name="dp", bucket_bytes=256 * 1024)
    assert bench_e2e.action_key(bucketed) == bench_e2e.action_key(dp)
    assert bench_e2e.strategy_key(bucketed) != bench_e2e.strategy_key(dp)       # different programs all the same


def test_table_combines_the_cases_of_several_runs_and_refuses_a_case_measured_twice(tmp_path, capsys):
    """--table a.json,b.json: one table and summary over both runs' cases, each row naming its run; a case in
    both runs, or a file that is not a saved result, exits 2 with one line."""
    import json
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"commit": "aaa", "seconds": 10.0, "complete": True, "rows": [_saved_row("vgg", 0.05)]}))
    b.write_text(json.dumps({"commit": "bbb", "seconds": 20.0, "complete": True, "rows": [_saved_row("cnn", 0.08)]}))
    out = tmp_path / "both.json"
    assert load_script("bench_e2e").main(["--table", f"{a},{b}", "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert [(r["case"], r["run_commit"]) for r in both["rows"]] == [("vgg", "aaa"), ("cnn", "bbb")]
    assert [r["commit"] for r in both["runs"]] == ["aaa", "bbb"]
    assert both["mixed_wins"] == 2 and both["geomean_speedup_vs_best_mwms"] == pytest.approx((2.0 * 1.25) ** 0.5)
    capsys.readouterr()
    assert load_script("bench_e2e").main(["--table", f"{a},{a}"]) == 2
    assert "vgg at batch 48 is in both" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert load_script("bench_e2e").main(["--table", f"{a},{bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a saved bench_e2e --json result" in err and "\n" not in err
    bad.write_text('{"rows": [{"config": "G"}]}')
    assert load_script("bench_e2e").main(["--table", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a row has no key" in err and "\n" not in err


def test_a_cheap_step_is_timed_for_longer_and_a_costly_one_as_asked():
    """bench_e2e times each program MIN_TIMED_S seconds' worth of steps (at most MAX_TIMED_STEPS, never fewer
    than --steps asks), decided from its first round; the steps are spread evenly over the rounds."""
    bench_e2e = load_script("bench_e2e")
    assert bench_e2e.timed_steps_after_first_round([0.2] * 4, 10, min_timed_s=20.0, max_timed=45) == 45
    assert bench_e2e.timed_steps_after_first_round([0.5, 0.6, 0.5], 10, min_timed_s=20.0, max_timed=45) == 40
    assert bench_e2e.timed_steps_after_first_round([7.0] * 4, 10, min_timed_s=20.0, max_timed=45) == 10
    assert bench_e2e.timed_steps_after_first_round([], 10) == 10
    assert bench_e2e.split_steps(10, 3) == [4, 3, 3] and bench_e2e.split_steps(41, 2) == [21, 20]


def test_mwms_and_tag_take_turns_going_first_in_the_rounds():
    """Neither side of a bench_e2e round always runs right after the other: MWMS first in even rounds."""
    bench_e2e = load_script("bench_e2e")
    firsts = [bench_e2e.round_order(r, ["mwms", "tag"])[0] for r in range(4)]
    assert firsts == ["mwms", "tag", "mwms", "tag"]
    assert sorted(bench_e2e.round_order(1, ["mwms", "tag"])) == ["mwms", "tag"]
