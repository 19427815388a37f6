"""scripts/probe_stage_order.py: the pipeline DP planned in one fixed stage order (no testbed needed)."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import tag  # noqa: E402
from tag.api import prepare  # noqa: E402
from tag.cost.model import Profile  # noqa: E402
import _testbed_cases  # noqa: E402  (not its names: pytest would collect testbed_topology)
from bench_e2e import GPU_CONFIG, config_recipe  # noqa: E402
import probe_stage_order  # noqa: E402

PROFILE = os.path.join(REPO, "docs/measured/issue22-e2e/e2e_g5_amd_run51.profile.json")


@pytest.mark.parametrize("hosts", [(0, 1, 2), (2, 1, 0)])
def test_the_pipeline_runs_its_stages_on_the_hosts_in_the_order_asked(hosts):
    profile = Profile.load(PROFILE)
    recipe = config_recipe(_testbed_cases.load_recipe(), profile, 25.0)
    _, topo = _testbed_cases.testbed_topology(recipe, GPU_CONFIG, profile)
    gd = tag.zoo.training_graph("mlp", 48, hidden=(256, 256, 256, 256))
    found = probe_stage_order.pipeline_in_order(prepare(gd, topo, batch_size=48, profile=profile), hosts)
    assert found.strategy is not None and found.strategy.pipeline is not None
    stage_hosts = [{topo.groups[g].host for g in stage.placement} for stage in found.strategy.pipeline.stages]
    assert stage_hosts == [{topo.hosts[h].name} for h in hosts]
