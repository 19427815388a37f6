"""The end-to-end benchmark's pieces: shared models (tag_bench.mwms) and the testbed topology/profile."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from tag.cluster.topology import parse_topology
from tag.cost.model import DeviceProfile, Profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(REPO, "scripts", "bench_e2e.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mlp_graph_has_the_entry_points_and_about_8m_parameters():
    from tag_bench.mwms import tf1_graph
    from tag.frontend.analyze import analyze
    gd = tf1_graph("mlp", 96)
    names = {n.name for n in gd.node}
    assert {"input", "labels", "loss", "train_op", "init"} <= names
    tg = analyze(gd, batch_size=96)
    params = sum(v.nbytes for v in tg.variables if v.kind == "trainable") // 4
    assert 7.5e6 < params < 8.5e6


def test_vgg_graph_keeps_most_weights_in_the_head_and_most_flops_in_the_convolutions():
    from tag_bench.mwms import tf1_graph
    from tag.frontend.analyze import analyze
    tg = analyze(tf1_graph("vgg", 6), batch_size=6)
    weights = {v.name: v.nbytes // 4 for v in tg.variables if v.kind == "trainable"}
    head = sum(n for name, n in weights.items() if "dense" in name)
    assert 2.0e6 < sum(weights.values()) < 2.5e6 and head / sum(weights.values()) > 0.9
    conv = sum(o.flops.per_example for o in tg.ops if o.type.startswith("Conv2D"))
    dense = sum(o.flops.per_example for o in tg.ops if o.type == "MatMul")
    assert conv > 4 * dense             # about 80% of the FLOPs


def test_float64_build_has_float64_weights_and_inputs_and_leaves_keras_in_float32():
    import tensorflow as tf
    import tf_keras
    from tag_bench.mwms import tf1_graph
    # even under a global policy pinned to float32 (as a test that restores the policy leaves it)
    old = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy("float32")
    try:
        gd = tf1_graph("mlp", 8, width=32, depth=2, floatx="float64")
        assert tf_keras.mixed_precision.global_policy().name == "float32"
    finally:
        tf_keras.mixed_precision.set_global_policy(old)
    nodes = {n.name: n for n in gd.node}
    assert nodes["input"].attr["dtype"].type == tf.float64.as_datatype_enum
    kernels = [n for n in gd.node if n.op == "VarHandleOp" and n.name.endswith("kernel")]
    assert kernels and all(n.attr["dtype"].type == tf.float64.as_datatype_enum for n in kernels)
    matmuls = [n for n in gd.node if n.op == "MatMul"]
    assert matmuls and all(n.attr["T"].type == tf.float64.as_datatype_enum for n in matmuls)
    assert tf_keras.backend.floatx() == "float32"                 # restored for the next build
    gd32 = tf1_graph("mlp", 8, width=32, depth=2)
    # the same ops; float64 adds the optimizer's casts of its hyperparameters (and reads them there)
    assert {n.name for n in gd32.node if n.op != "ReadVariableOp"} <= set(nodes)


def _saved_row(case: str, plan_s: float) -> dict:
    """One bench_e2e row as --json saves it (the keys summary() and markdown_table() read)."""
    return {"config": "G", "case": case, "batch": 48, "mwms_s": {"1": 0.1, "2": 0.2, "3": 0.3}, "mwms_best_s": 0.1,
            "mwms_best_hosts": 1, "uniform_s": 0.1, "uniform": "one device on h0", "dp_same_s": 0.1, "dp_same_over_mwms": 1.0, "plan_s": plan_s,
            "plan_method": "pipeline", "plan_is_uniform": False, "plan": "[h0 | h1] M=4", "tuned_s": plan_s,
            "tuned_method": "pipeline", "tuned_is_uniform": False, "tuned": "[h0 | h1] M=4",
            "speedup_vs_best_mwms": 0.1 / plan_s, "speedup_vs_mwms": 0.3 / plan_s, "dp_over_mwms": 1.0,
            "plan_speedup_vs_best_mwms": 0.1 / plan_s, "tune_seconds": 10.0, "load": [1.0, 1.0, 1.0]}


def test_gpu_ratio_links_and_the_readme_table():
    """Configuration G's links keep a V100's bytes per FLOP; --table renders a row with both anchors."""
    import sys
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from _testbed_cases import gpu_ratio_link_gbps
    prof = Profile(devices={"CPUq100": DeviceProfile(20e9, 1e10, 1e-5, {})})
    assert gpu_ratio_link_gbps(prof, 1.0, 25.0) == pytest.approx(25.0 * 20e9 / 15e12)
    row = {**_saved_row("vgg", 0.08), "uniform_s": 0.12, "dp_same_s": 0.11, "plan_method": "mcts",
           "tuned_method": "mcts", "mixed_over_uniform": 1.5, "mixed_win": True, "tuned": "allreduce@h0+h1 x9",
           "load": [3.0, 3.0, 3.0]}
    assert (row["speedup_vs_best_mwms"], row["speedup_vs_mwms"]) == pytest.approx((1.25, 3.75))
    table = bench().markdown_table({"rows": [row]})
    assert "| G | vgg (48) | 100 / 200 / 300 | 100 (1) |" in table and "1.50 (win)" in table


def test_an_mwms_anchor_that_failed_is_named_and_left_out_of_the_all_hosts_keys():
    """MWMS that failed on all three hosts: the row's table says "failed" there and n/a against it; the best
    MWMS is of the prefixes that ran, and the all-hosts keys average over the other cases."""
    bench_e2e = bench()
    failed = {**_saved_row("deep-mlp", 0.05), "mwms_s": {"1": 0.1, "2": 0.2, "3": None},
              "mwms_failed": {"3": "MWMS chief failed (rc 1): heartbeat timeout"}, "speedup_vs_mwms": None,
              "dp_over_mwms": None}
    other = {**_saved_row("vgg", 0.1), "dp_over_mwms": 2.0}
    s = bench_e2e.summary([failed, other])
    assert s["geomean_speedup_vs_mwms"] == pytest.approx(3.0) and s["dp_over_mwms"] == pytest.approx(2.0)
    assert s["geomean_speedup_vs_best_mwms"] == pytest.approx((2.0 * 1.0) ** 0.5)
    table = bench_e2e.markdown_table({"rows": [failed]})
    assert "| G | deep-mlp (48) | 100 / 200 / failed | 100 (1) |" in table and "| 2.00x | n/a |" in table
    assert bench_e2e.summary([failed])["geomean_speedup_vs_mwms"] is None


def test_bucketed_data_parallelism_is_a_uniform_action_not_a_mixed_win():
    """Data parallelism with its gradient buckets sized is still one action for every op group: neither a saved
    row that flagged it mixed nor a strategy compared by ``action_key`` counts it as a mixed win."""
    bench_e2e = bench()
    row = {**_saved_row("cnn", 0.1), "uniform": "allreduce@h0+h1+h2 x25", "uniform_s": 0.13,
           "plan": "allreduce@h0+h1+h2 x25 (256 KB buckets)", "tuned": "allreduce@h0+h1+h2 x25 (256 KB buckets)"}
    assert bench_e2e.summary([row])["mixed_wins"] == 0 and row["mixed_over_uniform"] is None
    mixed = {**row, "plan": "allreduce@h0+h1+h2 x12, allreduce@h0 x13 (256 KB buckets)", "tuned_is_uniform": True}
    assert bench_e2e.summary([mixed])["mixed_wins"] == 1 and mixed["mixed_over_uniform"] == pytest.approx(1.3)
    from tag.strategy.types import Action, Grouping, Strategy
    grouping = Grouping(np.array([0, 0, 1]), ["a", "b"])
    dp = Strategy(grouping, [Action((0, 1), "allreduce")] * 2, name="dp")
    bucketed = Strategy(grouping, [Action((0, 1), "allreduce")] * 2, name="dp", bucket_bytes=256 * 1024)
    assert bench_e2e.action_key(bucketed) == bench_e2e.action_key(dp)
    assert bench_e2e.strategy_key(bucketed) != bench_e2e.strategy_key(dp)       # different programs all the same


def test_table_combines_the_cases_of_several_runs_and_refuses_a_case_measured_twice(tmp_path, capsys):
    """--table a.json,b.json: one table and summary over both runs' cases, each row naming its run; a case in
    both runs, or a file that is not a saved result, exits 2 with one line."""
    import json
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"commit": "aaa", "seconds": 10.0, "complete": True, "rows": [_saved_row("vgg", 0.05)]}))
    b.write_text(json.dumps({"commit": "bbb", "seconds": 20.0, "complete": True, "rows": [_saved_row("cnn", 0.08)]}))
    out = tmp_path / "both.json"
    assert bench().main(["--table", f"{a},{b}", "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert [(r["case"], r["run_commit"]) for r in both["rows"]] == [("vgg", "aaa"), ("cnn", "bbb")]
    assert [r["commit"] for r in both["runs"]] == ["aaa", "bbb"]
    assert both["mixed_wins"] == 2 and both["geomean_speedup_vs_best_mwms"] == pytest.approx((2.0 * 1.25) ** 0.5)
    capsys.readouterr()
    assert bench().main(["--table", f"{a},{a}"]) == 2
    assert "vgg at batch 48 is in both" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert bench().main(["--table", f"{a},{bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a saved bench_e2e --json result" in err and "\n" not in err
    bad.write_text('{"rows": [{"config": "G"}]}')
    assert bench().main(["--table", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a row has no key" in err and "\n" not in err


def test_testbed_recipe_and_topology_from_profiled_quotas():
    """The recipe's configurations become three-host topologies whose device speeds are the profile's."""
    import sys
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from _testbed_cases import all_quotas, device_type, load_recipe, testbed_topology
    recipe = load_recipe()
    quotas = all_quotas(recipe)
    prof = Profile(devices={device_type(q): DeviceProfile(4e10 * q, 1e10 * q, 1e-5, {}) for q in quotas})
    _, topo = testbed_topology(recipe, "A", prof)
    assert len(topo.hosts) == 3 and [d.device_type for d in topo.devices] == ["CPUq100", "CPUq50", "CPUq25"]
    assert [g.peak_flops for g in topo.groups] == pytest.approx([4e10, 2e10, 1e10])
    assert topo.host_bandwidth[0, 1] == pytest.approx(1e9 / 8) and topo.host_bandwidth[1, 2] == pytest.approx(0.2e9 / 8)


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
    from test_rewrite import assert_same_training, feeds_for, reference, run_rewritten
    from tag.strategy.baselines import BUILTIN_STRATEGIES

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
    got = run_rewritten(rewritten, servers[0].target, ir, batches)
    # 1e-4: the convolutions' weight gradients sum 48 x 32 x 32 terms, in another order on three replicas
    assert_same_training(got, ref, grads0, ir, learning_rate=0.01, rtol=1e-4)


def test_a_cheap_step_is_timed_for_longer_and_a_costly_one_as_asked():
    """bench_e2e times each program MIN_TIMED_S seconds' worth of steps (at most MAX_TIMED_STEPS, never fewer
    than --steps asks), decided from its first round; the steps are spread evenly over the rounds."""
    bench_e2e = bench()
    assert bench_e2e.timed_steps_after_first_round([0.2] * 4, 10, min_timed_s=20.0, max_timed=45) == 45
    assert bench_e2e.timed_steps_after_first_round([0.5, 0.6, 0.5], 10, min_timed_s=20.0, max_timed=45) == 40
    assert bench_e2e.timed_steps_after_first_round([7.0] * 4, 10, min_timed_s=20.0, max_timed=45) == 10
    assert bench_e2e.timed_steps_after_first_round([], 10) == 10
    assert bench_e2e.split_steps(10, 3) == [4, 3, 3] and bench_e2e.split_steps(41, 2) == [21, 20]


def test_mwms_and_tag_take_turns_going_first_in_the_rounds():
    """Neither side of a bench_e2e round always runs right after the other: MWMS first in even rounds."""
    bench_e2e = bench()
    firsts = [bench_e2e.round_order(r, ["mwms", "tag"])[0] for r in range(4)]
    assert firsts == ["mwms", "tag", "mwms", "tag"]
    assert sorted(bench_e2e.round_order(1, ["mwms", "tag"])) == ["mwms", "tag"]
