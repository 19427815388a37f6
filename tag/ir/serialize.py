"""The training-graph IR as plain JSON: save an analysed graph and read it back without re-analysing it.

Analysing a large model (building its Keras graph, differentiating it, reading every shape) takes 10-60 s;
benchmarks that predict many rows of the same models keep the IRs between runs. They are kept as JSON
(gzip-compressed when the file name ends in ``.gz``), never as pickles: a cache file is data, and loading
it runs no code.

Example::

    from tag.ir.serialize import save_training_graph, load_training_graph
    save_training_graph(tg, "resnet50-b8.ir.json.gz")
    same = load_training_graph("resnet50-b8.ir.json.gz")   # equal ops, edges, variables and costs
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any

from tag.ir.types import Edge, Linear, OpInfo, TensorInfo, TrainingGraph, VariableInfo

#: bumped whenever the IR's fields change, so that an older file is refused instead of misread
FORMAT_VERSION = 1
FORMAT_NAME = "tag-training-graph"


def _linear(x: Linear) -> list[float]:
    return [float(x.fixed), float(x.per_example)]


def _shape(shape) -> list | None:
    return None if shape is None else [None if d is None else int(d) for d in shape]


def training_graph_to_dict(tg: TrainingGraph) -> dict[str, Any]:
    """TG as JSON-ready plain data (``training_graph_from_dict`` inverts it)."""
    ops = [{"name": o.name, "type": o.type, "device": o.device, "phase": o.phase, "inputs": list(o.inputs),
            "control_inputs": list(o.control_inputs),
            "outputs": [{"name": t.name, "dtype": t.dtype, "shape": _shape(t.shape), "batch_axis": t.batch_axis,
                         "nbytes": _linear(t.nbytes)} for t in o.outputs],
            "flops": _linear(o.flops), "mem_bytes": _linear(o.mem_bytes), "has_flop_rule": bool(o.has_flop_rule),
            "colocation_group": o.colocation_group, "attrs": dict(o.attrs)} for o in tg.ops]
    edges = [[int(e.src), int(e.dst), e.tensor, *_linear(e.nbytes)] for e in tg.edges]
    variables = [{"name": v.name, "op": int(v.op), "shape": _shape(v.shape), "dtype": v.dtype,
                  "nbytes": int(v.nbytes), "kind": v.kind, "apply_op": v.apply_op, "gradient": v.gradient,
                  "slots": list(v.slots), "slot_bytes": int(v.slot_bytes), "read_ops": list(v.read_ops)}
                 for v in tg.variables]
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "name": tg.name, "batch_size": int(tg.batch_size),
            "inputs": list(tg.inputs), "colocation": [list(c) for c in tg.colocation],
            "unknown_op_types": dict(tg.unknown_op_types), "unknown_shape_tensors": int(tg.unknown_shape_tensors),
            "ops": ops, "edges": edges, "control_edges": [[int(a), int(b)] for a, b in tg.control_edges],
            "variables": variables}


def training_graph_from_dict(data: Any, where: str = "training graph") -> TrainingGraph:
    """The TrainingGraph DATA describes (``training_graph_to_dict``'s form). Raises ValueError naming WHERE
    when DATA is not that form or is of another format version."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ValueError(f"{where}: not a saved tag training graph")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}: format version {data.get('version')!r}, this tag reads {FORMAT_VERSION}")

    def tup(shape):
        return None if shape is None else tuple(shape)

    try:
        ops = [OpInfo(name=o["name"], type=o["type"], device=o["device"], phase=o["phase"], inputs=list(o["inputs"]),
                      control_inputs=list(o["control_inputs"]),
                      outputs=[TensorInfo(t["name"], t["dtype"], tup(t["shape"]), t["batch_axis"], Linear(*t["nbytes"]))
                               for t in o["outputs"]],
                      flops=Linear(*o["flops"]), mem_bytes=Linear(*o["mem_bytes"]), has_flop_rule=o["has_flop_rule"],
                      colocation_group=o["colocation_group"], attrs=dict(o["attrs"])) for o in data["ops"]]
        edges = [Edge(int(s), int(d), t, Linear(f, p)) for s, d, t, f, p in data["edges"]]
        variables = [VariableInfo(name=v["name"], op=int(v["op"]), shape=tuple(v["shape"]), dtype=v["dtype"],
                                  nbytes=int(v["nbytes"]), kind=v["kind"], apply_op=v["apply_op"],
                                  gradient=v["gradient"], slots=list(v["slots"]), slot_bytes=int(v["slot_bytes"]),
                                  read_ops=list(v["read_ops"])) for v in data["variables"]]
        return TrainingGraph(ops=ops, edges=edges, control_edges=[(int(a), int(b)) for a, b in data["control_edges"]],
                             variables=variables, batch_size=int(data["batch_size"]), inputs=list(data["inputs"]),
                             colocation=[list(c) for c in data["colocation"]],
                             unknown_op_types=dict(data["unknown_op_types"]), name=data["name"],
                             unknown_shape_tensors=int(data["unknown_shape_tensors"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: malformed saved training graph ({type(err).__name__}: {err})") from None


def _open(path: str | os.PathLike, mode: str, compressed: bool):
    return gzip.open(path, mode + "t", encoding="utf-8") if compressed else open(path, mode, encoding="utf-8")


def save_training_graph(tg: TrainingGraph, path: str | os.PathLike) -> None:
    """Write TG to PATH as JSON (gzip when PATH ends in ``.gz``), through a temporary file so that an
    interrupted write leaves no half-written file behind."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with _open(tmp, "w", compressed=str(path).endswith(".gz")) as f:
            json.dump(training_graph_to_dict(tg), f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_training_graph(path: str | os.PathLike) -> TrainingGraph:
    """The TrainingGraph saved at PATH (``save_training_graph``); ValueError naming PATH when it is not one."""
    try:
        with _open(path, "r", compressed=str(path).endswith(".gz")) as f:
            data = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read a saved training graph ({err})") from None
    return training_graph_from_dict(data, where=str(path))
