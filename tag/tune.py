"""The measured tuning step: run the most promising distinct candidates on the real cluster, keep the fastest.

The simulator ranks strategies well on average but can misjudge one cluster (bench_fidelity: mixed plans
predicted 20-37% too fast). Before training, ``tag-deploy --run --tune K`` and
``tag.optimize(..., tune_target=..., tune_k=K)`` measure K candidates there and keep the one measured
fastest, printing each one's predicted and measured step time so that users see the simulator's error on
their own cluster.

- The candidates (``distinct_candidates``): the plan and the best strategy of every search step (best
  uniform action, PaSE DP, tree search, refinement, ...) and every built-in, feasible ones only, one per
  distinct strategy (a search step that found a built-in is that built-in). ``choose`` always takes the
  plan, the best built-in, the best uniform action and one device (even when the plan is itself a
  built-in), and the best pipeline when it is predicted within ``TUNE_PIPELINE_WITHIN`` of the fastest
  prediction, then the next fastest predicted until there are K. Why the pipeline: the simulator's error
  depends on the kind of plan, so each kind's best is measured, not only the kinds predicted fastest; in
  bench_e2e run 37 the transformer's pipeline (predicted 1.12x one host's step) ran 1.097x faster than one
  host; runs 38 and 39 never measured it (1.35x one host on run 39's calibration, without runtime levels).
- The measurement (``tune``): ``TUNE_ROUNDS`` interleaved rounds (every candidate once per round, the order
  rotated each round, so that a drift of the machine's load is spread over all); each candidate's turn
  opens a session (``TUNE_WARMUP`` untimed steps, a new session's first step sets up the graph on the
  workers) and times ``TUNE_STEPS`` steps. Each candidate's median over all its timed steps is kept
  beside the median absolute deviation (MAD) of those steps, its noise. While more than one candidate is
  within the noise of the fastest, those alone run up to ``TUNE_EXTRA_ROUNDS`` more rounds: a median's
  error shrinks as 1/sqrt(steps), so more steps separate what six could not. Kept (``keep``): of the
  candidates within the noise of the fastest (``within_noise``: ``TUNE_MIN_GAIN``, or the two MADs scaled
  to the steps taken), the one on the fewest hosts, then the plan, then the fastest: a gain within the
  noise is no gain, a plan on more hosts has more to lose, and the prediction is what is most wrong about
  multi-host plans (bench_fidelity run 11: every searched plan on A and B predicted 16-43% too fast, the
  one-host steps within 9%). In bench_fidelity run 7 a plan on several hosts measured 40 ms in tuning
  against one host's 43 ms (MADs 2.8 and 2.2), both well ahead of the simulator's plan, and then ran 60 ms
  against 49; in run 11 the earlier rule (the plan stays within the noise) kept B/cnn's searched plan, which
  then ran 141 ms against one host's 116.
  A gap that every round shows is not noise, however much the rounds differ from each other: a candidate
  slower than the fastest in each of at least ``TUNE_PAIRED_ROUNDS`` rounds both ran in, by a median of
  more than ``TUNE_MIN_GAIN`` per round, is out of the noise (``consistently_slower``). Round-to-round drift
  of the shared machine inflates every MAD but moves the candidates of one round together; in bench_fidelity
  run 17, A/cnn's one-host step measured 112 +- 13 ms against data parallelism's 101-102 +- 4 after six
  rounds, was kept as within the noise, and ran 128 and 134 ms against 103 and 110 side by side afterwards.
- The default K (``default_k``): as many candidates, in the order above, as cost at most
  ``TUNE_BUDGET_STEPS`` (30) steps of the slowest of them, by predicted time (at least the 2-3 that are
  always measured), none predicted over ``TUNE_HOPELESS`` (3x) the fastest prediction.

The report's ``tune`` keys (``tune_fields``) list every candidate with predicted and measured times, the
one kept and the seconds it cost; ``tag.report.format_tune`` prints them. ``tune_plan`` runs all of it for a Plan on
a cluster (TensorFlow is imported only there).

Example::

    import tag
    from tag.backend.runtime import LocalCluster
    from tag.tune import tune_plan

    topo = tag.load_topology("topologies/localhost.pbtxt")
    plan = tag.optimize(tag.zoo.training_graph("mlp", 32, hidden=(64, 64)), topo, playouts=8)
    with LocalCluster(topo) as cluster:
        plan = tune_plan(plan, cluster, k=3)         # or tag.optimize(..., tune_target=cluster, tune_k=3)
    print(plan.report()["tune"]["kept"])
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tag.cluster.topology import Topology
from tag.errors import TagError
from tag.options import check_k
from tag.plan import Plan, plan_for
from tag.search import SearchEnv
from tag.search.driver import best_uniform
from tag.strategy.baselines import BUILTIN_STRATEGIES, hosts_used, one_device_placement

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.strategy.types import Strategy

TUNE_ROUNDS = 3          # interleaved rounds
TUNE_STEPS = 2           # timed steps of each candidate per round
TUNE_WARMUP = 1          # untimed steps that open each candidate's turn (a new session)
TUNE_BUDGET_STEPS = 30   # the default K costs at most about this many steps of the slowest candidate
#: more rounds, of the candidates still within the noise of the fastest only, until one is left: a median of
#: 6 steps on the shared testbed moved 10-25% between two measurements of one program (B/cnn, one host:
#: 107, 136 and 116 ms in three bench-style measurements a minute apart; MADs 2-14 ms)
TUNE_EXTRA_ROUNDS = 3
#: a candidate slower than the fastest by at most this share of its median (or the two medians' spread,
#: ``within_noise``) is within the noise: on the shared testbed, six steps of one program differed by up to 15%
#: between tuning and a later measurement, and choosing on smaller gaps deployed slower plans
TUNE_MIN_GAIN = 0.03
#: a candidate slower than the fastest in every one of at least this many rounds both ran in (by a median of
#: more than TUNE_MIN_GAIN per round) is out of the noise, whatever its MAD (``consistently_slower``): with
#: equal programs, all of four rounds go one way one time in eight
TUNE_PAIRED_ROUNDS = 4
#: the default K leaves out candidates (other than those always measured) predicted over this many times the
#: fastest prediction: the simulator's worst errors on the testbed (mixed plans 37% too fast, others 61% too
#: slow) cannot turn 3x into a win, and in bench_e2e's deep transformer three such candidates (3.3x, 3.4x and
#: 8.3x the plan's 1.2 s) took 290 of the tuning step's 359 seconds
TUNE_HOPELESS = 3.0
#: the best pipeline is measured whenever it is predicted within this factor of the fastest prediction (a role, as
#: the plan's): on bench_e2e's configuration G the transformer's pipeline ran 14% faster than predicted (run 37)
#: and its one-host step 8% and 34% slower (runs 38, 39, the machine's drift included, as a host-drift probe showed),
#: so a pipeline predicted 1.26-1.56x one host can win
TUNE_PIPELINE_WITHIN = 1.5
BEST_UNIFORM = "best_uniform"

PLAN, BEST_BUILTIN, BEST_UNIFORM_ROLE = "the plan", "best built-in", "best uniform action"
#: the whole step on the fastest device (built-in ``single``): what a user with one fast machine runs; always
#: measured, so that a plan predicted faster on several hosts is never deployed when one device is faster
ONE_DEVICE_ROLE = "one device"
BEST_PIPELINE_ROLE = "best pipeline"


@dataclass
class Candidate:
    """A strategy to measure: its NAME, the STRATEGY, its predicted step time (s) and why it is measured
    (``roles``: the plan, the best built-in, the best uniform action, one device; ``aliases``: other names of the same
    strategy, e.g. the search step that found a built-in)."""

    name: str
    strategy: Any = field(repr=False)
    predicted_s: float
    roles: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    hosts: int = 0           # hosts the strategy runs on (0: not known)


@dataclass
class Measured:
    """A candidate's timed steps (all rounds together): median and median absolute deviation. ``rounds``: the
    round each step ran in (empty: not known), for comparisons round by round (``consistently_slower``)."""

    candidate: Candidate
    step_times: list[float]
    rounds: list[int] = field(default_factory=list)

    def round_medians(self) -> dict[int, float]:
        """{round: median of this candidate's steps in it} ({} when the rounds are not known)."""
        if len(self.rounds) != len(self.step_times):
            return {}
        by_round: dict[int, list[float]] = {}
        for r, t in zip(self.rounds, self.step_times, strict=True):
            by_round.setdefault(r, []).append(t)
        return {r: float(statistics.median(ts)) for r, ts in by_round.items()}

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.step_times))

    @property
    def mad_s(self) -> float:
        return median_absolute_deviation(self.step_times)


