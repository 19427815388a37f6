"""tag.optimize end to end on real TF servers: a searched mixed plan trains as one device does."""
from __future__ import annotations

import pytest

from tag.cluster.topology import parse_topology


def mixing_cnn(batch: int):
    """A CNN whose convolutions want data parallelism (many FLOPs per weight) and whose head does not
    (few FLOPs per weight): over 1 Gbit/s the searched plan mixes per-group actions."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        h = tf1.placeholder(tf.float32, [batch, 32, 32, 3], name="input")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        for i in range(3):
            h = tf.nn.relu(tf.nn.conv2d(h, tf1.get_variable(f"conv{i}", [3, 3, h.shape[-1], 32]), 1, "SAME"))
        h = tf.nn.relu(tf.matmul(tf.reshape(h, [batch, -1]), tf1.get_variable("fc", [32 * 32 * 32, 256])))
        logits = tf.matmul(h, tf1.get_variable("out", [256, 10]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def loopback_topology(ports, gbps: float):
    hosts = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {p} device {{ type: "CPU" kind: CPU memory_gib: 2 '
        f'peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}' for i, p in enumerate(ports))
    return parse_topology(f'name: "mixing"\n{hosts}\nfabric {{ bandwidth_gbps: {gbps} latency_us: 50 }}\n')


@pytest.mark.slow
def test_searched_mixed_plan_trains_like_one_device_on_three_servers():
    """tag.optimize returns a mixed plan (different actions for different op groups, not a built-in) for
    mixing_cnn on three 1 Gbit/s hosts, and the rewritten plan, run on three real TF servers on loopback,
    gives the single-device loss and updated weights over 3 steps (within float32 rounding)."""
    import tag
    from helpers import in_process_servers
    from tag.strategy.baselines import BUILTIN_STRATEGIES
    from test_rewrite import assert_same_training, feeds_for, reference, run_rewritten

    ports, servers = in_process_servers(3)
    gd = mixing_cnn(48)
    plan = tag.optimize(gd, loopback_topology(ports, 1.0), playouts=20, groups=16)
    actions = {(a.placement, a.mode, a.ps_device) for a in plan.strategy.actions}
    assert plan.method not in BUILTIN_STRATEGIES and len(actions) >= 2, (plan.method, actions)
    assert plan.predicted_step_time < min(plan.baselines[n] for n in BUILTIN_STRATEGIES)
    ir = plan.analysis.graph
    rewritten = plan.analysis.rewrite(plan.strategy)
    assert rewritten.train_op == plan.train_op
    batches = feeds_for(gd, ir, 3)
    ref, grads0 = reference(gd, ir, batches)
    got = run_rewritten(rewritten, ir, batches)
    # 1e-4: the convolutions' weight gradients sum 48 x 32 x 32 terms, in another order on three replicas
    assert_same_training(got, ref, grads0, ir, learning_rate=0.01, rtol=1e-4)
