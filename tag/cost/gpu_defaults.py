"""Shipped GPU cost profiles: what a GPU's ops and collectives cost when nobody has profiled it.

No GPU is at hand to run ``tag-profile`` on, and the generic built-in roofline (one efficiency per op
type) predicts published FP32 training throughput 3% to 68% too slow (VGG-style 3x3 stacks 3x: cuDNN's
Winograd and FFT algorithms do fewer multiplications than the direct-convolution FLOP count). So tag
ships one profile per GPU class in ``tag/cost/data/gpu_profiles.json``, fitted by
``scripts/fit_gpu_defaults.py`` on the *fit* rows of ``data/published_throughput.csv`` (published FP32
TensorFlow training throughputs) and checked by ``scripts/bench_published.py`` on its *validation* rows.
Each class holds:

- ``efficiency``: fraction of the FP32 peak reached per op class (``tag.cost.op_classes``: convolutions by
  kernel size and stride, MatMul by shape, batched matmuls) or op type, ``default`` for the rest. The
  ``conv:3x3s1`` value may exceed 1: it is relative to the direct-convolution FLOP count, and Winograd
  needs fewer multiplications than that.
- ``peaks``: the class's spec-sheet peaks by precision (FP32 and dense TF32 / FP16 / BF16 tensor cores);
  a device's peak in a precision is its own FP32 peak times the class's ratio (``tag.cost.precision``).
- ``tensor_efficiency``: per tensor-core precision, the fraction of that peak MatMuls and convolutions
  reach, per op class (fitted on V100 mixed-precision rows; every class with tensor cores has them times
  its ``tensor_scale``, the clock part of its FP32 compute scale).
- ``full_rate_peaks`` (GeForce classes): the tensor datapath's rate where the FP32-accumulate ``peaks``
  are half of it (``Resolution.tensor_efficiency``: a convolution held to a fraction of a full-rate peak by
  its operand feed reaches that fraction of the datapath's rate, up to what the half-rate math allows).
- ``memory_efficiency``: the fraction of the spec-sheet memory bandwidth that memory-bound kernels reach.
- ``launch_overhead_s``: fixed cost per kernel (TensorFlow executor and launch).
- ``spec``: the class's own spec sheet, with ``sms``, its streaming multiprocessors (architecture
  whitepapers), by which the cost model charges GEMM-like ops their occupancy (``tag.cost.occupancy``). A
  related GPU has its reference card's (a related family's ``sms``) or its class's count, times its FP32
  peak over that card's (``Resolution.sm_count``).
- ``basis``: how the class was calibrated (fitted on which GPU's rows, or derived from which class).

Synchronous data parallelism runs each step at the pace of the slowest replica (per-step jitter,
NCCL kernels sharing the SMs and memory with compute), so a GPU of a device group with ``n > 1``
devices runs its ops ``1 + lockstep_per_doubling * log2(n)`` times slower (fitted on the multi-GPU
fit rows; published 8-GPU scaling is 7.3-7.9x for ResNet-50, not 8x).

Collectives get NCCL-style defaults per interconnect kind (``collectives``): the fraction of the
declared link bandwidth an all-reduce reaches (its bus bandwidth, as nccl-tests reports it) and a fixed
cost per collective call. They apply to collectives whose devices all resolve to a shipped GPU class.

How a device type finds its class (``resolve``): its name is matched (case-insensitive, ignoring
spaces, dashes and underscores) against each class's patterns ("V100", "Tesla V100-SXM2-32GB",
"A100-80G" ...), then against ``related`` GPUs that have no profile of their own (Titan V, RTX 2080,
A6000, A10, ...), which name the nearest class. Peak FLOP/s and bandwidth always come from the
topology (the device's own spec sheet), so a related GPU is the nearest class scaled by its spec
sheet. A related family may carry its own spec-sheet ``peaks`` (a reference card's FP32 and dense
tensor-core peaks): its tensor-core ratios then replace the class's, since workstation and datacenter
parts (Titan RTX, Quadro RTX, RTX A4000-A6000, A10, A40, L4) run FP16 with FP32 accumulation at twice
the GeForce rate of the class that serves them. A name that matches nothing keeps tag's generic built-in
defaults.

Example::

    from tag.cost.gpu_defaults import describe_device_type, gpu_profiles, resolve
    r = resolve("Tesla V100-SXM2-16GB")      # Resolution(cls=<V100>, exact=True, via='V100')
    r.cls.efficiency["conv:3x3s1"], r.cls.launch_overhead_s
    resolve("TitanV").exact                  # False: the V100 class serves it, scaled by its spec sheet
    describe_device_type("RTX2080Ti", "GPU") # 'shipped GPU profile RTX2080Ti'
    gpu_profiles().collective("NVLINK")      # CollectiveDefaults(bandwidth_efficiency=..., call_latency_s=...)
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cost.profile import Profile

GPU_PROFILES_VERSION = 1
DATA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpu_profiles.json")
#: interconnect kinds a topology can declare (tag/cluster/proto/topology.proto), plus the network
COLLECTIVE_KINDS = ("NVLINK", "PCIE", "INTERCONNECT_UNSPECIFIED", "NETWORK")


#: the largest fraction of a half-rate tensor peak a kernel is charged (``Resolution.tensor_efficiency``)
HALF_RATE_CAP = 1.0


@dataclass(frozen=True)
class GpuClass:
    """One shipped GPU profile: efficiencies per op class / type, bandwidth efficiency, launch overhead."""

    name: str
    patterns: tuple[str, ...]
    efficiency: dict[str, float]
    memory_efficiency: float
    launch_overhead_s: float
    spec: dict[str, float] = field(default_factory=dict)    # the class's own spec sheet (``sms``: its SMs)
    basis: str = ""
    #: the class's spec-sheet peaks in TFLOP/s by precision ("fp32", "tf32", "fp16", "bf16"; dense tensor cores)
    peaks: dict[str, float] = field(default_factory=dict)
    #: fraction of the tensor-core peak reached per op class, by precision ("tf32", "fp16", "bf16")
    tensor_efficiency: dict[str, dict[str, float]] = field(default_factory=dict)
    #: GeForce classes: the tensor datapath's rate by precision (TFLOP/s, dense) where ``peaks`` (FP32
    #: accumulation, what frameworks run) is a fraction of it (Turing / GA102 whitepapers: FP16 accumulation)
    full_rate_peaks: dict[str, float] = field(default_factory=dict)

    def peak_ratio(self, precision: str) -> float | None:
        """This class's PRECISION peak over its FP32 peak (None: the spec sheet lists none)."""
        p, base = self.peaks.get(precision), self.peaks.get("fp32")
        return p / base if p and base else None


