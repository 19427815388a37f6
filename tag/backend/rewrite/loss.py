"""Loss: gradient seeds and loss weights that keep the replicated step exact, and the fetches.

A TF1 gradient starts from a seed (``gradients/grad_ys_0``, a Fill of ones). When the loss is a batch
mean, the seed of an instance on ``s`` of ``B`` examples is set to ``s / B``; then every backward
tensor of the instance equals the matching slice of the single-device backward tensor and every
weight gradient is an exact partial sum, so sums of partial sums are the single-device gradient and
batch-axis tensors can be re-split freely between groups. The loss the result reports is
``sum_d (s_d / B) * loss_d``. A loss that sums over the batch keeps seed 1 and sums the replicas'
losses; a summed loss plus batch-independent terms cannot be split and is refused. The loss kind is
found by walking from the loss tensor back to its batch reduction (``Mean`` or ``Sum``/``L2Loss``).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    res.loss                           # 'loss': an AddN of the replicas' share-weighted losses
"""
from __future__ import annotations

import re

import numpy as np
from tensorflow.core.framework import node_def_pb2

from tag.errors import RewriteError

from .context import RewriteState
from .graph_edit import Instance, attr_type, split_tensor, tensor_name

# ops a loss may pass through between its batch reduction and the loss tensor
_LOSS_PASSTHROUGH = frozenset({"Identity", "AddV2", "Add", "AddN", "Sub", "Mul", "RealDiv", "Div", "Cast", "Neg",
                               "Reshape", "Squeeze"})
_SEED_RE = re.compile(r"(^|/)grad_ys_\d+$")   # tf.gradients' default grad_ys: Fill(shape(loss), 1)


def find_seeds(st: RewriteState) -> set[str]:
    """The TF1 gradient seeds among the kept ops (Fills named gradients/grad_ys_N)."""
    return {n for n in st.order if st.nodes[n].op == "Fill" and _SEED_RE.search(n)}


def check_seeds(st: RewriteState) -> None:
    """RewriteError when replicas split the batch but there is no seed to weight their gradients by."""
    if not st.seeds and any(r != st.full_batch for placements in st.placements.values()
                              for r, _ in placements):
        raise RewriteError(f"train op {st.train_op!r}: no TF1 gradient seed (a Fill named gradients/grad_ys_N) "
                           f"was found, so replicas' gradients cannot be weighted by their batch shares")


def loss_kind(st: RewriteState) -> str:
    """'mean' if the loss averages over the batch (instances weight their seeds and losses by
    s / B), 'sum' if it sums over it (weights 1); found by walking from the loss to its batch reduction."""
    t, steps, constant_term = st.loss, 0, None
    while t and steps < 64:
        steps += 1
        node = st.nodes[split_tensor(t)[0]]
        if node.op == "Mean":
            return "mean"
        if node.op in ("Sum", "L2Loss"):
            if constant_term is not None:
                raise RewriteError(f"loss {st.loss!r} sums over the batch and adds {constant_term!r}, which does "
                                   f"not depend on the batch; replicas cannot share such a loss (use a mean)")
            return "sum"
        data = [i for i in node.input if not i.startswith("^")]
        batch_inputs = [i for i in data if st.batch_dependent[split_tensor(i)[0]]]
        if node.op not in _LOSS_PASSTHROUGH or not batch_inputs:
            break
        if node.op in ("AddV2", "Add", "AddN", "Sub") and len(batch_inputs) < len(data) and constant_term is None:
            constant_term = next(i for i in data if i not in batch_inputs)
        t = batch_inputs[0]
    return "mean"


def scale_seed(st: RewriteState, n: str, name: str, data: list[str], size: int, dev: int) -> None:
    """For instance NAME of seed N on SIZE examples (a mean loss): its fill value becomes SIZE / B."""
    if size != st.batch and st.loss_is_mean:
        dtype = st.dtype(tensor_name(n, 0))
        c = st.const(f"{name}/tag_seed_scale", np.array(size / st.batch, dtype=dtype.as_numpy_dtype), dev)
        data[1] = c


# -------------------------------------------------------------------------------- fetches
def fetches(st: RewriteState) -> None:
    """Names to run in the result: the train op, the (global) loss and the init op (``fetch_train``,
    ``fetch_loss``, ``fetch_init``)."""
    st.fetch_train = _group_fetch(st, st.train_op)
    st.fetch_init = _group_fetch(st, st.init) if st.init else None
    loss = None
    if st.loss:
        insts = [i for i in st.instances[st.loss] if i.primary]
        if len(insts) == 1:
            loss = insts[0].name
        else:
            loss = _weighted_loss(st, st.loss, insts)
    st.fetch_loss = loss


def _group_fetch(st: RewriteState, n: str) -> str:
    """N itself when it has one instance, else a NoOp named N depending on all of them."""
    insts = [i for i in st.instances[n] if i.primary]
    if len(insts) == 1:
        return insts[0].name
    node = node_def_pb2.NodeDef(name=n, op="NoOp", device=st.topo.tf_device(insts[0].dev))
    node.input.extend("^" + i.name for i in insts)
    st.out_nodes.append(node)
    return n


def _weighted_loss(st: RewriteState, n: str, insts: list[Instance]) -> str:
    """Loss N of the global batch, named N: the replicas' losses weighted by s / B (mean) or 1 (sum)."""
    ranges = sorted(i.rng for i in insts)
    if all(r == st.full_batch for r in ranges):
        return insts[0].name
    if st.tiling(n, st.full_batch) is None:
        raise RewriteError(f"loss {n!r}: its instances do not tile the batch")
    dev = insts[0].dev
    dtype = st.dtype(tensor_name(n, 0))
    terms = []
    for i in sorted(insts, key=lambda i: i.rng):
        weight = (i.rng[1] - i.rng[0]) / st.batch if st.loss_is_mean else 1.0
        w = st.const(f"{n}/tag_weight_{i.asked_dev}", np.array(weight, dtype=dtype.as_numpy_dtype), i.dev)
        name = st.fresh(f"{n}/tag_weighted_{i.asked_dev}")
        node = node_def_pb2.NodeDef(name=name, op="Mul", device=st.topo.tf_device(i.dev))
        node.input.extend([i.name, w])
        node.attr["T"].CopyFrom(attr_type(dtype))
        st.out_nodes.append(node)
        terms.append(name)
    node = node_def_pb2.NodeDef(name=n, op="AddN", device=st.topo.tf_device(dev))
    node.input.extend(terms)
    node.attr["N"].i = len(terms)
    node.attr["T"].CopyFrom(attr_type(dtype))
    st.out_nodes.append(node)
    return n
