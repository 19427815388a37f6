"""The documentation stays readable: README and ARCHITECTURE.md within their line budgets, no prose line over 120
characters in either (tables and code blocks excepted), and every relative link in README.md, ARCHITECTURE.md
and docs/**/*.md pointing at a file that exists."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS = ["README.md", "ARCHITECTURE.md", *sorted(os.path.relpath(p, REPO) for p in
                                             glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]


def read(name: str) -> list[str]:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read().split("\n")


def outside_code(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


def prose(lines: list[str]) -> list[tuple[int, str]]:
    """The lines outside code blocks that are not table rows."""
    return [(i, line) for i, line in outside_code(lines) if not line.lstrip().startswith("|")]


@pytest.mark.parametrize("name, most", [("README.md", 400), ("ARCHITECTURE.md", 300)])
def test_line_budget(name, most):
    assert len(read(name)) <= most


@pytest.mark.parametrize("name", ["README.md", "ARCHITECTURE.md"])
def test_no_prose_line_over_120_characters(name):
    long = [f"{name}:{i}: {len(line)} characters" for i, line in prose(read(name)) if len(line) > 120]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("name", DOCS)
def test_relative_links_point_at_files(name):
    missing = []
    for i, line in outside_code(read(name)):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue                                       # a URL or an anchor in the same page
            path = os.path.normpath(os.path.join(REPO, os.path.dirname(name), target.split("#")[0]))
            if not os.path.exists(path):
                missing.append(f"{name}:{i}: {target}")
    assert not missing, "\n".join(missing)
