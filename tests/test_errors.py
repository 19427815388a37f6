"""The CLI plumbing: bad input is one line and exit 2; anything else exit 1."""
from tag.cli.common import run_cli
from tag.errors import TopologyError


def test_bad_input_is_one_line_exit_2(capsys):
    def body(argv):
        raise TopologyError("f.pbtxt:3: bandwidth must be positive\nsecond line")

    assert run_cli("tag-x", body, []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "f.pbtxt:3: bandwidth must be positive second line" in err


def test_unexpected_error_exit_1(capsys):
    def body(argv):
        raise RuntimeError("boom")

    assert run_cli("tag-x", body, []) == 1
    assert "Traceback" not in capsys.readouterr().err
