"""tag_bench.testbed: network namespaces, shaped links and TF servers inside them (needs root + iproute2)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from bounded import bounded
from tag.cluster.topology import parse_topology
from tag_bench.testbed import GSO_MAX_BYTES, Testbed, TestbedError, cleanup_stale, testbed_available, testbed_missing
from tag_bench.testbed_hosts import pack_quotas

CPU = 'device { type: "CPU" kind: CPU memory_gib: 2 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }'
AVAILABLE, WHY = testbed_available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=f"testbed unavailable: {WHY}")


def topo(n=2, fabric_gbps=0.2, latency_us=0, links=""):
    hosts = "\n".join(f'host {{ name: "h{i}" address: "127.0.0.1" port: {24100 + i} {CPU} }}' for i in range(n))
    return parse_topology(f'name: "tb"\n{hosts}\nfabric {{ bandwidth_gbps: {fabric_gbps} latency_us: {latency_us} }}\n'
                          f"{links}")


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def link_names() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=60).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def test_bad_cpu_shares_are_input_errors():
    with pytest.raises(TestbedError, match="unknown hosts"):
        Testbed(topo(), cpu_shares={"nope": 512})
    with pytest.raises(TestbedError, match="2 entries for 3 hosts"):
        Testbed(topo(3), cpu_shares=[512, 1024])
    with pytest.raises(TestbedError, match=r"\[2, 262144\]"):
        Testbed(topo(), cpu_shares=[1, 1024])


@needs_netns
def test_namespaces_exist_during_and_are_gone_after():
    with Testbed(topo(3)) as tb:
        names = {tb.namespace(i) for i in range(3)}
        assert names <= netns_names()
        assert tb.bridge in link_names()
        addrs = [h.address for h in tb.topology.hosts]
        assert len(set(addrs)) == 3 and all(a.startswith(("198.18.", "198.19.")) for a in addrs)
        assert [h.port for h in tb.topology.hosts] == [24100, 24101, 24102]
        # the host's interface carries its address; the link to h1 is shaped to the declared 200 Mbit/s
        assert addrs[0] in tb.exec("h0", ["ip", "-4", "addr", "show", "dev", "eth0"]).stdout
        classes = tb.exec("h0", ["tc", "class", "show", "dev", "eth0"]).stdout
        assert classes.count("ceil 200Mbit") == 3     # the NIC (200 Mbit/s) and one class per destination
    assert not names & netns_names()
    assert tb.bridge not in link_names() and not any(n.startswith(tb.bridge[:-2]) for n in link_names())


@needs_netns
def test_teardown_after_an_error_inside_the_block():
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(topo(2), cpu_shares={"h0": 256}) as tb:
            ns, cg = tb.namespace(0), tb._cgroup()
            assert ns in netns_names() and os.path.isdir(cg)
            with open(os.path.join(tb._cgroup(0), "cpu.shares")) as f:
                assert f.read().strip() == "256"
            raise RuntimeError("boom")
    assert ns not in netns_names() and not os.path.exists(cg)


def _testbed_child(how: str) -> subprocess.Popen:
    """A process that sets up a two-host testbed with CPU quotas (and with HOW == "processes", a process in
    each namespace and cgroup, as a TF server runs), prints the names of what it made as one JSON line, and
    sleeps."""
    code = ("import json, os, signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores SIGINT\n"
            "from tag.cluster.topology import parse_topology\n"
            "from tag_bench.testbed import Testbed\n"
            f"with Testbed(parse_topology({topo_text_for_child()!r}), cpu_quota=[1.0, 0.5]) as tb:\n"
            "    import subprocess\n"
            f"    inside = [subprocess.Popen(tb.launch_prefix(i) + ['sleep', '600'])\n"
            f"              for i in range(2 if {how == 'processes'!r} else 0)]\n"
            "    def entered(i, p):  # the process runs inside host i's namespace (not still on its way in)\n"
            "        out = subprocess.run(['ip', 'netns', 'pids', tb.namespace(i)], capture_output=True, text=True,\n"
            "                             timeout=30)\n"
            "        return str(p.pid) in out.stdout.split()\n"
            "    for _ in range(600):\n"
            "        if all(entered(i, p) for i, p in enumerate(inside)):\n"
            "            break\n"
            "        time.sleep(0.05)\n"
            "    names = {'netns': [tb.namespace(i) for i in range(2)],\n"
            "             'links': [tb.bridge, tb._veth(0), tb._veth(1)],\n"
            "             'cgroup': tb._cgroup(), 'pids': [p.pid for p in inside]}\n"
            "    print(json.dumps(names), flush=True)\n"
            "    time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _left_behind(names: dict) -> list[str]:
    left = [n for n in names["netns"] if n in netns_names()] + [n for n in names["links"] if n in link_names()]
    left += [names["cgroup"]] if os.path.isdir(names["cgroup"]) else []
    return left + [f"pid {p}" for p in names["pids"] if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@needs_netns
@pytest.mark.slow
@pytest.mark.parametrize("signum, how, code",
                         [(signal.SIGTERM, "processes", 143), (signal.SIGINT, "bare", -signal.SIGINT)])
def test_a_stopped_process_takes_its_testbed_down(signum, how, code):
    """SIGTERM (a time limit, kill) or SIGINT (Ctrl-C) to a process with a testbed up: namespaces, bridge,
    veths, cgroups and the processes in the namespaces are gone, and the process ends as the signal
    says (SIGTERM: exit status 143; SIGINT: an uncaught KeyboardInterrupt, which Python ends by SIGINT)."""
    import json

    from bounded import LineReader, stop
    proc = _testbed_child(how)
    try:
        line = LineReader(proc.stdout).next(timeout_s=180)
        assert line is not None, "the child died before its testbed was up"
        names = json.loads(line)
        assert set(names["netns"]) <= netns_names() and os.path.isdir(names["cgroup"])
        assert len(names["pids"]) == (2 if how == "processes" else 0)
        proc.send_signal(signum)        # as `timeout` does: the process, then its whole process group
        os.killpg(proc.pid, signum)     # (a terminal's Ctrl-C, too, signals the whole foreground group)
        assert proc.wait(timeout=60) == code
    finally:
        stop(proc)
    assert _left_behind(names) == []


@needs_netns
@pytest.mark.slow
def test_a_new_testbed_clears_what_a_killed_run_left():
    """A process killed with SIGKILL cannot clean up; the next Testbed start (cleanup_stale) removes its
    namespaces, bridge, veths and cgroups."""
    import json

    from bounded import LineReader, stop
    proc = _testbed_child("bare")
    try:
        line = LineReader(proc.stdout).next(timeout_s=180)
        assert line is not None, "the child died before its testbed was up"
        names = json.loads(line)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    finally:
        stop(proc)
    assert sorted(_left_behind(names)) == sorted(names["netns"] + names["links"] + [names["cgroup"]])
    with Testbed(topo(2)):
        assert _left_behind(names) == []


@needs_netns
@pytest.mark.slow
def test_cleanup_stale_removes_what_a_killed_run_left():
    code = ("import os, sys\n"
            "from tag.cluster.topology import parse_topology\n"
            "from tag_bench.testbed import Testbed\n"
            f"tb = Testbed(parse_topology({topo_text_for_child()!r})).setup()\n"
            "print(tb.namespace(0), tb.bridge, flush=True)\n"
            "os._exit(0)  # dies without tearing down\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    ns, bridge = out.stdout.split()
    assert ns in netns_names() and bridge in link_names()
    removed = cleanup_stale()
    assert f"netns {ns}" in removed and ns not in netns_names() and bridge not in link_names()


def topo_text_for_child() -> str:
    return (f'host {{ name: "a" address: "127.0.0.1" port: 24200 {CPU} }}\n'
            f'host {{ name: "b" address: "127.0.0.1" port: 24201 {CPU} }}\n'
            "fabric { bandwidth_gbps: 1 }\n")


@needs_netns
@pytest.mark.slow
def test_shaped_bandwidth_matches_the_declared_pairs():
    """200 Mbit/s fabric, one 100 Mbit/s link: each pair measures within 15% of what it declares."""
    t = topo(3, fabric_gbps=0.2, links='link { a: "h0" b: "h2" bandwidth_gbps: 0.1 }')
    measured = {}
    with Testbed(t) as tb:
        for a, b, declared in [("h0", "h1", 200e6), ("h1", "h0", 200e6), ("h0", "h2", 100e6),
                               ("h2", "h0", 100e6)]:
            got = tb.measure_bandwidth(a, b, seconds=1.0) * 8
            measured[(a, b)] = got
            assert abs(got - declared) / declared < 0.15, (a, b, got)
        rtt = tb.measure_rtt("h0", "h1")
        assert 0 < rtt < 0.05
    print(f"\nmeasured Mbit/s: { {k: round(v / 1e6, 1) for k, v in measured.items()} }, rtt {rtt * 1e6:.0f} us")
    with Testbed(t, shape_links=False) as tb:
        fast = tb.measure_bandwidth("h0", "h2", seconds=0.5) * 8
    assert fast > 2 * 100e6  # unshaped veths are much faster: the shaping did the limiting
    print(f"unshaped veth: {fast / 1e6:.0f} Mbit/s")


@needs_netns
def test_declared_latency_is_shaped_or_reported():
    with pytest.warns(RuntimeWarning, match="netem") if not _has_netem() else _nothing():
        with Testbed(topo(2, latency_us=2000)) as tb:
            shaped = tb.latency_shaped
            if shaped:
                assert tb.measure_rtt("h0", "h1") >= 2 * 0.002
    assert shaped == _has_netem()


def _has_netem() -> bool:
    try:
        with open("/proc/config.gz", "rb") as f:
            import gzip

            return b"CONFIG_NET_SCH_NETEM=" in gzip.decompress(f.read())
    except OSError:
        return os.path.isdir("/sys/module/sch_netem")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@needs_netns
@pytest.mark.slow
def test_tf_cluster_inside_the_testbed_runs_a_two_task_graph():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tag.backend.runtime import run_steps, session_config
    from test_runtime import learnable_input, mlp_graph, pid_alive

    with Testbed(topo(2, fabric_gbps=0.5), cpu_shares={"h0": 1024, "h1": 512}) as tb:
        target = tb.start_workers()
        assert target == f"grpc://{tb.topology.hosts[0].address}:24100"
        # each worker really lives in its namespace and its cgroup
        for i, pid in enumerate(tb.cluster.pids):
            assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{tb.namespace(i)}").st_ino
            assert os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
            with open(os.path.join(tb._cgroup(i), "cgroup.procs")) as f:
                assert str(pid) in f.read().split()
        r = run_steps(mlp_graph(tasks=(0, 1)), target, steps=20, warmup=3, input_fn=learnable_input())
        assert np.all(np.isfinite(r.losses)) and np.mean(r.losses[-5:]) < np.mean(r.losses[:5])
        print(f"\n2-task MLP step on the testbed (500 Mbit/s): {r.mean_step_time_s * 1e3:.2f} ms")
        g = tf.Graph()
        outs = []
        with g.as_default():
            for t in range(2):
                with tf.device(f"/job:worker/task:{t}/device:CPU:0"):
                    outs.append(tf.raw_ops.CollectiveReduceV2(
                        input=tf.fill([1000], float(t + 1)), group_size=2, group_key=1, instance_key=1,
                        ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring"))
        with tf.compat.v1.Session(target, graph=g, config=bounded(session_config())) as sess:
            for got in sess.run(outs):
                np.testing.assert_allclose(got, np.full(1000, 3.0))
        pids = list(tb.cluster.pids)
    assert not any(pid_alive(p) for p in pids)


def test_bad_cpu_quota_and_nic_are_input_errors():
    with pytest.raises(TestbedError, match="unknown hosts"):
        Testbed(topo(), cpu_quota={"nope": 0.5})
    with pytest.raises(TestbedError, match="2 entries for 3 hosts"):
        Testbed(topo(3), cpu_quota=[0.5, 1.0])
    with pytest.raises(TestbedError, match="cores"):
        Testbed(topo(), cpu_quota=[0.0, 1.0])
    with pytest.raises(TestbedError, match="must be > 0"):
        Testbed(topo(), nic_gbps=[0.0, 1.0])
    tb = Testbed(topo(3, links='link { a: "h0" b: "h1" bandwidth_gbps: 1 }'))
    assert [r * 8 / 1e9 for r in tb.nic_rates] == pytest.approx([1.0, 1.0, 0.2])


def test_quotas_pack_onto_cpus_at_most_one_core_each():
    assert pack_quotas({"a": 1.0, "b": 0.5, "c": 0.25}, [0, 1]) == {"a": "0", "b": "1", "c": "1"}
    # least-loaded first: 0.25 joins 0.5 (0.75) rather than filling 0.75 up to a whole core
    assert pack_quotas({"a": 0.75, "b": 0.5, "c": 0.25}, [0, 1]) == {"a": "0", "b": "1", "c": "1"}
    assert pack_quotas({"a": 0.5, "b": 0.5, "c": 0.5}, [0, 1, 2, 3]) == {"a": "0", "b": "1", "c": "2"}
    assert pack_quotas({"a": 2.0, "b": 1.0}, [0, 1, 2]) == {"a": "0,1", "b": "2"}
    assert pack_quotas({"a": 1.0, "b": 1.0, "c": 0.5}, [0, 1]) is None
    assert pack_quotas({"a": 1.5, "b": 0.6}, [0, 1]) is None


def test_bad_cpu_pinning_is_an_input_error():
    with pytest.raises(TestbedError, match="cpu_pinning"):
        Testbed(topo(), cpu_quota=[1.0, 0.5], cpu_pinning="sometimes")
    with pytest.raises(TestbedError, match="CPU list"):
        Testbed(topo(), cpu_pinning=["0", "one"])
    assert Testbed(topo(), cpu_quota=[1.0, 0.5], cpu_pinning="off").cpu_pinning == {}
    assert Testbed(topo(), cpu_pinning=["0", None]).cpu_pinning == {"h0": "0", "h1": None}


UNEQUAL = ('link { a: "h0" b: "h1" bandwidth_gbps: 0.4 }\n'
           'link { a: "h0" b: "h2" bandwidth_gbps: 0.1 }\nlink { a: "h1" b: "h2" bandwidth_gbps: 0.1 }\n')


@needs_netns
@pytest.mark.slow
def test_quotas_unequal_links_and_a_shared_nic():
    """Three hosts, CPU quotas 1 / 0.5 / 0.25 core, 0.4 Gbit/s between h0 and h1 and 0.1 to h2: each pair
    runs at its own rate alone, and h0's two concurrent streams share its 0.4 Gbit/s NIC."""
    import threading
    with Testbed(topo(3, links=UNEQUAL), cpu_quota=[1.0, 0.5, 0.25]) as tb:
        from tag_bench.testbed import CFS_PERIOD_US
        for i, q in enumerate([1.0, 0.5, 0.25]):
            with open(os.path.join(tb._cgroup(i), "cpu.cfs_quota_us")) as f:
                assert int(f.read()) == int(q * CFS_PERIOD_US)
        # a busy loop in h2 is throttled to a quarter of a core, and its cgroup's counters say so
        before = tb.cpu_stat("h2")
        res = subprocess.run(tb.launch_prefix("h2") + [sys.executable, "-c",
                             "import time\nt=time.process_time()\ns=time.time()\n"
                             "while time.time()-s<1.0: pass\nprint(time.process_time()-t)"],
                             capture_output=True, text=True, timeout=60, check=True)
        assert float(res.stdout) < 0.4
        after = tb.cpu_stat("h2")
        assert after["nr_throttled"] - before.get("nr_throttled", 0) > 10 and after["throttled_time"] > 0
        # pinned (cpu_pinning="auto"): h0 alone on one CPU, h1 and h2 together on another
        if len(os.sched_getaffinity(0)) >= 2:
            show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
            allowed = [subprocess.run(tb.launch_prefix(h) + show, capture_output=True, text=True, timeout=60,
                                      check=True).stdout.strip() for h in ("h0", "h1", "h2")]
            assert allowed[0] != allowed[1] and allowed[1] == allowed[2] and all(a.count(",") == 0 for a in allowed)
        goodput = 1448 / 1514
        assert tb.measure_bandwidth("h0", "h1") * 8 / 1e9 == pytest.approx(0.4 * goodput, rel=0.2)
        assert tb.measure_bandwidth("h0", "h2") * 8 / 1e9 == pytest.approx(0.1 * goodput, rel=0.2)
        # two streams out of h0 at once: h1's stream gets what h2's leaves of the NIC, the sum stays 0.4
        out = {}
        threads = [threading.Thread(target=lambda b=b: out.__setitem__(b, tb.measure_bandwidth("h0", b, seconds=2)))
                   for b in ("h1", "h2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a bandwidth measurement did not end"
        total = (out["h1"] + out["h2"]) * 8 / 1e9
        assert total == pytest.approx(0.4 * goodput, rel=0.2)
        assert out["h2"] * 8 / 1e9 <= 0.1 * 1.2


def _concurrent_bandwidths(tb, pairs, seconds=2.0) -> list[float]:
    """Gbit/s of each (sender, receiver) stream of PAIRS, all run at once."""
    import threading
    out = {}
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, tb.measure_bandwidth(*p, seconds=seconds)))
               for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a bandwidth measurement did not end"
    return [out[p] * 8 / 1e9 for p in pairs]