@dataclass
class TuneResult:
    """What ``tune`` measured: every candidate in the order chosen, the kept one, the seconds it took."""

    measured: list[Measured]
    kept: Measured
    plan: str
    rounds: int
    steps: int
    warmup: int
    seconds: float
    extra_rounds: int = 0    # rounds of only the candidates within the noise of the fastest


def median_absolute_deviation(values: Sequence[float]) -> float:
    """The median of |v - median(VALUES)|: the spread of step times that one slow step does not move."""
    mid = statistics.median(values)
    return float(statistics.median(abs(v - mid) for v in values))


def strategy_key(strategy: "Strategy", topology: "Topology | None" = None) -> str:
    """What makes two strategies run the same program (their name aside): actions, partitions, SFB
    gradients, batch-share speeds and pipeline; with TOPOLOGY, every strategy that runs each op group whole
    on one device is known by those devices alone (``single``, a one-device ``partition`` and a search step
    that kept everything on one host are one program: measuring it twice wastes a tuning slot)."""
    if topology is not None:
        where = one_device_placement(strategy, topology)
        if where is not None:
            return f"on devices {list(where)}"
    d = strategy.to_dict()
    return json.dumps({k: v for k, v in d.items() if k not in ("name", "grouping")}, sort_keys=True)


def distinct_candidates(plan: str, strategies: Mapping[str, "Strategy"], predicted: Mapping[str, float],
                        feasible: Mapping[str, bool], topology: "Topology | None" = None) -> list[Candidate]:
    """Every feasible strategy of STRATEGIES (name -> Strategy; PREDICTED: name -> seconds, FEASIBLE: name ->
    fits in memory, missing means it fits) once, the PLAN first, then by predicted time; a strategy found
    under several names keeps the plan's name, else a built-in's, else the fastest one's, and lists the
    others as aliases (with TOPOLOGY, strategies that run on the same single devices are one: ``strategy_key``).
    Roles mark the plan, the best built-in, the best uniform action, the whole step on one device and the
    best pipeline (when predicted within ``TUNE_PIPELINE_WITHIN`` of the fastest)."""
    def usable(n: str) -> bool:
        t = predicted.get(n)
        return n in strategies and t is not None and math.isfinite(t) and feasible.get(n, True)

    names = [n for n in strategies if usable(n)]
    if plan not in names:
        raise TagError(f"the plan {plan!r} has no feasible prediction to tune against")
    rank = {n: (n != plan, n not in BUILTIN_STRATEGIES, predicted[n], i) for i, n in enumerate(names)}
    by_key: dict[str, Candidate] = {}
    for n in sorted(names, key=rank.get):
        key = strategy_key(strategies[n], topology)
        if key in by_key:
            by_key[key].aliases.append(n)
        else:
            by_key[key] = Candidate(n, strategies[n], float(predicted[n]),
                                    hosts=len(hosts_used(strategies[n], topology)) if topology is not None else 0)
    out = sorted(by_key.values(), key=lambda c: (c.name != plan, c.predicted_s))

    def mark(role: str, among: list[str]) -> None:
        named = [c for c in out if c.name in among or set(c.aliases) & set(among)]
        if named:
            min(named, key=lambda c: c.predicted_s).roles.append(role)

    mark(PLAN, [plan])
    mark(BEST_BUILTIN, [n for n in names if n in BUILTIN_STRATEGIES])
    mark(BEST_UNIFORM_ROLE, [BEST_UNIFORM])
    mark(ONE_DEVICE_ROLE, ["single"])
    # a pipeline whose stages share one placement only buys memory (``Pipeline.on_one_placement``): not a kind
    pipelines = [c for c in out if getattr(c.strategy, "pipeline", None) is not None
                 and not c.strategy.pipeline.on_one_placement]
    if pipelines:
        best = min(pipelines, key=lambda c: c.predicted_s)
        if best.predicted_s <= TUNE_PIPELINE_WITHIN * min(c.predicted_s for c in out):
            best.roles.append(BEST_PIPELINE_ROLE)
    return out


