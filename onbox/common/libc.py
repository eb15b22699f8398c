"""The C library's functions that Python's ``os`` module lacks (``sync_file_range``, and
``syscall`` for calls libc has no wrapper of, such as ``openat2``), loaded through ctypes on
Linux only. Callers treat None as "not here" and do without.

Standard library only and Python 3.9: the agent imports it on the box, the laptop through onbox.
"""

from __future__ import annotations

import sys
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
