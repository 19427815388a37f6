"""Graph rewriter: turn a training GraphDef + a Strategy into one device-annotated GraphDef.

Every op of the training step gets one *instance* per device its op group runs on, and each instance
works on a contiguous range ``[start, end)`` of the global batch: replicas of an ``allreduce`` or
``ps`` group get the slices given by ``tag.strategy.batch_shares`` (uneven on unequal devices); ops of
a ``partition`` group run once, on the whole batch, on ``strategy.partition[op]``. Every node gets the
device string ``topology.tf_device(d)``; replica ``d`` of op ``x`` is named ``x/replica_d``, while ops
with one instance (placeholders, partitioned ops, the parameter server's updates) keep their names.

Tensors crossing between instances whose ranges differ:

* with a batch axis (IR ``TensorInfo.batch_axis``): sliced where they are produced, concatenated where
  they are consumed -- only the examples that change device move;
* gradient partial sums (batch-reduced, no batch axis): summed -- by ``CollectiveReduceV2`` among the
  replicas of an ``allreduce`` group (one fused collective per op group: gradients flattened,
  concatenated, all-reduced, split; group key per device set, instance key per collective), by
  ``AddN`` on the parameter server of a ``ps`` group, by ``AddN`` wherever else a whole-batch value is
  needed;
* anything else that depends on the batch (shapes, statistics): recomputed for the consumer's range.

Exactness: a TF1 gradient starts from a seed (``gradients/grad_ys_0``, a Fill of ones). When the loss
is a batch mean, the seed of an instance on ``s`` of ``B`` examples is set to ``s / B``; then every
backward tensor of the instance equals the matching slice of the single-device backward tensor and
every weight gradient is an exact partial sum, so sums of partial sums are the single-device
gradient and batch-axis tensors can be re-split freely between groups. The loss the result reports is
``sum_d (s_d / B) * loss_d``. (A loss that sums over the batch keeps seed 1 and sums the replicas'
losses; a summed loss plus batch-independent terms cannot be split and is refused.)

Graphs built with a concrete batch dimension (``Placeholder [32, 784]``) carry that number in
constants (``Reshape`` shapes, ``Tile`` multiples, a mean gradient's divisor, ...). Those constants are
found from the IR's batch axes and rescaled for each instance's share (and for ``batch_size=``).

Rules (documented choices):

* A variable belongs to the op group of its optimizer apply op (slots follow their variable; other
  variables follow their own op's group). ``allreduce``: one copy per replica device, every copy
  initialised from the same initial value (computed once). ``ps``: one copy on ``ps_device`` (state
  that replicas update with their own batch, BatchNorm moving statistics, stays per replica).
  ``partition``: one copy on the device of the variable's op.
* An op that reads or updates a variable runs where the variable's copy lives (TF colocates resource
  ops with their resource); ops of other groups read the copy on their device or the first one.
  Function-call ops (``If``/``StatelessIf`` of tf_keras BatchNorm, ``PartitionedCall``) stay on their
  group's device and may take handles from elsewhere; the function library is copied unchanged.
* Optimizer-update ops that depend on gradients run on the summed gradient (range = whole batch):
  once per replica device for ``allreduce`` (copies stay identical), once on ``ps_device`` for ``ps``.
  Sparse (IndexedSlices) updates get the indices and values of the whole batch, so the deduplication
  and scatter run as on one device.
* BatchNorm keeps per-replica batch statistics (as Horovod and MirroredStrategy do).
* ``strategy.sfb`` (sufficient-factor broadcasting): those weight gradients are not summed but
  recomputed on every replica from the gathered factors (the layer's input and output gradient).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    strategy = builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16))
    res = rewrite(gd, tg, strategy, topo)
    res.graph_def                      # every node on /job:worker/task:T/device:TYPE:I
    res.inputs                         # ['input', 'labels']: feed full batches under these names
    # sess.run(res.init); sess.run([res.train_op, res.loss], {"input:0": x, "labels:0": y})
"""
from __future__ import annotations

import gc
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import (  # noqa: E402
    attr_value_pb2, graph_pb2, node_def_pb2, tensor_pb2, tensor_shape_pb2)
from tensorflow.python.client import pywrap_tf_session as c_api  # noqa: E402
from tensorflow.python.framework import c_api_util  # noqa: E402
from tensorflow.python.framework import op_def_registry  # noqa: E402

from tag.errors import RewriteError, StrategyError  # noqa: E402
from tag.ir.op_types import FUNCTION_CALL_TYPES, PLACEHOLDER_TYPES, TF1_LOOP_TYPES, VARIABLE_TYPES  # noqa: E402
from tag.strategy.types import Strategy, batch_shares  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from tag.ir.types import TensorInfo, TrainingGraph
    from tag.cluster.topology import Topology

__all__ = ["RewriteResult", "rewrite", "collective_group_key"]

Range = tuple[int, int]

# Ops that take a variable (resource or ref) without changing it.
_VAR_READERS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "ResourceGather",
                          "ResourceGatherNd", "VariableShape", "Identity", "Snapshot", "Shape", "Size", "Rank"})
# Stateful ops that may nevertheless be recomputed (they only read).
_CLONABLE_STATEFUL = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"})
# op type -> input index that is a shape whose entries follow the op's output shape
_SHAPE_OPERAND = {
    "Reshape": 1, "Fill": 0, "BroadcastTo": 1, "StridedSliceGrad": 0, "Slice": 2, "RandomUniform": 0,
    "RandomStandardNormal": 0, "TruncatedNormal": 0, "StatelessRandomUniformV2": 0,
    "StatelessRandomNormalV2": 0, "Conv2DBackpropInput": 0, "Conv3DBackpropInputV2": 0,
    "DepthwiseConv2dNativeBackpropInput": 0, "AvgPoolGrad": 0, "AvgPool3DGrad": 0, "Empty": 0,
    "ScatterNd": 2,
}
# ops a loss may pass through between its batch reduction and the loss tensor
_LOSS_PASSTHROUGH = frozenset({"Identity", "AddV2", "Add", "AddN", "Sub", "Mul", "RealDiv", "Div", "Cast", "Neg",
                               "Reshape", "Squeeze"})
_SEED_RE = re.compile(r"(^|/)grad_ys_\d+$")   # tf.gradients' default grad_ys: Fill(shape(loss), 1)
_GRAD_SCOPE_RE = re.compile(r"(?:^|/)gradients(?:_\d+)?/(.+?)_grad/")
_FLOAT_TYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64})


@dataclass
class RewriteResult:
    """A rewritten training step and the names to run it by.

    ``inputs``: the original batch placeholders (full global batch; replicas slice them).
    ``train_op`` / ``loss`` / ``init``: op names to run (the loss is the global-batch mean).
    ``variables``: original variable name -> names of its copies in ``graph_def``.
    ``devices``: TF device string of every device that runs something.
    ``replicas``: replicated op group -> [(device index, first example, end example), ...].
    """

    graph_def: "tf.compat.v1.GraphDef"
    train_op: str
    loss: str | None
    init: str | None
    inputs: list[str]
    batch_size: int
    variables: dict[str, list[str]] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replicas: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)

    def copies(self, variable: str) -> list[str]:
        """Names of the copies of VARIABLE (one per replica for allreduce groups)."""
        return list(self.variables[variable])


def collective_group_key(device_strings: Iterable[str]) -> int:
    """A stable collective group key for a set of TF devices (same set -> same key, any graph)."""
    text = "|".join(sorted(device_strings))
    return 1 + int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") % (2 ** 30 - 1)


