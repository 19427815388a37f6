"""scripts/results_pages.py: the committed results pages and the README's headline table are exactly what the
committed JSON gives, and a changed figure, a JSON without provenance or one no page cites makes --check fail."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "results_pages.py")
MEASURED = os.path.join(REPO, "docs", "measured")
TIMEOUT_S = 120


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture
def copy(tmp_path):
    """The measured JSON, the pages and the README copied under TMP_PATH as in the repository."""
    shutil.copytree(MEASURED, tmp_path / "docs" / "measured")
    shutil.copytree(os.path.join(REPO, "docs", "results"), tmp_path / "docs" / "results")
    shutil.copy(os.path.join(REPO, "README.md"), tmp_path / "README.md")
    return tmp_path


def on(copy, *extra: str) -> subprocess.CompletedProcess:
    return run("--measured", str(copy / "docs" / "measured"), "--out", str(copy / "docs" / "results"),
               "--readme", str(copy / "README.md"), *extra)


def test_the_committed_pages_are_what_the_json_gives():
    done = run("--check")
    assert done.returncode == 0, done.stderr


def test_a_changed_figure_fails_the_check_naming_the_pages(copy):
    assert on(copy, "--check").returncode == 0
    path = copy / "docs" / "measured" / "e2e" / "e2e_g5_amd_run55.json"
    data = json.loads(path.read_text())
    data["rows"][0]["tuned_s"] *= 1.5                         # the VGG-style CNN's kept plan, 50% slower
    path.write_text(json.dumps(data, indent=2))
    done = on(copy, "--check")
    assert done.returncode == 1
    assert "e2e.md differs" in done.stderr and "README.md differs" in done.stderr
    assert "fidelity.md" not in done.stderr                   # pages of other JSON are untouched
    assert on(copy).returncode == 0                            # regenerated, the copy matches again
    assert on(copy, "--check").returncode == 0
    headline = (copy / "README.md").read_text()
    assert "worst 0.84x, vgg" in headline and "worst 0.93x, vgg" in headline   # the new worst cases


def test_a_result_without_provenance_fails_the_check(copy):
    path = copy / "docs" / "measured" / "pipeline" / "bench_pipeline_run33.json"
    data = json.loads(path.read_text())
    del data["provenance"]["command"]
    path.write_text(json.dumps(data))
    done = on(copy, "--check")
    assert done.returncode == 1 and "bench_pipeline_run33.json: no provenance" in done.stderr


def test_a_result_no_page_cites_fails_the_check(copy):
    shutil.copy(copy / "docs" / "measured" / "ir" / "bench_ir_bert_large.json",
                copy / "docs" / "measured" / "ir" / "bench_ir_other.json")
    done = on(copy, "--check")
    assert done.returncode == 1 and "bench_ir_other.json: no page cites it" in done.stderr


def test_every_result_json_records_its_commit_command_and_load():
    for root, _, files in os.walk(MEASURED):
        for name in files:
            if name.endswith(".json") and not name.endswith(".profile.json"):
                with open(os.path.join(root, name)) as f:
                    prov = json.load(f).get("provenance")
                assert isinstance(prov, dict), name
                assert all(isinstance(prov.get(k), str) and prov[k]
                           for k in ("commit", "command", "load_average")), name
