"""Cost model: profile files, roofline op times and communication models, checked by hand."""
import json

import numpy as np
import pytest

from tag.cost.model import CostModel, DeviceProfile, Profile
from tag.errors import TagError
from tiny import DeviceSpec, GraphBuilder, make_topology


def _graph():
    b = GraphBuilder(batch_size=8)
    b.op("x", "Placeholder", out_pe=4000)
    b.op("mm", "MatMul", inputs=("x",), flops=2e9, out_pe=1000)          # compute-bound
    b.op("add", "AddV2", inputs=("mm",), flops_pe=10, out_bytes=1e9)    # memory-bound: 1e9 + 8*1000 bytes
    b.op("id", "Identity", inputs=("add",), out_bytes=1e9)              # free
    return b.build()


def _topo(**kw):
    return make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-A", 2), ("GPU-B", 1)])],
                         specs={"GPU-A": DeviceSpec(peak_flops=10e12, memory_bandwidth=1e11),
                                "GPU-B": DeviceSpec(peak_flops=5e12, memory_bandwidth=5e10)}, **kw)


def test_op_times_roofline_by_hand():
    prof = Profile({"GPU-A": DeviceProfile(efficiency={"MatMul": 0.5, "default": 0.25}, launch_overhead_s=1e-5)})
    cm = CostModel(_graph(), _topo(), prof)
    t = cm.op_times(0, batch=8)
    assert t[0] == 0.0                                              # Placeholder: zero-cost type
    assert t[1] == pytest.approx(2e9 / (10e12 * 0.5) + 1e-5)         # 0.4 ms + launch overhead
    assert t[2] == pytest.approx((1e9 + 8 * 1000) / 1e11 + 1e-5)     # memory term dominates
    assert t[3] == 0.0                                              # Identity moves nothing
    # another device type scales by its spec sheet (no profile entry: built-in GPU defaults)
    tb = cm.op_times(2, batch=8)
    assert tb[1] == pytest.approx(2e9 / (5e12 * 0.5) + 5e-6)
    assert tb[2] == pytest.approx((1e9 + 8000) / 5e10 + 5e-6)
    # cached and read-only
    assert cm.op_times(0, 8) is t
    with pytest.raises(ValueError):
        t[0] = 1.0


def test_profile_entry_replaces_spec_numbers_default_entry_does_not():
    prof = Profile({"GPU-A": DeviceProfile(peak_flops=1e12, memory_bandwidth=1e10, launch_overhead_s=0.0,
                                           efficiency={"MatMul": 1.0}),
                    "default": DeviceProfile(peak_flops=123.0, launch_overhead_s=0.0, efficiency={"default": 0.1})})
    cm = CostModel(_graph(), _topo(), prof)
    assert cm.op_times(0, 8)[1] == pytest.approx(2e9 / 1e12)        # measured peak, not the 10 TFLOP/s spec
    ra, rb = cm.rates(0), cm.rates(2)
    assert ra.peak_flops == 1e12 and ra.memory_bandwidth == 1e10
    assert rb.peak_flops == 5e12 and rb.efficiency_of("Conv2DBackpropFilter") == 0.5   # built-in per type
    assert rb.efficiency_of("Softmax") == 0.1                        # the profile's "default"


def test_profile_round_trip(tmp_path):
    prof = Profile({"CPU": DeviceProfile(1.1e11, 9e9, 1.2e-5, {"MatMul": 0.6, "default": 0.1})}, source="test")
    path = tmp_path / "p.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["devices"]["CPU"]["efficiency"]["MatMul"] == 0.6
    back = Profile.load(path)
    assert back == prof


def test_profile_round_trip_with_family_scales_and_old_files_still_load(tmp_path):
    prof = Profile({"CPU": DeviceProfile(1.1e11, 9e9, 1.2e-5, {"MatMul": 0.6}, family_scale={"conv": 0.75,
                                                                                           "matmul": 1.2})})
    path = tmp_path / "p.json"
    prof.save(path)
    assert json.loads(path.read_text())["devices"]["CPU"]["family_scale"] == {"conv": 0.75, "matmul": 1.2}
    back = Profile.load(path)
    assert back == prof and back.devices["CPU"].family_scale == {"conv": 0.75, "matmul": 1.2}
    # scaling the entry to another quota keeps its family scales
    assert back.devices["CPU"].scaled(0.5).family_scale == {"conv": 0.75, "matmul": 1.2}
    # a profile written before family scales existed has no such key and loads with none
    old = tmp_path / "old.json"
    old.write_text('{"version": 1, "devices": {"CPU": {"peak_flops": 1e11, "memory_bandwidth": 1e10, '
                   '"efficiency": {"MatMul": 0.5}}}}')
    assert Profile.load(old).devices["CPU"].family_scale == {}
    assert "family_scale" not in Profile.load(old).to_dict()["devices"]["CPU"]


