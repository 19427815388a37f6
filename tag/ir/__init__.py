"""The training-graph IR: ops, tensors (shapes, bytes, batch axes), variables, FLOPs, and graph algorithms.

Plain data (dataclasses + numpy); nothing here imports TensorFlow. The frontend builds a
``TrainingGraph`` from a GraphDef; every later stage reads it.

Example::

    import tag
    from tag.ir import TrainingGraph, topological_order
    tg: TrainingGraph = tag.analyze(tag.zoo.training_graph("mlp", batch_size=32))
    order = topological_order(tg)
"""
from tag.ir.algorithms import UnionFind, dependency_arrays, op_levels, op_stages, topological_order
from tag.ir.types import PHASES, Edge, GraphArrays, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo

__all__ = ["PHASES", "Edge", "GraphArrays", "Linear", "OpInfo", "TensorInfo", "TrainingGraph", "VariableInfo",
           "UnionFind", "dependency_arrays", "op_levels", "op_stages", "topological_order"]
