"""Instances: one copy of every kept op per placement, and the tensor each input of a copy reads.

Every op gets one *instance* per (batch range, device) of its placement; replica ``d`` of op ``x`` is
named ``x/replica_d``, while ops with one instance keep their names. Each data input of an instance is
*resolved*: the producer's instance with the same range (on the same device if possible); else a
re-split of a batch-axis tensor (``batch_split``), a sum of gradient partial sums (``parameter_server``,
``collectives``), or -- for anything else that depends on the batch (shapes, statistics) -- a clone of
the producer computed for the consumer's range.

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite import rewrite

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    res = rewrite(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    [n.name for n in res.graph_def.node if n.name.startswith("mlp/dense_0/MatMul")]
"""
from __future__ import annotations

import hashlib

from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import op_def_registry

from tag.errors import RewriteError
from tag.ir.op_types import FUNCTION_CALL_TYPES, PLACEHOLDER_TYPES, VARIABLE_TYPES

from .context import RewriteContext
from .graph_edit import Instance, Range, split_tensor, tensor_name
from .variables import CLONABLE_STATEFUL

# what the rewrite adds -> counted in the notes ("3 slices added")
_COUNTED = ("slices", "concats", "sums", "allreduces", "fused allreduces", "dense table sums", "clones")


class InstancesMixin(RewriteContext):
    """Emits the output nodes (``out_nodes``) and resolves the inputs of every instance."""

    def _emit_all(self) -> None:
        """Emit every op's instances in topological order, then the fused collectives."""
        self.out_nodes = []
        self.used_names = set(self.nodes)
        self.instances = {}
        self.instance_at = {}
        self.memo = {}
        token = hashlib.sha1()
        token.update(self.strategy.to_json().encode())
        token.update(repr(sorted(self.nodes)).encode())
        self.token = token.hexdigest()      # makes collective instance keys differ between graphs
        self.counts = {k: 0 for k in _COUNTED}
        self.sfb_tensors = self._find_sfb_tensors()
        self._plan_fusion()
        self._plan_dense_sparse()
        for n in self.order:
            placements = self.placements[n]
            names = self._instance_names(n, placements)
            self.instances[n] = []
            for (rng, asked_dev), name in zip(placements, names, strict=True):
                self._emit(n, rng, asked_dev, name, primary=True)
        self._emit_fusions()
        for k, v in self.counts.items():
            if v:
                self.notes.append(f"{v} {k} added")

    def _instance_names(self, n: str, placements: list[tuple[Range, int]]) -> list[str]:
        if len(placements) == 1:
            return [n]
        names = []
        micro = self.stage_of_group is not None and len({d for _, d in placements}) < len(placements)
        for rng, asked_dev in placements:
            name = f"{n}/replica_{asked_dev}"
            if micro:
                name += f"_micro_{self._micro_index(rng)}"
            if name in self.nodes:
                raise RewriteError(f"op {n!r}: the name {name!r} of its replica is taken in the graph")
            names.append(name)
        if len(set(names)) != len(names):
            raise RewriteError(f"op {n!r} has two instances on one device")
        return names

    def _emit(self, n: str, rng: Range, asked_dev: int, name: str, primary: bool) -> Instance:
        """A copy of op N named NAME for examples RNG, asked on ASKED_DEV, with resolved inputs."""
        if n in self.dense_sparse:
            dense = self._dense_rows(n, rng, asked_dev, name, primary)
            if dense is not None:
                return dense
        orig = self.nodes[n]
        dev = self._device_for(n, asked_dev)
        inst = Instance(name, rng, asked_dev, dev, primary)
        node = node_def_pb2.NodeDef()
        if orig.op == "Const":
            scaled = self._batch_const_value(n, rng) if self._batch_axis(n) is not None else \
                self._const_value(n, rng[1] - rng[0])
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
        if orig.op in PLACEHOLDER_TYPES:
            self._rescale_placeholder(n, node)
        if size != self.ref_batch and "output_shapes" in node.attr:
            for s in node.attr["output_shapes"].list.shape:
                s.Clear()
                s.unknown_rank = True
        if size != self.ref_batch:
            self._rescale_function_attrs(node, size)     # loop bodies with batch-sized list elements
        del node.input[:]
        data, ctrl = [], []
        for i in orig.input:
            if i.startswith("^"):
                ctrl.extend(self._control(i[1:], n, rng, asked_dev))
            else:
                data.append(self._resolve(i, rng, dev, n, asked_dev))
        if n in self.seeds:
            self._scale_seed(n, name, data, size, dev)
        node.input.extend(data)
        seen = set()
        for c in ctrl:
            if c not in seen:
                seen.add(c)
                node.input.append("^" + c)
        self.out_nodes.append(node)
        self.instances.setdefault(n, []).append(inst)
        self.instance_at.setdefault((n, rng, asked_dev), inst)
        return inst

    def _control(self, p: str, consumer: str, rng: Range, asked_dev: int) -> list[str]:
        """Control inputs: the matching instance when both ops have the same instances (and the consumer's
        instances act on their own replica's state), else all of them -- in a pipeline, all of them that
        share examples with RNG: a micro-batch's op waits for the same micro-batch of an op in another
        stage, not for every micro-batch (which orders a later micro-batch's backward before an earlier one's
        and, under 1F1B's schedule, closes a cycle). A micro-batch's op does not wait for a deferred
        weight-gradient op (``deferred_ops``), which runs once all micro-batches are done."""
        if p in self.deferred_ops and consumer not in self.deferred_ops and rng != self.full_batch:
            return []
        if self.placements.get(consumer) == self.placements.get(p) and not self._shares_copy(consumer):
            inst = self.instance_at.get((p, rng, asked_dev))
            if inst is not None:
                return [inst.name]
        primary = [i for i in self.instances[p] if i.primary]
        if self.stage_of_group is not None:
            overlapping = [i.name for i in primary if i.rng[0] < rng[1] and rng[0] < i.rng[1]]
            if overlapping:
                return overlapping
        return [i.name for i in primary]

    def _clone(self, p: str, rng: Range, dev: int, consumer: str) -> Instance:
        """An extra instance of P computed on RNG at DEV (for a consumer that needs exactly that)."""
        inst = self.instance_at.get((p, rng, dev))
        if inst is not None:
            return inst
        node = self.nodes[p]
        op_def = op_def_registry.get(node.op)
        if node.op in PLACEHOLDER_TYPES or node.op in VARIABLE_TYPES or self._writes(p) or (
                op_def is not None and op_def.is_stateful and node.op not in CLONABLE_STATEFUL):
            raise RewriteError(f"op {consumer!r} needs {p!r} ({node.op}) for examples {rng[0]}..{rng[1] - 1}, "
                               f"which only its own instances compute, and {node.op} cannot be recomputed")
        name = self._fresh(f"{p}/tag_{dev}_{rng[0]}_{rng[1]}")
        self.counts["clones"] += 1
        return self._emit(p, rng, dev, name, primary=False)

    # -------------------------------------------------------------------------------- resolution
    @staticmethod
    def _pick(insts: list[Instance], dev: int, asked_dev: int | None = None) -> Instance:
        """The instance on DEV, else the one asked on ASKED_DEV, else the first."""
        for i in insts:
            if i.dev == dev:
                return i
        if asked_dev is not None:
            for i in insts:
                if i.asked_dev == asked_dev:
                    return i
        return insts[0]

    def _resolve(self, t: str, rng: Range, dev: int, consumer: str, consumer_asked_dev: int) -> str:
        """Name of the tensor that gives instance (RNG, DEV) of CONSUMER the value of T."""
        p, k = split_tensor(t)
        insts = self.instances[p]
        if self.nodes[p].op in VARIABLE_TYPES or self._var_of(t) is not None:
            same = [i for i in insts if i.dev == dev]
            if not same and self.nodes[consumer].op in FUNCTION_CALL_TYPES:
                same = insts[:1]
            if not same:
                raise RewriteError(f"op {consumer!r} needs variable {p!r} on {self.topo.tf_device(dev)}, "
                                   f"where it has no copy")
            return tensor_name(same[0].name, k)
        if not self.batch_dependent[p]:
            if self.stage_of_group is not None:   # per-micro-batch copies (a constant after a gradient) stay in theirs
                same = [i for i in insts if i.rng == rng and i.dev == dev]
                if same:
                    return tensor_name(same[0].name, k)
            return tensor_name(self._pick(insts, dev, consumer_asked_dev).name, k)
        same = [i for i in insts if i.rng == rng]
        if tensor_name(p, k) in self.sfb_tensors:        # recomputed on every device that needs it, not shipped
            same = [i for i in same if i.dev == dev]
        if same:
            return tensor_name(self._pick(same, dev, consumer_asked_dev).name, k)
        if self._batch_axis(t) is not None:
            return self._resplit(t, rng, dev)
        if self._additive(t):
            if rng == self.full_batch:
                return self._aggregate(t, dev, consumer)
            parts = self._tiling(p, rng)
            if parts is not None:
                return self._add_n(t, [tensor_name(i.name, k) for i in parts], rng, dev)
        return tensor_name(self._clone(p, rng, dev, consumer).name, k)

    def _tiling(self, p: str, rng: Range) -> list[Instance] | None:
        """Primary instances of P whose ranges exactly tile RNG, or None."""
        prim = sorted((i for i in self.instances[p] if i.primary), key=lambda i: i.rng)
        out, at = [], rng[0]
        for i in prim:
            if i.rng[0] == at and i.rng[1] <= rng[1]:
                out.append(i)
                at = i.rng[1]
        return out if at == rng[1] and out else None