@dataclass(frozen=True)
class CollectiveDefaults:
    """NCCL all-reduce on one kind of link: bus bandwidth / declared bandwidth, fixed seconds per call."""

    bandwidth_efficiency: float
    call_latency_s: float


@dataclass(frozen=True)
class Resolution:
    """Which class serves a device type: ``exact`` when it is the class's own GPU; ``via`` what matched."""

    cls: GpuClass
    exact: bool
    via: str
    #: the related family's own spec-sheet peaks by precision (empty: the class's ratios hold)
    peaks: dict[str, float] = field(default_factory=dict)
    #: SMs of the related family's reference card (the one whose FP32 peak is ``peaks["fp32"]``; 0: none)
    reference_sms: float = 0.0

    def sm_count(self, fp32_peak_flops: float) -> int:
        """Streaming multiprocessors of a device of this resolution with FP32_PEAK_FLOPS (0: unknown). The
        class's own GPU has its spec sheet's count; a related GPU the reference card's (or the class's)
        count scaled by its FP32 peak (SMs x clock; the clock assumed the reference's)."""
        own = self.cls.spec.get("sms", 0.0)
        if self.exact or own <= 0 and self.reference_sms <= 0:
            return int(own)
        ref_sms, ref_peak = ((self.reference_sms, self.peaks.get("fp32", 0.0)) if self.reference_sms > 0
                             else (own, self.cls.spec.get("peak_tflops", 0.0)))
        if ref_peak <= 0 or fp32_peak_flops <= 0:
            return int(ref_sms)
        return max(1, int(round(ref_sms * fp32_peak_flops / (ref_peak * 1e12))))

    def tensor_efficiency(self) -> dict[str, dict[str, float]]:
        """Fraction of this device's tensor-core peak (``peak_ratio``) reached per op class, by precision.

        The class's fitted table, except on a part that runs FP32 accumulation slower than its tensor
        datapath (a GeForce class with ``full_rate_peaks``, served without a family's own peaks): the fitted
        fractions are of a full-rate peak (the V100's), where what holds a convolution to them is feeding
        operands, not the multiply-add rate. That feed is the datapath's, so such a kernel reaches the same
        fraction of the full rate, as long as the half-rate math keeps up: at most the half-rate peak itself
        (``HALF_RATE_CAP`` of it). The cap is the math's limit, not a fitted number: it was the fitted table's
        largest entry until the large-MatMul efficiency, once the XLA chains were costed through
        ``tf.gradients``' Identities, was refitted from its bound 1.0 to an end-to-end 0.5, which says how
        fast TensorFlow's BERT MatMuls run, not how fast half-rate math can go."""
        out = {}
        for prec, table in self.cls.tensor_efficiency.items():
            full, own = self.cls.full_rate_peaks.get(prec), self.cls.peaks.get(prec)
            if self.peaks or not table or not full or not own or full <= own:
                out[prec] = dict(table)
                continue
            out[prec] = {k: min(v * full / own, HALF_RATE_CAP) for k, v in table.items()}
        return out

    def peak_ratio(self, precision: str) -> float | None:
        """PRECISION's peak over the FP32 peak: the related family's spec sheet where it has one, else the
        class's (None: no tensor cores for it)."""
        if self.peaks:
            p, base = self.peaks.get(precision), self.peaks.get("fp32")
            return p / base if p and base else None
        return self.cls.peak_ratio(precision)

    def label(self) -> str:
        if self.exact:
            return f"shipped GPU profile {self.cls.name}"
        return f"shipped GPU profile {self.cls.name} (nearest class for {self.via}, scaled by its spec sheet)"


