"""tag.tune: which candidates the measured tuning step runs, how it measures them, what it keeps and reports.

Fast tests check the choice (distinct strategies, the plan, the best built-in and the best uniform action
always in, the default K's step budget), the interleaved rounds and the statistics with a given measuring
function. The slow test tunes a searched plan on three local TF servers.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tag.errors import TagError
from tag.report import format_tune
from tag.strategy.types import Action, Grouping, Strategy
from tag.tune import (
    BEST_BUILTIN,
    BEST_PIPELINE_ROLE,
    BEST_UNIFORM_ROLE,
    ONE_DEVICE_ROLE,
    PLAN,
    Candidate,
    Measured,
    check_k,
    choose,
    default_k,
    distinct_candidates,
    keep,
    median_absolute_deviation,
    steps_per_candidate,
    strategy_key,
    tune,
    tune_fields,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPING = Grouping(np.array([0, 0, 1, 1]), ["a", "b"])


def strat(*actions: Action, name: str = "") -> Strategy:
    return Strategy(GROUPING, list(actions), name=name)


ONE = Action((0,), "allreduce")
ALL = Action((0, 1, 2), "allreduce")
PS = Action((0, 1, 2), "ps", ps_device=0)
MIXED = strat(ALL, ONE, name="refine")
STRATEGIES = {"dp_allreduce": strat(ALL, ALL), "ps": strat(PS, PS), "single": strat(ONE, ONE),
              "partition": strat(ONE, ONE), "best_uniform": strat(ALL, ALL), "pase_dp": strat(ALL, ONE),
              "mcts": strat(PS, ONE), "refine": MIXED}
PREDICTED = {"dp_allreduce": 0.30, "ps": 0.50, "single": 0.20, "partition": 0.20, "best_uniform": 0.30,
             "pase_dp": 0.15, "mcts": 0.18, "refine": 0.15}


def test_distinct_candidates_one_per_strategy_with_roles():
    cands = distinct_candidates("refine", STRATEGIES, PREDICTED, {"ps": False})
    names = [c.name for c in cands]
    # the plan first, then by predicted time; ps does not fit; duplicates fold into one name
    assert names == ["refine", "mcts", "single", "dp_allreduce"]
    by = {c.name: c for c in cands}
    assert by["refine"].aliases == ["pase_dp"]                 # the same strategy found by two steps
    assert by["single"].aliases == ["partition"]               # a built-in's name wins over a search step's
    assert by["dp_allreduce"].aliases == ["best_uniform"]
    assert by["refine"].roles == [PLAN] and by["single"].roles == [BEST_BUILTIN, ONE_DEVICE_ROLE]
    assert by["dp_allreduce"].roles == [BEST_UNIFORM_ROLE] and by["mcts"].roles == []
    assert strategy_key(STRATEGIES["single"]) == strategy_key(STRATEGIES["partition"])
    assert strategy_key(STRATEGIES["single"]) != strategy_key(MIXED)


def test_strategies_on_the_same_single_devices_are_one_candidate_with_the_topology():
    """A one-device partition, ``single`` and a search step that kept every group on one device run one
    program: with the topology they fold into one candidate (without it, their keys differ)."""
    from tiny import make_topology
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)]), ("h2", [("GPU-A", 1)])])
    part = Strategy(GROUPING, [Action((0,), "partition")] * 2, partition={i: 0 for i in range(4)}, name="partition")
    strategies = {"single": strat(ONE, ONE), "partition": part, "mcts": strat(Action((0,), "ps", ps_device=0), ONE),
                  "refine": MIXED}
    predicted = {"single": 0.2, "partition": 0.2, "mcts": 0.19, "refine": 0.15}
    assert strategy_key(part) != strategy_key(strategies["single"])
    assert strategy_key(part, topo) == strategy_key(strategies["single"], topo)
    assert strategy_key(part, topo) == strategy_key(strategies["mcts"], topo)
    assert strategy_key(MIXED, topo) != strategy_key(strategies["single"], topo)
    cands = distinct_candidates("refine", strategies, predicted, {}, topo)
    assert [c.name for c in cands] == ["refine", "single"]
    assert sorted(cands[1].aliases) == ["mcts", "partition"]


def test_a_pipeline_of_one_micro_batch_on_single_devices_is_that_placement():
    """One micro-batch through stages that each run on one device is the program of that per-group
    placement (``single`` when every stage is on the same device); more micro-batches are another program."""
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tiny import make_topology
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)]), ("h2", [("GPU-A", 1)])])

    def pipe(m, first=0, second=0):
        stages = (PipelineStage((0,), (first,)), PipelineStage((1,), (second,)))
        return Strategy.pipelined(GROUPING, Pipeline(stages, m))

    single = strat(ONE, ONE)
    assert strategy_key(pipe(1), topo) == strategy_key(single, topo)
    assert strategy_key(pipe(2), topo) != strategy_key(single, topo)
    assert strategy_key(pipe(1, 0, 1), topo) == strategy_key(strat(ONE, Action((1,), "allreduce")), topo)
    assert strategy_key(pipe(1, 0, 1), topo) != strategy_key(single, topo)
    cands = distinct_candidates("single", {"single": single, "pipeline": pipe(1), "pipeline_m2": pipe(2)},
                                {"single": 0.2, "pipeline": 0.2, "pipeline_m2": 0.21}, {}, topo)
    assert [(c.name, c.aliases) for c in cands] == [("single", ["pipeline"]), ("pipeline_m2", [])]


def test_the_best_pipeline_is_measured_when_predicted_within_reach():
    """The fastest real pipeline (stages on different devices) gets a role when predicted within
    TUNE_PIPELINE_WITHIN of the fastest prediction, and K=1 then still measures it; one predicted further off,
    or a pipeline whose stages share one placement (gradient accumulation), is not measured for its kind."""
    from tag.strategy.pipeline import Pipeline, PipelineStage
    from tag.tune import TUNE_PIPELINE_WITHIN
    from tiny import make_topology
    topo = make_topology([("h0", [("GPU-A", 1)]), ("h1", [("GPU-A", 1)]), ("h2", [("GPU-A", 1)])])

    def pipe(m, first, second):
        stages = (PipelineStage((0,), (first,)), PipelineStage((1,), (second,)))
        return Strategy.pipelined(GROUPING, Pipeline(stages, m))

    strategies = {"single": strat(ONE, ONE), "pipeline": pipe(4, 1, 0), "pipeline_m8": pipe(8, 1, 0),
                  "accumulate": pipe(4, 0, 0)}
    near = {"single": 0.20, "pipeline": 0.20 * 1.3, "pipeline_m8": 0.20 * 1.4, "accumulate": 0.21}
    cands = distinct_candidates("single", strategies, near, {}, topo)
    roles = {c.name: c.roles for c in cands}
    assert roles["pipeline"] == [BEST_PIPELINE_ROLE] and roles["pipeline_m8"] == [] and roles["accumulate"] == []
    assert [c.name for c in choose(cands, 1)] == ["single", "pipeline"]
    far = dict(near, pipeline=0.20 * (TUNE_PIPELINE_WITHIN + 0.1), pipeline_m8=0.20 * (TUNE_PIPELINE_WITHIN + 0.2))
    cands = distinct_candidates("single", strategies, far, {}, topo)
    assert not any(BEST_PIPELINE_ROLE in c.roles for c in cands)
    assert [c.name for c in choose(cands, 1)] == ["single"]


def test_the_plan_is_a_builtin_and_still_meets_the_best_uniform_action():
    predicted = dict(PREDICTED, refine=0.25, pase_dp=0.25, mcts=0.25, best_uniform=0.22)
    strategies = dict(STRATEGIES, best_uniform=strat(ONE, ALL))
    cands = distinct_candidates("single", strategies, predicted, {})
    chosen = choose(cands, 1)           # K=1 still measures the roles: the plan (= best built-in), best uniform
    assert [c.name for c in chosen] == ["single", "best_uniform"]
    assert chosen[0].roles == [PLAN, BEST_BUILTIN, ONE_DEVICE_ROLE] and chosen[1].roles == [BEST_UNIFORM_ROLE]
    third = choose(cands, 3)[2]      # then the fastest predicted other: the mix that pase_dp and refine found
    assert {third.name, *third.aliases} == {"pase_dp", "refine"} and strategy_key(third.strategy) == strategy_key(MIXED)
    assert len(choose(cands, 100)) == len(cands)


def test_default_k_costs_about_30_steps_of_the_slowest():
    assert steps_per_candidate() == 9
    same = [Candidate(f"c{i}", None, 0.1, [PLAN] if i == 0 else []) for i in range(6)]
    assert default_k(same) == 3                      # 3 x 9 steps = 27 <= 30 steps of the slowest
    fast_rest = same[:1] + [Candidate(f"f{i}", None, 0.01) for i in range(10)]
    assert default_k(fast_rest) == 11                # 9 x (0.1 + 10 x 0.01) = 1.8 s <= 30 x 0.1 s
    slow_plan_roles = [Candidate("p", None, 0.1, [PLAN]), Candidate("b", None, 0.1, [BEST_BUILTIN]),
                       Candidate("u", None, 0.1, [BEST_UNIFORM_ROLE]), Candidate("x", None, 0.1)]
    assert default_k(slow_plan_roles) == 3           # the roles are always measured, nothing more fits
    assert len(choose(slow_plan_roles, None)) == 3


def test_default_k_leaves_out_candidates_predicted_over_3x_the_fastest():
    """bench_e2e's deep transformer: the plan at 1.2 s, one device at 1.7 s, then candidates at 1.5, 4.0, 4.1
    and 10 s. Without the cap the 30-step budget of the slowest (10 s) let all six in (359 s of tuning)."""
    cands = [Candidate("plan", None, 1.2, [PLAN]), Candidate("single", None, 1.7, [BEST_BUILTIN]),
             Candidate("refine", None, 1.5), Candidate("partition", None, 4.0), Candidate("dp", None, 4.1),
             Candidate("ps", None, 10.0)]
    assert default_k(cands) == 3
    assert [c.name for c in choose(cands, None)] == ["plan", "refine", "single"]
    assert len(choose(cands, 6)) == 6                # an explicit K is the user's


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_bad_k_is_an_input_error(bad):
    with pytest.raises(TagError, match="positive number of candidates"):
        check_k(bad)
    assert check_k(None) is None and check_k(4) == 4


def test_tune_interleaves_rounds_keeps_the_fastest_median_and_reports_every_candidate():
    cands = [Candidate("plan", None, 0.10, [PLAN]), Candidate("dp", None, 0.20, [BEST_BUILTIN]),
             Candidate("uni", None, 0.30, [BEST_UNIFORM_ROLE])]
    true_time = {"plan": 0.15, "dp": 0.12, "uni": 0.40}
    calls = []

    def measure(c: Candidate, steps: int, warmup: int) -> list[float]:
        calls.append((c.name, steps, warmup))
        return [5.0] * warmup + [true_time[c.name] + 0.01 * (i % 2) for i in range(steps - warmup)]

    result = tune(cands, measure, rounds=3, steps=2, warmup=1)
    assert [n for n, _, _ in calls] == ["plan", "dp", "uni", "dp", "uni", "plan", "uni", "plan", "dp"]
    assert all(s == 3 and w == 1 for _, s, w in calls)
    assert result.kept.candidate.name == "dp"       # measured fastest, though predicted slower than the plan
    fields = tune_fields(result)
    rows = {r["name"]: r for r in fields["candidates"]}
    assert list(rows) == ["plan", "dp", "uni"] and fields["kept"] == "dp" and fields["plan"] == "plan"
    assert fields["overrode_simulator"] and fields["rounds"] == 3 and fields["seconds"] >= 0
    assert rows["dp"]["steps"] == 6 and rows["dp"]["measured_ms"] == pytest.approx(125.0)   # warm-up dropped
    assert rows["dp"]["mad_ms"] == pytest.approx(5.0) and rows["dp"]["predicted_ms"] == pytest.approx(200.0)
    assert rows["uni"]["error"] == pytest.approx(0.405 / 0.3 - 1)
    lines = format_tune(fields)
    assert len(lines) == 4 and "kept dp, overriding the simulator's plan" in lines[0]
    assert "measured" in lines[2] and "+-" in lines[2] and lines[2].endswith("<- kept")
    tie = tune(cands[:2], lambda c, s, w: [0.1] * s, rounds=1, steps=2, warmup=1)
    assert tie.kept.candidate.name == "plan"         # a tie keeps the plan


def test_tune_keeps_the_plan_when_the_faster_candidate_is_within_the_noise():
    """Another candidate replaces the plan only when faster by more than TUNE_MIN_GAIN of the plan's median
    and more than the two medians' spread (or in every round, ``test_a_gap_every_round_shows_...``)."""
    from tag.tune import TUNE_MIN_GAIN
    cands = [Candidate("plan", None, 0.10, [PLAN]), Candidate("other", None, 0.11)]

    def run(other: float, jitter: float):
        turns = {"plan": 0, "other": 0}

        def measure(c: Candidate, steps: int, warmup: int) -> list[float]:
            # the other's steps swing by JITTER from one round to the next: some rounds it is the slower
            sign = 1 if turns[c.name] % 2 else -1
            turns[c.name] += 1
            base = 0.100 if c.name == "plan" else other + jitter * sign
            return [base + jitter * (1 if i % 2 else -1) for i in range(steps)]
        return tune(cands, measure, rounds=3, steps=2, warmup=1).kept.candidate.name

    assert run(0.100 * (1 - TUNE_MIN_GAIN / 2), 0.0) == "plan"      # 1.5% faster: noise
    assert run(0.090, 0.016) == "plan"                               # 10% faster, but each +-16 ms
    assert run(0.090, 0.001) == "other"                              # 10% faster, +-1 ms: a real gain


