"""The policy network: attention message passing on a DGL heterograph of op groups and device groups.

Graph (one per search state, or a disjoint union of several for training): node types ``op`` (op
groups) and ``dev`` (device groups); relations ``flow`` (op -> op, forward data flow), ``flow_rev`` (its
reverse), ``link`` (dev -> dev), ``placed`` (op -> dev: the device groups of the op group's current
action) and ``hosts`` (the reverse). Every relation has edge features (``tag.gnn.features``).

Layers: node and edge features are embedded by linear maps per node type / relation (the relation's
embedding tells the attention which relation an edge belongs to); then ``LAYERS`` rounds of multi-head
attention over the heterograph's homogeneous view (for edge u -> v: score = <W_q h_v, W_k h_u> / sqrt(d)
+ w . e_uv per head (``fn.u_dot_v``), softmax over v's incoming edges (``dgl.ops.edge_softmax``), message
= score * (W_v h_u + W_e e_uv), summed with ``update_all``), and a residual MLP with layer normalisation.
The homogeneous view is built straight from the arrays with ``dgl.to_homogeneous``'s numbering
(``homogeneous_view``): converting the heterograph costs more than the whole forward pass, and one
attention over all relations makes 4 DGL kernel calls per layer instead of 4 per relation per layer.

Decoder: for each candidate action of the group decided next, the mean and max of the embeddings of the
device groups it places on (weighted by device share), its own features and the deciding group's
embedding and graph-pooled context go through an MLP to a score; a log-softmax over the state's
candidates gives log-probabilities (any number of candidates). Nothing depends on device-group numbering:
device groups enter as nodes, through symmetric aggregations only.

Layers are ``tf.Module`` objects with DGL's TensorFlow backend (``dgl.function`` built-ins); Keras layers
are not used. Parameters save to / load from a plain ``.npz`` (``save_npz`` / ``load_npz``).

Example::

    from tag.gnn.model import PolicyNet
    from tag.gnn.features import batch_inputs, state_input
    net = PolicyNet(seed=0)
    logp = net.log_probs(batch_inputs([state_input(env, order, (), env.allowed[order[0]])]))
"""
from __future__ import annotations

import os

os.environ.setdefault("DGLBACKEND", "tensorflow")

import dgl  # noqa: E402
import dgl.function as fn  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tag.gnn.features import F_CAND, F_DEV, F_FLOW, F_GLOBAL, F_LINK, F_OP, F_PLACE  # noqa: E402

dgl.use_libxsmm(False)     # its generated kernels fail for edge_softmax's max-reduction on some CPUs
dgl.utils.set_num_threads(1)   # graphs of a search state are small: OpenMP threads only spin and wait

HIDDEN = 48
HEADS = 4
LAYERS = 3
RELATIONS = {"flow": F_FLOW, "flow_rev": F_FLOW, "link": F_LINK, "placed": F_PLACE, "hosts": F_PLACE}   # edge widths


class Params:
    """Named tf.Variables, created with a seeded initialiser; the unit of saving and loading."""

    def __init__(self, seed: int):
        self.variables: dict[str, tf.Variable] = {}
        self._rng = np.random.default_rng(seed)

    def weight(self, name: str, shape: tuple[int, ...]) -> tf.Variable:
        fan_in = shape[0] if len(shape) > 1 else 1
        init = self._rng.normal(0.0, np.sqrt(1.0 / max(fan_in, 1)), size=shape) if len(shape) > 1 else np.zeros(shape)
        v = tf.Variable(init.astype(np.float32), name=name.replace("/", "_"))
        self.variables[name] = v
        return v

    def ones(self, name: str, shape: tuple[int, ...]) -> tf.Variable:
        v = tf.Variable(np.ones(shape, np.float32), name=name.replace("/", "_"))
        self.variables[name] = v
        return v


class Dense(tf.Module):
    def __init__(self, params: Params, name: str, n_in: int, n_out: int):
        super().__init__(name=name.replace("/", "_"))
        self.w = params.weight(f"{name}/w", (n_in, n_out))
        self.b = params.weight(f"{name}/b", (n_out,))

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, self.w) + self.b


class MLP(tf.Module):
    """Linear -> ReLU -> linear."""

    def __init__(self, params: Params, name: str, n_in: int, n_hidden: int, n_out: int):
        super().__init__(name=name.replace("/", "_"))
        self.first = Dense(params, f"{name}/0", n_in, n_hidden)
        self.second = Dense(params, f"{name}/1", n_hidden, n_out)

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        return self.second(tf.nn.relu(self.first(x)))


