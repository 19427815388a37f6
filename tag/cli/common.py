"""Shared plumbing for tag's command-line tools: exit codes and one-line errors.

Exit codes: 0 success, 2 bad input (one line on stderr, no traceback), 1 anything else.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from tag.errors import TagError

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


def one_line(text: str) -> str:
    """Collapse a message onto a single line."""
    return " ".join(str(text).split())


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write TEXT to PATH atomically (``tag.files.write_atomic``)."""
    from tag.files import write_atomic
    write_atomic(path, text)


def run_cli(prog: str, body: Callable[[Sequence[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run BODY(argv) and turn exceptions into tag's exit codes and one-line messages."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return int(body(list(sys.argv[1:] if argv is None else argv)) or 0)
    except TagError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `tag-topo show f | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:  # argparse usage errors exit 2 already
        return int(err.code or 0) if isinstance(err.code, int) else EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - last resort: still one line, exit 1
        if os.environ.get("TAG_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(err).__name__}: {one_line(err)} (set TAG_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return EXIT_ERROR