def test_within_the_noise_of_the_fastest_the_candidate_on_the_fewest_hosts_is_kept():
    """bench_fidelity run 7, B/cnn: the simulator's plan ran 63.1 ms in tuning, clearly slower; another plan on
    three hosts 40.2 ms (MAD 2.8), one host 43.5 (MAD 2.2). 3.3 ms is within their noise, so one host is kept.
    A clear gain still wins; among candidates that the steps cannot tell apart the one on the fewest hosts stays,
    the plan included (bench_e2e, B/vgg: the plan 143 ms with MAD 17 against one host's 163; more rounds
    separate them: ``test_extra_rounds_...``); unknown host counts keep the plan."""
    def measured(name: str, median: float, mad: float, hosts: int) -> Measured:
        return Measured(Candidate(name, None, 0.05, hosts=hosts), [median - mad, median, median + mad])

    plan = measured("mcts", 0.0631, 0.0089, 3)
    refine, single = measured("refine", 0.0402, 0.0028, 3), measured("single", 0.0435, 0.0022, 1)
    assert keep([plan, refine, single]).candidate.name == "single"
    assert keep([plan, refine, measured("single", 0.0500, 0.0010, 1)]).candidate.name == "refine"
    assert keep([measured("p", 0.0410, 0.003, 0), measured("q", 0.0400, 0.003, 0)]).candidate.name == "p"
    noisy_plan = [measured("refine", 0.1434, 0.0167, 3), measured("single", 0.1629, 0.0028, 1)]
    assert keep(noisy_plan).candidate.name == "single"     # three steps cannot tell: fewer hosts
    assert keep([measured("p", 0.0500, 0.001, 0), measured("q", 0.0400, 0.001, 0)]).candidate.name == "q"


