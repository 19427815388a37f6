"""scripts/probe_schedules.py: the per-stage step table it reads from a traced step."""
import os
import sys

import pytest
from tensorflow.core.protobuf import config_pb2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from probe_schedules import measured_steps  # noqa: E402


def _meta(device: str, ops: list[tuple[str, int, int]]):
    meta = config_pb2.RunMetadata()
    dev = meta.step_stats.dev_stats.add()
    dev.device = device
    for name, start_us, length_us in ops:
        n = dev.node_stats.add()
        n.node_name, n.all_start_micros, n.all_end_rel_micros = name, start_us, length_us
    return meta


def test_steps_per_micro_batch_and_the_once_per_step_weight_gradients():
    phase_of = {"dense/MatMul": "forward", "gradients/dense/MatMul_grad/MatMul": "backward",
                "gradients/dense/MatMul_grad/MatMul_1": "backward"}
    ops = [("tag/concat/gradients/dense/Relu_grad/ReluGrad_0/0_0_8/axis", 1000, 1),   # a constant at the start
           ("dense/MatMul/replica_0_micro_0", 1000, 2000),
           ("dense/MatMul/replica_0_micro_1", 3000, 2000),
           ("gradients/dense/MatMul_grad/MatMul/replica_0_micro_1", 5000, 3000),
           ("gradients/dense/MatMul_grad/MatMul/replica_0_micro_0", 8000, 3000),
           ("tag/concat/gradients/dense/Relu_grad/ReluGrad_0/0_0_8", 11000, 500),
           ("gradients/dense/MatMul_grad/MatMul_1", 11500, 4000),                       # deferred: whole batch
           ("save/restore_all", 20000, 100)]                                            # no step: not labelled
    out = measured_steps(_meta("/job:worker/replica:0/task:0/device:CPU:0", ops), phase_of,
                         {"gradients/dense/MatMul_grad/MatMul_1"})
    row = out["worker/replica:0/task:0/device:CPU:0"]
    assert list(row["steps"]) == ["F0", "F1", "B1", "B0", "W"]
    assert row["steps"]["F0"] == [0.0, 2.0] and row["steps"]["B0"] == [7.0, 10.0]
    assert row["steps"]["W"] == [10.0, 14.5]              # from the concatenation, not its axis constant
    assert row["busy_ms"] == pytest.approx(14.6) and row["span_ms"] == pytest.approx(19.1)
