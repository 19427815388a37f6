"""Lossless gradient compression: sufficient-factor broadcasting, placed where a MILP selection says it pays.

``tag.strategy.sfb_eligibility`` finds the weight gradients that are one batch-contracting MatMul (``dW = A^T B``;
re-exported here);
``selection`` picks which of them travel as factors (a 0/1 program solved with ``scipy.optimize.milp``,
confirmed by the simulator). numpy/scipy only.

Example::

    from tag.compress import select_sfb
    chosen = select_sfb(simulator, strategy)      # strategy with .sfb set where it pays
    chosen.chosen, chosen.step_time, chosen.bytes_saved
"""
from tag.compress.selection import SfbSelection, select_sfb
from tag.strategy.sfb_eligibility import SufficientFactors, eligible_gradients

__all__ = ["SfbSelection", "SufficientFactors", "eligible_gradients", "select_sfb"]
