"""Pipelines in the simulator (tag/sim/pipeline.py): micro-batch timelines, bubbles, memory by schedule,
transfers between stages, the trace, bad input. Tiny hand-made graphs; no TensorFlow."""
from itertools import pairwise

import numpy as np
import pytest

from tag.cost.model import CostModel, DeviceProfile, Profile
from tag.errors import StrategyError
from tag.sim.simulator import Simulator
from tag.strategy.grouping import group_ops
from tag.strategy.pipeline import Pipeline, PipelineStage
from tag.strategy.types import Action, Strategy
from tiny import DeviceSpec, make_topology, mlp_graph

EXACT = Profile({"GPU-A": DeviceProfile(peak_flops=1e12, memory_bandwidth=1e30, launch_overhead_s=0.0,
                                        efficiency={"MatMul": 1.0, "default": 1.0})})


def _setup(hosts=2, per_host=1, bandwidth=1e12, latency=0.0, memory=16 << 30, batch=64, width=512):
    tg = mlp_graph(batch=batch, widths=(width,) * 5)
    topo = make_topology([(f"h{i}", [("GPU-A", per_host)]) for i in range(hosts)], inter_bandwidth=bandwidth,
                         inter_latency=latency, specs={"GPU-A": DeviceSpec(memory_bytes=memory)})
    grouping = group_ops(tg, 8)
    assert grouping.names == ["dense_0", "dense_1", "dense_2", "dense_3", "loss"]
    return tg, topo, grouping, Simulator(tg, topo, grouping, CostModel(tg, topo, EXACT))


def _two_stages(grouping, m, schedule="1f1b", placements=((0,), (1,))):
    p = Pipeline((PipelineStage((0, 1), placements[0]), PipelineStage((2, 3, 4), placements[1])), m, schedule)
    return Strategy.pipelined(grouping, p)


@pytest.mark.parametrize("placement", [(0,), (0, 1)])
def test_one_stage_one_micro_batch_is_the_plain_strategy(placement, monkeypatch):
    import tag.strategy.fusion as fusion
    monkeypatch.setattr(fusion, "FUSION_BUCKET_BYTES", 0.0)     # pipelines sync per op group; so must the plain
    tg, topo, grouping, sim = _setup(latency=1e-5, bandwidth=1e9)
    plain = sim.evaluate(Strategy(grouping, [Action(placement, "allreduce")] * grouping.num_groups))
    piped = sim.evaluate(Strategy.pipelined(grouping, Pipeline((PipelineStage(tuple(range(5)), placement),), 1)))
    assert piped.step_time == pytest.approx(plain.step_time, rel=1e-9)
    assert np.allclose(piped.peak_memory, plain.peak_memory)
    assert piped.comm_bytes == pytest.approx(plain.comm_bytes)
    assert piped.bubble_fraction == pytest.approx(0.0)
    assert plain.bubble_fraction is None


def test_bubble_shrinks_as_micro_batches_grow_and_1f1b_holds_less():
    tg, topo, grouping, sim = _setup()
    bubbles, memory = [], {}
    for m in (1, 2, 4, 8):
        r = sim.evaluate(_two_stages(grouping, m, "fill_drain"))
        bubbles.append(r.bubble_fraction)
        memory[m] = r.activation_memory[0]
    assert all(a > b for a, b in pairwise(bubbles)), bubbles
    assert bubbles[0] == pytest.approx(0.5, abs=0.02)           # two stages, one micro-batch: half idle
    one_f = sim.evaluate(_two_stages(grouping, 8, "1f1b"))
    assert one_f.activation_memory[0] < memory[8]               # 1F1B: 2 micro-batches in flight on stage 0, not 8
    assert memory[8] > 0.8 * memory[1]                           # fill-drain keeps the whole batch alive
    # a pipeline over both devices beats one device alone here (fast link)
    single = sim.evaluate(Strategy(grouping, [Action((0,))] * 5))
    assert one_f.step_time < single.step_time


