"""Cost model: per-op time on each device type, transfers and collectives, memory; the profile format.

``tag.cost.model`` is numpy only; profiles are measured with TensorFlow by ``tag.calibration`` (above the
runtime, which it runs models through) and fitted by ``tag.cost.fitting``.

Example::

    from tag.cost import CostModel
    cm = CostModel(training_graph, topology)     # built-in defaults, or profile=Profile.load(path)
"""
from tag.cost.model import (
    BUILTIN_DEFAULTS,
    ZERO_COST_TYPES,
    CostModel,
    DeviceProfile,
    DeviceRates,
    NetworkProfile,
    Profile,
)

__all__ = [
    "BUILTIN_DEFAULTS", "ZERO_COST_TYPES", "CostModel", "DeviceProfile", "DeviceRates", "NetworkProfile", "Profile",
]
