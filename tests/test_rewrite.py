"""tag.rewrite: rewritten graphs have the right structure and train exactly like the original.

Fast tests check the structure of rewritten graphs (devices, batch slices, gradient seeds, collective
keys, parameter-server placement, rescaled batch constants, errors). The slow tests run rewritten zoo
models on a cluster of real TF servers (in this process, on loopback ports) and compare loss and
updated weights with the original graph on one device over 3 steps (``test_same_training``).
"""
from __future__ import annotations

import dataclasses
import os
from functools import lru_cache

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tag  # noqa: E402
from bounded import bounded  # noqa: E402
from helpers import in_process_servers, train_host_programs, zero_gradient_variables  # noqa: E402
from tag import zoo  # noqa: E402
from tag.backend.rewrite import RewriteResult, collective_group_key, rewrite  # noqa: E402
from tag.backend.runtime import free_ports, session_config  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.compress import eligible_gradients  # noqa: E402
from tag.errors import RewriteError, StrategyError  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.types import Action, Grouping, Strategy, batch_shares  # noqa: E402

tf1 = tf.compat.v1
STEPS = 3
RTOL = 1e-5

# Small versions of the zoo models (named options; fewer layers where the model allows it).
MODELS = {
    "mlp": dict(hidden=(16, 16)),
    "vgg19": dict(image_size=32, num_classes=5),
    "resnet50": dict(image_size=64, num_classes=5),
    "transformer": dict(seq_len=8, vocab_size=50, num_layers=1, d_model=16, d_ff=32, num_heads=2),
    "bert_base": dict(seq_len=8, vocab_size=50, num_layers=2, hidden_size=16, intermediate_size=32,
                      num_heads=2, max_position=16),
}
BATCH = 4
BATCHNORM = {"resnet50"}   # models whose replicas compute their own batch statistics


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def topology(ports, tflops):
    """A loopback topology: one CPU host per port, peak TFLOP/s as given (shares follow them)."""
    hosts = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU memory_gib: 2 '
        f'peak_tflops: {f} memory_bandwidth_gbs: 10 }} }}' for i, (p, f) in enumerate(zip(ports, tflops, strict=True)))
    return parse_topology(f'name: "rw"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n')


@lru_cache(maxsize=None)
def model(name: str, batch: int = BATCH):
    gd = zoo.training_graph(name, batch_size=batch, **MODELS[name])
    return gd, tag.analyze(gd)


def one_group(ir) -> Grouping:
    return Grouping(np.zeros(len(ir.ops), dtype=np.int64), ["all"])


def strategy(mode: str, ir, topo, *, batchnorm: bool = False) -> Strategy:
    """allreduce / ps / partition over every device group, or a mixed strategy over real op groups."""
    grouping = group_ops(ir, 12)
    everything = tuple(g.index for g in topo.groups)
    ps_device = topo.num_devices - 1
    if mode == "allreduce":
        return builtin_strategy("dp_allreduce", ir, topo, grouping)
    if mode == "ps":
        return Strategy(grouping, [Action(everything, "ps", ps_device=ps_device)] * grouping.num_groups)
    part = builtin_strategy("partition", ir, topo, grouping)
    assert len(set(part.partition.values())) >= 2, "the partition baseline should use several devices"
    if mode == "partition":
        return part
    assert mode == "mixed"
    # Every third op group allreduce, ps, partition. With BatchNorm (per-replica statistics by design)
    # the mix is allreduce + ps over the same devices, so that a per-replica reference exists.
    actions, partition = [], {}
    for g in range(grouping.num_groups):
        kind = ("allreduce", "ps") if batchnorm else ("allreduce", "ps", "partition")
        mode_g = kind[g % len(kind)]
        if mode_g == "partition":
            actions.append(Action(everything, "partition"))
            partition.update({int(i): part.partition[int(i)] for i in grouping.members(g)})
        else:
            actions.append(Action(everything, mode_g, ps_device=ps_device if mode_g == "ps" else None))
    return Strategy(grouping, actions, partition)


def feeds_for(gd, ir, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """STEPS batches for the graph's batch placeholders (labels within the model's classes)."""
    nodes = {n.name: n for n in gd.node}
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        fd = {}
        for name in ir.inputs:
            node = nodes[name]
            shape = [d.size for d in node.attr["shape"].shape.dim]
            if node.attr["dtype"].type == tf.int32.as_datatype_enum:
                fd[name] = rng.randint(0, 2, shape).astype(np.int32)   # token ids, masks, labels
            else:
                fd[name] = rng.randn(*shape).astype(np.float32)
        out.append(fd)
    return out


def local_config():
    """Sessions of these tests skip Grappler: it only costs set-up time on graphs run 3 steps."""
    cfg = tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    return cfg


def cluster_config():
    cfg = bounded(session_config())
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    return cfg


def _reads(g, handles):
    with g.as_default():
        return [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(h + ":0"),
                                          dtype=g.get_operation_by_name(h).get_attr("dtype")) for h in handles]


def _import(gd) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    return g


def trainables(ir):
    return [v for v in ir.variables if v.kind == "trainable"]


def reference(gd, ir, batches):
    """The original graph on one local device: per step (loss, weights), and step-0 gradients."""
    g = _import(gd)
    vs = trainables(ir)
    reads = _reads(g, [v.name for v in vs])
    out = []
    with tf1.Session(graph=g, config=local_config()) as s:
        s.run("init")
        grads0 = s.run([v.gradient for v in vs], _named(batches[0]))
        for fd in batches:
            loss, _ = s.run(["loss:0", "train_op"], _named(fd))
            out.append((float(loss), s.run(reads)))
    return out, grads0


