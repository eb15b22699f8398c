"""What the kernel says about memory: the cgroup's OOM-kill counter, and the kernel log.

cgroup v2 (``memory.events``) and v1 (``memory.oom_control``), each at the path
/proc/self/cgroup names (containers often show only their own cgroup at the mount root).
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Iterator, Optional, Tuple

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


def _kernel_log() -> Iterator[Tuple[int, bytes]]:
    """The kernel log's records as (sequence number, text), oldest first, read from /dev/kmsg
    without blocking (root or CAP_SYSLOG; nothing where it is not readable)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return
            except OSError:  # EPIPE: the ring buffer overwrote what we were about to read
                continue
            if not record:
                return
            # "prio,seq,usec,flags[,...];text": the sequence number is never reused
            head, _, text = record.partition(b";")
            fields = head.split(b",")
            if len(fields) > 1 and fields[1].isdigit():
                yield int(fields[1]), text
    finally:
        os.close(fd)


def kernel_log_mark() -> Optional[int]:
    """The sequence number of the kernel log's newest record, or None where the log cannot be
    read: the OOM kills recorded after it are an attempt's (see ``kernel_says_oom_killed``)."""
    mark: Optional[int] = None
    for seq, _ in _kernel_log():
        mark = seq
    return mark


def kernel_says_oom_killed(pids: Iterable[int], after: Optional[int]) -> bool:
    """Whether a kernel log record after the mark ``after`` says the OOM killer killed one of
    ``pids``; never without a mark.

    Only records after the mark: pid_max is often 32768, so a box reuses pids within hours, and
    the ring buffer still holds the OOM kill of an earlier process that had the job's pid.
    """
    wanted = {str(p).encode() for p in pids}
    if not wanted or after is None:
        return False
    for seq, text in _kernel_log():
        if seq > after and any(m.group(1) in wanted for m in _KMSG_OOM.finditer(text)):
            return True
    return False
