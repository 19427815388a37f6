"""Input pipelines where the data is: one ``tf.data`` pipeline per worker host, read by the rewritten graph.

A rewritten graph reads each batch input (a placeholder of the global batch) where the rewriter put it:
replicas take their examples through ``tag/slice/...`` ops, whole-batch readers (a partitioned op, the
loss of a model-parallel plan) take the placeholder itself. ``plan_pipelines`` finds those reads in the
GraphDef and gives every host whose devices read a distinct part of the batch its own pipeline for
those examples (``PipelineSpec``: host task, example range); when the reads do not split the batch by
host, one pipeline on the host of the first input serves the whole batch. ``build_inputs`` then calls
the user's ``dataset_fn(ctx)`` once per pipeline, inside ``tf.device`` of that host's CPU, so the
``tf.data`` ops and the iterator live on that host: the data set is read, batched to the pipeline's
share (uneven on unequal devices) and prefetched there, and no example passes through the client. The
returned ``input_map`` replaces each slice by the pipeline's batch on the host that reads it and each
placeholder by the pipelines' batches joined (only built where something reads the whole batch).

``ctx`` is a ``TagInputContext``, a ``tf.distribute.InputContext`` (``input_pipeline_id``,
``num_input_pipelines``) that also says ``batch_size`` (this pipeline's share of the global batch;
``ctx.get_per_replica_batch_size(global_batch)`` returns it too), ``global_batch_size``,
``batch_range`` (its first and end example of each global batch), ``device`` and ``start_step`` (the
step a resumed run starts at). ``dataset_fn`` returns a data set of single examples (tag batches them)
or of batches of ``ctx.batch_size`` examples; sharding is the data set's own business
(``ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``), as with ``tf.distribute``. Elements
match the graph's batch inputs by name (a dict keyed by placeholder name) or by order (a tuple in the
order of ``inputs``); a dtype or shape that does not fit is a one-line ``GraphError`` naming the input.

Example::

    from tag.backend.runtime.input_pipeline import build_inputs, plan_pipelines

    specs = plan_pipelines(rewritten_graph_def, ["x", "y"], batch_size=32)   # one per host, e.g. 11/11/10
    graph = tf.Graph()
    inputs = build_inputs(graph, rewritten_graph_def, ["x", "y"], 32, dataset_fn, specs)
    with graph.as_default():
        tf.compat.v1.import_graph_def(inputs.graph_def, input_map=inputs.input_map, name="")
    sess.run(inputs.initializers)        # after the variables' initializer
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tag.backend.runtime.cluster_spec import import_tf
from tag.errors import GraphError, TagError

PREFETCH = 2                       # batches each pipeline prepares ahead of the step
_TASK_RE = re.compile(r"/job:([^/]+)/(?:replica:\d+/)?task:(\d+)")


@dataclass(frozen=True)
class PipelineSpec:
    """One host's pipeline: examples ``lo..hi-1`` of every global batch, made on ``device`` (its CPU)."""

    task: int
    lo: int
    hi: int
    device: str


@dataclass
class _Read:
    """A place the rewritten graph reads batch input ``name``: examples LO..HI-1 on host TASK, through the
    slice op ``node`` (None: the placeholder itself, whole batch)."""

    name: str
    node: str | None
    lo: int
    hi: int
    task: int | None


@dataclass
class BuiltInputs:
    """What ``build_inputs`` made: the GraphDef to import (control edges to replaced slices dropped), the
    ``input_map`` for ``import_graph_def``, the iterators' initializers, and each pipeline's context."""

    graph_def: Any
    input_map: dict[str, Any]
    initializers: list[Any]
    contexts: list[Any] = field(default_factory=list)
    specs: list[PipelineSpec] = field(default_factory=list)


def _task_and_job(device: str) -> tuple[str, int] | None:
    m = _TASK_RE.search(device or "")
    return (m.group(1), int(m.group(2))) if m else None


