"""tag.search.buckets: where a plan's gradient fusion buckets close, chosen on the simulator."""
from __future__ import annotations

import dataclasses
import os

import pytest

from tag.search.buckets import BUCKET_CHOICES, choose_bucket_bytes, fusable
from tag.sim.simulator import Simulator
from tag.strategy.fusion import FUSION_BUCKET_BYTES
from tag.strategy.grouping import group_ops
from tag.strategy.pipeline import Pipeline, PipelineStage
from tag.strategy.types import Action, Strategy
from tiny import DeviceSpec, make_topology, mlp_graph


def data_parallel(tg, topo, groups: int = 8):
    grouping = group_ops(tg, target_groups=groups)
    sim = Simulator(tg, topo, grouping)
    return sim, Strategy(grouping, [Action(tuple(range(len(topo.groups))), "allreduce")] * grouping.num_groups)


def test_a_ring_over_many_slow_hosts_wants_few_large_buckets():
    """Eight hosts 5 ms apart: every collective pays 14 ring steps of latency, so 100 MB of gradients in one
    bucket beat 16 MB buckets; the sizes the buckets do not change are predicted alike."""
    tg = mlp_graph(batch=64, widths=(2048,) * 7)        # six 16 MB weight matrices
    topo = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(8)], inter_latency=5e-3,
                         inter_bandwidth=12.5e9)
    sim, dp = data_parallel(tg, topo)
    chosen = choose_bucket_bytes(sim, dp, tg.batch_size)
    assert chosen is not None and chosen.strategy.bucket_bytes > FUSION_BUCKET_BYTES
    assert chosen.step_time < 0.5 * chosen.default_step_time
    assert chosen.step_time == sim.evaluate(chosen.strategy, tg.batch_size).step_time
    assert chosen.step_times[FUSION_BUCKET_BYTES] == chosen.default_step_time
    # the largest of the equally fast sizes: the fewest collectives
    assert chosen.strategy.bucket_bytes == max(b for b, t in chosen.step_times.items() if t == chosen.step_time)
    assert dp.bucket_bytes is None      # the strategy passed in is left alone


def test_a_slow_link_beside_long_compute_wants_buckets_that_overlap_the_backward_pass():
    """Two hosts on 1 Gbit/s with half a second of compute: small buckets start during the backward pass."""
    tg = mlp_graph(batch=4096, widths=(1024,) * 7)
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)])],
                         specs={"GPU-A": DeviceSpec(peak_flops=2e12)}, inter_bandwidth=1.25e8)
    sim, dp = data_parallel(tg, topo)
    chosen = choose_bucket_bytes(sim, dp, tg.batch_size)
    assert chosen is not None and chosen.strategy.bucket_bytes < FUSION_BUCKET_BYTES
    assert chosen.step_time <= 0.99 * chosen.default_step_time
    assert set(chosen.step_times) == set(BUCKET_CHOICES) | {FUSION_BUCKET_BYTES}


def test_nothing_to_fuse_or_nothing_gained_keeps_the_default():
    tg = mlp_graph(batch=8, widths=(16, 32, 4))
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)])])
    sim, dp = data_parallel(tg, topo)
    assert choose_bucket_bytes(sim, dp, 8) is None            # a few KB of gradients: every size is one bucket
    one = Strategy(dp.grouping, [Action((0,), "allreduce")] * dp.grouping.num_groups)
    assert choose_bucket_bytes(sim, one, 8) is None           # one device: nothing is all-reduced
    ps = Strategy(dp.grouping, [Action((0, 1), "ps", ps_device=0)] * dp.grouping.num_groups)
    assert not fusable(ps) and choose_bucket_bytes(sim, ps, 8) is None
    n = dp.grouping.num_groups
    stages = (PipelineStage(tuple(range(n // 2)), (0,)), PipelineStage(tuple(range(n // 2, n)), (1,)))
    piped = Strategy.pipelined(dp.grouping, Pipeline(stages, 2))
    assert not fusable(piped) and choose_bucket_bytes(sim, piped, 8) is None


def test_bucket_bytes_change_the_simulated_buckets():
    """The simulator closes buckets at the strategy's size: a size below every group's gradients gives one
    collective per group, the default one for all of them."""
    tg = mlp_graph(batch=64, widths=(512,) * 5)
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)])])
    sim, dp = data_parallel(tg, topo)
    assert len(sim.collectives(dp, 64)) == 1
    per_group = sim.collectives(dataclasses.replace(dp, bucket_bytes=1.0), 64)
    assert len(per_group) == sum(1 for g in range(dp.grouping.num_groups) if sim.tasks.update_tasks[g])


@pytest.mark.parametrize("fuse", [True, False])
def test_search_plan_keeps_the_default_size_as_a_tuning_candidate(fuse):
    """tag.optimize's plan reports the sizes it compared; dp_allreduce with its own size is a candidate for
    the measured tuning step (``dp_allreduce_buckets``) when the plan is something else."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tag
    from tag.api import DEFAULT_BUCKETS, DP_BUCKETS, prepare, search_plan
    from tag.cluster.topology import parse_topology
    cpu = 'device { type: "CPU" kind: CPU memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }'
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {2000 + i} {cpu} }}' for i in range(2))
    topo = parse_topology(f'name: "slow"\n{hosts}\nfabric {{ bandwidth_gbps: 0.5 latency_us: 50 }}\n')
    gd = tag.zoo.training_graph("mlp", batch_size=256, input_dim=512, hidden=(512, 512), num_classes=10)
    analysis = prepare(gd, topo, name="mlp")
    plan = search_plan(analysis, playouts=20, seed=0, fuse_buckets=fuse)
    report = plan.report()
    if not fuse:
        assert DP_BUCKETS not in plan.candidates and DEFAULT_BUCKETS not in plan.candidates
        assert "bucket_bytes" not in report
        return
    assert plan.method != "dp_allreduce"
    dp = plan.candidates[DP_BUCKETS]
    assert dp.bucket_bytes in BUCKET_CHOICES
    assert report["baselines"][DP_BUCKETS] < report["baselines"]["dp_allreduce"]
    assert report["baselines"][DP_BUCKETS] == pytest.approx(analysis.simulator().evaluate(dp).step_time)
