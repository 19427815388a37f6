"""The heterogeneous testbed that bench_e2e and bench_fidelity measure on, built from one recipe file.

``testbed_recipe.json`` (beside this file) fixes the calibration (model, batch, steps) and the testbed
configurations: per host a CPU quota (cores, CFS) and per host pair a link bandwidth. The topology's
device speeds are *profiled*, not declared, each inside a cgroup of its quota and pinned to one core as a
worker is: ``tag-profile --sustained`` traces the calibration model on the largest quota, and
``tag-profile --like`` scales that profile to each smaller quota by the ratio of sustained step times
(kernels cannot be traced under a quota: the fastest run between throttled slices). The profile holds one
device type per quota (``CPUq50`` = half a core). Network costs of TensorFlow's runtime come from
``tag.cost.calibration.profile_network`` (two local one-thread workers).

Usage (from a script in this folder)::

    from _testbed_cases import load_recipe, calibrate_testbed, testbed_topology
    recipe = load_recipe()
    profile = calibrate_testbed(recipe, workdir)                 # every quota of every configuration
    text, topo = testbed_topology(recipe, "A", profile)          # .pbtxt text and the parsed Topology
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_recipe.json")
HOST_PAIRS = (("h0", "h1"), ("h0", "h2"), ("h1", "h2"))   # order of a configuration's links_gbps


def load_recipe(path: str = RECIPE) -> dict:
    with open(path) as f:
        return json.load(f)


def device_type(quota: float) -> str:
    """The topology's device type for a host of QUOTA cores (``CPUq25`` = a quarter of a core)."""
    return f"CPUq{int(round(quota * 100))}"


def all_quotas(recipe: dict, configs=None) -> list[float]:
    names = configs or list(recipe["configs"])
    return sorted({float(q) for n in names for q in recipe["configs"][n]["quotas"]}, reverse=True)


def model_file(spec: str, batch: int, workdir: str) -> str:
    """A ``tag-profile --model`` argument for SPEC: zoo specs as they are; ``mwms:NAME[,width=W]`` written as a
    GraphDef file (``tag.backend.mwms.tf1_graph``) into WORKDIR."""
    if not spec.startswith("mwms:"):
        return spec
    from tag.backend.mwms import tf1_graph
    name, *opts = spec[len("mwms:"):].split(",")
    width = next((int(o.split("=", 1)[1]) for o in opts if o.startswith("width=")), None)
    path = os.path.join(workdir, f"{name}-{width or 'default'}.pb")
    with open(path, "wb") as f:
        f.write(tf1_graph(name, batch, width=width).SerializeToString())
    return path


def calibrate_testbed(recipe: dict, workdir: str, configs=None, verbose: bool = True):
    """A Profile with one device type per quota (``tag-profile --sustained`` inside a cgroup of that quota,
    pinned to core 0) and the runtime's network costs."""
    from tag.backend.testbed import Testbed
    from tag.cli.profiles import merge_profiles
    from tag.cluster.topology import parse_topology
    from tag.cost.calibration import profile_network
    from tag.cost.model import Profile
    cal = recipe["calibration"]
    quotas = all_quotas(recipe, configs)
    hosts = "\n".join(f'host {{ name: "cal{i}" address: "127.0.0.1" port: {25461 + i} device {{ type: "CPU" '
                      f'kind: CPU count: 1 memory_gib: 4 peak_tflops: 0.05 memory_bandwidth_gbs: 10 }} }}'
                      for i in range(len(quotas)))
    topo = parse_topology(hosts + "\nfabric { bandwidth_gbps: 10 latency_us: 10 }\n", path="<calibration>")
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    models = [model_file(spec, cal["batch"], workdir) for spec in cal["models"]]
    base = ["--batch", str(cal["batch"]), "--sustained", str(cal["sustained_s"])]
    items = []
    with Testbed(topo, shape_links=False, cpu_quota=quotas) as tb:
        for i, q in enumerate(quotas):   # the fastest first: the others are scaled from its kernels
            out = os.path.join(workdir, f"profile-{device_type(q)}.json")
            how = (["--model", *models, "--steps", str(cal["traced_steps"])] if i == 0
                   else ["--model", models[0], "--like", items[0][0]])
            cmd = tb.launch_prefix(i) + pin + [sys.executable, "-m", "tag.cli.profile", *base, *how,
                                               "--device-type", device_type(q), "--out", out]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO))
            items.append((out, Profile.load(out)))
    profile, _ = merge_profiles(items) if len(items) > 1 else (items[0][1], [])
    profile.network = profile_network(steps=int(cal["network_steps"]))
    profile.source = (f"testbed calibration ({', '.join(cal['models'])} at batch {cal['batch']}; "
                      f"one device type per quota)")
    if verbose:
        n = profile.network
        parts = [f"{t} {d.peak_flops / 1e9:.1f} GFLOP/s" for t, d in sorted(profile.devices.items(), reverse=True)]
        print(f"calibration: {', '.join(parts)}; runtime step overhead {n.step_overhead_s * 1e3:.2f} ms, "
              f"transfer latency {n.transfer_latency_s * 1e6:.0f} us", flush=True)
    return profile


def testbed_topology(recipe: dict, name: str, profile):
    """(pbtxt text, Topology) of configuration NAME: one one-CPU host per quota, links as the recipe says;
    each device's peak FLOP/s and memory bandwidth are its quota's profiled ones."""
    from tag.cluster.topology import parse_topology
    cfg = recipe["configs"][name]
    lines = [f'name: "testbed-{name}"']
    for i, q in enumerate(cfg["quotas"]):
        d = profile.devices[device_type(q)]
        lines.append(f'host {{ name: "h{i}" address: "127.0.0.1" port: {24461 + i}\n'
                     f'  device {{ type: "{device_type(q)}" kind: CPU count: 1 memory_gib: 4 '
                     f'peak_tflops: {d.peak_flops / 1e12:.6g} memory_bandwidth_gbs: {d.memory_bandwidth / 1e9:.4g} }} }}')
    latency = recipe.get("link_latency_us", 50)
    for (a, b), bw in zip(HOST_PAIRS, cfg["links_gbps"]):
        lines.append(f'link {{ a: "{a}" b: "{b}" bandwidth_gbps: {bw} latency_us: {latency} }}')
    text = "\n".join(lines) + "\n"
    return text, parse_topology(text, path=f"<testbed {name}>")
