"""The rewriter's shared state: the inputs, the pruned original graph in topological order, and what
each op depends on (the batch, a gradient seed), plus lookups every concern needs (dtypes, shapes,
batch axes, op groups, replicas).

Each concern of the rewrite (variables, batch split, collectives, parameter server, SFB, loss,
instances) is a mixin over ``RewriteContext`` in its own module; ``tag.backend.rewrite.api`` combines
them into the rewriter. Attributes filled by a later pass are declared here with their meaning.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite.context import RewriteContext

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    ctx = RewriteContext(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    ctx._prune_and_order()
    ctx.order[:2]                      # original op names, producers first
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from tag.errors import RewriteError, StrategyError
from tag.ir.op_types import TF1_LOOP_TYPES
from tag.strategy.types import Strategy, batch_shares

from .graph_edit import FLOAT_TYPES, Instance, NodeBuilder, Range, canonical, split_tensor, tensor_name

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TensorInfo, TrainingGraph


class RewriteContext(NodeBuilder):
    """Inputs of one rewrite and the state its passes share (see the attribute comments)."""

    def __init__(self, graph_def: "tf.compat.v1.GraphDef", graph: "TrainingGraph", strategy: Strategy,
                 topology: "Topology", batch_size: int | None = None, train_op: str = "train_op",
                 loss: str | None = "loss", init: str | None = "init", fuse_allreduce: bool = True):
        self.fuse_allreduce = fuse_allreduce
        self.graph_def = graph_def
        self.ir = graph
        self.strategy = strategy
        self.topo = topology
        self.ref_batch = int(graph.batch_size)     # the global batch the graph was built (and analysed) for
        self.batch = int(batch_size if batch_size is not None else graph.batch_size)   # the batch to run
        if self.batch <= 0 or self.ref_batch <= 0:
            raise StrategyError(f"batch size must be positive (got {self.batch})")
        self.full_batch: Range = (0, self.batch)
        self.notes: list[str] = []
        self.nodes: dict[str, node_def_pb2.NodeDef] = {n.name: n for n in graph_def.node}
        if train_op not in self.nodes:
            raise RewriteError(f"train op {train_op!r} is not in the graph")
        self.train_op = train_op
        self.loss = loss if loss and loss in self.nodes else None
        self.init = init if init and init in self.nodes else None
        self._check_strategy()
        self.ir_index: dict[str, int] = {op.name: i for i, op in enumerate(graph.ops)}   # op name -> IR op index
        missing = [n for n in self.ir_index if n not in self.nodes]
        if missing:
            raise RewriteError(f"op {missing[0]!r} of the analysed graph is not in the GraphDef")
        self.tensor_info: dict[str, "TensorInfo"] = {}   # canonical tensor name -> its IR info
        for op in graph.ops:
            for k, t in enumerate(op.outputs):
                self.tensor_info[tensor_name(op.name, k)] = t
        self.inputs = [n for n in graph.inputs if n in self.nodes]
        self._tfg: tf.Graph | None = None
        self._replica_cache: dict[int, tuple[list[int], list[Range]]] = {}   # op group -> _replicas(g)
        self._vars_cache: dict[str, list[str]] = {}                          # op -> _vars_of_inputs(op)

        # ---- filled by the passes (in run order) ----
        self.order: list[str] = []        # kept original ops, topologically ordered
        # op -> [(consumer op, output index of op, input slot of the consumer)], data inputs only
        self.consumers: dict[str, list[tuple[str, int, int]]] = {}
        self.const_scale: dict[str, list[int]] = {}       # batch-dependent Const -> flat positions to rescale
        self.seeds: set[str] = set()                      # gradient seeds (gradients/grad_ys_N Fills)
        self.batch_dependent: dict[str, bool] = {}        # op -> its outputs depend on the batch
        self.grad_dependent: dict[str, bool] = {}         # op -> its outputs depend on a gradient seed
        self.on_summed_grads: dict[str, bool] = {}        # op -> update op that runs on whole-batch gradients
        self.loss_is_mean = True                          # the loss averages (not sums) over the batch
        self.var_copies: dict[str, list[int]] = {}        # variable op -> devices of its copies
        self.var_owner: dict[str, int | None] = {}        # variable op -> op group that owns it
        self.placements: dict[str, list[tuple[Range, int]]] = {}   # op -> [(batch range, asked device)] per instance
        # output graph (during emission)
        self.out_nodes: list[node_def_pb2.NodeDef] = []
        self.used_names: set[str] = set()
        self.instances: dict[str, list[Instance]] = {}    # original op -> its instances, in emission order
        self.instance_at: dict[tuple[str, Range, int], Instance] = {}   # (op, range, asked device) -> instance
        self.memo: dict[tuple, str] = {}                  # (kind, tensor, range/instance, device) -> output tensor
        self.counts: dict[str, int] = {}                  # what was added -> how many (for the notes)
        self.token = ""                                   # hash of strategy and graph: seeds collective instance keys
        self.sfb_tensors: set[str] = set()                # gradients recomputed by SFB (and Identities before them)
        # collectives: (tensor, devices, ranges) -> {device: summed tensor}; (what, devices) -> instance key
        self.allreduce_memo: dict[tuple, dict[int, str]] = {}
        self.instance_key_of: dict[tuple[str, tuple[int, ...]], int] = {}
        self.taken_instance_keys: set[int] = set()
        # pipelines (``pipeline``): stage of each op group (None: no pipeline), micro-batch ranges,
        # stage -> (batch range, device) of its micro-batch instances
        self.stage_of_group: np.ndarray | None = None
        self.micro_ranges: list[Range] = []
        self._stage_instances: dict[int, list[tuple[Range, int]]] = {}
        # ops a ``deferred_w`` pipeline runs once per step on their stage's device (``pipeline``)
        self.deferred_ops: set[str] = set()

    # -------------------------------------------------------------------------------- checks
    def _check_strategy(self) -> None:
        """StrategyError unless every group, device and partition of the strategy exists."""
        st, topo, ir = self.strategy, self.topo, self.ir
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

    # -------------------------------------------------------------------------------- structure
    def _prune_and_order(self) -> None:
        """Keep the ops the fetches, the analysed step and the inputs need; order them (``order``) and
        record their data consumers (``consumers``)."""
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
                stack.append(split_tensor(i.lstrip("^"))[0])
        self.order = self._topological_order(keep)

    def _topological_order(self, keep: set[str]) -> list[str]:
        """KEEP in topological order (Kahn), original node order as tie-break; fills ``consumers``."""
        pos = {name: i for i, name in enumerate(self.nodes)}
        names = sorted(keep, key=pos.__getitem__)
        indeg = {n: 0 for n in names}
        succ: dict[str, list[str]] = {n: [] for n in names}
        self.consumers = {n: [] for n in names}
        for n in names:
            node = self.nodes[n]
            if node.op in TF1_LOOP_TYPES:
                raise RewriteError(f"op {n!r}: TF1 while-loop frames ({node.op}) cannot be split between devices; "
                                   f"build the loop with control flow v2 (a While op)")
            seen = set()
            for slot, i in enumerate(node.input):
                p, k = split_tensor(i.lstrip("^"))
                if not i.startswith("^"):
                    self.consumers[p].append((n, k, slot))
                if p not in seen:
                    seen.add(p)
                    succ[p].append(n)
                    indeg[n] += 1
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
        return order

    def _flags(self) -> None:
        """Fill ``seeds``, ``batch_dependent``, ``grad_dependent``, ``on_summed_grads`` and the loss kind."""
        self.seeds = self._find_seeds()
        inputs = set(self.inputs)
        for n in self.order:
            data_in = [split_tensor(i)[0] for i in self.nodes[n].input if not i.startswith("^")]
            self.batch_dependent[n] = n in inputs or n in self.seeds or n in self.const_scale or any(
                self.batch_dependent[p] for p in data_in) or (
                self.nodes[n].op == "Const" and self._batch_axis(n) is not None)
            self.grad_dependent[n] = n in self.seeds or any(self.grad_dependent[p] for p in data_in)
        for n in reversed(self.order):
            self.on_summed_grads[n] = self._phase(n) == "update" and (
                self.grad_dependent[n] or any(self.on_summed_grads.get(c, False) for c, _, _ in self.consumers[n]))
        self.loss_is_mean = self._loss_kind() == "mean"

    # -------------------------------------------------------------------------------- lookups
    @property
    def tfg(self) -> "tf.Graph":
        """The pruned original graph imported into Python (only built when the IR lacks an answer)."""
        if self._tfg is None:
            sub = graph_pb2.GraphDef()
            sub.versions.CopyFrom(self.graph_def.versions)
            sub.library.CopyFrom(self.graph_def.library)
            sub.node.extend(self.nodes[n] for n in self.order)
            for node in sub.node:   # colocation with ops pruned away would fail the import (shapes need none)
                if "_class" in node.attr:
                    del node.attr["_class"]
            g = tf.Graph()
            with g.as_default():
                try:
                    tf.graph_util.import_graph_def(sub, name="")
                except (ValueError, tf.errors.OpError) as err:
                    raise RewriteError(f"the training graph does not import: {str(err).splitlines()[0]}") from None
            self._tfg = g
        return self._tfg

    def _tensor(self, t: str) -> "tf.Tensor":
        op, k = split_tensor(t)
        return self.tfg.get_operation_by_name(op).outputs[k]

    def _dtype(self, t: str) -> "tf.DType":
        info = self.tensor_info.get(canonical(t))
        if info is not None and info.dtype:
            try:
                return tf.as_dtype(info.dtype).base_dtype
            except TypeError:
                pass
        op, k = split_tensor(t)
        node = self.nodes[op]
        for a in ("T", "dtype"):
            if k == 0 and a in node.attr and node.attr[a].type:
                return tf.as_dtype(node.attr[a].type).base_dtype
        return self._tensor(t).dtype.base_dtype

    def _batch_axis(self, t: str) -> int | None:
        info = self.tensor_info.get(canonical(t))
        return None if info is None else info.batch_axis

    def _ref_shape(self, t: str) -> list[int | None] | None:
        """Shape of T at the reference batch (IR first, else TF's static shape)."""
        info = self.tensor_info.get(canonical(t))
        if info is not None:
            return None if info.shape is None else list(info.shape)
        shape = self._tensor(t).shape
        return None if shape.rank is None else shape.as_list()

    def _phase(self, op: str) -> str | None:
        i = self.ir_index.get(op)
        return None if i is None else self.ir.ops[i].phase

    def _additive(self, t: str) -> bool:
        """A batch-reduced partial sum of gradients (sums over instances give the whole-batch value)."""
        op, _ = split_tensor(t)
        return self.grad_dependent[op] and self._batch_axis(t) is None and self._dtype(t) in FLOAT_TYPES

    def _group(self, op: str) -> int | None:
        """The op group of OP (None for ops outside the analysed step)."""
        i = self.ir_index.get(op)
        return None if i is None else int(self.strategy.grouping.group_of_op[i])

    def _pipelined(self, g: int | None) -> bool:
        """Is op group G part of a pipeline stage (micro-batched)?"""
        return g is not None and self.stage_of_group is not None

    def _replicas(self, g: int) -> tuple[list[int], list[Range]]:
        """Devices of op group G and the batch range of each (``batch_shares`` by peak FLOP/s)."""
        if g not in self._replica_cache:
            devs = self.strategy.devices_of(g, self.topo)
            if not devs:
                raise StrategyError(f"op group {g} is placed on no device")
            shares = batch_shares(self.strategy.share_speeds(devs, self.topo), self.batch)
            ranges, start = [], 0
            for s in shares:
                ranges.append((start, start + s))
                start += s
            self._replica_cache[g] = (devs, ranges)
        return self._replica_cache[g]
