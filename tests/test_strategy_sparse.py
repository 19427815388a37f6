"""tag.strategy.sparse: which sparse gradients may be summed as dense tables, and when that pays."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag.frontend import real_graphs as rg  # noqa: E402
from tag.frontend.analyze import analyze  # noqa: E402
from tag.strategy.sparse import dense_sum_pays, sparse_dedups  # noqa: E402


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "momentum"])
def test_deduplicating_updates_are_found_with_their_ids(optimizer):
    ir = analyze(rg.optimizer_graph(optimizer, sparse=True, resource=True, batch_size=16))
    [d] = sparse_dedups(ir).values()
    assert d.variable == "emb" and d.rows == 20 and d.table_bytes == 20 * 6 * 4
    assert d.values_bytes_per_example == 3 * 6 * 4            # three ids per example, six floats a row
    ops = {op.name: op for op in ir.ops}
    assert ops[d.unique_op].type == "Unique" and ops[d.segment_sum_op].type == "UnsortedSegmentSum"
    assert ops[d.unique_op].inputs[0].split(":")[0] == d.indices.split(":")[0]


def test_plain_gradient_descent_and_dense_gradients_are_left_out():
    """SGD scatters its rows without deduplicating them; a dense model has no sparse gradient."""
    assert sparse_dedups(analyze(rg.optimizer_graph("sgd", sparse=True, resource=True, batch_size=16))) == {}
    assert sparse_dedups(analyze(rg.optimizer_graph("adam", sparse=False, resource=True, batch_size=16))) == {}


def test_dense_sum_pays_once_the_rows_outweigh_twice_the_table():
    assert not dense_sum_pays(72.0, 480.0, 13)        # 936 bytes of rows <= 960
    assert dense_sum_pays(72.0, 480.0, 14)            # 1008 > 960
    np.testing.assert_array_equal(dense_sum_pays(np.array([72.0, 72.0]), np.array([480.0, 4800.0]), 14.0),
                                  [True, False])