def _const_value(node: Any) -> np.ndarray:
    tf = import_tf()
    return tf.make_ndarray(node.attr["value"].tensor)


def _find_reads(graph_def: Any, inputs: Sequence[str], batch_size: int) -> dict[str, list[_Read]]:
    """Input name -> where the rewritten GRAPH_DEF reads it (slices of a range, or the whole batch)."""
    nodes = {n.name: n for n in graph_def.node}
    consumers: dict[str, list[Any]] = {}
    for n in graph_def.node:
        for i in n.input:
            if not i.startswith("^"):
                consumers.setdefault(i.split(":")[0], []).append(n)
    reads: dict[str, list[_Read]] = {}
    for name in inputs:
        if name not in nodes:
            raise GraphError(f"batch input {name!r} is not in the rewritten graph")
        ph = nodes[name]
        home = _task_and_job(ph.device)
        out = []
        for c in consumers.get(name, []):
            task = (_task_and_job(c.device) or home or ("", None))[1]
            if c.op == "StridedSlice" and c.name.startswith("tag/slice/") and c.input[0].split(":")[0] == name:
                begin, end = _const_value(nodes[c.input[1]]), _const_value(nodes[c.input[2]])
                if len(begin) != 1:
                    raise GraphError(f"batch input {name!r} is split along axis {len(begin) - 1}; input pipelines "
                                     f"batch along axis 0 (feed it instead)")
                readers = consumers.get(c.name, [])
                tasks = [t[1] for t in (_task_and_job(r.device) for r in readers) if t is not None]
                task = max(set(tasks), key=tasks.count) if tasks else task
                out.append(_Read(name, c.name, int(begin[0]), int(end[0]), task))
            else:
                out.append(_Read(name, None, 0, batch_size, task))
        reads[name] = out
    return reads


def plan_pipelines(graph_def: Any, inputs: Sequence[str], batch_size: int) -> list[PipelineSpec]:
    """One ``PipelineSpec`` per host that reads its own examples of the batch (sorted by example), or one
    for the whole batch on the host of the first input when the reads do not split the batch by host."""
    reads = _find_reads(graph_def, inputs, batch_size)
    nodes = {n.name: n for n in graph_def.node}
    job = next((jt[0] for n in graph_def.node for jt in [_task_and_job(n.device)] if jt), None)
    if not inputs:
        raise GraphError("the graph has no batch inputs for a data set to fill")
    ref = max(inputs, key=lambda n: len({(r.lo, r.hi) for r in reads[n]}))
    by_task: dict[int, list[tuple[int, int]]] = {}
    for r in reads[ref]:
        if r.task is not None:
            by_task.setdefault(r.task, []).append((r.lo, r.hi))
    merged: list[tuple[int, int, int]] = []          # (lo, hi, task)
    for task, ranges in by_task.items():
        ranges = sorted(set(ranges))
        lo, hi = ranges[0]
        for a, b in ranges[1:]:
            if a > hi:
                merged = []
                break
            hi = max(hi, b)
        else:
            merged.append((lo, hi, task))
            continue
        break
    merged.sort()
    tiles = bool(merged) and merged[0][0] == 0 and merged[-1][1] == batch_size and all(
        a[1] == b[0] for a, b in pairwise(merged))
    if not tiles:
        home = _task_and_job(nodes[inputs[0]].device)
        task = home[1] if home else 0
        merged = [(0, batch_size, task)]
    if job is None:             # a graph without cluster devices (one process): the local CPU
        return [PipelineSpec(0, 0, batch_size, "/device:CPU:0")]
    return [PipelineSpec(task, lo, hi, f"/job:{job}/task:{task}/device:CPU:0") for lo, hi, task in merged]