def test_family_scale_applies_to_its_family_only_and_not_to_the_launch_overhead():
    b = GraphBuilder(batch_size=8)
    b.op("x", "Placeholder", out_pe=4000)
    b.op("conv", "Conv2D", inputs=("x",), flops=1e9, out_pe=1000)
    b.op("dconv", "Conv2DBackpropFilter", inputs=("conv",), flops=1e9, out_pe=1000)
    b.op("mm", "MatMul", inputs=("dconv",), flops=2e9, out_pe=1000)
    b.op("bmm", "BatchMatMulV2", inputs=("mm",), flops=2e9, out_pe=1000)
    b.op("add", "AddV2", inputs=("bmm",), flops_pe=10, out_bytes=1e9)
    b.op("id", "Identity", inputs=("add",), out_bytes=1e9)
    graph = b.build()
    entry = DeviceProfile(efficiency={"default": 0.5}, launch_overhead_s=1e-5)
    plain = CostModel(graph, _topo(), Profile({"GPU-A": entry})).op_times(0, 8)
    conv_only = Profile({"GPU-A": DeviceProfile(efficiency={"default": 0.5}, launch_overhead_s=1e-5,
                                                family_scale={"conv": 0.5})})
    t = CostModel(graph, _topo(), conv_only).op_times(0, 8)
    for i in (1, 2):                                                 # Conv2D and its backprop: half the roofline
        assert t[i] == pytest.approx((plain[i] - 1e-5) * 0.5 + 1e-5)
    assert list(t[3:]) == list(plain[3:]) and t[0] == plain[0] == 0.0    # MatMuls, the rest, free ops: unchanged
    every = Profile({"GPU-A": DeviceProfile(efficiency={"default": 0.5}, launch_overhead_s=1e-5,
                                            family_scale={"conv": 2.0, "matmul": 3.0, "other": 4.0})})
    t = CostModel(graph, _topo(), every).op_times(0, 8)
    for i, k in [(1, 2.0), (2, 2.0), (3, 3.0), (4, 3.0), (5, 4.0)]:
        assert t[i] == pytest.approx((plain[i] - 1e-5) * k + 1e-5)
    assert t[6] == 0.0
    # another device type without an exact entry, served by the "default" entry, takes its family scales too
    by_default = CostModel(graph, _topo(), Profile({"default": DeviceProfile(
        efficiency={"default": 0.5}, launch_overhead_s=1e-5, family_scale={"matmul": 2.0})}))
    base = CostModel(graph, _topo(), Profile({"default": DeviceProfile(efficiency={"default": 0.5},
                                                                       launch_overhead_s=1e-5)}))
    t2, p2 = by_default.op_times(2, 8), base.op_times(2, 8)
    assert t2[3] == pytest.approx((p2[3] - 1e-5) * 2 + 1e-5) and t2[1] == p2[1] and t2[5] == p2[5]


