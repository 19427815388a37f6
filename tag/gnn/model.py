"""The policy network: a graph encoder run once per search and a light head run per tree node.

Encoder (DGL, once per ``SearchEnv``): a heterograph of op groups and device groups with the features no
search state changes (``tag.gnn.features.EncoderInput``): node types ``op`` and ``dev``; relations ``flow``
(op -> op, forward data flow), ``flow_rev`` (its reverse) and ``link`` (dev -> dev), each with edge
features. Node and edge features are embedded by linear maps per node type / relation (the relation's
embedding tells the attention which relation an edge belongs to); then ``LAYERS`` rounds of multi-head
attention over the heterograph's homogeneous view (for edge u -> v: score = <W_q h_v, W_k h_u> / sqrt(d)
+ w . e_uv per head (``fn.u_dot_v``), softmax over v's incoming edges (``dgl.ops.edge_softmax``), message
= score * (W_v h_u + W_e e_uv), summed with ``update_all``), and a residual MLP with layer normalisation.
The homogeneous view is built straight from the arrays with ``dgl.to_homogeneous``'s numbering
(``homogeneous_view``). Each candidate action's placement is pooled from the device-group embeddings
(mean weighted by device share, and max), also once per search.

Head (per tree node, ``tag.gnn.features.NodeInput``): for each allowed candidate of the group decided
next, [the group's embedding, graph-pooled op and device context, the node's features, the candidate's
pooled placement, its embedded features] go through an MLP to a score; the score is *added* to the
default prior's logit (the uniform strategies' values, ``tag.search.mcts.uniform_value_prior``) and a
log-softmax over the node's candidates gives log-probabilities. The last layer starts at zero, so an
untrained network is the default prior and training learns a correction. Nothing depends on
device-group numbering (device groups enter as nodes, through symmetric aggregations only).

Training runs everything in TensorFlow (``log_probs``). Inference runs the encoder in TensorFlow once per
search and the head in numpy over tables made from the encoder's output (``encode_env`` ->
``EncodedEnv.log_probs``): the head's first layer is split by input block, so the parts that depend only on
the group or the candidate are multiplied once per search, and a node costs a few small numpy products.

Layers are ``tf.Module`` objects with DGL's TensorFlow backend (``dgl.function`` built-ins); Keras layers
are not used. Parameters save to / load from a plain ``.npz`` (``save_npz`` / ``load_npz``).

Example::

    from tag.gnn.model import PolicyNet
    from tag.gnn.features import encoder_input, node_input
    net = PolicyNet(seed=0)
    enc = net.encode_env(encoder_input(env))                       # once per search
    logp = enc.log_probs(node_input(env, order, (), env.allowed[order[0]]))   # per tree node
"""
from __future__ import annotations

import os

os.environ.setdefault("DGLBACKEND", "tensorflow")

from typing import TYPE_CHECKING  # noqa: E402

import dgl  # noqa: E402
import dgl.function as fn  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tag.gnn.features import F_CAND, F_DEV, F_FLOW, F_GLOBAL, F_LINK, F_OP  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from tag.gnn.features import EncoderInput, NodeInput

dgl.use_libxsmm(False)     # its generated kernels fail for edge_softmax's max-reduction on some CPUs
dgl.utils.set_num_threads(1)   # graphs of a search state are small: OpenMP threads only spin and wait

HIDDEN = 48
HEADS = 4
LAYERS = 3
RELATIONS = {"flow": F_FLOW, "flow_rev": F_FLOW, "link": F_LINK}   # edge widths


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
        ("dev", "link", "dev"): (b["link_src"], b["link_dst"], b["link_x"]),
        ("op", "flow", "op"): (b["flow_src"], b["flow_dst"], b["flow_x"]),
        ("op", "flow_rev", "op"): (b["flow_dst"], b["flow_src"], b["flow_x"]),
    }


def state_heterograph(b: dict[str, np.ndarray]) -> dgl.DGLGraph:
    """The DGL heterograph of a batch of environments (``tag.gnn.features.batch_encoders``), features
    attached: ``ndata["x"]`` per node type, ``edata["x"]`` per relation."""
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


# the head's first layer, split by input block (rows of decoder/mlp/0/w, in this order)
HEAD_BLOCKS = ("target", "op_ctx", "dev_ctx", "global", "mean_pool", "max_pool", "cand")


