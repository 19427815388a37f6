"""What each testbed host gets from the machine: CPU shares, a CFS quota, the CPUs it is pinned to.

``tag_bench.testbed`` parses a ``Testbed``'s per-host options here and packs the quotas onto the machine's
CPUs (``pack_quotas``); the cgroups themselves are made there.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from typing import TYPE_CHECKING, Mapping, Sequence

from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover
    from tag.cluster.topology import Host

CGROUP_CPUSET = "/sys/fs/cgroup/cpuset"


class TestbedError(TagError):
    """The testbed cannot be built here (not root, no iproute2, no namespaces) or a step failed."""

    __test__ = False  # not a pytest test class


def _per_host(option: str, given, hosts: Sequence["Host"], default) -> dict:
    """Host name -> value of OPTION, from a mapping by host name (missing: DEFAULT) or a list in host order."""
    names = [h.name for h in hosts]
    if isinstance(given, Mapping):
        unknown = [k for k in given if k not in names]
        if unknown:
            raise TestbedError(f"{option} names unknown hosts {unknown}; known hosts: {', '.join(names)}")
        return {n: given.get(n, default) for n in names}
    values = list(given)
    if len(values) != len(names):
        raise TestbedError(f"{option} has {len(values)} entries for {len(names)} hosts")
    return dict(zip(names, values, strict=True))


def parse_shares(cpu_shares, hosts: Sequence["Host"]) -> dict[str, int] | None:
    if cpu_shares is None:
        return None
    shares = {n: int(v) for n, v in _per_host("cpu_shares", cpu_shares, hosts, 1024).items()}
    bad = {n: s for n, s in shares.items() if not 2 <= s <= 262144}
    if bad:
        raise TestbedError(f"cpu shares must be in [2, 262144] (1024 = one normal share): {bad}")
    return shares


def parse_quota(cpu_quota, hosts: Sequence["Host"]) -> dict[str, float | None] | None:
    """host name -> cores (None: unlimited) from a mapping or a list in host order."""
    if cpu_quota is None:
        return None
    quota = _per_host("cpu_quota", cpu_quota, hosts, None)
    out: dict[str, float | None] = {}
    for n, q in quota.items():
        if q is None:
            out[n] = None
            continue
        q = float(q)
        if not 0.01 <= q <= 1024:
            raise TestbedError(f"cpu quota of host {n!r} must be in [0.01, 1024] cores, got {q}")
        out[n] = q
    return out


def pack_quotas(quotas: Mapping[str, float], cpus: Sequence[int]) -> dict[str, str] | None:
    """host -> CPU list ("0", "2,3") that packs QUOTAS (host -> cores) onto CPUS so that no CPU carries more
    than one core of quota: largest quota first, each on the least-loaded CPUs (a quota q above one core takes
    ceil(q) CPUs, q / ceil(q) on each); None when they do not fit."""
    load = {c: 0.0 for c in cpus}
    out: dict[str, str] = {}
    for name, q in sorted(quotas.items(), key=lambda kv: (-kv[1], kv[0])):
        k = max(1, math.ceil(q - 1e-9))
        chosen = sorted(load, key=lambda c: (load[c], c))[:k]
        if len(chosen) < k or any(load[c] + q / k > 1.0 + 1e-9 for c in chosen):
            return None
        for c in chosen:
            load[c] += q / k
        out[name] = ",".join(str(c) for c in sorted(chosen))
    return out


def parse_pinning(cpu_pinning, cpu_quota: dict | None, hosts: Sequence["Host"]) -> dict[str, str | None]:
    """host name -> CPU list (None: not pinned) from "auto", "off", a mapping or a list in host order."""
    if isinstance(cpu_pinning, str):
        if cpu_pinning == "off":
            return {}
        if cpu_pinning != "auto":
            raise TestbedError(f"cpu_pinning must be 'auto', 'off', or CPU lists per host, got {cpu_pinning!r}")
        quotas = {n: q for n, q in (cpu_quota or {}).items() if q is not None}
        if not quotas:
            return {}
        if not os.path.isfile(os.path.join(CGROUP_CPUSET, "cpuset.cpus")):   # run unpinned, as before pinning
            warnings.warn(f"no cgroup v1 cpuset controller at {CGROUP_CPUSET}: hosts are not pinned",
                          RuntimeWarning, stacklevel=3)
            return {}
        cpus = sorted(os.sched_getaffinity(0))
        packed = pack_quotas(quotas, cpus)
        if packed is None:
            warnings.warn(f"cpu quotas {sorted(quotas.values(), reverse=True)} do not pack onto this machine's "
                          f"{len(cpus)} CPUs at one core each: hosts are not pinned", RuntimeWarning, stacklevel=3)
            return {}
        return packed
    given = _per_host("cpu_pinning", cpu_pinning, hosts, None)
    for n, c in given.items():
        if c is not None and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(c)):
            raise TestbedError(f"cpu_pinning of host {n!r} must be a CPU list such as '0' or '1-3,5', got {c!r}")
    return {n: (None if c is None else str(c)) for n, c in given.items()}