def test_a_fading_level_leaves_long_kernels_as_traced_and_scales_short_ones():
    """``level_fade_s``: an op of roofline time t is charged t * (1 + (scale - 1) * tau / (t + tau)); the
    launch overhead is untouched, and the field round-trips through JSON (absent in older files)."""
    b = GraphBuilder(batch_size=8)
    b.op("x", "Placeholder", out_pe=4000)
    b.op("short", "MatMul", inputs=("x",), flops=1e6, out_pe=10)
    b.op("long", "MatMul", inputs=("short",), flops=1e12, out_pe=10)
    graph = b.build()
    plain = CostModel(graph, _topo(), Profile({"GPU-A": DeviceProfile(
        efficiency={"default": 0.5}, launch_overhead_s=1e-5)})).op_times(0, 8) - 1e-5
    entry = DeviceProfile(efficiency={"default": 0.5}, launch_overhead_s=1e-5, family_scale={"matmul": 2.0},
                          level_fade_s=1e-3)
    t = CostModel(graph, _topo(), Profile({"GPU-A": entry})).op_times(0, 8) - 1e-5
    for i in (1, 2):
        assert t[i] == pytest.approx(plain[i] * (1 + 1e-3 / (plain[i] + 1e-3)))
    assert plain[1] < 1e-5 and t[1] == pytest.approx(2 * plain[1], rel=0.01)        # short: the full scale
    assert plain[2] > 0.1 and t[2] - plain[2] == pytest.approx(1e-3, rel=0.01)      # long: + (2 - 1) * tau
    back = Profile.from_dict(Profile({"GPU-A": entry}).to_dict())
    assert back.devices["GPU-A"].level_fade_s == 1e-3 and back.devices["GPU-A"].scaled(0.5).level_fade_s == 1e-3
    assert "level_fade_s" not in Profile({"GPU-A": DeviceProfile()}).to_dict()["devices"]["GPU-A"]


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"version": 2, "devices": {}}', "unsupported profile version"),
    ('{"version": 1}', "'devices' must be an object"),
    ('{"version": 1, "devices": {"CPU": {"efficiency": {"MatMul": 1.5}}}}', "must be in (0, 1]"),
    ('{"version": 1, "devices": {"CPU": {"peak_flops": -1}}}', "finite number >= 0"),
    ('{"version": 1, "devices": {"CPU": {"level_fade_s": 0}}}', "level_fade_s must be a finite number > 0"),
    ('{"version": 1, "devices": {"CPU": {"peak_flops": "fast"}}}', "finite number >= 0"),
    ('{"version": 1, "devices": {"CPU": {"speed": 3}}}', "unknown field 'speed'"),
    ('{"version": 1, "devices": {"CPU": {"family_scale": {"lstm": 2}}}}', "unknown op family 'lstm'"),
    ('{"version": 1, "devices": {"CPU": {"family_scale": {"conv": 0}}}}', "finite number > 0"),
    ('{"version": 1, "devices": {"CPU": {"family_scale": [1, 2]}}}', "family_scale must be an object"),
    ('{"version": 1, "devices": {"CPU": {"family_scale": 0}}}', "family_scale must be an object"),
])
def test_bad_profile_files_raise_one_line_tag_error(tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TagError) as err:
        Profile.load(path)
    msg = str(err.value)
    assert msg.startswith(str(path)) and needle in msg and "\n" not in msg


def test_missing_and_binary_profile(tmp_path):
    with pytest.raises(TagError, match="not found"):
        Profile.load(tmp_path / "nope.json")
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TagError, match="not UTF-8"):
        Profile.load(p)
    with pytest.raises(TagError, match="directory"):
        Profile.load(tmp_path)


def test_transfer_time():
    topo = _topo(intra_bandwidth=100e9, intra_latency=2e-6, inter_bandwidth=1.25e9, inter_latency=20e-6)
    cm = CostModel(_graph(), topo)
    assert cm.transfer_time(1e9, 0, 0) == 0.0
    assert cm.transfer_time(1e9, 0, 1) == pytest.approx(2e-6 + 1e9 / 100e9)
    assert cm.transfer_time(1e9, 0, 2) == pytest.approx(20e-6 + 1e9 / 1.25e9)


def test_allreduce_ring_and_hierarchical_by_hand():
    # 4 hosts x 1 device, 1 GB/s links, 10 us: ring only
    topo = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(4)], inter_bandwidth=1e9, inter_latency=1e-5)
    cm = CostModel(_graph(), topo)
    assert cm.allreduce_time(1e8, [0, 1, 2, 3]) == pytest.approx(2 * 3 / 4 * 1e8 / 1e9 + 2 * 3 * 1e-5)
    assert cm.allreduce_time(1e8, [2]) == 0.0
    # 2 hosts x 2 devices: hierarchical (reduce-scatter + all-gather inside at 100 GB/s, ring across hosts)
    topo = make_topology([("h0", [("GPU-A", 2)]), ("h1", [("GPU-A", 2)])], intra_bandwidth=1e11,
                         intra_latency=2e-6, inter_bandwidth=1e9, inter_latency=1e-5)
    cm = CostModel(_graph(), topo)
    ring = 2 * 3 / 4 * 1e8 / 1e9 + 6 * 1e-5
    hier = (2 * 1 / 2 * 1e8 / 1e11 + 2 * 2e-6) + (2 * 1 / 2 * 1e8 / 1e9 + 2 * 1e-5)
    assert hier < ring
    (ring_fixed, ring_per_byte), (hier_fixed, hier_per_byte) = cm.allreduce_coeffs([0, 1, 2, 3])
    assert hier_fixed + hier_per_byte * 1e8 == pytest.approx(hier)
    # what is charged is what the rewriter deploys: the flat ring
    assert cm.allreduce_time(1e8, [0, 1, 2, 3]) == pytest.approx(ring_fixed + ring_per_byte * 1e8)


