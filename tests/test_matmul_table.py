"""tag.cost.matmul_table: the MatMul efficiency table (lookup, JSON), the MatMul shapes of a real graph, and
how the cost model, the fit and the profiler use a table."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tag  # noqa: E402
from tag.cluster.topology import load_topology  # noqa: E402
from tag.cost.fitting import StepMeasurement, fit_profile  # noqa: E402
from tag.cost.matmul_table import (  # noqa: E402
    VARIANTS,
    MatmulTable,
    einsum_as_matmul,
    grid_shapes,
    matmul_dims,
    table_from_rates,
    variant_of,
)
from tag.cost.model import CostModel, DeviceProfile, Profile  # noqa: E402
from tag.errors import TagError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
SIDES = (16, 64, 256)


def _table(nn=0.5, nt=0.1, tn=0.4) -> MatmulTable:
    return MatmulTable(SIDES, {v: np.full((3, 3, 3), e) for v, e in (("nn", nn), ("nt", nt), ("tn", tn))})


@pytest.fixture(scope="module")
def mlp():
    return tag.analyze(tag.zoo.training_graph("mlp", batch_size=32, input_dim=64, hidden=(128, 256)))


def test_lookup_is_exact_on_the_grid_and_log_linear_between_points():
    eff = np.zeros((3, 3, 3))
    eff[:, :, :] = 0.2
    eff[1, :, :] = 0.8                                     # m = 64 is four times as fast as m = 16
    t = MatmulTable(SIDES, {"nn": eff, "nt": eff / 2, "tn": eff})
    nn, nt = VARIANTS.index("nn"), VARIANTS.index("nt")
    got = t.lookup(np.array([nn, nn, nt, nn, nn]), np.array([16, 64, 64, 32, 1e6]), np.array([64, 64, 64, 64, 64]),
                   np.array([64, 64, 64, 64, 64]))
    assert got[0] == pytest.approx(0.2) and got[1] == pytest.approx(0.8) and got[2] == pytest.approx(0.4)
    assert got[3] == pytest.approx(0.4)                    # halfway in log2(m): the geometric mean
    assert got[4] == pytest.approx(0.2)                    # beyond the grid: clamped to its last point


def test_variant_of_transposes():
    assert VARIANTS[variant_of(False, False)] == "nn"
    assert VARIANTS[variant_of(False, True)] == "nt"
    assert VARIANTS[variant_of(True, False)] == "tn"
    assert VARIANTS[variant_of(True, True)] == "nt"


def test_matmul_dims_of_a_real_mlp(mlp):
    dims = matmul_dims(mlp)
    names = [mlp.ops[i].name for i in dims.ops]
    assert len(names) == sum(op.type == "MatMul" for op in mlp.ops) > 0
    by_name = {name: i for i, name in enumerate(names)}
    fwd = next(n for n in names if n.endswith("dense_1/MatMul"))
    dx = next(n for n in names if "dense_1/MatMul_grad/MatMul" in n and not n.endswith("_1"))
    dw = next(n for n in names if n.endswith("dense_1/MatMul_grad/MatMul_1"))
    for batch in (8.0, 32.0):
        m, k, n = dims.at(batch)
        f, x, w = by_name[fwd], by_name[dx], by_name[dw]
        assert VARIANTS[dims.variant[f]] == "nn" and (m[f], k[f], n[f]) == (batch, 128, 256)
        assert VARIANTS[dims.variant[x]] == "nt" and (m[x], k[x], n[x]) == (batch, 256, 128)
        assert VARIANTS[dims.variant[w]] == "tn" and (m[w], k[w], n[w]) == (128, batch, 256)


def test_einsum_as_matmul_places_one_product_and_leaves_batches_of_products():
    nn, nt, tn = (VARIANTS.index(v) for v in VARIANTS)
    assert einsum_as_matmul("abc,cde->abde") == ("ab", "c", "de", nn)        # EinsumDense on [B, S, D]
    assert einsum_as_matmul("abde,cde->abc") == ("ab", "de", "c", nt)        # its input gradient
    assert einsum_as_matmul("abc,abde->cde") == ("c", "ab", "de", tn)        # its weight gradient
    assert einsum_as_matmul("ij, jk -> ik") == ("i", "j", "k", nn)
    assert einsum_as_matmul("ji,jk->ik")[3] == tn                            # A read as [k, m]
    assert einsum_as_matmul("ji,kj->ik")[3] == nt                            # both transposed: costed as nt
    for eq in ("aecd,abcd->acbe",          # attention scores: a batch of products over a and c
               "abc,cd->abd" + "x",        # malformed output label
               "...c,cd->...d",            # ellipsis
               "abc->acb",                 # one operand
               "ab,bc,cd->ad",             # three operands
               "abc,cd->ad",               # b summed within the first operand alone
               "ab,cd->abcd",              # an outer product: nothing contracted
               "aab,bc->ac"):              # a repeated label (a diagonal)
        assert einsum_as_matmul(eq) is None, eq


def test_matmul_dims_places_the_dense_einsums_of_keras_attention():
    """A real Keras transformer (tf_keras MultiHeadAttention): the query/key/value/output Einsums and their
    gradients are placed as 2-D products whose row side grows with the batch; attention's Einsums are not."""
    from tag_bench.mwms import tf1_graph
    graph = tag.analyze(tf1_graph("transformer", 8, width=16))
    dims = matmul_dims(graph)
    placed = {graph.ops[i].name: j for j, i in enumerate(dims.ops)}
    einsums = [op for op in graph.ops if op.type == "Einsum"]
    dense = [op for op in einsums if "/query/" in op.name or "/key/" in op.name or "/value/" in op.name
             or "/attention_output/" in op.name]
    assert dense and all(op.name in placed for op in dense)
    assert all(op.name not in placed for op in einsums if op not in dense)       # scores, context, their gradients
    query = next(op.name for op in dense if op.name.endswith("query/einsum/Einsum"))
    for batch in (8.0, 24.0):
        m, k, n = dims.at(batch)
        j = placed[query]
        assert VARIANTS[dims.variant[j]] == "nn" and (m[j], k[j], n[j]) == (batch * 32, 16, 16)   # 32 tokens
    weight_grad = next(op.name for op in dense if op.name.endswith("query/einsum/Einsum_grad/Einsum_1"))
    m, k, n = dims.at(8.0)
    j = placed[weight_grad]
    assert VARIANTS[dims.variant[j]] == "tn" and (m[j], k[j], n[j]) == (16, 8 * 32, 16)
    from tag.ir.serialize import training_graph_from_dict, training_graph_to_dict
    back = training_graph_from_dict(json.loads(json.dumps(training_graph_to_dict(graph))))
    assert np.array_equal(matmul_dims(back).ops, dims.ops)                   # a saved IR keeps the equations


