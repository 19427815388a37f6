"""Mixed precision for a training GraphDef: TensorFlow's automatic mixed-precision rewrite, before planning.

``tag.optimize(..., precision=...)`` and ``tag-deploy --precision`` plan (and deploy) the graph that will
run, so the rewrite happens here, on the GraphDef, before the IR is built:

- ``"mixed_bfloat16"``: Grappler's ``auto_mixed_precision_onednn_bfloat16`` optimizer (run through
  ``tf_optimizer.OptimizeGraph`` with every other Grappler pass off): MatMuls, convolutions and the
  element-wise ops between them compute in bfloat16, with ``Cast`` ops at the edges; variables, the
  optimizer update and the gradients that reach it stay float32. The pass only acts on a CPU with
  AVX-512 bfloat16 support (it changed nothing on an AMD EPYC host); elsewhere tag puts the MatMuls and
  convolutions (``HALF_COMPUTE_OPS``) other than weight gradients in bfloat16 itself and leaves the
  element-wise ops float32.
- ``"mixed_float16"``: Grappler's ``auto_mixed_precision`` (the CUDA pass) where TensorFlow sees a GPU.
  That pass does nothing on a machine without one (checked with TensorFlow 2.21: the MatMuls stay
  float32, and ``auto_mixed_precision_cpu`` leaves them float32 too), so there the bfloat16 pass decides
  which ops go to half precision and they are given ``half`` instead (both passes share one allow /
  infer / deny scheme). FP16 then gets static loss scaling: the gradient seed of the loss (the
  ``Fill`` of ones that ``tf.gradients`` starts from) is multiplied by ``LOSS_SCALE`` (128, the static
  scale NVIDIA's TF1 ResNet-50 recipes used) and every gradient by ``1 / LOSS_SCALE`` before its optimizer
  update, so small gradients do not flush to zero in half precision while the update stays the same. The
  unscaling ``Mul`` sits in its gradient's name scope, so it is a backward op: each replica unscales its
  own gradient and the all-reduce starts as soon as that gradient exists, during the rest of the backward
  pass (named under the optimizer's update, it was an update op, and the simulator held every all-reduce of
  a ``mixed_float16`` graph until the whole backward pass had run).
  A static scale can overflow (NaN losses) where gradients are large; TensorFlow's dynamic loss scaling
  (skipping such steps) is not applied to a GraphDef here.
- ``"fp32"`` / ``"tf32"``: the graph unchanged (TF32 is a math mode of the GPU's MatMuls, on by default
  in TensorFlow on Ampere and later; the cost model charges it with ``CostModel(..., tf32=True)``).

A graph already built in mixed precision (a tf_keras ``mixed_float16`` / ``mixed_bfloat16`` policy)
needs none of this: its half-precision ops are in the GraphDef, and the IR costs them as they are.

``mark_for_xla`` marks a (rewritten) graph's element-wise and normalisation ops for XLA, so the deployed
graph fuses what ``CostModel(..., xla=True)`` costs as fused (``tag.optimize(..., xla=True)``).

Example::

    from tag.frontend.precision import apply_precision, mark_for_xla
    gd16 = apply_precision(graph_def, "mixed_float16", train_op="train_op", loss="loss")
    mark_for_xla(gd16)
"""
from __future__ import annotations

import re
from typing import Any

from tag.cost.precision import check_plan_precision
from tag.errors import GraphError

#: the static loss scale of FP16 graphs (a power of two: scaling and unscaling are exact)
LOSS_SCALE = 128.0


