"""Every import between a project's modules, read from the source, and the checks of ``test_layers``.

``read_imports`` parses each ``.py`` file of the given packages (nothing is imported or run) and records
every import statement wherever it sits: at module level, inside a function, under ``if TYPE_CHECKING:``;
absolute or relative; ``import a.b.c``, ``from a.b import c`` (c a module: the edge goes to ``a.b.c``) and
``from a.b import name`` (the edge goes to ``a.b``, the package's ``__init__``). Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``; those implicit edges are not recorded (a package always sits on
its own submodules' path, so counting them would make every package a circle with its submodules).

``check`` holds the imports against an ORDER of units, lowest first. A unit is a package or a module, as a
dotted name; it stands for every module beneath it, except that a unit with finer units inside it (the
package root ``tag``, ``tag.backend``) stands for its own ``__init__`` only, so a new package is named in
the order or the check fails. Problems found, each naming ``file:line``:

- an import from a unit to a higher one;
- a module that no unit of the order covers;
- a circle among modules (a strongly connected set of the module graph, every import counted).

Example::

    from import_graph import check, read_imports
    imports, modules = read_imports(repo_root, ["tag", "tag_bench"], exempt=["tag._proto"])
    problems = check(imports, modules, ["tag.errors", "tag.ir", ..., "tag"])   # [] when clean
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Import:
    """One import statement's edge: module SOURCE (file PATH, LINE) imports module TARGET."""

    source: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(root: Path, path: Path) -> str:
    """The dotted module name of PATH (a .py file under ROOT): ``pkg/sub/__init__.py`` is ``pkg.sub``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def read_imports(root: Path, packages: Iterable[str], exempt: Sequence[str] = ()) -> tuple[list[Import], set[str]]:
    """(every import between modules of PACKAGES, the modules scanned): each package a directory under ROOT;
    modules within EXEMPT (generated code) are not scanned but may be imported. Imports of anything outside
    PACKAGES (the standard library, TensorFlow) are left out."""
    root = Path(root)
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            files[module_name(root, path)] = path
    known = set(files)
    scanned = {m for m in files if not any(_within(m, e) for e in exempt)}
    ours = tuple(packages)
    imports: list[Import] = []
    for source in sorted(scanned):
        path = files[source]
        is_package = path.name == "__init__.py"
        here = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=here)):
            for target in _targets(node, source, is_package, known):
                if any(_within(target, p) for p in ours) and target != source:
                    imports.append(Import(source, target, here, node.lineno))
    return imports, scanned


def _targets(node: ast.AST, source: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules one AST NODE of module SOURCE imports (none for a node that is not an import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:     # relative: level 1 is the package SOURCE belongs to (itself, for an __init__)
        package = source.split(".") if is_package else source.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    names = [a.name for a in node.names if f"{base}.{a.name}" not in known]
    return submodules + ([base] if names or not submodules else [])


def unit_of(module: str, order: Sequence[str]) -> str | None:
    """The unit of ORDER that covers MODULE (the longest that does), or None: a unit with finer units inside
    it covers only its own module."""
    best = None
    for unit in order:
        if module == unit or (_within(module, unit)
                              and not any(_within(other, unit) and other != unit for other in order)):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def check(imports: Sequence[Import], modules: Iterable[str], order: Sequence[str]) -> list[str]:
    """What is wrong with IMPORTS under ORDER (lowest unit first): missing units, imports up the order,
    circles (module docstring); one line each, [] when nothing is."""
    rank = {unit: i for i, unit in enumerate(order)}
    problems = [f"{m}: no unit of the order covers this module; add its package to the order"
                for m in sorted(modules) if unit_of(m, order) is None]
    for imp in imports:
        mine, theirs = unit_of(imp.source, order), unit_of(imp.target, order)
        if mine is None or theirs is None:
            if theirs is None and imp.target not in modules:
                problems.append(f"{imp.where()}: {imp.source} imports {imp.target}, which no unit covers")
            continue
        if rank[theirs] > rank[mine]:
            problems.append(f"{imp.where()}: {imp.source} ({mine}) imports {imp.target} ({theirs}), "
                            f"a higher unit")
    problems.extend(circles(imports))
    return problems


def circles(imports: Sequence[Import]) -> list[str]:
    """One line per circle of the module graph (a strongly connected set of two or more modules), naming
    every import inside it."""
    edges: dict[str, list[Import]] = {}
    for imp in imports:
        edges.setdefault(imp.source, []).append(imp)
    out = []
    for component in _strongly_connected(edges):
        inside = sorted((imp for m in component for imp in edges.get(m, []) if imp.target in component),
                        key=lambda imp: (imp.path, imp.line))
        out.append(f"circle among {', '.join(sorted(component))}: "
                   + "; ".join(f"{imp.where()} {imp.source} -> {imp.target}" for imp in inside))
    return out


def _strongly_connected(edges: dict[str, list[Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of two or more nodes (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    nodes = sorted(set(edges) | {imp.target for imps in edges.values() for imp in imps})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted({imp.target for imp in edges.get(start, [])})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted({imp.target for imp in edges.get(nxt, [])}))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found
