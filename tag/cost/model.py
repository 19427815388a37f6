"""Cost model: how long ops take on a device type, and how long bytes take to move between devices.

Compute follows a roofline per op: ``max(flops / (peak * efficiency[op type]), mem_bytes / memory_bandwidth)
+ launch overhead``. Efficiencies per op type come from a ``Profile`` (measured by ``tag-profile``, i.e.
``tag.calibration``, on a real device and stored as JSON) or from built-in defaults; a profile entry with a
``matmul_table`` (``tag.cost.matmul_table``) gives each MatMul op, and each Einsum that is one 2-D product (a dense
layer on a 3-D input and its gradients), the efficiency measured at its own shape instead.
A profile entry's ``family_scale`` multiplies the roofline time (not the launch overhead) of every op of
one family (``tag.cost.op_classes.op_family``: ``conv``, ``matmul``, ``other``) on that device type: how
a runtime's convolutions or MatMuls run relative to what the traced kernels predicted (fitted by
``tag_bench.cases.runtime_levels``); peaks and efficiencies stay as measured, so every
efficiency stays <= 1. With ``level_fade_s`` (tau) the scales fade for long kernels: an op of roofline time
``t`` is charged ``t * (1 + (scale - 1) * tau / (t + tau))``, so what a runtime adds or saves per kernel is at
most ``(scale - 1) * tau`` and a kernel much longer than tau runs as traced. MatMuls and convolutions use
the peak of the precision the graph computes them in (FP16 / BF16 tensor cores for half-precision ops, TF32 with
``tf32=True``; ``tag.cost.precision``), and ``xla=True`` costs element-wise chains as XLA fuses them (one pass over
memory). Gradients are all-reduced in their variables' dtype; ``gradient_dtype="fp16"`` charges 16-bit all-reduces of
float32 gradients instead, for runtimes that cast them before the collective (tf_cnn_benchmarks'
``compact_gradient_transfer`` with ``--use_fp16``, Horovod's ``Compression.fp16``;
``tag.cost.precision.gradient_bytes_factor``).
On a GPU served by a shipped class, a MatMul's or convolution's compute time is divided by its SM
occupancy (``tag.cost.occupancy``: how full its waves of thread-block tiles are at the op's batch on the
device's SM count), so small per-device batches and GPUs with many SMs cost what they leave idle; on
tensor cores also by how full its tiles are in the channel dimension (tile quantization).
Communication follows latency + bytes / bandwidth of the path, with ring / hierarchical all-reduce,
parameter-server push/pull and all-gather models on top.
No TensorFlow here: numpy only, so the simulator can call it thousands of times per search.

Example::

    import tag
    from tag.cost.model import CostModel, Profile
    topo = tag.load_topology("topologies/lab-v100-1080ti.pbtxt")
    tg = tag.analyze(tag.zoo.training_graph("resnet50", batch_size=64))
    cm = CostModel(tg, topo, Profile.load("profile.json"))     # or CostModel(tg, topo, tf32=True, xla=True)
    t = cm.op_times(device_group=0, batch=32)          # seconds per IR op on one device of group 0
    cm.allreduce_time(100e6, list(range(topo.num_devices)))
    cm.transfer_time(4e6, 0, 5)

The profile's JSON format, and how its entries apply to the topology's device groups: ``tag.cost.profile``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from tag.cluster.topology import Topology
from tag.cost.gpu_defaults import describe_device_type, gpu_profiles, resolve
from tag.cost.matmul_table import MatmulDims, MatmulTable, matmul_dims
from tag.cost.occupancy import GemmExtents, gemm_extents, occupancy
from tag.cost.op_classes import FAMILIES, cpu_fused_bias_adds, op_classes, op_family
from tag.cost.precision import PRECISIONS, device_peak, fusion_bytes, gradient_bytes_factor, op_precisions

# the profile dataclasses live in tag.cost.profile; imported here for the cost model and for older imports
from tag.cost.profile import PROFILE_VERSION, DeviceProfile, NetworkProfile, Profile  # noqa: F401
from tag.ir.types import TrainingGraph

# Ops that move no data and do no arithmetic at run time (aliases, metadata, graph plumbing).
ZERO_COST_TYPES = frozenset({
    "Const", "Identity", "IdentityN", "NoOp", "Reshape", "Squeeze", "ExpandDims", "ReadVariableOp",
    "VarHandleOp", "VariableV2", "Variable", "Placeholder", "PlaceholderWithDefault", "Shape", "ShapeN",
    "Size", "Rank", "StopGradient", "PreventGradient", "ControlTrigger", "VarIsInitializedOp",
    "BroadcastGradientArgs", "ZerosLike", "OnesLike", "Snapshot", "EnsureShape", "CheckNumerics",
    "_Arg", "_Retval", "DestroyResourceOp", "Assert",
})

_MATMUL_LIKE = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv2DBackpropInput",
                "Conv2DBackpropFilter", "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
                "_FusedMatMul", "_FusedConv2D", "Einsum")
_DEPTHWISE = ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
              "DepthwiseConv2dNativeBackpropFilter")

#: Built-in efficiencies and launch overheads per TF device type, used where no profile entry applies.
BUILTIN_DEFAULTS: dict[str, dict] = {
    "GPU": {"launch_overhead_s": 5e-6,
            "efficiency": {**{t: 0.5 for t in _MATMUL_LIKE}, **{t: 0.2 for t in _DEPTHWISE}, "default": 0.25}},
    "CPU": {"launch_overhead_s": 1e-5,
            "efficiency": {**{t: 0.5 for t in _MATMUL_LIKE}, **{t: 0.2 for t in _DEPTHWISE}, "default": 0.1}},
}



@dataclass(frozen=True)
class DeviceRates:
    """What the roofline needs for one device group: effective peak, bandwidth, overhead, efficiencies."""

    peak_flops: float
    memory_bandwidth: float
    launch_overhead_s: float
    efficiency: dict[str, float]
    lockstep_factor: float = 1.0    # op-time multiplier for replicas running in lockstep (shipped GPU defaults)
    matmul_table: MatmulTable | None = None   # MatMul efficiency by shape, from the device's own profile entry
    #: peak FLOP/s by precision ("fp32" is ``peak_flops``; others: ``tag.cost.precision.device_peak``)
    peaks: dict[str, float] = field(default_factory=dict)
    #: tensor-core efficiency per op class by precision (shipped GPU classes); else the FP32 efficiencies
    tensor_efficiency: dict[str, dict[str, float]] = field(default_factory=dict)
    #: roofline-time multiplier per op family (``DeviceProfile.family_scale``); absent families are 1
    family_scale: dict[str, float] = field(default_factory=dict)
    #: seconds over which ``family_scale`` fades for long kernels (``DeviceProfile.level_fade_s``); 0: no fade
    level_fade_s: float = 0.0
    #: streaming multiprocessors (shipped GPU classes): GEMM-like ops are charged their occupancy
    #: (``tag.cost.occupancy``); 0: efficiencies apply as they are
    sms: int = 0

    def efficiency_of(self, op_type: str) -> float:
        return self.efficiency.get(op_type, self.efficiency.get("default", 0.25))

    def efficiency_for(self, op_type: str, op_class: str | None, precision: str = "fp32") -> float:
        """The efficiency of an op: for a tensor-core PRECISION the class's tensor-core entry where the
        device has one; else its class's entry (``tag.cost.op_classes``), else its type's, else default."""
        table = self.tensor_efficiency.get(precision) if precision != "fp32" else None
        if table and op_class is not None and op_class in table:
            return table[op_class]
        if op_class is not None and op_class in self.efficiency:
            return self.efficiency[op_class]
        return self.efficiency_of(op_type)

    def peak_for(self, precision: str) -> float:
        """Peak FLOP/s in PRECISION (the FP32 peak where none is known)."""
        return self.peaks.get(precision, self.peak_flops)


class CostModel:
    """Compute and communication times for one TrainingGraph on one Topology (see module docstring)."""

    def __init__(self, graph: TrainingGraph, topology: Topology, profile: Profile | None = None, *,
                 tf32: bool = False, xla: bool = False, gradient_dtype: str | None = None):
        self.graph = graph
        self.profile = profile if profile is not None else Profile()
        self.topology = self.given_topology = topology
        self.arrays = graph.arrays()
        self.tf32, self.xla = bool(tf32), bool(xla)
        self.gradient_dtype = gradient_dtype
        # bytes an all-reduce moves per byte of the variables it reduces (1 unless gradients travel narrower)
        self.gradient_bytes_factor = gradient_bytes_factor(graph, gradient_dtype)
        types = [op.type for op in graph.ops]
        # efficiency key per op: (op type, op class, precision); the class refines the type for the shipped
        # GPU profiles; the precision (tag.cost.precision) picks the peak: MatMuls and convolutions run on
        # tensor cores in the dtype the graph has them in, everything else on the FP32 units
        classes = op_classes(graph)
        precs = [p if c is not None and c != "conv:depthwise" and p is not None else "fp32"
                 for c, p in zip(classes, op_precisions(graph), strict=True)]
        if self.tf32:
            precs = ["tf32" if p == "fp32" and c is not None and c != "conv:depthwise" else p
                     for c, p in zip(classes, precs, strict=True)]
        keys = list(zip(types, classes, precs, strict=True))
        self._keys = sorted(set(keys), key=lambda k: (k[0], k[1] or "", k[2]))
        key_id = {k: i for i, k in enumerate(self._keys)}
        self._op_key_id = np.array([key_id[k] for k in keys], dtype=np.int64)
        self._zero = np.array([t in ZERO_COST_TYPES for t in types], dtype=bool)
        #: on CPU devices also the BiasAdds that run inside their convolution's kernel (``cpu_fused_bias_adds``)
        self._zero_cpu = self._zero.copy()
        self._zero_cpu[list(cpu_fused_bias_adds(graph))] = True
        #: per op: its index in FAMILIES (DeviceRates.family_scale)
        self._family = np.array([FAMILIES.index(op_family(t)) for t in types], dtype=np.int64)
        # with XLA, element-wise / normalisation chains cost one pass over memory and one launch
        if self.xla:
            self._mem_fixed, self._mem_per_example, self._fused = fusion_bytes(graph)
        else:
            self._mem_fixed, self._mem_per_example = self.arrays.mem_fixed, self.arrays.mem_per_example
            self._fused = np.zeros(len(graph.ops), dtype=bool)
        self._rates: dict[int, DeviceRates] = {}
        self._gpu_res: dict[int, object] = {}
        self._inv_rate: dict[int, np.ndarray] = {}
        self._tc_mask: dict[int, np.ndarray] = {}
        self._op_time_cache: dict[tuple[int, float], np.ndarray] = {}
        # host-level view of the interconnect, used by the collective models
        self._dev_host = np.array([d.host_index for d in topology.devices], dtype=np.int64)
        self._host_intra_bw = np.array([h.intra_bandwidth for h in topology.hosts], dtype=np.float64)
        self._host_intra_lat = np.array([h.intra_latency for h in topology.hosts], dtype=np.float64)
        self._nccl: tuple | None = None
        # with a network calibration, inter-host links carry the runtime's measured transfer costs
        if self.profile.network:
            self.topology = self.profile.network.calibrate(topology)
        #: seconds each tensor sent between hosts costs beyond its bytes (NetworkProfile.per_tensor_s)
        self.per_tensor_s = float(self.profile.network.per_tensor_s) if self.profile.network else 0.0

    def with_profile(self, profile: Profile) -> "CostModel":
        """A cost model of the same graph, topology and options (TF32, XLA, gradient dtype) with PROFILE."""
        return CostModel(self.graph, self.given_topology, profile, tf32=self.tf32, xla=self.xla,
                         gradient_dtype=self.gradient_dtype)

    # ---------------------------------------------------------------- compute
    @functools.cached_property
    def gemm_extents(self) -> GemmExtents:
        """The graph's MatMul / convolution GEMM extents, for devices charged their occupancy."""
        return gemm_extents(self.graph)

    @functools.cached_property
    def matmul_dims(self) -> MatmulDims:
        """The graph's MatMul shapes, for devices whose profile has a MatMul table."""
        return matmul_dims(self.graph)

    def rates(self, device_group: int) -> DeviceRates:
        """The effective numbers of one device group (profile entry applied to the topology's spec).

        Precedence: the profile's entry for the group's device type; else, for a GPU whose name tag knows,
        the shipped GPU class (``tag.cost.gpu_defaults``) with the topology's peak and bandwidth; else the
        profile's "default" entry; else the built-in defaults of the TF device type.
        """
        r = self._rates.get(device_group)
        if r is not None:
            return r
        g = self.topology.groups[device_group]
        builtin = BUILTIN_DEFAULTS.get(g.tf_device_type, BUILTIN_DEFAULTS["GPU"])
        entry, exact = self.profile.entry_for(g.device_type)
        gpu = self._gpu_class(device_group)
        peak, bw = g.peak_flops, g.memory_bandwidth
        overhead = builtin["launch_overhead_s"]
        eff = dict(builtin["efficiency"])
        if gpu is not None and not exact:
            n = len(g.devices)
            lockstep = 1.0 + gpu_profiles().lockstep_per_doubling * math.log2(n) if n > 1 else 1.0
            r = DeviceRates(float(peak), float(bw) * gpu.cls.memory_efficiency, gpu.cls.launch_overhead_s,
                            dict(gpu.cls.efficiency), lockstep, peaks=self._peaks(g),
                            tensor_efficiency=gpu.tensor_efficiency(),
                            sms=gpu.sm_count(g.peak_flops))
            self._rates[device_group] = r
            return r
        if entry is not None:
            if exact and entry.peak_flops > 0:
                peak = entry.peak_flops
            if exact and entry.memory_bandwidth > 0:
                bw = entry.memory_bandwidth
            if entry.launch_overhead_s is not None:
                overhead = entry.launch_overhead_s
            # listed op types come from the profile; unlisted ones keep a built-in per-type value if there
            # is one, else the profile's "default"
            eff.update(entry.efficiency)
        # a MatMul table holds fractions of the peak it was measured against: only the device's own entry
        table = entry.matmul_table if entry is not None and exact else None
        # a measured peak replaces the spec's FP32 peak: the other precisions keep their ratio to it
        scale = peak / g.peak_flops if g.peak_flops > 0 else 1.0
        peaks = {k: v * scale for k, v in self._peaks(g).items()}
        family_scale = dict(entry.family_scale) if entry is not None else {}
        fade = entry.level_fade_s if entry is not None and entry.level_fade_s is not None else 0.0
        r = DeviceRates(float(peak), float(bw), float(overhead), eff, matmul_table=table, peaks=peaks,
                        family_scale=family_scale, level_fade_s=float(fade))
        self._rates[device_group] = r
        return r

    @staticmethod
    def _peaks(group) -> dict[str, float]:
        return {p: device_peak(group, p) for p in PRECISIONS}

    def _gpu_class(self, device_group: int):
        """The shipped GPU class serving DEVICE_GROUP when no exact profile entry does (else None)."""
        if device_group not in self._gpu_res:
            g = self.topology.groups[device_group]
            res = None
            if g.tf_device_type == "GPU" and g.device_type not in self.profile.devices:
                res = resolve(g.device_type)
            self._gpu_res[device_group] = res
        return self._gpu_res[device_group]

    def profile_source(self, device_group: int) -> str:
        """Which profile serves DEVICE_GROUP (a profile entry, a shipped GPU class, or built-in defaults)."""
        g = self.topology.groups[device_group]
        return describe_device_type(g.device_type, g.tf_device_type, self.profile)

    def _inv_compute_rate(self, device_group: int) -> np.ndarray:
        inv = self._inv_rate.get(device_group)
        if inv is None:
            r = self.rates(device_group)
            per_key = np.array([1.0 / (r.peak_for(p) * r.efficiency_for(t, c, p)) for t, c, p in self._keys])
            inv = per_key[self._op_key_id] if len(self._op_key_id) else np.zeros(0)
            self._inv_rate[device_group] = inv
        return inv

    def _on_tensor_cores(self, device_group: int) -> np.ndarray:
        """Per op: whether it runs on DEVICE_GROUP's tensor cores (a precision and op class its shipped GPU
        class has a tensor-core efficiency for), so that its tile padding is charged (``occupancy``)."""
        mask = self._tc_mask.get(device_group)
        if mask is None:
            tables = self.rates(device_group).tensor_efficiency
            per_key = np.array([p != "fp32" and c is not None and c in tables.get(p, {}) for _, c, p in self._keys],
                               dtype=bool)
            mask = per_key[self._op_key_id] if len(self._op_key_id) else np.zeros(0, dtype=bool)
            self._tc_mask[device_group] = mask
        return mask

    def op_times(self, device_group: int, batch: float) -> np.ndarray:
        """Seconds per IR op on ONE device of DEVICE_GROUP at per-replica batch BATCH (cached, read-only)."""
        key = (int(device_group), float(batch))
        t = self._op_time_cache.get(key)
        if t is not None:
            return t
        if len(self._op_time_cache) > 4096:
            self._op_time_cache.clear()
        a = self.arrays
        r = self.rates(device_group)
        flops = a.flops_fixed + a.flops_per_example * batch
        mem = self._mem_fixed + self._mem_per_example * batch
        compute = flops * self._inv_compute_rate(device_group)
        if r.sms > 0:
            compute = compute / occupancy(self.gemm_extents, batch, r.sms, self._on_tensor_cores(device_group))
        t = np.maximum(compute, mem / r.memory_bandwidth)
        if r.matmul_table is not None and len(self.matmul_dims.ops):
            mm = self.matmul_dims
            eff = r.matmul_table.lookup(mm.variant, *mm.at(batch))
            t[mm.ops] = np.maximum(flops[mm.ops] / (r.peak_flops * eff), mem[mm.ops] / r.memory_bandwidth)
        if r.family_scale:
            scale = np.array([r.family_scale.get(f, 1.0) for f in FAMILIES])[self._family]
            if r.level_fade_s > 0:
                scale = 1.0 + (scale - 1.0) * r.level_fade_s / (t + r.level_fade_s)
            t = t * scale
        t = t + np.where(self._fused, 0.0, r.launch_overhead_s)
        if r.lockstep_factor != 1.0:
            t = t * r.lockstep_factor
        t[self._zero_cpu if self.topology.groups[device_group].tf_device_type == "CPU" else self._zero] = 0.0
        t.setflags(write=False)
        self._op_time_cache[key] = t
        return t

    # ---------------------------------------------------------- communication
    def transfer_time(self, nbytes: float, src_device: int, dst_device: int) -> float:
        """Latency + bytes / bandwidth between two devices (0 on the same device)."""
        if src_device == dst_device or nbytes <= 0:
            return 0.0
        topo = self.topology
        return float(topo.latency[src_device, dst_device] + nbytes / topo.bandwidth[src_device, dst_device])

    def _ring_coeffs(self, devices: Sequence[int]) -> tuple[float, float, int]:
        """(slowest link bandwidth, largest hop latency, n) of a ring over DEVICES ordered by host.

        For devices that are all GPUs tag knows, the bandwidth is what NCCL reaches on each link (the
        declared bandwidth times the shipped collective efficiency of the link's kind)."""
        devs = sorted(devices, key=lambda d: (self._dev_host[d], d))
        n = len(devs)
        src = np.array(devs)
        dst = np.roll(src, -1)
        bw_m = self.topology.bandwidth[src, dst]
        eff, _ = self._nccl_defaults(devs)
        if eff is not None:
            bw_m = bw_m * eff[src, dst]
        bw = float(np.min(bw_m))
        lat = float(np.max(self.topology.latency[src, dst]))
        return bw, lat, n

    def _nccl_defaults(self, devices: Sequence[int]) -> tuple[np.ndarray | None, float]:
        """(per-device-pair bandwidth efficiency, fixed seconds per collective call) of NCCL collectives
        over DEVICES when every one is a GPU with a shipped class (``tag.cost.gpu_defaults``); else (None, 0)."""
        if self._nccl is None:
            topo = self.topology
            known = np.array([g.tf_device_type == "GPU" and gpu_profiles().resolve(g.device_type) is not None
                              for g in topo.groups], dtype=bool)
            dev_known = np.array([known[d.group] for d in topo.devices], dtype=bool)
            kinds = topo.extra.get("interconnect", {}) if isinstance(topo.extra, dict) else {}
            host_kind = [kinds.get(h.name, "INTERCONNECT_UNSPECIFIED") for h in topo.hosts]
            prof = gpu_profiles()
            h_eff = np.array([prof.collective(k).bandwidth_efficiency for k in host_kind])
            h_call = np.array([prof.collective(k).call_latency_s for k in host_kind])
            net = prof.collective("NETWORK")
            same = self._dev_host[:, None] == self._dev_host[None, :]
            eff = np.where(same, h_eff[self._dev_host][:, None], net.bandwidth_efficiency)
            self._nccl = (dev_known, eff, h_call, net.call_latency_s)
        dev_known, eff, h_call, net_call = self._nccl
        idx = np.asarray(list(devices), dtype=np.int64)
        if not len(idx) or not bool(np.all(dev_known[idx])):
            return None, 0.0
        hosts = np.unique(self._dev_host[idx])
        call = float(np.max(h_call[hosts])) if len(hosts) == 1 else max(float(np.max(h_call[hosts])), net_call)
        return eff, call

    def allreduce_coeffs(self, devices: Sequence[int]) -> tuple[tuple[float, float], tuple[float, float]]:
        """Linear models (fixed seconds, seconds per byte) of ring and hierarchical all-reduce over DEVICES.

        ring: 2(n-1) steps of bytes/n each over the slowest link of a ring ordered by host.
        hierarchical: reduce-scatter inside each host, ring all-reduce of the full bytes across hosts
        (one stream per host link), all-gather inside each host.
        """
        devices = list(dict.fromkeys(int(d) for d in devices))
        n = len(devices)
        if n <= 1:
            return (0.0, 0.0), (0.0, 0.0)
        bw, lat, _ = self._ring_coeffs(devices)
        hosts = self.topology.devices_by_host(devices)     # host index -> the devices on it
        # TF's collective runtime between hosts costs more than plain transfers (network calibration)
        step_x, byte_x = self.profile.network.collective_extra() if (
            self.profile.network is not None and len(hosts) > 1) else (0.0, 0.0)
        _, call = self._nccl_defaults(devices)
        gf = self.gradient_bytes_factor
        ring = (call + 2 * (n - 1) * (lat + step_x), gf * 2 * (n - 1) / n * (1.0 / bw + byte_x))
        if len(hosts) == 1 or all(len(v) == 1 for v in hosts.values()):
            return ring, ring
        # inside hosts: (k-1)/k of the bytes twice (reduce-scatter + all-gather), slowest host dominates
        intra_fixed, intra_per_byte = 0.0, 0.0
        for devs in hosts.values():
            k = len(devs)
            if k > 1:
                bw_h, lat_h, _ = self._ring_coeffs(devs)
                intra_fixed = max(intra_fixed, 2 * (k - 1) * lat_h)
                intra_per_byte = max(intra_per_byte, 2 * (k - 1) / k / bw_h)
        leaders = [devs[0] for _, devs in sorted(hosts.items())]
        hb, hl, m = self._ring_coeffs(leaders)
        hier = (call + intra_fixed + 2 * (m - 1) * (hl + step_x),
                gf * (intra_per_byte + 2 * (m - 1) / m * (1.0 / hb + byte_x)))
        return ring, hier

    def allreduce_time(self, nbytes: float, devices: Sequence[int]) -> float:
        """Flat ring all-reduce of NBYTES (per device) over DEVICES: the algorithm the rewriter deploys
        (the hierarchical model of ``allreduce_coeffs`` is not deployed, so it is not charged)."""
        if nbytes <= 0:
            return 0.0
        (a1, b1), _ = self.allreduce_coeffs(devices)
        return float(a1 + b1 * nbytes)

    def ps_coeffs(self, workers: Sequence[int], ps_device: int) -> tuple[float, float]:
        """Linear model (fixed s, s per byte) of ONE direction (push or pull) of parameter-server traffic.

        Every remote worker's bytes cross the PS host's link, one after another (the bottleneck is the sum
        of bytes through the PS host's NIC / its fastest link); workers on the PS's own host share its
        intra-host interconnect likewise; a single transfer can be no faster than its own path.
        """
        topo = self.topology
        others = [int(w) for w in dict.fromkeys(workers) if int(w) != int(ps_device)]
        if not others:
            return 0.0, 0.0
        ph = int(self._dev_host[ps_device])
        remote = [w for w in others if self._dev_host[w] != ph]
        local = [w for w in others if self._dev_host[w] == ph]
        fixed = max(float(topo.latency[w, ps_device]) for w in others)
        per_byte = max(1.0 / float(topo.bandwidth[w, ps_device]) for w in others)
        if remote:
            nic_bw = self.nic_bandwidth(ph)
            per_byte = max(per_byte, len(remote) / nic_bw)
        if local:
            per_byte = max(per_byte, len(local) / float(self._host_intra_bw[ph]))
        return fixed, per_byte

    def nic_bandwidth(self, host: int) -> float:
        """Bandwidth of a host's network interface: its fastest link to any other host."""
        hb = self.topology.host_bandwidth
        if hb.shape[0] <= 1:
            return float("inf")
        row = np.delete(hb[host], host)
        return float(np.max(row))

    def ps_time(self, nbytes: float, workers: Sequence[int], ps_device: int) -> float:
        """Push of NBYTES from every worker to PS_DEVICE plus the pull back (all share the PS's links)."""
        if nbytes <= 0:
            return 0.0
        a, b = self.ps_coeffs(workers, ps_device)
        return float(2 * (a + b * nbytes)) if b > 0 else 0.0

    def allgather_coeffs(self, devices: Sequence[int]) -> tuple[tuple[float, float], tuple[float, float]]:
        """Linear models (fixed s, s per byte of ONE device's block) of ring and hierarchical all-gather.

        ring: (n-1) steps over the slowest link of a ring ordered by host. hierarchical: gather inside each
        host, ring across hosts carrying each host's gathered blocks, broadcast the rest inside each host.
        """
        devices = list(dict.fromkeys(int(d) for d in devices))
        n = len(devices)
        if n <= 1:
            return (0.0, 0.0), (0.0, 0.0)
        bw, lat, _ = self._ring_coeffs(devices)
        _, call = self._nccl_defaults(devices)
        ring = (call + (n - 1) * lat, (n - 1) / bw)
        hosts = self.topology.devices_by_host(devices)     # host index -> the devices on it
        if len(hosts) == 1 or len(hosts) == n:
            return ring, ring
        intra_fixed = intra_pb = 0.0
        for devs in hosts.values():
            k = len(devs)
            if k > 1:
                bw_h, lat_h, _ = self._ring_coeffs(devs)
                intra_fixed = max(intra_fixed, 2 * (k - 1) * lat_h)
                intra_pb = max(intra_pb, ((k - 1) + (n - k)) / bw_h)
        leaders = [devs[0] for _, devs in sorted(hosts.items())]
        hb, hl, m = self._ring_coeffs(leaders)
        kmax = max(len(v) for v in hosts.values())
        return ring, (call + intra_fixed + (m - 1) * hl, intra_pb + (m - 1) * kmax / hb)

    def allgather_time(self, nbytes_per_device: float, devices: Sequence[int]) -> float:
        """Time for every device of DEVICES to receive every other device's NBYTES_PER_DEVICE block."""
        if nbytes_per_device <= 0:
            return 0.0
        (a1, b1), (a2, b2) = self.allgather_coeffs(devices)
        return float(min(a1 + b1 * nbytes_per_device, a2 + b2 * nbytes_per_device))

    def compute_time(self, device_group: int, batch: float, ops: Iterable[int] | None = None) -> float:
        """Sum of op times (all ops, or OPS) on one device of DEVICE_GROUP at BATCH: a serial lower bound."""
        t = self.op_times(device_group, batch)
        return float(t.sum() if ops is None else t[np.asarray(list(ops), dtype=np.int64)].sum())


def device_profiles(topology: "Topology", cost_model: "CostModel | None" = None) -> dict[str, str]:
    """{device type: which profile serves it} for TOPOLOGY's device groups (``tag-topo show``, the report).

    COST_MODEL (the one predictions use) accounts for its profile file; without it, as with no profile file."""
    out: dict[str, str] = {}
    for g in topology.groups:
        if g.device_type not in out:
            out[g.device_type] = (cost_model.profile_source(g.index) if cost_model is not None
                                  else describe_device_type(g.device_type, g.tf_device_type))
    return out