def rewrite(graph_def: "tf.compat.v1.GraphDef", graph: "TrainingGraph", strategy: Strategy,
            topology: "Topology", *, batch_size: int | None = None, train_op: str = "train_op",
            loss: str | None = "loss", init: str | None = "init", fuse_allreduce: bool = True,
            validate: bool = True) -> RewriteResult:
    """Rewrite GRAPH_DEF (analysed as GRAPH) to run STRATEGY on TOPOLOGY; returns a RewriteResult.

    ``batch_size`` overrides the global batch (default: ``graph.batch_size``). ``train_op``, ``loss``
    and ``init`` name the original ops to keep runnable (``loss``/``init`` may be absent).
    ``fuse_allreduce``: the gradients of each allreduce op group are summed by one collective over a
    concatenated buffer (as the simulator models it) instead of one collective per variable. With
    ``validate`` the result is imported into a fresh ``tf.Graph`` (shape inference) before it is
    returned. Raises RewriteError (naming the op) for what cannot be rewritten and StrategyError
    when the strategy does not fit the graph or the topology.
    """
    # The rewrite allocates many small objects; with large graphs alive in the process, cyclic GC passes
    # would dominate its run time (seconds), and it creates no reference cycles worth collecting.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Rewriter(graph_def, graph, strategy, topology, batch_size, train_op, loss, init,
                         fuse_allreduce).run(validate)
    finally:
        if was_enabled:
            gc.enable()


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _split(t: str) -> tuple[str, int]:
    """'op:1' -> ('op', 1); 'op' -> ('op', 0)."""
    if ":" in t:
        op, idx = t.rsplit(":", 1)
        return op, int(idx)
    return t, 0


def _tname(op: str, idx: int) -> str:
    return op if idx == 0 else f"{op}:{idx}"


def _attr_type(dtype: "tf.DType") -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype.as_datatype_enum)


def _tensor_proto(value: np.ndarray):
    """A TensorProto for a small numpy array (faster than tf.make_tensor_proto)."""
    value = np.asarray(value)
    proto = tensor_pb2.TensorProto(dtype=tf.as_dtype(value.dtype).as_datatype_enum)
    proto.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in value.shape]))
    proto.tensor_content = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
    return proto