def apply_precision(graph_def: Any, precision: str | None, *, train_op: str, loss: str | None,
                    init: str | None = None, loss_scale: float = LOSS_SCALE, virtual_gpu: bool = False) -> Any:
    """GRAPH_DEF rewritten for PRECISION (module docstring); the same GraphDef for "fp32" / "tf32".

    TRAIN_OP, LOSS and INIT name the step, loss and initialiser ops; every node keeps its name (Grappler
    may not change the dtype of the ops it is asked to fetch, so only those keep theirs). VIRTUAL_GPU
    (``mixed_float16`` only): run TensorFlow's CUDA pass on a Grappler virtual cluster of one GPU even
    where TensorFlow sees none, so the graph is the one a GPU machine's pass makes (weight gradients and
    the element-wise ops between half-precision ops in half too), whatever CPU builds it: for costing GPU
    runs (``scripts/bench_published.py``); such a graph may have no CPU kernels for some of its ops."""
    fetch = [n for n in (train_op, loss, init) if n]
    precision = check_plan_precision(precision)
    if precision in ("fp32", "tf32"):
        return graph_def
    if precision == "mixed_float16" and (virtual_gpu or _has_gpu()):
        out = _grappler(graph_def, "auto_mixed_precision", fetch, virtual_gpu=virtual_gpu and not _has_gpu())
    else:
        out = _grappler(graph_def, "auto_mixed_precision_onednn_bfloat16", fetch)
        if not any(_is_half(n) for n in out.node):
            _half_compute_ops(out, fetch)
        if precision == "mixed_float16":
            _bfloat16_to_half(out)
    _repair_types(out)
    if not any(_is_half(n) for n in out.node):
        raise GraphError(f"TensorFlow's {precision} rewrite changed nothing in this graph (no MatMul or "
                         "convolution it converts)")
    if precision == "mixed_float16":
        if loss is None:
            raise GraphError("mixed_float16 needs the loss op, to scale it")
        _scale_loss(out, loss, loss_scale)
    return out


def _has_gpu() -> bool:
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


def _virtual_gpu_cluster() -> Any:
    """A Grappler virtual cluster of one GPU (compute capability 7.0, so the CUDA mixed-precision pass
    treats it as having tensor cores; CUDA 11 and cuDNN 8, which its allow list reads: batched MatMuls go
    to half precision from CUDA 9.1 on) and one CPU: the pass places the graph's ops on the GPU and
    rewrites them as it would on a GPU machine."""
    from tensorflow.core.protobuf import device_properties_pb2 as dp
    from tensorflow.python.grappler import cluster as gcluster
    base = "/job:localhost/replica:0/task:0/device:"
    gpu = dp.NamedDevice(name=base + "GPU:0", properties=dp.DeviceProperties(
        type="GPU", environment={"architecture": "7.0", "cuda": "11000", "cudnn": "8000"}, num_cores=80,
        frequency=1530, memory_size=16 << 30))
    cpu = dp.NamedDevice(name=base + "CPU:0", properties=dp.DeviceProperties(type="CPU"))
    return gcluster.Cluster(devices=[gpu, cpu])


