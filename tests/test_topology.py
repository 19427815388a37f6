"""tag.cluster.topology: schema build, loading, validation messages, matrices, ready cluster files."""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tag
from tag.cluster.topology import MAX_FILE_BYTES, Topology, format_topology, load_topology, parse_topology
from tag.errors import TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGIES = os.path.join(ROOT, "topologies")

CPU = 'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }'
GPU2 = 'device { type: "V100" kind: GPU count: 2 memory_gib: 16 peak_tflops: 15.7 memory_bandwidth_gbs: 900 }'


def host(name: str = "a", port: object = 1, body: str = CPU, address: str = "127.0.0.1") -> str:
    """A 7-line host entry: host{ / name / address / port / body (one line) / ... / }."""
    return f'host {{\n  name: "{name}"\n  address: "{address}"\n  port: {port}\n  {body}\n}}\n'


def gpu(**fields: object) -> str:
    """A V100 device entry (fields overridable, None drops one) and an interconnect, on one line."""
    f = dict(type='"V100"', kind="GPU", count=2, memory_gib=16, peak_tflops=15.7, memory_bandwidth_gbs=900)
    f.update(fields)
    entry = " ".join(f"{k}: {v}" for k, v in f.items() if v is not None)
    return f"device {{ {entry} }} interconnect {{ bandwidth_gbs: 10 }}"


FABRIC = "fabric { bandwidth_gbps: 1 }\n"

