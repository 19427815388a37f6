"""Step simulator: predicts one training step of a Strategy on a Topology (time, memory, trace).

The model is specified in ``tag.sim.simulator`` (the API); the other modules are its parts: task_graph,
layouts, routing, schedule, memory, result, trace.

Example::

    from tag.sim import Simulator
    result = Simulator(training_graph, topology, grouping).evaluate(strategy)
    result.step_time, result.feasible
"""
from tag.sim.simulator import SimResult, Simulator

__all__ = ["SimResult", "Simulator"]
