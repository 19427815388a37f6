"""scripts/probe_host_drift.py: one host's step on a bare CPU, in a testbed host's cgroup, through tag's server, by MWMS."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from probe_host_drift import in_process_steps, keras_steps, main, spread  # noqa: E402


def test_bad_profile_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    assert main(["--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err


def test_bad_rounds_are_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["--rounds", "0"])
    assert exc.value.code == 2


@pytest.mark.parametrize("program, steps_of", [("graph", in_process_steps), ("keras", keras_steps)])
def test_each_program_and_its_child_mode(program, steps_of, capsys):
    """graph: tag's TF1 step in one process; keras: MWMS's tf_keras program without the strategy."""
    times = steps_of("mlp", 8, steps=2, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert main(["--child", program, "--model", "mlp", "--batch", "8", "--steps", "3", "--warmup", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["step_times"]) == 3


def test_spread_is_largest_over_smallest():
    assert spread([2.0, 1.0, 1.5]) == 2.0


@pytest.mark.parametrize("modes", ["cgroup,gpu", "server,server", ""])
def test_bad_modes_are_a_usage_error(modes):
    with pytest.raises(SystemExit) as exc:
        main(["--modes", modes])
    assert exc.value.code == 2
