"""Cost profiles on the command line: read them safely, merge several device types, say which served what.

A profile (``tag.cost.model.Profile``) has one entry per device type ("CPU", "V100", ...) and may have a
"default" entry. For a mixed cluster each device type is profiled on its own machine (``tag-profile
--device-type V100 --json v100.json`` there, ``--device-type 1080Ti`` on another) and the files are merged
into one (``merge_profiles``; ``tag-profile --merge v100.json 1080ti.json --json lab.json``). A device type
of the topology is served by the profile entry of the same name, else by the profile's "default" entry,
else by the built-in defaults; ``profile_use`` says which for every device type of a topology, and
``profile_warning`` says when a profile serves none of them (a profile made for another cluster).
Profiles are read through ``tag.files.read_input_file`` (regular files only, size limit).

Example::

    from tag.cli.profiles import merge_profiles, profile_use, read_profile
    merged, notes = merge_profiles([("v100.json", read_profile("v100.json")),
                                    ("gtx.json", read_profile("gtx.json"))])
    profile_use(merged, "lab.json", topology)   # {"V100": "lab.json entry 'V100'", "P100": "built-in defaults", ...}
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tag.cluster.topology import Topology
    from tag.cost.model import Profile

MAX_PROFILE_BYTES = 64 << 20
BUILTIN = "built-in defaults"


def read_profile(path: str | os.PathLike) -> "Profile":
    """The profile at PATH; TagError naming PATH when it is missing, special, too large or malformed."""
    from tag.cost.model import Profile
    from tag.files import decode_json, read_input_file
    path = os.fspath(path)
    data = read_input_file(path, what="cost profile (JSON)", limit=MAX_PROFILE_BYTES)
    parsed = decode_json(data, path, not_text="profile is not UTF-8 text", not_json="profile is not valid JSON")
    return Profile.from_dict(parsed, where=path)


def load_profile_arg(path: str | None) -> tuple["Profile | None", str | None]:
    """(profile, where it came from) for ``--profile PATH``; without PATH the default location
    (``$TAG_PROFILE``, else the user cache) when a profile is there, else (None, None)."""
    from tag.cost.profile_store import PROFILE_ENV, default_profile_path
    if path is not None:
        return read_profile(path), path
    default = default_profile_path()
    if not os.path.exists(default):
        if os.environ.get(PROFILE_ENV):
            raise TagError(f"{default}: profile named by ${PROFILE_ENV} does not exist")
        return None, None
    return read_profile(default), default


def merge_profiles(items: Sequence[tuple[str, "Profile"]]) -> tuple["Profile", list[str]]:
    """One profile holding the device types of every (path, profile) in ITEMS, and notes for the user.

    A device type in two files is an error unless both entries are equal; the network figures
    (``tag-profile --network``) are taken from the first file that has them (a note names the others)."""
    from tag.cost.model import Profile
    if len(items) < 2:
        raise TagError("--merge needs at least two profile files")
    devices, origin, notes = {}, {}, []
    network, network_from = None, None
    for path, prof in items:
        for dtype, entry in prof.devices.items():
            if dtype in devices and devices[dtype].to_dict() != entry.to_dict():
                raise TagError(f"{origin[dtype]} and {path} both describe device type {dtype!r} with different "
                               f"numbers: merge profiles of different device types (tag-profile --device-type)")
            devices.setdefault(dtype, entry)
            origin.setdefault(dtype, path)
        if prof.network is not None:
            if network is None:
                network, network_from = prof.network, path
            elif prof.network != network:
                notes.append(f"network figures from {network_from}; those of {path} are not used")
    source = "merged: " + "; ".join(f"{path} ({', '.join(sorted(p.devices)) or 'no devices'})" for path, p in items)
    return Profile(devices, source, network=network), notes


def profile_use(profile: "Profile | None", source: str | None, topology: "Topology") -> dict[str, str]:
    """Device type of TOPOLOGY -> what serves it: ``"SOURCE entry 'TYPE'"``, ``"SOURCE entry 'default'"``
    or ``"built-in defaults"`` (``tag.cost.model.CostModel`` applies them in that order)."""
    out: dict[str, str] = {}
    for group in topology.groups:
        if group.device_type in out:
            continue
        entry, exact = (None, False) if profile is None else profile.entry_for(group.device_type)
        if entry is None:
            out[group.device_type] = BUILTIN
        else:
            out[group.device_type] = f"{source or 'profile'} entry '{group.device_type if exact else 'default'}'"
    return out


def profile_warning(profile: "Profile | None", source: str | None, topology: "Topology") -> str | None:
    """A one-line warning when PROFILE serves no device type of TOPOLOGY (else None)."""
    if profile is None:
        return None
    use = profile_use(profile, source, topology)
    if any(v != BUILTIN for v in use.values()):
        return None
    have = ", ".join(sorted(profile.devices)) or "no device types"
    return (f"profile {source} matches no device type of {topology.name} ({', '.join(use)}); it has {have}: "
            f"built-in defaults are used (profile those types with tag-profile --device-type, or merge "
            f"profiles with tag-profile --merge)")
