"""Graph neural network policy (DGL, TensorFlow backend) giving the tree search a prior over actions.  [DGL]

The only package that imports DGL. A heterograph of op groups and device groups, encoded by attention
message passing once per search, and a light head scoring each candidate action of the group decided next
from the cached embeddings and a few per-node features (``tag.gnn.features``, ``tag.gnn.model``; no
simulator run per node); trained by self-play in the simulator (``tag.gnn.selfplay``,
``scripts/train_gnn.py``); the weights ship beside this file and load by default.

Example::

    from tag.gnn import gnn_prior, load_policy
    from tag.search.mcts import mcts
    tree = mcts(env, playouts=100, seed=0, prior=gnn_prior)     # or prior=load_policy(mix=0.1)
"""
from __future__ import annotations

import os

os.environ.setdefault("DGLBACKEND", "tensorflow")

from tag.gnn.policy import GNNPolicy, gnn_prior, load_policy  # noqa: E402

__all__ = ["GNNPolicy", "gnn_prior", "load_policy"]
