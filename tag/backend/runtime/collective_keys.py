"""Fresh collective keys: renumber a graph's collective group/instance keys so many graphs share one cluster.

TF servers remember collective groups for their whole life; a later session that reuses a group
key with other members aborts every collective on the cluster. ``fresh_collective_keys`` gives each
graph keys no earlier graph of this process used (``run_steps`` calls it itself).

Example::

    from tag.backend.runtime.collective_keys import fresh_collective_keys

    plan_gd = fresh_collective_keys(plan.graph_def)     # same old key -> same new key within the graph
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from tag.backend.runtime.cluster_spec import import_tf

_V1_COLLECTIVES = {"CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastRecv"}
_KEY_ALLOC_LOCK = threading.Lock()
_NEXT_KEY = [0]   # one-element list: the last key handed out in this process (0: none yet)
MASKED_KEY_BASE = 1 << 30   # masked keys lie in [2**30, 2**31): never a rewriter's or a run's fixed key


def _fresh_key() -> int:
    """A collective key no earlier run of this process used (start varies per process)."""
    with _KEY_ALLOC_LOCK:
        if _NEXT_KEY[0] == 0:
            _NEXT_KEY[0] = (1 << 24) + ((os.getpid() * 7919 + int(time.time())) % (1 << 20)) * 512
        _NEXT_KEY[0] += 1
        if _NEXT_KEY[0] >= (1 << 31) - 1:
            _NEXT_KEY[0] = 1 << 24
        return _NEXT_KEY[0]


def _input_positions(node, op_def, arg_names: Sequence[str]) -> dict[str, int]:
    """Position in NODE.input of each named single-tensor input argument."""
    pos, out = 0, {}
    for arg in op_def.input_arg:
        if arg.number_attr:
            count = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count = len(node.attr[arg.type_list_attr].list.type)
        else:
            count = 1
        if arg.name in arg_names and count == 1:
            out[arg.name] = pos
        pos += count
    return out


def fresh_collective_keys(graph_def: Any) -> Any:
    """A copy of GRAPH_DEF whose collective group and instance keys are new to this process's clusters.

    TF servers remember collective groups for their whole life: a later session that reuses a group
    key with other members aborts every collective on the cluster ("joining a group with size 2, but
    that group has size 3"). Renumbering the keys of each graph before it runs (same old key -> same
    new key, so the members of one collective still agree) lets one cluster run many graphs, e.g. a
    plan and then its baseline. Keys of V2 ops must come from Const nodes; when one does not, the graph
    is returned unchanged. ``run_steps`` calls this itself.
    """
    return renumber_collective_keys(graph_def, lambda key, old: _fresh_key())


def mask_collective_keys(graph_def: Any, nonce: str) -> Any:
    """A copy of GRAPH_DEF whose collective group and instance keys are mixed with NONCE: key K becomes
    ``2**30 + (K ^ mask(NONCE)) % 2**30``, the same on every host that masks with the same nonce (hosts' programs
    built apart still meet) and different for another run on the same servers (TF servers remember groups and
    instances for their whole life). A bijection on keys below 2**30, so distinct keys stay distinct."""
    mask = int.from_bytes(hashlib.sha1(nonce.encode()).digest()[:4], "big") % MASKED_KEY_BASE
    return renumber_collective_keys(graph_def, lambda key, old: MASKED_KEY_BASE + ((old ^ mask) % MASKED_KEY_BASE))


def renumber_collective_keys(graph_def: Any, new_key: Callable[[str, int], int]) -> Any:
    """A copy of GRAPH_DEF whose collective keys are NEW_KEY(\"group_key\" or \"instance_key\", old key), each old
    key mapped once (the members of one collective still agree). V1 collectives keep keys in attributes, V2 ones
    in Const inputs (replaced by new Consts); a V2 key that is not a Const leaves the graph unchanged."""
    tf = import_tf()
    from tensorflow.python.framework import op_def_registry, tensor_util

    nodes = {n.name: n for n in graph_def.node}
    plan = []  # (node index, kind, arg name, position or None)
    for idx, node in enumerate(graph_def.node):
        if node.op in _V1_COLLECTIVES:
            plan.extend((idx, "attr", k, None) for k in ("group_key", "instance_key") if k in node.attr)
        elif node.op.startswith("Collective") and node.op.endswith(("V2", "V3")):
            op_def = op_def_registry.get(node.op)
            if op_def is None:
                continue
            positions = _input_positions(node, op_def, ("group_key", "instance_key"))
            for k, p in positions.items():
                src = node.input[p].lstrip("^").split(":")[0]
                if src not in nodes or nodes[src].op != "Const":
                    return graph_def  # cannot renumber consistently: leave the graph as it is
                plan.append((idx, "input", k, p))
    if not plan:
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    maps: dict[str, dict[int, int]] = {"group_key": {}, "instance_key": {}}
    taken = set(nodes)
    for idx, kind, key, p in plan:
        node = out.node[idx]
        if kind == "attr":
            old = int(node.attr[key].i)
        else:
            old = int(tensor_util.MakeNdarray(nodes[node.input[p].split(":")[0]].attr["value"].tensor))
        new = maps[key].setdefault(old, new_key(key, old))
        if kind == "attr":
            node.attr[key].i = new
            continue
        src = nodes[node.input[p].split(":")[0]]
        name = f"{node.name}/tag_{key}"
        while name in taken:
            name += "_"
        taken.add(name)
        const = out.node.add()
        const.name, const.op, const.device = name, "Const", node.device
        dtype = src.attr["dtype"].type
        const.attr["dtype"].type = dtype
        const.attr["value"].tensor.CopyFrom(
            tensor_util.make_tensor_proto(np.array(new, dtype=tf.dtypes.as_dtype(dtype).as_numpy_dtype)))
        node.input[p] = name
    return out
