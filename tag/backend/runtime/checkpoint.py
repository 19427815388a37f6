"""Checkpoints in TensorFlow's own format, under the original graph's variable names.

``Checkpointer(graph)`` finds the variables of an imported (rewritten) training graph -- weights,
optimizer slots, step counters; not the synthetic input batches of ``run_steps(synthetic=True)`` -- and
groups the copies the rewriter made of each (``w/replica_2`` is a copy of ``w``): ``save`` reads one copy
of every variable and writes a TensorFlow checkpoint (``DIR/model.ckpt-STEP.index`` and ``.data-*``,
through TensorFlow's own ``SaveV2`` kernel) whose keys are the original names, so
``tf.train.load_checkpoint`` reads it and a ``tf.compat.v1.train.Saver`` restores it into the original
single-device graph; ``restore`` assigns a checkpoint's values to every copy. Beside each checkpoint a
small JSON file (``model.ckpt-STEP.tag.json``: step, loss curve, the caller's fields) lets a run resume,
and the ``checkpoint`` state file names the newest last, so a crash while saving leaves the previous
checkpoint in force. ``export_npz`` writes a checkpoint's values as a plain ``.npz`` for tools that
want one. ``tag-deploy --run --checkpoint-every K`` saves one every K steps and ``--resume`` continues.

Example::

    from tag.backend.runtime.checkpoint import Checkpointer, latest_checkpoint, read_checkpoint_meta

    ckpt = Checkpointer(graph)                        # before the session finalizes the graph
    prefix = ckpt.save(sess, "ckpt/", step=10, losses=[2.3, 2.1], meta={"strategy": "ps"})
    read_checkpoint_meta("ckpt/")["step"]             # 10 (the newest checkpoint of the directory)
    step, losses = ckpt.restore(sess, "ckpt/")
    tf.train.load_checkpoint(latest_checkpoint("ckpt/")).get_tensor("w1")   # one copy, original name
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from tag.backend.runtime.cluster_spec import import_tf
from tag.errors import TagError

FORMAT = "tag-checkpoint"
VERSION = 2
PREFIX_NAME = "model.ckpt"
META_SUFFIX = ".tag.json"
STATE_FILE = "checkpoint"
KEEP = 3                                           # checkpoints kept per directory (older ones are deleted)
_VARIABLE_OPS = {"VarHandleOp": "resource", "VariableV2": "ref", "Variable": "ref"}
SKIP_PREFIXES = ("tag_synthetic/",)   # run_steps' on-device input batches: data, not state
_REPLICA_RE = re.compile(r"^(.+)/replica_\d+$")


def original_name(name: str) -> str:
    """The original graph's name of variable copy NAME (``w/replica_2`` -> ``w``)."""
    m = _REPLICA_RE.match(name)
    return m.group(1) if m else name


def latest_checkpoint(path: str | os.PathLike) -> str | None:
    """The prefix of the newest checkpoint in directory PATH (None if there is none); a prefix is returned
    as it is."""
    tf = import_tf()
    path = os.fspath(path)
    if os.path.isdir(path):
        return tf.train.latest_checkpoint(path)
    return path if glob.glob(path + ".index") else None


