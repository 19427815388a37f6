"""tag.options.SearchOptions: each field checked once with a one-line message, keywords and the object search
alike, and tag-deploy's flags go through the same checks (exit 2, one line naming the flag)."""
from __future__ import annotations

import os

import pytest

import tag
from tag.cli.deploy import main as deploy_main
from tag.errors import OptionError, TagError
from tag.options import SearchOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")


@pytest.mark.parametrize("field, value, message", [
    ("budget_s", 0.0, "budget_s must be a positive number of seconds, got 0"),
    ("budget_s", float("inf"), "budget_s must be a positive number of seconds, got inf"),
    ("playouts", 0, "playouts must be a positive number of playouts, got 0"),
    ("playouts", 2.5, "playouts must be a positive number of playouts, got 2.5"),
    ("order", "sideways", "unknown order 'sideways' (known: auto, cost_descending"),
    ("seed", -1, "seed must be a non-negative integer, got -1"),
    ("prior", "oracle", "unknown prior 'oracle' (known: uniform, gnn)"),
    ("sfb", "yes", "sfb must be True or False, got 'yes'"),
    ("pipeline", 1, "pipeline must be True or False, got 1"),
    ("min_gain", -0.1, "min_gain must be between 0 and 10 (a fraction: 0.05 = 5%), got -0.1"),
    ("min_gain", 10, "min_gain must be between 0 and 10"),
    ("mixed_min_gain", float("nan"), "mixed_min_gain must be between 0 and 10 (a fraction: 0.10 = 10%), got nan"),
    ("tune_k", 0, "tune_k must be a positive number of candidates to measure, got 0"),
    ("tune_k", True, "tune_k must be a positive number of candidates to measure, got True"),
])
def test_a_bad_field_is_one_line_naming_it(field, value, message):
    with pytest.raises(OptionError) as err:
        SearchOptions(**{field: value})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert err.value.field == field and isinstance(err.value, TagError)
    assert err.value.named("--flag").startswith(message.replace(field, "--flag", 1))


def test_the_defaults_and_the_edges_of_each_range_are_accepted():
    o = SearchOptions()
    assert (o.budget_s, o.playouts, o.order, o.seed, o.prior, o.tune_k) == (None, None, "auto", 0, "uniform", None)
    assert o.sfb and o.pipeline and o.fuse_buckets and o.min_gain == 0.05 and o.mixed_min_gain == 0.10
    SearchOptions(budget_s=0.5, playouts=1, order="bfs", seed=7, prior="gnn", min_gain=0, mixed_min_gain=9.99,
                  tune_k=1)


def test_keywords_replace_fields_and_none_keeps_them():
    base = SearchOptions(playouts=40, seed=3)
    assert SearchOptions.of(base, seed=5) == SearchOptions(playouts=40, seed=5)
    assert SearchOptions.of(base, seed=None, min_gain=None) is base
    assert SearchOptions.of(None, playouts=8) == SearchOptions(playouts=8)
    with pytest.raises(OptionError, match="playouts must be a positive number"):
        SearchOptions.of(base, playouts=-3)                      # a keyword is checked like a field
    with pytest.raises(TypeError, match="unexpected keyword argument 'budget'"):
        SearchOptions.of(budget=3)
    with pytest.raises(OptionError, match="options must be a tag.SearchOptions, got dict"):
        SearchOptions.of({"playouts": 3})


def test_optimize_refuses_a_bad_option_before_reading_the_graph():
    with pytest.raises(OptionError, match="mixed_min_gain must be between 0 and 10"):
        tag.optimize(b"not a graph", LOCALHOST, mixed_min_gain=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'playout'"):
        tag.optimize(b"not a graph", LOCALHOST, playout=3)


def test_keywords_and_the_options_object_make_the_same_plan():
    gd = tag.zoo.training_graph("mlp", batch_size=12, input_dim=64, hidden=(128, 128))
    by_keywords = tag.optimize(gd, LOCALHOST, playouts=12, seed=4, order="topological", mixed_min_gain=0.0)
    opts = SearchOptions(playouts=12, seed=4, order="topological", mixed_min_gain=0.0)
    by_object = tag.optimize(gd, LOCALHOST, options=opts)
    assert by_object.strategy.to_dict() == by_keywords.strategy.to_dict()
    assert by_object.predicted_step_time == by_keywords.predicted_step_time
    assert by_object.report()["search"] == by_keywords.report()["search"] == \
        {"order": "topological", "seed": 4, "playouts": 12, "budget_s": None}
    # a keyword beside the object wins over its field
    overridden = tag.optimize(gd, LOCALHOST, options=opts, seed=9)
    assert overridden.report()["search"]["seed"] == 9


@pytest.mark.parametrize("flags, message", [
    (["--playouts", "0"], "--playouts must be a positive number of playouts, got 0"),
    (["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    (["--min-gain", "10"], "--min-gain must be between 0 and 10 (a fraction: 0.05 = 5%), got 10"),
    (["--order", "sideways"], "unknown --order 'sideways' (known: auto, cost_descending"),
    (["--run", "--tune", "many"], "--tune must be a positive number of candidates to measure, got 'many'"),
])
def test_tag_deploy_words_the_options_message_with_its_flag(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("TAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc = deploy_main(["--topo", LOCALHOST, "--model", "zoo:mlp", *flags, "--report", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"tag-deploy: error: {message}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()
