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
  replicas of an ``allreduce`` group (one fused collective per fusion bucket of ``tag.strategy.fusion``:
  gradients flattened, concatenated, all-reduced, split; group key per device set, instance key per
  collective), by
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
found from the IR's batch axes and rescaled for each instance's share (and for ``batch_size=``); so
are ``tf.shape`` results TensorFlow folded into constants (``<scope>/Shape_k``) and the loss's tail
outside the analysed step (its batch axes come from the frontend's per-op rules). Tensors TensorFlow
folded into a constant of the batch's shape (``zeros_like`` of a static batch) give each instance its
rows.

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
* BatchNorm keeps per-replica batch statistics (as Horovod and MirroredStrategy do); in a pipeline, per
  micro-batch and device (``pipeline``).
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

Where things are (one module per concern): ``api`` (``rewrite``), ``passes`` (the ordered passes, each a
function of a concern module with the state fields it reads and writes), ``context`` (``RewriteState``: the
shared state, its lookups -- dtypes, shapes, replicas -- and node builders), ``structure`` (graph order,
batch/gradient dependence), ``placement`` (variable copies and instances per op), ``variables``,
``batch_split`` (slices, concats, batch-following constants), ``instances`` (emission, input resolution,
clones), ``loop_state`` (per-batch loop bodies), ``collectives`` (all-reduce, fusion, group keys),
``parameter_server`` (whole-batch gradient sums), ``sfb``, ``pipeline`` (micro-batched stages, gradient
accumulation, the schedule's control dependencies), ``loss`` (seeds, loss kinds and weights, fetches),
``result`` (``RewriteResult``, assembled by the last pass), ``programs`` (a host's part of the result) and
``graph_edit`` (NodeDef/tensor-name plumbing, the import check).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag.backend.rewrite.api import RewriteResult, rewrite  # noqa: E402
from tag.backend.rewrite.collectives import collective_group_key  # noqa: E402

__all__ = ["RewriteResult", "rewrite", "collective_group_key"]