def test_json_round_trip_and_bad_tables_are_rejected():
    t = _table()
    back = MatmulTable.from_dict(json.loads(json.dumps(t.to_dict())), "p")
    assert back.sides == SIDES and np.allclose(back.efficiency["nt"], 0.1)
    tiny = MatmulTable.from_dict(json.loads(json.dumps(_table(nt=1.234567e-6).to_dict())), "p")
    assert tiny.efficiency["nt"][0, 0, 0] == pytest.approx(1.2346e-6)    # significant digits, never rounded to 0
    bad = t.to_dict()
    bad["efficiency"]["nn"][0][0][0] = 1.5
    with pytest.raises(TagError, match=r"p\.efficiency\.nn: every efficiency must be in \(0, 1\]"):
        MatmulTable.from_dict(bad, "p")
    with pytest.raises(TagError, match="increasing"):
        MatmulTable.from_dict({"sides": [64, 16], "efficiency": t.to_dict()["efficiency"]}, "p")
    with pytest.raises(TagError, match="grid"):
        MatmulTable.from_dict({"sides": [16, 64], "efficiency": t.to_dict()["efficiency"]}, "p")
    prof = {"version": 1, "devices": {"CPU": {"peak_flops": 1e10, "matmul_table": {"sides": [1]}}}}
    with pytest.raises(TagError, match="devices.CPU.matmul_table"):
        Profile.from_dict(prof, "prof.json")


def test_table_from_rates_fills_untimed_points_from_the_largest_timed_rows():
    shapes = grid_shapes(SIDES, max_flops=2.0 * 64 * 256 * 256)
    assert ("nn", 256, 256, 256) not in shapes and ("nn", 64, 256, 256) in shapes
    rates = {s: 1e9 * (1 + SIDES.index(s[1])) for s in shapes}
    t = table_from_rates(rates, peak=1e10, sides=SIDES)
    assert t.efficiency["nn"][2, 2, 2] == pytest.approx(0.2)      # m = 256 copies m = 64
    assert t.efficiency["nn"][0, 0, 0] == pytest.approx(0.1)
    with pytest.raises(TagError, match="no timing"):
        table_from_rates({}, peak=1e10, sides=SIDES)