def choose(candidates: Sequence[Candidate], k: int | None) -> list[Candidate]:
    """The candidates to measure: every one with a role (the plan, the best built-in, the best uniform
    action, one device, the best pipeline), then the next fastest predicted until there are K (None:
    ``default_k``)."""
    if k is None:
        k = default_k(candidates)
    must = [c for c in candidates if c.roles]
    rest = [c for c in candidates if not c.roles]
    chosen = must + rest[:max(0, k - len(must))]
    return sorted(chosen, key=lambda c: (PLAN not in c.roles, c.predicted_s))


def steps_per_candidate(rounds: int = TUNE_ROUNDS, steps: int = TUNE_STEPS, warmup: int = TUNE_WARMUP) -> int:
    return rounds * (steps + warmup)


def default_k(candidates: Sequence[Candidate], budget_steps: int = TUNE_BUDGET_STEPS) -> int:
    """The largest K whose chosen candidates cost at most BUDGET_STEPS steps of the slowest of them (by
    predicted time; ``steps_per_candidate`` each); at least the candidates that are always measured. A
    candidate without a role predicted over ``TUNE_HOPELESS`` times the fastest prediction is not promising
    and ends the list."""
    must = [c for c in candidates if c.roles]
    rest = [c for c in candidates if not c.roles]
    fastest = min((c.predicted_s for c in candidates), default=0.0)
    k = len(must)
    for extra in range(1, len(rest) + 1):
        if rest[extra - 1].predicted_s > TUNE_HOPELESS * fastest:
            break
        times = [c.predicted_s for c in must + rest[:extra]]
        if steps_per_candidate() * sum(times) > budget_steps * max(times):
            break
        k = len(must) + extra
    return max(k, 1)