# (case id, file content, expected message after "PATH")
MALFORMED = [
    ("empty", b"", ": empty file: expected a cluster in protobuf text format (host { ... })"),
    ("whitespace", b"  \n\n\t\n", ": empty file: expected a cluster in protobuf text format (host { ... })"),
    ("only-comments", b"# nothing here\n", ": no hosts: a cluster needs at least one host { ... } with a device"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
     ":1: not UTF-8 text (byte 0x89 at offset 0); is this a binary file?"),
    ("latin1", "# ok\n# café\n".encode("latin-1"),
     ":2: not UTF-8 text (byte 0xe9 at offset 10); is this a binary file?"),
    ("nul", b'name: "x"\n\x00\n', ":2: contains a NUL character; is this a binary file?"),
    ("json", b'{"host": [{"name": "a"}]}',
     ':1: Expected identifier or number, got {. -- this looks like JSON, but topology files are protobuf text format: '
     'host { name: "a" ... }'),
    ("yaml", b"host:\n  - name: a\n    port: 1\n",
     ':2: Expected "{". -- this looks like YAML, but topology files are protobuf text format: host { name: "a" ... }'),
    ("typo-field", host().replace("port:", "prot:").encode(),
     ":4: unknown field 'prot' in Host (its fields: name, address, port, device, interconnect)"),
    ("unit-mixup", host(body=CPU + " interconnect { bandwidth_gbps: 10 }").encode(),
     ":5: unknown field 'bandwidth_gbps' in Interconnect (its fields: kind, bandwidth_gbs, latency_us); "
     "inside a host bandwidth is in GB/s: bandwidth_gbs"),
    ("bad-enum", host(body=gpu(kind="TPU")).encode(),
     ":5: unknown DeviceGroup.Kind value 'TPU' (expected one of: GPU, CPU)"),
    ("kind-number", host(body=gpu(kind=3)).encode(), ":5: host 'a' device 'V100': unknown kind 3 (GPU or CPU)"),
    ("interconnect-kind-number",
     host(body=GPU2 + "\n  interconnect {\n    kind: 9\n    bandwidth_gbs: 1\n  }").encode(),
     ":7: host 'a' interconnect: unknown kind 9 (NVLINK, PCIE, SHARED_MEMORY, OTHER)"),
    ("unclosed", b'host {\n  name: "a"\n', ':2: Expected "}".'),
    ("double-name", b'host {\n  name: "a"\n  name: "b"\n}\n',
     ':3: Message type "tag.Host" should not have multiple "name" fields.'),
    ("int-overflow", host(port="99999999999999999999999").encode(),
     ":4: Value out of range: 99999999999999999999999"),
    ("float-port", host(port="1.5").encode(), ":4: Couldn't parse integer: 1.5"),
    ("dup-host", (host() + host(port=2)).encode(), ":8: duplicate host name 'a' (first on line 1)"),
    ("no-name", ('host { address: "127.0.0.1" port: 1 ' + CPU + " }").encode(), ":1: host #1 has no name"),
    ("slash-name", host(name="a/b").encode(),
     ":2: host name 'a/b' may use only letters, digits, '_', '.', '-' (at most 128)"),
    ("no-address", ('host {\n  name: "a"\n  port: 1\n  ' + CPU + "\n}\n").encode(),
     ":1: host 'a': missing address (hostname or IP address of its TF server)"),
    ("bad-ip", host(address="10.0.0.256").encode(),
     ":3: host 'a': address '10.0.0.256' is neither an IP address nor a valid hostname"),
    ("bad-hostname", host(address="-bad-.example.org").encode(),
     ":3: host 'a': address '-bad-.example.org' is neither an IP address nor a valid hostname"),
    ("address-with-port", host(address="10.0.0.1:2222").encode(),
     ":3: host 'a': address '10.0.0.1:2222' is neither an IP address nor a valid hostname "
     "(give the port in port:, not in the address)"),
    ("no-port", ('host {\n  name: "a"\n  address: "h"\n  ' + CPU + "\n}\n").encode(), ":1: host 'a': missing port"),
    ("port-zero-remote", host(port=0, address="10.0.0.1").encode(),
     ":4: host 'a': port 0 (a free port chosen at start) is only for loopback hosts (127.0.0.1, ::1, localhost), "
     "not 10.0.0.1: give its port"),
    ("port-too-big", host(port=70000).encode(), ":4: host 'a': port must be in 1..65535 (or 0 on a loopback host), "
     "got 70000"),
    ("port-negative", host(port=-5).encode(), ":4: host 'a': port must be in 1..65535 (or 0 on a loopback host), "
     "got -5"),
    ("same-endpoint", (host("a") + host("b") + FABRIC).encode(),
     ":10: host 'b': 127.0.0.1:1 is already the address of host 'a'"),
    ("no-devices", b'host {\n  name: "a"\n  address: "h"\n  port: 1\n}\n',
     ":1: host 'a' has no devices (add device { type: ... kind: GPU ... })"),
    ("no-kind", host(body=gpu(kind=None)).encode(), ":5: host 'a' device 'V100': missing kind (GPU or CPU)"),
    ("no-type", host(body=gpu(type=None)).encode(), ":5: host 'a': device entry #1 has no type"),
    ("type-with-colon", host(body=gpu(type='"V100:0"')).encode(),
     ":5: host 'a': device type 'V100:0' may use only letters, digits, '_', '.', '+', '-' (at most 64)"),
    ("count-zero", host(body=gpu(count=0)).encode(), ":5: host 'a' device 'V100': count must be positive, got 0"),
    ("count-huge", host(body=gpu(count=5000)).encode(),
     ":5: host 'a' device 'V100': count 5000 is over the limit of 4096"),
    ("memory-zero", host(body=gpu(memory_gib=0)).encode(),
     ":5: host 'a' device 'V100': memory_gib must be positive, got 0"),
    ("memory-negative", host(body=gpu(memory_gib=-16)).encode(),
     ":5: host 'a' device 'V100': memory_gib must be positive, got -16"),
    ("memory-missing", host(body=gpu(memory_gib=None)).encode(), ":5: host 'a' device 'V100': missing memory_gib"),
    ("memory-huge", host(body=gpu(memory_gib="1e300")).encode(),
     ":5: host 'a' device 'V100': memory_gib = 1e+300 is implausibly large (limit 1,048,576)"),
    ("memory-tiny", host(body=gpu(memory_gib="1e-300")).encode(),
     ":5: host 'a' device 'V100': memory_gib = 1e-300 is implausibly small (at least 0.001)"),
    ("tflops-nan", host(body=gpu(peak_tflops="nan")).encode(),
     ":5: host 'a' device 'V100': peak_tflops must be a finite number, got nan"),
    ("membw-inf", host(body=gpu(memory_bandwidth_gbs="inf")).encode(),
     ":5: host 'a' device 'V100': memory_bandwidth_gbs must be a finite number, got inf"),
    ("dup-type", host(body=GPU2 + "\n  " + GPU2 + "\n  interconnect { bandwidth_gbs: 10 }").encode(),
     ":6: host 'a' lists device type 'V100' twice (entries #1 and #2); give one entry with its count, "
     "or name different models differently"),
    ("no-interconnect", host(body=GPU2).encode(),
     ":1: host 'a' has 2 devices but no interconnect { kind: ... bandwidth_gbs: ... }"),
    ("interconnect-zero", host(body=GPU2 + "\n  interconnect {\n    kind: PCIE\n    bandwidth_gbs: 0\n  }").encode(),
     ":8: host 'a' interconnect: bandwidth_gbs must be positive, got 0"),
    ("latency-negative", host(body=GPU2 + "\n  interconnect { bandwidth_gbs: 10 latency_us: -1 }").encode(),
     ":6: host 'a' interconnect: latency_us must not be negative, got -1"),
    ("latency-huge", (host("a") + host("b", 2) + "fabric {\n bandwidth_gbps: 1\n latency_us: 1e12\n}\n").encode(),
     ":15: fabric: latency_us = 1e+12 is implausibly large (limit 1,000,000,000)"),
    ("link-unknown", (host("a") + host("b", 2) + 'link { a: "a" b: "c" bandwidth_gbps: 10 }\n').encode(),
     ":13: link #1: unknown host 'c'"),
    ("link-self", (host("a") + 'link { a: "a" b: "a" bandwidth_gbps: 10 }\n').encode(),
     ":7: link #1 connects host 'a' to itself"),
    ("link-dup", (host("a") + host("b", 2) + 'link { a: "a" b: "b" bandwidth_gbps: 10 }\n'
                  'link { a: "b" b: "a" bandwidth_gbps: 10 }\n').encode(),
     ":14: duplicate link between 'b' and 'a' (first on line 13)"),
    ("link-missing-b", (host("a") + host("b", 2) + 'link { a: "a" bandwidth_gbps: 10 }\n').encode(),
     ":13: link #1: missing b (a host name)"),
    ("link-zero-bw", (host("a") + host("b", 2) + 'link { a: "a" b: "b" bandwidth_gbps: 0 }\n').encode(),
     ":13: link a - b: bandwidth_gbps must be positive, got 0"),
    ("no-fabric", (host("a") + host("b", 2)).encode(),
     ":7: hosts 'a' and 'b' have no link and there is no fabric { bandwidth_gbps: ... } to connect them"),
    ("fabric-no-bw", (host("a") + host("b", 2) + "fabric { latency_us: 5 }\n").encode(),
     ":13: fabric: missing bandwidth_gbps"),
    ("too-many-devices", (host("a", 1, gpu(count=4000)) + host("b", 2, gpu(count=200)) + FABRIC).encode(),
     ":11: the cluster has more than 4096 devices, tag's limit"),
    ("deep-nesting", b"host { " * 50000,
     ":1: unknown field 'host' in Host (its fields: name, address, port, device, interconnect)"),
    ("deep-brackets", b"{" * 50000,
     ':1: Expected identifier or number, got {. -- this looks like JSON, but topology files are protobuf text format: '
     'host { name: "a" ... }'),
    ("garbage-bytes", bytes(range(256)) * 8000, ":2: not UTF-8 text (byte 0x80 at offset 128); is this a binary file?"),
    ("cluster-name-newline", b'name: "a\\nb"\n' + host().encode(),
     ":1: cluster name must be printable text of at most 200 characters"),
]


