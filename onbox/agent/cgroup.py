"""What the kernel says about memory: the cgroup's OOM-kill counter, and the kernel log.

cgroup v2 (``memory.events``) and v1 (``memory.oom_control``), each at the path
/proc/self/cgroup names (containers often show only their own cgroup at the mount root).
"""

from __future__ import annotations

import os
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable, Iterator, Optional

ROOT = "/sys/fs/cgroup"
_KMSG_OOM = re.compile(rb"(?:Killed process|oom-kill:.*?\bpid=)\s*(\d+)")


def _own_paths() -> Iterator[str]:
    """Files that hold this process's OOM-kill count, most specific first."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "":
            for mount in (ROOT, os.path.join(ROOT, "unified")):
                yield os.path.join(mount, rel, "memory.events")
        elif "memory" in parts[1].split(","):
            yield os.path.join(ROOT, "memory", rel, "memory.oom_control")
    yield os.path.join(ROOT, "memory.events")
    yield os.path.join(ROOT, "memory", "memory.oom_control")


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
    for path in _own_paths():
        n = _read_key(path, "oom_kill")
        if n is not None:
            return n
    return None


def kernel_says_oom_killed(pids: Iterable[int]) -> bool:
    """Whether the kernel log says the OOM killer killed one of ``pids``.

    Reads /dev/kmsg without blocking (root or CAP_SYSLOG; False where it is not readable).
    """
    wanted = {str(p).encode() for p in pids}
    if not wanted:
        return False
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False
            except OSError:  # EPIPE: the ring buffer overwrote what we were about to read
                continue
            if not record:
                return False
            for m in _KMSG_OOM.finditer(record):
                if m.group(1) in wanted:
                    return True
    finally:
        os.close(fd)