def test_extra_rounds_measure_only_the_candidates_within_the_noise_until_one_is_left():
    """A noisy plan on three hosts 20 ms ahead of one host (bench_e2e, B/vgg: 143 +- 18 ms against 163 +- 3):
    six steps cannot tell them apart, one more round of those two can; a third candidate well behind is not
    measured again."""
    from tag.tune import TUNE_EXTRA_ROUNDS
    cands = [Candidate("refine", None, 0.10, [PLAN], hosts=3), Candidate("single", None, 0.12, hosts=1),
             Candidate("ps", None, 0.13, hosts=3)]
    level = {"refine": (0.125, 0.161), "single": (0.160, 0.166), "ps": (0.30, 0.30)}
    calls = []

    def measure(c: Candidate, steps: int, warmup: int) -> list[float]:
        calls.append(c.name)
        lo, hi = level[c.name]
        return [1.0] * warmup + [lo if i % 2 == 0 else hi for i in range(steps - warmup)]

    result = tune(cands, measure, rounds=3, steps=2, warmup=1)
    assert result.extra_rounds == 1 and calls[9:] == ["refine", "single"]
    assert result.kept.candidate.name == "refine"       # a gain the extra steps confirm
    assert [len(m.step_times) for m in result.measured] == [8, 8, 6]
    assert tune_fields(result)["extra_rounds"] == 1 and "(+1 of those within the noise)" in format_tune(
        tune_fields(result))[0]
    # a tie that stays a tie: every extra round is run, and the candidate on the fewest hosts is kept
    level["refine"] = (0.150, 0.170)
    calls.clear()
    result = tune(cands, measure, rounds=3, steps=2, warmup=1)
    assert result.extra_rounds == TUNE_EXTRA_ROUNDS and result.kept.candidate.name == "single"
    assert calls.count("ps") == 3 and calls.count("single") == 3 + TUNE_EXTRA_ROUNDS
    assert tune(cands, measure, rounds=3, steps=2, warmup=1, extra_rounds=0).extra_rounds == 0


