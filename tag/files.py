"""Reading user files and writing outputs safely: one place for size limits, special files and atomic writes.

``read_input_file`` refuses what is not a regular file (a named pipe would block forever, ``/dev/zero``
never ends) and anything over a size limit before reading it, and maps OS errors to one-line messages
that start with the path. ``write_atomic`` writes through a temporary file and a rename, so a failure
never leaves a half-written report, trace, profile or plan.

Example::

    from tag.errors import TagError
    from tag.files import read_input_file, write_atomic
    data = read_input_file("cluster.pbtxt", what="topology file", limit=2 << 20, error=TagError)
    write_atomic("report.json", "{}\\n")
"""
from __future__ import annotations

import os
import stat

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
            data = f.read(limit + 1)
    except PermissionError:
        raise error(f"{path}: permission denied") from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > limit:
        raise error(f"{path}: file too large (over {limit / 2**20:.0f} MiB) for a {what}")
    return data


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write DATA (bytes, or text as UTF-8) to PATH through a temporary file in the same directory and a
    rename, so a failure never leaves a half-written file (the temporary file is removed)."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
