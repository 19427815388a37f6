"""Small helpers shared by the scripts in this folder (``from _common import ...``; Python puts the
running script's folder on ``sys.path``)."""
from __future__ import annotations

import json


def write_json(path: str | None, obj, indent: int = 1) -> None:
    """Write OBJ as JSON to PATH (indented by INDENT); nothing when PATH is empty or None (no --json)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=indent)


def testbed_missing(prog: str) -> bool:
    """True (after saying why on stderr) when the network-namespace testbed cannot run here."""
    import sys
    from tag.backend.testbed import testbed_available
    ok, why = testbed_available()
    if not ok:
        print(f"{prog}: the testbed is not available here: {why}", file=sys.stderr)
    return not ok