def per_replica_reference(name, ir, batches, shares):
    """Reference with per-replica BatchNorm statistics, from original graphs only.

    Replica d's gradients come from the original model built at batch s_d (weights set to the current
    ones) on its slice of the batch; they are combined as sum_d (s_d / B) g_d and fed to the original
    full-batch graph's optimizer apply ops (TF1 lets one feed any tensor). The loss is
    sum_d (s_d / B) loss_d. This is what the rewritten graph computes, with BatchNorm statistics per
    replica by design (as Horovod and MirroredStrategy).
    """
    B = sum(shares)
    vs = trainables(ir)
    gd, _ = model(name, B)
    g_full = _import(gd)
    full_reads = _reads(g_full, [v.name for v in vs])
    sessions = {}
    for s_d in sorted(set(shares)):
        g = _import(model(name, s_d)[0])
        with g.as_default():
            phs = [tf1.placeholder(g.get_operation_by_name(v.name).get_attr("dtype")) for v in vs]
            assign = tf.group(*[tf.raw_ops.AssignVariableOp(resource=g.get_tensor_by_name(v.name + ":0"), value=p)
                                for v, p in zip(vs, phs, strict=True)])
        sess = tf1.Session(graph=g, config=local_config())
        sess.run("init")
        sessions[s_d] = (sess, phs, assign)
    out, grads0 = [], None
    with tf1.Session(graph=g_full, config=local_config()) as full:
        full.run("init")
        for fd in batches:
            weights = full.run(full_reads)
            total = [np.zeros_like(w) for w in weights]
            loss, lo = 0.0, 0
            for s_d in shares:
                sess, phs, assign = sessions[s_d]
                sess.run(assign, dict(zip(phs, weights, strict=True)))
                part = {k + ":0": v[lo:lo + s_d] for k, v in fd.items()}
                l_d, g_d = sess.run(["loss:0", [v.gradient for v in vs]], part)
                loss += s_d / B * float(l_d)
                total = [t + s_d / B * gg for t, gg in zip(total, g_d, strict=True)]
                lo += s_d
            grads0 = total if grads0 is None else grads0
            feed = _named(fd)
            feed.update({v.gradient: t for v, t in zip(vs, total, strict=True)})
            full.run("train_op", feed)
            out.append((loss, full.run(full_reads)))
    for sess, _, _ in sessions.values():
        sess.close()
    return out, grads0


def _named(fd):
    return {k + ":0": v for k, v in fd.items()}


def run_rewritten(res: RewriteResult, ir, batches):
    """Per step: (loss, {variable: [values of each copy]}), RES run as per-host programs (a thread and a session
    per host of its topology)."""
    return train_host_programs(res, ir, batches, config=cluster_config())


ADAPTIVE_NOISE = 1e-4   # with an adaptive optimizer: elements whose gradient is below this of their variable's largest


def assert_same_training(got, ref, grads0, ir, learning_rate, rtol=RTOL, adaptive: bool = False):
    """Loss and every trainable weight within RTOL (relative to the weight's largest magnitude).

    Parameters whose exact gradient is zero by construction (a conv bias before BatchNorm, an
    attention key bias: softmax ignores it) have gradients of rounding noise only; an adaptive
    optimizer turns that noise into steps of up to the learning rate. Those parameters (gradient
    below 1e-6 of the largest one in the reference) are checked against that bound instead.

    ADAPTIVE (Adam): Adam moves an element by about lr * g / (|g| + eps), so where |g| is small its step
    follows the float32 rounding of g (which depends on the order of summation: micro-batches, replicas)
    up to 1 / (|g| + eps) times; a step with the exact gradient can differ by 1e-4 of a zero-initialised
    bias (plain data parallelism too). Elements whose step-0 gradient is at most ``ADAPTIVE_NOISE`` of their
    variable's largest are then held to the learning-rate bound; every other element to RTOL.
    """
    vs = trainables(ir)
    noise = zero_gradient_variables([v.name for v in vs], grads0)
    g0 = dict(zip([v.name for v in vs], grads0, strict=True))
    assert len(noise) < len(vs) / 3, f"too many zero-gradient parameters: {sorted(noise)}"
    for step, ((loss, weights), (ref_loss, ref_weights)) in enumerate(zip(got, ref, strict=True)):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"step {step}: loss {loss} vs {ref_loss}"
        for v, r in zip(vs, ref_weights, strict=True):
            copies = weights[v.name]
            scale = float(np.max(np.abs(r))) or 1.0
            for c in copies[1:]:   # replicas' copies stay identical
                assert np.max(np.abs(c - copies[0])) <= 1e-6 * scale, f"step {step}: copies of {v.name} differ"
            diff = np.abs(copies[0] - r)
            if adaptive and np.shape(g0[v.name]) == diff.shape:
                small = np.abs(g0[v.name]) <= ADAPTIVE_NOISE * float(np.max(np.abs(g0[v.name])))
                assert float(np.max(diff[small], initial=0.0)) <= 2 * (step + 1) * learning_rate, \
                    f"step {step}: {v.name} moved {float(np.max(diff[small], initial=0.0))}"
                diff = np.where(small, 0.0, diff)
            err = float(np.max(diff))
            if v.name in noise:
                assert err <= 2 * (step + 1) * learning_rate, f"step {step}: {v.name} moved {err}"
            else:
                assert err <= rtol * scale, f"step {step}: {v.name} differs by {err / scale:.2e} (relative)"


# ------------------------------------------------------------------------------------------------
# fast: structure of rewritten graphs
# ------------------------------------------------------------------------------------------------

