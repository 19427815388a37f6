"""One op group's action: the device groups it runs on and how its gradients are combined.

Its own module so that both ``tag.strategy.types`` (a ``Strategy`` holds one ``Action`` per op group) and
``tag.strategy.pipeline`` (every op group of a stage carries the stage's action) import it.

Example::

    from tag.strategy.action import Action
    Action(placement=(0, 1), mode="allreduce")
    Action((2,), "ps", ps_device=3).to_dict()     # {'placement': [2], 'mode': 'ps', 'ps_device': 3}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tag.errors import StrategyError

Mode = Literal["allreduce", "ps", "partition"]
MODES: tuple[str, ...] = ("allreduce", "ps", "partition")


@dataclass(frozen=True)
class Action:
    """Placement (non-empty sorted tuple of device-group indices) and communication mode.

    allreduce: replicate on every device of the placement, gradients summed by all-reduce.
    ps: replicate likewise; gradients aggregated and applied on ``ps_device`` (a global device index).
    partition: model-parallel; the group's ops are split over the placement's devices.
    """

    placement: tuple[int, ...]
    mode: Mode = "allreduce"
    ps_device: int | None = None

    def __post_init__(self):
        if not self.placement:
            raise StrategyError("an action needs at least one device group")
        if self.mode not in MODES:
            raise StrategyError(f"unknown mode {self.mode!r} (expected one of {', '.join(MODES)})")
        if self.mode == "ps" and self.ps_device is None:
            raise StrategyError("mode 'ps' needs ps_device")
        object.__setattr__(self, "placement", tuple(sorted(set(int(g) for g in self.placement))))

    def to_dict(self) -> dict:
        d = {"placement": list(self.placement), "mode": self.mode}
        if self.ps_device is not None:
            d["ps_device"] = int(self.ps_device)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Action":
        return cls(tuple(d["placement"]), d.get("mode", "allreduce"), d.get("ps_device"))
