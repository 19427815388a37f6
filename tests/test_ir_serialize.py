"""tag.ir.serialize: a saved training graph reads back equal, costs the same, and bad files get a clear error."""
from __future__ import annotations

import gzip
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tag  # noqa: E402
from tag.cost.model import CostModel  # noqa: E402
from tag.ir.serialize import (  # noqa: E402
    FORMAT_VERSION,
    load_training_graph,
    save_training_graph,
    training_graph_from_dict,
    training_graph_to_dict,
)
from tiny import TINY_ZOO_OPTIONS, make_topology  # noqa: E402


@pytest.fixture(scope="module")
def transformer_ir():
    """A real analysed graph with every kind of field: unknown batch axes, colocation, slots, attrs."""
    return tag.analyze(tag.zoo.training_graph("transformer", batch_size=4, **TINY_ZOO_OPTIONS["transformer"]))


@pytest.mark.parametrize("name", ["g.ir.json", "g.ir.json.gz"])
def test_saved_graph_reads_back_equal_and_costs_the_same(tmp_path, transformer_ir, name):
    path = tmp_path / name
    save_training_graph(transformer_ir, path)
    back = load_training_graph(path)
    assert back == transformer_ir
    assert back.op_index == transformer_ir.op_index
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-B", 1)])])
    for batch in (1.0, 3.0):
        np.testing.assert_array_equal(CostModel(back, topo).op_times(0, batch),
                                      CostModel(transformer_ir, topo).op_times(0, batch))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_compressed_file_is_gzip_and_plain_json(tmp_path, transformer_ir):
    path = tmp_path / "g.ir.json.gz"
    save_training_graph(transformer_ir, path)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    assert data["format"] == "tag-training-graph" and data["version"] == FORMAT_VERSION
    assert len(data["ops"]) == len(transformer_ir.ops)


def test_bad_files_get_an_error_naming_them(tmp_path, transformer_ir):
    garbage = tmp_path / "garbage.ir.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match="garbage.ir.json: cannot read"):
        load_training_graph(garbage)
    other = tmp_path / "other.ir.json"
    other.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="other.ir.json: not a saved tag training graph"):
        load_training_graph(other)
    data = training_graph_to_dict(transformer_ir)
    with pytest.raises(ValueError, match="format version 99"):
        training_graph_from_dict({**data, "version": 99})
    del data["ops"][0]["flops"]
    with pytest.raises(ValueError, match="malformed saved training graph"):
        training_graph_from_dict(data)