class LayerNorm(tf.Module):
    def __init__(self, params: Params, name: str, width: int):
        super().__init__(name=name.replace("/", "_"))
        self.gain = params.ones(f"{name}/gain", (width,))
        self.bias = params.weight(f"{name}/bias", (width,))

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5) * self.gain + self.bias


class GraphAttention(tf.Module):
    """One round of multi-head attention over every relation of the state graph (module docstring)."""

    def __init__(self, params: Params, name: str, width: int, heads: int = HEADS):
        super().__init__(name=name.replace("/", "_"))
        self.heads, self.head_dim = heads, width // heads
        self.qkv = Dense(params, f"{name}/qkv", width, 3 * width)
        self.edge_value = Dense(params, f"{name}/edge_value", width, width)
        self.edge_score = Dense(params, f"{name}/edge_score", width, heads)
        self.update = MLP(params, f"{name}/update", 2 * width, 2 * width, width)
        self.norm = LayerNorm(params, f"{name}/norm", width)

    def __call__(self, graph: dgl.DGLGraph, h: tf.Tensor, edge_h: tf.Tensor) -> tf.Tensor:
        H, d = self.heads, self.head_dim
        q, k, v = tf.split(self.qkv(h), 3, axis=1)
        with graph.local_scope():
            graph.ndata["q"] = tf.reshape(q, (-1, H, d))
            graph.ndata["k"] = tf.reshape(k, (-1, H, d))
            graph.ndata["v"] = tf.reshape(v, (-1, H, d))
            graph.apply_edges(fn.u_dot_v("k", "q", "s"))
            score = graph.edata["s"] / np.sqrt(d) + tf.reshape(self.edge_score(edge_h), (-1, H, 1))
            alpha = dgl.ops.edge_softmax(graph, score)
            graph.edata["a"] = alpha
            graph.edata["ea"] = alpha * tf.reshape(self.edge_value(edge_h), (-1, H, d))
            graph.update_all(fn.u_mul_e("v", "a", "m"), fn.sum("m", "from_nodes"))
            graph.update_all(fn.copy_e("ea", "m"), fn.sum("m", "from_edges"))
            agg = tf.reshape(graph.ndata["from_nodes"] + graph.ndata["from_edges"], (-1, H * d))
        return self.norm(h + self.update(tf.concat([h, agg], axis=1)))