UNEVEN = topology([23401, 23402], [0.15, 0.05])      # shares 3:1
THREE = topology([23401, 23402, 23403], [0.1, 0.05, 0.05])


def mlp(batch=8):
    return model("mlp", batch)


def _nodes(res):
    return {n.name: n for n in res.graph_def.node}


def test_package_layout_and_graph_edit_helpers():
    """The rewriter is a package by concern, run as passes; its public names and the tensor-name helpers."""
    import tag.backend.rewrite as pkg
    from tag.backend.rewrite.graph_edit import canonical, split_tensor, tensor_name, tensor_proto
    from tag.backend.rewrite.passes import PASSES

    assert set(pkg.__all__) == {"RewriteResult", "rewrite", "collective_group_key"}
    assert split_tensor("a/b:2") == ("a/b", 2) and split_tensor("a/b") == ("a/b", 0)
    assert tensor_name("a", 0) == "a" and tensor_name("a", 3) == "a:3" and canonical("a:0") == "a"
    value = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert np.array_equal(tf.make_ndarray(tensor_proto(value)), value)
    concerns = {p.run.__module__.rsplit(".", 1)[-1] for p in PASSES if p.run.__module__.startswith(pkg.__name__)}
    assert {"loss", "sfb", "collectives", "instances", "batch_split", "placement", "pipeline", "structure",
            "result"} <= concerns


def test_every_op_on_a_topology_device_and_names_kept():
    gd, ir = mlp()
    res = rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")]), UNEVEN)
    devices = {UNEVEN.tf_device(d) for d in range(UNEVEN.num_devices)}
    assert all(n.device in devices for n in res.graph_def.node)
    nodes = _nodes(res)
    for name in ("input", "labels"):               # original placeholders, full batch, one copy
        assert nodes[name].op == "Placeholder" and [d.size for d in nodes[name].attr["shape"].shape.dim][0] == 8
    assert res.inputs == ["input", "labels"] and res.batch_size == 8
    assert res.replicas == {0: [(0, 0, 6), (1, 6, 8)]}
    assert nodes[res.train_op].op == "NoOp" and res.loss == "loss" and nodes["loss"].op == "AddN"
    kernel = "mlp/dense_0/kernel"
    assert res.variables[kernel] == [f"{kernel}/replica_0", f"{kernel}/replica_1"]
    assert [nodes[c].device for c in res.variables[kernel]] == [UNEVEN.tf_device(0), UNEVEN.tf_device(1)]


def test_uneven_batch_slices_and_seed_scaling():
    gd, ir = mlp()
    assert batch_shares([d.peak_flops for d in UNEVEN.devices], 8) == [6, 2]
    res = rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")]), UNEVEN)
    nodes = _nodes(res)
    value = lambda n: tf.make_ndarray(nodes[n].attr["value"].tensor)  # noqa: E731
    slices = {}                                      # replica's device -> the rows of the batch it gets
    for d in range(2):
        matmul = nodes[f"mlp/dense_0/MatMul/replica_{d}"]
        sl = nodes[matmul.input[0]]
        assert sl.op == "StridedSlice" and sl.input[0] == "input" and sl.device == nodes["input"].device
        slices[matmul.device] = (int(value(sl.input[1])[0]), int(value(sl.input[2])[0]))
    assert slices == {UNEVEN.tf_device(0): (0, 6), UNEVEN.tf_device(1): (6, 8)}
    # the gradient seed of replica d is s_d / B; the loss is the share-weighted sum of replica losses
    seeds = {n.device: float(value(n.input[1])) for n in res.graph_def.node
             if n.op == "Fill" and "grad_ys_0" in n.name}
    assert seeds == {UNEVEN.tf_device(0): 0.75, UNEVEN.tf_device(1): 0.25}
    weights = sorted(float(value(n.input[1])) for n in res.graph_def.node if n.name.startswith("loss/tag_weighted"))
    assert weights == [0.25, 0.75]
    # constants that hold the batch (static-shape gradient code) are rescaled per replica
    tiles = {n.device: value(n.name).tolist() for n in res.graph_def.node
             if n.op == "Const" and n.name.startswith("gradients/Mean_grad/Const/")}
    assert tiles == {UNEVEN.tf_device(0): [6], UNEVEN.tf_device(1): [2]}


def test_fusion_buckets_split_by_placement_and_size_and_the_rewrite_follows_them(monkeypatch):
    """Groups on the same replicas share a bucket, taken last group first and closed at the byte cap;
    groups on other replicas, parameter-server or single-device groups stay apart."""
    import tag.strategy.fusion as fusion
    from tag.strategy.fusion import bucket_leaders, fusion_buckets
    ALL, TWO, PS = Action((0, 1, 2), "allreduce"), Action((0, 1), "allreduce"), Action((0, 1, 2), "ps", ps_device=0)
    actions = [ALL, ALL, TWO, ALL, PS, ALL, Action((0,), "allreduce")]
    sizes = [5.0, 5.0, 1.0, 1.0, 1.0, 3.0, 1.0]
    replicated = [True] * 6 + [False]
    buckets = fusion_buckets(actions, sizes, replicated, exclude={1}, cap=4.0)
    assert buckets == [(5, 3), (0,), (2,)]
    assert bucket_leaders(buckets) == {5: 5, 3: 5, 0: 0, 2: 2}
    assert fusion_buckets(actions, sizes, replicated, cap=100.0) == [(5, 3, 1, 0), (2,)]
    # the rewrite of a 3-replica MLP whose groups fall into two buckets: two fused collectives
    gd, ir = mlp()
    grouping = group_ops(ir, 6)
    st = Strategy(grouping, [Action((0, 1, 2), "allreduce")] * grouping.num_groups)
    group_bytes = [0.0] * grouping.num_groups
    for v in trainables(ir):
        group_bytes[int(grouping.group_of_op[v.op])] += v.nbytes
    cap = min(b for b in group_bytes if b > 0)              # every group closes a bucket by itself
    want = fusion_buckets(st.actions, group_bytes, [True] * grouping.num_groups, cap=cap)
    assert len(want) >= 2
    def instance_keys(res) -> set:
        nodes = _nodes(res)
        return {int(tf.make_ndarray(nodes[n.input[3]].attr["value"].tensor)) for n in res.graph_def.node
                if n.op == "CollectiveReduceV2"}
    # the strategy's own bucket size (what tag.search.buckets chooses), and the module default alike
    assert len(instance_keys(rewrite(gd, ir, dataclasses.replace(st, bucket_bytes=cap), THREE))) == len(want)
    assert len(instance_keys(rewrite(gd, ir, st, THREE))) == 1
    monkeypatch.setattr(fusion, "FUSION_BUCKET_BYTES", cap)
    assert len(instance_keys(rewrite(gd, ir, st, THREE))) == len(want)


