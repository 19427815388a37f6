"""scripts/fuzz_inputs.py on a fixed small sample: every malformed input is a clean one-line exit 2."""
from __future__ import annotations

import json

from helpers import load_script

fuzz_inputs = load_script("fuzz_inputs")


def test_generator_makes_enough_distinct_cases(tmp_path):
    cases = fuzz_inputs.all_cases(str(tmp_path))
    assert len(cases) >= 200
    assert len({c.name for c in cases}) == len(cases)
    kinds = {c.name.split("/")[1].split("-")[0] for c in cases}
    for kind in ("truncated", "empty", "cycle", "unknown", "forward", "topology", "graphdef", "fifo", "huge"):
        assert any(k.startswith(kind) for k in kinds), kind


def test_fixed_sample_is_all_clean_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("TAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "fuzz.json"
    rc = fuzz_inputs.main(["--sample", "40", "--subprocess", "1", "--json", str(out)])
    summary = json.loads(out.read_text())
    assert summary["inputs"] == 41 and summary["subprocess_cases"] == 1
    assert summary["tracebacks"] == 0 and summary["hangs"] == 0, summary["failures"]
    assert summary["clean_errors"] == summary["inputs"], summary["failures"]
    assert rc == 0
    command = f"python scripts/fuzz_inputs.py --sample 40 --subprocess 1 --json {out}"
    assert summary["provenance"]["command"] == command
