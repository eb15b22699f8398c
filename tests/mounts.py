"""Real kernel objects for a test: a tmpfs mounted with the options given and unmounted at the
end (root only; skipped, or failed under CI, elsewhere), and a cgroup v1 memory group, made and
removed (with whatever is left in it killed by PID)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Iterator

from tests.conftest import require


@contextlib.contextmanager
def tmpfs(path: str, options: str, label: str = "rgt-test", kind: str = "tmpfs") -> Iterator[str]:
    """``mount -t KIND -o OPTIONS LABEL PATH`` (a tmpfs, or another filesystem held in memory:
    ``ramfs`` refuses O_DIRECT, where a tmpfs takes it); lazily unmounted when the block ends."""
    require(os.geteuid() == 0, f"root, to mount the test's {kind}")
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", kind, "-o", options, label, path],
        capture_output=True,
        text=True,
        timeout=30,
    )
    require(p.returncode == 0, f"mounting a {kind} ({p.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        assert not os.path.ismount(path)


def memory_cgroup(limit: int, name: str) -> str:
    """A cgroup v1 memory group ``name`` with ``limit`` bytes and no swap, or '' when one cannot
    be made here. The caller empties and removes it."""
    path = os.path.join("/sys/fs/cgroup/memory", f"{name}-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(path, "memory.swappiness"), "w") as f:
            f.write("0")
    except OSError:
        return ""
    return path


def remove_cgroup(path: str, timeout: float = 15.0) -> None:
    """Kill, by PID, whatever is left in the group ``path``, then remove it (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(os.path.join(path, "cgroup.procs")) as f:
            left = f.read().split()
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return
        except OSError:
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
