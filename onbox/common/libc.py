"""The C library's functions that Python's ``os`` module lacks (``sync_file_range``, and
``syscall`` for calls libc has no wrapper of, such as ``openat2`` and ``ioprio_set``), loaded
through ctypes on Linux only. Callers treat None as "not here" and do without.

Standard library only and Python 3.9: the agent imports it on the box, the laptop through onbox.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Optional


def linux_function(name: str) -> Optional[Any]:
    """libc's ``name`` as a ctypes function (errno kept for ``ctypes.get_errno``), or None off
    Linux, without ctypes, or where libc has no such function. The caller sets its argtypes
    and restype."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (ImportError, OSError, AttributeError):
        return None


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the syscall's number; libc has no wrapper


def lower_thread_priority() -> None:
    """The calling thread yields CPU and disk to the rest of the process and the machine
    (nice 10, IO best-effort level 7): the agent's sealing thread, beside the job. Where
    either cannot be set, it stays as it is."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 10)
    except OSError:
        pass
    nr = _IOPRIO_SET.get(os.uname().machine)
    syscall = linux_function("syscall") if nr is not None else None
    if syscall is not None:
        syscall(nr, 1, tid, (2 << 13) | 7)  # IOPRIO_WHO_PROCESS (a thread id), BE class, 7
