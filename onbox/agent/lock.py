"""Exactly one agent per run: an flock on ``RUN_DIR/lock``.

The lock is held on an open file description, so it passes from the `start` command to the
agent it spawns (by fd) with no moment when nobody holds it, and it dies with its holder, so a
killed agent never leaves a stale lock. The fd is close-on-exec: the job never inherits it.
The file holds the holder's host, pid and start time so a refused `start` can name it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from onbox.agent import procfs
from onbox.common.errors import LockedError

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Any, Dict, Optional


# What a holder is doing, in its record: only an "agent" whose signal handlers are in place
# reads the mailbox on SIGUSR2; it would kill a `sync` sealing with no agent, or a process
# still "starting" (a `start` about to hand the lock over, an agent restoring): a stop waits.
ROLES = ("agent", "starting", "sync")
# The remedy of a refused lock, as the box says it; the laptop's `rgt deploy` puts its own
# commands in its place (controller/deploy/boxstart.py).
HELD_REMEDY = "that agent is supervising it; use `rgt-agent status {run}` or `rgt-agent stop {run}`"


def _record(role: str) -> Dict[str, Any]:
    ident = procfs.identity(os.getpid())
    return {
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "start_ticks": ident.start_ticks if ident else None,
        "since": time.time(),
        "role": role,
    }


def read_holder(path: str) -> Optional[Dict[str, Any]]:
    """The record the holder wrote, or None."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        rec = json.loads(raw) if raw.strip() else None
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def describe(rec: Optional[Dict[str, Any]]) -> str:
    if not rec:
        return "another process (it has not written its record yet)"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec.get("since", 0)))
    return f"rgt-agent pid {rec.get('pid')} on {rec.get('host')} since {since}"


class RunLock:
    """An acquired run lock; ``fd`` may be handed to a child process that keeps it."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, path: str, run: str, role: str = "starting") -> RunLock:
        """Take the lock now (as ``role``, one of ROLES) or raise LockedError naming the
        holder."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # A few tries: `is_held` probes take the lock shared for a few microseconds.
        for _ in range(5):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.01)
        else:
            os.close(fd)
            # The winner writes its record right after it wins; give it a moment.
            rec = None
            for _ in range(20):
                rec = read_holder(path)
                if rec:
                    break
                time.sleep(0.01)
            raise LockedError(
                f"run {run!r} is held by {describe(rec)}",
                HELD_REMEDY.format(run=run),
            ) from None
        lock = cls(fd, path)
        lock.write_record(role)
        return lock

    @classmethod
    def adopt(cls, fd: int, path: str) -> RunLock:
        """Keep a lock fd handed over by the parent; make it close-on-exec again."""
        os.set_inheritable(fd, False)
        lock = cls(fd, path)
        lock.write_record("starting")
        return lock

    def write_record(self, role: str) -> None:
        assert role in ROLES, role
        data = json.dumps(_record(role)).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def is_held(path: str) -> bool:
    """Whether some process holds the lock right now (probes with a shared lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