def test_a_gap_every_round_shows_is_out_of_the_noise_however_the_rounds_drift():
    """bench_fidelity run 17, A/cnn: one host measured 112 +- 13 ms in tuning against data parallelism's 101 +- 4
    after six rounds, was kept as within the noise, and then ran 128 and 134 ms against 103 and 110. The machine's
    load drifts between rounds and moves both alike: one host 10% slower in every round is a real gap, while the
    MADs over all rounds (inflated by the drift) still call it noise."""
    from tag.tune import TUNE_PAIRED_ROUNDS, consistently_slower, tied_with_fastest, within_noise
    drift = [1.0, 1.25, 0.9, 1.2, 1.0, 1.3]
    cands = [Candidate("refine", None, 0.08, [PLAN], hosts=3), Candidate("single", None, 0.10, hosts=1),
             Candidate("dp", None, 0.09, hosts=3)]
    level = {"refine": 1.20, "single": 1.10, "dp": 1.00}
    done = {c.name: 0 for c in cands}

    def measure(c: Candidate, steps: int, warmup: int) -> list[float]:
        base = 0.100 * level[c.name] * drift[done[c.name]]
        done[c.name] += 1
        return [1.0] * warmup + [base * (0.98 if i % 2 else 1.02) for i in range(steps - warmup)]

    result = tune(cands, measure, rounds=3, steps=2, warmup=1)
    single, dp = result.measured[1], result.measured[2]
    assert within_noise(single.median_s, single.mad_s, dp.median_s, dp.mad_s, steps=len(single.step_times),
                        fastest_steps=len(dp.step_times))          # the pooled MADs cannot tell them apart
    assert consistently_slower(single, dp) and result.kept.candidate.name == "dp"
    assert result.extra_rounds == TUNE_PAIRED_ROUNDS - 3          # one more round gave the fourth pair
    assert tune_fields(result)["candidates"][1]["round_ms"] == pytest.approx(
        [110 * d for d in drift[:TUNE_PAIRED_ROUNDS]])
    # one round the other way, or fewer rounds than TUNE_PAIRED_ROUNDS, or a gap under TUNE_MIN_GAIN: noise
    def measured(name, hosts, per_round):
        return Measured(Candidate(name, None, 0.1, hosts=hosts), [t for t in per_round for _ in (0, 1)],
                        [r for r in range(len(per_round)) for _ in (0, 1)])
    fast = measured("dp", 3, [0.100, 0.125, 0.090, 0.120])
    assert not consistently_slower(measured("single", 1, [0.110, 0.120, 0.099, 0.132]), fast)
    assert not consistently_slower(measured("single", 1, [0.110, 0.1375, 0.099]), fast)
    assert not consistently_slower(measured("single", 1, [0.102, 0.127, 0.0918, 0.1224]), fast)
    assert not consistently_slower(Measured(Candidate("single", None, 0.1), [0.2] * 8), fast)   # rounds unknown
    slow = measured("single", 1, [0.110, 0.1375, 0.099, 0.132])
    assert [m.candidate.name for m in tied_with_fastest([fast, slow])] == ["dp"]


