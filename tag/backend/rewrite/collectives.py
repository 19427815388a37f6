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

from . import pipeline, variables
from .context import RewriteState
from .graph_edit import Instance, Range, attr_type, canonical, fill_defaults, split_tensor

# A fusion bucket: (op group, dtype) -- the gradients one fused collective sums.
BucketKey = tuple[int, "tf.DType"]


def collective_group_key(device_strings: Iterable[str]) -> int:
    """A stable collective group key for a set of TF devices (same set -> same key, any graph)."""
    text = "|".join(sorted(device_strings))
    return 1 + int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") % (2 ** 30 - 1)


def allreduce(st: RewriteState, t: str, devs: list[int], ranges: list[Range]) -> dict[int, str]:
    """One CollectiveReduceV2 per device of DEVS summing T's partial sums (ranges RANGES)."""
    memo_key = (t, tuple(devs), tuple(ranges))
    if memo_key in st.allreduce_memo:
        return st.allreduce_memo[memo_key]
    p, k = split_tensor(t)
    partials = {d: pipeline.replica_partial(st, t, r, d) for d, r in zip(devs, ranges, strict=True)}
    out = {d: _collective(st, f"tag/allreduce/{p}_{k}/{d}", partials[d], d, devs, st.dtype(t), t)
           for d in devs}
    st.counts["allreduces"] += 1
    st.allreduce_memo[memo_key] = out
    return out


def instance_key(st: RewriteState, what: str, devs: list[int], dstrs: list[str]) -> int:
    """The collective instance key of WHAT over DEVS: a hash of the graph, WHAT and the devices,
    moved on to the next free key on a clash; the same for every member of one collective."""
    ikey = st.instance_key_of.get((what, tuple(devs)))
    if ikey is None:
        ikey = 1 + int.from_bytes(hashlib.sha1(f"{st.token}|{what}|{dstrs}".encode()).digest()[:4],
                                  "big") % (2 ** 30 - 1)
        while ikey in st.taken_instance_keys:
            ikey = ikey % (2 ** 30 - 1) + 1
        st.taken_instance_keys.add(ikey)
        st.instance_key_of[(what, tuple(devs))] = ikey
    return ikey


def _collective(st: RewriteState, base: str, partial: str, dev: int, devs: list[int], dtype: "tf.DType",
                what: str) -> str:
    """A CollectiveReduceV2 (sum) of PARTIAL on DEV over DEVS; WHAT names the instance for its key."""
    dstrs = [st.topo.tf_device(d) for d in devs]
    ikey = instance_key(st, what, devs, dstrs)
    name = st.fresh(base)
    consts = [st.const(f"{name}/{key}", np.array(v, np.int32), dev)
              for key, v in (("group_size", len(devs)), ("group_key", collective_group_key(dstrs)),
                             ("instance_key", ikey))]
    node = node_def_pb2.NodeDef(name=name, op="CollectiveReduceV2", device=st.topo.tf_device(dev))
    node.input.extend([partial] + consts)
    node.attr["T"].CopyFrom(attr_type(dtype))
    node.attr["merge_op"].s = b"Add"
    node.attr["final_op"].s = b"Id"
    # ring on CPUs (verified across local TF servers); on GPUs TF's "auto" picks NCCL where it can
    cpu_only = all(st.topo.devices[d].tf_device_type == "CPU" for d in devs)
    node.attr["communication_hint"].s = b"ring" if cpu_only else b"auto"
    st.out_nodes.append(fill_defaults(node))
    return name


# -------------------------------------------------------------------------------- sparse as dense
def plan_dense_sparse(st: RewriteState) -> None:
    """``dense_sparse``: deduplicating segment-sum op -> its ``SparseDedup``, for the sparse gradients
    of allreduce groups over several devices (outside a pipeline) that are cheaper to sum as tables at
    this batch (``dense_sum_pays``), where the variable and the segment sum share their op group."""
    st.dense_sparse: dict[str, SparseDedup] = {}
    for d in grouped_dedups(st.ir, st.strategy.grouping.group_of_op).values():
        g = st.group(d.variable)
        if g is None or st.pipelined(g) or st.strategy.actions[g].mode != "allreduce":
            continue
        if len(st.replicas(g)[0]) > 1 and dense_sum_pays(d.values_bytes_per_example, d.table_bytes,
                                                              st.batch):
            st.dense_sparse[d.segment_sum_op] = d


