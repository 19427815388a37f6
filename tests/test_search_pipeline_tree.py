"""Pipelines as root candidates of the tree search (tag/search/pipeline_tree.py, tag/search/mcts.py): a
pipeline is chosen when it is the fastest, its stages' actions are searched below it, and it is passed over
when per-group actions are faster. Tiny hand-made graphs and topologies; no TensorFlow."""
import pytest

from tag.search.driver import best_uniform, pipeline_admitted
from tag.search.mcts import mcts
from tag.search.pipeline_dp import pipeline_dp
from tag.search.pipeline_tree import PipelineRoots
from tag.strategy.pipeline import Pipeline, PipelineStage
from test_search_pipeline import _env


def _root_visits(tree, roots):
    allowed, visits = tree.visits[()]
    pairs = list(zip(allowed, visits, strict=True))
    return sum(int(n) for k, n in pairs if k < 0), sum(int(n) for k, n in pairs if k >= 0)


def test_tree_chooses_a_pipeline_when_it_is_fastest():
    """A deep MLP on a fast and a 3x slower host behind a slow link: the pipeline wins the tree."""
    env = _env()
    choice, uniform = best_uniform(env)
    roots = PipelineRoots.of(env, pipeline_dp(env))
    assert 1 <= len(roots) <= 4 and roots.pipelines[0].num_stages == 2
    tree = mcts(env, playouts=60, seed=0, start=choice, pipelines=roots, keep_visits=True)
    assert tree.pipeline_wins and tree.pipeline_outcome.step_time < 0.95 * uniform.step_time
    assert tree.pipeline_outcome.step_time < tree.outcome.step_time
    on_pipelines, on_groups = _root_visits(tree, roots)
    assert on_pipelines >= 0.25 * (on_pipelines + on_groups)   # the pipelines got their share of playouts


def test_stage_actions_below_a_pipeline_are_searched():
    """A pipeline whose stages both sit on the fast host at the root: the levels below it move a stage to
    the slow host (the cuts, M and schedule stay), and that pipeline beats every per-group choice."""
    env = _env()
    best = pipeline_dp(env).strategy.pipeline
    fast = int(env.speeds.argmax())
    one_host = Pipeline(tuple(PipelineStage(st.groups, (fast,)) for st in best.stages), best.micro_batches,
                        best.schedule)
    roots = PipelineRoots.over(env, [one_host])
    assert roots.build(0, ()) == one_host
    before = env.evaluate_pipeline(one_host)
    tree = mcts(env, playouts=100, seed=0, pipelines=roots)
    assert tree.pipeline != one_host and tree.pipeline_outcome.rank > before.rank
    assert [st.groups for st in tree.pipeline.stages] == [st.groups for st in one_host.stages]
    assert {st.placement for st in tree.pipeline.stages} == {(0,), (1,)}
    assert tree.pipeline_outcome.step_time < 0.9 * before.step_time and tree.pipeline_wins


def test_tree_passes_a_pipeline_over_when_per_group_actions_are_faster():
    """The same model behind a 1 MB/s link: every cut sends activations over it; the fast host alone wins."""
    env = _env(bandwidth=1e6)
    order = list(range(env.num_groups))
    half = env.num_groups // 2
    pipe = Pipeline((PipelineStage(tuple(order[:half]), (0,)), PipelineStage(tuple(order[half:]), (1,))), 4)
    roots = PipelineRoots.over(env, [pipe])
    tree = mcts(env, playouts=60, seed=0, pipelines=roots, keep_visits=True)
    assert tree.pipeline is not None and not tree.pipeline_wins
    assert tree.outcome.step_time < tree.pipeline_outcome.step_time    # simulated (for the prior), not chosen