@dataclass(frozen=True)
class GpuProfiles:
    """Everything in the shipped data file."""

    classes: dict[str, GpuClass]
    #: (name, patterns, class name, the family's own spec-sheet peaks or {}, its reference card's SMs or 0)
    related: tuple[tuple[str, tuple[str, ...], str, dict[str, float], float], ...]
    collectives: dict[str, CollectiveDefaults]
    source: str = ""
    precision: str = "fp32"
    lockstep_per_doubling: float = 0.0

    def collective(self, kind: str) -> CollectiveDefaults:
        """Defaults for interconnect KIND ("NVLINK", "PCIE", "NETWORK", ...); unknown kinds: unspecified."""
        return self.collectives.get(kind) or self.collectives["INTERCONNECT_UNSPECIFIED"]

    def resolve(self, device_type: str) -> Resolution | None:
        """The class serving DEVICE_TYPE, or None when its name matches no GPU tag knows."""
        key = normalise(device_type)
        if not key:
            return None
        for cls in self.classes.values():
            if any(re.search(p, key) for p in cls.patterns):
                return Resolution(cls, True, cls.name)
        for name, patterns, cls_name, peaks, sms in self.related:
            if any(re.search(p, key) for p in patterns):
                return Resolution(self.classes[cls_name], False, name, dict(peaks), sms)
        return None


def normalise(name: str) -> str:
    """Lower case without spaces, dashes, underscores and a leading vendor word ("Tesla V100-SXM2" -> "v100sxm2")."""
    key = re.sub(r"[\s\-_]+", "", str(name).lower())
    return re.sub(r"^(nvidia|tesla|geforce|quadro)+", "", key)