def _prefix_of(path: str | os.PathLike, what: str = "checkpoint") -> str:
    prefix = latest_checkpoint(path)
    if prefix is None:
        raise TagError(f"{os.fspath(path)}: no TensorFlow {what} there (expected {PREFIX_NAME}-N.index and a "
                       f"'{STATE_FILE}' file)")
    return prefix


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The description saved with checkpoint PATH (a directory: its newest; or a prefix): ``step``,
    ``losses``, ``variables`` and the caller's fields. TagError if there is none or it is damaged."""
    prefix = _prefix_of(path)
    meta_path = prefix + META_SUFFIX
    from tag.files import read_input_file
    try:
        meta = json.loads(read_input_file(meta_path, what="tag checkpoint description", limit=1 << 30))
    except (ValueError, TypeError) as err:
        raise TagError(f"{meta_path}: damaged checkpoint description ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise TagError(f"{meta_path}: not a tag checkpoint description of version {VERSION}")
    if not isinstance(meta.get("step"), int) or meta["step"] < 0 or not isinstance(meta.get("losses"), list):
        raise TagError(f"{meta_path}: damaged checkpoint description (step/losses)")
    meta["prefix"] = prefix
    return meta


def read_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of TensorFlow checkpoint PATH (directory or prefix), by name."""
    tf = import_tf()
    prefix = _prefix_of(path)
    try:
        reader = tf.train.load_checkpoint(prefix)
        return {name: np.asarray(reader.get_tensor(name)) for name in sorted(reader.get_variable_to_shape_map())}
    except Exception as err:  # noqa: BLE001 - TensorFlow's reader raises several types
        raise TagError(f"{prefix}: not a readable TensorFlow checkpoint ({str(err).splitlines()[0]})") from None


def write_weights(prefix: str, weights: Mapping[str, np.ndarray]) -> None:
    """Write WEIGHTS (name -> array) as a TensorFlow checkpoint at PREFIX with TensorFlow's ``SaveV2``,
    in a small graph run in this process (works whether or not eager execution is on)."""
    tf = import_tf()
    names = sorted(weights)
    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:CPU:0"):
        values = [tf.compat.v1.placeholder(tf.as_dtype(np.asarray(weights[n]).dtype)) for n in names]
        save = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                                 tensors=values)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(save, feed_dict={v: np.asarray(weights[n]) for v, n in zip(values, names, strict=True)})


def export_npz(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the values of checkpoint PATH (directory or prefix) to OUT as a plain ``.npz`` (no pickle),
    one array per original variable name; returns OUT."""
    import io

    from tag.files import write_atomic
    weights = read_weights(path)
    buf = io.BytesIO()
    np.savez(buf, **weights)
    write_atomic(os.fspath(out), buf.getvalue())
    return os.fspath(out)


def _write_state(directory: str, prefixes: list[str]) -> None:
    from tag.files import write_atomic
    names = [os.path.basename(p) for p in prefixes]
    text = f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
        f'all_model_checkpoint_paths: "{n}"\n' for n in names)
    write_atomic(os.path.join(directory, STATE_FILE), text)


def _step_of(prefix: str) -> int:
    m = re.search(r"-(\d+)$", prefix)
    return int(m.group(1)) if m else -1


def save_weights_checkpoint(weights: Mapping[str, np.ndarray], directory: str | os.PathLike, *, step: int,
                            losses: Sequence[float], meta: dict[str, Any] | None = None, keep: int = KEEP) -> str:
    """Write WEIGHTS (original name -> value) as checkpoint ``DIRECTORY/model.ckpt-STEP`` (TensorFlow format) with
    its description (STEP, LOSSES, META), then name it newest in the state file; keeps the newest KEEP. Returns
    its prefix."""
    from tag.files import write_atomic
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, f"{PREFIX_NAME}-{int(step)}")
    write_weights(prefix, weights)
    desc = {**(meta or {}), "format": FORMAT, "version": VERSION, "step": int(step),
            "losses": [float(x) for x in losses], "variables": sorted(weights)}
    write_atomic(prefix + META_SUFFIX, json.dumps(desc))
    older = sorted({p[: -len(".index")] for p in glob.glob(os.path.join(directory, f"{PREFIX_NAME}-*.index"))}
                   - {prefix}, key=_step_of)
    kept = older[-(keep - 1):] if keep > 1 else []
    _write_state(directory, kept + [prefix])
    for old in older[: len(older) - len(kept)]:
        for f in glob.glob(old + ".*"):
            os.remove(f)
    return prefix


