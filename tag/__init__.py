"""tag: a topology-aware distributed-training compiler for TensorFlow.

Example::

    import tag
    plan = tag.optimize(graph_def, "topologies/lab-v100-1080ti.pbtxt")   # search + rewrite: a tag.Plan
    plan = tag.optimize(graph_def, "topologies/lab-v100-1080ti.pbtxt", options=tag.SearchOptions(playouts=200))
    plan.report(); plan.save("plan/")
    topo = tag.load_topology("topologies/lab-v100-1080ti.pbtxt")
    tg = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=64))
    print(tg.num_parameters, topo.num_devices)
    tag.fit(keras_model, "topologies/localhost.pbtxt", dataset_fn, loss="mse", optimizer="adam", steps=100,
            batch_size=32)                  # a tf_keras model trained from its weights, the result written back

Heavy modules (TensorFlow, DGL) load on first use, so ``import tag`` stays cheap.
"""
from __future__ import annotations

import importlib

from tag.errors import GraphError, MemoryBudgetError, OptionError, RewriteError, StrategyError, TagError, TopologyError

__version__ = "0.1.0"

_LAZY = {
    "load_topology": ("tag.cluster.topology", "load_topology"),
    "parse_topology": ("tag.cluster.topology", "parse_topology"),
    "Topology": ("tag.cluster.topology", "Topology"),
    "analyze": ("tag.frontend.analyze", "analyze"),
    "TrainingGraph": ("tag.ir.types", "TrainingGraph"),
    "zoo": ("tag.frontend.zoo", None),
    "Strategy": ("tag.strategy.types", "Strategy"),
    "Action": ("tag.strategy.types", "Action"),
    "optimize": ("tag.api", "optimize"),
    "Plan": ("tag.plan", "Plan"),
    "SearchOptions": ("tag.options", "SearchOptions"),
    "rewrite": ("tag.api", "rewrite"),
    "find_entry_points": ("tag.frontend.entry_points", "find_entry_points"),
    "train": ("tag.training", "train"),
    "fit": ("tag.keras", "fit"),
    "keras": ("tag.keras", None),
}

__all__ = ["TagError", "TopologyError", "GraphError", "StrategyError", "RewriteError", "MemoryBudgetError",
           "OptionError", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tag' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