def load_gpu_profiles(path: str | os.PathLike | None = None) -> GpuProfiles:
    """Read and check the shipped GPU profiles (or the file at PATH); TagError naming the file if malformed."""
    path = os.fspath(path) if path is not None else DATA_PATH
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TagError(f"{path}: GPU profile data not found (a broken install?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TagError(f"{path}: cannot read GPU profile data: {' '.join(str(err).split())}") from None
    return _parse(data, path)


def _parse(data: object, where: str) -> GpuProfiles:
    def bad(msg: str) -> TagError:
        return TagError(f"{where}: {msg}")

    def num(v: object, what: str, lo: float = 0.0, hi: float = math.inf) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo < v <= hi:
            raise bad(f"{what} must be a number in ({lo}, {hi}], got {v!r}")
        return float(v)

    if not isinstance(data, dict) or data.get("version") != GPU_PROFILES_VERSION:
        raise bad(f"expected a JSON object with version {GPU_PROFILES_VERSION}")
    classes: dict[str, GpuClass] = {}
    for name, c in (data.get("classes") or {}).items():
        if not isinstance(c, dict) or not isinstance(c.get("efficiency"), dict) or not c.get("patterns"):
            raise bad(f"classes.{name} needs 'patterns' and an 'efficiency' object")
        eff = {str(k): num(v, f"classes.{name}.efficiency.{k}", hi=8.0) for k, v in c["efficiency"].items()}
        if "default" not in eff:
            raise bad(f"classes.{name}.efficiency needs a 'default' entry")
        peaks = {str(k): num(v, f"classes.{name}.peaks.{k}", hi=1e6) for k, v in (c.get("peaks") or {}).items()}
        if peaks and "fp32" not in peaks:
            raise bad(f"classes.{name}.peaks needs an 'fp32' entry")
        full_rate = {str(k): num(v, f"classes.{name}.full_rate_peaks.{k}", hi=1e6)
                     for k, v in (c.get("full_rate_peaks") or {}).items()}
        tensor = {}
        for prec, table in (c.get("tensor_efficiency") or {}).items():
            if not isinstance(table, dict):
                raise bad(f"classes.{name}.tensor_efficiency.{prec} must be an object")
            tensor[str(prec)] = {str(k): num(v, f"classes.{name}.tensor_efficiency.{prec}.{k}", hi=1.0)
                                 for k, v in table.items()}
        classes[str(name)] = GpuClass(
            str(name), tuple(str(p) for p in c["patterns"]), eff,
            num(c.get("memory_efficiency"), f"classes.{name}.memory_efficiency", hi=1.0),
            num(c.get("launch_overhead_s"), f"classes.{name}.launch_overhead_s", hi=1e-2),
            {str(k): float(v) for k, v in (c.get("spec") or {}).items()}, str(c.get("basis", "")),
            peaks, tensor, full_rate)
    if not classes:
        raise bad("no GPU classes")
    related = []
    for name, r in (data.get("related") or {}).items():
        if not isinstance(r, dict) or r.get("class") not in classes or not r.get("patterns"):
            raise bad(f"related.{name} needs 'patterns' and a 'class' among {sorted(classes)}")
        peaks = {str(k): num(v, f"related.{name}.peaks.{k}", hi=1e6) for k, v in (r.get("peaks") or {}).items()}
        if peaks and "fp32" not in peaks:
            raise bad(f"related.{name}.peaks needs an 'fp32' entry")
        sms = num(r["sms"], f"related.{name}.sms", hi=1e4) if "sms" in r else 0.0
        if sms and "fp32" not in peaks:
            raise bad(f"related.{name}.sms needs the reference card's 'peaks' (with 'fp32')")
        related.append((str(name), tuple(str(p) for p in r["patterns"]), str(r["class"]), peaks, sms))
    colls = {}
    for kind in COLLECTIVE_KINDS:
        c = (data.get("collectives") or {}).get(kind)
        if not isinstance(c, dict):
            raise bad(f"collectives.{kind} missing")
        colls[kind] = CollectiveDefaults(num(c.get("bandwidth_efficiency"), f"collectives.{kind}.bandwidth_efficiency",
                                             hi=1.0),
                                         num(c.get("call_latency_s"), f"collectives.{kind}.call_latency_s",
                                             lo=-1e-30, hi=1.0))
    lockstep = data.get("lockstep_per_doubling", 0.0)
    if lockstep != 0.0:
        lockstep = num(lockstep, "lockstep_per_doubling", hi=1.0)
    return GpuProfiles(classes, tuple(related), colls, str(data.get("source", "")), str(data.get("precision", "fp32")),
                       float(lockstep))


@functools.lru_cache(maxsize=1)
def gpu_profiles() -> GpuProfiles:
    """The shipped profiles (read once per process)."""
    return load_gpu_profiles()


def resolve(device_type: str) -> Resolution | None:
    """The shipped class serving DEVICE_TYPE (see the module docstring), or None."""
    return gpu_profiles().resolve(device_type)


def describe_device_type(device_type: str, tf_device_type: str, profile: "Profile | None" = None) -> str:
    """Which profile serves DEVICE_TYPE in the cost model: a profile file's entry, a shipped GPU class,
    or the built-in defaults. PROFILE is the user's profile (None: none given)."""
    if profile is not None and device_type in profile.devices:
        return f"profile entry {device_type}"
    if tf_device_type == "GPU":
        r = resolve(device_type)
        if r is not None:
            return r.label()
    if profile is not None and "default" in profile.devices:
        return "profile entry default"
    return f"built-in {tf_device_type} defaults"
