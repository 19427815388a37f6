"""Run containers: each run's resources (variables, queues) in a resource container of its own.

tag's servers share resources between sessions by name (``isolate_session_state`` is off), which is what lets
one host's program reach a queue or a variable that another host's program created. A plan, its baseline
and tuning candidates run one after another on the same servers, so each run puts every resource it
creates in a container of its own (``tag-run-<id>``): runs never see each other's state, and the container
is released when the run ends (``release``).

Example::

    from tag.backend.runtime.containers import in_container, new_container

    name = new_container()                     # "tag-run-3f9a0c1b2d4e"
    graph_def = in_container(graph_def, name)  # every VarHandleOp, FIFOQueueV2, ... now lives there
"""
from __future__ import annotations

import secrets
from typing import Any

CONTAINER_PREFIX = "tag-run-"   # letters, digits, "." and "-" only: TensorFlow refuses "_" in a container name


def new_container(run_id: str | None = None) -> str:
    """The container of run RUN_ID (a fresh id when None)."""
    return CONTAINER_PREFIX + (run_id or secrets.token_hex(6))


def in_container(graph_def: Any, container: str) -> Any:
    """A copy of GRAPH_DEF whose every op with a ``container`` attribute (variables, queues, tables, ...) puts its
    resource in CONTAINER."""
    from tensorflow.python.framework import op_def_registry
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    value = container.encode()
    for node in out.node:
        op_def = op_def_registry.get(node.op)
        if op_def is not None and any(a.name == "container" for a in op_def.attr):
            node.attr["container"].s = value
    return out


def release(target: str, container: str, config: Any = None) -> None:
    """Free CONTAINER's resources on every task of TARGET's cluster (best effort: a cluster already gone is fine).
    Closes the sessions connected to TARGET's master, so call it once a run's sessions are done."""
    from tag.backend.runtime.cluster_spec import import_tf
    tf = import_tf()
    try:
        tf.compat.v1.Session.reset(target, containers=[container], config=config)
    except Exception:  # noqa: BLE001 - releasing after the run: nothing left to report
        pass