MeasureFn = Callable[[Candidate, int, int], Sequence[float]]


def tune(candidates: Sequence[Candidate], measure: MeasureFn, *, rounds: int = TUNE_ROUNDS,
         steps: int = TUNE_STEPS, warmup: int = TUNE_WARMUP, extra_rounds: int = TUNE_EXTRA_ROUNDS,
         say: Callable[[str], None] | None = None) -> TuneResult:
    """Measure CANDIDATES (the first is the plan) in ROUNDS interleaved rounds: MEASURE(candidate,
    total_steps, warmup) runs WARMUP + STEPS steps and returns every step's seconds; the first WARMUP are
    dropped. Then, while more than one candidate is within the noise of the fastest (``tied_with_fastest``),
    up to EXTRA_ROUNDS more rounds of those alone. Which one is kept: ``keep``."""
    if not candidates:
        raise TagError("nothing to tune: no candidate")
    t0 = time.perf_counter()
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    round_of: dict[str, list[int]] = {c.name: [] for c in candidates}

    def one_round(r: int, among: Sequence[Candidate], label: str, index: int) -> None:
        order = list(among[r % len(among):]) + list(among[:r % len(among)])
        for c in order:
            if say is not None:
                say(f"{label}: {c.name}")
            got = [float(t) for t in list(measure(c, warmup + steps, warmup))[warmup:]]
            times[c.name].extend(got)
            round_of[c.name].extend([index] * len(got))

    def measured_now() -> list[Measured]:
        return [Measured(c, list(times[c.name]), list(round_of[c.name])) for c in candidates]

    for r in range(rounds):
        one_round(r, candidates, f"round {r + 1}/{rounds}", r)
    done_extra = 0
    while done_extra < extra_rounds:
        tied = [m.candidate for m in tied_with_fastest(measured_now())]
        if len(tied) < 2:
            break
        one_round(done_extra, tied, f"extra round {done_extra + 1}/{extra_rounds} (within the noise)",
                  rounds + done_extra)
        done_extra += 1
    measured = measured_now()
    return TuneResult(measured, keep(measured), candidates[0].name, rounds, steps, warmup,
                      time.perf_counter() - t0, done_extra)


