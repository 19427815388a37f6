"""One name per concept across the command-line tools (docs/guide/cli.md, "Names"): the new names parse, each
former name still parses to the same value for a release, and ``--help`` shows only the new names."""
from __future__ import annotations

import json
import os

import pytest

from tag.cli import deploy, profile, topo, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
BASE = {"deploy": ["--topo", LOCALHOST], "profile": []}
PARSERS = {"deploy": deploy._parser, "profile": profile._parser}

# (tool, new name, former name, value, destination)
RENAMED = [
    ("deploy", "--batch-size", "--batch", "12", "batch"),
    ("deploy", "--json", "--report", "r.json", "report"),
    ("deploy", "--logdir", "--tensorboard", "tb", "tensorboard"),
    ("profile", "--batch-size", "--batch", "12", "batch"),
    ("profile", "--json", "--out", "p.json", "out"),
]


@pytest.mark.parametrize("tool, new, old, value, dest", RENAMED)
def test_former_name_sets_the_same_value(tool, new, old, value, dest):
    parse = PARSERS[tool]().parse_args
    by_new, by_old = parse(BASE[tool] + [new, value]), parse(BASE[tool] + [old, value])
    assert vars(by_new) == vars(by_old)
    expected = int(value) if value.isdigit() else value
    assert getattr(by_new, dest) == expected
    assert getattr(parse(BASE[tool]), dest) is None       # neither given: the default, not argparse.SUPPRESS


@pytest.mark.parametrize("tool, new, old, value, dest", RENAMED)
def test_help_shows_only_the_new_name(tool, new, old, value, dest):
    text = PARSERS[tool]().format_help()
    assert f"{new} " in text
    assert f"{old} " not in text and f"{old}," not in text


@pytest.mark.parametrize("parser", [deploy._parser, profile._parser, worker._parser, topo._parser])
def test_no_tool_offers_a_former_name_in_help(parser):
    text = parser().format_help()
    for old in ("--batch ", "--report", "--tensorboard", "--out ", "--batch,"):
        assert old not in text, old


def test_former_names_run_end_to_end(tmp_path, capsys):
    """tag-deploy with the former names writes the same report as with the new ones."""
    argv = ["--topo", LOCALHOST, "--model", "zoo:mlp,input_dim=16,hidden=16", "--strategy", "ps"]
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert deploy.main(argv + ["--batch", "12", "--report", str(old)]) == 0
    assert deploy.main(argv + ["--batch-size", "12", "--json", str(new)]) == 0
    capsys.readouterr()
    old_report, new_report = json.loads(old.read_text()), json.loads(new.read_text())
    assert old_report["batch_size"] == new_report["batch_size"] == 12
