#!/usr/bin/env python
"""Fuzz tag's command-line input handling with malformed topology files and GraphDefs.

Generates several hundred broken inputs -- truncated files, wrong field types, missing fields, absurd
numbers, huge (sparse) files, empty files, binary garbage, a topology given as a model and a GraphDef
given as a topology, a forward-only graph, cycles, unknown ops, a named pipe, a device, a directory --
and runs ``tag-topo validate`` or ``tag-deploy --strategy dp_allreduce`` (no search) of this checkout on
each. Every case must end with exit code 2, exactly one line on stderr, no traceback, no hang and no
output file (each deploy case gets ``--report`` in an empty directory that must stay empty).

To stay fast on two cores, the cases run in this process through each CLI's ``main(argv)`` with
stdout/stderr captured and a per-case time limit (``SIGALRM``); a sample of cases (``--subprocess N``)
also runs as ``python -m tag.cli.topo`` / ``python -m tag.cli.deploy`` subprocesses with a wall-clock
limit, which catches hangs in C code that an alarm cannot interrupt.

Usage::

    python scripts/fuzz_inputs.py                      # every case; prints a summary and the failures
    python scripts/fuzz_inputs.py --json fuzz.json     # also {"inputs", "clean_errors", "tracebacks", "hangs"}
    python scripts/fuzz_inputs.py --sample 40 --subprocess 2   # a fixed quick sample (the test uses this)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from tag_bench.records import Run, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for topologies/

LOCALHOST = os.path.join(ROOT, "topologies", "localhost.pbtxt")
CONSUMER = os.path.join(ROOT, "topologies", "consumer-lab-4host.pbtxt")
TINY = "zoo:mlp,input_dim=8,hidden=8,num_classes=2"
CASE_TIMEOUT_S = 60
SUBPROCESS_TIMEOUT_S = 180


@dataclass
class Case:
    """One malformed input: NAME, the file's bytes (None: PATH is used as it is), and how it is used:
    "topo" (tag-topo validate), "deploy-topo" (as --topo) or "deploy-model" (as --model)."""

    name: str
    data: bytes | None
    use: str
    path: str | None = None
    suffix: str = ".pbtxt"
    sparse_size: int = 0          # > 0: a sparse file of this size instead of DATA


@dataclass
class Outcome:
    case: str
    rc: int | None
    stderr: str
    clean: bool
    traceback: bool
    hang: bool
    leftovers: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ generators
def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return "".join(line for line in f if not line.lstrip().startswith("#"))


def topology_cases() -> list[Case]:
    """Broken cluster files: each is used with tag-topo validate and as tag-deploy --topo."""
    good = {"localhost": _text(LOCALHOST), "consumer": _text(CONSUMER)}
    raw: list[tuple[str, str]] = [("empty", ""), ("blank", "  \n\t\n"), ("comment-only", "# nothing\n")]
    for key, text in good.items():
        for frac in (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97):
            raw.append((f"{key}-truncated-{frac}", text[:int(len(text) * frac)]))
    loc = good["localhost"]
    swaps = {
        "port-string": ('port: 0', 'port: "23451"'), "port-huge": ('port: 0', 'port: 99999999'),
        "port-negative": ('port: 0', 'port: -1'), "port-zero-remote": ('address: "127.0.0.1"', 'address: "10.0.0.1"'),
        "port-float": ('port: 0', 'port: 2.5'), "name-number": ('name: "cpu0"', 'name: 7'),
        "name-empty": ('name: "cpu0"', 'name: ""'), "name-dup": ('name: "cpu1"', 'name: "cpu0"'),
        "address-empty": ('address: "127.0.0.1"', 'address: ""'),
        "memory-negative": ("memory_gib: 2", "memory_gib: -2"), "memory-zero": ("memory_gib: 2", "memory_gib: 0"),
        "memory-nan": ("memory_gib: 2", "memory_gib: nan"), "memory-inf": ("memory_gib: 2", "memory_gib: inf"),
        "memory-string": ("memory_gib: 2", 'memory_gib: "two"'), "memory-1e308": ("memory_gib: 2", "memory_gib: 1e308"),
        "tflops-zero": ("peak_tflops: 0.05", "peak_tflops: 0"),
        "tflops-negative": ("peak_tflops: 0.05", "peak_tflops: -1"),
        "bandwidth-zero": ("memory_bandwidth_gbs: 10", "memory_bandwidth_gbs: 0"),
        "count-zero": ("count: 1", "count: 0"), "count-negative": ("count: 1", "count: -3"),
        "count-absurd": ("count: 1", "count: 2000000000"), "kind-unknown": ("kind: CPU", "kind: QPU"),
        "kind-number": ("kind: CPU", "kind: 42"), "type-empty": ('type: "CPU"', 'type: ""'),
        "fabric-zero": ("bandwidth_gbps: 10", "bandwidth_gbps: 0"),
        "fabric-negative": ("latency_us: 50", "latency_us: -5"),
        "unknown-field": ('name: "localhost"', 'name: "localhost"\nfrobnicate: 3'),
        "unknown-block": ('name: "localhost"', 'name: "localhost"\nwormhole { a: "x" }'),
        "unbalanced-open": ("fabric {", "fabric { {"), "unbalanced-close": ("latency_us: 50 }", "latency_us: 50 } }"),
        "binary-junk": ('name: "localhost"', 'name: "localhost"\n\x00\x01\x02\xff'),
        "link-unknown-host": ("fabric {", 'link { a: "cpu0" b: "cpu9" bandwidth_gbps: 1 latency_us: 1 }\nfabric {'),
        "link-self": ("fabric {", 'link { a: "cpu0" b: "cpu0" bandwidth_gbps: 1 latency_us: 1 }\nfabric {'),
        "link-zero-bw": ("fabric {", 'link { a: "cpu0" b: "cpu1" bandwidth_gbps: 0 latency_us: 1 }\nfabric {'),
    }
    for name, (old, new) in swaps.items():
        assert old in loc, name
        raw.append((name, loc.replace(old, new, 1)))
    raw += [("no-hosts", 'name: "x"\nfabric { bandwidth_gbps: 10 latency_us: 5 }\n'),
            ("host-no-device", 'name: "x"\nhost { name: "a" address: "127.0.0.1" port: 1 }\n'),
            ("no-fabric-multi-host", loc.split("fabric")[0]),
            ("deep-nesting", "host { " * 2000), ("very-long-line", "name: \"" + "x" * 100000)]
    cases = [Case(f"topo/{name}", text.encode("utf-8"), "topo") for name, text in raw]
    cases.append(Case("topo/utf16-text", loc.encode("utf-16"), "topo"))
    rng = random.Random(1)
    for i in range(8):
        cases.append(Case(f"topo/random-bytes-{i}", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4000))),
                          "topo"))
    cases.append(Case("topo/huge-sparse", None, "topo", sparse_size=64 << 20))
    return cases


def _tiny_graph():
    from tag import zoo
    return zoo.training_graph("mlp", 8, input_dim=8, hidden=(8,), num_classes=2)


def _forward_only():
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 2])
        tf.reduce_mean(tf.matmul(x, w), name="loss")
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables(), name="init")
    return g.as_graph_def()


def _edited(gd, edit: Callable) -> bytes:
    import tensorflow as tf
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(gd)
    edit(out)
    return out.SerializeToString()


def _graph_edits() -> dict[str, Callable]:
    def node(gd, op):
        return next(n for n in gd.node if n.op == op)

    def cycle(gd):           # two ops waiting for each other (control inputs: no signature involved)
        a, b = node(gd, "MatMul"), node(gd, "Relu")
        a.input.append("^" + b.name)
        b.input.append("^" + a.name)

    def no_updates(gd):      # every optimizer update replaced by a NoOp (control inputs only): nothing trains
        for n in gd.node:
            if "Apply" in n.op:
                controls = ["^" + i.lstrip("^").split(":")[0] for i in n.input]
                n.op = "NoOp"
                del n.input[:]
                n.input.extend(controls)
                n.attr.clear()

    def set_shape(dims):
        def edit(gd):
            ph = node(gd, "Placeholder")
            del ph.attr["shape"].shape.dim[:]
            for d in dims:
                ph.attr["shape"].shape.dim.add().size = d
        return edit

    return {
        "unknown-op": lambda gd: setattr(node(gd, "MatMul"), "op", "FrobnicateOp"),
        "all-unknown-ops": lambda gd: [setattr(n, "op", "Zork") for n in gd.node],
        "cycle": cycle,
        "self-loop": lambda gd: node(gd, "MatMul").input.append("^" + node(gd, "MatMul").name),
        "dangling-input": lambda gd: gd.node[-1].input.append("no_such_node"),
        "duplicate-name": lambda gd: setattr(gd.node[1], "name", gd.node[0].name),
        "empty-op": lambda gd: setattr(gd.node[3], "op", ""),
        "empty-name": lambda gd: setattr(gd.node[3], "name", ""),
        "no-versions": lambda gd: gd.ClearField("versions"),
        "no-nodes": lambda gd: gd.ClearField("node"),
        "shape-huge": set_shape([10 ** 12, 10 ** 12]),
        "shape-negative": set_shape([-5, 8]),
        "shape-zero": set_shape([0, 8]),
        "shape-absurd-rank": set_shape([2] * 200),
        "dtype-invalid": lambda gd: setattr(node(gd, "Placeholder").attr["dtype"], "type", 999),
        "dtype-string": lambda gd: setattr(node(gd, "Placeholder").attr["dtype"], "type", 7),
        "attr-wrong-kind": lambda gd: node(gd, "MatMul").attr["transpose_a"].CopyFrom(
            type(node(gd, "MatMul").attr["transpose_a"])(s=b"yes")),
        "attr-missing": lambda gd: node(gd, "MatMul").attr.pop("T"),
        "input-port-absurd": lambda gd: node(gd, "MatMul").input.__setitem__(
            0, node(gd, "MatMul").input[0].split(":")[0] + ":99"),
        "device-garbage": lambda gd: [setattr(n, "device", "/job:x/task:zz/device:QPU:9") for n in gd.node],
        "no-optimizer-updates": no_updates,
        "control-input-cycle": lambda gd: node(gd, "Placeholder").input.append(
            "^" + next(n.name for n in gd.node if n.op == "NoOp" and n.name.endswith("train_op"))),
    }


def graph_cases() -> list[Case]:
    """Broken GraphDefs (and things that are not GraphDefs) given to tag-deploy --model."""
    from google.protobuf import text_format
    gd = _tiny_graph()
    binary = gd.SerializeToString()
    text = text_format.MessageToString(gd).encode()
    cases = [Case("graph/empty", b"", "deploy-model", suffix=".pb"), Case("graph/blank", b"\n \n", "deploy-model"),
             Case("graph/forward-only", _forward_only().SerializeToString(), "deploy-model", suffix=".pb"),
             Case("graph/topology-as-model", _text(LOCALHOST).encode(), "deploy-model"),
             Case("graph/json", b'{"node": []}', "deploy-model", suffix=".json"),
             Case("graph/huge-sparse", None, "deploy-model", suffix=".pb", sparse_size=3 << 30)]
    for frac in (0.01, 0.03, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99):
        cases.append(Case(f"graph/truncated-binary-{frac}", binary[:int(len(binary) * frac)], "deploy-model",
                          suffix=".pb"))
        cases.append(Case(f"graph/truncated-text-{frac}", text[:int(len(text) * frac)], "deploy-model",
                          suffix=".pbtxt"))
    for name, edit in _graph_edits().items():
        cases.append(Case(f"graph/{name}", _edited(gd, edit), "deploy-model", suffix=".pb"))
    for old, new, name in [(b"op: \"MatMul\"", b"op: 17", "text-op-number"),
                           (b"name: \"", b"name: 5 #", "text-name-number"),
                           (b"node {", b"nodes {", "text-unknown-field"),
                           (b"type: DT_FLOAT", b"type: DT_QUATERNION", "text-bad-enum")]:
        cases.append(Case(f"graph/{name}", text.replace(old, new, 1), "deploy-model", suffix=".pbtxt"))
    rng = random.Random(2)
    for i in range(12):
        flipped = bytearray(binary)
        for _ in range(rng.randrange(1, 40)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        cases.append(Case(f"graph/bit-flips-{i}", bytes(flipped), "deploy-model", suffix=".pb"))
    for i in range(8):
        cases.append(Case(f"graph/random-bytes-{i}", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000))),
                          "deploy-model", suffix=".pb"))
    return cases


def special_cases(tmp: str) -> list[Case]:
    """A named pipe, a device and a directory, as topology and as model."""
    fifo = os.path.join(tmp, "pipe")
    os.mkfifo(fifo)
    out = []
    for path, what in ((fifo, "fifo"), ("/dev/zero", "dev-zero"), (tmp, "directory"),
                       (os.path.join(tmp, "missing.pbtxt"), "missing")):
        out += [Case(f"special/{what}-topo", None, "topo", path=path),
                Case(f"special/{what}-as-topo", None, "deploy-topo", path=path),
                Case(f"special/{what}-as-model", None, "deploy-model", path=path)]
    return out


def all_cases(tmp: str) -> list[Case]:
    topo = topology_cases()
    both = topo + [Case(c.name.replace("topo/", "deploy-topo/"), c.data, "deploy-topo", c.path, c.suffix,
                        c.sparse_size) for c in topo]
    gd = _tiny_graph().SerializeToString()
    both.append(Case("deploy-topo/graphdef-as-topology", gd, "deploy-topo", suffix=".pbtxt"))
    both.append(Case("topo/graphdef-as-topology", gd, "topo", suffix=".pbtxt"))
    return both + graph_cases() + special_cases(tmp)


# ------------------------------------------------------------------------------------------------ running
class _Hang(BaseException):
    """Raised by SIGALRM inside a case that ran too long (BaseException: the CLIs do not catch it)."""


def _materialise(case: Case, directory: str, index: int) -> str:
    if case.path is not None:
        return case.path
    path = os.path.join(directory, f"case{index}{case.suffix}")
    with open(path, "wb") as f:
        if case.sparse_size:
            f.truncate(case.sparse_size)
        else:
            f.write(case.data or b"")
    return path


def _argv(case: Case, path: str, out_dir: str) -> tuple[str, list[str]]:
    report = os.path.join(out_dir, "report.json")
    if case.use == "topo":
        return "topo", ["validate", path]
    if case.use == "deploy-topo":
        return "deploy", ["--topo", path, "--model", TINY, "--strategy", "dp_allreduce", "--report", report]
    return "deploy", ["--topo", LOCALHOST, "--model", path, "--strategy", "dp_allreduce", "--report", report]


def _judge(name: str, rc: int | None, out: str, err: str, out_dir: str, hang: bool) -> Outcome:
    leftovers = sorted(os.listdir(out_dir))
    tb = "Traceback" in err or "internal error" in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    clean = (not hang and rc == 2 and len(lines) == 1 and err.endswith("\n") and not tb and not leftovers
             and not out.strip())
    return Outcome(name, rc, err.strip()[-500:], clean, tb, hang, leftovers)


def run_in_process(case: Case, index: int, work: str) -> Outcome:
    from tag.cli import deploy, topo
    case_dir = tempfile.mkdtemp(dir=work)
    out_dir = tempfile.mkdtemp(dir=work)
    path = _materialise(case, case_dir, index)
    which, argv = _argv(case, path, out_dir)
    main = topo.main if which == "topo" else deploy.main
    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):  # noqa: ARG001
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    hang, rc = False, None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except _Hang:
        hang = True
    except BaseException as e:  # noqa: BLE001 - an escape from main() is a traceback
        err.write(f"Traceback (escaped main): {type(e).__name__}: {e}\n")
        rc = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return _judge(case.name, rc, out.getvalue(), err.getvalue(), out_dir, hang)


def run_subprocess(case: Case, index: int, work: str) -> Outcome:
    case_dir = tempfile.mkdtemp(dir=work)
    out_dir = tempfile.mkdtemp(dir=work)
    path = _materialise(case, case_dir, index)
    which, argv = _argv(case, path, out_dir)
    module = "tag.cli.topo" if which == "topo" else "tag.cli.deploy"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TAG_PROFILE")}
    try:
        proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S, env=env, cwd=work)
        return _judge(f"{case.name} (subprocess)", proc.returncode, proc.stdout, proc.stderr, out_dir, False)
    except subprocess.TimeoutExpired:
        return _judge(f"{case.name} (subprocess)", None, "", "", out_dir, True)


SUBPROCESS_FIRST = ("special/fifo-as-model", "special/fifo-as-topo", "special/dev-zero-as-model",
                    "graph/huge-sparse", "graph/truncated-binary-0.5", "topo/deep-nesting")


def pick_sample(cases: list[Case], n: int) -> list[Case]:
    """A fixed spread of N cases (every kind represented; the special files first)."""
    if n >= len(cases):
        return cases
    special = [c for c in cases if c.name.startswith("special/")]
    rest = [c for c in cases if not c.name.startswith("special/")]
    step = max(1, len(rest) // max(1, n - len(special)))
    return (special + rest[::step])[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help='write {"inputs", "clean_errors", "tracebacks", "hangs"} to FILE')
    ap.add_argument("--sample", type=int, default=None, metavar="N", help="run a fixed sample of N cases only")
    ap.add_argument("--subprocess", type=int, default=len(SUBPROCESS_FIRST), metavar="N",
                    help=f"also run N cases as subprocesses (default {len(SUBPROCESS_FIRST)})")
    args = ap.parse_args(argv)
    this_run = Run(__file__, argv)
    from tag.cli.quiet import quiet_tensorflow
    quiet_tensorflow()
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="tag-fuzz-cache-"))
    os.environ.pop("TAG_PROFILE", None)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tag-fuzz-") as work:
        cases = all_cases(work)
        if args.sample is not None:
            cases = pick_sample(cases, args.sample)
        outcomes = [run_in_process(c, i, work) for i, c in enumerate(cases)]
        by_name = {c.name: c for c in cases}
        chosen = [by_name[n] for n in SUBPROCESS_FIRST if n in by_name][:args.subprocess]
        outcomes += [run_subprocess(c, 10_000 + i, work) for i, c in enumerate(chosen)]
    summary = {"inputs": len(outcomes), "clean_errors": sum(o.clean for o in outcomes),
               "tracebacks": sum(o.traceback for o in outcomes), "hangs": sum(o.hang for o in outcomes),
               "subprocess_cases": len(chosen), "seconds": round(time.monotonic() - t0, 1),
               "failures": [{"case": o.case, "rc": o.rc, "stderr": o.stderr, "leftovers": o.leftovers, "hang": o.hang}
                            for o in outcomes if not o.clean]}
    print(f"{summary['inputs']} inputs ({len(chosen)} also as subprocesses): {summary['clean_errors']} clean errors, "
          f"{summary['tracebacks']} tracebacks, {summary['hangs']} hangs, {summary['seconds']} s")
    for f in summary["failures"]:
        print(f"  FAIL {f['case']}: rc={f['rc']} hang={f['hang']} leftovers={f['leftovers']} {f['stderr'][-300:]!r}")
    write_json(args.json, summary, this_run, indent=2)
    return 0 if summary["clean_errors"] == summary["inputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
