"""tag-topo: check and show cluster topology files.

Example::

    $ tag-topo validate topologies/*.pbtxt
    topologies/a100-8x-nvlink.pbtxt: ok (1 hosts, 8 devices)
    ...
    $ tag-topo show topologies/lab-v100-1080ti.pbtxt      # hosts, device groups, links, fabric

``validate`` prints ``PATH: ok (N hosts, M devices)`` per good file on stdout and one line
``PATH:LINE: message`` per bad file on stderr; it exits 0 when every file is valid, 2 otherwise.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

from tag.cli.common import EXIT_BAD_INPUT, EXIT_OK, ArgumentParser, add_verbose, one_line, run_cli
from tag.cluster.topology import GBITS_PER_S, GBYTES_PER_S, GIB, MICROSECOND, TFLOPS, Topology, load_topology
from tag.cost.model import device_profiles
from tag.errors import TopologyError

PROG = "tag-topo"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tag-topo``; returns the exit code."""
    return run_cli(PROG, _body, argv)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Check and show tag cluster topology files (.pbtxt).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    validate = sub.add_parser("validate", help="check topology files; exit 2 if any is invalid")
    validate.add_argument("files", nargs="+", metavar="FILE")
    show = sub.add_parser("show", help="print a topology's hosts, device groups, links and fabric")
    show.add_argument("file", metavar="FILE")
    for p in (parser, validate, show):
        add_verbose(p, sub=p is not parser)
    return parser


def _body(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return validate(args.files)
    _out(format_topology(load_topology(args.file)))
    return EXIT_OK


def _out(text: str) -> None:
    """Print to stdout; a reader that went away (``| head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def validate(paths: Sequence[str]) -> int:
    """Load each file; print ok lines to stdout and one error line per bad file to stderr."""
    status = EXIT_OK
    for path in paths:
        try:
            topo = load_topology(path)
        except TopologyError as err:
            print(one_line(err), file=sys.stderr)
            status = EXIT_BAD_INPUT
            continue
        _out(f"{path}: ok ({len(topo.hosts)} hosts, {topo.num_devices} devices)")
    return status


def _num(value: float) -> str:
    """A number for a table: up to 4 significant digits, no exponent for everyday sizes."""
    if math.isinf(value):
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    def line(cells):
        return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(headers)] + [line(r) for r in rows]


def format_topology(topo: Topology) -> str:
    """A plain-text description of TOPO: hosts, device groups, links and fabric, in file units."""
    out = [f"cluster {topo.name} ({topo.path}): {len(topo.hosts)} hosts, {len(topo.groups)} device groups, "
           f"{topo.num_devices} devices"]
    if topo.comment:   # the comment's first paragraph: what the file models
        first = topo.comment.split("\n\n")[0]
        out.append("  " + " ".join(first.split()))
    kinds = topo.extra.get("interconnect", {})
    host_devices = {h.name: 0 for h in topo.hosts}
    for d in topo.devices:
        host_devices[d.host] += 1
    rows = []
    for h in topo.hosts:
        if math.isinf(h.intra_bandwidth):
            inter = "- (one device)"
        else:
            inter = (f"{kinds.get(h.name, 'INTERCONNECT_UNSPECIFIED').replace('INTERCONNECT_UNSPECIFIED', 'unstated')} "
                     f"{_num(h.intra_bandwidth / GBYTES_PER_S)} GB/s, {_num(h.intra_latency / MICROSECOND)} us")
        port = str(h.port) if h.port else "0 (free port at start)"
        rows.append([str(h.task_index), h.name, f"{h.address}:{port}", str(host_devices[h.name]), inter])
    out += ["", "hosts"] + _table(["task", "name", "address:port", "devices", "interconnect"], rows)
    rows = []
    for g in topo.groups:
        first = topo.devices[g.devices[0]]
        last_index = first.tf_local_index + len(g.devices) - 1
        span = (f"{topo.tf_device(first.index)} .. {first.tf_device_type}:{last_index}" if len(g.devices) > 1
                else topo.tf_device(first.index))
        rows.append([str(g.index), g.name, g.tf_device_type, str(len(g.devices)),
                     f"{_num(g.memory_bytes / GIB)} GiB", _num(g.peak_flops / TFLOPS),
                     f"{_num(g.memory_bandwidth / GBYTES_PER_S)} GB/s", span])
    out += ["", "device groups"] + _table(
        ["#", "group", "kind", "count", "memory", "TFLOP/s", "mem BW", "TF devices"], rows)
    out += ["", "cost profiles (without a profile file)"] + _table(
        ["device type", "served by"], [[t, s] for t, s in device_profiles(topo).items()])
    links = topo.extra.get("links", [])
    if links:
        rows = [[link["a"], link["b"], f"{_num(link['bandwidth'] / GBITS_PER_S)} Gbit/s",
                 f"{_num(link['latency'] / MICROSECOND)} us"] for link in links]
        out += ["", "links"] + _table(["a", "b", "bandwidth", "latency"], rows)
    fabric = topo.extra.get("fabric")
    out.append("")
    if fabric:
        out.append(f"fabric: {_num(fabric['bandwidth'] / GBITS_PER_S)} Gbit/s, "
                   f"{_num(fabric['latency'] / MICROSECOND)} us (every host pair without a link)")
    else:
        out.append("fabric: none" + (" (single host)" if len(topo.hosts) == 1 else " (every host pair has a link)"))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
