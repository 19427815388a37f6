"""What a benchmark's ``--json`` file records beside its figures, and writing it.

Every benchmark JSON has a top-level key ``provenance``: ``{"commit": short hash of the code measured, with
"+dirty" when tracked files differed from it, "command": the command line as run, "load_average": the 1-minute
load average at the start and at the end of the run ("1.02-1.87"), "date": ISO date of the start, "machine":
CPU model and core count}``. The commit and the start load are taken when the run starts (HEAD may move while a
long run goes on); the end load when the file is written (a run that saves after every row updates it).

Usage::

    from tag_bench.records import Run, write_json
    def main(argv=None) -> int:
        run = Run(__file__, argv)                           # at the start: commit, command, load now
        ...
        write_json(args.json, {"rows": rows}, run)          # {"provenance": {...}, "rows": [...]}
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

from tag.files import write_atomic
from tag_bench.machine import load1, machine_text

GIT_TIMEOUT_S = 10


def _git(args: list[str], cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                          check=True).stdout.strip()


def git_commit(where: str | None = None) -> str:
    """The short HEAD commit of the repository holding WHERE (a folder; default this package's), with "+dirty"
    when tracked files differ from it; "unknown" without git or outside a repository."""
    where = where or os.path.dirname(os.path.abspath(__file__))
    try:
        head = _git(["rev-parse", "--short", "HEAD"], where)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], where)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """``python SCRIPT ARGV...`` as a shell would take it: SCRIPT relative to its repository's root (or as given
    outside one), ARGV the arguments (default: this process's)."""
    path = os.path.abspath(script)
    try:
        path = os.path.relpath(path, _git(["rev-parse", "--show-toplevel"], os.path.dirname(path)))
    except (OSError, subprocess.SubprocessError):
        path = script
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", path, *args])


class Run:
    """One benchmark run, started now: the commit, the command and the load average at its start.

    ``provenance()`` is the JSON key at any later moment (the load average then as the end)."""

    def __init__(self, script: str, argv: Sequence[str] | None = None):
        self.commit = git_commit(os.path.dirname(os.path.abspath(script)))
        self.command = command_line(script, argv)
        self.load_start = load1()
        self.date = datetime.date.today().isoformat()
        self.machine = machine_text()

    def provenance(self) -> dict[str, str]:
        return {"commit": self.commit, "command": self.command,
                "load_average": f"{self.load_start:.2f}-{load1():.2f}", "date": self.date, "machine": self.machine}


def write_json(path: str | None, obj: dict[str, Any], run: Run, indent: int = 1) -> None:
    """Write OBJ as JSON to PATH with RUN's ``provenance`` first (a saved result's own, in OBJ, is kept), indented by
    INDENT, through a temporary file so a run stopped mid-write leaves the previous file; nothing when PATH is empty
    or None (no --json). A value JSON cannot hold is written as its text (an hour of measurement is not lost to a
    stray numpy type at the end)."""
    if path:
        write_atomic(path, json.dumps({"provenance": run.provenance(), **obj}, indent=indent, default=str) + "\n")


def commit_of(result: dict) -> str | None:
    """The commit a saved result was measured at: its ``provenance``'s, or the ``commit`` key of older results."""
    return (result.get("provenance") or {}).get("commit") or result.get("commit")
