"""Import layers: every module of ``tag`` and ``tag_bench`` imports only its own unit and the units below it
in ``ORDER``, and no modules import each other in a circle (``import_graph``: every import counted, those
inside functions and under ``TYPE_CHECKING`` too)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from import_graph import Import, check, read_imports

ROOT = Path(__file__).resolve().parents[1]

#: the units, lowest first, each with why it sits above the ones before it
ORDER: list[tuple[str, str]] = [
    ("tag.errors", "the exceptions every layer raises; imports nothing"),
    ("tag.files", "safe reading and writing of every layer's input and output files, strict JSON; raises tag.errors"),
    ("tag.cuda_noise", "TensorFlow's first device lookup without its meaningless CUDA start-up error line, for "
                       "every layer that opens a session; imports nothing of tag"),
    ("tag._proto", "generated protobuf classes of the topology and strategy file formats (not scanned)"),
    ("tag.ir", "the training step as plain data (ops, tensors, variables); imports nothing of tag"),
    ("tag.cluster", "the topology (hosts, devices, links), read through tag.files and the topology proto"),
    ("tag.cost", "what an op or a transfer costs: ops of the IR on devices of the cluster"),
    ("tag.frontend", "TensorFlow GraphDef -> IR; names precisions as the cost model does (tag.cost.precision)"),
    ("tag.strategy", "what to do with each op group (grouping, actions, pipelines, which gradients may be summed as "
                     "tables or sent as sufficient factors); groups ops by their cost; saved as the strategy proto"),
    ("tag.sim", "predicts a strategy's step time and memory with the cost model"),
    ("tag.search", "searches strategies by simulating them"),
    ("tag.compress", "picks, after the search, the eligible gradients that travel as sufficient factors: a MILP "
                     "confirmed by the simulator"),
    ("tag.gnn", "the tree search's learned prior (tag.search.mcts), trained on zoo graphs from the frontend"),
    ("tag.options", "the search's and the tuning step's settings, checked once against the search's orders and "
                    "default margins"),
    ("tag.backend", "the backend package's own __init__ (a docstring); its parts, rewrite and runtime, are units"),
    ("tag.backend.rewrite", "rewrites the GraphDef for a strategy; reads the frontend's batch axes"),
    ("tag.backend.runtime", "runs graphs on TensorFlow servers and writes TensorBoard files; measures a strategy by "
                            "rewriting the graph for it"),
    ("tag.calibration", "fits cost profiles by running graphs through the runtime (so not inside tag.cost)"),
    ("tag.training", "tag.train: trains a plan's graph on a cluster through the runtime"),
    ("tag.report", "the plan report and its tables: simulated results beside the runtime's measured runs"),
    ("tag.plan", "a Plan made for a given strategy (analysis, simulation, report, rewritten graph), saved and "
                 "loaded"),
    ("tag.tune", "measures a plan's candidates through the runtime and keeps the fastest as a Plan"),
    ("tag.api", "tag.optimize, search_plan and tag.rewrite: prepare, search, SFB, buckets and tuning with one "
                "SearchOptions, ending in a Plan"),
    ("tag.keras", "tag.fit: a tf_keras model's step (tag.frontend.keras) planned by tag.api and trained by "
                  "tag.training, the weights written back; a library call, so below the command lines"),
    ("tag.cli", "the command lines, on top of the library"),
    ("tag", "the package root names every layer's public entry points (loaded lazily by name on first use); "
            "its own imports are tag.errors only"),
    ("tag_bench", "the benchmark harness (testbeds, MWMS baselines), built on all of tag"),
]
UNITS = [unit for unit, _ in ORDER]
PACKAGES = ["tag", "tag_bench"]
EXEMPT = ["tag._proto"]       # generated: not scanned, may be imported


def _project_imports() -> tuple[list[Import], set[str]]:
    return read_imports(ROOT, [p for p in PACKAGES if (ROOT / p).is_dir()], exempt=EXEMPT)


def test_no_import_runs_up_the_layers_or_closes_a_circle():
    imports, modules = _project_imports()
    problems = check(imports, modules, UNITS)
    assert not problems, "\n".join([f"{len(problems)} import problems:", *problems])
    assert len(imports) > 500           # the reader sees the project's imports (about 640 when written)
    assert sorted({i.target for i in imports if i.source == "tag"}) == ["tag.errors"]


def test_a_new_upward_import_or_circle_in_the_project_fails():
    imports, modules = _project_imports()
    upward = Import("tag.cost.model", "tag.api", "tag/cost/model.py", 1)
    back = Import("tag.api", "tag.cost.model", "tag/api.py", 1)
    problems = check([*imports, upward, back], modules, UNITS)
    assert any(p.startswith("tag/cost/model.py:1: tag.cost.model (tag.cost) imports tag.api (tag.api)")
               for p in problems)
    assert any(p.startswith("circle among") and "tag.api" in p and "tag.cost.model" in p for p in problems)


def test_every_unit_has_a_reason_and_appears_once():
    assert len(set(UNITS)) == len(UNITS)
    assert all(reason.strip() for _, reason in ORDER)


# ------------------------------------------------------------------------------------------------ the checker
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def _problems(tmp_path: Path, files: dict[str, str], order: list[str]) -> list[str]:
    base = {"pkg/__init__.py": "", "pkg/low/__init__.py": "", "pkg/high/__init__.py": "",
            "pkg/low/a.py": "X = 1\n", "pkg/high/b.py": "from pkg.low.a import X\n"}
    root = _tree(tmp_path, {**base, **files})
    imports, modules = read_imports(root, ["pkg"])
    return check(imports, modules, order)


ORDER_LH = ["pkg.low", "pkg.high", "pkg"]


def test_checker_passes_a_clean_tree(tmp_path):
    assert _problems(tmp_path, {}, ORDER_LH) == []


def test_checker_finds_an_upward_import(tmp_path):
    problems = _problems(tmp_path, {"pkg/low/c.py": "import os\nimport pkg.high.b\n"}, ORDER_LH)
    assert len(problems) == 1 and problems[0].startswith("pkg/low/c.py:2: pkg.low.c (pkg.low) imports pkg.high.b")


def test_checker_finds_an_upward_import_inside_a_function(tmp_path):
    problems = _problems(tmp_path, {"pkg/low/c.py": """\
        def later():
            from ..high import b
            return b
        """}, ORDER_LH)
    assert len(problems) == 1 and problems[0].startswith("pkg/low/c.py:2: pkg.low.c (pkg.low) imports pkg.high.b")


def test_checker_finds_an_upward_import_under_type_checking(tmp_path):
    problems = _problems(tmp_path, {"pkg/low/c.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.high import b
        """}, ORDER_LH)
    assert len(problems) == 1 and problems[0].startswith("pkg/low/c.py:3:")


def test_checker_finds_a_circle_of_two_modules_in_one_unit(tmp_path):
    problems = _problems(tmp_path, {"pkg/low/a.py": "def f():\n    from pkg.low.c import Y\nX = 1\n",
                                    "pkg/low/c.py": "from pkg.low.a import X\nY = 2\n"}, ORDER_LH)
    assert len(problems) == 1
    assert problems[0].startswith("circle among pkg.low.a, pkg.low.c:")
    assert "pkg/low/a.py:2" in problems[0] and "pkg/low/c.py:1" in problems[0]


def test_checker_finds_a_module_outside_the_order(tmp_path):
    problems = _problems(tmp_path, {"pkg/other.py": "X = 3\n"}, ORDER_LH)
    assert problems == ["pkg.other: no unit of the order covers this module; add its package to the order"]


def test_checker_finds_an_import_of_the_package_root_from_below(tmp_path):
    problems = _problems(tmp_path, {"pkg/low/c.py": "def f():\n    import pkg\n    return pkg.high\n"}, ORDER_LH)
    assert len(problems) == 1 and "imports pkg (pkg), a higher unit" in problems[0]
