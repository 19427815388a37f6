"""The GNN policy: state heterograph, forward pass, invariance, a training step, the shipped weights."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("DGLBACKEND", "tensorflow")    # before the first import of dgl (else it looks for torch)
import dgl  # noqa: E402,F401  -- a pinned dependency (setup.py): a failed import fails these tests, never skips them

from tiny import make_topology, mlp_graph  # noqa: E402

from tag.gnn.features import F_CAND, F_DEV, F_OP, PolicyInput, batch_inputs, state_input  # noqa: E402
from tag.gnn.model import PolicyNet, homogeneous_view, state_heterograph  # noqa: E402
from tag.search.env import SearchEnv  # noqa: E402
from tag.search.mcts import complete, mcts  # noqa: E402
from tag.search.orders import decision_order  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402


@pytest.fixture(scope="module")
def env() -> SearchEnv:
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-B", 1), ("GPU-C", 2)])], inter_bandwidth=1.25e9)
    tg = mlp_graph(batch=16, widths=(32, 64, 64, 8))
    return SearchEnv(tg, topo, group_ops(tg, target_groups=16), batch_size=16)


@pytest.fixture(scope="module")
def order(env) -> list[int]:
    return decision_order("cost_descending", env.graph, env.topology, env.grouping, env.cost_model, env.batch_size)


@pytest.fixture(scope="module")
def net() -> PolicyNet:
    return PolicyNet(seed=3)


def _inter_group_flow(env) -> set[tuple[int, int]]:
    gof = env.grouping.group_of_op
    return {(int(gof[e.src]), int(gof[e.dst])) for e in env.graph.edges if gof[e.src] != gof[e.dst]}


def test_heterograph_counts_and_features(env, order):
    prefix = (env.allowed[order[0]][1],)
    x = state_input(env, order, prefix, env.allowed[order[1]])
    g = state_heterograph(batch_inputs([x]))
    G, D = env.num_groups, len(env.topology.groups)
    assert g.num_nodes("op") == G and g.num_nodes("dev") == D
    flows = _inter_group_flow(env)
    assert g.num_edges("flow") == g.num_edges("flow_rev") == len(flows)
    assert g.num_edges("link") == D * (D - 1)
    choice = complete(env, order, prefix)
    placed = {(gi, env.topology.devices[d].group) for gi, k in enumerate(choice)
              for d in (env.candidates[k].partition_devices if env.candidates[k].action.mode == "partition"
                        else [d for dg in env.candidates[k].action.placement for d in env.topology.groups[dg].devices])}
    assert g.num_edges("placed") == g.num_edges("hosts") == len(placed)
    assert g.nodes["op"].data["x"].shape == (G, F_OP) and g.nodes["dev"].data["x"].shape == (D, F_DEV)
    assert x.cand_x.shape == (len(env.allowed[order[1]]), F_CAND)
    for a in (x.op_x, x.dev_x, x.cand_x, x.flow_x, x.link_x, x.place_x, x.global_x):
        assert np.all(np.isfinite(a)) and np.abs(a).max() < 50
    assert x.op_x[order[0], 10] == 1.0 and x.op_x[order[1], 11] == 1.0     # decided / deciding-next flags
    assert x.op_x[:, 10].sum() == 1 and x.op_x[:, 11].sum() == 1


def test_homogeneous_view_matches_dgl(env, order):
    import dgl
    x = state_input(env, order, (env.allowed[order[0]][0],), env.allowed[order[1]])
    b = batch_inputs([x, x])
    ours, _, _ = homogeneous_view(b)
    theirs = dgl.to_homogeneous(state_heterograph(b))
    for a, c in zip(ours.edges(), theirs.edges()):
        assert np.array_equal(a.numpy(), c.numpy())


def test_one_log_probability_per_candidate(env, order, net):
    xs = [state_input(env, order, (), env.allowed[order[0]]),
          state_input(env, order, (env.allowed[order[0]][2],), env.allowed[order[1]])]
    logp = net.log_probs(batch_inputs(xs)).numpy()
    assert logp.shape == (sum(x.num_candidates for x in xs),)
    first = xs[0].num_candidates
    for part in (logp[:first], logp[first:]):
        assert np.isclose(np.exp(part).sum(), 1.0, atol=1e-5)


def _renumber_devices(x: PolicyInput, perm: np.ndarray) -> PolicyInput:
    """The same state with device group i renamed perm[i] (rows moved, edges and members relabelled)."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    return PolicyInput(x.op_x, x.dev_x[inv], x.flow_src, x.flow_dst, x.flow_x, perm[x.link_src], perm[x.link_dst],
                       x.link_x, x.place_src, perm[x.place_dst], x.place_x, x.global_x, x.target, x.cand_x,
                       x.member_cand, perm[x.member_dev], x.member_w)


def test_forward_invariant_to_renumbering_device_groups(env, order, net):
    x = state_input(env, order, (env.allowed[order[0]][3],), env.allowed[order[1]])
    perm = np.array([2, 0, 1])
    assert len(perm) == len(env.topology.groups)
    a = net.log_probs(batch_inputs([x])).numpy()
    b = net.log_probs(batch_inputs([_renumber_devices(x, perm)])).numpy()
    assert np.allclose(a, b, atol=1e-5)


def test_training_step_lowers_loss(env):
    from tag.gnn.selfplay import Trainer, self_play
    samples, tree = self_play(env, None, playouts=60, seed=0, min_visits=4)
    assert samples and tree.visits
    trainer = Trainer(PolicyNet(seed=1), learning_rate=1e-3)
    before = float(trainer.loss(samples))
    trainer.step(samples)
    assert float(trainer.loss(samples)) < before


def test_keep_visits_counts_playouts(env):
    tree = mcts(env, order="cost_descending", playouts=30, seed=0, keep_visits=True)
    allowed, visits = tree.visits[()]
    assert visits.sum() == 30 and len(allowed) == len(visits)


def test_shipped_weights_reproduce_recorded_output():
    from tag.gnn import load_policy
    from tag.gnn.policy import WEIGHTS_PATH, reference_log_probs
    with np.load(WEIGHTS_PATH, allow_pickle=False) as data:
        assert "__reference_log_probs" in data.files
    policy = load_policy()
    assert np.allclose(reference_log_probs(policy.net), policy.info["__reference_log_probs"], atol=1e-4)


def test_gnn_prior_is_a_distribution_over_allowed(env, order):
    from tag.gnn import gnn_prior
    for prefix in [(), (env.allowed[order[0]][0],)]:
        allowed = env.allowed[order[len(prefix)]]
        p = gnn_prior(env, order, prefix, allowed)
        assert p.shape == (len(allowed),) and np.all(p > 0) and np.isclose(p.sum(), 1.0)
    tree = mcts(env, order=order, playouts=5, seed=0, prior=gnn_prior)
    assert tree.outcome is not None


def test_generated_cases_build():
    import tag
    from tag.gnn.cases import random_layered_graph, random_topology_text
    rng = np.random.default_rng(11)
    for _ in range(3):
        topo = tag.parse_topology(random_topology_text(rng))
        tg = random_layered_graph(rng, batch=8)
        env = SearchEnv(tg, topo, group_ops(tg, target_groups=64), batch_size=8 * topo.num_devices)
        assert env.num_groups >= 4 and len(env.candidates) >= 1