@pytest.mark.parametrize("fuse", [False, True])
def test_allreduce_collectives_keys(fuse):
    gd, ir = mlp()
    grouping = group_ops(ir, 6)
    st = Strategy(grouping, [Action((0, 1, 2), "allreduce")] * grouping.num_groups)
    res = rewrite(gd, ir, st, THREE, fuse_allreduce=fuse)
    nodes = _nodes(res)
    value = lambda n: int(tf.make_ndarray(nodes[n].attr["value"].tensor))  # noqa: E731
    by_instance = {}
    for n in res.graph_def.node:
        if n.op == "CollectiveReduceV2":
            size, group, inst = (value(i) for i in n.input[1:4])
            assert size == 3 and group == collective_group_key(THREE.tf_device(d) for d in range(3))
            assert n.attr["merge_op"].s == b"Add" and n.attr["final_op"].s == b"Id"
            by_instance.setdefault(inst, []).append(n.device)
    # every collective runs once on each of the 3 replicas, with its own instance key
    assert all(sorted(d) == sorted(THREE.tf_device(i) for i in range(3)) for d in by_instance.values())
    vs = trainables(ir)
    if fuse:   # one collective per fusion bucket (tag.strategy.fusion, as the simulator models it)
        groups = {int(grouping.group_of_op[ir.op_index[v.apply_op]]) for v in vs}
        assert len(by_instance) == 1 < len(groups) < len(vs)      # a small MLP: one bucket
        fused = [n for n in res.graph_def.node if n.op == "CollectiveReduceV2" and nodes[n.input[0]].op == "ConcatV2"]
        assert fused
    else:      # one per trainable variable
        assert len(by_instance) == len(vs)
    # every replica applies the update to its own copies
    applies = [n for n in res.graph_def.node if n.op == "ResourceApplyAdam"]
    assert len(applies) == 3 * len(vs)
    for a in applies:
        assert all(nodes[i.split(":")[0]].device == a.device for i in a.input[:3])


def test_ps_variables_on_the_parameter_server():
    gd, ir = mlp()
    res = rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1, 2), "ps", ps_device=2)]), THREE)
    nodes = _nodes(res)
    ps = THREE.tf_device(2)
    for v in ir.variables:
        assert [nodes[c].device for c in res.variables[v.name]] == [ps], v.name
    applies = [n for n in res.graph_def.node if n.op == "ResourceApplyAdam"]
    assert len(applies) == len(trainables(ir)) and all(a.device == ps for a in applies)
    for a in applies:                              # gradients of the 3 replicas summed there
        grad = nodes[a.input[-1].split(":")[0]]
        assert grad.op == "AddN" and grad.attr["N"].i == 3 and grad.device == ps
    assert not any(n.op.startswith("Collective") for n in res.graph_def.node)
    # forward ops still run on every replica, reading the variables from the server
    matmuls = [n for n in res.graph_def.node if n.name.startswith("mlp/dense_0/MatMul/replica_")]
    assert sorted(n.device for n in matmuls) == sorted(THREE.tf_device(i) for i in range(3))


def test_partition_ops_on_their_devices():
    gd, ir = mlp()
    grouping = group_ops(ir, 6)
    part = builtin_strategy("partition", ir, THREE, grouping)
    res = rewrite(gd, ir, part, THREE)
    nodes = _nodes(res)
    for i, op in enumerate(ir.ops):
        if op.type not in ("VarHandleOp",) and not any(
                nodes[x.lstrip("^").split(":")[0]].op == "VarHandleOp" for x in nodes[op.name].input):
            assert nodes[op.name].device == THREE.tf_device(part.partition[i]), op.name
    assert not any(n.op in ("StridedSlice", "ConcatV2") and n.name.startswith("tag/") for n in res.graph_def.node)
    # variables and their readers/updaters share a device (TF colocates resource ops)
    for n in res.graph_def.node:
        for i in n.input:
            src = nodes[i.lstrip("^").split(":")[0]]
            if not i.startswith("^") and src.op == "VarHandleOp":
                assert n.device == src.device