def _context_class() -> type:
    tf = import_tf()

    class TagInputContext(tf.distribute.InputContext):
        """A ``tf.distribute.InputContext`` that also knows this pipeline's share of the global batch."""

        def __init__(self, spec: PipelineSpec, pipeline_id: int, pipelines: int, global_batch: int,
                     start_step: int):
            super().__init__(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id,
                             num_replicas_in_sync=pipelines)
            self.batch_size = spec.hi - spec.lo
            self.global_batch_size = global_batch
            self.batch_range = (spec.lo, spec.hi)
            self.device = spec.device
            self.start_step = start_step

        def get_per_replica_batch_size(self, global_batch_size: int) -> int:
            """This pipeline's share (``batch_size``) for the plan's global batch; otherwise TensorFlow's rule."""
            if global_batch_size == self.global_batch_size:
                return self.batch_size
            return super().get_per_replica_batch_size(global_batch_size)

        def __repr__(self) -> str:
            return (f"TagInputContext(pipeline {self.input_pipeline_id} of {self.num_input_pipelines}, "
                    f"examples {self.batch_range[0]}..{self.batch_range[1] - 1} of {self.global_batch_size}, "
                    f"{self.device})")

        __str__ = __repr__

    return TagInputContext


def element_spec(dataset_fn: Callable[[Any], Any], batch_size: int) -> Any:
    """The element spec of DATASET_FN's data set, built once in a throwaway graph with the context of one pipeline
    reading the whole global BATCH_SIZE: what a caller can check before planning (the labels' dtype and shape)."""
    tf = import_tf()
    ctx = _context_class()(PipelineSpec(0, 0, batch_size, "/device:CPU:0"), 0, 1, batch_size, 0)
    with tf.Graph().as_default():
        return _dataset(dataset_fn, ctx).element_spec


def _dataset(dataset_fn: Callable[[Any], Any], ctx: Any) -> Any:
    """DATASET_FN(CTX), checked to be a ``tf.data.Dataset``."""
    tf = import_tf()
    ds = dataset_fn(ctx)
    if not isinstance(ds, tf.data.Dataset):
        raise TagError(f"the data set function returned {type(ds).__name__}, not a tf.data.Dataset")
    return ds


def _spec_text(shape: Any, dtype: Any) -> str:
    dims = "?" if shape.rank is None else "[" + ", ".join("?" if d is None else str(d) for d in shape.as_list()) + "]"
    return f"{dtype.name} {dims}"


def _match_elements(element_spec: Any, placeholders: dict[str, Any], order: Sequence[str]) -> list[tuple[str, Any]]:
    """[(placeholder name, path into the element)] matching the data set's elements to the placeholders."""
    tf = import_tf()
    names = list(order)
    if isinstance(element_spec, dict):
        keys = {str(k).split(":")[0]: k for k in element_spec}
        extra = sorted(set(keys) - set(names))
        missing = [n for n in names if n not in keys]
        if missing or extra:
            raise GraphError(f"the data set's elements are keyed {sorted(keys)}, the graph's batch inputs are "
                             f"{names}" + (f" (no element for {missing[0]!r})" if missing else
                                           f" ({extra[0]!r} matches no input)"))
        return [(n, keys[n]) for n in names]
    if isinstance(element_spec, tf.TensorSpec):
        specs = [element_spec]
    elif isinstance(element_spec, (tuple, list)):
        specs = list(element_spec)
    else:
        raise GraphError(f"the data set's elements are {type(element_spec).__name__}; tag takes a tensor, a tuple "
                         f"in the order {names} or a dict keyed by input name")
    if len(specs) != len(names):
        raise GraphError(f"the data set's elements have {len(specs)} parts, the graph has {len(names)} batch inputs "
                         f"{names} (match them by order, or return a dict keyed by input name)")
    if not all(isinstance(s, tf.TensorSpec) for s in specs):
        raise GraphError("each part of the data set's elements must be a dense tensor")
    return [(n, k) if len(specs) > 1 or isinstance(element_spec, (tuple, list)) else (n, None)
            for k, n in enumerate(names)]


