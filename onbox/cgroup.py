"""What the box's cgroup says about memory: the OOM-kill counter, and the memory limit.

cgroup v2 first (``memory.events``), then v1 (``memory.oom_control``). Containers often show
only their own cgroup at /sys/fs/cgroup; elsewhere /proc/self/cgroup names the path.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

ROOT = "/sys/fs/cgroup"


def _own_v2_dirs() -> Iterator[str]:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    yield os.path.join(ROOT, parts[2].lstrip("/"))
    except OSError:
        pass
    yield ROOT


def _read_key(path: str, key: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        return None
    return None


def oom_kill_count() -> Optional[int]:
    """How many processes the OOM killer has killed in our cgroup, or None when unknown."""
    for d in _own_v2_dirs():
        n = _read_key(os.path.join(d, "memory.events"), "oom_kill")
        if n is not None:
            return n
    return _read_key(os.path.join(ROOT, "memory", "memory.oom_control"), "oom_kill")
