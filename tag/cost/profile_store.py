"""Where cost profiles live by default: ``$TAG_PROFILE``, else the user cache directory.

``tag-profile`` writes there and ``tag-deploy`` reads from there when no ``--profile`` is given.
No TensorFlow import: the library and the CLIs find the profile without loading the profiler.

Example::

    from tag.cost.profile_store import default_profile_path, load_default_profile

    print(default_profile_path())        # e.g. ~/.cache/tag/profile.json
    prof = load_default_profile()        # a tag.cost.Profile, or None when nothing is profiled yet
"""
from __future__ import annotations

import os

from tag.cost.profile import Profile
from tag.errors import TagError

PROFILE_ENV = "TAG_PROFILE"


def default_profile_path() -> str:
    """Where profiles are written and read by default: ``$TAG_PROFILE``, else the user cache directory
    (``$XDG_CACHE_HOME/tag/profile.json``, ``~/.cache/tag/profile.json`` when that is unset)."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tag", "profile.json")


def load_default_profile() -> "Profile | None":
    """The profile at ``default_profile_path()``, or None when there is none.

    ``$TAG_PROFILE`` naming a missing or bad file is an error (the user asked for it); a missing
    file at the cache location just means "not profiled yet".
    """
    path = default_profile_path()
    if not os.path.exists(path):
        if os.environ.get(PROFILE_ENV):
            raise TagError(f"{path}: profile named by ${PROFILE_ENV} does not exist")
        return None
    return Profile.load(path)
