"""Is a user's GraphDef a graph TensorFlow itself would run? Checked before tag analyses it.

tag's frontend reads a GraphDef as data (ops, inputs, shapes); it does not check every op against
TensorFlow's op registry. A hand-edited or corrupted file can name ops with the wrong number or types
of inputs, attributes of the wrong kind, or contain a cycle -- and would then be planned and written
out as if it were fine. ``check_importable`` imports the graph into a fresh ``tf.Graph`` (TensorFlow's
own graph constructor checks op signatures, attributes and cycles) and turns any complaint into a
one-line ``GraphError`` naming the file. Zoo models are built by TensorFlow and skip the check.

Example::

    from tag.cli.graph_check import check_importable
    check_importable(graph_def, "my_step.pb")   # GraphError: "my_step.pb: not a valid TensorFlow graph: ..."
"""
from __future__ import annotations

from typing import Any

from tag.errors import GraphError


def check_importable(graph_def: Any, where: str) -> None:
    """Raise GraphError("WHERE: not a valid TensorFlow graph: ...") unless GRAPH_DEF imports into TF."""
    from tag.backend.runtime.cluster_spec import import_tf
    tf = import_tf()
    try:
        with tf.Graph().as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, KeyError, IndexError, tf.errors.OpError) as err:
        text = " ".join(str(getattr(err, "message", "") or err).split()) or type(err).__name__
        raise GraphError(f"{where}: not a valid TensorFlow graph: {text[:300]}") from None
    except RecursionError:
        raise GraphError(f"{where}: not a valid TensorFlow graph: nested too deeply") from None