def _batched(ds: Any, placeholders: dict[str, Any], matched: list[tuple[str, Any]], share: int) -> Any:
    """DS as batches of SHARE examples (batching single examples), checked against the placeholders."""
    tf = import_tf()

    def part(spec, key):
        return spec if key is None else spec[key]

    elem = ds.element_spec
    ranks = []
    for name, key in matched:
        spec, ph = part(elem, key), placeholders[name]
        want = ph.shape
        if spec.dtype != ph.dtype:
            raise GraphError(f"input {name!r}: the data set gives {_spec_text(spec.shape, spec.dtype)}, the graph's "
                             f"placeholder is {_spec_text(want, ph.dtype)}")
        if want.rank is None or spec.shape.rank is None:
            ranks.append(None)
            continue
        if spec.shape.rank == want.rank - 1:
            ok, single = spec.shape.is_compatible_with(want[1:]), True
        elif spec.shape.rank == want.rank:
            ok, single = spec.shape.is_compatible_with(tf.TensorShape([share]).concatenate(want[1:])), False
        else:
            ok, single = False, False
        if not ok:
            raise GraphError(f"input {name!r}: the data set gives {_spec_text(spec.shape, spec.dtype)}, the graph's "
                             f"placeholder is {_spec_text(want, ph.dtype)} (examples of shape "
                             f"{_spec_text(want[1:], ph.dtype)}, or batches of this pipeline's {share})")
        ranks.append(single)
    kinds = {r for r in ranks if r is not None}
    if len(kinds) > 1:
        raise GraphError("the data set's elements mix single examples and batches")
    single = kinds.pop() if kinds else True
    if single:
        return ds.batch(share, drop_remainder=True)
    first_key = matched[0][1]
    is_tuple = isinstance(elem, (tuple, list))

    def full(*args):
        e = args if is_tuple else args[0]
        return tf.equal(tf.shape(part(e, first_key))[0], share)

    def static(*args):     # the batches' size is known statically from here on
        e = args if is_tuple else args[0]
        if first_key is None:
            return tf.ensure_shape(e, [share] + e.shape.as_list()[1:])
        items = e.items() if isinstance(e, dict) else enumerate(e)
        out = {k: tf.ensure_shape(v, [share] + v.shape.as_list()[1:]) for k, v in items}
        return out if isinstance(e, dict) else tuple(out[k] for k in range(len(e)))

    return ds.filter(full).map(static)


def build_inputs(graph: Any, graph_def: Any, inputs: Sequence[str], batch_size: int,
                 dataset_fn: Callable[[Any], Any], specs: Sequence[PipelineSpec] | None = None, *,
                 start_step: int = 0, prefetch: int = PREFETCH) -> BuiltInputs:
    """Per-host pipelines of DATASET_FN in GRAPH (a fresh ``tf.Graph``) for the batch INPUTS of the
    rewritten GRAPH_DEF (global batch BATCH_SIZE); SPECS default to ``plan_pipelines``."""
    tf = import_tf()
    specs = list(specs) if specs is not None else plan_pipelines(graph_def, inputs, batch_size)
    nodes = {n.name: n for n in graph_def.node}
    placeholders = {}
    for name in inputs:
        node = nodes.get(name)
        if node is None or node.op not in ("Placeholder", "PlaceholderWithDefault"):
            raise GraphError(f"batch input {name!r} is not a placeholder of the rewritten graph")
        shape = tf.TensorShape(node.attr["shape"].shape)
        if shape.rank is not None and shape.rank > 0 and shape[0] is not None and shape[0] != batch_size:
            raise GraphError(f"input {name!r} has {shape[0]} rows, not the plan's batch of {batch_size}; input "
                             f"pipelines need the batch on axis 0")
        placeholders[name] = tf.TensorSpec(shape, tf.as_dtype(node.attr["dtype"].type), name)
    ctx_class = _context_class()
    outputs: list[dict[str, Any]] = []
    inits, contexts = [], []
    with graph.as_default():
        for k, spec in enumerate(specs):
            ctx = ctx_class(spec, k, len(specs), batch_size, start_step)
            with tf.device(spec.device), tf.name_scope(f"tag_input/pipeline_{k}/"):
                ds = _dataset(dataset_fn, ctx)
                matched = _match_elements(ds.element_spec, placeholders, list(inputs))
                ds = _batched(ds, placeholders, matched, spec.hi - spec.lo).prefetch(prefetch)
                it = tf.compat.v1.data.make_initializable_iterator(ds)
                elem = it.get_next()
            got = {}
            for name, key in matched:
                t = elem if key is None else elem[key]
                got[name] = t
            outputs.append(got)
            inits.append(it.initializer)
            contexts.append(ctx)
        input_map, replaced = _input_map(graph, graph_def, inputs, batch_size, specs, outputs, nodes)
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for n in out.node:          # ordering hints towards slices that the pipelines replace
        keep = [i for i in n.input if not (i.startswith("^") and i[1:] in replaced)]
        if len(keep) != len(n.input):
            del n.input[:]
            n.input.extend(keep)
    return BuiltInputs(out, input_map, inits, contexts, specs)