def test_evaluate_pipeline_caches_and_refuses_a_backward_cut():
    env = _env()
    order = list(range(env.num_groups))
    good = Pipeline((PipelineStage(tuple(order[:3]), (0,)), PipelineStage(tuple(order[3:]), (1,))), 4)
    backward = Pipeline((PipelineStage(tuple(order[3:]), (0,)), PipelineStage(tuple(order[:3]), (1,))), 4)
    runs = env.evaluations
    out = env.evaluate_pipeline(good)
    assert out.feasible and env.evaluations == runs + 1
    assert env.evaluate_pipeline(good) == out and env.evaluations == runs + 1      # cached
    assert env.evaluate_pipeline(backward) is None                                 # stage 1 feeds stage 0
    roots = PipelineRoots.over(env, [good])
    assert roots.allowed(0, 1)[0] == roots.options.index(good.stages[1].action())
    assert roots.build(0, (roots.options.index(good.stages[1].action()),)).stages[0].placement == (1,)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_pipeline_on_one_placement_competes_through_its_stages_actions_alone(monkeypatch, micro_batches):
    """pipeline_dp's answer rewritten with every stage on both hosts (B/cnn's kind in bench_fidelity runs
    13-14 with one micro-batch; bench_e2e G's transformer with four): the same actions fit in memory, so the
    search never returns it, or any pipeline on one placement, as a pipeline."""
    import dataclasses

    import tag.search.driver as driver
    env = _env()
    real = pipeline_dp(env)
    both = tuple(g.index for g in env.topology.groups)
    fake = Pipeline(tuple(PipelineStage(st.groups, both) for st in real.strategy.pipeline.stages), micro_batches)
    assert fake.on_one_placement and fake.in_name_only == (micro_batches == 1)
    strategy = env.pipeline_strategy(fake)
    rigged = dataclasses.replace(real, strategy=strategy, outcome=env.evaluate_pipeline(fake),
                                 result=env.simulator.evaluate(strategy, batch_size=env.batch_size))
    monkeypatch.setattr(driver, "pipeline_dp", lambda *a, **k: rigged)
    out = driver.search(env, playouts=30, seed=0)
    assert "pipeline" not in out.baselines and "pipeline_stages" in out.baselines
    for name in ("pipeline", "mcts_pipeline"):
        assert name not in out.baselines or not out.candidates[name].pipeline.on_one_placement
    assert out.strategy.pipeline is None or not out.strategy.pipeline.on_one_placement


def test_a_pipeline_on_one_placement_is_admitted_only_when_its_actions_do_not_fit_without_it():
    """Eight micro-batches through stages that all sit on the fast host: a pipeline answer only where the
    same actions without micro-batches run out of memory (the activations of the whole batch at once)."""
    from tag.cost.model import CostModel
    from tag.search import SearchEnv
    from tag.strategy.types import Strategy
    from test_search_pipeline import PROFILE
    from tiny import DeviceSpec, make_topology

    env = _env()
    fast = int(env.speeds.argmax())
    stages = tuple(PipelineStage(st.groups, (fast,)) for st in pipeline_dp(env).strategy.pipeline.stages)

    def on_fast(env):
        piped = env.pipeline_strategy(Pipeline(stages, 8, "1f1b"))
        return piped, Strategy(piped.grouping, list(piped.actions))

    piped, plain = on_fast(env)
    assert piped.pipeline.on_one_placement and not piped.pipeline.in_name_only
    assert not pipeline_admitted(env, piped)                       # the same actions fit: no pipeline
    peak_piped = env.simulator.evaluate(piped, batch_size=env.batch_size).peak_memory[fast]
    peak_plain = env.simulator.evaluate(plain, batch_size=env.batch_size).peak_memory[fast]
    assert peak_piped < peak_plain
    memory = int((peak_piped + peak_plain) / 2)
    topo = make_topology([("fast", [("FAST", 1)]), ("slow", [("SLOW", 1)])], inter_latency=5e-5,
                         specs={"FAST": DeviceSpec(peak_flops=3e12, memory_bytes=memory),
                                "SLOW": DeviceSpec(peak_flops=1e12)})
    tight = SearchEnv(env.graph, topo, env.grouping, cost_model=CostModel(env.graph, topo, PROFILE))
    piped, plain = on_fast(tight)
    assert not tight.simulator.evaluate(plain, batch_size=tight.batch_size).feasible
    assert tight.simulator.evaluate(piped, batch_size=tight.batch_size).feasible
    assert pipeline_admitted(tight, piped)                         # micro-batches are what makes it fit


def test_the_tree_reports_only_the_pipelines_it_may_answer_with():
    """Behind a 1 MB/s link, of two root pipelines with the same cuts the one with both stages on the fast
    host is the faster (no activation crosses the link); with ``admit_pipeline`` refusing pipelines on one
    placement, the tree reports the other instead, though it still searched both."""
    env = _env(bandwidth=1e6)
    order = list(range(env.num_groups))
    half = env.num_groups // 2
    apart = Pipeline((PipelineStage(tuple(order[:half]), (0,)), PipelineStage(tuple(order[half:]), (1,))), 4)
    together = Pipeline(tuple(PipelineStage(st.groups, (0,)) for st in apart.stages), 4)
    roots = PipelineRoots.over(env, [apart, together])
    free = mcts(env, playouts=60, seed=0, pipelines=roots)
    assert free.pipeline.on_one_placement
    held = mcts(env, playouts=60, seed=0, pipelines=roots, admit_pipeline=lambda p: not p.on_one_placement)
    assert held.pipeline is not None and not held.pipeline.on_one_placement
    assert held.pipeline_outcome.rank < free.pipeline_outcome.rank
