"""Platform profiles: what rgt knows about each platform users rent from (profiles/*.toml,
shipped as package data in onbox/profiles/data), loaded and checked against the schema.

The profiles wing imports only the ground floor (onbox.common); the agent and the controller
read profiles through ``load`` and act on the values (grace, job environment, default store,
preemption notice, boot hook, meter-stop verb, danger clocks).
"""

from onbox.profiles.load import load, load_all, names, user_dirs
from onbox.profiles.schema import Profile, ProfileError

__all__ = ["Profile", "ProfileError", "load", "load_all", "names", "user_dirs"]