def test_batch_size_override_rescales_constants_like_a_rebuild():
    """The B=4 graph rewritten for a batch of 6 has the constants of the model built at batch 6."""
    name = "transformer"
    gd4, ir4 = model(name, 4)
    gd6, _ = model(name, 6)
    topo1 = topology([23401], [0.05])
    single = Strategy(one_group(ir4), [Action((0,), "partition")], partition={i: 0 for i in range(len(ir4.ops))})
    res = rewrite(gd4, ir4, single, topo1, batch_size=6)
    got = _nodes(res)
    want = {n.name: n for n in gd6.node}
    compared = 0
    for n, node in got.items():
        if node.op == "Const" and n in want:
            a, b = tf.make_ndarray(node.attr["value"].tensor), tf.make_ndarray(want[n].attr["value"].tensor)
            assert a.shape == b.shape and np.array_equal(a, b), n
            compared += 1
    assert compared > 100
    assert [d.size for d in got["input"].attr["shape"].shape.dim] == [6, 8]


def test_errors_name_the_op():
    gd, ir = mlp()
    good = Strategy(one_group(ir), [Action((0, 1), "allreduce")])
    with pytest.raises(RewriteError, match="'nope'"):
        rewrite(gd, ir, good, UNEVEN, train_op="nope")
    with pytest.raises(StrategyError, match="no device in strategy.partition"):
        rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "partition")]), UNEVEN)
    with pytest.raises(StrategyError, match="smaller than"):
        rewrite(gd, ir, good, UNEVEN, batch_size=1)
    # a TF1 while loop in the step cannot be replicated op by op
    bad = tf1.GraphDef()
    bad.CopyFrom(gd)
    node = next(n for n in bad.node if n.name == "mlp/dense_0/MatMul")
    node.op = "Enter"
    with pytest.raises(RewriteError, match="'mlp/dense_0/MatMul'"):
        rewrite(bad, ir, good, UNEVEN)


# ------------------------------------------------------------------------------------------------
# slow: same training as the original graph, on real TF servers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """Three TF servers in this process on loopback ports (collective leader set, isolated sessions)."""
    ports, servers = in_process_servers(3)
    return ports, servers[0].target


def bn_cnn_graph():
    """A small CNN with tf_keras BatchNorm behind a ``training`` tensor (If / StatelessIf + function
    library) and an unknown batch dimension (``[None, ...]`` placeholders)."""
    import tf_keras

    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 6, 6, 3], name="input")
        y = tf1.placeholder(tf.int32, [None], name="labels")
        training = tf1.placeholder_with_default(True, [], name="training")
        init = tf_keras.initializers.GlorotUniform
        h = tf_keras.layers.Conv2D(4, 3, kernel_initializer=init(seed=1), name="conv")(x)
        h = tf_keras.layers.BatchNormalization(name="bn")(h, training=training)
        h = tf_keras.layers.Flatten()(tf_keras.layers.ReLU()(h))
        logits = tf_keras.layers.Dense(3, kernel_initializer=init(seed=2), name="dense")(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        loss = tf.identity(loss, name="loss")
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        tf.group(tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss), *updates, name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "ps", "mixed"])
def test_function_library_batchnorm_unknown_batch(cluster, mode):
    """StatelessIf/If BatchNorm in a [None, ...] graph, shares 6:2: same training as the original graph run
    on each replica's slice with the gradients combined sum_d (s_d / B) g_d (per-replica statistics)."""
    ports, target = cluster
    gd = bn_cnn_graph()
    assert {"If", "StatelessIf"} <= {n.op for n in gd.node} and len(gd.library.function) > 0
    B = 8
    ir = tag.analyze(gd, batch_size=B)
    topo = topology(ports[:2], [0.15, 0.05])
    shares = batch_shares([d.peak_flops for d in topo.devices], B)
    assert shares == [6, 2]
    grouping = group_ops(ir, 6)
    if mode == "mixed":
        actions = [Action((0, 1), "allreduce") if g % 2 else Action((0, 1), "ps", ps_device=0)
                   for g in range(grouping.num_groups)]
    else:
        actions = [Action((0, 1), mode, ps_device=1 if mode == "ps" else None)] * grouping.num_groups
    res = rewrite(gd, ir, Strategy(grouping, actions), topo)
    assert len(res.graph_def.library.function) == len(gd.library.function)
    assert all(n.device for n in res.graph_def.node if n.op in ("If", "StatelessIf"))
    rng = np.random.RandomState(1)
    batches = [{"input": rng.randn(B, 6, 6, 3).astype(np.float32), "labels": rng.randint(0, 3, B).astype(np.int32)}
               for _ in range(STEPS)]
    # reference: the original graph on each slice, gradients combined and fed to the apply ops
    g = _import(gd)
    vs = trainables(ir)
    reads = _reads(g, [v.name for v in vs])
    ref, grads0 = [], None
    with tf1.Session(graph=g, config=local_config()) as s:
        s.run("init")
        for fd in batches:
            total, loss, lo = None, 0.0, 0
            for s_d in shares:
                part = {k + ":0": v[lo:lo + s_d] for k, v in fd.items()}
                l_d, g_d = s.run(["loss:0", [v.gradient for v in vs]], part)
                total = ([s_d / B * x for x in g_d] if total is None
                         else [t + s_d / B * x for t, x in zip(total, g_d, strict=True)])
                loss += s_d / B * float(l_d)
                lo += s_d
            grads0 = total if grads0 is None else grads0
            feed = _named(fd)
            feed.update({v.gradient: t for v, t in zip(vs, total, strict=True)})
            s.run("train_op", feed)
            ref.append((loss, s.run(reads)))
    got = run_rewritten(res, ir, batches)
    assert_same_training(got, ref, grads0, ir, 0.05)


