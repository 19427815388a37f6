"""Keep TensorFlow's start-up noise off the console of tag's command-line tools.

Importing TensorFlow prints lines that mean nothing to a tag user (absl's "All log messages before
absl::InitializeLog()", the CUDA stub's "Could not find cuda drivers", oneDNN notes), some from C++
before any Python setting can reach them, and later Python deprecation warnings. ``quiet_tensorflow``
runs at the start of every CLI, before TensorFlow is imported:

- ``TF_CPP_MIN_LOG_LEVEL=3`` (TF's own C++ log lines: info, warnings, errors such as ``cuInit`` failures);
- Python ``warnings`` and the ``tensorflow`` / ``absl`` loggers at ERROR;
- the first ``import tensorflow`` runs with file descriptor 2 pointed at a temporary file: what C++
  writes there during the import is dropped if the import succeeds and replayed on stderr if it fails.
  This is done by a ``sys.meta_path`` hook that wraps TensorFlow's loader and removes itself afterwards,
  so wherever the import happens (the zoo, the rewriter, a worker) it is quiet.

``--verbose`` (``quiet_tensorflow(verbose=True)``) changes nothing: TensorFlow logs as it always does.

Example::

    from tag.cli.quiet import quiet_tensorflow
    quiet_tensorflow(verbose="--verbose" in sys.argv)
    import tensorflow as tf        # nothing on the console
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Any, Sequence

_LOCK = threading.Lock()
_NOISY_LOGGERS = ("tensorflow", "absl", "h5py", "tf_keras", "keras")


def quiet_tensorflow(verbose: bool = False) -> None:
    """Silence TensorFlow's start-up and deprecation noise for this process (no-op when VERBOSE)."""
    if verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(tensorflow|tf_keras|keras)(\.|$)")
    if "absl.logging" in sys.modules:
        sys.modules["absl.logging"].set_verbosity("error")
    if "tensorflow" not in sys.modules:
        _install_hook()


def wants_verbose(argv: Sequence[str]) -> bool:
    """Does ARGV ask for TensorFlow's own logging (``--verbose``)? Looked at before argparse runs."""
    return "--verbose" in argv


class _MutedStderr:
    """File descriptor 2 redirected to a temporary file; ``replay()`` copies what was caught to stderr."""

    def __enter__(self) -> "_MutedStderr":
        self._sink = tempfile.TemporaryFile()
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        self._saved = os.dup(2)
        os.dup2(self._sink.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if exc[0] is not None:
            self.replay()
        self._sink.close()

    def replay(self) -> None:
        self._sink.seek(0)
        data = self._sink.read()
        if data:
            os.write(2, data)


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's own loader, run with stderr muted."""

    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):  # noqa: ANN001 - importlib protocol
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001 - importlib protocol
        _remove_hook()
        with _MutedStderr():
            self._inner.exec_module(module)
        # absl may have been imported by TensorFlow: keep it at ERROR from here on
        if "absl.logging" in sys.modules:
            sys.modules["absl.logging"].set_verbosity("error")
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


class _TensorFlowFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` with the normal finders and wraps its loader in ``_QuietLoader``."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != "tensorflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _QuietLoader(spec.loader)
        return spec


_HOOK = _TensorFlowFinder()


def _install_hook() -> None:
    with _LOCK:
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)


def _remove_hook() -> None:
    with _LOCK:
        if _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)