def within_noise(median: float, mad: float, fastest_median: float, fastest_mad: float, *,
                 steps: int | None = None, fastest_steps: int | None = None) -> bool:
    """Whether a candidate measured MEDIAN (MAD, over STEPS timed steps) is within the noise of the fastest:
    slower by at most ``TUNE_MIN_GAIN`` of its median or by the two MADs together, each scaled by
    sqrt(reference / steps) (a median's error shrinks as 1/sqrt(steps); the reference is the default rounds'
    ``TUNE_ROUNDS * TUNE_STEPS`` steps, where the band is the two MADs; None: that many). Any one time unit."""
    ref = TUNE_ROUNDS * TUNE_STEPS

    def scaled(m: float, n: int | None) -> float:
        return m * math.sqrt(ref / n) if n else m

    spread = scaled(mad, steps) + scaled(fastest_mad, fastest_steps)
    return median - fastest_median <= max(TUNE_MIN_GAIN * median, spread)


def consistently_slower(m: Measured, fastest: Measured, min_rounds: int = TUNE_PAIRED_ROUNDS) -> bool:
    """Whether M was slower than FASTEST in every one of the (at least MIN_ROUNDS) rounds both ran in, by a
    median per-round ratio above 1 + ``TUNE_MIN_GAIN``: a gap each round shows, which drift between rounds
    (moving both alike) cannot make."""
    mine, theirs = m.round_medians(), fastest.round_medians()
    ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
    return (len(ratios) >= min_rounds and all(q > 1.0 for q in ratios)
            and statistics.median(ratios) > 1.0 + TUNE_MIN_GAIN)


def tied_with_fastest(measured: Sequence[Measured]) -> list[Measured]:
    """The candidates of MEASURED within the noise of the fastest (``within_noise``) and not consistently
    slower than it round by round (``consistently_slower``), the fastest included."""
    fastest = min(measured, key=lambda m: m.median_s)     # min keeps the first of equal medians
    return [m for m in measured
            if m is fastest or (within_noise(m.median_s, m.mad_s, fastest.median_s, fastest.mad_s,
                                             steps=len(m.step_times), fastest_steps=len(fastest.step_times))
                                and not consistently_slower(m, fastest))]


def keep(measured: Sequence[Measured]) -> Measured:
    """Of MEASURED (the plan first), the one to deploy: among those within the noise of the fastest
    (``tied_with_fastest``), the one on the fewest hosts (unknown counts last), then the plan, then the
    fastest."""
    plan = measured[0]
    return min(tied_with_fastest(measured),
               key=lambda m: (m.candidate.hosts or math.inf, m is not plan, m.median_s))


def tune_fields(result: TuneResult) -> dict[str, Any]:
    """The report's ``tune`` keys: ``candidates`` [{name, roles, aliases, predicted_ms, measured_ms, mad_ms,
    error (measured / predicted - 1), steps, hosts (0: not known), round_ms (the median of each round it ran
    in)}], ``plan`` (the simulator's pick), ``kept``,
    ``overrode_simulator``, ``rounds``, ``extra_rounds``, ``steps_per_round``, ``warmup_per_round``,
    ``seconds``."""
    rows = [{"name": m.candidate.name, "roles": list(m.candidate.roles), "aliases": list(m.candidate.aliases),
             "predicted_ms": m.candidate.predicted_s * 1e3, "measured_ms": m.median_s * 1e3,
             "mad_ms": m.mad_s * 1e3, "error": m.median_s / m.candidate.predicted_s - 1.0,
             "steps": len(m.step_times), "hosts": m.candidate.hosts,
             "round_ms": [t * 1e3 for _, t in sorted(m.round_medians().items())]} for m in result.measured]
    return {"candidates": rows, "plan": result.plan, "kept": result.kept.candidate.name,
            "overrode_simulator": result.kept.candidate.name != result.plan, "rounds": result.rounds,
            "extra_rounds": result.extra_rounds,
            "steps_per_round": result.steps, "warmup_per_round": result.warmup, "seconds": result.seconds}


