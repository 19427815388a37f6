"""Reading user files and writing outputs safely: one place for size limits, special files and atomic writes.

``read_input_file`` refuses what is not a regular file (a named pipe would block forever, ``/dev/zero``
never ends) and anything over a size limit before reading it, and maps OS errors to one-line messages
that start with the path; ``decode_json`` turns its bytes into a JSON value, with messages of the same
kind; ``finite`` makes a value strict JSON (no NaN or infinity). ``write_atomic`` writes through a temporary
file and a rename, so a failure never leaves a half-written report, trace, profile or plan;
``check_writable`` tells before any work is done whether an output path can be written.

Example::

    from tag.errors import TagError
    from tag.files import check_writable, read_input_file, write_atomic
    data = read_input_file("cluster.pbtxt", what="topology file", limit=2 << 20, error=TagError)
    write_atomic("report.json", "{}\\n")
    check_writable("out/trace.json", what="trace")   # TagError unless it could be written
"""
from __future__ import annotations

import json
import os
import stat
import threading
from typing import Any

import numpy as np

from tag.errors import TagError


def read_input_file(path: str | os.PathLike, *, what: str, limit: int, error: type = TagError) -> bytes:
    """The bytes of PATH, a regular file of at most LIMIT bytes; ERROR("PATH: ...") otherwise.

    Messages: ``no such file``, ``is a directory, not a WHAT``, ``not a regular file (a pipe or device),
    not a WHAT``, ``permission denied``, ``cannot read: REASON``, ``file too large (over N MiB) for a WHAT``.
    """
    path = os.fspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except PermissionError:
        raise error(f"{path}: permission denied") from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: not a regular file (a pipe or device), not a {what}")
    if info.st_size > limit:
        raise error(f"{path}: file too large (over {limit / 2**20:.0f} MiB) for a {what}")
    try:
        with open(path, "rb") as f:
            # read what stat promised (+1 to see growth), then on in chunks: never a LIMIT-sized buffer
            chunks = [f.read(min(limit, info.st_size) + 1)]
            total = len(chunks[0])
            while chunks[-1] and total <= limit:
                chunks.append(f.read(min(1 << 24, limit + 1 - total)))
                total += len(chunks[-1])
            data = b"".join(chunks)
    except PermissionError:
        raise error(f"{path}: permission denied") from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > limit:
        raise error(f"{path}: file too large (over {limit / 2**20:.0f} MiB) for a {what}")
    return data


def decode_json(data: bytes, path: str, *, not_text: str, not_json: str, error: type = TagError) -> Any:
    """The JSON value in DATA (UTF-8 bytes read from PATH); ERROR("PATH: NOT_TEXT") when DATA is not UTF-8,
    ERROR("PATH: NOT_JSON (line L: reason)") or ERROR("PATH: NOT_JSON (nested too deeply)") when it is
    not valid JSON."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{path}: {not_text}") from None
    except (json.JSONDecodeError, RecursionError) as err:
        where = f"line {err.lineno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        raise error(f"{path}: {not_json} ({where})") from None


def finite(obj: Any) -> Any:
    """OBJ with non-finite floats replaced by None and numpy scalars by Python ones (strict JSON)."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write DATA (bytes, or text as UTF-8) to PATH through a temporary file in the same directory and a
    rename, so a failure never leaves a half-written file (the temporary file is removed). A path that
    cannot be written is a TagError ``PATH: cannot write: REASON`` naming PATH."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:   # the user's path in the message, never the temporary name
        raise TagError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def check_writable(path: str | os.PathLike, *, what: str = "output", directory: bool = False,
                   create_parents: bool = False) -> None:
    """Raise TagError (naming PATH) unless an output at PATH could be written now.

    Checked before any work is done, so a bad ``--json`` path fails in a second rather than after a
    search: PATH must not be a directory (or must be one, or not exist yet, when DIRECTORY), its parent
    must exist (with CREATE_PARENTS: its nearest existing ancestor, where the missing folders will be
    made), and a file can be created there (a probe file, removed at once).
    """
    path = os.fspath(path)
    if not path:
        raise TagError(f"empty path for the {what}")
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise TagError(f"{path}: exists and is not a directory (the {what})")
        probe_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    else:
        if os.path.isdir(path):
            raise TagError(f"{path}: is a directory (the {what} is a file)")
        probe_dir = os.path.dirname(os.path.abspath(path))
    if create_parents:
        while not os.path.exists(probe_dir) and os.path.dirname(probe_dir) != probe_dir:
            probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise TagError(f"{path}: directory {probe_dir} does not exist")
    probe = os.path.join(probe_dir, f".tag-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(probe, "wb"):
            pass
    except OSError as e:
        raise TagError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