def _input_map(graph: Any, graph_def: Any, inputs: Sequence[str], batch_size: int, specs: list[PipelineSpec],
               outputs: list[dict[str, Any]], nodes: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """{tensor name in GRAPH_DEF: pipeline tensor} and the slice ops so replaced."""
    tf = import_tf()
    reads = _find_reads(graph_def, inputs, batch_size)
    input_map: dict[str, Any] = {}
    replaced: set[str] = set()
    for name in inputs:
        parts = [o[name] for o in outputs]
        dev = nodes[name].device
        with tf.device(dev or None), tf.name_scope(f"tag_input/{name}/"):
            full = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0, name="batch")
        input_map[f"{name}:0"] = full
        for r in reads[name]:
            if r.node is None:
                continue
            spec_i = next((i for i, s in enumerate(specs) if s.lo <= r.lo and r.hi <= s.hi), None)
            if spec_i is None:
                continue                      # spans pipelines: sliced from the joined batch, as before
            spec, src = specs[spec_i], outputs[spec_i][name]
            if (r.lo, r.hi) != (spec.lo, spec.hi):
                with tf.device(spec.device), tf.name_scope(f"tag_input/{name}/slice_{r.lo}_{r.hi}/"):
                    src = src[r.lo - spec.lo: r.hi - spec.lo]
            input_map[f"{r.node}:0"] = src
            replaced.add(r.node)
    return input_map, replaced


# ------------------------------------------------------------------------------------------------ per-host programs
PULL_INSTANCE = 3          # the collective instance of the hosts' "every pipeline has a batch" agreement


def host_pipeline_specs(programs: Mapping[str, Any]) -> dict[str, PipelineSpec]:
    """Host name -> its pipeline (the examples its program's batch inputs hold: one contiguous range per host),
    for every host of PROGRAMS (name -> ``HostProgram``) that reads examples. GraphError when a host's inputs
    are not one contiguous range of the batch, along axis 0."""
    out = {}
    for name, program in programs.items():
        if not program.inputs:
            continue
        if any(i.axis != 0 for i in program.inputs):
            bad = next(i for i in program.inputs if i.axis != 0)
            raise GraphError(f"batch input {bad.source!r} is split along axis {bad.axis}; input pipelines batch "
                             f"along axis 0 (feed it instead)")
        lo, hi = min(i.lo for i in program.inputs), max(i.hi for i in program.inputs)
        out[name] = PipelineSpec(program.task, lo, hi, program.cpu)
    return out