def test_ps_time_shares_the_ps_link():
    topo = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(4)], inter_bandwidth=1e9, inter_latency=1e-5)
    cm = CostModel(_graph(), topo)
    # three remote workers push 1e8 bytes each through the PS host's 1 GB/s NIC, then pull them back
    assert cm.ps_time(1e8, [0, 1, 2, 3], 0) == pytest.approx(2 * (1e-5 + 3 * 1e8 / 1e9))
    assert cm.ps_time(1e8, [0], 0) == 0.0
    # 10 GB/s links from the PS host: its NIC still carries the three workers' bytes one after another
    fast = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(4)], inter_bandwidth=1e9, inter_latency=1e-5,
                         host_links={("h0", f"h{i}"): (1e10, 1e-5) for i in (1, 2, 3)})
    assert CostModel(_graph(), fast).ps_time(1e8, [0, 1, 2, 3], 0) == pytest.approx(2 * (1e-5 + 3 * 1e8 / 1e10))
    # ... and a single slow path is never faster than its own link
    one = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(4)], inter_bandwidth=1e9, inter_latency=1e-5,
                        host_links={("h0", "h1"): (1e10, 1e-5)})
    assert CostModel(_graph(), one).ps_time(1e8, [0, 1, 2, 3], 0) == pytest.approx(2 * (1e-5 + 1e8 / 1e9))


def test_allgather_ring_by_hand():
    topo = make_topology([(f"h{i}", [("GPU-A", 1)]) for i in range(3)], inter_bandwidth=1e9, inter_latency=1e-5)
    cm = CostModel(_graph(), topo)
    assert cm.allgather_time(1e6, [0, 1, 2]) == pytest.approx(2 * (1e-5 + 1e6 / 1e9))
    assert cm.allgather_time(1e6, [1]) == 0.0


def test_cost_model_on_a_real_graph_is_positive_and_scales_with_batch():
    from tiny import mlp_graph
    tg = mlp_graph(batch=8, widths=(64, 256, 10))
    cm = CostModel(tg, _topo())
    t8, t64 = cm.compute_time(0, 8), cm.compute_time(0, 64)
    assert 0 < t8 < t64
    assert np.all(cm.op_times(0, 64) >= cm.op_times(0, 8))


def test_network_calibration_slows_inter_host_links_only(tmp_path):
    from tag.cost.model import NetworkProfile
    net = NetworkProfile(step_overhead_s=1e-3, transfer_latency_s=1e-4, transfer_bytes_per_s=1.25e9)
    prof = Profile({}, network=net)
    path = tmp_path / "p.json"
    prof.save(path)
    loaded = Profile.load(path)
    assert loaded.network == net
    topo = _topo()                                 # h0: devices 0,1; h1: devices 2,3 (+4): 1.25e9 B/s, 20 us
    cm = CostModel(_graph(), topo, loaded)
    # inter-host: 1 / (1/1.25e9 + 1/1.25e9) = 0.625e9 B/s, latency 20 us + 100 us
    assert cm.transfer_time(1.25e9, 0, 2) == pytest.approx(120e-6 + 2.0)
    assert cm.transfer_time(1e9, 0, 1) == pytest.approx(2e-6 + 1e9 / 100e9)       # intra-host untouched
    assert topo.bandwidth[0, 2] == pytest.approx(1.25e9)                          # the input is not modified


def test_network_profile_rejects_bad_values(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "devices": {}, "network": {"transfer_bytes_per_s": 0}}))
    with pytest.raises(TagError, match="network.transfer_bytes_per_s"):
        Profile.load(path)
    path.write_text(json.dumps({"version": 1, "devices": {}, "network": {"bogus": 1}}))
    with pytest.raises(TagError, match="unknown field 'bogus'"):
        Profile.load(path)