@needs_netns
@pytest.mark.slow
def test_a_host_receiving_from_two_hosts_is_capped_at_its_nic_and_sends_at_full_duplex():
    """h0's NIC is 0.4 Gbit/s, its links to h1 and h2 too: what it receives from both at once adds up to 0.4
    (the receive side is shaped), while it sends and receives 0.4 at the same time (full duplex)."""
    links = ('link { a: "h0" b: "h1" bandwidth_gbps: 0.4 }\n'
             'link { a: "h0" b: "h2" bandwidth_gbps: 0.4 }\nlink { a: "h1" b: "h2" bandwidth_gbps: 0.4 }\n')
    goodput = 1448 / 1514
    with Testbed(topo(3, links=links)) as tb:
        into = _concurrent_bandwidths(tb, [("h1", "h0"), ("h2", "h0")])
        assert sum(into) == pytest.approx(0.4 * goodput, rel=0.2)
        both_ways = _concurrent_bandwidths(tb, [("h0", "h1"), ("h1", "h0")])
        for got in both_ways:
            assert got == pytest.approx(0.4 * goodput, rel=0.2)



def _gso_max_size(namespace: list[str], dev: str) -> int:
    out = subprocess.run(["ip", *namespace, "-d", "link", "show", "dev", dev], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return int(out.split("gso_max_size", 1)[1].split()[0])


@needs_netns
def test_shaped_veths_hand_the_shaper_small_offload_packets():
    """HTB sends a packet whenever its class has tokens and runs a debt after: both ends of every shaped veth
    carry offload packets of at most GSO_MAX_BYTES, so a tensor after an idle gap cannot leave at veth speed."""
    with Testbed(topo(2)) as tb:
        for i in range(2):
            assert _gso_max_size(["-n", tb.namespace(i)], "eth0") == GSO_MAX_BYTES
            assert _gso_max_size([], tb._veth(i)) == GSO_MAX_BYTES
    with Testbed(topo(2), gso_max_bytes=None) as tb:
        assert _gso_max_size(["-n", tb.namespace(0)], "eth0") == 65536


def test_gso_max_bytes_out_of_range_is_refused():
    with pytest.raises(TestbedError, match="gso_max_bytes"):
        Testbed(topo(2), gso_max_bytes=100)


def test_a_benchmark_is_told_why_the_testbed_is_missing(capsys):
    assert testbed_missing("bench_x") is (not AVAILABLE)
    err = capsys.readouterr().err
    assert err == ("" if AVAILABLE else f"bench_x: the testbed is not available here: {WHY}\n")
