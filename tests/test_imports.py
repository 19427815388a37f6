"""Import boundaries: the core stages load without TensorFlow or DGL, and the public names resolve."""
import subprocess
import sys

CORE_MODULES = ["tag", "tag.ir", "tag.ir.algorithms", "tag.ir.op_types", "tag.cluster", "tag.cost", "tag.cost.model",
                "tag.strategy", "tag.sim", "tag.search", "tag.compress"]


def _fresh_interpreter(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_core_imports_neither_tensorflow_nor_dgl():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in CORE_MODULES)
            + "import tag\n"
            + "topo = tag.load_topology('topologies/localhost.pbtxt')\n"
            + "bad = [m for m in ('tensorflow', 'dgl', 'tf_keras') if m in sys.modules]\n"
            + "print(','.join(bad) or 'clean')\n")
    proc = _fresh_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "clean", f"core imports pulled in: {proc.stdout.strip()}"


def test_a_frontend_import_does_pull_tensorflow():
    """The check above can fail: importing the frontend does load TensorFlow."""
    proc = _fresh_interpreter("import sys, tag.frontend; print('tensorflow' in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


def test_public_names_resolve():
    import tag
    for name in ("load_topology", "parse_topology", "Topology", "analyze", "TrainingGraph", "zoo", "Strategy",
                 "Action", "TagError", "TopologyError", "GraphError", "StrategyError", "RewriteError",
                 "MemoryBudgetError", "OptionError", "SearchOptions", "Plan"):
        assert getattr(tag, name) is not None, name
