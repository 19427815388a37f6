"""The rewriter's shared state: one plain object that every pass reads and fills, plus the lookups every
concern needs (dtypes, shapes, batch axes, op groups, replicas) and the node builders of the output graph.

The passes (``tag.backend.rewrite.passes``) are functions of the concern modules that take the state;
each states the fields it reads and writes. ``RewriteState`` sets the inputs (``INPUT_FIELDS``) and the
caches of its lookups; every other field is set by the first pass that writes it (``FIELDS`` below says
which pass that is and what the field holds), so a pass that reads a field before its writer ran fails
with AttributeError instead of reading an empty default.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite.context import RewriteState
    from tag.backend.rewrite.structure import prune_and_order

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    st = RewriteState(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    prune_and_order(st)
    st.order[:2]                       # original op names, producers first
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from tag.errors import RewriteError, StrategyError
from tag.strategy.types import Strategy, batch_shares

from .graph_edit import FLOAT_TYPES, Instance, NodeBuilder, Range, canonical, split_tensor, tensor_name

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Topology
    from tag.ir.types import TensorInfo, TrainingGraph

# Fields the constructor sets from the arguments of ``rewrite``; passes read them (``tensor_info`` is also
# extended by ``const_rules`` and ``notes`` appended to by many passes).
INPUT_FIELDS = frozenset({
    "graph_def", "ir", "strategy", "topo", "host", "fuse_allreduce", "validate", "ref_batch", "batch", "full_batch",
    "notes", "nodes", "train_op", "loss", "init", "ir_index", "tensor_info", "inputs"})
# Memos of the lookups (derived from inputs and earlier passes' fields; any pass may fill them).
CACHE_FIELDS = frozenset({"replica_cache", "vars_cache", "micro_memo", "_tfg"})


@dataclass(frozen=True)
class Emission:
    """How the concerns below ``instances`` reach its input resolution while they emit: a sum of gradient
    partial sums (``collectives``, ``pipeline``, ``sfb``) resolves the partial sums, which may need a re-split
    or a sum of their own, so resolution is recursive across concerns; they call it through the state
    (``instances.begin_output`` sets it) rather than import ``instances``, which imports them.

    ``resolve(st, tensor, range, device, consumer, consumer's asked device)`` -> the tensor name that gives
    that instance of the consumer the value; ``clone(st, op, range, device, consumer)`` -> an extra Instance
    of op computed for those examples on that device."""

    resolve: Callable[..., str]
    clone: Callable[..., Instance]


class RewriteState(NodeBuilder):
    """Inputs of one rewrite and the fields its passes fill (the annotations below: what each holds and
    which pass writes it; ``tag.backend.rewrite.passes.PASSES`` lists who reads it).

    ``host``: the topology host the rewrite builds for, None for all of them. Today every pass builds the
    whole step whatever it says (a host's program is cut from it, ``programs``); it is the hook for emitting
    one host's instances only (lazy per-host emission), which passes read from here.
    """

    # ---- pipeline.setup_pipeline
    stage_of_group: "np.ndarray | None"          # op group -> its pipeline stage; None: no pipeline
    micro_ranges: list[Range]                    # the micro-batches' example ranges
    stage_instances: dict[int, list[tuple[Range, int]]]   # stage -> (batch range, device) of its instances
    deferred_ops: set[str]                       # ops a ``deferred_w`` pipeline runs once per step
    # ---- structure.prune_and_order
    order: list[str]                             # kept original ops, topologically ordered
    consumers: dict[str, list[tuple[str, int, int]]]   # op -> [(consumer, output index, input slot)], data only
    # ---- batch_split.const_rules
    const_scale: dict[str, list[int]]            # batch-dependent Const -> flat positions to rescale
    # ---- structure.flag_dependencies
    seeds: set[str]                              # gradient seeds (gradients/grad_ys_N Fills)
    batch_dependent: dict[str, bool]             # op -> its outputs depend on the batch
    grad_dependent: dict[str, bool]              # op -> its outputs depend on a gradient seed
    on_summed_grads: dict[str, bool]             # op -> update op that runs on whole-batch gradients
    loss_is_mean: bool                           # the loss averages (not sums) over the batch
    # ---- variables.place_variables
    var_copies: dict[str, list[int]]             # variable op -> devices of its copies
    var_owner: dict[str, int | None]             # variable op -> op group that owns it
    # ---- placement.place_all
    placements: dict[str, list[tuple[Range, int]]]   # op -> [(batch range, asked device)] per instance
    # ---- instances.begin_output (the output graph; later passes append to it)
    out_nodes: list[node_def_pb2.NodeDef]        # the output graph's nodes, in output order
    used_names: set[str]                         # node names taken in the output graph
    instances: dict[str, list[Instance]]         # original op -> its instances, in emission order
    instance_at: dict[tuple[str, Range, int], Instance]   # (op, range, asked device) -> instance
    memo: dict[tuple, object]                    # (kind, tensor, range/instance, device) -> output tensor(s)
    counts: dict[str, int]                       # what was added -> how many (for the notes)
    token: str                                   # hash of strategy and graph: seeds collective instance keys
    allreduce_memo: dict[tuple, dict[int, str]]  # (tensor, devices, ranges) -> {device: summed tensor}
    instance_key_of: dict[tuple[str, tuple[int, ...]], int]   # (what, devices) -> collective instance key
    taken_instance_keys: set[int]                # instance keys given out
    function_table: dict                         # function name -> FunctionDef of the graph's library
    function_copies: dict[tuple[str, int], str]  # (function, batch size) -> the function its instances call
    added_functions: list                        # per-batch copies of loop bodies (``loop_state``)
    emission: Emission                           # input resolution, for the concerns below ``instances``
    # ---- sfb.plan_sfb
    sfb_tensors: set[str]                        # gradients recomputed by SFB (and Identities before them)
    sfb_factors: dict                            # gradient MatMul op -> its SufficientFactors
    sfb_gathers: dict[str, dict[int, str]]       # gradient MatMul op -> device -> its gradient there
    # ---- collectives.plan_fusion
    fusion: dict[str, tuple]                     # fused gradient tensor -> its bucket (op group, dtype)
    buckets: dict[tuple, list[str]]              # bucket -> its gradient tensors, in order
    bucket_out: dict[tuple, dict[str, dict[int, str]]]   # bucket -> gradient -> device -> summed name
    buckets_used: list[tuple]                    # buckets some update op reads, first use first
    # ---- collectives.plan_dense_sparse
    dense_sparse: dict                           # deduplicating segment-sum op -> its SparseDedup
    # ---- loss.fetches
    fetch_train: str                             # the op to run per step
    fetch_loss: str | None                       # the global loss
    fetch_init: str | None                       # the op to run once
    # ---- result.assemble
    result: object                               # the RewriteResult

    def __init__(self, graph_def: "tf.compat.v1.GraphDef", graph: "TrainingGraph", strategy: Strategy,
                 topology: "Topology", batch_size: int | None = None, train_op: str = "train_op",
                 loss: str | None = "loss", init: str | None = "init", fuse_allreduce: bool = True,
                 validate: bool = True, host: str | None = None):
        self.fuse_allreduce = fuse_allreduce
        self.validate = validate                   # check that the result imports (``result.assemble``)
        self.graph_def = graph_def
        self.ir = graph
        self.strategy = strategy
        self.topo = topology
        if host is not None and host not in {h.name for h in topology.hosts}:
            raise RewriteError(f"host {host!r} is not in the topology "
                               f"(hosts: {', '.join(h.name for h in topology.hosts)})")
        self.host = host
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
        # caches of the lookups
        self._tfg: tf.Graph | None = None
        self.replica_cache: dict[int, tuple[list[int], list[Range]]] = {}   # op group -> replicas(g)
        self.vars_cache: dict[str, list[str]] = {}                          # op -> variables.vars_of_inputs(op)
        self.micro_memo: dict[str, bool] | None = None                      # op -> pipeline._per_micro_batch(op)

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

    def tensor(self, t: str) -> "tf.Tensor":
        op, k = split_tensor(t)
        return self.tfg.get_operation_by_name(op).outputs[k]

    def dtype(self, t: str) -> "tf.DType":
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
        return self.tensor(t).dtype.base_dtype

    def batch_axis(self, t: str) -> int | None:
        info = self.tensor_info.get(canonical(t))
        return None if info is None else info.batch_axis

    def ref_shape(self, t: str) -> list[int | None] | None:
        """Shape of T at the reference batch (IR first, else TF's static shape)."""
        info = self.tensor_info.get(canonical(t))
        if info is not None:
            return None if info.shape is None else list(info.shape)
        shape = self.tensor(t).shape
        return None if shape.rank is None else shape.as_list()

    def phase(self, op: str) -> str | None:
        i = self.ir_index.get(op)
        return None if i is None else self.ir.ops[i].phase

    def additive(self, t: str) -> bool:
        """A batch-reduced partial sum of gradients (sums over instances give the whole-batch value)."""
        op, _ = split_tensor(t)
        return self.grad_dependent[op] and self.batch_axis(t) is None and self.dtype(t) in FLOAT_TYPES

    def group(self, op: str) -> int | None:
        """The op group of OP (None for ops outside the analysed step)."""
        i = self.ir_index.get(op)
        return None if i is None else int(self.strategy.grouping.group_of_op[i])

    def pipelined(self, g: int | None) -> bool:
        """Is op group G part of a pipeline stage (micro-batched)?"""
        return g is not None and self.stage_of_group is not None

    def replicas(self, g: int) -> tuple[list[int], list[Range]]:
        """Devices of op group G and the batch range of each (``batch_shares`` by the strategy's device speeds)."""
        if g not in self.replica_cache:
            devs = self.strategy.devices_of(g, self.topo)
            if not devs:
                raise StrategyError(f"op group {g} is placed on no device")
            shares = batch_shares(self.strategy.share_speeds(devs, self.topo), self.batch)
            ranges, start = [], 0
            for s in shares:
                ranges.append((start, start + s))
                start += s
            self.replica_cache[g] = (devs, ranges)
        return self.replica_cache[g]

    def tiling(self, p: str, rng: Range) -> list[Instance] | None:
        """Primary instances of P whose ranges exactly tile RNG, or None."""
        prim = sorted((i for i in self.instances[p] if i.primary), key=lambda i: i.rng)
        out, at = [], rng[0]
        for i in prim:
            if i.rng[0] == at and i.rng[1] <= rng[1]:
                out.append(i)
                at = i.rng[1]
        return out if at == rng[1] and out else None