@pytest.mark.parametrize("content, expected", [(c, e) for _, c, e in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_malformed_file_gives_one_line_error(tmp_path, content, expected):
    path = tmp_path / "cluster.pbtxt"
    path.write_bytes(content)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value) == f"{path}{expected}"
    assert "\n" not in str(info.value)


def test_megabytes_of_text_garbage_is_a_short_error(tmp_path):
    path = tmp_path / "garbage.pbtxt"
    path.write_text("x" * 1_500_000)
    start = time.perf_counter()
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: unknown field 'xxxxxxxx") and len(message) < len(str(path)) + 200
    assert time.perf_counter() - start < 5


def test_file_over_the_size_limit(tmp_path):
    path = tmp_path / "big.pbtxt"
    path.write_bytes(b"# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(TopologyError, match=r"big\.pbtxt: file too large \(over 2 MiB\)"):
        load_topology(path)


def test_missing_path_and_directory(tmp_path):
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path / "nope.pbtxt")
    assert str(info.value) == f"{tmp_path / 'nope.pbtxt'}: no such file"
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a topology file"


def test_public_name_and_error_type():
    assert tag.load_topology is load_topology
    assert issubclass(tag.TopologyError, tag.TagError)
    with pytest.raises(tag.TopologyError):
        tag.load_topology(os.path.join(TOPOLOGIES, "does-not-exist.pbtxt"))


# ------------------------------------------------------------------------------------------------
# A small cluster checked by hand

SMALL = """\
# small: three hosts for a hand-checked matrix
name: "small"
host {
  name: "g"
  address: "10.0.0.1"
  port: 2222
  device { type: "V100" kind: GPU count: 2 memory_gib: 16 peak_tflops: 15.7 memory_bandwidth_gbs: 900 }
  device { type: "CPU" kind: CPU memory_gib: 64 peak_tflops: 1 memory_bandwidth_gbs: 100 }
  device { type: "P100" kind: GPU memory_gib: 0.5 peak_tflops: 9.3 memory_bandwidth_gbs: 732 }
  interconnect { kind: PCIE bandwidth_gbs: 16 latency_us: 5 }
}
host {
  name: "h"
  address: "h.example.org"
  port: 2223
  device { type: "T4" kind: GPU memory_gib: 16 peak_tflops: 8.1 memory_bandwidth_gbs: 320 }
}
host {
  name: "i"
  address: "::1"
  port: 2224
  device { type: "T4" kind: GPU memory_gib: 16 peak_tflops: 8.1 memory_bandwidth_gbs: 320 }
}
link { a: "h" b: "g" bandwidth_gbps: 8 latency_us: 30 }
fabric { bandwidth_gbps: 80 latency_us: 100 }
"""


@pytest.fixture()
def small(tmp_path) -> Topology:
    path = tmp_path / "small.pbtxt"
    path.write_text(SMALL)
    return load_topology(path)


def test_small_cluster_structure(small):
    assert small.name == "small" and small.comment == "small: three hosts for a hand-checked matrix"
    assert [h.name for h in small.hosts] == ["g", "h", "i"]
    assert [h.task_index for h in small.hosts] == [0, 1, 2]
    assert [g.name for g in small.groups] == ["g/V100", "g/CPU", "g/P100", "h/T4", "i/T4"]
    assert [g.devices for g in small.groups] == [(0, 1), (2,), (3,), (4,), (5,)]
    assert [d.name for d in small.devices] == ["g/V100:0", "g/V100:1", "g/CPU:0", "g/P100:0", "h/T4:0", "i/T4:0"]
    assert [d.group for d in small.devices] == [0, 0, 1, 2, 3, 4]
    assert [d.host_index for d in small.devices] == [0, 0, 0, 0, 1, 2]
    # TF local indices count per host per TF device type: the P100 is the host's third GPU.
    assert [small.tf_device(i) for i in range(6)] == [
        "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1", "/job:worker/task:0/device:CPU:0",
        "/job:worker/task:0/device:GPU:2", "/job:worker/task:1/device:GPU:0", "/job:worker/task:2/device:GPU:0"]
    assert small.cluster_spec() == {"worker": ["10.0.0.1:2222", "h.example.org:2223", "[::1]:2224"]}


def test_small_cluster_units(small):
    v100, p100 = small.groups[0], small.groups[2]
    assert v100.memory_bytes == 16 * 2**30 and p100.memory_bytes == 2**29
    assert v100.peak_flops == pytest.approx(15.7e12) and v100.memory_bandwidth == pytest.approx(900e9)
    assert small.devices[3].peak_flops == pytest.approx(9.3e12)
    g, h, i = small.hosts
    assert g.intra_bandwidth == pytest.approx(16e9) and g.intra_latency == pytest.approx(5e-6)
    assert h.intra_bandwidth == np.inf and h.intra_latency == 0.0   # one device: nothing inside the host
    assert small.extra["interconnect"] == {"g": "PCIE"}
    assert small.extra["fabric"]["bandwidth"] == pytest.approx(10e9)


def test_small_cluster_matrices_by_hand(small):
    inf = np.inf
    pcie, link, fab = 16e9, 1e9, 10e9          # 16 GB/s; 8 Gbit/s = 1 GB/s; 80 Gbit/s = 10 GB/s
    expected_bw = np.array([
        [inf, pcie, pcie, pcie, link, fab],
        [pcie, inf, pcie, pcie, link, fab],
        [pcie, pcie, inf, pcie, link, fab],
        [pcie, pcie, pcie, inf, link, fab],
        [link, link, link, link, inf, fab],
        [fab, fab, fab, fab, fab, inf],
    ])
    np.testing.assert_allclose(small.bandwidth, expected_bw)
    pl, ll, fl = 5e-6, 30e-6, 100e-6
    expected_lat = np.array([
        [0, pl, pl, pl, ll, fl],
        [pl, 0, pl, pl, ll, fl],
        [pl, pl, 0, pl, ll, fl],
        [pl, pl, pl, 0, ll, fl],
        [ll, ll, ll, ll, 0, fl],
        [fl, fl, fl, fl, fl, 0],
    ])
    np.testing.assert_allclose(small.latency, expected_lat)
    np.testing.assert_allclose(small.host_bandwidth, [[inf, link, fab], [link, inf, fab], [fab, fab, inf]])
    np.testing.assert_allclose(small.host_latency, [[0, ll, fl], [ll, 0, fl], [fl, fl, 0]])


def test_alternative_text_syntax_keeps_lines(tmp_path):
    """List syntax, angle brackets and separators parse, and semantic errors still find their line."""
    text = (
        'host: [\n'
        '  { name: "a" address: "127.0.0.1" port: 1; ' + CPU + ' },\n'
        '  < name: "b" address: "127.0.0.1" port: 2, ' + CPU + ' >\n'
        ']\n'
        'link < a: "a" b: "b" bandwidth_gbps: 1 >\n'
    )
    topo = parse_topology(text, "x.pbtxt")
    assert [h.name for h in topo.hosts] == ["a", "b"] and topo.bandwidth[0, 1] == pytest.approx(0.125e9)
    bad = text.replace("port: 2", "port: 1")
    with pytest.raises(TopologyError, match=r"^x\.pbtxt:3: host 'b': 127\.0\.0\.1:1 is already"):
        parse_topology(bad, "x.pbtxt")


def test_addresses_accepted():
    for address, shown in [("localhost", "localhost"), ("gpu-node-2", "gpu-node-2"), ("10.1.2.3", "10.1.2.3"),
                           ("fe80::1", "[fe80::1]"), ("[::1]", "[::1]"), ("n1.cluster.local", "n1.cluster.local")]:
        topo = parse_topology(host(address=address))
        assert topo.hosts[0].address == shown


def test_defaults_count_one_latency_zero_name_from_file(tmp_path):
    path = tmp_path / "my-lab.pbtxt"
    path.write_text(host(body=CPU) + "\n")
    topo = load_topology(path)
    assert topo.name == "my-lab" and topo.num_devices == 1 and topo.latency[0, 0] == 0


# ------------------------------------------------------------------------------------------------
# Ready files

READY = {
    "localhost.pbtxt": (3, 3),
    "lab-v100-1080ti.pbtxt": (4, 16),
    "a100-8x-nvlink.pbtxt": (1, 8),
    "h100-2x8-infiniband.pbtxt": (2, 16),
    "cloud-slow-link.pbtxt": (4, 28),
    "consumer-lab-4host.pbtxt": (4, 7),
    "fabric-64x8.pbtxt": (64, 512),
    "fabric-128x8.pbtxt": (128, 1024),
}


@pytest.mark.parametrize("name", sorted(READY))
def test_ready_file_loads(name):
    topo = load_topology(os.path.join(TOPOLOGIES, name))
    hosts, devices = READY[name]
    assert (len(topo.hosts), topo.num_devices) == (hosts, devices)
    assert topo.name == name[: -len(".pbtxt")]
    assert len(topo.comment.splitlines()) >= 3, "each ready file opens with a comment saying what it models"
    n = topo.num_devices
    assert topo.bandwidth.shape == topo.latency.shape == (n, n)
    off = ~np.eye(n, dtype=bool)
    assert np.all(np.isfinite(topo.bandwidth[off])) and np.all(topo.bandwidth[off] > 0)
    assert np.all(np.isinf(np.diag(topo.bandwidth))) and np.all(np.diag(topo.latency) == 0)
    assert np.array_equal(topo.bandwidth, topo.bandwidth.T) and np.array_equal(topo.latency, topo.latency.T)
    assert np.all(topo.latency[off] >= 0)


def test_ready_files_are_all_listed():
    assert sorted(f for f in os.listdir(TOPOLOGIES) if f.endswith(".pbtxt")) == sorted(READY)


def test_localhost_file_matches_the_test_servers():
    topo = load_topology(os.path.join(TOPOLOGIES, "localhost.pbtxt"))
    assert topo.cluster_spec() == {"worker": ["127.0.0.1:0"] * 3}      # free ports, chosen at each start
    assert topo.free_port_hosts == ["cpu0", "cpu1", "cpu2"]
    assert [h.name for h in topo.hosts] == ["cpu0", "cpu1", "cpu2"]
    assert {d.tf_device_type for d in topo.devices} == {"CPU"}
    assert topo.bandwidth[0, 1] == pytest.approx(10e9 / 8)


def test_ready_file_numbers():
    """Spot checks of the spec-sheet numbers after unit conversion."""
    h100 = load_topology(os.path.join(TOPOLOGIES, "h100-2x8-infiniband.pbtxt"))
    assert h100.groups[0].peak_flops == pytest.approx(67e12) and h100.groups[0].memory_bytes == 80 * 2**30
    assert h100.bandwidth[0, 1] == pytest.approx(450e9)      # NVLink 4, one direction
    assert h100.bandwidth[0, 8] == pytest.approx(400e9 / 8)  # NDR 400 Gbit/s
    cloud = load_topology(os.path.join(TOPOLOGIES, "cloud-slow-link.pbtxt"))
    slow = [h.name for h in cloud.hosts].index("t4-remote")
    others = [i for i in range(len(cloud.hosts)) if i != slow]
    assert np.allclose(cloud.host_bandwidth[slow, others], 10e9 / 8)
    assert cloud.host_bandwidth[others[0], others[1]] > 10e9 / 8


def test_fabric_64x8_loads_fast():
    path = os.path.join(TOPOLOGIES, "fabric-64x8.pbtxt")
    load_topology(path)  # warm up imports
    start = time.perf_counter()
    topo = load_topology(path)
    elapsed = time.perf_counter() - start
    assert topo.num_devices == 512 and len(topo.groups) == 64
    assert elapsed < 1.0, f"loading 512 devices took {elapsed:.2f} s"
    same_host = topo.bandwidth[0, 7]
    other_host = topo.bandwidth[0, 8]
    assert same_host == pytest.approx(300e9) and other_host == pytest.approx(200e9 / 8)


# ------------------------------------------------------------------------------------------------
# Generated code is never stale


def test_generated_module_matches_the_proto(tmp_path):
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"-I{include}", f"--python_out={tmp_path}",
         "topology.proto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    from tag._proto import topology_pb2

    assert filecmp.cmp(tmp_path / "topology_pb2.py", topology_pb2.__file__, shallow=False), (
        "tag/_proto/topology_pb2.py is stale: run `pip install -e . --no-deps` to regenerate it")


# ------------------------------------------------------------------------------------------------
# Any input: a Topology or a TopologyError, nothing else

VALID = open(os.path.join(TOPOLOGIES, "lab-v100-1080ti.pbtxt"), encoding="utf-8").read()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_files_never_raise_anything_else(data):
    text = VALID
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 12))
        insert = data.draw(st.sampled_from(["", "{", "}", "<", '"', "-", "0", "1e999", "nan", " x ", ":", "[",
                                            "\\", "'", "#", "\n", "port: 7", "host {", "9" * 30, "\u00e9"]))
        text = text[:pos] + insert + text[pos + cut:]
    try:
        topo = parse_topology(text, "m.pbtxt")
    except TopologyError as err:
        message = str(err)
        assert message.startswith("m.pbtxt") and "\n" not in message
    else:
        assert topo.num_devices >= 1


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_else(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("fuzz") / "f.pbtxt"
    path.write_bytes(content)
    try:
        load_topology(path)
    except TopologyError as err:
        assert str(err).startswith(str(path)) and "\n" not in str(err)


def test_tensor_core_peaks_are_optional_declared_or_from_the_shipped_class(tmp_path):
    from tag.cost.precision import device_peak
    plain = parse_topology(host(body=gpu(type='"A100-40G"', peak_tflops=19.5)))
    g = plain.groups[0]
    assert g.declared_peaks == () and g.declared_peak("fp32") == pytest.approx(19.5e12)
    # a file naming only the type and its FP32 peak gets the A100 spec sheet's ratios
    assert [device_peak(g, p) / 1e12 for p in ("tf32", "fp16", "bf16")] == pytest.approx([156, 312, 312])
    declared = parse_topology(host(body=gpu(type='"A100-40G"', peak_tflops=19.5, peak_fp16_tflops=250)))
    assert device_peak(declared.groups[0], "fp16") == pytest.approx(250e12)
    assert device_peak(declared.groups[0], "tf32") == pytest.approx(156e12)
    # no tensor cores (V100 in BF16) or an unknown GPU / a CPU: the FP32 peak
    v100 = parse_topology(host(body=gpu())).groups[0]
    assert device_peak(v100, "bf16") == pytest.approx(15.7e12) and device_peak(v100, "fp16") == pytest.approx(125e12)
    cpu = parse_topology(host()).groups[0]
    assert device_peak(cpu, "fp16") == pytest.approx(0.05e12)
    path = tmp_path / "bad.pbtxt"
    path.write_text(host(body=gpu(peak_bf16_tflops=-3)))
    with pytest.raises(TopologyError, match=r"bad\.pbtxt:5: host 'a' device 'V100': peak_bf16_tflops must be positive"):
        load_topology(path)


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_port_zero_is_a_free_port_on_loopback_hosts(address):
    topo = parse_topology(host("a", 0, address=address) + host("b", 0, address=address)
                          + "fabric { bandwidth_gbps: 10 latency_us: 20 }\n")
    assert topo.free_port_hosts == ["a", "b"]          # two port-0 hosts on one address are not a duplicate
    started = topo.with_ports({"a": 4101, "b": 4102})
    assert [h.port for h in started.hosts] == [4101, 4102] and started.free_port_hosts == []
    assert [h.port for h in topo.hosts] == [0, 0]      # the topology itself is left as read
    assert parse_topology(format_topology(topo)).free_port_hosts == ["a", "b"]
