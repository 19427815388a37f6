"""The rewriter as a sequence of passes, each a function of one concern module over the shared state
(``context.RewriteState``), with the state fields it reads and writes.

A pass reads only the state's inputs (``context.INPUT_FIELDS``) and fields an earlier pass wrote
(``tests/test_rewrite_passes.py`` checks the declarations against each other and against the fields
each pass touches when it runs); ``run_passes`` checks, after each pass, that it set the fields it
declares it writes. Lookups on the state (``replicas``, ``dtype``, ...) read fields too: a pass that
calls them declares what they read. ``notes`` is appended to by any pass and ``host`` is read by none
yet (``RewriteState``).

Example::

    import tag
    from tag.strategy.grouping import group_ops
    from tag.strategy.baselines import builtin_strategy
    from tag.backend.rewrite.context import RewriteState
    from tag.backend.rewrite.passes import PASSES, run_passes

    topo = tag.load_topology("topologies/localhost.pbtxt")
    gd = tag.zoo.training_graph("mlp", batch_size=32)
    tg = tag.analyze(gd)
    st = RewriteState(gd, tg, builtin_strategy("dp_allreduce", tg, topo, group_ops(tg, 16)), topo)
    run_passes(st, PASSES[:3])         # set up the pipeline (none), prune and order, batch constants
    st.const_scale                     # batch-dependent Const -> positions that follow the batch
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import batch_split, collectives, instances, loss, pipeline, placement, result, sfb, structure
from .context import RewriteState


@dataclass(frozen=True)
class Pass:
    """One step of the rewrite: NAME, the function RUN(state), and the state fields it READS and WRITES."""

    name: str
    run: Callable[[RewriteState], None]
    reads: frozenset[str]
    writes: frozenset[str]


def _pass(run: Callable[[RewriteState], None], reads: str, writes: str) -> Pass:
    return Pass(run.__name__, run, frozenset(reads.split()), frozenset(writes.split()))


PASSES: tuple[Pass, ...] = (
    _pass(pipeline.setup_pipeline,
          "batch ir nodes strategy topo",
          "deferred_ops micro_ranges notes stage_instances stage_of_group"),
    _pass(structure.prune_and_order,
          "init inputs ir_index loss nodes train_op",
          "consumers order"),
    _pass(batch_split.const_rules,
          "consumers graph_def ir ir_index nodes order ref_batch tensor_info",
          "const_scale tensor_info"),
    _pass(structure.flag_dependencies,
          "const_scale consumers inputs ir ir_index loss nodes order tensor_info",
          "batch_dependent grad_dependent loss_is_mean on_summed_grads seeds"),
    _pass(pipeline.check_pipeline_order,
          "ir ir_index nodes order stage_of_group strategy",
          "notes"),
    _pass(placement.place_variables,
          "batch batch_dependent full_batch ir ir_index nodes on_summed_grads order strategy topo",
          "var_copies var_owner"),
    _pass(placement.place_all,
          "batch batch_dependent consumers deferred_ops full_batch inputs ir ir_index nodes "
          "on_summed_grads order stage_instances stage_of_group strategy topo var_copies",
          "placements"),
    _pass(loss.check_seeds,
          "full_batch placements seeds train_op",
          ""),
    _pass(instances.begin_output,
          "graph_def nodes strategy",
          "added_functions allreduce_memo counts emission function_copies function_table instance_at "
          "instance_key_of instances memo out_nodes taken_instance_keys token used_names"),
    _pass(sfb.plan_sfb,
          "ir ir_index nodes stage_of_group strategy",
          "notes sfb_factors sfb_gathers sfb_tensors"),
    _pass(collectives.plan_fusion,
          "fuse_allreduce grad_dependent ir ir_index sfb_tensors strategy tensor_info",
          "bucket_out buckets buckets_used fusion used_names"),
    _pass(collectives.plan_dense_sparse,
          "batch ir ir_index stage_of_group strategy",
          "dense_sparse"),
    _pass(instances.emit_instances,
          "batch batch_dependent bucket_out const_scale deferred_ops dense_sparse emission full_batch "
          "function_table fusion grad_dependent graph_def ir ir_index loss_is_mean micro_ranges nodes "
          "order placements ref_batch seeds sfb_factors sfb_tensors stage_of_group strategy "
          "tensor_info token topo var_copies",
          "added_functions allreduce_memo buckets_used counts function_copies instance_at "
          "instance_key_of instances memo notes out_nodes sfb_gathers taken_instance_keys used_names"),
    _pass(collectives.emit_fusions,
          "batch_dependent bucket_out buckets buckets_used emission instances ir_index nodes "
          "sfb_tensors stage_of_group strategy tensor_info token topo",
          "counts instance_key_of memo notes out_nodes taken_instance_keys used_names"),
    _pass(instances.note_counts,
          "counts",
          "notes"),
    _pass(pipeline.enforce_schedule,
          "consumers deferred_ops full_batch inputs instances ir ir_index micro_ranges nodes "
          "stage_of_group strategy topo",
          "notes out_nodes used_names"),
    _pass(batch_split.send_remote_slices_first,
          "inputs",
          "out_nodes"),
    _pass(loss.fetches,
          "batch full_batch init instances loss loss_is_mean tensor_info topo train_op",
          "fetch_init fetch_loss fetch_train out_nodes used_names"),
    _pass(result.assemble,
          "added_functions batch fetch_init fetch_loss fetch_train graph_def inputs instances notes "
          "out_nodes stage_instances stage_of_group strategy topo validate var_copies",
          "result"),
)


def run_passes(st: RewriteState, passes: tuple[Pass, ...] = PASSES) -> None:
    """Run PASSES in order on ST; RuntimeError (a bug of the rewriter) when a pass leaves a field it
    declares it writes unset."""
    for p in passes:
        p.run(st)
        missing = sorted(f for f in p.writes if f not in st.__dict__)
        if missing:
            raise RuntimeError(f"rewrite pass {p.name} did not set {', '.join(missing)}")
