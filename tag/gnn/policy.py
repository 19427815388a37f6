"""The trained policy as a tree-search prior: ``load_policy()`` and ``gnn_prior``.

``GNNPolicy`` wraps a ``PolicyNet``: called as ``policy(env, order, prefix, allowed)`` it returns
probabilities over ALLOWED, the ``PriorFn`` contract of ``tag.search.mcts``. The graph encoder runs once per
environment (the first call on it; ``EncodedEnv`` tables cached while the environment lives), then each call
builds the node's few features (``tag.gnn.features.node_input``, no simulator run) and runs the numpy head:
well under a millisecond per tree node. ``encode_seconds``, ``node_seconds`` and ``calls`` count where the
time went. The shipped weights (``policy_weights.npz`` beside this file, plain arrays:
``np.load(..., allow_pickle=False)``) are loaded by ``load_policy()`` with no argument; ``gnn_prior`` is the
default policy as a plain function.

The npz also records the network's output on a fixed reference state (``reference_env``), so a test can
check that the shipped weights load and reproduce it.

Example::

    from tag.gnn import gnn_prior
    from tag.search.mcts import mcts
    tree = mcts(env, playouts=100, seed=0, prior=gnn_prior)
"""
from __future__ import annotations

import os
import time
import weakref
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tag.gnn.features import batch_encoders, batch_nodes, encoder_input, node_input
from tag.gnn.model import EncodedEnv, PolicyNet

if TYPE_CHECKING:  # pragma: no cover
    from tag.search.env import SearchEnv

WEIGHTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policy_weights.npz")


class GNNPolicy:
    """A PolicyNet as an MCTS prior: ``policy(env, order, prefix, allowed) -> probabilities over allowed``.

    ``mix`` blends in the uniform distribution (a floor for candidates the network dismisses; 0 by
    default: the network's output already includes the default prior); ``temperature`` divides the
    log-probabilities.
    """

    def __init__(self, net: PolicyNet | None = None, *, mix: float = 0.0, temperature: float = 1.0):
        self.net = net if net is not None else PolicyNet()
        self.mix, self.temperature = float(mix), float(temperature)
        self.calls = 0
        self.encodes = 0
        self.encode_seconds = 0.0        # graph encoder, once per environment
        self.node_seconds = 0.0          # per-node features and head
        self.info: dict[str, np.ndarray] = {}
        self._encoded: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def encoded(self, env: "SearchEnv") -> EncodedEnv:
        """ENV's encoder output (computed on first use, cached while ENV lives)."""
        enc = self._encoded.get(env)
        if enc is None:
            t0 = time.perf_counter()
            enc = self._encoded[env] = self.net.encode_env(encoder_input(env))
            self.encode_seconds += time.perf_counter() - t0
            self.encodes += 1
        return enc

    def forget(self) -> None:
        """Drop the cached encoder outputs (after training changed the network)."""
        self._encoded = weakref.WeakKeyDictionary()

    def log_probs(self, env: "SearchEnv", order: Sequence[int], prefix: Sequence[int],
                  allowed: Sequence[int]) -> np.ndarray:
        """The network's log-probabilities over ALLOWED for group ``order[len(prefix)]``."""
        enc = self.encoded(env)
        t0 = time.perf_counter()
        logp = enc.log_probs(node_input(env, order, tuple(prefix), allowed))
        self.node_seconds += time.perf_counter() - t0
        return logp

    def __call__(self, env: "SearchEnv", order: Sequence[int], prefix: tuple[int, ...],
                 allowed: Sequence[int]) -> np.ndarray:
        self.calls += 1
        if len(allowed) == 1:
            return np.ones(1)
        logp = self.log_probs(env, order, prefix, allowed) / self.temperature
        p = np.exp(logp - logp.max())
        p /= p.sum()
        return (1.0 - self.mix) * p + self.mix / len(allowed)

    @property
    def ms_per_node(self) -> float:
        """Milliseconds per call, the encoder's time spread over the calls."""
        return 1e3 * (self.encode_seconds + self.node_seconds) / max(self.calls, 1)


def load_policy(path: str | os.PathLike | None = None, **kwargs) -> GNNPolicy:
    """The policy with weights from PATH (default: the shipped ``policy_weights.npz``)."""
    net = PolicyNet()
    policy = GNNPolicy(net, **kwargs)
    policy.info = net.load_npz(str(path or WEIGHTS_PATH))
    return policy


_DEFAULT: GNNPolicy | None = None


def gnn_prior(env: "SearchEnv", order: Sequence[int], prefix: tuple[int, ...], allowed: Sequence[int]) -> np.ndarray:
    """The shipped policy's probabilities over ALLOWED (loaded on first use): a ``PriorFn`` for ``mcts``."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load_policy()
    return _DEFAULT(env, order, prefix, allowed)


def reference_env() -> "SearchEnv":
    """A fixed small state for recording and checking the shipped network's output: a generated
    layered graph on a generated 3-host cluster (seeded, no TensorFlow graph building)."""
    from tag.cluster.topology import parse_topology
    from tag.gnn.cases import random_layered_graph
    from tag.search.env import SearchEnv
    from tag.strategy.grouping import group_ops
    tg = random_layered_graph(np.random.default_rng(5), batch=32, name="reference")
    topo = parse_topology(_REFERENCE_TOPOLOGY)
    return SearchEnv(tg, topo, group_ops(tg, target_groups=16), batch_size=32)


def reference_log_probs(net: PolicyNet) -> np.ndarray:
    """NET's log-probabilities at the root and after the first allowed candidate, on ``reference_env``."""
    from tag.search.orders import decision_order
    env = reference_env()
    order = decision_order("cost_descending", env.graph, env.topology, env.grouping, env.cost_model, env.batch_size)
    enc = batch_encoders([encoder_input(env)])
    nodes = [node_input(env, order, (), env.allowed[order[0]]),
             node_input(env, order, (env.allowed[order[0]][0],), env.allowed[order[1]])]
    return net.log_probs(net.encode(enc), batch_nodes(nodes, [0, 0], enc["op_offset"], enc["cand_offset"])).numpy()


_REFERENCE_TOPOLOGY = """
name: "reference"
host { name: "a" address: "10.0.0.1" port: 2222
  device { type: "V100" kind: GPU count: 2 memory_gib: 32 peak_tflops: 15.7 memory_bandwidth_gbs: 900 }
  interconnect { kind: NVLINK bandwidth_gbs: 50 latency_us: 2 } }
host { name: "b" address: "10.0.0.2" port: 2222
  device { type: "T4" kind: GPU count: 2 memory_gib: 16 peak_tflops: 8.1 memory_bandwidth_gbs: 320 }
  interconnect { kind: PCIE bandwidth_gbs: 16 latency_us: 5 } }
host { name: "c" address: "10.0.0.3" port: 2222
  device { type: "GTX1080Ti" kind: GPU count: 1 memory_gib: 11 peak_tflops: 11.3 memory_bandwidth_gbs: 484 } }
link { a: "a" b: "b" bandwidth_gbps: 25 latency_us: 20 }
fabric { bandwidth_gbps: 10 latency_us: 50 }
"""
