"""The README's Python snippets run as printed: the TF1, Keras and own-data quick starts, in order, in one fresh
Python process (the own-data snippet continues the TF1 one), from a folder holding a copy of ``topologies/``
whose loopback cluster is on free ports (the shipped file's fixed ports may be taken on a shared machine)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
RUN_TIMEOUT_S = 540                      # inside pytest's 600 s per test


def python_snippets(path: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of PATH."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_the_readme_has_the_three_quick_starts():
    codes = [code for _, code in python_snippets(os.path.join(REPO, "README.md"))]
    assert len(codes) >= 3
    assert any("tag.optimize(graph" in c for c in codes)                          # TF1
    assert any("tag.fit(" in c for c in codes)                                    # Keras
    assert any("tag.train(" in c and "dataset_fn" in c for c in codes)            # own data
    keras = next(c for c in codes if "tag.fit(" in c)
    assert len(keras.strip().splitlines()) <= 10


@pytest.mark.slow
def test_every_readme_python_snippet_runs(tmp_path):
    from tag.backend.runtime import free_ports
    snippets = python_snippets(os.path.join(REPO, "README.md"))
    shutil.copytree(os.path.join(REPO, "topologies"), tmp_path / "topologies")
    local = tmp_path / "topologies" / "localhost.pbtxt"
    text = local.read_text()
    for old, new in zip(("23451", "23452", "23453"), free_ports(3), strict=True):
        text = text.replace(f"port: {old}", f"port: {new}")
    local.write_text(text)
    runner = ["import sys", "namespace = {'__name__': '__main__'}"]
    for line, code in snippets:
        runner += [f"exec(compile({code!r}, 'README.md:{line}', 'exec'), namespace)",
                   f"print('README.md:{line} ran', flush=True)"]
    (tmp_path / "run_readme.py").write_text("\n".join(runner) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "run_readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    ran = re.findall(r"^(README\.md:\d+) ran$", done.stdout, re.M)
    assert done.returncode == 0, f"ran {ran}; then:\n{done.stderr[-3000:]}"
    assert ran == [f"README.md:{line}" for line, _ in snippets]