def test_cost_model_costs_each_matmul_at_its_shape(mlp):
    topo = load_topology(LOCALHOST)
    dtype = topo.groups[0].device_type
    plain = Profile({dtype: DeviceProfile(1e10, 1e12, 0.0, {"MatMul": 0.5, "default": 0.5})})
    tabled = Profile({dtype: DeviceProfile(1e10, 1e12, 0.0, {"MatMul": 0.5, "default": 0.5},
                                           matmul_table=_table(nn=0.5, nt=0.1, tn=0.25))})
    dims = matmul_dims(mlp)
    before = CostModel(mlp, topo, plain).op_times(0, 32.0)[dims.ops]
    after = CostModel(mlp, topo, tabled).op_times(0, 32.0)[dims.ops]
    ratio = dict(zip((VARIANTS[v] for v in dims.variant), after / before, strict=True))
    assert ratio["nn"] == pytest.approx(1.0, rel=1e-6)
    assert ratio["nt"] == pytest.approx(5.0, rel=1e-6)
    assert ratio["tn"] == pytest.approx(2.0, rel=1e-6)
    # scaled to a slower device (a CPU quota), the table travels with the entry
    assert tabled.devices[dtype].scaled(0.5).matmul_table is tabled.devices[dtype].matmul_table


def test_fit_scales_the_table_to_the_level_of_the_measured_step(mlp):
    # a step whose MatMuls ran exactly 1.5x as fast as the table says (efficiencies well below 1)
    peak, bw = 1e10, 1e13
    table = _table(nn=0.2, nt=0.05, tn=0.1)
    dims = matmul_dims(mlp)
    eff = table.lookup(dims.variant, *dims.at(32.0))
    times = np.full(len(mlp.ops), 2e-6)
    flops = np.array([mlp.ops[i].flops.at(32.0) for i in dims.ops])
    times[dims.ops] = flops / (peak * eff * 1.5) + 2e-6
    m = StepMeasurement(times, wall_s=float(times.sum()), wall_parallel_s=float(times.sum()), steps=1)
    fit = fit_profile(mlp, m, peak, bw, matmul_table=table)
    assert fit.matmul_scale == pytest.approx(1.5, rel=0.02)
    assert fit_profile(mlp, m, peak, bw).matmul_scale == 1.0


def test_fit_gives_einsums_of_attention_their_own_efficiency():
    """Dense Einsums at the table's speed, attention's at a tenth of peak: the per-type Einsum efficiency is the
    attention Einsums' (it serves only them), and the dense ones follow the table."""
    from tag_bench.mwms import tf1_graph
    graph = tag.analyze(tf1_graph("transformer", 8, width=64))
    peak, bw = 1e10, 1e13
    table = _table(nn=0.5, nt=0.5, tn=0.5)
    dims = matmul_dims(graph)
    times = np.full(len(graph.ops), 2e-6)
    flops = np.array([op.flops.at(8.0) for op in graph.ops])
    eff = np.full(len(graph.ops), np.nan)
    eff[dims.ops] = table.lookup(dims.variant, *dims.at(8.0))
    batched = np.array([op.type == "Einsum" for op in graph.ops]) & np.isnan(eff)
    assert batched.any() and (~np.isnan(eff[[op.type == "Einsum" for op in graph.ops]])).any()
    times[~np.isnan(eff)] = flops[~np.isnan(eff)] / (peak * eff[~np.isnan(eff)]) + 2e-6
    times[batched] = flops[batched] / (peak * 0.1) + 2e-6
    m = StepMeasurement(times, wall_s=float(times.sum()), wall_parallel_s=float(times.sum()), steps=1)
    fit = fit_profile(graph, m, peak, bw, matmul_table=table)
    assert fit.efficiency["Einsum"] == pytest.approx(0.1, rel=0.05)
    assert fit.matmul_scale == pytest.approx(1.0, rel=0.05)


def test_profile_graph_times_a_small_table_on_this_cpu():
    from tag.calibration import measure_matmul_rates, profile_graph
    rates = measure_matmul_rates([("nn", 16, 64, 64), ("nt", 16, 64, 64), ("tn", 64, 16, 64)], peak=1e10)
    assert len(rates) == 3 and all(r > 1e6 for r in rates.values())
    gd = tag.zoo.training_graph("mlp", batch_size=16, input_dim=64, hidden=(64,))
    prof = profile_graph(gd, tag.analyze(gd), steps=2, matmul_table=True, matmul_sides=(16, 64))
    entry = prof.devices["CPU"]
    assert entry.matmul_table is not None and entry.matmul_table.sides == (16, 64)
    assert "MatMul table" in prof.source
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict())), "p").devices["CPU"].matmul_table is not None


def test_cli_matmul_table_with_like_is_bad_input(tmp_path, capsys):
    from tag.cli.profile import main
    out = tmp_path / "p.json"
    code = main(["--model", "zoo:mlp,input_dim=16,hidden=16", "--batch", "4", "--like", str(tmp_path / "base.json"),
                 "--matmul-table", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "--matmul-table" in capsys.readouterr().err


def test_profile_summary_names_the_table():
    from tag.cli.profile import _summary
    prof = Profile({"CPU": DeviceProfile(1e10, 1e10, 1e-6, {"default": 0.5}, matmul_table=_table())})
    line = _summary(prof, "CPU")[-1]
    assert line.startswith("  MatMul by shape (sides 16-256)") and "nt 0.1-0.1" in line