# ------------------------------------------------------------------------------------------------ on a cluster
def plan_candidates(plan: "Plan") -> list[Candidate]:
    """The distinct candidates of PLAN (made in this process; ``analysis_candidates``)."""
    if plan.analysis is None:
        raise TagError("tuning needs a plan made in this process (a loaded plan has no analysis)")
    return analysis_candidates(plan.analysis, plan.method, plan.strategy, plan.report(), plan.candidates)


def analysis_candidates(analysis: Any, name: str, strategy: "Strategy", report: Mapping[str, Any],
                        searched: Mapping[str, "Strategy"] | None = None) -> list[Candidate]:
    """The distinct candidates for strategy NAME of ANALYSIS (REPORT: its plan report, with every compared
    strategy's predicted time): SEARCHED (name -> each search step's best and the built-ins, as
    ``SearchResult.candidates``), or for a strategy that was not searched the built-ins and the best uniform
    action, which are found here."""
    strategies = dict(searched or {})
    predicted = {n: float(t) for n, t in (report.get("baselines") or {}).items() if t is not None}
    feasible = dict(report.get("baselines_feasible") or {})
    strategies[name] = strategy
    predicted[name] = float(report["predicted_step_time_s"])
    feasible[name] = bool(report.get("feasible", True))
    for n in BUILTIN_STRATEGIES:
        if n not in strategies and n in predicted:
            strategies[n] = analysis.builtin(n)
    if BEST_UNIFORM not in strategies:
        strategies[BEST_UNIFORM], predicted[BEST_UNIFORM], feasible[BEST_UNIFORM] = best_uniform_of(analysis)
    return distinct_candidates(name, strategies, predicted, feasible, analysis.topology)


def best_uniform_of(analysis: Any) -> tuple["Strategy", float, bool]:
    """(strategy, predicted seconds, fits in memory) of ANALYSIS's best uniform action."""
    env = SearchEnv(analysis.graph, analysis.topology, analysis.grouping, cost_model=analysis.cost_model,
                    batch_size=analysis.batch, simulator=analysis.simulator())
    choice, outcome = best_uniform(env)
    return env.strategy(choice, name=BEST_UNIFORM), float(outcome.step_time), bool(outcome.feasible)


def candidate_runner(analysis: Any, cluster: Any, *, step_timeout_s: float | None = 600.0,
                     progress: Callable[[str, Any], None] | None = None) -> MeasureFn:
    """A ``tune`` MEASURE that runs a candidate on CLUSTER (a session target "grpc://host:port", or a running
    cluster: ``open_cluster``'s, a ``LocalCluster``, a ``Testbed``): its graph rewritten once (``analysis.rewrite``),
    then run on synthetic batches by ``measure.run_on`` (a candidate on one device as a process of its own on its
    host where the cluster can start one, as a deployment runs it), guarded (the cluster's watchdog names a dead
    worker; no step waits past STEP_TIMEOUT_S). PROGRESS(name, RunEvent) hears every phase and step."""
    from tag.backend.runtime.guard import RunControl
    from tag.backend.runtime.measure import Cluster, cluster_targets, host_launcher, one_device_runner, run_on
    address, watchdog = _target_and_watchdog(cluster)
    targets = {h.name: f"grpc://{h.address}:{h.port}" for h in analysis.topology.hosts}
    if not isinstance(cluster, str):
        started = getattr(cluster, "targets", None) or getattr(cluster, "topology", None)
        targets.update(cluster_targets(cluster) if started else {})     # the ports it started on (port: 0)
    on = Cluster(address, watchdog, one_device_runner(cluster), targets, host_launcher(cluster))
    rewritten: dict[str, Any] = {}

    def measure(candidate: Candidate, steps: int, warmup: int) -> list[float]:
        if candidate.name not in rewritten:
            rewritten[candidate.name] = analysis.rewrite(candidate.strategy)
        rr = rewritten[candidate.name]
        control = RunControl(step_timeout_s=step_timeout_s, setup_timeout_s=max(step_timeout_s or 0.0, 120.0),
                             watchdog=watchdog)
        if progress is not None:
            control.progress = lambda ev: progress(candidate.name, ev)
        return run_on(on, rr, steps=steps, warmup=warmup, control=control).step_times

    return measure


