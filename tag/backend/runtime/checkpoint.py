"""Checkpoints of a running training graph as plain data: one ``.npz`` of variable values, no pickle.

``Checkpointer(graph)`` finds the variables of an imported (rewritten) training graph -- weights,
optimizer slots, step counters; not the synthetic input batches of ``run_steps(synthetic=True)`` -- and
adds a read and an assign op for each. ``save`` writes every value and a JSON description (step, losses
so far, the caller's fields) into one ``.npz`` through ``tag.files.write_atomic``, so a crash never
leaves half a checkpoint; ``restore`` loads it back with ``allow_pickle=False`` after checking that it
holds exactly this graph's variables with the same shapes. ``tag-deploy --run --checkpoint-every K``
saves one every K steps and ``--resume`` continues from it.

Example::

    from tag.backend.runtime.checkpoint import Checkpointer, read_checkpoint_meta

    ckpt = Checkpointer(graph)                        # before the session finalizes the graph
    ckpt.save(sess, "ckpt/weights.npz", step=10, losses=[2.3, 2.1], meta={"strategy": "ps"})
    read_checkpoint_meta("ckpt/weights.npz")["step"]   # 10
    step, losses = ckpt.restore(sess, "ckpt/weights.npz")
"""
from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Any, Sequence

import numpy as np

from tag.backend.runtime.cluster_spec import import_tf
from tag.errors import TagError

META_KEY = "__tag_checkpoint__"
FORMAT = "tag-checkpoint"
VERSION = 1
MAX_CHECKPOINT_BYTES = 1 << 40
_VARIABLE_OPS = {"VarHandleOp": "resource", "VariableV2": "ref", "Variable": "ref"}
SKIP_PREFIXES = ("tag_synthetic/",)   # run_steps' on-device input batches: data, not state


def _read_npz(path: str) -> Any:
    from tag.files import read_input_file
    data = read_input_file(path, what="tag checkpoint (.npz)", limit=MAX_CHECKPOINT_BYTES)
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as err:
        raise TagError(f"{path}: not a tag checkpoint ({' '.join(str(err).split())})") from None


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON description saved in checkpoint PATH (``step``, ``losses``, caller fields); TagError if bad."""
    path = os.fspath(path)
    npz = _read_npz(path)
    if META_KEY not in npz.files:
        raise TagError(f"{path}: not a tag checkpoint (no {META_KEY} entry)")
    try:
        meta = json.loads(str(npz[META_KEY]))
    except (ValueError, TypeError) as err:
        raise TagError(f"{path}: damaged checkpoint description ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise TagError(f"{path}: not a tag checkpoint of version {VERSION}")
    if not isinstance(meta.get("step"), int) or meta["step"] < 0 or not isinstance(meta.get("losses"), list):
        raise TagError(f"{path}: damaged checkpoint description (step/losses)")
    return meta


class Checkpointer:
    """Read and assign ops for the variables of GRAPH (a ``tf.Graph`` not yet finalized)."""

    def __init__(self, graph: Any):
        tf = import_tf()
        self.names: list[str] = []
        self._reads: list[Any] = []
        self._feeds: list[Any] = []
        self._assigns: list[Any] = []
        with graph.as_default():
            for op in graph.get_operations():
                kind = _VARIABLE_OPS.get(op.type)
                if kind is None or op.name.startswith(SKIP_PREFIXES):
                    continue
                dtype = op.get_attr("dtype")
                with tf.device(op.device), tf.name_scope(f"tag_checkpoint/{op.name}/"):
                    value = tf.compat.v1.placeholder(dtype, name="value")
                    if kind == "resource":
                        read = tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=dtype)
                        assign = tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value)
                    else:
                        read = tf.identity(op.outputs[0])
                        assign = tf.raw_ops.Assign(ref=op.outputs[0], value=value, validate_shape=False)
                self.names.append(op.name)
                self._reads.append(read)
                self._feeds.append(value)
                self._assigns.append(assign)

    def save(self, sess: Any, path: str | os.PathLike, *, step: int, losses: Sequence[float],
             meta: dict[str, Any] | None = None) -> None:
        """Write every variable's value and the description (STEP, LOSSES, META) to PATH atomically."""
        from tag.files import write_atomic
        values = sess.run(self._reads) if self._reads else []
        desc = {**(meta or {}), "format": FORMAT, "version": VERSION, "step": int(step),
                "losses": [float(x) for x in losses], "variables": self.names}
        arrays = {f"v{i}": np.asarray(v) for i, v in enumerate(values)}
        arrays[META_KEY] = np.array(json.dumps(desc))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        write_atomic(path, buf.getvalue())

    def restore(self, sess: Any, path: str | os.PathLike) -> tuple[int, list[float]]:
        """Assign the values saved at PATH; returns (step, losses so far). TagError if it does not fit."""
        path = os.fspath(path)
        meta = read_checkpoint_meta(path)
        npz = _read_npz(path)
        saved = list(meta.get("variables") or [])
        if saved != self.names:
            missing = sorted(set(self.names) - set(saved))[:3]
            extra = sorted(set(saved) - set(self.names))[:3]
            raise TagError(f"{path}: saved for another graph or strategy (variables differ: missing "
                           f"{missing or '-'}, unknown {extra or '-'}); resume with the same model, batch and "
                           f"strategy, or start without --resume")
        feed = {}
        for i, (name, ph) in enumerate(zip(self.names, self._feeds)):
            key = f"v{i}"
            if key not in npz.files:
                raise TagError(f"{path}: damaged checkpoint (no value for {name})")
            value = npz[key]
            want = self._reads[i].shape
            if want.rank is not None and (want.rank != value.ndim or not want.is_compatible_with(value.shape)):
                raise TagError(f"{path}: {name} has shape {list(value.shape)} in the checkpoint, "
                               f"{want.as_list()} in this graph (another batch or model?)")
            feed[ph] = value
        if self._assigns:
            sess.run(self._assigns, feed_dict=feed)
        return int(meta["step"]), [float(x) for x in meta["losses"]]
