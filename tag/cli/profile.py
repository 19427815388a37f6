"""``tag-profile``: profile a training step on this machine and write a cost profile (JSON).

Measures with ``tag.calibration`` (TensorFlow), fits with ``tag.cost.fitting``; the profile
goes to ``--json FILE``, else to ``tag.cost.profile_store.default_profile_path()`` where ``tag-deploy``
finds it. A profile describes the device type it was measured on (``--device-type``, default CPU): for a
mixed cluster, profile each type on its own machine and ``--merge`` the files (``tag.cli.profiles``).

Usage::

    tag-profile --model zoo:mlp --json profile.json     # then tag-deploy --profile profile.json
    tag-profile --model zoo:mlp                         # writes default_profile_path()
    tag-profile --model zoo:mlp --network               # + TF runtime costs between two workers
    tag-profile --model zoo:mlp --sustained 4 --json full.json             # + the mean step over 4 s
    tag-profile --model zoo:mlp --matmul-table --json p.json  # + MatMul speed by shape (about 2 minutes)
    tag-profile --model zoo:mlp --like full.json --device-type CPUq50      # the same device, time-sliced
    tag-profile --merge v100.json gtx1080ti.json --json lab.json  # device types of a mixed cluster in one file

    from tag.cli.profile import main
    main(["--model", "zoo:mlp,input_dim=64,hidden=128", "--batch-size", "16", "--steps", "2", "--json", "p.json"])

Exit codes: 0 success, 2 bad input (one line on stderr), 1 anything else.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Sequence

from tag.cli.common import ArgumentParser, add_old_name, add_verbose, run_cli
from tag.cost.profile_store import PROFILE_ENV, default_profile_path
from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cost.model import Profile

PROG = "tag-profile"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG,
                                description="Profile a training step on this machine and write a cost profile.")
    p.add_argument("--model", default=None, nargs="+", metavar="SPEC",
                   help="zoo:NAME[,key=value...] or a .pb/.pbtxt training GraphDef; several are fitted together "
                        "(with --like and --sustained, the first one is timed)")
    p.add_argument("--merge", nargs="+", default=None, metavar="P.json",
                   help="instead of profiling: merge profiles of different device types into --json")
    add_old_name(p, "--batch", p.add_argument("--batch-size", dest="batch", type=int, default=None, metavar="N",
                                              help="global batch size (default: the model's)"))
    p.add_argument("--steps", type=int, default=10, metavar="N", help="traced steps (default 10)")
    p.add_argument("--device-type", default="CPU", help="device type the profile describes (default CPU)")
    add_old_name(p, "--out", p.add_argument("--json", dest="out", default=None, metavar="FILE",
                                            help=f"write the profile as JSON (default: ${PROFILE_ENV} or the user "
                                                 f"cache)"))
    p.add_argument("--sustained", type=float, default=None, metavar="S",
                   help="also time S seconds of steps back to back and record the mean step (what --like scales "
                        "from; default: off, 4 with --like)")
    p.add_argument("--like", default=None, metavar="BASE.json",
                   help="a device that runs BASE's kernels at another speed (a CPU quota, a shared GPU): time the "
                        "model's sustained step here and scale BASE's one device entry (profiled with --sustained)")
    p.add_argument("--matmul-table", action="store_true",
                   help="also time MatMul products on a grid of shapes (about 2 minutes on one CPU core) and cost "
                        "each MatMul op at its own shape and transposes")
    p.add_argument("--network", action="store_true",
                   help="also measure TF's distributed runtime between two local one-thread workers "
                        "(step overhead, transfer latency and throughput)")
    add_verbose(p)
    return p


def _summary(prof: "Profile", device_type: str) -> list[str]:
    """The lines printed after the profile is written: runtime costs, peak, bandwidth, efficiencies."""
    d = prof.to_dict()["devices"][device_type]
    lines = []
    if prof.network is not None:
        n = prof.network
        lines.append(f"  runtime: step overhead {n.step_overhead_s * 1e3:.2f} ms, transfer latency "
                     f"{n.transfer_latency_s * 1e6:.0f} us (+{n.per_tensor_s * 1e6:.0f} us per tensor), transfer "
                     f"throughput {n.transfer_bytes_per_s / 1e9:.2f} GB/s, "
                     f"all-reduce latency {n.collective_latency_s * 1e6:.0f} us, throughput "
                     f"{n.collective_bytes_per_s / 1e9:.2f} GB/s")
        if n.host_cpu:
            lines.append(f"  runtime CPU (one thread of {n.cpu_flops / 1e9:.0f} GFLOP/s): a remote worker "
                         f"{n.worker_step_cpu_s * 1e3:.2f} ms per step, {n.tensor_cpu_s * 1e6:.0f} us per tensor and "
                         f"{n.byte_cpu_s * 1e9:.2f} ns per byte at each end")
    lines.append(f"  peak {d['peak_flops'] / 1e9:.1f} GFLOP/s, memory {d['memory_bandwidth'] / 1e9:.1f} GB/s, "
                 f"launch {d['launch_overhead_s'] * 1e6:.1f} us")
    for t, e in sorted(d["efficiency"].items()):
        lines.append(f"  {t:<36} efficiency {e:.3g}")
    table = prof.devices[device_type].matmul_table
    if table is not None:
        spans = ", ".join(f"{v} {a.min():.3g}-{a.max():.3g}" for v, a in table.efficiency.items())
        lines.append(f"  MatMul by shape (sides {table.sides[0]}-{table.sides[-1]}): efficiency {spans}")
    if d.get("family_scale"):
        fade = (f", fading over {d['level_fade_s'] * 1e3:.3g} ms of an op's time" if d.get("level_fade_s") else "")
        lines.append("  time scale per op family: " + ", ".join(f"{f} x{v:.3g}" for f, v in d["family_scale"].items())
                     + fade)
    return lines


def _merge(args: argparse.Namespace) -> int:
    """``--merge A B ... --json C``: one profile for a mixed cluster."""
    from tag.cli.profiles import merge_profiles, read_profile
    merged, notes = merge_profiles([(path, read_profile(path)) for path in args.merge])
    out = args.out or default_profile_path()
    merged.save(out)
    print(f"wrote {out}: device types {', '.join(sorted(merged.devices))}")
    for note in notes:
        print(f"  note: {note}")
    return 0


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    from tag.files import check_writable
    if (args.model is None) == (args.merge is None):
        raise TagError("give --model (profile a step) or --merge P.json ... (combine profiles), not both")
    if args.out is not None:
        check_writable(args.out, what="profile", create_parents=True)
    if args.merge is not None:
        return _merge(args)
    if args.batch is not None and args.batch < 1:
        raise TagError(f"--batch-size must be positive, got {args.batch}")
    if args.steps < 1:
        raise TagError(f"--steps must be positive, got {args.steps}")
    if args.sustained is not None and not 0 < args.sustained <= 600:
        raise TagError(f"--sustained must be between 0 and 600 seconds, got {args.sustained:g}")
    if args.like is not None and args.matmul_table:
        raise TagError("--matmul-table times this device's own MatMuls; with --like the base profile's table is used")
    base = None
    if args.like is not None:
        from tag.cli.profiles import read_profile
        base = read_profile(args.like)
    from tag.calibration import profile_graph, profile_network
    from tag.cli.model_size import check_model_spec
    from tag.frontend import zoo
    from tag.frontend.analyze import analyze
    items = []
    for spec in args.model:
        check_model_spec(spec, args.batch)
        name, gd = zoo.resolve_model(spec, args.batch)
        if not str(spec).strip().startswith("zoo:"):
            from tag.cli.graph_check import check_importable
            check_importable(gd, spec)
        items.append((gd, analyze(gd, batch_size=args.batch), spec))
    gd, graph, spec = items[0]
    if base is not None:     # the first model's sustained step, against the one recorded in the base profile
        from tag.calibration import profile_like
        prof = profile_like(base, gd, graph, device_type=args.device_type, sustain_s=args.sustained or 4.0,
                            model=spec)
    else:
        prof = profile_graph(gd, graph, steps=args.steps, device_type=args.device_type, model=spec,
                             sustain_s=args.sustained or 0.0, more=items[1:], matmul_table=args.matmul_table)
    if args.network:
        prof.network = profile_network()
        prof.source += "; network: two local one-thread TF workers over gRPC"
    out = args.out or default_profile_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    prof.save(out)              # atomic: temporary file + rename
    print(f"wrote {out}")
    print("\n".join(_summary(prof, args.device_type)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tag-profile``: exit 0, or 2 with one line on bad input."""
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
