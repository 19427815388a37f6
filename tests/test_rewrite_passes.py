"""tag.backend.rewrite.passes: the rewrite's passes state what they read and write, and the declarations hold.

The static test checks the declarations against each other (a pass reads only inputs and fields an earlier
pass wrote). The traced tests run real rewrites (data parallelism with SFB and fusion, a parameter server,
a 1F1B and a deferred-W pipeline, a sparse table summed densely, a static-batch LSTM) on a state that
records every field each pass touches, and check that a pass touches only what it declares, that every
declared read is read by some case, and that the traced rewrite gives the same graph as the plain one.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tag  # noqa: E402
from tag.backend.rewrite import rewrite  # noqa: E402
from tag.backend.rewrite.context import CACHE_FIELDS, INPUT_FIELDS, RewriteState  # noqa: E402
from tag.backend.rewrite.passes import PASSES, Pass, run_passes  # noqa: E402
from tag.cluster.topology import parse_topology  # noqa: E402
from tag.compress import eligible_gradients  # noqa: E402
from tag.errors import RewriteError  # noqa: E402
from tag.frontend import real_graphs  # noqa: E402
from tag.strategy.baselines import builtin_strategy  # noqa: E402
from tag.strategy.grouping import group_ops  # noqa: E402
from tag.strategy.pipeline import Pipeline, PipelineStage  # noqa: E402
from tag.strategy.types import Action, Strategy  # noqa: E402
from test_rewrite_loop_state import lstm_graph  # noqa: E402  (pytest puts tests/ on sys.path)

STATE_FIELDS = frozenset(RewriteState.__annotations__) | INPUT_FIELDS
# read by no pass yet: the host a rewrite builds for is the hook of per-host emission (RewriteState)
UNREAD_INPUTS = {"host"}
# reads on a path the cases do not take: check_seeds looks at the placements only in a graph without a seed
UNTAKEN_READS = {"check_seeds": {"full_batch", "placements", "train_op"}}


def topology(hosts: int = 3, per_host: int = 1):
    """Loopback CPU hosts h0, h1, ... (peak TFLOP/s 0.1, 0.05, ...: uneven batch shares)."""
    text = "\n".join(
        f'host {{ name: "h{i}" address: "127.0.0.1" port: {23401 + i} device {{ type: "CPU" kind: CPU '
        f'count: {per_host} memory_gib: 2 peak_tflops: {0.1 if i == 0 else 0.05} memory_bandwidth_gbs: 10 }} }}'
        for i in range(hosts))
    return parse_topology(f'name: "passes"\n{text}\nfabric {{ bandwidth_gbps: 10 latency_us: 50 }}\n')


class TracedState(RewriteState):
    """A RewriteState that records the fields read and assigned while ``log`` is set."""

    def __getattribute__(self, name):
        log = object.__getattribute__(self, "__dict__").get("log")
        if log is not None and name in STATE_FIELDS | CACHE_FIELDS:
            log[0].add(name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        log = self.__dict__.get("log")
        if log is not None:
            log[1].add(name)
        object.__setattr__(self, name, value)


def traced_run(gd, ir, strategy, topo) -> tuple[TracedState, dict[str, tuple[set, set]]]:
    """Run every pass on a traced state; per pass, the (read, assigned) fields."""
    st = TracedState(gd, ir, strategy, topo)
    touched = {}
    for p in PASSES:
        st.__dict__["log"] = (set(), set())
        run_passes(st, (p,))
        touched[p.name] = st.__dict__.pop("log")
    return st, touched


@lru_cache(maxsize=None)
def cases() -> dict[str, tuple]:
    """name -> (GraphDef, IR, strategy, topology): the concerns every pass can meet."""
    topo = topology()
    out = {}
    gd = tag.zoo.training_graph("mlp", batch_size=8, hidden=(16, 16))
    ir = tag.analyze(gd)
    st = builtin_strategy("dp_allreduce", ir, topo, group_ops(ir, 8))
    st.sfb = [f.variable for f in eligible_gradients(ir)][:1]
    out["mlp_dp_sfb"] = (gd, ir, st, topo)
    grouping = group_ops(ir, 8)
    everything = tuple(g.index for g in topo.groups)
    out["mlp_ps"] = (gd, ir, Strategy(grouping, [Action(everything, "ps", ps_device=2)] * grouping.num_groups),
                     topo)
    half = grouping.num_groups // 2
    for schedule, mode in (("1f1b", "allreduce"), ("deferred_w", "ps")):
        pipe = Pipeline((PipelineStage(tuple(range(half)), (0,)),
                         PipelineStage(tuple(range(half, grouping.num_groups)), (1, 2), mode,
                                       2 if mode == "ps" else None)), 2, schedule)
        out[f"mlp_{schedule}"] = (gd, ir, Strategy.pipelined(grouping, pipe), topo)
    gd = real_graphs.optimizer_graph("adam", sparse=True, resource=True, batch_size=32)
    ir = tag.analyze(gd)
    out["sparse_table"] = (gd, ir, builtin_strategy("dp_allreduce", ir, topo, group_ops(ir, 8)), topo)
    gd = lstm_graph()        # a tf_keras LSTM built at a static batch: per-batch copies of its loop bodies
    ir = tag.analyze(gd)
    out["lstm"] = (gd, ir, builtin_strategy("dp_allreduce", ir, topo, group_ops(ir, 8)), topo)
    return out


@lru_cache(maxsize=None)
def traced(name: str):
    gd, ir, strategy, topo = cases()[name]
    return traced_run(gd, ir, strategy, topo)


def test_every_read_is_an_input_or_written_by_an_earlier_pass():
    written: set[str] = set()
    for p in PASSES:
        assert p.reads | p.writes <= STATE_FIELDS, (p.name, sorted((p.reads | p.writes) - STATE_FIELDS))
        assert p.reads <= INPUT_FIELDS | written, (p.name, sorted(p.reads - INPUT_FIELDS - written))
        written |= p.writes
    assert set(RewriteState.__annotations__) <= written, sorted(set(RewriteState.__annotations__) - written)
    assert len({p.name for p in PASSES}) == len(PASSES)


@pytest.mark.parametrize("name", ["mlp_dp_sfb", "mlp_ps", "mlp_1f1b", "mlp_deferred_w", "sparse_table", "lstm"])
def test_passes_touch_only_the_fields_they_declare(name):
    st, touched = traced(name)
    for p in PASSES:
        read, assigned = touched[p.name]
        assert read <= p.reads | p.writes | CACHE_FIELDS, (p.name, sorted(read - p.reads - p.writes - CACHE_FIELDS))
        assert assigned <= p.writes | CACHE_FIELDS, (p.name, sorted(assigned - p.writes - CACHE_FIELDS))
        first = p.writes - INPUT_FIELDS - {f for q in PASSES[:PASSES.index(p)] for f in q.writes}
        assert first <= assigned, (p.name, sorted(first - assigned))   # it creates the fields it is first to write
    gd, ir, strategy, topo = cases()[name]
    plain = rewrite(gd, ir, strategy, topo)
    assert st.result.graph_def.SerializeToString(deterministic=True) == \
        plain.graph_def.SerializeToString(deterministic=True)


def test_every_declared_read_is_read_by_some_case():
    """No stale declarations: each pass reads everything it says it reads in at least one case."""
    for p in PASSES:
        read = set().union(*(traced(name)[1][p.name][0] for name in cases()))
        unread = p.reads - UNREAD_INPUTS - UNTAKEN_READS.get(p.name, set()) - read
        assert not unread, (p.name, sorted(unread))


def test_the_cases_meet_every_concern():
    notes = {name: " ".join(traced(name)[0].result.notes) for name in cases()}
    assert "sfb gathers" in notes["mlp_dp_sfb"] and "fused allreduces" in notes["mlp_dp_sfb"]
    assert "dense" in notes["sparse_table"]
    assert "weight-gradient ops run once per step" in notes["mlp_deferred_w"]
    assert any("_tag_b" in f.signature.name for f in traced("lstm")[0].result.graph_def.library.function)


def test_a_pass_that_leaves_a_declared_field_unset_is_caught():
    gd, ir, strategy, topo = cases()["mlp_ps"]
    st = RewriteState(gd, ir, strategy, topo)
    lazy = Pass("lazy", lambda st: None, frozenset(), frozenset({"order"}))
    with pytest.raises(RuntimeError, match="rewrite pass lazy did not set order"):
        run_passes(st, (lazy,))
    with pytest.raises(AttributeError):
        _ = st.order        # fields are set by their pass, not defaulted: reading early fails


def test_host_is_a_topology_host():
    gd, ir, strategy, topo = cases()["mlp_ps"]
    assert RewriteState(gd, ir, strategy, topo, host="h1").host == "h1"
    with pytest.raises(RewriteError, match="host 'h9' is not in the topology"):
        RewriteState(gd, ir, strategy, topo, host="h9")
