"""The traversal-order study on the zoo: which decision order lets the tree search find the most, at an equal budget.

Sequential placement decides one op group after another; the order changes what a fixed budget finds,
and the best order depends on the network family. For every zoo model, every heterogeneous ready topology
and a small global batch (4 examples per device), MCTS alone (no refinement, uniform-value prior) runs with
each decision order of ``tag.search.orders`` at the same playout budget and seed; the score is the speedup of
its best strategy over data parallelism. Per model family, the winning order is the one with the highest
geometric-mean speedup, and the margin is its ratio to the runner-up and to TAG's cost-descending order.
``tag.search.orders.AUTO_ORDER`` is set from this table.

Usage::

    python scripts/bench_orders.py --json orders.json                  # all zoo models
    python scripts/bench_orders.py --models resnet50 vgg19 --playouts 100
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import tag
from tag.search import SearchEnv
from tag.search.mcts import mcts
from tag.search.orders import ORDERS, model_family
from tag.strategy.grouping import group_ops
from tag_bench.machine import load1
from tag_bench.records import Run, write_json
from tag_bench.stats import geomean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/
TOPOLOGIES = ["lab-v100-1080ti", "cloud-slow-link", "consumer-lab-4host"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--topologies", nargs="*", default=TOPOLOGIES)
    p.add_argument("--playouts", type=int, default=150)
    p.add_argument("--per-device", type=int, default=4, help="examples per device in the global batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    models = args.models or list(tag.zoo.names())
    rows = []
    print(f"{'model':<13} {'family':<12} {'topology':<20} " + " ".join(f"{o[:12]:>12}" for o in ORDERS)
          + f" {'load':>5}")
    for model in models:
        tg = tag.analyze(tag.zoo.training_graph(model, batch_size=32))
        grouping = group_ops(tg, target_groups=64)
        family = model_family(tg)
        for name in args.topologies:
            topo = tag.load_topology(os.path.join(ROOT, "topologies", f"{name}.pbtxt"))
            batch = args.per_device * topo.num_devices
            shared = SearchEnv(tg, topo, grouping, batch_size=batch)
            speedups = {}
            for order in ORDERS:
                env = SearchEnv(tg, topo, grouping, batch_size=batch, simulator=shared.simulator)
                t0 = time.perf_counter()
                tree = mcts(env, order=order, playouts=args.playouts, seed=args.seed)
                speedups[order] = env.reference_time / tree.outcome.step_time if tree.outcome.feasible else 0.0
                rows.append({"model": model, "family": family, "topology": name, "batch": batch, "order": order,
                             "speedup_vs_reference": speedups[order], "reference": env.reference_name,
                             "seconds": time.perf_counter() - t0, "evaluations": env.evaluations})
            print(f"{model:<13} {family:<12} {name:<20} " + " ".join(f"{speedups[o]:12.3f}" for o in ORDERS)
                  + f" {load1():5.1f}", flush=True)
    families = sorted({r["family"] for r in rows})
    winners = {}
    print("\nper family: geometric-mean speedup over the reference by order")
    for fam in families:
        # an order that found no feasible plan in the family scores nan (it ranks nowhere)
        score = {o: geomean([r["speedup_vs_reference"] for r in rows if r["family"] == fam and r["order"] == o
                             and r["speedup_vs_reference"] > 0]) or math.nan for o in ORDERS}
        ranked = sorted(ORDERS, key=lambda o: -score[o])
        best, second = ranked[0], ranked[1]
        winners[fam] = {"order": best, "geomean": score[best], "over_runner_up": score[best] / score[second],
                        "over_cost_descending": score[best] / score["cost_descending"], "scores": score}
        print(f"  {fam:<12} winner {best:<20} {score[best]:.3f}  (x{score[best] / score[second]:.3f} over "
              f"{second}, x{score[best] / score['cost_descending']:.3f} over cost_descending)")
    write_json(args.json, {"rows": rows, "winners": winners, "playouts": args.playouts}, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