def test_collective_calibration_charges_cross_host_all_reduce_only():
    from tag.cost.model import NetworkProfile
    net = NetworkProfile(transfer_bytes_per_s=1e9, collective_bytes_per_s=0.5e9, transfer_latency_s=0.0,
                         collective_latency_s=2e-3)
    plain, calibrated = CostModel(_graph(), _topo()), CostModel(_graph(), _topo(), Profile({}, network=net))
    # two devices on two hosts: ring of 2 steps; extra = 1e6 bytes * (1/0.5e9 - 1/1e9) + 2 steps * 1 ms
    # on top of the link slowed by the transfer calibration: 1 / (1/1.25e9 + 1/1e9)
    expected = 2 * 20e-6 + 2 * 1e-3 + 1e6 * (1 / 1.25e9 + 1 / 1e9 + (1 / 0.5e9 - 1 / 1e9))
    assert calibrated.allreduce_time(1e6, [0, 2]) == pytest.approx(expected)
    assert calibrated.allreduce_time(1e6, [0, 1]) == pytest.approx(plain.allreduce_time(1e6, [0, 1]))  # one host


def test_runtime_transfer_costs_are_the_same_from_a_slower_cpu_host():
    """The network calibration adds the runtime's measured per-transfer latency and per-byte cost to every
    inter-host link alike: a quarter-speed CPU host pays no more (measured on the 3-host testbed, charging
    it at the slower host's speed predicted data parallelism of MLPs 15-40% too slow)."""
    from tag.cost.model import NetworkProfile, Profile
    from tiny import DeviceSpec, make_topology, mlp_graph
    net = NetworkProfile(transfer_latency_s=1e-3, transfer_bytes_per_s=1e9)
    specs = {"FAST": DeviceSpec(tf_device_type="CPU", peak_flops=40e9, memory_bandwidth=10e9),
             "SLOW": DeviceSpec(tf_device_type="CPU", peak_flops=10e9, memory_bandwidth=10e9)}
    topo = make_topology([("h0", [("FAST", 1)]), ("h1", [("FAST", 1)]), ("h2", [("SLOW", 1)])], specs=specs,
                         inter_bandwidth=1e12)
    cm = CostModel(mlp_graph(batch=8, widths=(16, 16)), topo, Profile({}, "t", network=net))
    nbytes = 1e8
    for dst in (1, 2):
        t = cm.topology.latency[0, dst] + nbytes / cm.topology.bandwidth[0, dst]
        assert t == pytest.approx(20e-6 + 1e-3 + nbytes * (1e-12 + 1e-9), rel=1e-6)


def test_profile_devices_under_load_round_trip_and_errors(tmp_path):
    alone = DeviceProfile(1.1e11, 9e9, 1e-5, {"MatMul": 0.6})
    busy = DeviceProfile(1.1e11, 9e9, 3e-5, {"MatMul": 0.6}, family_scale={"conv": 1.5})
    prof = Profile({"CPU": alone}, devices_under_load={"CPU": busy})
    path = tmp_path / "p.json"
    prof.save(path)
    assert json.loads(path.read_text())["devices_under_load"]["CPU"]["launch_overhead_s"] == 3e-5
    back = Profile.load(path)
    assert back == prof
    assert back.under_load().devices["CPU"] == busy and back.under_load().devices_under_load == {}
    assert Profile({"CPU": alone}).under_load() is None           # a cluster's profile: nothing timed under load
    path.write_text('{"version": 1, "devices": {}, "devices_under_load": {"CPU": {"family_scale": {"gpu": 2}}}}')
    with pytest.raises(TagError, match=r"devices_under_load\.CPU\.family_scale: unknown op family 'gpu'"):
        Profile.load(path)
    path.write_text('{"version": 1, "devices": {"CPU": {"peak_flops": -1}}}')
    with pytest.raises(TagError, match=r"devices\.CPU\.peak_flops must be a finite number >= 0"):
        Profile.load(path)


def test_with_profile_keeps_the_options_and_calibrates_the_links_once():
    from tag.cost.model import NetworkProfile
    net = NetworkProfile(transfer_latency_s=1e-3, transfer_bytes_per_s=1e9)
    cm = CostModel(_graph(), _topo(), Profile({}, network=net), xla=True, gradient_dtype="fp16")
    other = cm.with_profile(Profile({"GPU-A": DeviceProfile(efficiency={"default": 0.5})}, network=net))
    assert other.xla and other.gradient_dtype == "fp16" and not other.tf32
    assert np.array_equal(other.topology.latency, cm.topology.latency)      # not the runtime's latency twice
