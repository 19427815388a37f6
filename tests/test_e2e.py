"""The end-to-end benchmark's pieces: shared models (tag.backend.mwms) and the testbed topology/profile."""
from __future__ import annotations

import importlib.util
import os

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
    from tag.backend.mwms import tf1_graph
    from tag.frontend.analyze import analyze
    gd = tf1_graph("mlp", 96)
    names = {n.name for n in gd.node}
    assert {"input", "labels", "loss", "train_op", "init"} <= names
    tg = analyze(gd, batch_size=96)
    params = sum(v.nbytes for v in tg.variables if v.kind == "trainable") // 4
    assert 7.5e6 < params < 8.5e6


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


@pytest.mark.slow
def test_optimize_with_verify_target_keeps_the_faster_of_plan_and_best_builtin():
    import tag
    from tag.backend.runtime import LocalCluster
    topo = tag.load_topology(os.path.join(REPO, "topologies", "localhost.pbtxt"))
    gd = tag.zoo.training_graph("mlp", 32, hidden=(64, 64))
    with LocalCluster(topo, threads_per_worker=1) as cluster:
        plan = tag.optimize(gd, topo, batch_size=32, playouts=8, verify_target=cluster.target, verify_steps=4)
    notes = [n for n in plan.notes if n.startswith("verified on")]
    builtins = {"dp_allreduce", "ps", "single", "partition"}
    if plan.report()["method"] not in builtins:   # a searched plan was compared with the best built-in
        assert len(notes) == 1 and "kept" in notes[0]