def embedding_graph(use_resource: bool):
    """tf.gather on an embedding (IndexedSlices gradient, TF1 Adam's sparse Unique/ScatterAdd update)."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, 5], name="input")
        y = tf1.placeholder(tf.int32, [None], name="labels")
        emb = tf1.get_variable("emb", [20, 6], initializer=tf1.random_normal_initializer(seed=2),
                               use_resource=use_resource)
        w = tf1.get_variable("w", [6, 3], initializer=tf1.glorot_uniform_initializer(seed=3),
                             use_resource=use_resource)
        logits = tf.matmul(tf.reduce_mean(tf.gather(emb, ids), axis=1), w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tf1.train.AdamOptimizer(0.01).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "ps"])
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_sparse_gradients_and_ref_variables(cluster, mode, use_resource):
    """Sparse embedding updates (indices and values gathered to every updating device, then deduplicated
    there as on one device) and TF1 reference variables (VariableV2, ApplyAdam) train exactly alike."""
    ports, target = cluster
    gd = embedding_graph(use_resource)
    assert any(n.op in ("ResourceScatterAdd", "ScatterAdd") for n in gd.node)
    B = 8
    ir = tag.analyze(gd, batch_size=B)
    topo = topology(ports, [0.1, 0.05, 0.05])
    st = Strategy(one_group(ir), [Action((0, 1, 2), mode, ps_device=1 if mode == "ps" else None)])
    res = rewrite(gd, ir, st, topo)
    rng = np.random.RandomState(0)
    batches = [{"input:0": rng.randint(0, 20, (B, 5)).astype(np.int32),
                "labels:0": rng.randint(0, 3, B).astype(np.int32)} for _ in range(STEPS)]
    names = [v.name for v in ir.variables]          # every variable: weights, slots, beta powers

    def values(sess, graph, ops):
        out = []
        for n in ops:
            op = graph.get_operation_by_name(n)
            if op.type == "VarHandleOp":
                with graph.as_default():
                    out.append(sess.run(tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=op.get_attr("dtype"))))
            else:
                out.append(sess.run(op.outputs[0]))
        return out

    g = _import(gd)
    with tf1.Session(graph=g, config=local_config()) as s:
        s.run("init")
        ref = [(s.run(["loss:0", "train_op"], fd)[0], values(s, g, names)) for fd in batches]
    g = _import(res.graph_def)
    with tf1.Session(target, graph=g, config=cluster_config()) as s:
        s.run(res.init)
        for step, fd in enumerate(batches):
            loss = s.run([res.loss + ":0", res.train_op], fd)[0]
            assert abs(loss - ref[step][0]) <= RTOL * abs(ref[step][0])
            for name, r in zip(names, ref[step][1], strict=True):
                for copy in values(s, g, res.variables[name]):
                    assert np.max(np.abs(copy - r)) <= RTOL * np.max(np.abs(r)), (step, name)


def small_mlp(loss_kind: str):
    """A [None, 10] MLP whose loss is a batch mean (+ L2), a batch sum, or a sum / constant (+ L2)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 10], name="input")
        y = tf1.placeholder(tf.int32, [None], name="labels")
        w1 = tf1.get_variable("w1", [10, 7], initializer=tf1.glorot_uniform_initializer(seed=1))
        w2 = tf1.get_variable("w2", [7, 3], initializer=tf1.glorot_uniform_initializer(seed=2))
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(tf.nn.relu(x @ w1), w2))
        l2 = 0.01 * tf.nn.l2_loss(w1)
        loss = {"mean+l2": tf.reduce_mean(xent) + l2, "sum": tf.reduce_sum(xent),
                "sum/8": tf.reduce_sum(xent) / 8.0, "sum+l2": tf.reduce_sum(xent) + l2}[loss_kind]
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.identity(loss, name="loss"), name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    return g.as_graph_def()


@pytest.mark.slow
@pytest.mark.parametrize("loss_kind", ["mean+l2", "sum", "sum/8"])
def test_mean_and_sum_losses(cluster, loss_kind):
    """Seeds and loss weights follow the loss's batch reduction: s/B for a mean (batch-independent terms
    such as weight decay stay exact), 1 for a sum."""
    ports, target = cluster
    gd = small_mlp(loss_kind)
    B = 8
    ir = tag.analyze(gd, batch_size=B)
    topo = topology(ports[:2], [0.15, 0.05])        # shares 6:2
    res = rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")]), topo)
    rng = np.random.RandomState(2)
    batches = [{"input": rng.randn(B, 10).astype(np.float32), "labels": rng.randint(0, 3, B).astype(np.int32)}
               for _ in range(STEPS)]
    ref, grads0 = reference(gd, ir, batches)
    assert_same_training(run_rewritten(res, ir, batches), ref, grads0, ir, 0.1)


def test_sum_loss_with_constant_term_is_refused():
    gd = small_mlp("sum+l2")
    ir = tag.analyze(gd, batch_size=8)
    with pytest.raises(RewriteError, match="sums over the batch"):
        rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")]), UNEVEN)


LEARNING_RATE = {"mlp": 1e-3, "vgg19": 0.01, "resnet50": 0.01, "transformer": 1e-4, "bert_base": 1e-4}