def attach_pipeline(program: Any, dataset_fn: Callable[[Any], Any], *, spec: PipelineSpec | None,
                    pipeline_id: int, pipelines: int, global_batch: int, inputs: Sequence[str],
                    host_cpus: Sequence[str], group_key: int, start_step: int = 0, seed: int = 0,
                    prefetch: int = PREFETCH) -> Any:
    """PROGRAM (a ``HostProgram``) with its own input pipeline: DATASET_FN's data set for SPEC's examples (None:
    a host that reads none) on the host's CPU, read into batch variables by a ``pull`` op that also agrees with
    every host (a collective over HOST_CPUS, group GROUP_KEY) that each pipeline still has a batch, so every host
    stops at the same step when one data set ends. Returns a new HostProgram whose ``input_init`` and ``pull``
    name those ops and whose batch inputs are filled."""
    import dataclasses
    tf = import_tf()
    graph = tf.Graph()
    input_map: dict[str, Any] = {}
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed + program.task)
        with tf.device(program.cpu), tf.name_scope("tag_input/"):
            inits, has = [], tf.constant(1, tf.int32)
            if spec is not None:
                nodes = {n.name: n for n in program.graph_def.node}
                by_source = {}
                for hi in program.inputs:
                    by_source.setdefault(hi.source, nodes[hi.name])
                placeholders = {}
                for source in inputs:
                    node = by_source.get(source)
                    if node is None:
                        continue
                    dims = tf.TensorShape(node.attr["shape"].shape)
                    shape = dims if dims.rank is None else tf.TensorShape([global_batch]).concatenate(dims[1:])
                    placeholders[source] = tf.TensorSpec(shape, tf.as_dtype(node.attr["dtype"].type), source)
                order = [s for s in inputs if s in placeholders]
                ctx = _context_class()(spec, pipeline_id, pipelines, global_batch, start_step)
                ds = _dataset(dataset_fn, ctx)
                matched = _match_elements(ds.element_spec, placeholders, order)
                ds = _batched(ds, placeholders, matched, spec.hi - spec.lo).prefetch(prefetch)
                it = tf.compat.v1.data.make_initializable_iterator(ds)
                optional = it.get_next_as_optional()
                present = optional.has_value()
                batches, assigns = {}, []
                for source, key in matched:
                    ph = placeholders[source]
                    var = tf.compat.v1.Variable(tf.zeros([spec.hi - spec.lo] + ph.shape.as_list()[1:], ph.dtype),
                                                trainable=False, use_resource=True, collections=[],
                                                name=f"batch_{len(batches)}")
                    batches[source] = var
                    inits.append(var.initializer)
                    assigns.append((var, key))
                with tf.control_dependencies([tf.cond(present, lambda: tf.group(*[
                        v.assign(optional.get_value() if k is None else optional.get_value()[k])
                        for v, k in assigns]), tf.no_op)]):
                    has = tf.cast(present, tf.int32)
                inits.append(it.initializer)
                for hi in program.inputs:
                    with tf.control_dependencies(None):
                        read = batches[hi.source].read_value()
                        input_map[f"{hi.name}:0"] = read[hi.lo - spec.lo: hi.hi - spec.lo]
            agreed = tf.raw_ops.CollectiveReduceV2(input=tf.reshape(has, [1]), group_size=len(host_cpus),
                                                   group_key=group_key, instance_key=PULL_INSTANCE, ordering_token=[],
                                                   merge_op="Min", final_op="Id", communication_hint="ring",
                                                   name="pull")
            input_init = tf.group(*inits, name="init") if inits else tf.no_op(name="init")
        try:
            tf.compat.v1.import_graph_def(program.graph_def, input_map=input_map or None, name="")
        except (ValueError, TypeError) as err:
            raise GraphError(f"the data set's batches do not fit the graph: {' '.join(str(err).split())[:300]}") \
                from None
    return dataclasses.replace(program, graph_def=graph.as_graph_def(), inputs=[], input_init=input_init.name,
                               pull=agreed.name if agreed.name.endswith(":0") else agreed.name + ":0")