def test_within_noise_narrows_as_the_steps_grow():
    from tag.tune import within_noise
    assert within_noise(0.110, 0.005, 0.100, 0.005)                       # 6 steps: the two MADs
    assert within_noise(0.110, 0.005, 0.100, 0.005, steps=6, fastest_steps=6)
    assert not within_noise(0.110, 0.005, 0.100, 0.005, steps=24, fastest_steps=24)   # half the band
    assert within_noise(0.102, 0.0, 0.100, 0.0, steps=100, fastest_steps=100)         # TUNE_MIN_GAIN


def test_candidates_know_how_many_hosts_they_use():
    from tag.strategy.grouping import group_ops
    from tiny import make_topology, mlp_graph
    tg = mlp_graph(batch=8, widths=(16, 16))
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-A", 1)])])
    gr = group_ops(tg, target_groups=2)
    one = Strategy(gr, [Action((0,), "allreduce")] * gr.num_groups)
    both = Strategy(gr, [Action((0, 1), "ps", ps_device=0)] * gr.num_groups)
    cands = distinct_candidates("a", {"a": both, "single": one}, {"a": 0.1, "single": 0.2}, {}, topo)
    assert {c.name: c.hosts for c in cands} == {"a": 2, "single": 1}


def test_median_absolute_deviation():
    assert median_absolute_deviation([1.0, 1.0, 2.0, 2.0, 4.0, 6.0, 9.0]) == 1.0
    assert median_absolute_deviation([3.0]) == 0.0


