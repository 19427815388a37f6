"""Shared plumbing for tag's command-line tools: exit codes, one-line errors, a quiet console.

Exit codes: 0 success, 2 bad input (one line on stderr, no traceback), 1 anything else (a failed run is
one line too; an unexpected exception is one "internal error" line, ``TAG_DEBUG=1`` for the traceback).
``ArgumentParser`` makes argparse's usage errors one line (``PROG: error: argument --batch-size: invalid int
value: 'abc'``, exit 2) instead of the usage block. ``run_cli`` silences TensorFlow's start-up noise
(``tag.cli.quiet``) unless the command line has ``--verbose``.

Example::

    from tag.cli.common import ArgumentParser, add_verbose, run_cli

    def body(argv):
        p = ArgumentParser(prog="tag-x"); add_verbose(p); p.add_argument("--n", type=int)
        args = p.parse_args(argv)
        return 0

    run_cli("tag-x", body, ["--n", "abc"])      # -> 2, "tag-x: error: argument --n: invalid int value: 'abc'"
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

from tag.errors import RunError, TagError

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(TagError):
    """A command line argparse rejects (unknown option, bad value, missing argument)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error()`` raises UsageError instead of printing the usage block.

    Sub-command parsers made by ``add_subparsers`` are of this class too. ``--help`` is unchanged."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def add_verbose(parser: argparse.ArgumentParser, *, sub: bool = False) -> None:
    """``--verbose``: let TensorFlow log as it does by default (start-up lines, warnings)."""
    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS if sub else False,
                        help="show TensorFlow's own log output (hidden by default)")


def add_old_name(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str,
                 new: argparse.Action) -> None:
    """OLD: a former spelling of the option NEW (the action ``add_argument`` returned), still accepted for a
    release: it sets the same destination with the same type, and ``--help`` lists only NEW's name."""
    parser.add_argument(old, dest=new.dest, type=new.type, nargs=new.nargs, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def one_line(text: object) -> str:
    """Collapse a message onto a single line."""
    return " ".join(str(text).split())


def run_cli(prog: str, body: Callable[[Sequence[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run BODY(argv) and turn exceptions into tag's exit codes and one-line messages."""
    from tag.cli.quiet import quiet_tensorflow, wants_verbose
    args = list(sys.argv[1:] if argv is None else argv)
    quiet_tensorflow(verbose=wants_verbose(args))
    try:
        return int(body(args) or 0)
    except TagError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. `tag-topo show f | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:  # --help exits 0
        return int(err.code or 0) if isinstance(err.code, int) else EXIT_BAD_INPUT
    except MemoryError:
        if os.environ.get("TAG_DEBUG"):
            raise
        print(f"{prog}: error: out of memory (the model or the input is too large for this machine)",
              file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:  # noqa: BLE001 - last resort: still one line, exit 1
        if os.environ.get("TAG_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(err).__name__}: {one_line(err)} (set TAG_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return EXIT_ERROR