def dense_rows(st: RewriteState, n: str, rng: Range, asked_dev: int, name: str, primary: bool) -> Instance | None:
    """Instance NAME of segment-sum op N (in ``dense_sparse``) for the whole batch on its replica: the rows
    of the all-reduced table at the whole batch's distinct ids. None where N does not run on a replica."""
    d = st.dense_sparse[n]
    dev = variables.device_for(st, n, asked_dev)
    devs, ranges = st.replicas(st.group(n))
    if rng != st.full_batch or dev not in devs:
        return None
    table = _dense_table_sums(st, d, devs, ranges)[dev]
    ids = st.emission.resolve(st, d.unique_op + ":0", rng, dev, n, asked_dev)
    axis = st.const(f"{name}/axis", np.array(0, np.int32), dev)
    node = node_def_pb2.NodeDef(name=name, op="GatherV2", device=st.topo.tf_device(dev))
    node.input.extend([table, ids, axis])
    node.attr["Tparams"].CopyFrom(attr_type(st.dtype(d.values)))
    node.attr["Tindices"].CopyFrom(attr_type(st.dtype(d.indices)))
    node.attr["Taxis"].CopyFrom(attr_type(tf.int32))
    st.out_nodes.append(fill_defaults(node))
    st.used_names.add(name)
    inst = Instance(name, rng, asked_dev, dev, primary)
    st.instances.setdefault(n, []).append(inst)
    st.instance_at.setdefault((n, rng, asked_dev), inst)
    return inst


def _dense_table_sums(st: RewriteState, d: SparseDedup, devs: list[int], ranges: list[Range]) -> dict[int, str]:
    """Per replica device: the table D's rows sum to over the whole batch, all-reduced (each replica's
    rows added into a dense table by their ids first)."""
    memo_key = ("dense_table", d.variable, tuple(devs))
    if memo_key in st.memo:
        return st.memo[memo_key]
    dtype = st.dtype(d.values)
    out = {}
    for dev, r in zip(devs, ranges, strict=True):
        base = f"tag/dense_sum/{d.variable}/{dev}"
        rows = st.const(f"{base}/rows", np.array(d.rows, np.int32), dev)
        node = node_def_pb2.NodeDef(name=st.fresh(base), op="UnsortedSegmentSum",
                                    device=st.topo.tf_device(dev))
        node.input.extend([st.emission.resolve(st, d.values, r, dev, d.segment_sum_op, dev),
                           st.emission.resolve(st, d.indices, r, dev, d.segment_sum_op, dev), rows])
        node.attr["T"].CopyFrom(attr_type(dtype))
        node.attr["Tindices"].CopyFrom(attr_type(st.dtype(d.indices)))
        node.attr["Tnumsegments"].CopyFrom(attr_type(tf.int32))
        st.out_nodes.append(fill_defaults(node))
        out[dev] = _collective(st, f"tag/dense_allreduce/{d.variable}/{dev}", node.name, dev, devs, dtype,
                                    f"dense|{d.variable}")
    st.counts["dense table sums"] += 1
    st.notes.append(f"{d.variable}: sparse gradient summed as a dense {d.rows}-row table")
    st.memo[memo_key] = out
    return out


# -------------------------------------------------------------------------------- gradient fusion
def plan_fusion(st: RewriteState) -> None:
    """Gradients of one allreduce op group (and dtype) are summed by one fused collective, as the
    simulator models it: flattened, concatenated, all-reduced, split. Output names are reserved here;
    the collectives are built once every gradient exists (``emit_fusions``)."""
    st.fusion: dict[str, BucketKey] = {}             # fused gradient tensor -> its bucket
    st.buckets: dict[BucketKey, list[str]] = {}      # bucket -> its gradient tensors, in order
    # bucket -> gradient tensor -> replica device -> name of the summed gradient there
    st.bucket_out: dict[BucketKey, dict[str, dict[int, str]]] = {}
    st.buckets_used: list[BucketKey] = []            # buckets some update op reads, first use first
    if not st.fuse_allreduce:
        return
    for key, ts in _fusable_gradients(st).items():
        if len(ts) < 2:
            continue
        g = key[0]
        base = st.fresh(f"tag/fused_allreduce/group_{g}_{key[1].name}")
        st.buckets[key] = ts
        st.bucket_out[key] = {t: {d: st.fresh(f"{base}/grad_{j}/{d}") for d in st.replicas(g)[0]}
                                for j, t in enumerate(ts)}
        for t in ts:
            st.fusion[t] = key