def _fill_defaults(node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
    op_def = op_def_registry.get(node.op)
    if op_def is not None:
        for a in op_def.attr:
            if a.name not in node.attr and a.HasField("default_value"):
                node.attr[a.name].CopyFrom(a.default_value)
    return node


@dataclass
class _Inst:
    """One instance of an op: its node name, batch range, requested device and actual device."""

    name: str
    rng: Range
    key: int          # the device its op group asked for
    dev: int          # where it runs (a variable's copy for ops that take a variable)
    primary: bool = True


class _Rewriter:
    def __init__(self, graph_def, graph, strategy: Strategy, topology, batch_size, train_op, loss, init,
                 fuse: bool = True):
        self.fuse = fuse
        self.gd = graph_def
        self.ir = graph
        self.st = strategy
        self.topo = topology
        self.B_ref = int(graph.batch_size)
        self.B = int(batch_size if batch_size is not None else graph.batch_size)
        if self.B <= 0 or self.B_ref <= 0:
            raise StrategyError(f"batch size must be positive (got {self.B})")
        self.FULL: Range = (0, self.B)
        self.notes: list[str] = []
        self.nodes = {n.name: n for n in graph_def.node}
        if train_op not in self.nodes:
            raise RewriteError(f"train op {train_op!r} is not in the graph")
        self.train_op = train_op
        self.loss = loss if loss and loss in self.nodes else None
        self.init = init if init and init in self.nodes else None
        self._check_strategy()
        self.ir_index = {op.name: i for i, op in enumerate(graph.ops)}
        missing = [n for n in self.ir_index if n not in self.nodes]
        if missing:
            raise RewriteError(f"op {missing[0]!r} of the analysed graph is not in the GraphDef")
        self.tinfo: dict[str, "TensorInfo"] = {}
        for op in graph.ops:
            for k, t in enumerate(op.outputs):
                self.tinfo[_tname(op.name, k)] = t
        self.inputs = [n for n in graph.inputs if n in self.nodes]

    # -------------------------------------------------------------------------------- checks
    def _check_strategy(self) -> None:
        st, topo, ir = self.st, self.topo, self.ir
        if len(st.grouping.group_of_op) != len(ir.ops):
            raise StrategyError(f"grouping covers {len(st.grouping.group_of_op)} ops but the graph has {len(ir.ops)}")
        ngroups = len(topo.groups)
        for g, a in enumerate(st.actions):
            for p in a.placement:
                if not 0 <= p < ngroups:
                    raise StrategyError(f"op group {g} is placed on device group {p}, the topology has {ngroups}")
            if a.mode == "ps" and not 0 <= int(a.ps_device) < topo.num_devices:
                raise StrategyError(f"op group {g}: ps_device {a.ps_device} is not a device of the topology")
        for i, d in st.partition.items():
            if not 0 <= int(d) < topo.num_devices:
                raise StrategyError(f"op {i} is partitioned onto device {d}, the topology has {topo.num_devices}")
        groups = np.asarray(st.grouping.group_of_op)
        if len(groups) and (groups.min() < 0 or groups.max() >= len(st.actions)):
            raise StrategyError(f"grouping names op group {int(groups.max())}, "
                                f"the strategy has {len(st.actions)} actions")
        for i, op in enumerate(ir.ops):
            a = st.actions[int(st.grouping.group_of_op[i])]
            if a.mode == "partition":
                d = st.partition.get(i)
                if d is None:
                    raise StrategyError(f"op {op.name!r} is in a partition group but has no device in "
                                        f"strategy.partition")
                if topo.devices[int(d)].group not in a.placement:
                    raise StrategyError(f"op {op.name!r} is partitioned onto device {d}, outside its group's placement")

    # -------------------------------------------------------------------------------- driver
    def run(self, validate: bool) -> RewriteResult:
        self._prune_and_order()
        self._tfg = None
        self._const_rules()
        self._flags()
        self._variables()
        self._keys()
        if not self.seeds and any(r != self.FULL for keys in self.keys.values() for r, _ in keys):
            raise RewriteError(f"train op {self.train_op!r}: no TF1 gradient seed (a Fill named gradients/grad_ys_N) "
                               f"was found, so replicas' gradients cannot be weighted by their batch shares")
        self._emit_all()
        fetch_train, fetch_loss, fetch_init = self._fetches()
        out = graph_pb2.GraphDef()
        out.versions.CopyFrom(self.gd.versions)
        out.library.CopyFrom(self.gd.library)
        out.node.extend(self.out_nodes)
        if validate:
            self._validate(out)
        devices = sorted({n.device for n in out.node if n.device})
        variables = {v: [i.name for i in self.insts[v]] for v in self.var_copies}
        replicas = {}
        for g, a in enumerate(self.st.actions):
            if a.mode != "partition":
                devs, ranges = self._replicas(g)
                replicas[g] = [(d, r[0], r[1]) for d, r in zip(devs, ranges)]
        return RewriteResult(out, fetch_train, fetch_loss, fetch_init, list(self.inputs), self.B,
                             variables, devices, self.notes, replicas)

    # -------------------------------------------------------------------------------- structure
    def _prune_and_order(self) -> None:
        roots = [self.train_op] + [n for n in (self.loss, self.init) if n] + list(self.ir_index) + self.inputs
        keep: set[str] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in keep:
                continue
            if n not in self.nodes:
                raise RewriteError(f"an input of the graph names the missing op {n!r}")
            keep.add(n)
            for i in self.nodes[n].input:
                stack.append(_split(i.lstrip("^"))[0])
        # topological order (Kahn), original node order as tie-break
        pos = {name: i for i, name in enumerate(self.nodes)}
        names = sorted(keep, key=pos.__getitem__)
        indeg = {n: 0 for n in names}
        succ: dict[str, list[str]] = {n: [] for n in names}
        # op -> [(consumer, output index, input slot)]
        self.consumers: dict[str, list[tuple[str, int, int]]] = {n: [] for n in names}
        for n in names:
            node = self.nodes[n]
            if node.op in TF1_LOOP_TYPES:
                raise RewriteError(f"op {n!r}: TF1 while-loop frames ({node.op}) cannot be split between devices; "
                                   f"build the loop with control flow v2 (a While op)")
            seen = set()
            for slot, i in enumerate(node.input):
                p, k = _split(i.lstrip("^"))
                if not i.startswith("^"):
                    self.consumers[p].append((n, k, slot))
                if p not in seen:
                    seen.add(p)
                    succ[p].append(n)
                    indeg[n] += 1
        import heapq
        ready = [(pos[n], n) for n in names if indeg[n] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, n = heapq.heappop(ready)
            order.append(n)
            for m in succ[n]:
                indeg[m] -= 1
                if indeg[m] == 0:
                    heapq.heappush(ready, (pos[m], m))
        if len(order) != len(names):
            stuck = next(n for n in names if indeg[n] > 0)
            raise RewriteError(f"op {stuck!r} is on a cycle; the training step must be acyclic")
        self.order = order

    @property
    def tfg(self) -> "tf.Graph":
        """The pruned original graph imported into Python (only built when the IR lacks an answer)."""
        if self._tfg is None:
            sub = graph_pb2.GraphDef()
            sub.versions.CopyFrom(self.gd.versions)
            sub.library.CopyFrom(self.gd.library)
            sub.node.extend(self.nodes[n] for n in self.order)
            g = tf.Graph()
            with g.as_default():
                try:
                    tf.graph_util.import_graph_def(sub, name="")
                except (ValueError, tf.errors.OpError) as err:
                    raise RewriteError(f"the training graph does not import: {str(err).splitlines()[0]}") from None
            self._tfg = g
        return self._tfg

    def _tensor(self, t: str):
        op, k = _split(t)
        return self.tfg.get_operation_by_name(op).outputs[k]

    def _dtype(self, t: str) -> "tf.DType":
        info = self.tinfo.get(_tname(*_split(t)))
        if info is not None and info.dtype:
            try:
                return tf.as_dtype(info.dtype).base_dtype
            except TypeError:
                pass
        op, k = _split(t)
        node = self.nodes[op]
        for a in ("T", "dtype"):
            if k == 0 and a in node.attr and node.attr[a].type:
                return tf.as_dtype(node.attr[a].type).base_dtype
        return self._tensor(t).dtype.base_dtype

    def _batch_axis(self, t: str) -> int | None:
        info = self.tinfo.get(_tname(*_split(t)))
        return None if info is None else info.batch_axis

    def _ref_shape(self, t: str) -> list[int | None] | None:
        """Shape of T at the reference batch (IR first, else TF's static shape)."""
        info = self.tinfo.get(_tname(*_split(t)))
        if info is not None:
            return None if info.shape is None else list(info.shape)
        shape = self._tensor(t).shape
        return None if shape.rank is None else shape.as_list()

    def _phase(self, op: str) -> str | None:
        i = self.ir_index.get(op)
        return None if i is None else self.ir.ops[i].phase

    # -------------------------------------------------------------------------------- flags
    def _flags(self) -> None:
        """bd: depends on the batch; gd: depends on a gradient seed; agg: update op on summed gradients."""
        self.seeds = {n for n in self.order if self.nodes[n].op == "Fill" and _SEED_RE.search(n)}
        inputs = set(self.inputs)
        self.bd: dict[str, bool] = {}
        self.gd_: dict[str, bool] = {}
        for n in self.order:
            data_in = [_split(i)[0] for i in self.nodes[n].input if not i.startswith("^")]
            self.bd[n] = n in inputs or n in self.seeds or n in self.const_scale or any(self.bd[p] for p in data_in)
            self.gd_[n] = n in self.seeds or any(self.gd_[p] for p in data_in)
        self.agg: dict[str, bool] = {}
        for n in reversed(self.order):
            self.agg[n] = self._phase(n) == "update" and (
                self.gd_[n] or any(self.agg.get(c, False) for c, _, _ in self.consumers[n]))
        self.loss_is_mean = self._loss_kind() == "mean"

    def _loss_kind(self) -> str:
        """'mean' if the loss averages over the batch (instances weight their seeds and losses by
        s / B), 'sum' if it sums over it (weights 1); found by walking from the loss to its batch reduction."""
        t, steps, constant_term = self.loss, 0, None
        while t and steps < 64:
            steps += 1
            node = self.nodes[_split(t)[0]]
            if node.op == "Mean":
                return "mean"
            if node.op in ("Sum", "L2Loss"):
                if constant_term is not None:
                    raise RewriteError(f"loss {self.loss!r} sums over the batch and adds {constant_term!r}, which does "
                                       f"not depend on the batch; replicas cannot share such a loss (use a mean)")
                return "sum"
            data = [i for i in node.input if not i.startswith("^")]
            batch_inputs = [i for i in data if self.bd[_split(i)[0]]]
            if node.op not in _LOSS_PASSTHROUGH or not batch_inputs:
                break
            if node.op in ("AddV2", "Add", "AddN", "Sub") and len(batch_inputs) < len(data) and constant_term is None:
                constant_term = next(i for i in data if i not in batch_inputs)
            t = batch_inputs[0]
        return "mean"

    def _additive(self, t: str) -> bool:
        """A batch-reduced partial sum of gradients (sums over instances give the whole-batch value)."""
        op, _ = _split(t)
        return self.gd_[op] and self._batch_axis(t) is None and self._dtype(t) in _FLOAT_TYPES

    # -------------------------------------------------------------------------------- groups
    def _replicas(self, g: int) -> tuple[list[int], list[Range]]:
        cache = self.__dict__.setdefault("_rep_cache", {})
        if g not in cache:
            devs = self.st.devices_of(g, self.topo)
            if not devs:
                raise StrategyError(f"op group {g} is placed on no device")
            shares = batch_shares([self.topo.devices[d].peak_flops for d in devs], self.B)
            ranges, start = [], 0
            for s in shares:
                ranges.append((start, start + s))
                start += s
            cache[g] = (devs, ranges)
        return cache[g]

    def _group(self, op: str) -> int | None:
        i = self.ir_index.get(op)
        return None if i is None else int(self.st.grouping.group_of_op[i])

    def _ir_keys(self, op: str) -> list[tuple[Range, int]]:
        i = self.ir_index[op]
        g = self._group(op)
        a = self.st.actions[g]
        if a.mode == "partition":
            return [(self.FULL, int(self.st.partition[i]))]
        devs, ranges = self._replicas(g)
        if self._phase(op) == "update" and (self.agg[op] or not self.bd[op]):
            if a.mode == "allreduce":
                return [(self.FULL, d) for d in devs]
            return [(self.FULL, int(a.ps_device))]
        return list(zip(ranges, devs))

    # -------------------------------------------------------------------------------- variables
    def _var_of(self, t: str) -> str | None:
        """The variable op behind a tensor that is a variable handle/ref (through Identity), else None."""
        seen = 0
        while seen < 64:
            op, k = _split(t)
            node = self.nodes[op]
            if node.op in VARIABLE_TYPES:
                return op
            if node.op == "Identity" and node.input and node.attr["T"].type == tf.resource.as_datatype_enum:
                t = node.input[0]
                seen += 1
                continue
            return None
        return None

    def _vars_of_inputs(self, op: str) -> list[str]:
        cache = self.__dict__.setdefault("_vars_cache", {})
        if op not in cache:
            cache[op] = self._find_vars_of_inputs(op)
        return cache[op]

    def _find_vars_of_inputs(self, op: str) -> list[str]:
        out = []
        for i in self.nodes[op].input:
            if i.startswith("^"):
                continue
            v = self._var_of(i)
            if v is not None and v not in out:
                out.append(v)
        return out

    def _writes(self, op: str) -> bool:
        """Does OP (not a function call) update a variable it takes?"""
        node = self.nodes[op]
        if node.op in _VAR_READERS or node.op in VARIABLE_TYPES or node.op in FUNCTION_CALL_TYPES:
            return False
        return bool(self._vars_of_inputs(op))

    def _may_write(self, op: str) -> bool:
        """Like _writes, counting function calls that take variables (their bodies may assign)."""
        return self._writes(op) or (self.nodes[op].op in FUNCTION_CALL_TYPES and bool(self._vars_of_inputs(op)))

    def _variables(self) -> None:
        info = {v.name: v for v in self.ir.variables}
        slot_owner = {}
        for v in self.ir.variables:
            for s in v.slots:
                slot_owner[s] = v.name
        self.var_copies: dict[str, list[int]] = {}
        self.var_owner: dict[str, int | None] = {}
        writers: dict[str, list[str]] = {}
        for n in self.order:
            if n in self.ir_index and self._may_write(n):
                for v in self._vars_of_inputs(n):
                    writers.setdefault(v, []).append(n)
        var_order = [n for n in self.order if self.nodes[n].op in VARIABLE_TYPES]
        # trainable variables before slots: a slot lives where its variable lives
        var_order.sort(key=lambda n: n in slot_owner and slot_owner[n] in self.nodes)
        for n in var_order:
            v = info.get(n)
            parent = slot_owner.get(n)
            if parent in self.var_copies:
                self.var_owner[n] = self.var_owner[parent]
                self.var_copies[n] = list(self.var_copies[parent])
                continue
            owner = None
            if v is not None and v.apply_op in self.ir_index:
                owner = self._group(v.apply_op)
            if owner is None:
                owner = self._group(n)
            self.var_owner[n] = owner
            if owner is None:
                self.var_copies[n] = [self._main_device()]
                continue
            a = self.st.actions[owner]
            if a.mode == "allreduce":
                copies = self._replicas(owner)[0]
            elif a.mode == "ps":
                per_replica = (v is None or v.kind == "state") and any(
                    any(r != self.FULL for r, _ in self._ir_keys(w)) for w in writers.get(n, []))
                copies = self._replicas(owner)[0] if per_replica else [int(a.ps_device)]
            else:
                i = self.ir_index.get(n)
                d = self.st.partition.get(i) if i is not None else None
                if d is None and v is not None and v.apply_op in self.ir_index:
                    d = self.st.partition.get(self.ir_index[v.apply_op])
                copies = [int(d) if d is not None else self._replicas(owner)[0][0]]
            self.var_copies[n] = list(copies)

    def _main_device(self) -> int:
        """Where ops without a better home go: the first device of the first input's group, else 0."""
        for n in self.inputs:
            g = self._group(n)
            if g is not None:
                a = self.st.actions[g]
                if a.mode == "partition":
                    return int(self.st.partition[self.ir_index[n]])
                return self._replicas(g)[0][0]
        return 0

    def _device_for(self, op: str, key: int) -> int:
        vs = self._vars_of_inputs(op)
        if not vs or self.nodes[op].op in FUNCTION_CALL_TYPES:
            return key
        cand = [d for d in self.var_copies[vs[0]] if all(d in self.var_copies[v] for v in vs[1:])]
        if not cand:
            raise RewriteError(f"op {op!r} uses variables {', '.join(vs)} whose copies share no device")
        return key if key in cand else cand[0]

    # -------------------------------------------------------------------------------- instance keys
    def _keys(self) -> None:
        """Instance keys (range, requested device) of every op.

        Step ops follow their op group's action; variables their copies; ops that take a variable one
        per copy; other ops outside the analysed step follow their batch-dependent producer (the loss
        of a static-shape graph, metrics), else sit with their first consumer ("home").
        """
        self.keys: dict[str, list[tuple[Range, int]]] = {}
        for n in self.order:
            node = self.nodes[n]
            if node.op in VARIABLE_TYPES:
                self.keys[n] = [(self.FULL, c) for c in self.var_copies[n]]
            elif node.op in PLACEHOLDER_TYPES or n in self.inputs:
                # batch sources run once, whole batch (an iterator must not be read once per replica)
                if n in self.ir_index:
                    self.keys[n] = [(self.FULL, self._placeholder_home(n))]
            elif n in self.ir_index and self.consumers[n] and all(
                    c in self.inputs and c in self.ir_index for c, _, _ in self.consumers[n]):
                # what feeds a batch source (the iterator resource) goes with it
                self.keys[n] = [(self.FULL, self._placeholder_home(self.consumers[n][0][0]))]
            elif n in self.ir_index:
                self.keys[n] = self._ir_keys(n)
            elif self._vars_of_inputs(n) and node.op not in FUNCTION_CALL_TYPES:
                self.keys[n] = [(self.FULL, c) for c in self.var_copies[self._vars_of_inputs(n)[0]]]
            elif self.bd[n]:
                for i in self.nodes[n].input:
                    p = _split(i)[0]
                    if not i.startswith("^") and self.bd[p] and p in self.keys:
                        self.keys[n] = list(self.keys[p])
                        break
        for n in reversed(self.order):
            if n not in self.keys:
                self.keys[n] = [(self.FULL, self._home(n))]
        for n in self.order:
            if self._writes(n):
                self.keys[n] = self._writer_keys(n, self.keys[n])

    def _writer_keys(self, n: str, keys):
        copies = self.var_copies[self._vars_of_inputs(n)[0]]
        devs = [self._device_for(n, k) for _, k in keys]
        if sorted(devs) == sorted(copies) and len(set(devs)) == len(devs):
            return keys
        if all(r == self.FULL for r, _ in keys):
            return [(self.FULL, c) for c in copies]
        raise RewriteError(f"op {n!r} updates a variable whose copies ({copies}) do not match its replicas "
                           f"({devs}); put it in the variable's op group")

    def _placeholder_home(self, n: str) -> int:
        g = self._group(n)
        a = self.st.actions[g]
        if a.mode == "partition":
            return int(self.st.partition[self.ir_index[n]])
        return self._replicas(g)[0][0]

    def _home(self, n: str) -> int:
        """Device of an op outside the step: its first consumer's, else its first placed input's."""
        for c, _, _ in self.consumers[n]:
            if c in self.keys:
                return self._device_for(c, self.keys[c][0][1])
        for i in self.nodes[n].input:
            p = _split(i.lstrip("^"))[0]
            if p in self.keys:
                return self._device_for(p, self.keys[p][0][1])
        return self._main_device()

    # -------------------------------------------------------------------------------- constants
    def _const_rules(self) -> None:
        """For each batch-dependent constant: the flat positions that scale with the batch."""
        self.const_scale: dict[str, list[int]] = {}
        for n in self.order:
            node = self.nodes[n]
            if node.op != "Const":
                continue
            dtype = tf.as_dtype(node.attr["dtype"].type)
            if dtype not in (tf.int32, tf.int64) and not (dtype in _FLOAT_TYPES and self._is_scalar(node)):
                continue
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.ndim > 1 or value.size > 16:
                continue
            pos = self._scaled_positions(n, value.reshape(-1), dtype)
            if pos:
                self.const_scale[n] = sorted(pos)

    @staticmethod
    def _is_scalar(node) -> bool:
        return len(node.attr["value"].tensor.tensor_shape.dim) == 0

    def _scaled_positions(self, n: str, v: np.ndarray, dtype) -> set[int]:
        pos: set[int] = set()
        B = self.B_ref
        is_int = dtype in (tf.int32, tf.int64)
        # R1: shape operand of an op whose output has a batch axis
        for c, _, slot in self.consumers[n]:
            cop = self.nodes[c].op
            if _SHAPE_OPERAND.get(cop) != slot or not is_int or v.size == 0:
                continue
            if cop == "Tile":
                continue
            ax = self._batch_axis(c)
            shape = self._ref_shape(c) if ax is not None else None
            if ax is not None and shape is not None and ax < v.size and shape[ax] is not None \
                    and v[ax] == shape[ax] and v[ax] % B == 0:
                pos.add(ax)
        for c, _, slot in self.consumers[n]:
            if self.nodes[c].op == "Tile" and slot == 1 and is_int:
                ax = self._batch_axis(c)
                src = self.nodes[c].input[0]
                if ax is not None and ax < v.size and self._batch_axis(src) is None and v[ax] % B == 0 and v[ax] > 0:
                    pos.add(ax)
        # R2/R3: a constant made by the gradient function of forward op F from F's static shapes
        m = _GRAD_SCOPE_RE.search(n)
        if m:
            fwd = self._forward_op(m.group(1))
            if fwd is not None:
                tensors = [i for i in self.nodes[fwd].input if not i.startswith("^")]
                if fwd in self.ir_index:
                    tensors += [t.name for t in self.ir.ops[self.ir_index[fwd]].outputs]
                for t in tensors:
                    ax = self._batch_axis(t)
                    shape = self._ref_shape(t) if ax is not None else None
                    if shape is None or any(s is None for s in shape):
                        continue
                    numel = int(np.prod(shape)) if shape else 1
                    if is_int and v.size == len(shape) and v.size > 0 and list(v) == list(shape):
                        pos.add(ax)
                    elif v.size == 1 and self._is_scalar(self.nodes[n]) and numel % B == 0 and v[0] == numel and (
                            # the element count of a batch tensor (tf.size folded), or a mean's divisor
                            (is_int and n.rsplit("/", 1)[-1].startswith("Size"))
                            or (not is_int and self.nodes[fwd].op == "Mean")):
                        pos.add(0)
                if self.nodes[fwd].op == "Mean" and v.size == 1 and self._is_scalar(self.nodes[n]):
                    tin, tout = self.nodes[fwd].input[0], _tname(fwd, 0)
                    ok = self._batch_axis(tin) is not None and tout in self.tinfo and self._batch_axis(tout) is None
                    sin, sout = (self._ref_shape(tin), self._ref_shape(tout)) if ok else (None, None)
                    if ok and sin and sout is not None and None not in sin and None not in sout:
                        factor = int(np.prod(sin)) // max(int(np.prod(sout)) if sout else 1, 1)
                        if v[0] == factor and factor % B == 0:
                            pos.add(0)
        return pos

    def _forward_op(self, scoped: str) -> str | None:
        """The forward op whose gradient scope is SCOPED ('a/b' for 'gradients/a/b_grad/...')."""
        cand = scoped
        while True:
            if cand in self.nodes:
                return cand
            m = _GRAD_SCOPE_RE.search(cand + "/")
            if not m:
                return None
            cand = m.group(1)

    def _const_value(self, n: str, size: int) -> node_def_pb2.NodeDef | None:
        """A copy of Const N rescaled for an instance on SIZE examples (None: unchanged)."""
        pos = self.const_scale.get(n)
        if not pos or size == self.B_ref:
            return None
        node = self.nodes[n]
        value = tf.make_ndarray(node.attr["value"].tensor)
        flat = value.reshape(-1).copy()
        for p in pos:
            if np.issubdtype(flat.dtype, np.integer):
                if (int(flat[p]) * size) % self.B_ref:
                    raise RewriteError(f"constant {n!r} ({flat[p]}) cannot be split to {size} of {self.B_ref} examples")
                flat[p] = int(flat[p]) * size // self.B_ref
            else:
                flat[p] = flat[p] * size / self.B_ref
        new = node_def_pb2.NodeDef()
        new.CopyFrom(node)
        new.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(flat.reshape(value.shape)))
        return new

    # -------------------------------------------------------------------------------- emission
    def _emit_all(self) -> None:
        self.out_nodes: list[node_def_pb2.NodeDef] = []
        self.used_names: set[str] = set(self.nodes)
        self.insts: dict[str, list[_Inst]] = {}
        self.by_key: dict[tuple[str, Range, int], _Inst] = {}
        self.memo: dict[tuple, str] = {}
        self.coll: dict[tuple, dict[int, str]] = {}
        self.instance_keys: set[int] = set()
        self.instance_key: dict[tuple, int] = {}
        token = hashlib.sha1()
        token.update(self.st.to_json().encode())
        token.update(repr(sorted(self.nodes)).encode())
        self.token = token.hexdigest()
        self.counts = {"slices": 0, "concats": 0, "sums": 0, "allreduces": 0, "fused allreduces": 0, "clones": 0}
        self.sfb = self._sfb_tensors()
        self._plan_fusion()
        for n in self.order:
            keys = self.keys[n]
            names = self._instance_names(n, keys)
            self.insts[n] = []
            for (rng, key), name in zip(keys, names):
                self._emit(n, rng, key, name, primary=True)
        self._emit_fusions()
        for k, v in self.counts.items():
            if v:
                self.notes.append(f"{v} {k} added")

    def _instance_names(self, n: str, keys) -> list[str]:
        if len(keys) == 1:
            return [n]
        names = []
        for rng, key in keys:
            name = f"{n}/replica_{key}"
            if name in self.nodes:
                raise RewriteError(f"op {n!r}: the name {name!r} of its replica is taken in the graph")
            names.append(name)
        if len(set(names)) != len(names):
            raise RewriteError(f"op {n!r} has two instances on one device")
        return names

    def _fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.used_names:
            name = f"{base}_{i}"
            i += 1
        self.used_names.add(name)
        return name

    def _emit(self, n: str, rng: Range, key: int, name: str, primary: bool) -> _Inst:
        orig = self.nodes[n]
        dev = self._device_for(n, key)
        inst = _Inst(name, rng, key, dev, primary)
        node = node_def_pb2.NodeDef()
        if orig.op == "Const":
            scaled = self._const_value(n, rng[1] - rng[0])
            node.CopyFrom(scaled if scaled is not None else orig)
        else:
            node.CopyFrom(orig)
        node.name = name
        self.used_names.add(name)
        node.device = self.topo.tf_device(dev)
        for a in ("_class", "_output_shapes"):
            if a in node.attr:
                del node.attr[a]
        size = rng[1] - rng[0]
        if orig.op in VARIABLE_TYPES and orig.op == "VarHandleOp" and name != n:
            node.attr["shared_name"].s = name.encode()
        if orig.op in PLACEHOLDER_TYPES and self.B != self.B_ref and "shape" in node.attr:
            ax = self._batch_axis(n)
            dims = node.attr["shape"].shape.dim
            if ax is not None and ax < len(dims) and dims[ax].size > 0:
                dims[ax].size = dims[ax].size // self.B_ref * self.B
        if size != self.B_ref and "output_shapes" in node.attr:
            for s in node.attr["output_shapes"].list.shape:
                s.Clear()
                s.unknown_rank = True
        del node.input[:]
        data, ctrl = [], []
        for slot, i in enumerate(orig.input):
            if i.startswith("^"):
                ctrl.extend(self._control(i[1:], n, rng, key))
            else:
                data.append(self._resolve(i, rng, dev, n, key))
        if n in self.seeds and size != self.B and self.loss_is_mean:
            dtype = self._dtype(_tname(n, 0))
            c = self._const(f"{name}/tag_seed_scale", np.array(size / self.B, dtype=dtype.as_numpy_dtype), dev)
            data[1] = c
        node.input.extend(data)
        seen = set()
        for c in ctrl:
            if c not in seen:
                seen.add(c)
                node.input.append("^" + c)
        self.out_nodes.append(node)
        self.insts.setdefault(n, []).append(inst)
        self.by_key.setdefault((n, rng, key), inst)
        return inst

    def _control(self, p: str, consumer: str, rng: Range, key: int) -> list[str]:
        """Control inputs: the matching instance when both ops have the same instances, else all of them."""
        if self.keys.get(consumer) == self.keys.get(p):
            inst = self.by_key.get((p, rng, key))
            if inst is not None:
                return [inst.name]
        return [i.name for i in self.insts[p] if i.primary]

    # -------------------------------------------------------------------------------- resolution
    def _pick(self, insts: list[_Inst], dev: int, key: int | None = None) -> _Inst:
        for i in insts:
            if i.dev == dev:
                return i
        if key is not None:
            for i in insts:
                if i.key == key:
                    return i
        return insts[0]

    def _resolve(self, t: str, rng: Range, dev: int, consumer: str, ckey: int) -> str:
        """Name of the tensor that gives instance (RNG, DEV) of CONSUMER the value of T."""
        p, k = _split(t)
        insts = self.insts[p]
        if self.nodes[p].op in VARIABLE_TYPES or self._var_of(t) is not None:
            same = [i for i in insts if i.dev == dev]
            if not same and self.nodes[consumer].op in FUNCTION_CALL_TYPES:
                same = insts[:1]
            if not same:
                raise RewriteError(f"op {consumer!r} needs variable {p!r} on {self.topo.tf_device(dev)}, "
                                   f"where it has no copy")
            return _tname(same[0].name, k)
        if not self.bd[p]:
            return _tname(self._pick(insts, dev, ckey).name, k)
        same = [i for i in insts if i.rng == rng]
        if _tname(p, k) in self.sfb:                      # recomputed on every device that needs it, not shipped
            same = [i for i in same if i.dev == dev]
        if same:
            return _tname(self._pick(same, dev, ckey).name, k)
        if self._batch_axis(t) is not None:
            return self._resplit(t, rng, dev)
        if self._additive(t):
            if rng == self.FULL:
                return self._aggregate(t, dev, consumer)
            parts = self._tiling(p, rng)
            if parts is not None:
                return self._sum(t, [_tname(i.name, k) for i in parts], rng, dev)
        return _tname(self._clone(p, rng, dev, consumer).name, k)

    def _tiling(self, p: str, rng: Range) -> list[_Inst] | None:
        """Primary instances of P whose ranges exactly tile RNG, or None."""
        prim = sorted((i for i in self.insts[p] if i.primary), key=lambda i: i.rng)
        out, at = [], rng[0]
        for i in prim:
            if i.rng[0] == at and i.rng[1] <= rng[1]:
                out.append(i)
                at = i.rng[1]
        return out if at == rng[1] and out else None

    def _cover(self, p: str, rng: Range, dev: int) -> list[_Inst]:
        """Instances of P covering RNG: one that contains it (prefer DEV) or the primary tiling."""
        containing = [i for i in self.insts[p] if i.rng[0] <= rng[0] and rng[1] <= i.rng[1]]
        if containing:
            return [self._pick(containing, dev)]
        prim = sorted((i for i in self.insts[p] if i.primary), key=lambda i: i.rng)
        chosen: dict[Range, _Inst] = {}
        for i in prim:
            if i.rng not in chosen or i.dev == dev:
                chosen[i.rng] = i
        out = [chosen[r] for r in sorted(chosen) if r[0] < rng[1] and rng[0] < r[1]]
        at = rng[0]
        for i in out:
            if i.rng[0] > at:
                break
            at = max(at, i.rng[1])
        if at < rng[1]:
            raise RewriteError(f"op {p!r}: its instances do not cover examples {rng[0]}..{rng[1] - 1}")
        return out

    def _rows_per_example(self, t: str) -> int:
        ax = self._batch_axis(t)
        shape = self._ref_shape(t)
        if shape is None or ax is None or ax >= len(shape) or shape[ax] is None or shape[ax] % self.B_ref:
            raise RewriteError(f"tensor {t!r}: its batch axis {ax} has no static size that is a multiple of "
                               f"the batch {self.B_ref}, so it cannot be split between devices")
        return shape[ax] // self.B_ref

    def _resplit(self, t: str, rng: Range, dev: int) -> str:
        memo_key = ("resplit", t, rng, dev)
        if memo_key in self.memo:
            return self.memo[memo_key]
        p, k = _split(t)
        ax = self._batch_axis(t)
        rows = self._rows_per_example(t)
        parts = []
        for inst in self._cover(p, rng, dev):
            lo, hi = max(rng[0], inst.rng[0]), min(rng[1], inst.rng[1])
            if (lo, hi) == inst.rng:
                parts.append(_tname(inst.name, k))
            else:
                parts.append(self._slice(t, inst, (lo - inst.rng[0]) * rows, (hi - inst.rng[0]) * rows, ax))
        if len(parts) == 1:
            out = parts[0]
        else:
            out = self._concat(t, parts, ax, dev, rng)
        self.memo[memo_key] = out
        return out

    def _slice(self, t: str, inst: _Inst, begin: int, end: int, ax: int) -> str:
        memo_key = ("slice", t, inst.name, begin, end)
        if memo_key in self.memo:
            return self.memo[memo_key]
        p, k = _split(t)
        base = f"tag/slice/{p}_{k}/{inst.dev}_{begin}_{end}"
        name = self._fresh(base)
        dev = inst.dev
        b = self._const(name + "/begin", np.array([0] * ax + [begin], np.int32), dev)
        e = self._const(name + "/end", np.array([0] * ax + [end], np.int32), dev)
        s = self._const(name + "/strides", np.ones(ax + 1, np.int32), dev)
        node = node_def_pb2.NodeDef(name=name, op="StridedSlice", device=self.topo.tf_device(dev))
        node.input.extend([_tname(inst.name, k), b, e, s])
        node.attr["T"].CopyFrom(_attr_type(self._dtype(t)))
        node.attr["Index"].CopyFrom(_attr_type(tf.int32))
        mask = (1 << ax) - 1
        node.attr["begin_mask"].i = mask
        node.attr["end_mask"].i = mask
        self.out_nodes.append(_fill_defaults(node))
        self.counts["slices"] += 1
        self.memo[memo_key] = name
        return name

    def _concat(self, t: str, parts: list[str], ax: int, dev: int, rng: Range) -> str:
        p, k = _split(t)
        name = self._fresh(f"tag/concat/{p}_{k}/{dev}_{rng[0]}_{rng[1]}")
        a = self._const(name + "/axis", np.array(ax, np.int32), dev)
        node = node_def_pb2.NodeDef(name=name, op="ConcatV2", device=self.topo.tf_device(dev))
        node.input.extend(parts + [a])
        node.attr["N"].i = len(parts)
        node.attr["T"].CopyFrom(_attr_type(self._dtype(t)))
        node.attr["Tidx"].CopyFrom(_attr_type(tf.int32))
        self.out_nodes.append(node)
        self.counts["concats"] += 1
        return name

    def _sum(self, t: str, parts: list[str], rng: Range, dev: int) -> str:
        memo_key = ("sum", t, rng, dev)
        if memo_key in self.memo:
            return self.memo[memo_key]
        if len(parts) == 1:
            return parts[0]
        p, k = _split(t)
        name = self._fresh(f"tag/sum/{p}_{k}/{dev}")
        node = node_def_pb2.NodeDef(name=name, op="AddN", device=self.topo.tf_device(dev))
        node.input.extend(parts)
        node.attr["N"].i = len(parts)
        node.attr["T"].CopyFrom(_attr_type(self._dtype(t)))
        self.out_nodes.append(node)
        self.counts["sums"] += 1
        self.memo[memo_key] = name
        return name

    def _sfb_tensors(self) -> set[str]:
        """Gradients sent by sufficient-factor broadcasting (``strategy.sfb``), with the Identity ops
        between them and the op that computes them from batch-carrying factors."""
        out: set[str] = set()
        info = {v.name: v for v in self.ir.variables}
        for name in self.st.sfb:
            v = info.get(name)
            if v is None or not v.gradient:
                raise StrategyError(f"strategy.sfb names {name!r}, which is not a trainable variable with a gradient")
            t = _tname(*_split(v.gradient))
            while True:
                out.add(t)
                node = self.nodes[_split(t)[0]]
                if node.op != "Identity":
                    break
                t = _tname(*_split(node.input[0]))
        return out

    def _aggregate(self, t: str, dev: int, consumer: str) -> str:
        """The whole-batch sum of gradient partial sums T, on DEV, for an update op CONSUMER.

        Gradients in ``strategy.sfb`` are recomputed on the whole batch instead: their factors (the
        layer's input and output gradient, which have a batch axis) are gathered to DEV.
        """
        t = _tname(*_split(t))
        p, k = _split(t)
        if t in self.sfb:
            return _tname(self._clone(p, self.FULL, dev, consumer).name, k)
        fused = self._fused(t, dev)
        if fused is not None:
            return fused
        g = self._group(consumer)
        if g is not None and self.st.actions[g].mode == "allreduce":
            devs, ranges = self._replicas(g)
            if len(devs) > 1 and dev in devs:
                return self._allreduce(t, devs, ranges)[dev]
        parts = self._tiling(p, self.FULL)
        if parts is None:
            raise RewriteError(f"gradient {t!r}: its instances do not tile the batch, cannot sum them")
        return self._sum(t, [_tname(i.name, k) for i in parts], self.FULL, dev)

    def _allreduce(self, t: str, devs: list[int], ranges: list[Range]) -> dict[int, str]:
        """One CollectiveReduceV2 per device of DEVS summing T's partial sums (ranges RANGES)."""
        memo_key = (t, tuple(devs), tuple(ranges))
        if memo_key in self.coll:
            return self.coll[memo_key]
        p, k = _split(t)
        partials = {d: self._resolve(t, r, d, p, d) for d, r in zip(devs, ranges)}
        out = {d: self._collective(f"tag/allreduce/{p}_{k}/{d}", partials[d], d, devs, self._dtype(t), t)
               for d in devs}
        self.counts["allreduces"] += 1
        self.coll[memo_key] = out
        return out

    def _collective(self, base: str, partial: str, dev: int, devs: list[int], dtype, what: str) -> str:
        """A CollectiveReduceV2 (sum) of PARTIAL on DEV over DEVS; WHAT names the instance for its key."""
        dstrs = [self.topo.tf_device(d) for d in devs]
        ikey = self.instance_key.get((what, tuple(devs)))
        if ikey is None:
            ikey = 1 + int.from_bytes(hashlib.sha1(f"{self.token}|{what}|{dstrs}".encode()).digest()[:4],
                                      "big") % (2 ** 30 - 1)
            while ikey in self.instance_keys:
                ikey = ikey % (2 ** 30 - 1) + 1
            self.instance_keys.add(ikey)
            self.instance_key[(what, tuple(devs))] = ikey
        name = self._fresh(base)
        consts = [self._const(f"{name}/{key}", np.array(v, np.int32), dev)
                  for key, v in (("group_size", len(devs)), ("group_key", collective_group_key(dstrs)),
                                 ("instance_key", ikey))]
        node = node_def_pb2.NodeDef(name=name, op="CollectiveReduceV2", device=self.topo.tf_device(dev))
        node.input.extend([partial] + consts)
        node.attr["T"].CopyFrom(_attr_type(dtype))
        node.attr["merge_op"].s = b"Add"
        node.attr["final_op"].s = b"Id"
        # ring on CPUs (what FACTS.md verified); on GPUs TF's "auto" picks NCCL where it can
        cpu_only = all(self.topo.devices[d].tf_device_type == "CPU" for d in devs)
        node.attr["communication_hint"].s = b"ring" if cpu_only else b"auto"
        self.out_nodes.append(_fill_defaults(node))
        return name

    # -------------------------------------------------------------------------------- gradient fusion
    def _plan_fusion(self) -> None:
        """Gradients of one allreduce op group (and dtype) are summed by one fused collective, as the
        simulator models it: flattened, concatenated, all-reduced, split. Output names are reserved here;
        the collectives are built once every gradient exists (``_emit_fusions``)."""
        self.fusion: dict[str, tuple] = {}
        self.buckets: dict[tuple, list[str]] = {}
        self.bucket_out: dict[tuple, dict[str, dict[int, str]]] = {}
        self.buckets_used: list[tuple] = []
        if not self.fuse:
            return
        buckets: dict[tuple, list[str]] = {}
        for v in self.ir.variables:
            if v.kind != "trainable" or v.apply_op not in self.ir_index or not v.gradient:
                continue
            g = self._group(v.apply_op)
            if self.st.actions[g].mode != "allreduce" or len(self._replicas(g)[0]) < 2:
                continue
            t = _tname(*_split(v.gradient))
            shape = self._ref_shape(t) if t in self.tinfo else None
            if t in self.sfb or shape is None or None in shape or self._batch_axis(t) is not None \
                    or not self.gd_[_split(t)[0]] or t in buckets.get((g, self._dtype(t)), []):
                continue
            buckets.setdefault((g, self._dtype(t)), []).append(t)
        for key, ts in buckets.items():
            if len(ts) < 2:
                continue
            g = key[0]
            base = self._fresh(f"tag/fused_allreduce/group_{g}_{key[1].name}")
            self.buckets[key] = ts
            self.bucket_out[key] = {t: {d: self._fresh(f"{base}/grad_{j}/{d}") for d in self._replicas(g)[0]}
                                    for j, t in enumerate(ts)}
            for t in ts:
                self.fusion[t] = key

    def _fused(self, t: str, dev: int) -> str | None:
        key = self.fusion.get(t)
        if key is None or dev not in self._replicas(key[0])[0]:
            return None
        if key not in self.buckets_used:
            self.buckets_used.append(key)
        return self.bucket_out[key][t][dev]

    def _emit_fusions(self) -> None:
        for key in self.buckets_used:
            g, dtype = key
            ts = self.buckets[key]
            devs, ranges = self._replicas(g)
            sizes = [int(np.prod(self._ref_shape(t))) for t in ts]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
            base = self.bucket_out[key][ts[0]][devs[0]].rsplit("/", 2)[0]
            for d, r in zip(devs, ranges):
                flat = []
                for j, t in enumerate(ts):
                    partial = self._resolve(t, r, d, _split(t)[0], d)
                    flat.append(self._reshape(f"{base}/flat_{j}/{d}", partial, [-1], dtype, d))
                shape_axis = self._const(f"{base}/concat_{d}/axis", np.array(0, np.int32), d)
                concat = self._fresh(f"{base}/concat_{d}")
                node = node_def_pb2.NodeDef(name=concat, op="ConcatV2", device=self.topo.tf_device(d))
                node.input.extend(flat + [shape_axis])
                node.attr["N"].i = len(flat)
                node.attr["T"].CopyFrom(_attr_type(dtype))
                node.attr["Tidx"].CopyFrom(_attr_type(tf.int32))
                self.out_nodes.append(node)
                summed = self._collective(f"{base}/allreduce_{d}", concat, d, devs, dtype, f"fused|{g}|{dtype.name}")
                for j, t in enumerate(ts):
                    begin = self._const(f"{base}/split_{j}_{d}/begin", np.array([offsets[j]], np.int32), d)
                    size = self._const(f"{base}/split_{j}_{d}/size", np.array([sizes[j]], np.int32), d)
                    part = self._fresh(f"{base}/split_{j}_{d}")
                    node = node_def_pb2.NodeDef(name=part, op="Slice", device=self.topo.tf_device(d))
                    node.input.extend([summed, begin, size])
                    node.attr["T"].CopyFrom(_attr_type(dtype))
                    node.attr["Index"].CopyFrom(_attr_type(tf.int32))
                    self.out_nodes.append(node)
                    out = self.bucket_out[key][t][d]
                    self._reshape(out, part, self._ref_shape(t), dtype, d, exact_name=True)
            self.counts["fused allreduces"] += 1
            self.notes.append(f"op group {g}: {len(ts)} gradients all-reduced as one {dtype.name} buffer "
                              f"of {int(offsets[-1])} elements")

    def _reshape(self, name: str, tensor: str, shape, dtype, dev: int, exact_name: bool = False) -> str:
        if not exact_name:
            name = self._fresh(name)
        sh = self._const(f"{name}/shape", np.array(list(shape), np.int32), dev)
        node = node_def_pb2.NodeDef(name=name, op="Reshape", device=self.topo.tf_device(dev))
        node.input.extend([tensor, sh])
        node.attr["T"].CopyFrom(_attr_type(dtype))
        node.attr["Tshape"].CopyFrom(_attr_type(tf.int32))
        self.out_nodes.append(node)
        return name

    def _clone(self, p: str, rng: Range, dev: int, consumer: str) -> _Inst:
        """An extra instance of P computed on RNG at DEV (for a consumer that needs exactly that)."""
        inst = self.by_key.get((p, rng, dev))
        if inst is not None:
            return inst
        node = self.nodes[p]
        op_def = op_def_registry.get(node.op)
        if node.op in PLACEHOLDER_TYPES or node.op in VARIABLE_TYPES or self._writes(p) or (
                op_def is not None and op_def.is_stateful and node.op not in _CLONABLE_STATEFUL):
            raise RewriteError(f"op {consumer!r} needs {p!r} ({node.op}) for examples {rng[0]}..{rng[1] - 1}, "
                               f"which only its own instances compute, and {node.op} cannot be recomputed")
        name = self._fresh(f"{p}/tag_{dev}_{rng[0]}_{rng[1]}")
        self.counts["clones"] += 1
        return self._emit(p, rng, dev, name, primary=False)

    def _const(self, name: str, value: np.ndarray, dev: int) -> str:
        name = self._fresh(name)
        node = node_def_pb2.NodeDef(name=name, op="Const", device=self.topo.tf_device(dev))
        node.attr["dtype"].CopyFrom(_attr_type(tf.as_dtype(value.dtype)))
        node.attr["value"].tensor.CopyFrom(_tensor_proto(value))
        self.out_nodes.append(node)
        return name

    # -------------------------------------------------------------------------------- fetches
    def _fetches(self) -> tuple[str, str | None, str | None]:
        train = self._group_fetch(self.train_op)
        init = self._group_fetch(self.init) if self.init else None
        loss = None
        if self.loss:
            insts = [i for i in self.insts[self.loss] if i.primary]
            if len(insts) == 1:
                loss = insts[0].name
            else:
                loss = self._weighted_loss(self.loss, insts)
        return train, loss, init

    def _group_fetch(self, n: str) -> str:
        insts = [i for i in self.insts[n] if i.primary]
        if len(insts) == 1:
            return insts[0].name
        node = node_def_pb2.NodeDef(name=n, op="NoOp", device=self.topo.tf_device(insts[0].dev))
        node.input.extend("^" + i.name for i in insts)
        self.out_nodes.append(node)
        return n

    def _weighted_loss(self, n: str, insts: list[_Inst]) -> str:
        ranges = sorted(i.rng for i in insts)
        full = all(r == self.FULL for r in ranges)
        if full:
            return insts[0].name
        if self._tiling(n, self.FULL) is None:
            raise RewriteError(f"loss {n!r}: its instances do not tile the batch")
        dev = insts[0].dev
        dtype = self._dtype(_tname(n, 0))
        terms = []
        for i in sorted(insts, key=lambda i: i.rng):
            weight = (i.rng[1] - i.rng[0]) / self.B if self.loss_is_mean else 1.0
            w = self._const(f"{n}/tag_weight_{i.key}", np.array(weight, dtype=dtype.as_numpy_dtype), i.dev)
            name = self._fresh(f"{n}/tag_weighted_{i.key}")
            node = node_def_pb2.NodeDef(name=name, op="Mul", device=self.topo.tf_device(i.dev))
            node.input.extend([i.name, w])
            node.attr["T"].CopyFrom(_attr_type(dtype))
            self.out_nodes.append(node)
            terms.append(name)
        node = node_def_pb2.NodeDef(name=n, op="AddN", device=self.topo.tf_device(dev))
        node.input.extend(terms)
        node.attr["N"].i = len(terms)
        node.attr["T"].CopyFrom(_attr_type(dtype))
        self.out_nodes.append(node)
        return n

    # -------------------------------------------------------------------------------- validation
    def _validate(self, out: "tf.compat.v1.GraphDef") -> None:
        """Import OUT with TF's C++ importer (shape inference with constant folding of shapes)."""
        g = tf.Graph()
        opts = c_api.TF_NewImportGraphDefOptions()
        try:
            c_api.TF_ImportGraphDefOptionsSetPrefix(opts, "")
            with c_api_util.tf_buffer(out.SerializeToString()) as buf:
                with g._c_graph.get() as c_graph:  # noqa: SLF001 - the C graph is what TF's importer fills
                    c_api.TF_GraphImportGraphDefWithResults(c_graph, buf, opts)
        except (ValueError, tf.errors.OpError) as err:
            first = " ".join(str(err).split())
            raise RewriteError(f"the rewritten graph does not import: {first[:400]}") from None
        finally:
            c_api.TF_DeleteImportGraphDefOptions(opts)