@pytest.mark.slow
def test_sufficient_factor_broadcasting(cluster):
    """Kernels in strategy.sfb: no all-reduce of their gradient; every replica all-gathers the layer's input
    and output gradient (CollectiveGatherV2) and recomputes the whole-batch gradient; same training."""
    ports, target = cluster
    gd, ir = model("mlp")
    topo = topology(ports, [0.1, 0.05, 0.05])
    kernels = [v.name for v in trainables(ir) if v.name.endswith("kernel")]
    st = Strategy(one_group(ir), [Action((0, 1, 2), "allreduce")], sfb=kernels)
    res = rewrite(gd, ir, st, topo)
    collectives = [n for n in res.graph_def.node if n.op == "CollectiveReduceV2"]
    assert len(collectives) == 3                   # the biases, fused into one buffer, on each replica
    nodes = _nodes(res)
    for v in trainables(ir):
        for d in range(3):
            grad = nodes[nodes[f"{v.apply_op}/replica_{d}"].input[-1].split(":")[0]]
            assert (grad.op in ("CollectiveReduceV2", "Reshape")) == (v.name not in kernels), v.name
            if v.name in kernels:                      # recomputed from the gathered batch
                matmul = nodes[grad.input[0].split(":")[0]]
                assert matmul.op == "MatMul" and matmul.device == topo.tf_device(d)
                for i in matmul.input:
                    part = nodes[i.split(":")[0]]
                    assert part.op == "Slice" and nodes[part.input[0]].op == "CollectiveGatherV2"
    ref, grads0 = _cached_reference("mlp")
    got = run_rewritten(res, ir, feeds_for(gd, ir, STEPS))
    assert_same_training(got, ref, grads0, ir, LEARNING_RATE["mlp"])
    with pytest.raises(StrategyError, match="sfb"):
        rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1, 2), "allreduce")], sfb=["nope"]), topo)



@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "ps", "partition", "mixed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_same_training(cluster, name, mode):
    """Loss and updated weights of the rewritten graph match the original over 3 steps (1e-5 relative).

    Non-BatchNorm models: 3 workers with uneven shares (2:1:1 of a batch of 4), compared with the
    original graph on one device. ResNet-50 (BatchNorm): replicated modes keep per-replica batch
    statistics by design, so they are compared with ``per_replica_reference`` (2 workers, 2+2
    examples); partition runs the whole batch once and is compared with the original directly.
    """
    ports, target = cluster
    gd, ir = model(name)
    batches = feeds_for(gd, ir, STEPS)
    bn = name in BATCHNORM
    topo = topology(ports[:2], [0.05, 0.05]) if bn else topology(ports, [0.1, 0.05, 0.05])
    st = strategy(mode, ir, topo, batchnorm=bn)
    res = rewrite(gd, ir, st, topo)
    if bn and mode != "partition":
        shares = tuple(batch_shares([d.peak_flops for d in topo.devices], BATCH))
        if (name, shares) not in _REFS:
            _REFS[name, shares] = per_replica_reference(name, ir, batches, list(shares))
        ref, grads0 = _REFS[name, shares]
    else:
        ref, grads0 = _cached_reference(name)
    got = run_rewritten(res, ir, batches)
    assert_same_training(got, ref, grads0, ir, LEARNING_RATE[name])


_REFS: dict = {}


def _cached_reference(name):
    if name not in _REFS:
        gd, ir = model(name)
        _REFS[name] = reference(gd, ir, feeds_for(gd, ir, STEPS))
    return _REFS[name]


@pytest.mark.slow
def test_dataset_iterator_input(cluster):
    """A tf.data iterator feeds the step: it is read once per step (whole batch) and sliced."""
    ports, target = cluster
    B = 8
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        data = (rng.randn(64, 10).astype(np.float32), rng.randint(0, 3, 64).astype(np.int32))
        ds = tf.data.Dataset.from_tensor_slices(data).batch(B, drop_remainder=True).repeat()
        x, y = tf1.data.make_one_shot_iterator(ds).get_next()
        w = tf1.get_variable("w", [10, 3], initializer=tf1.glorot_uniform_initializer(seed=1))
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x @ w)
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.identity(tf.reduce_mean(xent), name="loss"),
                                                        name="train_op")
        tf1.variables_initializer(tf1.global_variables(), name="init")
    gd = g.as_graph_def()
    ir = tag.analyze(gd)
    topo = topology(ports[:2], [0.15, 0.05])
    res = rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")]), topo)
    assert [n.name for n in res.graph_def.node if "Iterator" in n.op] == ["OneShotIterator", "IteratorGetNext"]
    with tf1.Session(graph=_import(gd), config=local_config()) as s:
        s.run("init")
        ref = [s.run(["loss:0", "train_op"])[0] for _ in range(STEPS)]
    with tf1.Session(target, graph=_import(res.graph_def), config=cluster_config()) as s:
        s.run(res.init)
        got = [s.run([res.loss + ":0", res.train_op])[0] for _ in range(STEPS)]
    np.testing.assert_allclose(got, ref, rtol=RTOL)


def random_strategy(ir, seed: int) -> Strategy:
    """Any action per op group: a random subset of the 3 device groups, a random mode, a random PS
    device, random devices for partitioned ops (the kind of strategies a search visits), a random set of
    SFB gradients."""
    rng = np.random.RandomState(seed)
    grouping = group_ops(ir, int(rng.choice([4, 8, 16])))
    actions, partition = [], {}
    for g in range(grouping.num_groups):
        placement = tuple(sorted(rng.choice(3, rng.randint(1, 4), replace=False).tolist()))
        mode = ("allreduce", "ps", "partition")[rng.randint(3)]
        actions.append(Action(placement, mode, ps_device=int(rng.randint(3)) if mode == "ps" else None))
        if mode == "partition":
            partition.update({int(i): int(rng.choice(placement)) for i in grouping.members(g)})
    # about half the SFB-eligible weights by sufficient factors (applied where their group is a replicated
    # allreduce group, ignored elsewhere)
    sfb = [f.variable for f in eligible_gradients(ir) if rng.rand() < 0.5]
    return Strategy(grouping, actions, partition, sfb=sfb)


