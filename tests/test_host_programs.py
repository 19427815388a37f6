"""One program per host: tag.backend.rewrite.programs (the cut) and the runtime that runs them
(tag.backend.runtime.host_run / host_process / host_threads, tag-worker --plan).

Fast tests check the cut: every node of a host's program is on that host, every tensor another host sends has a
matching receive, batch inputs are cut per host only when hosts read apart examples, and programs survive
their files. Slow tests run real servers: hosts given different plans, a program that does not import, a host
program killed mid-run, and tag-worker --plan on three loopback hosts (with the bad inputs of that command).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tag  # noqa: E402
import tag.api  # noqa: E402
from bounded import stop  # noqa: E402
from tag.backend.rewrite.programs import HostProgram, task_of  # noqa: E402
from tag.backend.runtime import LocalCluster, free_ports  # noqa: E402
from tag.backend.runtime.guard import RunControl  # noqa: E402
from tag.backend.runtime.host_process import root_cause, run_in_processes  # noqa: E402
from tag.backend.runtime.host_run import RunSpec, run_host  # noqa: E402
from tag.errors import RunError, TagError  # noqa: E402
from test_runtime import topo_text  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = dict(input_dim=16, hidden=(16,), num_classes=4)


def _topology(ports=None):
    return tag.parse_topology(topo_text(ports or free_ports(3)))


def _mlp(batch=12):
    return tag.zoo.training_graph("mlp", batch_size=batch, **MLP)


def _collective_keys(program: HostProgram) -> list[tuple[str, int, int]]:
    """(op, group key, instance key) of every exchange broadcast of PROGRAM."""
    nodes = {n.name: n for n in program.graph_def.node}
    out = []
    for n in program.graph_def.node:
        if n.op in ("CollectiveBcastSendV2", "CollectiveBcastRecvV2"):
            first = 1 if n.op == "CollectiveBcastSendV2" else 0
            keys = [int(tf_value(nodes[i.split(":")[0]])) for i in n.input[first + 1:first + 3]]
            out.append((n.op, keys[0], keys[1]))
    return out


def tf_value(node):
    import tensorflow as tf
    return tf.make_ndarray(node.attr["value"].tensor)


# ------------------------------------------------------------------------------------------------ the cut
@pytest.mark.parametrize("strategy", ["dp_allreduce", "ps", "partition"])
def test_each_program_holds_its_own_hosts_nodes_and_every_send_has_its_receive(strategy):
    rr = tag.rewrite(_mlp(), _topology(), strategy)
    programs = rr.programs()
    assert sorted(programs) == ["h0", "h1", "h2"]
    sends, recvs = [], []
    for name, p in programs.items():
        assert {task_of(n.device) for n in p.graph_def.node} == {p.task}, name
        assert {p.step_op, p.init_op} <= {n.name for n in p.graph_def.node}
        for op, group, instance in _collective_keys(p):
            (sends if op.endswith("SendV2") else recvs).append((group, instance))
    assert sorted(sends) == sorted(recvs) and len(set(sends)) == len(sends)
    assert sum(p.loss is not None for p in programs.values()) == 1          # one host holds the global loss
    primaries = {tuple(sorted(p.primary)) for p in programs.values()}
    assert len(primaries) == 1 and set(next(iter(primaries))) >= {v for v in rr.variables}


def test_hosts_that_read_apart_examples_get_their_own_inputs_and_others_keep_the_batch_whole():
    dp = tag.rewrite(_mlp(), _topology(), "dp_allreduce").programs()
    ranges = sorted((i.lo, i.hi) for p in dp.values() for i in p.inputs if i.source == "input")
    assert ranges[0][0] == 0 and ranges[-1][1] == 12 and all(a[1] == b[0] for a, b in pairwise(ranges))
    assert all(n.op != "Placeholder" or n.name.startswith("tag/slice/") for p in dp.values()
               for n in p.graph_def.node)                                     # no host holds the whole batch
    part = tag.rewrite(_mlp(), _topology(), "partition").programs()
    readers = {name: [(i.source, i.lo, i.hi) for i in p.inputs] for name, p in part.items() if p.inputs}
    assert len(readers) == 1 and sorted(next(iter(readers.values()))) == [("input", 0, 12), ("labels", 0, 12)]


def test_a_program_survives_its_files(tmp_path):
    p = tag.rewrite(_mlp(), _topology(), "ps").program("h1")
    back = HostProgram.from_files(*p.to_files(str(tmp_path)))
    assert back.graph_def.SerializeToString(deterministic=True) == p.graph_def.SerializeToString(deterministic=True)
    assert (back.host, back.task, back.step_op, back.init_op, back.loss, back.inputs, back.variables, back.primary) == \
        (p.host, p.task, p.step_op, p.init_op, p.loss, p.inputs, p.variables, p.primary)


def test_the_root_cause_of_a_failed_run_is_the_error_that_is_not_an_echo():
    errors = [("h0", "RunError", "step 3 on h0 failed: Collective ops is aborted by: peer gone"),
              ("h2", "RunError", "step 3 on h2 failed: ResourceExhaustedError: OOM when allocating"),
              ("h1", "RunError", "host h2 failed (during step 3 on h1)")]
    assert root_cause(errors)[1].startswith("step 3 on h2 failed: ResourceExhausted")
    assert root_cause(errors + [("h1", "TagError", "hosts run different plans: h1")])[0] == "TagError"


# ------------------------------------------------------------------------------------------------ real servers
@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(_topology(), threads_per_worker=1) as c:
        yield c


def _targets(topology):
    return {h.name: f"grpc://{h.address}:{h.port}" for h in topology.hosts}


@pytest.mark.slow
def test_hosts_given_different_plans_stop_with_one_line_naming_them(cluster):
    topo = cluster.topology
    programs = tag.rewrite(_mlp(), topo, "dp_allreduce").programs()
    base = RunSpec.new(programs, fingerprint="plan-a", steps=2, join_timeout_s=60)
    errors: dict[str, BaseException] = {}

    def go(name: str, fingerprint: str) -> None:
        spec = RunSpec(**{**vars(base), "fingerprint": fingerprint})
        try:
            run_host(programs[name], _targets(topo)[name], spec,
                     control=RunControl(step_timeout_s=60, setup_timeout_s=60))
        except (TagError, RunError) as err:
            errors[name] = err

    threads = [threading.Thread(target=go, args=(n, "plan-b" if n == "h2" else "plan-a")) for n in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(errors) == {"h0", "h1", "h2"}
    assert all(isinstance(e, TagError) and "hosts run different plans" in str(e) for e in errors.values())
    assert "h2 differ" in str(errors["h0"]) and "h0, h1 differ" in str(errors["h2"])


@pytest.mark.slow
def test_a_program_that_does_not_import_is_one_line_naming_the_host(cluster):
    topo = cluster.topology
    programs = tag.rewrite(_mlp(), topo, "dp_allreduce").programs()
    broken = programs["h1"]
    node = broken.graph_def.node.add(name="tag/broken", op="MatMul", device=broken.cpu)
    node.input.extend(["no_such_tensor", "no_such_tensor"])
    spec = RunSpec.new(programs, fingerprint="f", steps=2, join_timeout_s=60)
    with pytest.raises(TagError, match=r"^host h1: its program does not import: .*no_such_tensor"):
        run_in_processes(programs, {n: cluster.host_launch(n) for n in programs}, spec,
                         control=RunControl(step_timeout_s=60, setup_timeout_s=60, watchdog=cluster.dead_worker))


@pytest.mark.slow
def test_a_killed_host_program_is_named_within_30_s(cluster):
    topo = cluster.topology
    programs = tag.rewrite(_mlp(), topo, "dp_allreduce").programs()
    spec = RunSpec.new(programs, fingerprint="f", steps=100000, join_timeout_s=60)
    stepped = threading.Event()

    def hear(ev) -> None:
        if ev.kind == "step":
            stepped.set()

    launches = {n: cluster.host_launch(n) for n in programs}
    box: dict = {}

    def run() -> None:
        try:
            run_in_processes(programs, launches, spec, control=RunControl(
                progress=hear, step_timeout_s=120, setup_timeout_s=120, watchdog=cluster.dead_worker))
        except RunError as err:
            box["error"], box["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert stepped.wait(120), "no step within 120 s"
    child = [pid for pid in _descendants(os.getpid()) if "host_process" in _cmdline(pid) and "h2.spec" in
             _cmdline(pid)]
    assert child, "no host program process for h2"
    killed = time.monotonic()
    os.kill(child[0], signal.SIGKILL)
    thread.join(60)
    assert "error" in box and box["at"] - killed < 30
    assert re.match(r"host h2's program exited \(rc -9\) without a result", str(box["error"])), str(box["error"])


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):       # children of every thread of P
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------ tag-worker --plan
def _worker(args, **kw):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([sys.executable, "-m", "tag.cli.worker", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, **kw)


def test_worker_plan_bad_input_is_one_line(tmp_path):
    topo = _topology()
    plan = tag.api.plan_for(tag.api.prepare(_mlp(), topo), "dp_allreduce")
    d = plan.save(tmp_path / "plan")
    cases = [(["--plan", d, "--host", "gpu9"], "host 'gpu9' is not in the plan (hosts: h0, h1, h2)"),
             (["--plan", d], "--plan needs --host NAME"),
             (["--plan", str(tmp_path / "nope"), "--host", "h0"], "not a plan directory")]
    meta = json.loads((tmp_path / "plan" / "plan.json").read_text())
    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text(json.dumps({**meta, "version": 1}))
    cases.append((["--plan", str(old), "--host", "h0"], "saved by an earlier tag"))
    for args, message in cases:
        proc = _worker(args)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


@pytest.mark.slow
def test_worker_plan_on_every_host_trains_and_the_chief_checkpoints(tmp_path):
    topo = _topology()
    plan = tag.api.plan_for(tag.api.prepare(_mlp(), topo), "ps")
    d = plan.save(tmp_path / "plan")
    ckpt = tmp_path / "ckpt"
    procs = [_worker(["--plan", d, "--host", h.name, "--steps", "5", "--checkpoint-dir", str(ckpt),
                      "--threads", "1", "--join-timeout", "120"]) for h in topo.hosts]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            stop(p)
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    chief = next(err for _, err in outs if "step 5/5" in err)
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", chief)]
    assert losses and all(np.isfinite(losses))
    from tag.backend.runtime.checkpoint import read_checkpoint_meta, read_weights
    meta = read_checkpoint_meta(ckpt)
    assert meta["step"] == 5 and meta["plan"] == plan.fingerprint
    assert set(read_weights(ckpt)) == set(plan.rewritten.variables)       # original names, one each


@pytest.mark.slow
def test_worker_plan_with_another_plan_on_one_host_says_so_on_every_host(tmp_path):
    topo = _topology()
    an = tag.api.prepare(_mlp(), topo)
    a = tag.api.plan_for(an, "dp_allreduce").save(tmp_path / "a")
    b = tag.api.plan_for(an, "ps").save(tmp_path / "b")
    procs = [_worker(["--plan", b if h.name == "h1" else a, "--host", h.name, "--steps", "3",
                      "--join-timeout", "120"]) for h in topo.hosts]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (_, err) in zip(procs, outs, strict=True):
        last = [ln for ln in err.splitlines() if ln.strip()][-1]
        assert p.returncode == 2 and "hosts run different plans" in last, err[-1500:]
