"""Cost model: per-op time on each device type, transfers and collectives, memory; the profile format.

``tag.cost.model`` is numpy only; ``tag.cost.calibration`` measures profiles with TensorFlow and is
imported only by the calibration command.

Example::

    from tag.cost import CostModel
    cm = CostModel(training_graph, topology)     # built-in defaults, or profile=Profile.load(path)
"""
from tag.cost.model import (BUILTIN_DEFAULTS, ZERO_COST_TYPES, CostModel, DeviceProfile, DeviceRates,
                            NetworkProfile, Profile)

__all__ = ["BUILTIN_DEFAULTS", "ZERO_COST_TYPES", "CostModel", "DeviceProfile", "DeviceRates", "NetworkProfile",
           "Profile"]