@pytest.mark.slow
def test_optimize_tunes_k_candidates_on_three_local_servers_and_keeps_the_fastest():
    """tag.optimize(..., tune_target=TARGET, tune_k=3) on three real TF servers (in this process, on
    loopback): three or four distinct candidates measured (the plan, the best built-in, the best uniform action,
    one device among them), every one in the report with predicted and measured times, and the returned plan is the
    one measured fastest."""
    import tag
    from helpers import in_process_servers, kept_within_noise
    from tag.cluster.topology import parse_topology
    ports, servers = in_process_servers(3)
    text = open(os.path.join(REPO, "topologies", "localhost.pbtxt")).read()
    for port in ports:                      # the servers' ports in place of the file's port: 0
        text = text.replace("port: 0\n", f"port: {port}\n", 1)
    topo = parse_topology(text)
    gd = tag.zoo.training_graph("mlp", 24, hidden=(64, 64))
    plan = tag.optimize(gd, topo, batch_size=24, playouts=8, tune_target=servers[0].target, tune_k=3)
    t = plan.report()["tune"]
    rows = t["candidates"]
    assert 3 <= len(rows) <= 5 and len({r["name"] for r in rows}) == len(rows)   # K, or the roles if more
    roles = [role for r in rows for role in r["roles"] if role != BEST_PIPELINE_ROLE]  # one when in reach
    assert sorted(roles) == sorted([PLAN, BEST_BUILTIN, BEST_UNIFORM_ROLE, ONE_DEVICE_ROLE])
    # 3 rounds of 2 timed steps, plus 2 for each extra round a candidate tied with the fastest ran in
    extra = t["extra_rounds"]
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["mad_ms"] >= 0
               and 6 <= r["steps"] <= 6 + 2 * extra and r["steps"] % 2 == 0 for r in rows)
    assert max(r["steps"] for r in rows) == 6 + 2 * extra
    assert kept_within_noise(t)        # the fastest, or one within its noise (the fewest hosts, then the plan)
    assert t["kept"] == plan.method and plan.report()["strategy"] == t["kept"]
    assert t["overrode_simulator"] == (t["kept"] != rows[0]["name"]) and t["seconds"] > 0
    assert plan.notes[-1].startswith(f"tuned on the cluster: {len(rows)} candidates measured")


@pytest.mark.parametrize("bad", [0, -3])
def test_optimize_refuses_a_bad_tune_k_before_anything_runs(bad):
    import tag
    with pytest.raises(TagError, match="tune_k must be a positive number of candidates"):
        tag.optimize(b"not even a graph", os.path.join(REPO, "topologies", "localhost.pbtxt"),
                     tune_target="grpc://127.0.0.1:1", tune_k=bad)


def test_a_given_builtin_meets_the_best_builtin_and_the_best_uniform_action():
    """--strategy NAME (no search): the rivals are the other built-ins and the best uniform action, found
    for it; every candidate is a distinct strategy."""
    import tag
    from tag.api import prepare, strategy_report
    from tag.tune import analysis_candidates
    gd = tag.zoo.training_graph("mlp", 24, hidden=(64, 64))
    analysis = prepare(gd, os.path.join(REPO, "topologies", "localhost.pbtxt"), batch_size=24)
    name, strategy, report = strategy_report(analysis, "ps")
    cands = analysis_candidates(analysis, name, strategy, report)
    assert cands[0].name == "ps" and PLAN in cands[0].roles
    roles = {role: c.name for c in cands for role in c.roles}
    assert set(roles) - {BEST_PIPELINE_ROLE} == {PLAN, BEST_BUILTIN, BEST_UNIFORM_ROLE, ONE_DEVICE_ROLE}
    best_builtin = min((n for n in ("dp_allreduce", "ps", "single", "partition")), key=report["baselines"].get)
    assert roles[BEST_BUILTIN] == best_builtin or best_builtin in next(c.aliases for c in cands
                                                                          if c.name == roles[BEST_BUILTIN])
    assert len({strategy_key(c.strategy) for c in cands}) == len(cands)
    assert [c.name for c in choose(cands, 1)][0] == "ps" and len(choose(cands, 1)) == len(set(roles.values()))