def test_transfers_between_stages_ride_the_links_and_the_trace_shows_micro_batches():
    tg, topo, grouping, sim = _setup(bandwidth=1e9, latency=1e-5)
    m = 4
    st = _two_stages(grouping, m, "1f1b")
    r = sim.evaluate(st)
    # dense_1's output (64 x 512 floats) forward and its gradient backward, per micro-batch in total once
    assert r.comm_bytes == pytest.approx(2 * 64 * 512 * 4)
    trace = sim.trace(st)
    compute = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
    names_on = {d: {e["name"].split()[0] for e in compute if e["tid"] == d} for d in (0, 1)}
    for d in (0, 1):
        assert {f"F{i}" for i in range(m)} | {f"B{i}" for i in range(m)} <= names_on[d]
    # stage 0 runs 1F1B: F0 F1 B0 F2 B1 F3 B2 B3 (the dense_0 task of each step)
    order = [e["name"].split()[0] for e in sorted(compute, key=lambda e: e["ts"])
             if e["tid"] == 0 and e["name"].endswith("dense_0")]
    assert order == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3", "update"]
    labels = {e["name"] for e in comm}
    assert {f"F{i} dense_1 -> F{i} dense_2" for i in range(m)} <= labels
    assert {f"B{i} dense_2 -> B{i} dense_1" for i in range(m)} <= labels
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(r.bubble_fraction)


def test_stage_all_reduce_runs_once_after_the_last_micro_batch():
    tg, topo, grouping, sim = _setup(hosts=4, bandwidth=1e9, latency=1e-5)
    st = _two_stages(grouping, 4, "fill_drain", placements=((0, 1), (2, 3)))
    colls = sim.collectives(st)
    assert sorted(c["group"] for c in colls) == [0, 1, 2, 3]     # one per op group with weights
    assert all(c["devices"] in ([0, 1], [2, 3]) for c in colls)
    # ... each once its group's backward has run for every micro-batch
    trace = sim.trace(st)
    for c in colls:
        name = grouping.names[c["group"]]
        backward = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("cat") == "compute"
                    and e["name"].startswith("B") and e["name"].endswith(" " + name) and e["tid"] in c["devices"]]
        assert len(backward) == 4 * 2
        assert c["start_s"] * 1e6 >= max(backward) - 1e-6
    ps = Pipeline((PipelineStage((0, 1), (0, 1), "ps", 0), PipelineStage((2, 3, 4), (2, 3))), 4)
    assert sim.evaluate(Strategy.pipelined(grouping, ps)).step_time > 0


def test_bad_pipelines_name_the_stage():
    tg, topo, grouping, sim = _setup(batch=8)
    with pytest.raises(StrategyError, match="stage 1"):          # stage 1 before stage 0 in dependency order
        sim.evaluate(Strategy.pipelined(grouping, Pipeline((PipelineStage((2, 3, 4), (0,)),
                                                            PipelineStage((0, 1), (1,))), 2)))
    with pytest.raises(StrategyError, match="pipeline stage 1: 6 micro-batches but device h0/GPU-A:0 gets only 4"):
        sim.evaluate(_two_stages(grouping, 6, placements=((0,), (0, 1))))
    with pytest.raises(StrategyError, match="stage 5"):          # more stages than op groups
        Strategy.pipelined(grouping, Pipeline(tuple(PipelineStage((g,), (0,)) for g in range(6)), 1))
    with pytest.raises(StrategyError, match="stages but the grouping has only 5"):
        sim.pipeline_tasks(Pipeline(tuple(PipelineStage((g,), (0,)) for g in range(6)), 1))


def test_a_pipeline_that_does_not_fit_is_infeasible():
    tg, topo, grouping, sim = _setup(memory=3 << 20, batch=256)
    fill = sim.evaluate(_two_stages(grouping, 16, "fill_drain"))
    one_f = sim.evaluate(_two_stages(grouping, 16, "1f1b"))
    assert not fill.feasible and 0 in fill.oom_devices
    assert one_f.activation_memory[0] < fill.activation_memory[0]


def test_report_fields_name_stages_and_the_stages_out_of_memory():
    from tag.report import oom_stages, pipeline_fields
    tg, topo, grouping, sim = _setup(memory=3 << 20, batch=256)
    st = _two_stages(grouping, 16, "fill_drain")
    r = sim.evaluate(st)
    report = {"oom_devices": [topo.devices[d].name for d in r.oom_devices], **pipeline_fields(st, topo, r)}
    p = report["pipeline"]
    assert [s["groups"] for s in p["stages"]] == ["dense_0 .. dense_1", "dense_2 .. loss"]
    assert p["stages"][1]["devices"] == ["h1/GPU-A:0"] and p["micro_batches"] == 16
    assert p["bubble_fraction_ideal"] == pytest.approx(1 / 17)
    assert p["bubble_fraction_predicted"] == pytest.approx(r.bubble_fraction)
    assert 0 in oom_stages(report)
    assert pipeline_fields(Strategy(grouping, [Action((0,))] * 5), topo) == {}


