"""Collectives: gradient partial sums of ``allreduce`` op groups summed by ``CollectiveReduceV2``.

Among the replicas of an ``allreduce`` group, gradient partial sums are summed by one collective per
fusion bucket and dtype (``fuse_allreduce``; the buckets of ``tag.strategy.fusion``, as the simulator
models it): gradients flattened,
concatenated, all-reduced, split and reshaped back. Without fusion (or for a lone gradient) there is
one collective per gradient. The group key is a hash of the device set (``collective_group_key``: the
same set gets the same key in any graph); instance keys are unique per collective within a graph.
Collectives among CPUs use the ring implementation; elsewhere TF picks (NCCL on GPUs).

A sparse (``IndexedSlices``) gradient whose rows outweigh its table (``tag.strategy.sparse``) is summed as
a dense table: each replica adds its rows into the table's shape (``UnsortedSegmentSum`` by its ids), one
collective sums the tables, and the update's deduplicating segment sum becomes a ``GatherV2`` of the summed
table at the batch's distinct ids (``Unique`` of the whole batch's ids, which are still gathered).

Example::

    from tag.backend.rewrite import collective_group_key

    devices = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]
    assert collective_group_key(devices) == collective_group_key(reversed(devices))
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from tag.strategy.fusion import bucket_cap, bucket_leaders, fusion_buckets
from tag.strategy.sparse import SparseDedup, dense_sum_pays, grouped_dedups

from .context import RewriteContext
from .graph_edit import Instance, Range, attr_type, canonical, fill_defaults, split_tensor

# A fusion bucket: (op group, dtype) -- the gradients one fused collective sums.
BucketKey = tuple[int, "tf.DType"]


def collective_group_key(device_strings: Iterable[str]) -> int:
    """A stable collective group key for a set of TF devices (same set -> same key, any graph)."""
    text = "|".join(sorted(device_strings))
    return 1 + int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") % (2 ** 30 - 1)


class CollectivesMixin(RewriteContext):
    """All-reduces of gradients: per gradient (``_allreduce``) or fused per fusion bucket and dtype."""

    def _allreduce(self, t: str, devs: list[int], ranges: list[Range]) -> dict[int, str]:
        """One CollectiveReduceV2 per device of DEVS summing T's partial sums (ranges RANGES)."""
        memo_key = (t, tuple(devs), tuple(ranges))
        if memo_key in self.allreduce_memo:
            return self.allreduce_memo[memo_key]
        p, k = split_tensor(t)
        partials = {d: self._replica_partial(t, r, d) for d, r in zip(devs, ranges, strict=True)}
        out = {d: self._collective(f"tag/allreduce/{p}_{k}/{d}", partials[d], d, devs, self._dtype(t), t)
               for d in devs}
        self.counts["allreduces"] += 1
        self.allreduce_memo[memo_key] = out
        return out

    def _instance_key(self, what: str, devs: list[int], dstrs: list[str]) -> int:
        """The collective instance key of WHAT over DEVS: a hash of the graph, WHAT and the devices,
        moved on to the next free key on a clash; the same for every member of one collective."""
        ikey = self.instance_key_of.get((what, tuple(devs)))
        if ikey is None:
            ikey = 1 + int.from_bytes(hashlib.sha1(f"{self.token}|{what}|{dstrs}".encode()).digest()[:4],
                                      "big") % (2 ** 30 - 1)
            while ikey in self.taken_instance_keys:
                ikey = ikey % (2 ** 30 - 1) + 1
            self.taken_instance_keys.add(ikey)
            self.instance_key_of[(what, tuple(devs))] = ikey
        return ikey

    def _collective(self, base: str, partial: str, dev: int, devs: list[int], dtype: "tf.DType", what: str) -> str:
        """A CollectiveReduceV2 (sum) of PARTIAL on DEV over DEVS; WHAT names the instance for its key."""
        dstrs = [self.topo.tf_device(d) for d in devs]
        ikey = self._instance_key(what, devs, dstrs)
        name = self._fresh(base)
        consts = [self._const(f"{name}/{key}", np.array(v, np.int32), dev)
                  for key, v in (("group_size", len(devs)), ("group_key", collective_group_key(dstrs)),
                                 ("instance_key", ikey))]
        node = node_def_pb2.NodeDef(name=name, op="CollectiveReduceV2", device=self.topo.tf_device(dev))
        node.input.extend([partial] + consts)
        node.attr["T"].CopyFrom(attr_type(dtype))
        node.attr["merge_op"].s = b"Add"
        node.attr["final_op"].s = b"Id"
        # ring on CPUs (verified across local TF servers); on GPUs TF's "auto" picks NCCL where it can
        cpu_only = all(self.topo.devices[d].tf_device_type == "CPU" for d in devs)
        node.attr["communication_hint"].s = b"ring" if cpu_only else b"auto"
        self.out_nodes.append(fill_defaults(node))
        return name

    # -------------------------------------------------------------------------------- sparse as dense
    def _plan_dense_sparse(self) -> None:
        """``dense_sparse``: deduplicating segment-sum op -> its ``SparseDedup``, for the sparse gradients
        of allreduce groups over several devices (outside a pipeline) that are cheaper to sum as tables at
        this batch (``dense_sum_pays``), where the variable and the segment sum share their op group."""
        self.dense_sparse: dict[str, SparseDedup] = {}
        for d in grouped_dedups(self.ir, self.strategy.grouping.group_of_op).values():
            g = self._group(d.variable)
            if g is None or self._pipelined(g) or self.strategy.actions[g].mode != "allreduce":
                continue
            if len(self._replicas(g)[0]) > 1 and dense_sum_pays(d.values_bytes_per_example, d.table_bytes,
                                                                  self.batch):
                self.dense_sparse[d.segment_sum_op] = d

    def _dense_rows(self, n: str, rng: Range, asked_dev: int, name: str, primary: bool) -> Instance | None:
        """Instance NAME of segment-sum op N (in ``dense_sparse``) for the whole batch on its replica: the rows
        of the all-reduced table at the whole batch's distinct ids. None where N does not run on a replica."""
        d = self.dense_sparse[n]
        dev = self._device_for(n, asked_dev)
        devs, ranges = self._replicas(self._group(n))
        if rng != self.full_batch or dev not in devs:
            return None
        table = self._dense_table_sums(d, devs, ranges)[dev]
        ids = self._resolve(d.unique_op + ":0", rng, dev, n, asked_dev)
        axis = self._const(f"{name}/axis", np.array(0, np.int32), dev)
        node = node_def_pb2.NodeDef(name=name, op="GatherV2", device=self.topo.tf_device(dev))
        node.input.extend([table, ids, axis])
        node.attr["Tparams"].CopyFrom(attr_type(self._dtype(d.values)))
        node.attr["Tindices"].CopyFrom(attr_type(self._dtype(d.indices)))
        node.attr["Taxis"].CopyFrom(attr_type(tf.int32))
        self.out_nodes.append(fill_defaults(node))
        self.used_names.add(name)
        inst = Instance(name, rng, asked_dev, dev, primary)
        self.instances.setdefault(n, []).append(inst)
        self.instance_at.setdefault((n, rng, asked_dev), inst)
        return inst

    def _dense_table_sums(self, d: SparseDedup, devs: list[int], ranges: list[Range]) -> dict[int, str]:
        """Per replica device: the table D's rows sum to over the whole batch, all-reduced (each replica's
        rows added into a dense table by their ids first)."""
        memo_key = ("dense_table", d.variable, tuple(devs))
        if memo_key in self.memo:
            return self.memo[memo_key]
        dtype = self._dtype(d.values)
        out = {}
        for dev, r in zip(devs, ranges, strict=True):
            base = f"tag/dense_sum/{d.variable}/{dev}"
            rows = self._const(f"{base}/rows", np.array(d.rows, np.int32), dev)
            node = node_def_pb2.NodeDef(name=self._fresh(base), op="UnsortedSegmentSum",
                                        device=self.topo.tf_device(dev))
            node.input.extend([self._resolve(d.values, r, dev, d.segment_sum_op, dev),
                               self._resolve(d.indices, r, dev, d.segment_sum_op, dev), rows])
            node.attr["T"].CopyFrom(attr_type(dtype))
            node.attr["Tindices"].CopyFrom(attr_type(self._dtype(d.indices)))
            node.attr["Tnumsegments"].CopyFrom(attr_type(tf.int32))
            self.out_nodes.append(fill_defaults(node))
            out[dev] = self._collective(f"tag/dense_allreduce/{d.variable}/{dev}", node.name, dev, devs, dtype,
                                        f"dense|{d.variable}")
        self.counts["dense table sums"] += 1
        self.notes.append(f"{d.variable}: sparse gradient summed as a dense {d.rows}-row table")
        self.memo[memo_key] = out
        return out

    # -------------------------------------------------------------------------------- gradient fusion
    def _plan_fusion(self) -> None:
        """Gradients of one allreduce op group (and dtype) are summed by one fused collective, as the
        simulator models it: flattened, concatenated, all-reduced, split. Output names are reserved here;
        the collectives are built once every gradient exists (``_emit_fusions``)."""
        self.fusion: dict[str, BucketKey] = {}             # fused gradient tensor -> its bucket
        self.buckets: dict[BucketKey, list[str]] = {}      # bucket -> its gradient tensors, in order
        # bucket -> gradient tensor -> replica device -> name of the summed gradient there
        self.bucket_out: dict[BucketKey, dict[str, dict[int, str]]] = {}
        self.buckets_used: list[BucketKey] = []            # buckets some update op reads, first use first
        if not self.fuse_allreduce:
            return
        for key, ts in self._fusable_gradients().items():
            if len(ts) < 2:
                continue
            g = key[0]
            base = self._fresh(f"tag/fused_allreduce/group_{g}_{key[1].name}")
            self.buckets[key] = ts
            self.bucket_out[key] = {t: {d: self._fresh(f"{base}/grad_{j}/{d}") for d in self._replicas(g)[0]}
                                    for j, t in enumerate(ts)}
            for t in ts:
                self.fusion[t] = key

    def _fusable_gradients(self) -> dict[BucketKey, list[str]]:
        """Gradients of trainable variables of replicated allreduce groups with a static shape and no
        batch axis (not SFB), by (op group, dtype)."""
        buckets: dict[BucketKey, list[str]] = {}
        for v in self.ir.variables:
            if v.kind != "trainable" or v.apply_op not in self.ir_index or not v.gradient:
                continue
            g = self._group(v.apply_op)
            if self.strategy.actions[g].mode != "allreduce" or len(self._replicas(g)[0]) < 2:
                continue
            t = canonical(v.gradient)
            shape = self._ref_shape(t) if t in self.tensor_info else None
            if t in self.sfb_tensors or shape is None or None in shape or self._batch_axis(t) is not None \
                    or not self.grad_dependent[split_tensor(t)[0]] or t in buckets.get((g, self._dtype(t)), []):
                continue
            buckets.setdefault((g, self._dtype(t)), []).append(t)
        return self._merge_across_groups(buckets)

    def _merge_across_groups(self, buckets: dict[BucketKey, list[str]]) -> dict[BucketKey, list[str]]:
        """BUCKETS (by op group and dtype) merged by ``tag.strategy.fusion.fusion_buckets``: the groups of one
        fusion bucket (same replicas) share one collective per dtype, filed under the bucket's first group,
        as the simulator costs it. Pipelines keep one collective per op group (their stages sync apart)."""
        if self.strategy.pipeline is not None:
            return buckets
        grouping = self.strategy.grouping
        group_bytes = [0.0] * grouping.num_groups
        sfb_groups = set()
        sfb = set(self.strategy.sfb)
        for v in self.ir.variables:
            if v.kind == "trainable":
                g = int(grouping.group_of_op[v.op])
                group_bytes[g] += float(v.nbytes)
                if v.name in sfb:
                    sfb_groups.add(g)
        actions = self.strategy.actions
        replicated = [a.mode == "allreduce" and len(self._replicas(g)[0]) > 1 for g, a in enumerate(actions)]
        leader = bucket_leaders(fusion_buckets(actions, group_bytes, replicated, sfb_groups,
                                               cap=bucket_cap(self.strategy)))
        merged: dict[BucketKey, list[str]] = {}
        for (g, dtype), ts in sorted(buckets.items(), key=lambda kv: -kv[0][0]):
            merged.setdefault((leader.get(g, g), dtype), []).extend(ts)
        return merged

    def _fused(self, t: str, dev: int) -> str | None:
        """The name the fused all-reduce gives gradient T on DEV (None: T is not fused there)."""
        key = self.fusion.get(t)
        if key is None or dev not in self._replicas(key[0])[0]:
            return None
        if key not in self.buckets_used:
            self.buckets_used.append(key)
        return self.bucket_out[key][t][dev]

    def _emit_fusions(self) -> None:
        """Build the fused collectives of the buckets in use (every gradient exists by now)."""
        for key in self.buckets_used:
            g, dtype = key
            ts = self.buckets[key]
            devs, ranges = self._replicas(g)
            sizes = [int(np.prod(self._ref_shape(t))) for t in ts]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
            base = self.bucket_out[key][ts[0]][devs[0]].rsplit("/", 2)[0]
            for d, r in zip(devs, ranges, strict=True):
                self._emit_fused_on(key, base, d, r, devs, sizes, offsets)
            self.counts["fused allreduces"] += 1
            self.notes.append(f"op group {g}: {len(ts)} gradients all-reduced as one {dtype.name} buffer "
                              f"of {int(offsets[-1])} elements")

    def _emit_fused_on(self, key: BucketKey, base: str, d: int, r: Range, devs: list[int], sizes: list[int],
                       offsets: np.ndarray) -> None:
        """Bucket KEY's fused all-reduce on replica D (examples R): flatten, concat, all-reduce, split."""
        g, dtype = key
        ts = self.buckets[key]
        flat = []
        for j, t in enumerate(ts):
            partial = self._replica_partial(t, r, d)
            flat.append(self._reshape(f"{base}/flat_{j}/{d}", partial, [-1], dtype, d))
        shape_axis = self._const(f"{base}/concat_{d}/axis", np.array(0, np.int32), d)
        concat = self._concat_node(self._fresh(f"{base}/concat_{d}"), flat, shape_axis, dtype, d)
        summed = self._collective(f"{base}/allreduce_{d}", concat, d, devs, dtype, f"fused|{g}|{dtype.name}")
        for j, t in enumerate(ts):
            begin = self._const(f"{base}/split_{j}_{d}/begin", np.array([offsets[j]], np.int32), d)
            size = self._const(f"{base}/split_{j}_{d}/size", np.array([sizes[j]], np.int32), d)
            part = self._int32_indexed(self._fresh(f"{base}/split_{j}_{d}"), "Slice", [summed, begin, size], dtype,
                                       "Index", d)
            out = self.bucket_out[key][t][d]
            self._reshape(out, part, self._ref_shape(t), dtype, d, exact_name=True)
