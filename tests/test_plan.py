"""tag.plan: ``Plan.run`` times a plan beside data parallelism on real local TF servers, as tag-deploy --run does."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tag
from tag.errors import TagError
from tag.plan import plan_for, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
MEASURED_KEYS = {"measured_step_time_s", "measured_baseline_step_time_s", "measured_speedup_vs_dp", "measured_steps",
                 "measured_warmup_steps", "measured_losses", "measured_start_step", "measured_baseline_steps"}


@pytest.fixture(scope="module")
def ps_plan():
    graph = tag.zoo.training_graph("mlp", 12, input_dim=32, hidden=(64,))
    return plan_for(prepare(graph, LOCALHOST), "ps")


@pytest.mark.parametrize("steps, warmup, message", [
    (0, 0, "steps must be an integer >= 1, got 0"),
    (3, -1, "warmup must be an integer >= 0, got -1"),
    (3, 3, "warmup must be below steps (3), got 3"),
    (2.5, 0, "steps must be an integer >= 1, got 2.5"),
])
def test_run_refuses_bad_step_counts_before_starting_anything(ps_plan, steps, warmup, message):
    with pytest.raises(TagError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ps_plan.run(steps=steps, warmup=warmup)


def _check_fields(fields: dict, steps: int, baseline_steps: int, warmup: int) -> None:
    assert set(fields) == MEASURED_KEYS
    assert fields["measured_step_time_s"] > 0 and fields["measured_baseline_step_time_s"] > 0
    assert fields["measured_speedup_vs_dp"] == pytest.approx(
        fields["measured_baseline_step_time_s"] / fields["measured_step_time_s"])
    assert fields["measured_steps"] == steps and fields["measured_baseline_steps"] == baseline_steps
    assert fields["measured_warmup_steps"] == warmup
    assert len(fields["measured_losses"]) == steps and all(np.isfinite(fields["measured_losses"]))


@pytest.mark.slow
def test_run_times_the_plan_and_dp_allreduce_on_local_workers(ps_plan):
    heard = []
    fields = ps_plan.run(steps=4, warmup=1, progress=lambda name, event: heard.append(name))
    _check_fields(fields, 4, 4, 1)
    assert {"ps", "dp_allreduce"} <= set(heard)         # both runs reported their steps


@pytest.mark.slow
def test_a_loaded_plan_runs_with_its_baseline_rebuilt_from_its_files(ps_plan, tmp_path):
    loaded = tag.Plan.load(ps_plan.save(tmp_path / "plan"))
    assert loaded.analysis is None
    baseline = loaded._baseline_rewrite()
    assert sorted(baseline.devices) == sorted(ps_plan._baseline_rewrite().devices)   # dp over every device
    fields = loaded.run(steps=3, warmup=1, topology=LOCALHOST)
    _check_fields(fields, 3, 3, 1)
