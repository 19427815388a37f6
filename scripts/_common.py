"""Small helpers shared by the scripts in this folder (``from _common import ...``; Python puts the
running script's folder on ``sys.path``)."""
from __future__ import annotations

import json


def write_json(path: str | None, obj, indent: int = 1) -> None:
    """Write OBJ as JSON to PATH (indented by INDENT); nothing when PATH is empty or None (no --json)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=indent)
