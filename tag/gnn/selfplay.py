"""Self-play training of the policy: tree-search visit distributions as targets, cross-entropy loss.

AlphaZero-style: the tree search (``tag.search.mcts``) runs as ``tag.optimize`` runs it (seeded with the
best uniform strategy) with the current network as its prior (the first generation with the default
uniform-value prior, which an untrained network equals); every expanded node visited at least
``min_visits`` times yields a training sample (the node's features, the visit distribution over its
candidates); the network is then trained to match those distributions (cross-entropy, Adam). Repeating
generations makes the search, and so the targets, better. A sample keeps its environment's
``EncoderInput``: a training batch runs the encoder once per distinct environment in it.

Example::

    from tag.gnn.model import PolicyNet
    from tag.gnn.selfplay import Trainer, self_play
    samples, tree = self_play(env, prior=None, playouts=300, seed=0)     # None: the default prior
    trainer = Trainer(PolicyNet(seed=0))
    trainer.step(samples[:32])                     # one Adam step; returns the batch loss
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import tensorflow as tf

from tag.gnn.features import EncoderInput, NodeInput, batch_encoders, batch_nodes, encoder_input, node_input
from tag.gnn.model import PolicyNet

if TYPE_CHECKING:  # pragma: no cover
    from tag.search.env import SearchEnv
    from tag.search.mcts import PriorFn, TreeResult


@dataclass
class Sample:
    """One tree node (its environment's graph and its own features) and the search's visit distribution
    over its candidates."""

    enc: EncoderInput
    x: NodeInput
    target: np.ndarray          # sums to 1, one entry per candidate of x
    visits: int                 # the node's total visits


def self_play(env: "SearchEnv", prior: "PriorFn | None", playouts: int, seed: int,
              order: str | Sequence[int] = "cost_descending", min_visits: int = 8, visit_temperature: float = 1.0,
              value_weight: float = 0.0, value_temperature: float = 0.05) -> tuple[list[Sample], "TreeResult"]:
    """Run the tree search on ENV with PRIOR (None: the default uniform-value prior), seeded with the best
    uniform strategy, and turn its visited nodes into samples.

    A node's target is its visit distribution raised to 1 / VISIT_TEMPERATURE; with VALUE_WEIGHT > 0 it is
    blended with the softmax (temperature VALUE_TEMPERATURE) of every candidate's *completed* value (the
    simulated value of the node's completion with that candidate; values over the best one): visits of a
    short search depend much on which child it happened to try first, the completed values do not.
    """
    from tag.search.driver import best_uniform
    from tag.search.mcts import complete, mcts
    start, _ = best_uniform(env)
    tree = mcts(env, order=order, playouts=playouts, seed=seed, prior=prior, keep_visits=True, start=start)
    enc = encoder_input(env)
    samples = []
    for prefix, (allowed, visits) in sorted(tree.visits.items(), key=lambda kv: len(kv[0])):
        total = float(visits.sum())
        if total < min_visits or len(allowed) < 2:
            continue
        target = np.power(visits / total, 1.0 / visit_temperature)
        target /= target.sum()
        if value_weight > 0:
            values = np.array([env.evaluate(complete(env, tree.order, prefix + (k,))).value for k in allowed])
            scale = values.max() if values.max() > 0 else 1.0
            z = np.where(values > 0, values / scale, values - 1.0) / value_temperature
            q = np.exp(z - z.max())
            target = (1 - value_weight) * target + value_weight * q / q.sum()
        x = node_input(env, tree.order, prefix, allowed)
        samples.append(Sample(enc, x, target.astype(np.float32), int(total)))
    return samples, tree


class Trainer:
    """Adam on the cross-entropy between the network's log-probabilities and the visit distributions."""

    def __init__(self, net: PolicyNet, learning_rate: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 weight_decay: float = 1e-5, target_temperature: float = 1.0):
        self.net = net
        self.target_temperature = float(target_temperature)
        self.lr, self.beta1, self.beta2, self.weight_decay = learning_rate, beta1, beta2, weight_decay
        self.variables = list(net.variables_by_name.values())
        self.m = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.variables]
        self.v = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.variables]
        self.steps = 0

    def loss(self, samples: Sequence[Sample]) -> tf.Tensor:
        """Mean over SAMPLES of the cross-entropy sum(-target * log p)."""
        envs: dict[int, int] = {}
        for s in samples:
            envs.setdefault(id(s.enc), len(envs))
        encs = {id(s.enc): s.enc for s in samples}
        b = batch_encoders([encs[k] for k in envs])
        nodes = batch_nodes([s.x for s in samples], [envs[id(s.enc)] for s in samples], b["op_offset"],
                            b["cand_offset"])
        logp = self.net.log_probs(self.net.encode(b), nodes)
        target = tf.constant(np.concatenate([self.sharpened(s.target) for s in samples]))
        return -tf.reduce_sum(target * logp) / len(samples)

    def sharpened(self, target: np.ndarray) -> np.ndarray:
        """TARGET ** (1 / target_temperature), renormalised (AlphaZero's visit-count temperature)."""
        if self.target_temperature == 1.0:
            return target
        t = np.power(target.astype(np.float64), 1.0 / self.target_temperature)
        return (t / t.sum()).astype(np.float32)

    def target_entropy(self, samples: Sequence[Sample]) -> float:
        """Mean entropy of the (sharpened) targets: the loss a perfect fit would reach."""
        ents = [-(t * np.log(np.maximum(t, 1e-12))).sum() for t in (self.sharpened(s.target) for s in samples)]
        return float(np.mean(ents)) if ents else float("nan")

    def step(self, samples: Sequence[Sample]) -> float:
        """One Adam step on SAMPLES; returns the loss before the step."""
        with tf.GradientTape() as tape:
            loss = self.loss(samples)
        grads = tape.gradient(loss, self.variables)
        self.steps += 1
        t = self.steps
        scale = self.lr * np.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)
        for var, g, m, v in zip(self.variables, grads, self.m, self.v, strict=True):
            if g is None:
                continue
            g = tf.convert_to_tensor(g) + self.weight_decay * var
            m.assign(self.beta1 * m + (1 - self.beta1) * g)
            v.assign(self.beta2 * v + (1 - self.beta2) * tf.square(g))
            var.assign_sub(scale * m / (tf.sqrt(v) + 1e-8))
        return float(loss)

    def epoch(self, samples: Sequence[Sample], batch_size: int, rng: np.random.Generator) -> float:
        """One pass over SAMPLES in shuffled batches; returns the mean loss."""
        order = rng.permutation(len(samples))
        losses = []
        for start in range(0, len(order), batch_size):
            losses.append(self.step([samples[i] for i in order[start:start + batch_size]]))
        return float(np.mean(losses)) if losses else float("nan")
