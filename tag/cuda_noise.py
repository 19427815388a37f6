"""TensorFlow's CUDA start-up error line, kept off the console of machines without an NVIDIA driver.

TensorFlow's CUDA build calls ``cuInit`` the first time a process looks for devices (a session, a server,
``tf.config``) and, where no NVIDIA driver is installed, logs an error that means nothing there::

    E0000 00:00:1796691586.677838   28426 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: ...

``CUDA_VISIBLE_DEVICES=""`` does not stop it, nor does ``TF_CPP_MIN_LOG_LEVEL=2``; level 3 does, but also hides
TensorFlow's own warnings. So, instead:

- ``init_devices()`` (called by ``import_tf`` and before tag opens a session on TensorFlow it imported itself)
  makes that first device lookup once per process with file descriptor 2 captured, then writes back everything
  it caught except the cuInit line. Only where the line is noise: no NVIDIA driver on the machine
  (``/proc/driver/nvidia`` absent) or ``CUDA_VISIBLE_DEVICES`` empty. Where a driver exists, a failed cuInit
  is news and is shown.
- ``is_cuda_startup_noise(line)``: the test the tails of a failed worker's or host process's stderr use to
  quote the lines that matter (tag's child processes write their stderr to files).

Example::

    from tag.cuda_noise import init_devices
    import tensorflow as tf
    init_devices()                      # no "failed call to cuInit" line on a CPU-only machine
    with tf.compat.v1.Session() as sess: ...
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import threading

_DRIVER_DIR = "/proc/driver/nvidia"
_STARTUP_NOISE = re.compile(r"cuInit|Could not find cuda drivers|\b(?:cuda_\w+|cudart_stub)\.cc:\d+\]")
_LOCK = threading.Lock()
_done = False


def is_cuda_startup_noise(line: str) -> bool:
    """Is LINE TensorFlow's CUDA start-up chatter (the failed ``cuInit``, the missing-driver notice, other lines
    of its CUDA loaders), which says nothing about why a worker or host process failed?"""
    return bool(_STARTUP_NOISE.search(line))


def cuda_line_is_noise() -> bool:
    """Would a failed cuInit here mean nothing: no NVIDIA driver, or every GPU hidden on purpose?"""
    return not os.path.exists(_DRIVER_DIR) or os.environ.get("CUDA_VISIBLE_DEVICES", None) == ""


def without_cuinit(text: str) -> str:
    """TEXT (what fd 2 caught) less its failed-cuInit lines; every other line kept, in order."""
    return "".join(line for line in text.splitlines(keepends=True) if "cuInit" not in line)


def init_devices() -> None:
    """Let TensorFlow find its devices now, once per process, without the meaningless cuInit error line."""
    global _done
    if _done:
        return
    with _LOCK:
        if _done:
            return
        import tensorflow as tf
        if not cuda_line_is_noise():
            tf.config.list_physical_devices()
        else:
            with _FilteredStderr():
                tf.config.list_physical_devices()
        _done = True


class _FilteredStderr:
    """File descriptor 2 pointed at a temporary file; on exit what was caught goes back less cuInit lines."""

    def __enter__(self) -> "_FilteredStderr":
        _flush()
        self._sink = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._sink.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        _flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._sink.seek(0)
        kept = without_cuinit(self._sink.read().decode(errors="replace"))
        self._sink.close()
        data = kept.encode()
        while data:
            data = data[os.write(2, data):]


def _flush() -> None:
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