def _grappler(graph_def: Any, optimizer: str, fetch: list[str], virtual_gpu: bool = False) -> Any:
    """GRAPH_DEF after the one Grappler OPTIMIZER (FETCH: the ops the step runs); nodes the step does not
    reach are kept as they were. VIRTUAL_GPU: optimise for a virtual cluster of one GPU (``_virtual_gpu_cluster``)
    instead of this machine's devices."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    keep = meta_graph_pb2.CollectionDef()
    # also every op whose output nothing reads (e.g. the unused gradient of an input placeholder): the
    # rewrite leaves ops outside the fetched ones' fan-in with their old types, a fetched op keeps its type
    read = {i.lstrip("^").split(":")[0] for n in graph_def.node for i in n.input}
    keep.node_list.value.extend(dict.fromkeys(list(fetch) + [n.name for n in graph_def.node if n.name not in read]))
    meta.collection_def["train_op"].CopyFrom(keep)
    cfg = config_pb2.ConfigProto()
    rw = cfg.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    for field in ("model_pruner", "layout_optimizer", "constant_folding", "shape_optimization", "remapping",
                  "arithmetic_optimization", "dependency_optimization", "loop_optimization",
                  "function_optimization", "debug_stripper", "memory_optimization", "pin_to_host_optimization",
                  "implementation_selector", "common_subgraph_elimination"):
        if hasattr(rw, field):
            setattr(rw, field, off)
    rw.min_graph_nodes = -1
    rw.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    setattr(rw, optimizer, rewriter_config_pb2.RewriterConfig.ON)
    out = tf_optimizer.OptimizeGraph(cfg, meta, cluster=_virtual_gpu_cluster() if virtual_gpu else None)
    have = {n.name for n in out.node}
    out.node.extend(n for n in graph_def.node if n.name not in have)
    out.library.CopyFrom(graph_def.library)
    out.versions.CopyFrom(graph_def.versions)
    return out


def _arg_types(node: Any, args: Any) -> list[int] | None:
    """The dtype enum of each tensor of ARGS (an OpDef's input or output args) on NODE; None if unknown."""
    out: list[int] = []
    for arg in args:
        if arg.type_list_attr:
            out.extend(node.attr[arg.type_list_attr].list.type)
            continue
        t = node.attr[arg.type_attr].type if arg.type_attr else arg.type
        n = node.attr[arg.number_attr].i if arg.number_attr else 1
        out.extend([t] * n)
    return out or None


def _repair_types(graph_def: Any) -> None:
    """Insert a Cast (in place) wherever an op now receives a dtype other than the one it declares.

    Grappler's pass leaves a few ops outside the fetched ops' fan-in as they were (e.g. the
    ``StopGradient`` of a layer norm's mean), while their producer moved to half precision."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.python.framework import op_def_registry
    floats = {types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16}
    nodes = {n.name: n for n in graph_def.node}
    outputs: dict[str, list[int] | None] = {}
    for n in graph_def.node:
        op_def = op_def_registry.get(n.op)
        outputs[n.name] = _arg_types(n, op_def.output_arg) if op_def is not None else None
    for n in list(graph_def.node):
        op_def = op_def_registry.get(n.op)
        wanted = _arg_types(n, op_def.input_arg) if op_def is not None else None
        if wanted is None:
            continue
        data = [i for i in n.input if not i.startswith("^")]
        for pos, name in enumerate(data[:len(wanted)]):
            src, _, idx = name.partition(":")
            got = outputs.get(src)
            k = int(idx) if idx else 0
            if src not in nodes or got is None or k >= len(got):
                continue
            if got[k] != wanted[pos] and got[k] in floats and wanted[pos] in floats:
                cast = graph_def.node.add()
                cast.name, cast.op = f"{n.name}/input_{pos}_cast", "Cast"
                cast.input.append(name)
                cast.attr["SrcT"].type, cast.attr["DstT"].type = got[k], wanted[pos]
                cast.device = n.device
                n.input[list(n.input).index(name)] = cast.name


#: the compute ops every TensorFlow mixed-precision pass puts in half precision (its allow list's core)
HALF_COMPUTE_OPS = frozenset({"MatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"})


def _half_compute_ops(graph_def: Any, fetch: list[str]) -> None:
    """Where the oneDNN bfloat16 pass converts nothing (it only runs on CPUs with AVX-512 bfloat16 support,
    and it ran on none of an AMD EPYC host's graphs): the MatMuls and convolutions (``HALF_COMPUTE_OPS``)
    compute in bfloat16 (in place; ``_repair_types`` then adds the Casts around them), except weight
    gradients (``Conv2DBackpropFilter``, a ``MatMul`` with ``transpose_a``): data parallelism sums their
    per-replica partial sums, and partial sums rounded to bfloat16's 8-bit mantissa cancel badly (a
    two-replica plan of a small MLP with Adam ended 0.99 of an update away from one device; with them in
    float32, 5e-6). The element-wise ops between them stay float32, where the pass would move some too.
    A plan made on such a machine therefore costs weight gradients at float32 rates, pessimistically for a
    GPU cluster whose own pass would run them in half precision."""
    from tensorflow.core.framework import types_pb2
    for n in graph_def.node:
        weight_gradient = n.op == "Conv2DBackpropFilter" or (n.op == "MatMul" and n.attr["transpose_a"].b)
        if n.op in HALF_COMPUTE_OPS and n.name not in fetch and n.attr["T"].type == types_pb2.DT_FLOAT \
                and not weight_gradient:
            n.attr["T"].type = types_pb2.DT_BFLOAT16


def _is_half(node: Any) -> bool:
    from tensorflow.core.framework import types_pb2
    half = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
    return any(v.type in half for v in node.attr.values())


def _bfloat16_to_half(graph_def: Any) -> None:
    """Every bfloat16 type attribute of GRAPH_DEF (in place) becomes half."""
    from tensorflow.core.framework import types_pb2
    for n in graph_def.node:
        for v in n.attr.values():
            if v.type == types_pb2.DT_BFLOAT16:
                v.type = types_pb2.DT_HALF
            if v.list.type:
                v.list.type[:] = [types_pb2.DT_HALF if t == types_pb2.DT_BFLOAT16 else t for t in v.list.type]


def _scale_loss(graph_def: Any, loss: str, scale: float) -> None:
    """Static loss scaling (in place): the gradient seed of LOSS becomes SCALE, each optimizer update's
    gradient is multiplied by 1 / SCALE first."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry

    from tag.frontend.op_rules import grad_arg_index, is_apply_op
    nodes = {n.name: n for n in graph_def.node}

    def base(name: str) -> str:
        return name.lstrip("^").split(":")[0]

    # tf.gradients starts from Fill(shape of the loss, 1) named gradients/Fill or gradients/grad_ys_0
    # (the shape is a Const when it is static); one per gradients call of this loss
    seed_name = re.compile(r"(^|/)gradients(_\d+)?/(Fill|grad_ys_\d+)$")

    def is_seed(n: Any) -> bool:
        if n.op != "Fill" or len(n.input) != 2 or not seed_name.search(n.name):
            return False
        dims = nodes.get(base(n.input[0]))
        return dims is not None and (dims.op == "Const" or (dims.op == "Shape" and dims.input
                                                             and base(dims.input[0]) == loss))

    seeds = [n for n in graph_def.node if is_seed(n)]
    if not seeds:
        raise GraphError(f"mixed_float16: cannot find the gradient seed of the loss {loss!r} (the Fill of ones "
                         "tf.gradients starts from) to scale")
    # the seed's consumers read seed * SCALE (the seed itself stays a Fill of ones, which tag's rewriter
    # sets to each replica's batch share)
    scaled: dict[str, str] = {}
    for seed in seeds:
        value = nodes[base(seed.input[1])]
        dtype = tf.as_dtype(value.attr["dtype"].type)
        const = _const(f"{seed.name}/loss_scale_value", np.array(scale, dtype=dtype.as_numpy_dtype))
        mul = graph_def.node.add()
        mul.name, mul.op = f"{seed.name}/loss_scale", "Mul"
        mul.input.extend([seed.name, const.name])
        mul.attr["T"].type = dtype.as_datatype_enum
        mul.device = seed.device
        graph_def.node.append(const)
        scaled[seed.name] = mul.name
    for n in graph_def.node:
        if n.name in scaled.values():
            continue
        for i, name in enumerate(n.input):
            if name in scaled or (name.endswith(":0") and name[:-2] in scaled):
                n.input[i] = scaled[name.split(":")[0]]
    inv = {}
    taken = {n.name for n in graph_def.node}
    for n in list(graph_def.node):
        if not is_apply_op(n.op):
            continue
        gi = grad_arg_index(op_def_registry.get(n.op))
        if gi is None or gi >= len(n.input):
            continue
        dt = n.attr["T"].type
        if dt not in inv:
            c = _const(f"loss_scale/inverse_{tf.as_dtype(dt).name}",
                       np.array(1.0 / scale, dtype=tf.as_dtype(dt).as_numpy_dtype))
            graph_def.node.append(c)
            inv[dt] = c.name
        # in the gradient's own name scope, so that tag classifies it as a backward op (``tag.frontend.phases``):
        # each replica unscales its gradient, and its all-reduce can start as soon as the gradient exists
        # (unscaling is linear: before or after the sum is the same update)
        base = f"{n.input[gi].lstrip('^').split(':')[0]}/unscale"
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        mul = graph_def.node.add()
        mul.name = name
        mul.op = "Mul"
        mul.input.extend([n.input[gi], inv[dt]])
        mul.attr["T"].type = dt
        if n.device:
            mul.device = n.device
        n.input[gi] = mul.name


def _const(name: str, value: Any) -> Any:
    import tensorflow as tf
    from tensorflow.core.framework import node_def_pb2
    node = node_def_pb2.NodeDef()
    node.name, node.op = name, "Const"
    node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return node


def mark_for_xla(graph_def: Any) -> int:
    """Mark (in place) the element-wise and normalisation ops the cost model fuses under ``xla=True``
    (``tag.cost.precision.FUSIBLE_TYPES``) for XLA, with the attributes ``tf.xla.experimental.jit_scope``
    sets (``_XlaCompile``, one ``_XlaScope`` per device, so no cluster spans devices); TensorFlow's
    auto-clustering then compiles and fuses them when the session runs (also on CPU). Returns how many."""
    from tag.cost.precision import FUSIBLE_TYPES
    marked = 0
    for n in graph_def.node:
        if n.op in FUSIBLE_TYPES:
            n.attr["_XlaCompile"].b = True
            n.attr["_XlaScope"].s = f"tag_xla:{n.device}".encode()
            n.attr["_XlaSeparateCompiledGradients"].b = False
            marked += 1
    return marked


__all__ = ["LOSS_SCALE", "apply_precision", "mark_for_xla"]
