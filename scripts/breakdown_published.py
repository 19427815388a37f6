"""Where a published row's predicted step goes: one device's op times split by op class and bound.

For each row id given (``data/published_throughput.csv``), the per-op times tag's cost model gives one GPU
of the row's system at its per-GPU batch (``CostModel.op_times``, no profile) are summed by key: a MatMul
or convolution by its op class and precision (``conv:3x3s1/fp16``), every other op by its type; each key
also says how much of its time is memory-bound (bytes / bandwidth above the compute time) and how much is
launch overhead. With ``--step`` the row's simulated step (``dp_allreduce``, as the bench), its lockstep
factor and the time of one ring all-reduce of all its gradients are printed too, so a multi-GPU row's exposed
communication can be read against the device sum (the one-device step).

Usage::

    python scripts/breakdown_published.py --cache DIR ROW_ID [ROW_ID ...] [--top 12] [--json FILE]

``--json`` writes ``{"provenance", "rows"}``: every row's breakdown.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

from tag_bench import published
from tag_bench.records import Run, write_json


def breakdown(row: dict[str, Any], graph, step: bool = False) -> dict[str, Any]:
    """Per-key predicted seconds of one device's step for ROW (see the module docstring)."""
    import numpy as np

    import tag
    from tag.cost.model import CostModel
    from tag.cost.occupancy import occupancy
    n, per = row["gpu_count"], row["per_gpu_batch"]
    topo = tag.parse_topology(published.topology_text(row["system"], n), path=f"<{row['system']}>")
    cm = CostModel(graph, topo, tf32=row["precision"] == "tf32", xla=row["xla"],
                   gradient_dtype=None if row["grad_dtype"] == "fp32" else row["grad_dtype"])
    t = cm.op_times(0, float(per))
    r = cm.rates(0)
    a = cm.arrays
    flops = a.flops_fixed + a.flops_per_example * per
    mem = cm._mem_fixed + cm._mem_per_example * per
    compute = flops * cm._inv_compute_rate(0)
    if r.sms > 0:
        compute = compute / occupancy(cm.gemm_extents, per, r.sms, cm._on_tensor_cores(0))
    memt = mem / r.memory_bandwidth
    launch = np.where(cm._fused, 0.0, r.launch_overhead_s) * r.lockstep_factor
    keys: dict[str, dict[str, float]] = defaultdict(lambda: {"s": 0.0, "mem_s": 0.0, "launch_s": 0.0, "ops": 0})
    for i, op in enumerate(graph.ops):
        if t[i] <= 0:
            continue
        tk, cls, prec = cm._keys[cm._op_key_id[i]]
        k = f"{cls}/{prec}" if cls else op.type
        e = keys[k]
        e["s"] += float(t[i])
        e["launch_s"] += float(launch[i])
        if memt[i] > compute[i]:
            e["mem_s"] += float(t[i] - launch[i])
        e["ops"] += 1
    total = sum(e["s"] for e in keys.values())
    out = {"id": row["id"], "per_gpu_batch": per, "gpus": n, "device_sum_s": total,
           "published_step_s": n * per / row["throughput"],
           "keys": dict(sorted(keys.items(), key=lambda kv: -kv[1]["s"]))}
    if step:
        from tag.sim.simulator import Simulator
        from tag.strategy.baselines import builtin_strategy
        from tag.strategy.grouping import group_ops
        grouping = group_ops(graph, target_groups=published.GROUPS)
        strategy = builtin_strategy("dp_allreduce", graph, topo, grouping, cm)
        out["simulated_step_s"] = Simulator(graph, topo, grouping, cm).evaluate(strategy, batch_size=n * per).step_time
        out["lockstep_factor"] = r.lockstep_factor
        grad = sum(v.nbytes for v in graph.variables if v.kind == "trainable")
        out["gradient_bytes"] = grad * cm.gradient_bytes_factor
        out["allreduce_s"] = cm.allreduce_time(grad, list(range(n))) if n > 1 else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", nargs="+", help="row ids of the data file")
    p.add_argument("--cache", metavar="DIR", help="the bench's IR cache")
    p.add_argument("--top", type=int, default=12, help="keys printed per row")
    p.add_argument("--step", action="store_true", help="also simulate the row's step")
    p.add_argument("--json", metavar="FILE", help="write every row's breakdown as JSON")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    rows = {r["id"]: r for r in published.read_rows()}
    res = []
    for rid in args.rows:
        row = rows[rid]
        b = breakdown(row, published.build_ir(row, args.cache), step=args.step)
        res.append(b)
        head = (f"{rid}: device sum {1e3 * b['device_sum_s']:.1f} ms, "
                f"published step {1e3 * b['published_step_s']:.1f} ms")
        if "simulated_step_s" in b:
            head += (f", simulated step {1e3 * b['simulated_step_s']:.1f} ms (lockstep x{b['lockstep_factor']:.3f}), "
                     f"all-reduce of every gradient {1e3 * b['allreduce_s']:.1f} ms "
                     f"({b['gradient_bytes'] / 1e6:.0f} MB)")
        print(head)
        for k, e in list(b["keys"].items())[:args.top]:
            print(f"  {k:28} {1e3 * e['s']:8.2f} ms {100 * e['s'] / b['device_sum_s']:5.1f}%  "
                  f"mem-bound {1e3 * e['mem_s']:7.2f}  launch {1e3 * e['launch_s']:6.2f}  ops {e['ops']}")
    write_json(args.json, {"rows": res}, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