class Checkpointer:
    """Read and assign ops for the variables of GRAPH (a ``tf.Graph`` not yet finalized), grouped by the
    original variable each one copies (``names``: original names, sorted). COPIES (original name -> names of its
    copies in GRAPH) says the grouping, e.g. a host program's own copies; without it every variable op of GRAPH
    is grouped by name (``w/replica_2`` copies ``w``)."""

    def __init__(self, graph: Any, copies: Mapping[str, Sequence[str]] | None = None):
        tf = import_tf()
        if copies is not None:
            copies = {name: [graph.get_operation_by_name(c) for c in names] for name, names in copies.items()}
        else:
            copies = {}
            for op in graph.get_operations():
                if op.type in _VARIABLE_OPS and not op.name.startswith(SKIP_PREFIXES):
                    copies.setdefault(original_name(op.name), []).append(op)
        self.names: list[str] = sorted(copies)
        self._reads: list[Any] = []
        self._copy_reads: list[list[Any]] = []
        self._feeds: list[Any] = []
        self._assigns: list[list[Any]] = []
        with graph.as_default():
            for name in self.names:
                ops = sorted(copies[name], key=lambda o: o.name)
                dtype = ops[0].get_attr("dtype")
                reads, assigns = [], []
                with tf.name_scope(f"tag_checkpoint/{name}/"):
                    value = tf.compat.v1.placeholder(dtype, name="value")
                    for op in ops:
                        with tf.device(op.device):
                            if _VARIABLE_OPS[op.type] == "resource":
                                reads.append(tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=dtype))
                                assigns.append(tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value))
                            else:
                                reads.append(tf.identity(op.outputs[0]))
                                assigns.append(tf.raw_ops.Assign(ref=op.outputs[0], value=value,
                                                                 validate_shape=False))
                self._reads.append(reads[0])       # every copy holds the same value after a step
                self._copy_reads.append(reads)
                self._feeds.append(value)
                self._assigns.append(assigns)

    def weights(self, sess: Any) -> dict[str, np.ndarray]:
        """One value per original variable, read from the running graph."""
        values = sess.run(self._reads) if self._reads else []
        return {n: np.asarray(v) for n, v in zip(self.names, values, strict=True)}

    def all_copies(self, sess: Any) -> dict[str, list[np.ndarray]]:
        """Every copy's value, by original variable (copies in name order)."""
        values = sess.run(self._copy_reads) if self._copy_reads else []
        return {n: [np.asarray(x) for x in v] for n, v in zip(self.names, values, strict=True)}

    def save(self, sess: Any, directory: str | os.PathLike, *, step: int, losses: Sequence[float],
             meta: dict[str, Any] | None = None, keep: int = KEEP) -> str:
        """Write checkpoint ``DIRECTORY/model.ckpt-STEP`` (TensorFlow format) with its description (STEP,
        LOSSES, META), then name it newest in the state file; keeps the newest KEEP. Returns its prefix."""
        return save_weights_checkpoint(self.weights(sess), directory, step=step, losses=losses, meta=meta, keep=keep)

    def restore(self, sess: Any, path: str | os.PathLike) -> tuple[int, list[float]]:
        """Assign the values of checkpoint PATH (a directory: its newest; or a prefix) to every copy;
        returns (step, losses so far) from its description ((0, []) for a checkpoint tag did not write).
        TagError if it does not hold exactly this graph's variables with the same shapes."""
        prefix = _prefix_of(path)
        weights = read_weights(prefix)
        meta = read_checkpoint_meta(prefix) if os.path.exists(prefix + META_SUFFIX) else {"step": 0, "losses": []}
        missing = sorted(set(self.names) - set(weights))[:3]
        if missing:
            extra = sorted(set(weights) - set(self.names))[:3]
            raise TagError(f"{prefix}: saved for another graph (variables differ: missing {missing}, unknown "
                           f"{extra or '-'}); resume with the same model, or start without --resume")
        feed = {}
        for name, ph, read in zip(self.names, self._feeds, self._reads, strict=True):
            value = weights[name]
            want = read.shape
            if want.rank is not None and (want.rank != value.ndim or not want.is_compatible_with(value.shape)):
                raise TagError(f"{prefix}: {name} has shape {list(value.shape)} in the checkpoint, "
                               f"{want.as_list()} in this graph (another batch or model?)")
            feed[ph] = value
        if self._assigns:
            sess.run(self._assigns, feed_dict=feed)
        return int(meta["step"]), [float(x) for x in meta["losses"]]