def tune_plan(plan: "Plan", target: Any, *, k: int | None = None, rounds: int = TUNE_ROUNDS,
              steps: int = TUNE_STEPS, warmup: int = TUNE_WARMUP,
              say: Callable[[str], None] | None = None) -> "Plan":
    """Measure PLAN's K most promising distinct candidates (``choose``) on the cluster TARGET and return the
    one measured fastest as a Plan whose report has the ``tune`` keys and whose notes say what was kept.

    TARGET: a session target ("grpc://host:port"), an object with ``.target`` (``LocalCluster``, a running
    ``Testbed``, ``tag.backend.runtime.measure.open_cluster``'s cluster; its watchdog is used, and a candidate on
    one device runs as a process of its own on its host, as a deployment runs it), or a ``Topology`` (its
    cluster is opened for the measurement: local workers for loopback hosts, else every host's ``tag-worker``
    must answer)."""
    k = check_k(k)
    chosen = choose(plan_candidates(plan), k)
    if isinstance(target, Topology):
        from tag.backend.runtime.measure import open_cluster
        with open_cluster(target) as cluster:
            return tune_plan(plan, cluster, k=len(chosen), rounds=rounds, steps=steps, warmup=warmup, say=say)
    result = tune(chosen, candidate_runner(plan.analysis, target), rounds=rounds, steps=steps, warmup=warmup,
                  say=say)
    fields = tune_fields(result)
    return kept_plan(plan, result.kept.candidate, fields)


def kept_plan(plan: "Plan", kept: Candidate, fields: dict[str, Any]) -> "Plan":
    """PLAN itself, or a Plan of the KEPT candidate that keeps what PLAN's report knew (every strategy
    compared, the search's figures), with FIELDS as its ``tune`` keys and a note."""
    import copy
    import dataclasses

    note = (f"tuned on the cluster: {len(fields['candidates'])} candidates measured in {fields['seconds']:.1f} s; "
            + ("the plan was measured fastest" if kept.name == plan.method else
               f"{kept.name} was measured fastest and replaces the plan {plan.method}"))
    if kept.name == plan.method:
        report = plan.report()
        report["tune"] = fields
        report["notes"] = [*report.get("notes", []), note]
        return dataclasses.replace(plan, notes=[*plan.notes, note], _report=report, analysis=plan.analysis)
    other = plan_for(plan.analysis, kept.strategy, name=kept.name)
    report = other.report()
    before = plan.report()
    for key in ("baselines", "baselines_feasible"):
        report[key] = {**before.get(key, {}), **report.get(key, {})}
    for key in ("search_seconds", "evaluations", "search", "profile"):
        if key in before:
            report[key] = copy.deepcopy(before[key])
    report["tune"] = fields
    report["notes"] = [*report.get("notes", []), note]
    return dataclasses.replace(other, notes=[*other.notes, note], _report=report, analysis=plan.analysis,
                               candidates=plan.candidates)


def _target_and_watchdog(target: Any) -> tuple[str, Callable[[], str | None] | None]:
    if isinstance(target, str):
        return target, None
    address = getattr(target, "target", None)
    if not isinstance(address, str) or not address:
        raise TagError(f"tune_target must be a session target (grpc://host:port), a running cluster or a "
                       f"Topology, got {type(target).__name__}")
    for obj in (target, getattr(target, "cluster", None)):
        for attr in ("watchdog", "dead_worker"):
            fn = getattr(obj, attr, None)
            if callable(fn):
                return address, fn
    return address, None