def relation_edges(b: dict[str, np.ndarray]) -> dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per canonical relation of a batch: (source ids, destination ids, edge features), ids per node type."""
    return {
        ("dev", "hosts", "op"): (b["place_dst"], b["place_src"], b["place_x"]),
        ("dev", "link", "dev"): (b["link_src"], b["link_dst"], b["link_x"]),
        ("op", "flow", "op"): (b["flow_src"], b["flow_dst"], b["flow_x"]),
        ("op", "flow_rev", "op"): (b["flow_dst"], b["flow_src"], b["flow_x"]),
        ("op", "placed", "dev"): (b["place_src"], b["place_dst"], b["place_x"]),
    }


def state_heterograph(b: dict[str, np.ndarray]) -> dgl.DGLGraph:
    """The DGL heterograph of a batch of states (``tag.gnn.features.batch_inputs``), features attached:
    ``ndata["x"]`` per node type, ``edata["x"]`` per relation."""
    i64 = lambda a: tf.constant(np.asarray(a, dtype=np.int64))   # noqa: E731
    rel = relation_edges(b)
    g = dgl.heterograph({r: (i64(s), i64(d)) for r, (s, d, _) in rel.items()},
                        num_nodes_dict={"op": len(b["op_x"]), "dev": len(b["dev_x"])}, idtype=tf.int64)
    g.nodes["op"].data["x"] = tf.constant(b["op_x"])
    g.nodes["dev"].data["x"] = tf.constant(b["dev_x"])
    for r, (_, _, x) in rel.items():
        g.edges[r].data["x"] = tf.constant(np.asarray(x, dtype=np.float32))
    return g


def homogeneous_view(b: dict[str, np.ndarray]) -> tuple[dgl.DGLGraph, list[tuple[str, str, str]], np.ndarray]:
    """The heterograph's homogeneous view, numbered as ``dgl.to_homogeneous`` numbers it (device groups
    first, then op groups; edges relation by relation in canonical order), built straight from the arrays
    (converting costs more than a forward pass). Returns (graph, relations in order, edge counts)."""
    n_dev = len(b["dev_x"])
    offset = {"dev": 0, "op": n_dev}
    rel = relation_edges(b)
    order = sorted(rel)
    src = np.concatenate([np.asarray(rel[r][0], np.int64) + offset[r[0]] for r in order])
    dst = np.concatenate([np.asarray(rel[r][1], np.int64) + offset[r[2]] for r in order])
    counts = np.array([len(rel[r][0]) for r in order])
    g = dgl.graph((tf.constant(src), tf.constant(dst)), num_nodes=n_dev + len(b["op_x"]), idtype=tf.int64)
    return g, order, counts


class PolicyNet(tf.Module):
    """Embeddings, LAYERS rounds of relation-aware attention, candidate decoder (module docstring)."""

    def __init__(self, seed: int = 0, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__(name="policy_net")
        self.params = p = Params(seed)
        self.hidden, self.layers = hidden, layers
        self.embed_op = Dense(p, "embed/op", F_OP, hidden)
        self.embed_dev = Dense(p, "embed/dev", F_DEV, hidden)
        self.embed_edge = {r: Dense(p, f"embed/{r}", width, hidden) for r, width in RELATIONS.items()}
        self.attention = [GraphAttention(p, f"layer{i}", hidden) for i in range(layers)]
        self.embed_cand = Dense(p, "decoder/cand", F_CAND, hidden)
        self.decoder = MLP(p, "decoder/mlp", 6 * hidden + F_GLOBAL, 2 * hidden, 1)

    @property
    def variables_by_name(self) -> dict[str, tf.Variable]:
        return self.params.variables

    def embeddings(self, b: dict[str, np.ndarray]) -> tuple[tf.Tensor, tf.Tensor]:
        """Node embeddings after message passing: (op groups [G, H], device groups [D, H])."""
        graph, order, counts = homogeneous_view(b)
        rel = relation_edges(b)
        edge_h = tf.concat([tf.nn.relu(self.embed_edge[r[1]](tf.constant(np.asarray(rel[r][2], np.float32))))
                            for r in order], axis=0)
        n_dev = len(b["dev_x"])
        h = tf.concat([self.embed_dev(tf.constant(b["dev_x"])), self.embed_op(tf.constant(b["op_x"]))], axis=0)
        for layer in self.attention:
            h = layer(graph, h, edge_h)
        return h[n_dev:], h[:n_dev]

    def log_probs(self, b: dict[str, np.ndarray]) -> tf.Tensor:
        """Log-probabilities of every candidate of every state in the batch (flat, in the batch's order)."""
        h_op, h_dev = self.embeddings(b)
        n_states = len(b["global_x"])
        n_cand = len(b["cand_x"])
        member_cand = tf.constant(b["member_cand"])
        w = tf.constant(b["member_w"])[:, None]
        dev_h = tf.gather(h_dev, b["member_dev"])
        mean_pool = tf.math.unsorted_segment_sum(w * dev_h, member_cand, n_cand)
        max_pool = tf.math.unsorted_segment_max(dev_h, member_cand, n_cand)
        max_pool = tf.where(tf.math.is_finite(max_pool), max_pool, tf.zeros_like(max_pool))
        op_ctx = tf.math.unsorted_segment_mean(h_op, b["op_graph"], n_states)
        dev_ctx = tf.math.unsorted_segment_mean(h_dev, b["dev_graph"], n_states)
        target_h = tf.gather(h_op, b["targets"])
        per_state = tf.concat([target_h, op_ctx, dev_ctx, tf.constant(b["global_x"])], axis=1)
        cand_graph = b["cand_graph"]
        x = tf.concat([tf.gather(per_state, cand_graph), mean_pool, max_pool,
                       tf.nn.relu(self.embed_cand(tf.constant(b["cand_x"])))], axis=1)
        scores = tf.squeeze(self.decoder(x), axis=1)
        top = tf.math.unsorted_segment_max(scores, cand_graph, n_states)
        shifted = scores - tf.gather(top, cand_graph)
        log_z = tf.math.log(tf.math.unsorted_segment_sum(tf.exp(shifted), cand_graph, n_states))
        return shifted - tf.gather(log_z, cand_graph)

    def save_npz(self, path: str, extra: dict[str, np.ndarray] | None = None) -> None:
        """Write every parameter (and EXTRA arrays, names starting with ``__``) to a plain .npz."""
        arrays = {name: v.numpy() for name, v in self.params.variables.items()}
        arrays.update(extra or {})
        np.savez_compressed(path, **arrays)

    def load_npz(self, path: str) -> dict[str, np.ndarray]:
        """Set the parameters from a .npz written by ``save_npz``; returns its extra arrays."""
        extra = {}
        with np.load(path, allow_pickle=False) as data:
            names = set(data.files)
            for name, v in self.params.variables.items():
                if name not in names:
                    raise ValueError(f"{path}: no parameter {name!r} (saved by another network version?)")
                v.assign(data[name])
            for name in names:
                if name.startswith("__"):
                    extra[name] = data[name]
        return extra