class PolicyNet(tf.Module):
    """Encoder (LAYERS rounds of relation-aware attention) and per-node head (module docstring)."""

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
        self.decoder.second.w.assign(tf.zeros_like(self.decoder.second.w))   # untrained: the default prior

    @property
    def variables_by_name(self) -> dict[str, tf.Variable]:
        return self.params.variables

    def block_widths(self) -> dict[str, int]:
        """Width of each input block of the head's first layer (``HEAD_BLOCKS``)."""
        H = self.hidden
        return {"target": H, "op_ctx": H, "dev_ctx": H, "global": F_GLOBAL, "mean_pool": H, "max_pool": H, "cand": H}

    def encode(self, b: dict[str, np.ndarray]) -> dict[str, tf.Tensor]:
        """Encoder outputs of a ``batch_encoders`` batch: ``h_op`` [G, H], ``h_dev`` [D, H], ``mean_pool`` and
        ``max_pool`` [candidates, H] (candidates' placements), ``op_ctx`` / ``dev_ctx`` [environments, H]."""
        graph, order, counts = homogeneous_view(b)
        rel = relation_edges(b)
        edge_h = tf.concat([tf.nn.relu(self.embed_edge[r[1]](tf.constant(np.asarray(rel[r][2], np.float32))))
                            for r in order], axis=0)
        n_dev = len(b["dev_x"])
        h = tf.concat([self.embed_dev(tf.constant(b["dev_x"])), self.embed_op(tf.constant(b["op_x"]))], axis=0)
        for layer in self.attention:
            h = layer(graph, h, edge_h)
        h_op, h_dev = h[n_dev:], h[:n_dev]
        n_cand = int(b["num_candidates"])
        member_cand = tf.constant(b["member_cand"])
        dev_h = tf.gather(h_dev, b["member_dev"])
        mean_pool = tf.math.unsorted_segment_sum(tf.constant(b["member_w"])[:, None] * dev_h, member_cand, n_cand)
        max_pool = tf.math.unsorted_segment_max(dev_h, member_cand, n_cand)
        max_pool = tf.where(tf.math.is_finite(max_pool), max_pool, tf.zeros_like(max_pool))
        n_env = len(b["op_offset"])
        return {"h_op": h_op, "h_dev": h_dev, "mean_pool": mean_pool, "max_pool": max_pool,
                "op_ctx": tf.math.unsorted_segment_mean(h_op, b["op_graph"], n_env),
                "dev_ctx": tf.math.unsorted_segment_mean(h_dev, b["dev_graph"], n_env)}

    def log_probs(self, enc: dict[str, tf.Tensor], nodes: dict[str, np.ndarray]) -> tf.Tensor:
        """Log-probabilities of every candidate of every node of a ``batch_nodes`` batch over the encoder
        outputs ENC (flat, in the batch's order)."""
        cand_node, n_nodes = nodes["cand_node"], len(nodes["node_env"])
        env = nodes["node_env"]
        per_node = tf.concat([tf.gather(enc["h_op"], nodes["targets"]), tf.gather(enc["op_ctx"], env),
                              tf.gather(enc["dev_ctx"], env), tf.constant(nodes["global_x"])], axis=1)
        x = tf.concat([tf.gather(per_node, cand_node), tf.gather(enc["mean_pool"], nodes["cands"]),
                       tf.gather(enc["max_pool"], nodes["cands"]),
                       tf.nn.relu(self.embed_cand(tf.constant(nodes["cand_x"])))], axis=1)
        scores = tf.squeeze(self.decoder(x), axis=1) + tf.constant(nodes["prior_logit"])
        top = tf.math.unsorted_segment_max(scores, cand_node, n_nodes)
        shifted = scores - tf.gather(top, cand_node)
        log_z = tf.math.log(tf.math.unsorted_segment_sum(tf.exp(shifted), cand_node, n_nodes))
        return shifted - tf.gather(log_z, cand_node)

    def encode_env(self, x: "EncoderInput") -> "EncodedEnv":
        """One environment's encoder output as numpy tables for the per-node head (``EncodedEnv``)."""
        from tag.gnn.features import batch_encoders
        enc = {k: v.numpy().astype(np.float64) for k, v in self.encode(batch_encoders([x])).items()}
        return EncodedEnv(self, enc)

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
                if name not in names or data[name].shape != tuple(v.shape):
                    raise ValueError(f"{path}: no parameter {name!r} of shape {tuple(v.shape)} "
                                     "(saved by another network version?)")
                v.assign(data[name])
            for name in names:
                if name.startswith("__"):
                    extra[name] = data[name]
        return extra


class EncodedEnv:
    """One environment after the encoder: numpy tables for the head, which then costs a few small products
    per tree node (``log_probs``); the same function as ``PolicyNet.log_probs`` (float64 here)."""

    def __init__(self, net: PolicyNet, enc: dict[str, np.ndarray]):
        w1 = net.decoder.first.w.numpy().astype(np.float64)
        blocks, start = {}, 0
        for name in HEAD_BLOCKS:
            width = net.block_widths()[name]
            blocks[name] = w1[start:start + width]
            start += width
        self.per_group = enc["h_op"] @ blocks["target"]                                   # [G, 2H]
        self.base = (enc["op_ctx"][0] @ blocks["op_ctx"] + enc["dev_ctx"][0] @ blocks["dev_ctx"]
                     + net.decoder.first.b.numpy().astype(np.float64))                    # [2H]
        self.per_cand = enc["mean_pool"] @ blocks["mean_pool"] + enc["max_pool"] @ blocks["max_pool"]   # [C, 2H]
        self.w_global = blocks["global"]
        self.w_cand = blocks["cand"]
        self.embed_w = net.embed_cand.w.numpy().astype(np.float64)
        self.embed_b = net.embed_cand.b.numpy().astype(np.float64)
        self.out_w = net.decoder.second.w.numpy().astype(np.float64)[:, 0]
        self.out_b = float(net.decoder.second.b.numpy()[0])

    def log_probs(self, x: "NodeInput") -> np.ndarray:
        """Log-probabilities over X's allowed candidates."""
        cand_h = np.maximum(x.cand_x @ self.embed_w + self.embed_b, 0.0)
        pre = (self.per_group[x.target] + self.base + x.global_x @ self.w_global)[None, :] \
            + self.per_cand[x.allowed] + cand_h @ self.w_cand
        scores = np.maximum(pre, 0.0) @ self.out_w + self.out_b + x.prior_logit
        scores -= scores.max()
        return scores - np.log(np.exp(scores).sum())
