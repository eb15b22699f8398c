"""Pid reuse on demand: an unrelated process (``setsid sleep``, no rgt tag, nothing of the test's
environment) started with exactly the pid of a process that has ended, through
/proc/sys/kernel/ns_last_pid (root only; skipped, or failed under CI, elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

from onbox.agent import procfs
from tests.conftest import require

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"

# Forks until a child gets the pid asked for (other processes fork too), makes that child a
# session and group leader running sleep, prints its pid once it leads them, and reaps it: the
# squatter never outlives its parent by more than SECS, and never becomes anybody's zombie.
_TAKER = r"""
import os, sys
target, secs = int(sys.argv[1]), sys.argv[2]
for _ in range(2000):
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(target - 1))
    except OSError as e:
        print("ns_last_pid:", e, flush=True)
        sys.exit(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if os.getpid() != target:
            os._exit(0)
        os.setsid()
        os.write(w, b"x")  # a session leader now: only then is it handed to the test
        os.execve("/bin/sleep", ["sleep", secs], {"PATH": "/usr/bin:/bin"})
    os.close(w)
    if pid == target:
        os.read(r, 1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        sys.exit(0)
    os.close(r)
    os.waitpid(pid, 0)
print("pid", target, "was never handed out", flush=True)
sys.exit(1)
"""


@contextlib.contextmanager
def squatter(target: int, secs: int = 60) -> Iterator[procfs.Identity]:
    """An unrelated session leader with pid ``target`` (which must be free) for the block; killed
    by that identity when the block ends, and its parent waited for."""
    require(os.geteuid() == 0 and os.access(NS_LAST_PID, os.W_OK), f"root, to write {NS_LAST_PID}")
    taker = subprocess.Popen(
        [sys.executable, "-c", _TAKER, str(target), str(secs)],
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        text=True,
    )
    ident = None
    try:
        assert taker.stdout is not None
        line = taker.stdout.readline().strip()
        require(line == str(target), f"pid {target} handed out again ({line or taker.wait(5)})")
        ident = procfs.identity(target)
        assert ident is not None
        yield ident
    finally:
        if ident is not None and procfs.is_alive(ident):
            os.kill(ident.pid, signal.SIGKILL)
        try:
            taker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            taker.kill()
            taker.wait()
        if taker.stdout is not None:
            taker.stdout.close()
