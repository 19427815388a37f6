"""scripts/probe_step_trace.py: per-host figures of a traced step, read from TensorFlow's StepStats."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from probe_step_trace import measured_hosts, median_hosts, task_of  # noqa: E402


def _stats():
    from tensorflow.core.framework.step_stats_pb2 import StepStats
    s = StepStats()
    h0 = s.dev_stats.add(device="/job:worker/replica:0/task:0/device:CPU:0")
    h1 = s.dev_stats.add(device="/job:worker/replica:0/task:1/device:CPU:0")
    for dev, name, label, start_us, dur_us in (
            (h0, "conv", "conv = _MklNativeFusedConv2D(x, w)", 1000, 3000),
            (h1, "edge_1_w", "[256B] [0.2Mb/s] edge_1_w from /job:worker/replica:0/task:0/device:CPU:0 to "
                             "/job:worker/replica:0/task:1/device:CPU:0", 1100, 4000),
            (h1, "conv_1", "conv_1 = _MklNativeFusedConv2D(x, w)", 5200, 2000),
            (h1, "add", "add = AddV2(a, b)", 7300, 100)):
        ns = dev.node_stats.add(node_name=name, timeline_label=label, all_start_micros=start_us)
        ns.op_end_rel_micros = ns.all_end_rel_micros = dur_us
    return s


def test_task_of_reads_the_worker_task():
    assert task_of("/job:worker/replica:0/task:1/device:CPU:0") == 1
    assert task_of("/device:CPU:0") is None


def test_measured_hosts_splits_receives_from_kernels():
    hosts = measured_hosts(_stats())
    assert set(hosts) == {0, 1}
    assert hosts[0]["first_heavy_ms"] == 0.0 and hosts[0]["recvs"] == 0
    h1 = hosts[1]
    assert h1["first_ms"] == 0.1 and abs(h1["last_ms"] - 6.4) < 1e-9
    assert abs(h1["first_heavy_ms"] - 4.2) < 1e-9          # the convolution waited for the weight's receive
    assert abs(h1["recv_wait_ms"] - 4.0) < 1e-9 and h1["recvs"] == 1
    assert abs(h1["kernel_ms"] - 2.1) < 1e-9               # the receive is not a kernel
    assert h1["longest_recvs"][0][0] == "edge_1_w"


def test_median_hosts_takes_each_figure_apart():
    a, b, c = (measured_hosts(_stats()) for _ in range(3))
    b[1]["recv_wait_ms"], c[1]["recv_wait_ms"] = 10.0, 1.0
    assert median_hosts([a, b, c])[1]["recv_wait_ms"] == 4.0
