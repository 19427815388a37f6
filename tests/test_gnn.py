"""The GNN policy: encoder heterograph, numpy head against the TensorFlow one, invariance, the default prior
as the untrained network, no simulator run per node, a training step, the shipped weights."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("DGLBACKEND", "tensorflow")    # before the first import of dgl (else it looks for torch)
import dgl  # noqa: E402,F401  -- a pinned dependency (setup.py): a failed import fails these tests, never skips them

from tag.gnn.features import (  # noqa: E402
    F_CAND,
    F_DEV,
    F_GLOBAL,
    F_OP,
    EncoderInput,
    batch_encoders,
    batch_nodes,
    encoder_input,
    node_input,
)
from tag.gnn.model import PolicyNet, homogeneous_view, state_heterograph  # noqa: E402
from tag.search.env import SearchEnv  # noqa: E402
from tag.search.mcts import complete, mcts, uniform_value_prior  # noqa: E402
from tag.search.orders import decision_order  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tiny import make_topology, mlp_graph  # noqa: E402


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
    net = PolicyNet(seed=3)
    w = net.decoder.second.w            # starts at zero (the default prior); a random last layer tests more
    w.assign(np.random.default_rng(3).normal(0.0, 0.5, size=w.shape).astype(np.float32))
    return net


def _node(env, order, prefix):
    if prefix:
        env.evaluate(complete(env, order, prefix))     # a tree search simulates a node before expanding it
    return node_input(env, order, prefix, env.allowed[order[len(prefix)]])


def _tf_log_probs(net, env, nodes):
    b = batch_encoders([encoder_input(env)])
    return net.log_probs(net.encode(b), batch_nodes(nodes, [0] * len(nodes), b["op_offset"],
                                                    b["cand_offset"])).numpy()


def test_heterograph_counts_and_features(env, order):
    enc = encoder_input(env)
    g = state_heterograph(batch_encoders([enc]))
    G, D = env.num_groups, len(env.topology.groups)
    assert g.num_nodes("op") == G and g.num_nodes("dev") == D
    gof = env.grouping.group_of_op
    flows = {(int(gof[e.src]), int(gof[e.dst])) for e in env.graph.edges if gof[e.src] != gof[e.dst]}
    assert g.num_edges("flow") == g.num_edges("flow_rev") == len(flows)
    assert g.num_edges("link") == D * (D - 1)
    assert g.nodes["op"].data["x"].shape == (G, F_OP) and g.nodes["dev"].data["x"].shape == (D, F_DEV)
    prefix = (env.allowed[order[0]][1],)
    x = _node(env, order, prefix)
    assert x.cand_x.shape == (len(env.allowed[order[1]]), F_CAND) and x.global_x.shape == (F_GLOBAL,)
    for a in (enc.op_x, enc.dev_x, enc.flow_x, enc.link_x, x.cand_x, x.global_x):
        assert np.all(np.isfinite(a)) and np.abs(a).max() < 50
    first = list(x.allowed).index(prefix[0]) if prefix[0] in x.allowed else None
    flags = x.cand_x[:, -5]                                     # "is the first decision"
    assert flags.sum() == (first is not None) and (first is None or flags[first] == 1.0)


def test_homogeneous_view_matches_dgl(env):
    b = batch_encoders([encoder_input(env), encoder_input(env)])
    ours, _, _ = homogeneous_view(b)
    theirs = dgl.to_homogeneous(state_heterograph(b))
    for a, c in zip(ours.edges(), theirs.edges(), strict=True):
        assert np.array_equal(a.numpy(), c.numpy())


def test_numpy_head_matches_tensorflow(env, order, net):
    nodes = [_node(env, order, ()), _node(env, order, (env.allowed[order[0]][2],))]
    tf_logp = _tf_log_probs(net, env, nodes)
    assert tf_logp.shape == (sum(x.num_candidates for x in nodes),)
    enc = net.encode_env(encoder_input(env))
    np_logp = np.concatenate([enc.log_probs(x) for x in nodes])
    assert np.allclose(tf_logp, np_logp, atol=1e-4)
    first = nodes[0].num_candidates
    for part in (np_logp[:first], np_logp[first:]):
        assert np.isclose(np.exp(part).sum(), 1.0, atol=1e-6)
    assert np.abs(np.diff(np_logp[:first])).max() > 1e-3        # the random last layer moved it


def test_untrained_network_is_the_default_prior(env, order):
    from tag.gnn.policy import GNNPolicy
    policy = GNNPolicy(PolicyNet(seed=0))
    for prefix in [(), (env.allowed[order[0]][1],)]:
        allowed = env.allowed[order[len(prefix)]]
        _node(env, order, prefix)
        assert np.allclose(policy(env, order, prefix, allowed), uniform_value_prior(env, order, prefix, allowed))


def test_prior_runs_no_simulation_per_node(env, order, net):
    from tag.gnn.policy import GNNPolicy
    policy = GNNPolicy(net)
    mcts(env, order=order, playouts=5, seed=0, prior=policy)        # encoder and uniform values done
    before, calls = env.evaluations, policy.calls
    tree = mcts(env, order=order, playouts=40, seed=1, prior=policy)
    assert policy.calls > calls and env.evaluations - before <= tree.playouts    # the tree's own runs only
    assert policy.encodes == 1


def _renumber_devices(x: EncoderInput, perm: np.ndarray) -> EncoderInput:
    """The same graph with device group i renamed perm[i] (rows moved, edges and members relabelled)."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    return EncoderInput(x.op_x, x.dev_x[inv], x.flow_src, x.flow_dst, x.flow_x, perm[x.link_src], perm[x.link_dst],
                        x.link_x, x.member_cand, perm[x.member_dev], x.member_w, x.num_candidates)


def test_forward_invariant_to_renumbering_device_groups(env, order, net):
    x = _node(env, order, (env.allowed[order[0]][3],))
    perm = np.array([2, 0, 1])
    assert len(perm) == len(env.topology.groups)
    a = net.encode_env(encoder_input(env)).log_probs(x)
    b = net.encode_env(_renumber_devices(encoder_input(env), perm)).log_probs(x)
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
        _node(env, order, prefix)
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
