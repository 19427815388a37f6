"""Op grouping: layers, gradients with their forward op, colocation, acyclic group graph, merging."""
import networkx as nx
import numpy as np
import pytest

from tag.errors import TagError
from tag.ir.algorithms import op_levels, op_stages, topological_order
from tag.strategy.grouping import group_ops
from tiny import GraphBuilder, mlp_graph


def _task_graph(tg, group_of_op):
    stage = op_stages(tg)
    g = nx.DiGraph()
    deps = [(e.src, e.dst) for e in tg.edges] + list(tg.control_edges)
    for s, d in deps:
        a, b = (int(group_of_op[s]), int(stage[s])), (int(group_of_op[d]), int(stage[d]))
        if a != b:
            g.add_edge(a, b)
    return g


def _group(tg, grouping, name):
    return int(grouping.group_of_op[tg.op_index[name]])


def test_mlp_groups_are_layers_with_their_gradients_and_updates():
    tg = mlp_graph(batch=8, widths=(16, 32, 32, 4))
    gr = group_ops(tg, target_groups=64)
    for i in range(3):
        g = _group(tg, gr, f"dense_{i}/MatMul")
        assert gr.names[g] == f"dense_{i}"
        assert _group(tg, gr, f"dense_{i}/kernel") == g
        assert _group(tg, gr, f"gradients/dense_{i}/MatMul_grad/MatMul_1") == g
        assert _group(tg, gr, f"Adam/update_dense_{i}/kernel/ResourceApplyAdam") == g
    assert _group(tg, gr, "gradients/dense_2/MatMul_grad/MatMul") == _group(tg, gr, "dense_2/MatMul")
    # every colocation set in one group
    for names in tg.colocation:
        assert len({_group(tg, gr, n) for n in names}) == 1
    assert nx.is_directed_acyclic_graph(_task_graph(tg, gr.group_of_op))
    # groups are numbered in topological order of the layers
    assert [_group(tg, gr, f"dense_{i}/MatMul") for i in range(3)] == sorted(
        _group(tg, gr, f"dense_{i}/MatMul") for i in range(3))


def test_deterministic_and_target_respected():
    tg = mlp_graph(batch=8, widths=(16, 32, 32, 32, 4))
    a, b = group_ops(tg, 64), group_ops(tg, 64)
    assert np.array_equal(a.group_of_op, b.group_of_op) and a.names == b.names
    for target in (1, 2, 3):
        gr = group_ops(tg, target)
        assert gr.num_groups <= target
        assert sorted(set(gr.group_of_op.tolist())) == list(range(gr.num_groups))
        assert nx.is_directed_acyclic_graph(_task_graph(tg, gr.group_of_op))
    assert group_ops(tg, 2).names[0].startswith("dense_")
    with pytest.raises(TagError):
        group_ops(tg, 0)


def test_cheapest_neighbours_merge_first():
    b = GraphBuilder(batch_size=4)
    prev = b.op("input", "Placeholder", out_pe=4)
    for i, f in enumerate([100e9, 1e6, 2e6, 100e9]):
        prev = b.op(f"l{i}/op", "MatMul", inputs=(prev,), flops=f, out_pe=4)
    tg = b.build()
    gr = group_ops(tg, 3)
    # the two cheap layers (l1, l2) merge; the expensive ones stay alone
    assert _group(tg, gr, "l1/op") == _group(tg, gr, "l2/op")
    assert len({_group(tg, gr, f"l{i}/op") for i in (0, 1, 3)}) == 3


def _transformer_like():
    """A layer scope whose two residual adds sit around sub-layer scopes (as in BERT): not contiguous."""
    b = GraphBuilder(batch_size=2)
    x = b.op("input", "Placeholder", out_pe=64)
    h = b.op("layer/attn/mm", "MatMul", inputs=(x,), flops_pe=1e6, out_pe=64)
    a = b.op("layer/add", "AddV2", inputs=(x, h), flops_pe=16, out_pe=64)
    n = b.op("layer/norm/mul", "Mul", inputs=(a,), flops_pe=16, out_pe=64)
    f = b.op("layer/ffn/mm", "MatMul", inputs=(n,), flops_pe=1e6, out_pe=64)
    o = b.op("layer/add_1", "AddV2", inputs=(n, f), flops_pe=16, out_pe=64)
    b.op("loss", "Mean", inputs=(o,), flops_pe=16, out_bytes=4)
    return b.build()


def test_non_contiguous_scope_is_split_and_groups_stay_acyclic():
    tg = _transformer_like()
    gr = group_ops(tg, 64)
    assert _group(tg, gr, "layer/add") != _group(tg, gr, "layer/add_1")
    assert nx.is_directed_acyclic_graph(_task_graph(tg, gr.group_of_op))


def test_gradient_plumbing_joins_its_consumer():
    tg = mlp_graph(batch=8, widths=(16, 32, 4))
    gr = group_ops(tg, 64)
    # gradients/Fill (the loss seed) has no "_grad" scope: it joins the op that reads it
    assert _group(tg, gr, "gradients/Fill") == _group(tg, gr, "gradients/loss_grad/Tile")


def test_shared_state_colocation_hub_does_not_collapse_the_graph():
    """Adam's beta power: read by every update op, updated after all of them, colocated by TF with the
    first variable. Keeping that colocation would force one group; it is dropped instead."""
    tg = mlp_graph(batch=8, widths=(16, 32, 32, 32, 4))
    b = GraphBuilder(batch_size=8)
    # rebuild the mlp with a beta-power hub around its update ops
    for op in tg.ops:
        b.ops.append(op)
        b._index[op.name] = len(b.ops) - 1
    b.variables = list(tg.variables)
    b.colocation = [list(c) for c in tg.colocation]
    b.variable("beta1_power", 4, "state")
    reads = []
    applies = [op.name for op in tg.ops if op.type == "ResourceApplyAdam"]
    for ap in applies:
        reads.append(b.op(f"{ap}/ReadVariableOp", "ReadVariableOp", "update", ("beta1_power",), out_bytes=4))
        b.ops[b._index[ap]].inputs.append(f"{reads[-1]}:0")
    b.op("Adam/mul", "Mul", "update", ("beta1_power",), flops=1, out_bytes=4, control=tuple(applies))
    b.op("Adam/Assign", "AssignVariableOp", "update", ("beta1_power", "Adam/mul"))
    b.colocation[0] += ["beta1_power", *reads, "Adam/mul", "Adam/Assign"]
    tg2 = b.build()
    gr = group_ops(tg2, 64)
    layers = {_group(tg2, gr, f"dense_{i}/MatMul") for i in range(4)}
    assert len(layers) == 4
    assert nx.is_directed_acyclic_graph(_task_graph(tg2, gr.group_of_op))


def test_helpers_order_stage_level():
    tg = mlp_graph(batch=8, widths=(16, 32, 4))
    order = topological_order(tg)
    pos = np.empty(len(order), dtype=int)
    pos[order] = np.arange(len(order))
    assert all(pos[e.src] < pos[e.dst] for e in tg.edges)
    stage = op_stages(tg)
    assert all(stage[e.src] <= stage[e.dst] for e in tg.edges)
    lv = op_levels(tg)
    assert lv[tg.op_index["input"]] == 0 and lv[tg.op_index["dense_0/kernel"]] == -1
    assert lv[tg.op_index["dense_1/MatMul"]] > lv[tg.op_index["dense_0/MatMul"]]
