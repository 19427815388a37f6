"""tag_bench.records: every benchmark JSON's provenance (commit, command, load average, date, machine)."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess

from tag_bench.records import Run, command_line, commit_of, git_commit, write_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_e2e.py")


def test_provenance_keys_and_formats(tmp_path):
    path = tmp_path / "out.json"
    run = Run(SCRIPT, ["--quick", "--json", "F"])
    write_json(str(path), {"rows": [1, 2]}, run)
    saved = json.loads(path.read_text())
    assert list(saved) == ["provenance", "rows"] and saved["rows"] == [1, 2]
    p = saved["provenance"]
    assert set(p) == {"commit", "command", "load_average", "date", "machine"}
    assert p["command"] == "python scripts/bench_e2e.py --quick --json F"
    assert re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", p["load_average"])
    assert p["date"] == datetime.date.today().isoformat()
    assert p["machine"].endswith(f", {os.cpu_count()} cores")
    assert p["commit"] == run.commit


def test_commit_is_the_short_head_marked_dirty_when_tracked_files_differ():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=10).stdout.strip()
    commit = git_commit(REPO)
    assert commit in (head, head + "+dirty")
    assert git_commit("/") == "unknown"        # outside a repository


def test_command_quotes_arguments_and_reads_argv_when_none_given(monkeypatch):
    assert command_line(SCRIPT, ["--cases", "a b"]) == "python scripts/bench_e2e.py --cases 'a b'"
    monkeypatch.setattr("sys.argv", ["bench_e2e.py", "--quick"])
    assert command_line(SCRIPT) == "python scripts/bench_e2e.py --quick"


def test_no_path_writes_nothing_and_a_saved_provenance_is_kept(tmp_path):
    run = Run(SCRIPT, [])
    write_json(None, {"rows": []}, run)
    write_json("", {"rows": []}, run)
    assert list(tmp_path.iterdir()) == []
    old = {"provenance": {"commit": "abc1234"}, "rows": []}
    path = tmp_path / "again.json"
    write_json(str(path), old, run)
    assert json.loads(path.read_text())["provenance"] == {"commit": "abc1234"}


def test_commit_of_new_and_older_results():
    assert commit_of({"provenance": {"commit": "abc1234+dirty"}}) == "abc1234+dirty"
    assert commit_of({"commit": "0123456789abcdef"}) == "0123456789abcdef"
    assert commit_of({}) is None
