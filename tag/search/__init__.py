"""Search over strategies: candidate actions per op group, cached evaluation, MCTS, decision orders, PaSE DP.

Every search scores strategies with the simulator (``tag.sim``) and returns the best one it saw.
"""
