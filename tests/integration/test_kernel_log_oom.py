"""The kernel log as OOM evidence, read from the real /dev/kmsg: only records after the attempt's
mark count. pid_max is often 32768, so a box reuses pids within hours, and the ring buffer still
holds the OOM kill of an earlier process with the job's pid (a clean-clone CI run classified an
outside SIGKILL as ``oom_killed`` this way). The records written here name pids above any
pid_max (2**22), so they name no process of this machine.
"""

from __future__ import annotations

import os

from onbox.agent import cgroup
from tests.conftest import require

PID_MAX_LIMIT = 1 << 22  # the kernel's ceiling for pid_max


def _log(line: str) -> None:
    with open("/dev/kmsg", "w") as f:
        f.write(line + "\n")


def _kmsg_writable() -> bool:
    return os.access("/dev/kmsg", os.R_OK | os.W_OK) and cgroup.kernel_log_mark() is not None


def test_an_oom_record_from_before_the_mark_does_not_name_a_later_process() -> None:
    require(_kmsg_writable(), "root and a readable, writable /dev/kmsg")
    pid = PID_MAX_LIMIT + 1000 + os.getpid()
    _log(f"rgt test: Out of memory: Killed process {pid} (python3) total-vm:1kB")
    mark = cgroup.kernel_log_mark()
    assert not cgroup.kernel_says_oom_killed([pid], after=mark)
    _log(f"rgt test: oom-kill:constraint=CONSTRAINT_MEMCG,task=python3,pid={pid},uid=0")
    assert cgroup.kernel_says_oom_killed([pid], after=mark)
    assert not cgroup.kernel_says_oom_killed([pid + 1], after=mark)


def test_no_mark_is_no_evidence() -> None:
    """A mark the agent could not take (the log unreadable at the attempt's start, or a state
    written by an older agent) says nothing: the whole log is never read as this attempt's."""
    require(_kmsg_writable(), "root and a readable, writable /dev/kmsg")
    pid = PID_MAX_LIMIT + 2000 + os.getpid()
    _log(f"rgt test: Out of memory: Killed process {pid} (python3) total-vm:1kB")
    assert not cgroup.kernel_says_oom_killed([pid], after=None)
