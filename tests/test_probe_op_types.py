"""scripts/probe_op_types.py: a saved profile's op times per op type beside TensorFlow's kernel times."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from probe_op_types import main  # noqa: E402


def test_bad_profile_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    assert main(["--model", "mlp", "--batch", "8", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err


def test_small_mlp_per_type_and_per_op_figures(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--model", "mlp", "--batch", "8", "--width", "32", "--steps", "1", "--warmup", "1",
                 "--detail", "MatMul", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["by_type"]["MatMul"]["predicted_s"] > 0 and data["by_type"]["MatMul"]["measured_s"] > 0
    assert len(data["ops"]) >= 3 * 4 - 1                      # 4 layers: forward, input and weight gradients
    assert {o["attrs"] for o in data["ops"]} >= {"transpose_a=False transpose_b=False"}
    assert data["predicted_s"] > 0 and data["step_s"] > 0
    assert "every MatMul op:" in capsys.readouterr().out
