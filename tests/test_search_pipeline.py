"""Pipeline search (tag/search/pipeline_dp.py) and its place in the portfolio (tag/search/driver.py).
Tiny hand-made graphs and topologies; no TensorFlow."""
import pytest

from tag.cost.model import CostModel, DeviceProfile, Profile
from tag.search import SearchEnv, search
from tag.search.driver import best_uniform, stage_choice
from tag.search.pipeline_dp import (
    _has_empty_stage,
    _Tables,
    balance,
    group_chain,
    pipeline_alternatives,
    pipeline_dp,
    stage_device_sets,
)
from tag.strategy.grouping import group_ops
from tag.strategy.pipeline import SCHEDULES, Pipeline, PipelineStage
from tiny import DeviceSpec, make_topology, mlp_graph

PROFILE = Profile({t: DeviceProfile(peak_flops=f, memory_bandwidth=1e30, launch_overhead_s=0.0,
                                    efficiency={"MatMul": 1.0, "default": 1.0})
                   for t, f in (("FAST", 3e12), ("SLOW", 1e12))})


def _env(bandwidth=1.25e9, batch=256):
    """A deep MLP on a fast host and a 3x slower one behind a 10 Gbit/s link."""
    tg = mlp_graph(batch=batch, widths=(1024,) * 9)
    topo = make_topology([("fast", [("FAST", 1)]), ("slow", [("SLOW", 1)])], inter_bandwidth=bandwidth,
                         inter_latency=5e-5, specs={"FAST": DeviceSpec(peak_flops=3e12),
                                                    "SLOW": DeviceSpec(peak_flops=1e12)})
    grouping = group_ops(tg, 16)
    return SearchEnv(tg, topo, grouping, cost_model=CostModel(tg, topo, PROFILE))


def test_chain_and_device_sets():
    env = _env()
    assert group_chain(env.simulator.tasks) == list(range(env.num_groups))      # dense_0 .. dense_7, loss
    assert stage_device_sets(env.topology, env.speeds) == [[(0,), (1,)], [(1,), (0,)], [(0, 1), (0,)],
                                                           [(0,), (0, 1)]]
    four = make_topology([(f"h{i}", [("GPU-A", 2)]) for i in range(4)])
    sets = stage_device_sets(four, [1.0] * four.num_devices)
    assert [(0,), (1,)] in sets and [(0,), (1,), (2,), (3,)] in sets
    assert [(0, 1), (2, 3)] in sets                 # every host, two stages of two hosts each
    assert [(0, 1, 2, 3), (0,)] in sets             # every host, then the fastest alone (a CNN's head)


def test_dp_gives_the_fast_host_more_groups():
    env = _env()
    tables = _Tables(env, group_chain(env.simulator.tasks))
    for seq in ([(0,), (1,)], [(1,), (0,)]):
        _, cuts = balance(tables, seq, 8, 32, "1f1b")
        sizes = [cuts[0], env.num_groups - cuts[0]]
        on_fast = sizes[seq.index((0,))]
        assert on_fast >= 2 * sizes[seq.index((1,))], (seq, sizes)


def test_pipeline_beats_the_best_uniform_action_on_a_slow_link():
    env = _env()
    _, uniform = best_uniform(env)
    found = pipeline_dp(env)
    assert found.outcome.feasible
    assert found.outcome.step_time < 0.95 * uniform.step_time
    p = found.strategy.pipeline
    assert p.num_stages == 2 and p.micro_batches >= 4
    fast_stage = next(st for st in p.stages if st.placement == (0,))
    assert len(fast_stage.groups) > env.num_groups / 2
    assert found.estimate == pytest.approx(found.outcome.step_time, rel=0.25)   # the DP's model is close
    # the portfolio: the pipeline wins, its stages as per-group actions are a valid choice too
    result = search(env, playouts=20, seed=0)
    assert result.method == "pipeline" and result.strategy.pipeline == p
    assert result.baselines["pipeline"] == pytest.approx(found.outcome.step_time)
    assert stage_choice(env, p and found.strategy) is not None and "pipeline_stages" in result.baselines
    assert "pipeline" not in search(env, playouts=5, seed=0, use_pipeline=False).baselines


def test_other_micro_batch_counts_and_schedules_are_tuning_candidates():
    env = _env()
    found = pipeline_dp(env)
    answer = found.strategy.pipeline
    alternatives = pipeline_alternatives(found)
    feasible = [(p, o) for p, _, o in found.tried if o.feasible]
    want = {f"pipeline_m{p.micro_batches}" for p, _ in feasible if p.micro_batches != answer.micro_batches}
    want |= {f"pipeline_{p.schedule}" for p, _ in feasible
             if p.micro_batches == answer.micro_batches and p.stages == answer.stages and p != answer}
    assert set(alternatives) == want and any(n.startswith("pipeline_m") for n in want)
    assert {f"pipeline_{s}" for s in SCHEDULES if s != answer.schedule} <= set(alternatives)   # climbed from it
    for name, (strategy, outcome) in alternatives.items():
        pipeline = strategy.pipeline
        assert strategy.name == name and strategy.grouping is found.strategy.grouping
        assert outcome.feasible and outcome.step_time >= found.outcome.step_time    # the answer is the best
        if name.startswith("pipeline_m"):
            assert name == f"pipeline_m{pipeline.micro_batches}"
            assert all(o.rank <= outcome.rank for p, o in feasible if p.micro_batches == pipeline.micro_batches)
        else:
            assert pipeline == Pipeline(answer.stages, answer.micro_batches, name[len("pipeline_"):])
    # in the portfolio: compared in the report and offered to the tuning step, never the plan by themselves
    result = search(env, playouts=5, seed=0)
    for name, (strategy, outcome) in pipeline_alternatives(result.pipeline).items():
        assert result.candidates[name].pipeline == strategy.pipeline
        assert result.baselines[name] == pytest.approx(outcome.step_time)
    assert result.method == "pipeline"


