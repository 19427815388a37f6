"""scripts/breakdown_published.py: a published row's predicted one-GPU step split by op class, on a tiny graph."""
import numpy as np
import pytest

from helpers import load_script
from tiny import mlp_graph

breakdown = load_script("breakdown_published").breakdown


def _row(gpus: int) -> dict:
    return {"id": f"v100-mlp-{gpus}", "system": "dgx1-v100-16g", "gpu_count": gpus, "per_gpu_batch": 64,
            "precision": "fp32", "xla": False, "grad_dtype": "fp32", "throughput": 1000.0}


def test_breakdown_sums_to_the_cost_models_step_and_splits_its_bounds():
    import tag
    from tag.cost.model import CostModel
    from tag_bench import published
    g = mlp_graph(batch=8, widths=(256, 512, 10))
    b = breakdown(_row(1), g)
    topo = tag.parse_topology(published.topology_text("dgx1-v100-16g", 1), path="<test>")
    assert b["device_sum_s"] == pytest.approx(float(np.sum(CostModel(g, topo).op_times(0, 64.0))))
    assert sum(e["s"] for e in b["keys"].values()) == pytest.approx(b["device_sum_s"])
    # ops are keyed by op class and precision where they have one (unknown shapes here: by type)
    assert "MatMul" in b["keys"] and b["keys"]["MatMul"]["ops"] == sum(op.type == "MatMul" for op in g.ops)
    for e in b["keys"].values():
        assert 0.0 <= e["mem_s"] <= e["s"] + 1e-12 and 0.0 <= e["launch_s"] <= e["s"] + 1e-12
    assert b["published_step_s"] == pytest.approx(0.064)


def test_breakdown_step_reports_the_lockstep_and_the_allreduce_of_every_gradient():
    g = mlp_graph(batch=8, widths=(256, 512, 10))
    one, eight = breakdown(_row(1), g, step=True), breakdown(_row(8), g, step=True)
    assert one["allreduce_s"] == 0.0 and one["lockstep_factor"] == 1.0
    assert eight["allreduce_s"] > 0 and eight["lockstep_factor"] > 1.0
    grad = sum(v.nbytes for v in g.variables if v.kind == "trainable")
    assert eight["gradient_bytes"] == pytest.approx(grad)
    assert eight["simulated_step_s"] >= eight["device_sum_s"] * (1 - 1e-9)