@pytest.mark.slow
@pytest.mark.parametrize("name,seeds", [("mlp", range(8)), ("transformer", range(3)), ("bert_base", range(3))])
def test_random_strategies(cluster, name, seeds):
    """Random mixed strategies (seeded) train exactly like the original graph (2 steps)."""
    ports, target = cluster
    gd, ir = model(name)
    topo = topology(ports, [0.1, 0.05, 0.05])
    ref, grads0 = _cached_reference(name)
    batches = feeds_for(gd, ir, STEPS)
    for seed in seeds:
        res = rewrite(gd, ir, random_strategy(ir, seed), topo)
        got = run_rewritten(res, ir, batches[:2])
        assert_same_training(got, ref[:2], grads0, ir, LEARNING_RATE[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_small_fusion_buckets_train_exactly(cluster, name):
    """Data parallelism whose gradients are summed in several fusion buckets (a small ``bucket_bytes``, as
    tag.search.buckets may choose): several fused collectives, the same training as the original graph."""
    ports, target = cluster
    gd, ir = model(name)
    topo = topology(ports, [0.1, 0.05, 0.05])
    grouping = group_ops(ir, 8)
    dp = builtin_strategy("dp_allreduce", ir, topo, grouping)
    sizes = sorted(v.nbytes for v in trainables(ir))
    res = rewrite(gd, ir, dataclasses.replace(dp, bucket_bytes=float(sizes[len(sizes) // 2])), topo)
    nodes = _nodes(res)
    keys = {int(tf.make_ndarray(nodes[n.input[3]].attr["value"].tensor)) for n in res.graph_def.node
            if n.op == "CollectiveReduceV2"}
    assert len(keys) >= 2      # the model's gradients no longer travel in one collective
    ref, grads0 = _cached_reference(name)
    batches = feeds_for(gd, ir, STEPS)
    got = run_rewritten(res, ir, batches[:2])
    assert_same_training(got, ref[:2], grads0, ir, LEARNING_RATE[name])


@pytest.mark.slow
def test_runtime_worker_processes():
    """End to end on separate tag-worker processes (tag.backend.runtime.LocalCluster + run_steps): the built-in
    strategies of an MLP, with uneven shares, train like the original graph, one after another on
    the same cluster."""
    from tag.backend.runtime import LocalCluster, run_steps

    gd, ir = model("mlp")
    topo = topology(free_ports(3), [0.1, 0.05, 0.05])
    grouping = group_ops(ir, 8)
    batches = feeds_for(gd, ir, STEPS)
    ref, _ = _cached_reference("mlp")
    weights = [v.name for v in trainables(ir)]
    with LocalCluster(topo) as cluster:
        for name in ("dp_allreduce", "ps", "partition"):
            res = rewrite(gd, ir, builtin_strategy(name, ir, topo, grouping), topo)
            copies = [c for v in weights for c in res.variables[v]]
            run = run_steps(res.graph_def, cluster.target, train_op=res.train_op, loss=res.loss, init=res.init,
                            steps=STEPS, warmup=0, input_fn=lambda step: _named(batches[step]), fetch_after=copies)
            for loss, (ref_loss, _) in zip(run.losses, ref, strict=True):
                assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), name
            for v, r in zip(weights, ref[-1][1], strict=True):
                for c in res.variables[v]:
                    assert np.max(np.abs(run.values[c] - r)) <= RTOL * np.max(np.abs(r)), (name, c)


def test_batch_shares_follow_the_strategys_device_speeds():
    """With calibrated device speeds in the strategy, the replicas' slices follow them, not peak FLOP/s."""
    gd, ir = mlp()
    strategy = Strategy(one_group(ir), [Action((0, 1), "allreduce")], device_speeds=(1.0, 3.0))
    res = rewrite(gd, ir, strategy, UNEVEN)
    assert res.replicas == {0: [(0, 0, 2), (1, 2, 8)]}
    with pytest.raises(StrategyError, match="device speeds"):
        rewrite(gd, ir, Strategy(one_group(ir), [Action((0, 1), "allreduce")], device_speeds=(1.0,)), UNEVEN)


def test_input_slices_for_remote_replicas_come_before_the_local_replica():
    """Every local op that reads the batch (or its local slice) waits for the slices cut for the other
    replicas: TF runs a ready chain inline, so otherwise the remote replicas would wait for their inputs."""
    gd, ir = model("mlp")
    topo = topology([1, 2, 3], [0.05, 0.05, 0.05])
    res = rewrite(gd, ir, strategy("allreduce", ir, topo), topo, batch_size=BATCH)
    nodes = {n.name: n for n in res.graph_def.node}
    readers = {}
    for n in res.graph_def.node:
        for i in n.input:
            if not i.startswith("^"):
                readers.setdefault(i.split(":")[0], []).append(n)
    remote = [n for n in res.graph_def.node if n.op == "StridedSlice" and n.name.startswith("tag/slice/")
              and any(r.device != n.device for r in readers.get(n.name, ()))]
    assert remote, "a 3-way data-parallel rewrite slices the batch for the other replicas"
    for sl in remote:
        siblings = [o.name for o in nodes.values() if o.op == "StridedSlice" and o.device == sl.device
                    and o.name.startswith("tag/slice/") and o.input[0] == sl.input[0] and o not in remote]
        local = [r for src in [sl.input[0].split(":")[0], *siblings]
                 for r in readers.get(src, ()) if r.device == sl.device and not r.name.startswith("tag/slice/")]
        assert local and all(f"^{sl.name}" in r.input for r in local), sl.name