def test_no_stage_of_only_update_groups_is_tried():
    """Run 18's deep MLP: the hill-climb moved every layer onto h0 and left h1 + h2 only optimizer groups, a
    pipeline predicted as fast as one host. Such a stage is no stage: neither the DP nor the climb tries one."""
    env = _env()
    chain = group_chain(env.simulator.tasks)
    tables = _Tables(env, chain)
    update_only = [g for g in chain if tables.empty_stage[tables.position[g], tables.position[g] + 1]]
    assert update_only, "the MLP's optimizer groups carry no forward/backward work"
    work = [g for g in chain if g not in update_only]
    degenerate = Pipeline((PipelineStage(tuple(work), (0,)), PipelineStage(tuple(update_only), (1,))), 1,
                          "fill_drain")
    assert _has_empty_stage(degenerate, tables)
    found = pipeline_dp(env)
    assert not _has_empty_stage(found.strategy.pipeline, tables)
    assert not any(_has_empty_stage(p, tables) for p, _, _ in found.tried)


def test_no_pipeline_when_the_link_is_too_slow_for_activations():
    env = _env(bandwidth=1e6)
    found = pipeline_dp(env)
    result = search(env, playouts=10, seed=0)
    assert result.method != "pipeline"
    assert found.strategy is None or found.outcome.step_time > result.step_time


TWO_HOSTS = """name: "a100-v100-10g"
host {
  name: "a100"
  address: "127.0.0.1"
  port: 2222
  device { type: "A100-40G" kind: GPU count: 1 memory_gib: 40 peak_tflops: 19.5 memory_bandwidth_gbs: 1555 }
  interconnect { kind: NVLINK bandwidth_gbs: 300 latency_us: 2 }
}
host {
  name: "v100"
  address: "127.0.0.1"
  port: 2223
  device { type: "V100-16G" kind: GPU count: 1 memory_gib: 16 peak_tflops: 15.7 memory_bandwidth_gbs: 900 }
  interconnect { kind: NVLINK bandwidth_gbs: 25 latency_us: 2 }
}
fabric { bandwidth_gbps: 10 latency_us: 50 }
"""


def test_optimize_returns_a_pipeline_that_saves_loads_and_deploys(tmp_path, capsys, monkeypatch):
    """A deep wide MLP at a large batch on an A100 and a V100 behind 10 Gbit/s: data parallelism pays 400 MB
    of all-reduce, one host leaves the other idle; the pipeline beats both (the V100 takes fewer layers). The
    batch is large enough that micro-batches of it still fill the GPUs' waves of GEMM tiles
    (``tag.cost.occupancy``: at 2048, micro-batches of 256 rows leave an A100 41% idle and one host wins)."""
    import json

    import tag
    from tag.cli.deploy import main
    from tag.frontend import zoo
    monkeypatch.delenv("TAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    topo = tmp_path / "two.pbtxt"
    topo.write_text(TWO_HOSTS)
    spec = "zoo:mlp,hidden=4096x4096x4096x4096x4096x4096"
    _, gd = zoo.resolve_model(spec, batch_size=8192)
    plan = tag.optimize(gd, str(topo), batch_size=8192, playouts=5, sfb=False)
    assert plan.method == "pipeline" and plan.strategy.pipeline is not None
    assert plan.predicted_step_time < 0.95 * min(plan.baselines["single"], plan.baselines["best_uniform"])
    report = plan.report()
    stages = report["pipeline"]["stages"]
    assert len(stages) == 2 and report["pipeline"]["micro_batches"] >= 2
    on = {st["devices"][0].split("/")[0]: len(st["group_indices"]) for st in stages}
    assert 0 < report["pipeline"]["bubble_fraction_predicted"] < 1
    assert report["pipeline_search"]["simulated"] >= 1
    layers = {st["devices"][0].split("/")[0]: st["groups"] for st in stages}
    assert set(on) == {"a100", "v100"} and all(" .. " in g for g in layers.values())
    loaded = tag.Plan.load(plan.save(tmp_path / "plan"))
    assert loaded.strategy.pipeline == plan.strategy.pipeline
    # tag-deploy predicts the saved pipelined plan and prints its stages
    out_report = tmp_path / "r.json"
    rc = main(["--topo", str(topo), "--model", spec, "--strategy-file", str(tmp_path / "plan"),
               "--report", str(out_report)])
    out = capsys.readouterr().out
    assert rc == 0 and "pipeline             2 stages" in out and "stage 1:" in out
    saved = json.loads(out_report.read_text())
    assert saved["pipeline"]["micro_batches"] == plan.strategy.pipeline.micro_batches
    assert saved["predicted_step_time_s"] == pytest.approx(plan.predicted_step_time, rel=1e-6)