def test_gradient_accumulation_is_charged_per_micro_batch_after_the_first():
    """Each micro-batch after the first adds every weight gradient into a running sum: three passes over the
    gradient bytes at the device's memory bandwidth (the rewriter's accumulation)."""
    tg, topo, grouping, sim = _setup()
    weights = float(sim.memory.weight_bytes.sum())
    pt = sim.pipeline_tasks(_two_stages(grouping, 4).pipeline)
    assert pt.accumulate_bytes.sum() == pytest.approx(3 * weights)       # micro-batches 1, 2, 3
    assert (pt.accumulate_bytes[pt.micro_batch == 0] == 0).all()
    assert (pt.accumulate_bytes[pt.task_stage == 0] == 0).all()
    slow_memory = Profile({"GPU-A": DeviceProfile(peak_flops=1e12, memory_bandwidth=1e9, launch_overhead_s=0.0,
                                                  efficiency={"MatMul": 1.0, "default": 1.0})})
    slow = Simulator(tg, topo, grouping, CostModel(tg, topo, slow_memory))
    one = slow.evaluate(_two_stages(grouping, 1)).step_time
    four = slow.evaluate(_two_stages(grouping, 4)).step_time
    # three accumulations of every gradient, three passes each, at 1 GB/s (split over two stages that overlap)
    assert four - one > 0.5 * 3 * 3 * weights / 1e9


def test_deferred_weight_gradients_run_once_after_the_stages_last_backward():
    """``deferred_w``: each one-device stage runs its weight-gradient MatMuls once, after its last backward
    step, on the whole batch; no accumulation is charged; the input-gradient steps are shorter, so the step
    is shorter than fill-drain's when memory traffic costs (accumulation) and both stages compute."""
    slow_memory = Profile({"GPU-A": DeviceProfile(peak_flops=1e12, memory_bandwidth=1e10, launch_overhead_s=0.0,
                                                  efficiency={"MatMul": 1.0, "default": 1.0})})
    tg, topo, grouping, _ = _setup()
    sim = Simulator(tg, topo, grouping, CostModel(tg, topo, slow_memory))
    pt = sim.pipeline_tasks(_two_stages(grouping, 4, "deferred_w").pipeline)
    weights = [pt.labels[x] for x in np.flatnonzero(pt.is_weight_task)]
    assert sorted(weights) == ["W dense_0", "W dense_1", "W dense_2", "W dense_3"]
    assert pt.accumulate_bytes.sum() == 0
    # each stage's W tasks come after its last backward step, before any update
    for x in np.flatnonzero(pt.is_weight_task):
        s = pt.pipeline_stage[x]
        steps = np.flatnonzero((pt.pipeline_stage == s) & (pt.micro_batch >= 0))
        assert x > steps.max() and x < np.flatnonzero(pt.micro_batch == -1).min()
    deferred = sim.evaluate(_two_stages(grouping, 4, "deferred_w"))
    fill = sim.evaluate(_two_stages(grouping, 4, "fill_drain"))
    assert deferred.step_time < fill.step_time
    # the same FLOPs: a W task takes the whole batch's weight-gradient time (EXACT: FLOPs / peak)
    exact = Simulator(tg, topo, grouping, CostModel(tg, topo, EXACT))
    a = exact.evaluate(_two_stages(grouping, 4, "deferred_w"))
    b = exact.evaluate(_two_stages(grouping, 4, "fill_drain"))
    assert a.step_time <= b.step_time * (1 + 1e-9)
    # a stage on two devices runs fill-drain: with both stages on two devices nothing is deferred
    both = ((0, 1), (0, 1))
    pt2 = sim.pipeline_tasks(_two_stages(grouping, 4, "deferred_w", both).pipeline)
    assert not pt2.is_weight_task.any()
    assert sim.evaluate(_two_stages(grouping, 4, "deferred_w", both)).step_time == pytest.approx(
        sim.evaluate(_two_stages(grouping, 4, "fill_drain", both)).step_time)
