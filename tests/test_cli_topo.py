"""tag-topo: validate and show, exit codes and one-line errors."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from tag.cli.topo import format_topology, main
from tag.cluster.topology import load_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = sorted(glob.glob(os.path.join(ROOT, "topologies", "*.pbtxt")))
LAB = os.path.join(ROOT, "topologies", "lab-v100-1080ti.pbtxt")

GOOD = """\
host { name: "a" address: "127.0.0.1" port: 1
  device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 } }
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tag.cli.topo", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_subprocess_validate_ready_files_exit_0():
    result = _run("validate", *READY)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(READY) >= 7
    assert f"{os.path.join(ROOT, 'topologies', 'fabric-64x8.pbtxt')}: ok (64 hosts, 512 devices)" in lines
    assert result.stderr == ""


def test_subprocess_bad_files_exit_2_one_line_each(tmp_path):
    binary = tmp_path / "model.pb"
    binary.write_bytes(b"\x08\x96\x01\xff\xfe" * 100)
    typo = tmp_path / "typo.pbtxt"
    typo.write_text('host {\n  nam: "a"\n}\n')
    result = _run("validate", str(binary), LAB, str(typo), str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"{binary}:1: not UTF-8 text (byte 0x96 at offset 1); is this a binary file?",
        f"{typo}:2: unknown field 'nam' in Host (its fields: name, address, port, device, interconnect)",
        f"{tmp_path}: is a directory, not a topology file",
    ]
    assert result.stdout.splitlines() == [f"{LAB}: ok (4 hosts, 16 devices)"]
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("tag-topo") is None, reason="console script not installed")
def test_console_script():
    result = subprocess.run(["tag-topo", "show", LAB], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "v100-0/V100" in result.stdout


def test_validate_in_process(capsys, tmp_path):
    good = tmp_path / "good.pbtxt"
    good.write_text(GOOD)
    assert main(["validate", str(good)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{good}: ok (1 hosts, 1 devices)\n" and err == ""


@pytest.mark.parametrize("content, message", [
    (b"", ": empty file: expected a cluster in protobuf text format (host { ... })"),
    (b'{"host": []}\n', ":1: Expected identifier or number, got {. -- this looks like JSON, but topology files are "
                        'protobuf text format: host { name: "a" ... }'),
    (b"cluster:\n  hosts:\n    - name: a\n", ":1: unknown field 'cluster' in Cluster (its fields: name, host, link, "
                                             "fabric) -- this looks like YAML, but topology files are protobuf text "
                                             'format: host { name: "a" ... }'),
    (GOOD.replace("port: 1", "port: 65536").encode(),
     ":1: host 'a': port must be in 1..65535 (or 0 on a loopback host), got 65536"),
    (GOOD.replace("memory_gib: 2", "memory_gib: nan").encode(),
     ":2: host 'a' device 'CPU': memory_gib must be a finite number, got nan"),
    (b"host { " * 20000, ":1: unknown field 'host' in Host (its fields: name, address, port, device, interconnect)"),
])
def test_validate_bad_input_in_process(capsys, tmp_path, content, message):
    path = tmp_path / "bad.pbtxt"
    path.write_bytes(content)
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"{path}{message}\n"


def test_validate_missing_path(capsys, tmp_path):
    assert main(["validate", str(tmp_path / "none.pbtxt")]) == 2
    assert capsys.readouterr().err == f"{tmp_path / 'none.pbtxt'}: no such file\n"


def test_show_lab(capsys):
    assert main(["show", LAB]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"cluster lab-v100-1080ti ({LAB}): 4 hosts, 4 device groups, 16 devices"
    assert "hosts" in lines and "device groups" in lines and "links" in lines
    row = next(line for line in lines if "v100-0/V100" in line).split()
    assert row[:8] == ["0", "v100-0/V100", "GPU", "4", "32", "GiB", "15.7", "900"]
    assert any(line.split()[:3] == ["0", "v100-0", "10.0.1.10:2222"] and "NVLINK 50 GB/s" in line for line in lines)
    assert any(line.split() == ["v100-0", "p100-0", "25", "Gbit/s", "30", "us"] for line in lines)
    assert lines[-1] == "fabric: 10 Gbit/s, 50 us (every host pair without a link)"


def test_show_single_host_and_fabric_only():
    a100 = format_topology(load_topology(os.path.join(ROOT, "topologies", "a100-8x-nvlink.pbtxt")))
    assert a100.splitlines()[-1] == "fabric: none (single host)" and "\nlinks" not in a100
    big = format_topology(load_topology(os.path.join(ROOT, "topologies", "fabric-64x8.pbtxt")))
    assert sum(1 for line in big.splitlines() if "/A100-40G " in line) == 64
    assert big.splitlines()[-1] == "fabric: 200 Gbit/s, 5 us (every host pair without a link)"


def test_show_bad_file_exit_2(capsys, tmp_path):
    path = tmp_path / "bad.pbtxt"
    path.write_text("host {")
    assert main(["show", str(path)]) == 2
    assert capsys.readouterr().err == f'tag-topo: error: {path}:1: Expected "}}".\n'


@pytest.mark.parametrize("argv", [[], ["validate"], ["frobnicate", "x"], ["show"]])
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tag-topo: error: ") and err.count("\n") == 1 and "usage:" not in err
