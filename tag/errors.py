"""Errors that mean "bad input": the CLIs print them as one line and exit with code 2."""
from __future__ import annotations


class TagError(Exception):
    """Base of every user-facing input error. str(err) is the one-line message."""


class TopologyError(TagError):
    """A cluster topology file is unreadable or invalid. Message: ``PATH:LINE: what is wrong``."""


class GraphError(TagError):
    """A training GraphDef cannot be analysed (no optimizer, unreadable file, unknown batch size, ...)."""


class StrategyError(TagError):
    """A strategy does not fit the graph or the topology (bad group, empty placement, ...)."""


class RewriteError(TagError):
    """The graph cannot be rewritten for a strategy; the message names the op."""


class OptionError(TagError):
    """A search option (``tag.options.SearchOptions``) is outside what it allows. ``field`` names it; the
    message's template holds ``{name}`` where the name goes, so ``named("--budget")`` words the same message
    for a command-line flag."""

    def __init__(self, field: str, template: str):
        super().__init__(template.replace("{name}", field))
        self.field, self.template = field, template

    def named(self, name: str) -> str:
        """The message with NAME (a flag) in place of the field's name."""
        return self.template.replace("{name}", name)


class MemoryBudgetError(TagError):
    """No strategy fits the devices' memory.

    ``shortfall_bytes``, ``device`` and ``strategy``: the smallest shortfall found (bytes over the
    capacity of that device under that strategy), when known.
    """

    def __init__(self, message: str, *, shortfall_bytes: int | None = None, device: str | None = None,
                 strategy: str | None = None):
        super().__init__(message)
        self.shortfall_bytes, self.device, self.strategy = shortfall_bytes, device, strategy


class RunError(Exception):
    """A run failed for a reason that is not bad input (a worker died, a host stopped answering, a step
    timed out). Not a TagError: the CLIs print it as one line (``PROG: error: ...``) and exit with 1."""
