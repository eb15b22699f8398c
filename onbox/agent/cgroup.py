"""What the kernel says about memory: the cgroup's OOM-kill counter, and the kernel log.

cgroup v2 (``memory.events``) and v1 (``memory.oom_control``), each at the path
/proc/self/cgroup names (containers often show only their own cgroup at the mount root).
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Optional

from onbox.health.memory import cgroup_chain

_KMSG_OOM = re.compile(rb"(?:Killed process|oom-kill:.*?\bpid=)\s*(\d+)")


def oom_kill_count() -> Optional[int]:
    """How many processes the OOM killer has killed in our cgroup, or None when unknown. The
    memory probe's reader (onbox/health/memory.py) knows the cgroup files; innermost first."""
    for cg in cgroup_chain(None):
        n = cg.oom_kills()
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