def _fusable_gradients(st: RewriteState) -> dict[BucketKey, list[str]]:
    """Gradients of trainable variables of replicated allreduce groups with a static shape and no
    batch axis (not SFB), by (op group, dtype)."""
    buckets: dict[BucketKey, list[str]] = {}
    for v in st.ir.variables:
        if v.kind != "trainable" or v.apply_op not in st.ir_index or not v.gradient:
            continue
        g = st.group(v.apply_op)
        if st.strategy.actions[g].mode != "allreduce" or len(st.replicas(g)[0]) < 2:
            continue
        t = canonical(v.gradient)
        shape = st.ref_shape(t) if t in st.tensor_info else None
        if t in st.sfb_tensors or shape is None or None in shape or st.batch_axis(t) is not None \
                or not st.grad_dependent[split_tensor(t)[0]] or t in buckets.get((g, st.dtype(t)), []):
            continue
        buckets.setdefault((g, st.dtype(t)), []).append(t)
    return _merge_across_groups(st, buckets)


def _merge_across_groups(st: RewriteState, buckets: dict[BucketKey, list[str]]) -> dict[BucketKey, list[str]]:
    """BUCKETS (by op group and dtype) merged by ``tag.strategy.fusion.fusion_buckets``: the groups of one
    fusion bucket (same replicas) share one collective per dtype, filed under the bucket's first group,
    as the simulator costs it. Pipelines keep one collective per op group (their stages sync apart)."""
    if st.strategy.pipeline is not None:
        return buckets
    grouping = st.strategy.grouping
    group_bytes = [0.0] * grouping.num_groups
    sfb_groups = set()
    sfb = set(st.strategy.sfb)
    for v in st.ir.variables:
        if v.kind == "trainable":
            g = int(grouping.group_of_op[v.op])
            group_bytes[g] += float(v.nbytes)
            if v.name in sfb:
                sfb_groups.add(g)
    actions = st.strategy.actions
    replicated = [a.mode == "allreduce" and len(st.replicas(g)[0]) > 1 for g, a in enumerate(actions)]
    leader = bucket_leaders(fusion_buckets(actions, group_bytes, replicated, sfb_groups,
                                           cap=bucket_cap(st.strategy)))
    merged: dict[BucketKey, list[str]] = {}
    for (g, dtype), ts in sorted(buckets.items(), key=lambda kv: -kv[0][0]):
        merged.setdefault((leader.get(g, g), dtype), []).extend(ts)
    return merged


def fused(st: RewriteState, t: str, dev: int) -> str | None:
    """The name the fused all-reduce gives gradient T on DEV (None: T is not fused there)."""
    key = st.fusion.get(t)
    if key is None or dev not in st.replicas(key[0])[0]:
        return None
    if key not in st.buckets_used:
        st.buckets_used.append(key)
    return st.bucket_out[key][t][dev]


def emit_fusions(st: RewriteState) -> None:
    """Build the fused collectives of the buckets in use (every gradient exists by now)."""
    for key in st.buckets_used:
        g, dtype = key
        ts = st.buckets[key]
        devs, ranges = st.replicas(g)
        sizes = [int(np.prod(st.ref_shape(t))) for t in ts]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        base = st.bucket_out[key][ts[0]][devs[0]].rsplit("/", 2)[0]
        for d, r in zip(devs, ranges, strict=True):
            _emit_fused_on(st, key, base, d, r, devs, sizes, offsets)
        st.counts["fused allreduces"] += 1
        st.notes.append(f"op group {g}: {len(ts)} gradients all-reduced as one {dtype.name} buffer "
                          f"of {int(offsets[-1])} elements")


def _emit_fused_on(st: RewriteState, key: BucketKey, base: str, d: int, r: Range, devs: list[int], sizes: list[int],
                   offsets: np.ndarray) -> None:
    """Bucket KEY's fused all-reduce on replica D (examples R): flatten, concat, all-reduce, split."""
    g, dtype = key
    ts = st.buckets[key]
    flat = []
    for j, t in enumerate(ts):
        partial = pipeline.replica_partial(st, t, r, d)
        flat.append(st.reshape(f"{base}/flat_{j}/{d}", partial, [-1], dtype, d))
    shape_axis = st.const(f"{base}/concat_{d}/axis", np.array(0, np.int32), d)
    concat = st.concat_node(st.fresh(f"{base}/concat_{d}"), flat, shape_axis, dtype, d)
    summed = _collective(st, f"{base}/allreduce_{d}", concat, d, devs, dtype, f"fused|{g}|{dtype.name}")
    for j, t in enumerate(ts):
        begin = st.const(f"{base}/split_{j}_{d}/begin", np.array([offsets[j]], np.int32), d)
        size = st.const(f"{base}/split_{j}_{d}/size", np.array([sizes[j]], np.int32), d)
        part = st.int32_indexed(st.fresh(f"{base}/split_{j}_{d}"), "Slice", [summed, begin, size], dtype,
                                   "Index", d)
        out = st.bucket_out[key][t][d]
        st.reshape(out, part, st.ref_shape(t), dtype, d, exact_name=True)
