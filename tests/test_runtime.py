"""tag.backend.runtime: cluster specs, tag-worker, LocalCluster and run_steps on real TF servers."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from bounded import LineReader, bounded, stop  # noqa: E402
from tag.backend.runtime import (  # noqa: E402
    COLLECTIVE_LEADER,
    ClusterError,
    LocalCluster,
    cluster_spec_from,
    free_ports,
    fresh_collective_keys,
    run_steps,
    session_config,
)
from tag.cli.worker import main as worker_main  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.errors import GraphError, TagError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = 'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }'


def topo_text(ports, address="127.0.0.1", name="loop") -> str:
    hosts = "\n".join(f'host {{ name: "h{i}" address: "{address}" port: {p} {CPU} }}' for i, p in enumerate(ports))
    return f'name: "{name}"\n{hosts}\nfabric {{ bandwidth_gbps: 10 latency_us: 20 }}\n'


def loopback_topology(n: int):
    return parse_topology(topo_text(free_ports(n)))


def port_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def mlp_graph(tasks=(0, 1), batch=16, features=8, hidden=16, classes=2, lr=0.1, unknown_batch=False):
    """A 2-layer MLP training graph; layer i lives on /job:worker/task:tasks[i] (None: no device)."""
    def dev(t):
        return f"/job:worker/task:{t}/device:CPU:0" if t is not None else ""

    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        b = None if unknown_batch else batch
        with tf.device(dev(tasks[0])):
            x = tf.compat.v1.placeholder(tf.float32, [b, features], name="x")
            y = tf.compat.v1.placeholder(tf.int32, [b], name="y")
            w1 = tf.compat.v1.get_variable("w1", [features, hidden])
            b1 = tf.compat.v1.get_variable("b1", [hidden], initializer=tf.compat.v1.zeros_initializer())
            h = tf.nn.relu(tf.matmul(x, w1) + b1)
        with tf.device(dev(tasks[1])):
            w2 = tf.compat.v1.get_variable("w2", [hidden, classes])
            logits = tf.matmul(h, w2)
            loss = tf.identity(tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)), name="loss")
            tf.compat.v1.train.GradientDescentOptimizer(lr).minimize(loss, name="train_op")
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables(), name="init")
    return g.as_graph_def()


def learnable_input(batch=16, features=8, seed=0):
    """input_fn: labels follow a fixed rule of the inputs, so the loss can go down."""
    rng = np.random.default_rng(seed)

    def fn(step):
        x = rng.standard_normal((batch, features)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] + x[:, 1] > 0).astype(np.int32)}

    return fn


# ------------------------------------------------------------------------------------------------
# fast: no processes
# ------------------------------------------------------------------------------------------------

def test_cluster_spec_from_topology():
    topo = parse_topology(topo_text([23001, 23002, 23003]))
    spec = cluster_spec_from(topo)
    assert spec.jobs == ["worker"]
    assert spec.job_tasks("worker") == ["127.0.0.1:23001", "127.0.0.1:23002", "127.0.0.1:23003"]


def test_cluster_spec_from_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["10.1.2.3:2222", "10.1.2.4:2222"]},
                                                "task": {"type": "worker", "index": 1}}))
    spec = cluster_spec_from()
    assert spec.job_tasks("worker") == ["10.1.2.3:2222", "10.1.2.4:2222"]


def test_cluster_spec_without_anything_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterError, match="TF_CONFIG"):
        cluster_spec_from()
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ClusterError, match="not valid JSON"):
        cluster_spec_from()


def test_session_config_sets_collective_leader_and_shares_state_by_container():
    cfg = session_config(intra_op_threads=2)
    assert cfg.experimental.collective_group_leader == COLLECTIVE_LEADER == "/job:worker/replica:0/task:0"
    assert not cfg.isolate_session_state and cfg.intra_op_parallelism_threads == 2


def test_worker_unknown_host_exit_2_lists_known_hosts(tmp_path, capsys):
    f = tmp_path / "c.pbtxt"
    f.write_text(topo_text([23011, 23012]))
    assert worker_main(["--topo", str(f), "--host", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown host 'nope'" in err and "h0, h1" in err


def test_worker_cli_bad_input_is_one_line_exit_2(tmp_path):
    """As a process (python -m tag.cli.worker): no traceback, exit 2, before TensorFlow is even loaded."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = REPO
    missing = subprocess.run([sys.executable, "-m", "tag.cli.worker", "--topo", str(tmp_path / "none.pbtxt"),
                              "--host", "h0"], capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().count("\n") == 0 and "none.pbtxt" in missing.stderr
    nothing = subprocess.run([sys.executable, "-m", "tag.cli.worker"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert nothing.returncode == 2 and "TF_CONFIG" in nothing.stderr and "Traceback" not in nothing.stderr
    f = tmp_path / "c.pbtxt"
    f.write_text(topo_text([23021]))
    no_host = subprocess.run([sys.executable, "-m", "tag.cli.worker", "--topo", str(f)], capture_output=True,
                             text=True, env=env, timeout=60)
    assert no_host.returncode == 2 and "--host" in no_host.stderr


def test_local_cluster_refuses_remote_hosts():
    topo = parse_topology(topo_text([23031, 23032], address="192.0.2.7"))
    with pytest.raises(ClusterError, match="not loopback"):
        LocalCluster(topo)


def test_a_worker_refuses_port_zero_which_only_tag_chooses(tmp_path, capsys):
    f = tmp_path / "free.pbtxt"
    f.write_text(topo_text([0, 0]))
    assert worker_main(["--topo", str(f), "--host", "h0"]) == 2
    err = capsys.readouterr().err
    assert "h0, h1 have port 0" in err and "fixed ports" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_port_zero_takes_free_ports_and_retries_when_one_is_taken_first(monkeypatch):
    """port: 0 hosts get free ports at start; a port another program takes before the worker binds it (here a
    listening socket given out as the first choice) makes the start try again with new ports."""
    import tag.backend.runtime.local_cluster as local_cluster
    squatter = socket.socket()
    squatter.bind(("0.0.0.0", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    choices = []

    def first_taken(n, address="127.0.0.1"):
        ports = [taken] + free_ports(n - 1, address) if not choices else free_ports(n, address)
        choices.append(ports)
        return ports

    monkeypatch.setattr(local_cluster, "free_ports", first_taken)
    topo = parse_topology(topo_text([0, 0]))
    try:
        with LocalCluster(topo, threads_per_worker=1) as cluster:
            ports = [h.port for h in cluster.topology.hosts]
            assert len(choices) == 2 and ports == choices[1] and taken not in ports
            assert cluster.target == f"grpc://127.0.0.1:{ports[0]}"
            assert [h.port for h in topo.hosts] == [0, 0]              # the topology given is left as it was
            r = run_steps(mlp_graph(tasks=(0, 1)), cluster.target, steps=2, warmup=0)
            assert np.all(np.isfinite(r.losses))
    finally:
        squatter.close()


def test_local_cluster_port_clash_is_a_clear_error():
    topo = loopback_topology(2)
    busy = topo.hosts[1].port
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", busy))
    squatter.listen(1)
    try:
        cluster = LocalCluster(topo)
        with pytest.raises(ClusterError, match=f"port already in use for h1 127.0.0.1:{busy}"):
            cluster.start()
        assert cluster.pids == []
    finally:
        squatter.close()


def test_run_steps_in_process_random_batches_deterministic():
    gd = mlp_graph(tasks=(None, None))
    a = run_steps(gd, "", steps=6, warmup=2, seed=3)
    b = run_steps(gd, "", steps=6, warmup=2, seed=3)
    c = run_steps(gd, "", steps=6, warmup=2, seed=4)
    assert len(a.losses) == len(a.step_times) == 6 and a.warmup == 2
    assert np.all(np.isfinite(a.losses)) and a.losses == b.losses and a.losses != c.losses
    assert a.mean_step_time_s == pytest.approx(np.mean(a.step_times[2:]))
    assert all(t > 0 for t in a.step_times)


def test_run_steps_in_process_learns_with_input_fn_and_fetches_values():
    gd = mlp_graph(tasks=(None, None))
    r = run_steps(gd, "", steps=40, warmup=1, input_fn=learnable_input(), fetch_after=["w2:0"])
    assert np.all(np.isfinite(r.losses))
    assert np.mean(r.losses[-5:]) < 0.8 * np.mean(r.losses[:5])
    assert r.values["w2:0"].shape == (16, 2)


def test_run_steps_unknown_dimension_needs_feeds():
    gd = mlp_graph(tasks=(None, None), unknown_batch=True)
    with pytest.raises(GraphError, match="placeholder 'x' has an unknown dimension"):
        run_steps(gd, "", steps=2, warmup=0)
    fn = learnable_input(batch=5)
    r = run_steps(gd, "", steps=2, warmup=0, input_fn=fn)
    assert len(r.losses) == 2
    fixed = fn(0)
    r = run_steps(gd, "", steps=3, warmup=0, feeds=fixed)
    assert r.losses[2] < r.losses[0]  # the same batch three times: plain gradient descent fits it


def test_run_steps_synthetic_inputs_on_device():
    from tag.backend.runtime.inputs import pool_size
    gd = mlp_graph(tasks=(None, None))
    k = pool_size(16 * 8 * 4)           # batches in the pool of x (16 x 8 floats)
    a = run_steps(gd, "", steps=k + 1, warmup=1, synthetic=True, seed=5)
    b = run_steps(gd, "", steps=k + 1, warmup=1, synthetic=True, seed=5)
    assert a.losses == b.losses and np.all(np.isfinite(a.losses))
    assert a.losses[k] < a.losses[0]  # step K+1 reads step 1's batch again: gradient descent fits it
    with pytest.raises(TagError, match="exclude each other"):
        run_steps(gd, "", steps=2, warmup=0, synthetic=True, input_fn=learnable_input())
    unknown = mlp_graph(tasks=(None, None), unknown_batch=True)
    with pytest.raises(GraphError, match="unknown dimension"):
        run_steps(unknown, "", steps=2, warmup=0, synthetic=True)
    fn = learnable_input(batch=4)
    r = run_steps(unknown, "", steps=2, warmup=0, synthetic=True, feeds=fn(0))  # fed ones stay fed
    assert len(r.losses) == 2


def test_synthetic_pool_is_not_memorised_like_one_batch():
    """3 rounds of the pool (3K steps) of a model that learns one fixed batch by heart: the loss falls to about 0
    on one batch, not on the pool, and step T reads the batch step T + K reads."""
    import tag
    from tag.backend.runtime.inputs import SYNTHETIC_POOL, pool_size, random_feed
    gd = tag.zoo.training_graph("mlp", batch_size=16, input_dim=64, hidden=(256, 256))
    pooled = run_steps(gd, "", steps=3 * SYNTHETIC_POOL, warmup=1, synthetic=True, seed=0).losses
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(gd, name="")
    rng = np.random.default_rng(0)
    one = {f"{op.name}:0": random_feed(op, rng) for op in g.get_operations() if op.type == "Placeholder"}
    fixed = run_steps(gd, "", steps=3 * SYNTHETIC_POOL, warmup=1, feeds=one, seed=0).losses
    assert np.mean(fixed[-SYNTHETIC_POOL:]) < 0.05, fixed          # one batch: learnt by heart
    assert min(pooled[-SYNTHETIC_POOL:]) > 0.2, pooled              # the pool: still learning
    assert all(pooled[t + SYNTHETIC_POOL] < pooled[t] for t in range(2))   # the same batch again, fitted better
    assert pool_size(16 * 64 * 4) == SYNTHETIC_POOL and pool_size(1 << 30) == 1 and pool_size(100 << 20) == 2


def test_synthetic_shares_are_the_same_rows_of_the_same_batch_at_every_step():
    """However a strategy splits the batch, the hosts' shares at step T are rows of global batch T mod K."""
    from tensorflow.core.framework import node_def_pb2

    from tag.backend.runtime.inputs import SYNTHETIC_POOL, synthetic_share
    node = node_def_pb2.NodeDef(name="x", op="Placeholder")
    node.attr["dtype"].type = tf.float32.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(tf.TensorShape([40, 3]).as_proto())
    g = tf.Graph()
    with g.as_default():
        made = [synthetic_share(node, "x", lo, hi, 40, seed=7) for lo, hi in ((0, 40), (0, 13), (13, 40))]
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run([init for init, _ in made])
        seen = [sess.run([value for _, value in made]) for _ in range(SYNTHETIC_POOL + 1)]
    for whole, a, b in seen:
        assert whole.shape == (40, 3) and np.array_equal(np.concatenate([a, b]), whole)
    assert not np.array_equal(seen[0][0], seen[1][0])                  # a new batch each step ...
    assert np.array_equal(seen[SYNTHETIC_POOL][0], seen[0][0])         # ... K of them, then round again


def test_run_steps_bad_arguments():
    gd = mlp_graph(tasks=(None, None))
    with pytest.raises(GraphError, match="no op named 'missing'"):
        run_steps(gd, "", train_op="missing", steps=2, warmup=0)
    with pytest.raises(TagError, match="warmup"):
        run_steps(gd, "", steps=3, warmup=3)
    with pytest.raises(TagError, match="steps"):
        run_steps(gd, "", steps=0, warmup=0)


def _keys(gd):
    from tensorflow.python.framework import tensor_util

    nodes = {n.name: n for n in gd.node}
    out = []
    for n in gd.node:
        if n.op == "CollectiveReduceV2":
            out.append(tuple(int(tensor_util.MakeNdarray(nodes[n.input[i]].attr["value"].tensor)) for i in (2, 3)))
        elif n.op == "CollectiveReduce":
            out.append((n.attr["group_key"].i, n.attr["instance_key"].i))
    return out


def test_fresh_collective_keys_renumbers_consistently():
    g = tf.Graph()
    with g.as_default():
        for t in range(2):
            with tf.device(f"/job:worker/task:{t}/device:CPU:0"):
                v = tf.constant([1.0, 2.0])
                tf.raw_ops.CollectiveReduceV2(input=v, group_size=2, group_key=1, instance_key=1, ordering_token=[],
                                              merge_op="Add", final_op="Id")
                tf.raw_ops.CollectiveReduceV2(input=v, group_size=2, group_key=1, instance_key=2, ordering_token=[],
                                              merge_op="Add", final_op="Id")
                tf.raw_ops.CollectiveReduce(input=v, group_size=2, group_key=5, instance_key=1, merge_op="Add",
                                            final_op="Id", subdiv_offsets=[0])
    gd = g.as_graph_def()
    before = _keys(gd)
    assert before == [(1, 1), (1, 2), (5, 1)] * 2
    a, b = fresh_collective_keys(gd), fresh_collective_keys(gd)
    assert _keys(gd) == before  # the input is not modified
    ka, kb = _keys(a), _keys(b)
    assert ka[:3] == ka[3:] and kb[:3] == kb[3:]  # both members of each collective agree
    assert ka[0][0] == ka[1][0] != ka[2][0] and ka[0][1] != ka[1][1] and ka[0][1] == ka[2][1]
    assert not {k for pair in ka for k in pair} & {k for pair in kb for k in pair}  # new keys every time
    with tf.Graph().as_default():  # still a valid graph
        tf.compat.v1.import_graph_def(a, name="")
    plain = mlp_graph(tasks=(None, None))
    assert fresh_collective_keys(plain) is plain


# ------------------------------------------------------------------------------------------------
# slow: real TF servers in worker processes
# ------------------------------------------------------------------------------------------------

def collective_sum_graph(n_tasks: int, group_key: int = 1, instance_key: int = 1):
    g = tf.Graph()
    outs = []
    with g.as_default():
        for t in range(n_tasks):
            with tf.device(f"/job:worker/task:{t}/device:CPU:0"):
                v = tf.constant(np.arange(4, dtype=np.float32) + 10.0 * t)
                outs.append(tf.raw_ops.CollectiveReduceV2(
                    input=v, group_size=n_tasks, group_key=group_key, instance_key=instance_key,
                    ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring"))
    return g, outs


def dp_graph(n_tasks: int, batch=8, features=4, lr=0.1):
    """Data parallelism by hand: a linear model replicated on N tasks, gradients all-reduced (group key 1)."""
    g = tf.Graph()
    with g.as_default():
        losses, updates = [], []
        for t in range(n_tasks):
            with tf.device(f"/job:worker/task:{t}/device:CPU:0"):
                x = tf.compat.v1.placeholder(tf.float32, [batch, features], name=f"x{t}")
                w = tf.compat.v1.get_variable(f"w{t}", initializer=tf.ones([features, 1]))
                loss_t = tf.reduce_mean(tf.square(tf.matmul(x, w) - tf.reduce_sum(x, 1, keepdims=True) * 0.5))
                grad, = tf.gradients(loss_t, [w])
                total = tf.raw_ops.CollectiveReduceV2(input=grad, group_size=n_tasks, group_key=1, instance_key=1,
                                                      ordering_token=[], merge_op="Add", final_op="Div")
                updates.append(tf.compat.v1.assign_sub(w, lr * total))
                losses.append(loss_t)
        tf.identity(tf.add_n(losses) / n_tasks, name="loss")
        tf.group(*updates, name="train_op")
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables(), name="init")
    return g.as_graph_def()


@pytest.mark.slow
def test_local_cluster_runs_split_mlp_and_collective_allreduce():
    topo = loopback_topology(3)
    with LocalCluster(topo) as cluster:
        assert cluster.target == f"grpc://127.0.0.1:{topo.hosts[0].port}"
        assert all(pid_alive(p) for p in cluster.pids) and len(cluster.pids) == 3
        # an MLP whose two layers live on tasks 1 and 2, driven through task 0
        r = run_steps(mlp_graph(tasks=(1, 2)), cluster.target, steps=30, warmup=3, input_fn=learnable_input())
        assert np.all(np.isfinite(r.losses)) and np.mean(r.losses[-5:]) < 0.8 * np.mean(r.losses[:5])
        assert 0 < r.mean_step_time_s < 5
        print(f"\n2-task MLP step time on a 3-worker LocalCluster: {r.mean_step_time_s * 1e3:.2f} ms")
        # all-reduce across the three tasks with TF collective ops, several runs of one graph
        g, outs = collective_sum_graph(3)
        want = sum(np.arange(4, dtype=np.float32) + 10.0 * t for t in range(3))
        with tf.compat.v1.Session(cluster.target, graph=g, config=bounded(session_config())) as sess:
            for _ in range(3):
                for got in sess.run(outs):
                    np.testing.assert_allclose(got, want)
        # the servers remember group 1 = 3 tasks: a 2-task group under the same key aborts unless renumbered
        g2, outs2 = collective_sum_graph(2)
        g3 = tf.Graph()
        with g3.as_default():
            tf.compat.v1.import_graph_def(fresh_collective_keys(g2.as_graph_def()), name="")
        outs3 = [g3.get_tensor_by_name(t.name) for t in outs2]
        with tf.compat.v1.Session(cluster.target, graph=g3, config=bounded(session_config())) as sess:
            np.testing.assert_allclose(sess.run(outs3)[0], np.arange(4) * 2 + 10.0)
        # a second graph with the same variable names but other shapes: sessions do not share state
        r2 = run_steps(mlp_graph(tasks=(2, 0), features=5, hidden=3), cluster.target, steps=3, warmup=1)
        assert np.all(np.isfinite(r2.losses))
        # data-parallel training with all-reduced gradients, on 3 then 2 tasks with the same keys:
        # run_steps renumbers them, the replicas stay identical and the loss goes down
        for n in (3, 2):
            r4 = run_steps(dp_graph(n), cluster.target, steps=8, warmup=1, fetch_after=[f"w{t}" for t in range(n)])
            assert r4.losses[-1] < r4.losses[0]
            for t in range(1, n):
                np.testing.assert_allclose(r4.values[f"w{t}"], r4.values["w0"], rtol=1e-6)
        # synthetic inputs made on the placeholders' own task
        r5 = run_steps(mlp_graph(tasks=(1, 2)), cluster.target, steps=6, warmup=1, synthetic=True)
        assert r5.losses[-1] < r5.losses[0]
        # the random-batch path across tasks
        r3 = run_steps(mlp_graph(tasks=(0, 1)), cluster.target, steps=4, warmup=1)
        assert np.all(np.isfinite(r3.losses))


@pytest.mark.slow
def test_local_cluster_cleans_up_after_an_error():
    topo = loopback_topology(2)
    pids = []
    with pytest.raises(RuntimeError, match="boom"):
        with LocalCluster(topo) as cluster:
            pids = list(cluster.pids)
            assert not any(port_free(h.port) for h in topo.hosts)
            raise RuntimeError("boom")
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert all(port_free(h.port) for h in topo.hosts)  # a new cluster can bind them right away


@pytest.mark.slow
def test_tag_worker_process_serves_and_stops_on_sigterm(tmp_path):
    port, = free_ports(1)
    f = tmp_path / "one.pbtxt"
    f.write_text(topo_text([port]))
    env = dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "tag.cli.worker", "--topo", str(f), "--host", "h0", "--threads", "1"]
    proc = subprocess.Popen(command,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        line = LineReader(proc.stdout).next(timeout_s=120)
        assert line is not None and line.startswith("ready h0 127.0.0.1:") and str(port) in line
        g = tf.Graph()
        with g.as_default(), tf.device("/job:worker/task:0/device:CPU:0"):
            s = tf.reduce_sum(tf.constant([1.0, 2.0, 3.0]))
        with tf.compat.v1.Session(f"grpc://127.0.0.1:{port}", graph=g, config=bounded(session_config())) as sess:
            assert sess.run(s) == 6.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert port_free(port)
    finally:
        stop(proc)


@pytest.mark.slow
def test_worker_exits_when_its_parent_dies():
    """The safety net for a parent killed with SIGKILL: workers notice and exit by themselves."""
    topo = loopback_topology(1)
    code = (
        "import sys, time\n"
        "from tag.cluster.topology import parse_topology\n"
        "from tag.backend.runtime import LocalCluster\n"
        f"c = LocalCluster(parse_topology({topo_text([topo.hosts[0].port])!r})).start()\n"
        "print(c.pids[0], flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO), start_new_session=True)
    worker = None
    try:
        worker = int(LineReader(parent.stdout).next(timeout_s=120))
        assert pid_alive(worker)
        parent.kill()
        parent.wait(timeout=15)
        deadline = time.monotonic() + 15
        while pid_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(worker)
    finally:
        stop(parent)
        if worker is not None and pid_alive(worker):
            os.killpg(worker, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_stops_the_workers():
    """SIGINT (Ctrl-C) in the process that owns a LocalCluster stops its workers on the way out.

    The child restores Python's SIGINT handler first: started from a shell's background job (the suite
    run as ``pytest &``), this process and its children ignore SIGINT, and the child would never see it.
    Every read of its output is bounded."""
    topo = loopback_topology(1)
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from tag.cluster.topology import parse_topology\n"
        "from tag.backend.runtime import LocalCluster\n"
        "def alive(p):\n"
        "    try:\n"
        "        return open(f'/proc/{p}/stat').read().split(')')[-1].split()[0] != 'Z'\n"
        "    except OSError:\n"
        "        return False\n"
        "try:\n"
        f"    with LocalCluster(parse_topology({topo_text([h.port for h in topo.hosts])!r})) as c:\n"
        "        pids = c.pids\n"
        "        print('up', flush=True)\n"
        "        time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        "    print('alive' if any(alive(p) for p in pids) else 'stopped', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), start_new_session=True)
    lines = LineReader(proc.stdout)
    try:
        assert lines.next(timeout_s=120) == "up"
        proc.send_signal(signal.SIGINT)
        assert lines.next(timeout_s=60) == "stopped"
        proc.wait(timeout=15)
        assert all(port_free(h.port) for h in topo.hosts)
    finally:
        stop(proc)


# ------------------------------------------------------------------------------------------------
# guarded runs: watchdog, deadlines, progress, checkpoints (fast, in process)
# ------------------------------------------------------------------------------------------------

def test_guarded_watchdog_and_deadline_end_the_wait():
    from tag.backend.runtime.guard import guarded
    from tag.errors import RunError
    t0 = time.monotonic()
    with pytest.raises(RunError, match="worker for host h1 died.*during step 3"):
        guarded(lambda: time.sleep(30), what="step 3", timeout_s=60,
                watchdog=lambda: "worker for host h1 died" if time.monotonic() - t0 > 0.3 else None, poll_s=0.05)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RunError, match="step 1 did not finish within 0 s"):
        guarded(lambda: time.sleep(30), what="step 1", timeout_s=0.2, poll_s=0.05)
    assert guarded(lambda: 7, what="x", timeout_s=1) == 7
    with pytest.raises(TagError, match="bad"):
        guarded(lambda: (_ for _ in ()).throw(TagError("bad")), what="x", timeout_s=1)


def test_guarded_tensorflow_error_names_the_message_and_node():
    """A real session error: the RunError carries TF's message and node, not the bare "Graph execution error:"."""
    from tag.backend.runtime.guard import guarded
    from tag.errors import RunError
    tf = pytest.importorskip("tensorflow")
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        y = tf.debugging.check_numerics(x, "bad value here", name="check")
    with tf.compat.v1.Session(graph=g) as sess:
        with pytest.raises(RunError, match=r"step 2 failed: InvalidArgumentError: bad value here : Tensor had NaN "
                                           r"values \(at node check\)"):
            guarded(lambda: sess.run(y, {x: [float("nan")]}), what="step 2", timeout_s=30)


def test_wait_for_hosts_names_the_silent_host():
    from tag.backend.runtime.health import HostProbe, wait_for_hosts
    from tag.errors import RunError
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    closed = free_ports(1)[0]
    topo = parse_topology(topo_text([listener.getsockname()[1], closed]))
    try:
        t0 = time.monotonic()
        with pytest.raises(RunError, match=rf"no answer from host h1 \(127.0.0.1:{closed}\) within 1 s"):
            wait_for_hosts(topo.hosts, timeout_s=1, interval_s=0.2)
        assert time.monotonic() - t0 < 5
        wait_for_hosts(topo.hosts[:1], timeout_s=1)
        probe = HostProbe(topo.hosts, interval_s=0.1, misses=2, connect_s=0.2)
        deadline = time.monotonic() + 5
        while probe.dead_host() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.stop()
        assert "host h1" in (probe.dead_host() or "") and "h0" not in probe.dead_host()
    finally:
        listener.close()


def test_run_steps_progress_checkpoint_and_resume_in_process(tmp_path):
    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    from tag.backend.runtime.guard import RunControl
    gd = mlp_graph(tasks=(None, None))
    events = []
    path = str(tmp_path / "ckpt")
    full = run_steps(gd, "", steps=8, warmup=1, synthetic=True, seed=2)
    ctl = RunControl(progress=events.append, checkpoint_every=3, checkpoint_path=path, checkpoint_meta={"k": 1})
    first = run_steps(gd, "", steps=5, warmup=1, synthetic=True, seed=2, control=ctl)
    steps = [e for e in events if e.kind == "step"]
    assert [e.step for e in steps] == [1, 2, 3, 4, 5] and all(e.steps == 5 and e.loss is not None for e in steps)
    assert [e.step for e in events if e.kind == "checkpoint"] == [3, 5]
    meta = read_checkpoint_meta(path)
    assert meta["step"] == 5 and meta["k"] == 1 and meta["losses"] == first.losses
    assert "w1" in meta["variables"] and not any(v.startswith("tag_synthetic/") for v in meta["variables"])
    reader = tf.train.load_checkpoint(path)               # TensorFlow's own format, original names
    assert sorted(reader.get_variable_to_shape_map()) == meta["variables"]
    resumed = run_steps(gd, "", steps=8, warmup=1, synthetic=True, seed=2, control=RunControl(resume_from=path))
    assert resumed.start_step == 5 and len(resumed.step_times) == 3
    assert resumed.losses[:5] == first.losses
    np.testing.assert_allclose(resumed.losses, full.losses, rtol=1e-5)   # the curve continues where it was
    with pytest.raises(TagError, match="nothing left to run"):
        run_steps(gd, "", steps=5, warmup=1, synthetic=True, control=RunControl(resume_from=path))
    other = mlp_graph(tasks=(None, None), hidden=32)
    with pytest.raises(TagError, match="shape"):
        run_steps(other, "", steps=8, warmup=1, synthetic=True, control=RunControl(resume_from=path))
    (tmp_path / "junk").mkdir()
    with pytest.raises(TagError, match="no TensorFlow checkpoint"):
        read_checkpoint_meta(tmp_path / "junk")


# ------------------------------------------------------------------------------------------------
# tag-deploy --run on real local workers: a killed worker is named, --resume continues (slow)
# ------------------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _task_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return json.loads(env[b"TF_CONFIG"])["task"]["index"]
    except (OSError, KeyError, ValueError):
        return None


@pytest.mark.slow
def test_killed_worker_is_reported_and_the_run_resumes(tmp_path):
    topo_path = tmp_path / "loop.pbtxt"
    topo_path.write_text(topo_text(free_ports(3)))
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, "-m", "tag.cli.deploy", "--topo", str(topo_path), "--model",
            "zoo:mlp,input_dim=32,hidden=64", "--batch", "12", "--strategy", "ps", "--run",
            "--checkpoint-dir", str(ckpt)]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("TAG_PROFILE", None)
    proc = subprocess.Popen(base + ["--steps", "100000", "--checkpoint-every", "5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines = []
    try:
        killed_at = None
        reader = LineReader(proc.stderr)
        for line in reader.lines(total_timeout_s=300):
            lines.append(line + "\n")
            if ": step " in line and (ckpt / "checkpoint").exists():
                step = int(line.split(": step ")[1].split("/")[0])
                if step >= 12:
                    victim = [p for p in _children(proc.pid) if _task_of(p) == 1]
                    assert victim, lines
                    os.kill(victim[0], signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
        assert killed_at is not None, "".join(lines[-20:])
        proc.wait(timeout=60)
        rest = "\n".join(reader.lines(total_timeout_s=30))
        elapsed = time.monotonic() - killed_at
    finally:
        stop(proc)
    assert elapsed < 30, elapsed
    assert proc.returncode == 1
    last = rest.strip().splitlines()[-1]
    assert last.startswith("tag-deploy: error: worker for host h1 (127.0.0.1:") and "died" in last, rest
    assert "Traceback" not in rest
    assert not _children(proc.pid)

    from tag.backend.runtime.checkpoint import read_checkpoint_meta
    meta = read_checkpoint_meta(ckpt)
    saved = meta["step"]
    assert saved >= 10 and saved % 5 == 0
    report = tmp_path / "r.json"
    done = subprocess.run(base + ["--steps", str(saved + 3), "--resume", "--report", str(report)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed at step {saved}" in done.stderr
    r = json.loads(report.read_text())
    losses = r["measured_losses"]
    assert r["measured_start_step"] == saved and len(losses) == saved + 3
    assert losses[:saved] == pytest.approx(meta["losses"])
    # continues, not restarts (a new synthetic batch each step: compared with the first steps' level)
    assert max(losses[saved:]) < losses[0] and np.mean(losses[saved:]) < np.mean(losses[:3])


def test_synthetic_runs_make_each_remote_replica_slice_on_its_own_device():
    """A dp rewrite slices the batch on the first replica's host and sends the other slices; synthetic runs
    make those slices on the reading devices instead (each host its own share, as MWMS workers do)."""
    import tag
    from helpers import in_process_servers
    from tag.backend.runtime.inputs import remote_input_slices
    from tag.strategy.baselines import builtin_strategy
    from tag.strategy.grouping import group_ops
    ports, servers = in_process_servers(2)
    topo = parse_topology(topo_text(ports))
    gd = tag.zoo.training_graph("mlp", batch_size=8)
    tg = tag.analyze(gd)
    from tag.backend.rewrite import rewrite
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 4)), topo)
    placeholders = {n.name: n for n in res.graph_def.node if n.op == "Placeholder"}
    stand_ins = remote_input_slices(res.graph_def, placeholders)
    assert stand_ins, "the second replica's input slices should be made on its own host"
    for name, (node, _source, _, _) in stand_ins.items():
        src = placeholders[[n for n in res.graph_def.node if n.name == name][0].input[0].split(":")[0]]
        assert node.device.startswith("/job:worker/task:1") and "task:0" in src.device
        dims = [d.size for d in node.attr["shape"].shape.dim]
        full = [d.size for d in src.attr["shape"].shape.dim]
        assert dims[0] == full[0] // 2 and dims[1:] == full[1:]
    # the synthetic import maps each of them to a variable on that device, and the graph still imports
    from tag.backend.runtime.steps import _import_graph
    graph, input_map, inits = _import_graph(res.graph_def, synthetic=True, fed_names=set(), seed=0)
    for name, (node, _, _, _) in stand_ins.items():
        assert f"{name}:0" in input_map
        assert graph.get_operation_by_name(f"tag_synthetic/{name}/batch").device == node.device
    assert len(inits) == len(placeholders) + len(stand_ins)
    # each remote share is the same rows of the same synthetic batch (two in-process TF servers)
    with tf.compat.v1.Session(servers[0].target, graph=graph, config=bounded(session_config())) as sess:
        sess.run(inits)
        for name, (_node, source, begin, end) in stand_ins.items():
            share, whole = sess.run([input_map[f"{name}:0"], input_map[f"{source}:0"]])
            assert share.shape[0] == end[0] - begin[0] and np.array_equal(share, whole[begin[0]:end[0]])
