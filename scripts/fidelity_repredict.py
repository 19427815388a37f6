"""Re-predict a saved bench_fidelity run with today's cost model and simulator, against that run's measurements.

A simulator change can be checked on measurements already taken, without the testbed: for every group of a
saved ``bench_fidelity --json F`` run, the same graph is prepared with the run's own calibrated profile and
topology (``F.run1.testbed-C.profile.json`` / ``.pbtxt``, written beside F), and its built-ins and random mixes
(the same seed, so the same strategies) are predicted again. The searched plan and the tuning step's pick are
left out: the search itself may choose differently today. Prints old and new error per case and the figures
of ``tag_bench.fidelity`` (errors by class, Kendall tau; the rest and the held-out part apart); ``--json``
writes them with every row.

Usage::

    python scripts/fidelity_repredict.py F.json      # F.json: a bench_fidelity --json F.json run, its files beside it
    python scripts/fidelity_repredict.py RUN.json --models transformer,vgg --json out.json
    python scripts/fidelity_repredict.py RUN.json --network collective_latency_s=0.001   # a what-if

``--network KEY=VALUE`` replaces a field of every saved profile's ``NetworkProfile`` (``tag.cost.profile``):
what a calibration that measured that figure differently would have predicted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tag_bench.fidelity import MODELS, case_class, repredict_group, split_heldout, summary  # noqa: E402
from tag_bench.records import Run, commit_of, write_json  # noqa: E402


def network_overrides(pairs: list[str]) -> dict[str, float]:
    """{field: value} of ``--network KEY=VALUE`` options; ValueError naming a bad one."""
    from tag.cost.profile import NetworkProfile
    known = {f.name for f in dataclasses.fields(NetworkProfile)}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in known:
            raise ValueError(f"--network {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--network {pair!r}: {value!r} is not a number") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a saved bench_fidelity --json file (its profiles and topologies beside it)")
    p.add_argument("--models", help="comma-separated subset of the run's models")
    p.add_argument("--seed", type=int, default=0, help="the run's --seed (default 0, bench_fidelity's)")
    p.add_argument("--json", help="write the figures and rows here")
    p.add_argument("--network", action="append", default=[], metavar="KEY=VALUE",
                   help="replace this NetworkProfile field in every saved profile (repeatable)")
    args = p.parse_args(argv)
    this_run = Run(__file__, argv)
    try:
        overrides = network_overrides(args.network)
    except ValueError as err:
        print(f"fidelity_repredict: {err}", file=sys.stderr)
        return 2
    with open(args.run) as f:
        run = json.load(f)
    prefix = args.run[:-len(".json")] if args.run.endswith(".json") else args.run
    spec_of = {label: (spec, batch) for label, spec, batch in MODELS}
    rows = [r for r in run["rows"] if case_class(r["strategy"]) in ("uniform", "random")]
    groups = sorted({(r["config"], r["model"]) for r in rows})
    wanted = set(args.models.split(",")) if args.models else None
    out_rows = []
    for config, label in groups:
        if (wanted and label not in wanted) or label not in spec_of:
            continue
        mine = {r["strategy"]: r for r in rows if (r["config"], r["model"]) == (config, label)}
        spec, batch = spec_of[label]
        randoms = sum(1 for n in mine if n.startswith("random"))
        predicted = repredict_group(prefix, config, spec, batch, label, args.seed, randoms, network=overrides)
        for name, r in mine.items():
            if name not in predicted:
                continue
            new = dict(r, predicted_s=float(predicted[name]), old_predicted_s=r["predicted_s"])
            new["rel_error"] = (new["predicted_s"] - r["measured_s"]) / r["measured_s"]
            new.pop("tuned_pick", None)
            out_rows.append(new)
            print(f"{config:<2} {label:<18} {name:<13} measured {r['measured_s'] * 1e3:8.1f} ms  then "
                  f"{r['predicted_s'] * 1e3:8.1f} ({(r['predicted_s'] / r['measured_s'] - 1) * 100:+5.0f}%)  now "
                  f"{new['predicted_s'] * 1e3:8.1f} ({new['rel_error'] * 100:+5.0f}%)", flush=True)
    rest, held = split_heldout(out_rows)
    result = {"run": os.path.basename(args.run), "run_commit": commit_of(run), "network_overrides": overrides,
              "rest": {k: v for k, v in summary(rest).items() if k != "groups"} if rest else None,
              "heldout": {k: v for k, v in summary(held).items() if k != "groups"} if held else None,
              "rows": out_rows}
    for part in ("rest", "heldout"):
        f = result[part]
        if f:
            print(f"{part}: {f['cases']} cases, median error {f['median_abs_rel_error'] * 100:.1f}% (uniform "
                  f"{f['median_abs_rel_error_uniform'] * 100:.1f}%, "
                  f"random {f['median_abs_rel_error_random'] * 100:.1f}%), "
                  f"max random {f['max_abs_rel_error_random'] * 100:.1f}%, "
                  f"mean Kendall tau {f['mean_kendall_tau']:.2f}")
    write_json(args.json, result, this_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
