"""tag.files: user files are read with limits and refused when special; outputs are written atomically."""
import os

import pytest

from tag.errors import GraphError, TagError
from tag.files import read_input_file, write_atomic


def test_reads_a_regular_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello")
    assert read_input_file(f, what="thing", limit=10) == b"hello"


def test_refuses_a_named_pipe_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(GraphError, match=r"pipe: not a regular file \(a pipe or device\), not a GraphDef file"):
        read_input_file(fifo, what="GraphDef file", limit=10, error=GraphError)


@pytest.mark.parametrize("kind", ["missing", "directory", "large", "device"])
def test_one_line_errors_start_with_the_path(tmp_path, kind):
    path = {"missing": tmp_path / "none", "directory": tmp_path, "large": tmp_path / "big",
            "device": "/dev/zero"}[kind]
    if kind == "large":
        path.write_bytes(b"x" * 100)
    with pytest.raises(TagError) as info:
        read_input_file(path, what="topology file", limit=10)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message


def test_atomic_write_replaces_or_leaves_nothing(tmp_path):
    target = tmp_path / "report.json"
    write_atomic(target, "{}\n")
    write_atomic(target, b"[1]\n")
    assert target.read_text() == "[1]\n"
    with pytest.raises(TagError, match="no-such-dir/r.json: cannot write") as info:
        write_atomic(tmp_path / "no-such-dir" / "r.json", "x")
    assert ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
