"""A spy on the system calls that make a directory entry durable, for the tests that check it.

No crash can be simulated for real here (no device-mapper to drop unflushed writes), so the
tests check the order of the real calls instead: every ``mkdir`` is wrapped, and so are
``fsync``, ``replace``/``rename`` and ``link``, each recording the absolute path it acted on
(a descriptor resolved through /proc/self/fd) in the order the calls were made (an fsync is
recorded as it starts; the others as they are done, under the lock that orders the record).
A directory is durable once its parent has been fsynced after it was made (POSIX; ext4's
journal happens to order it, a network or FUSE mount need not).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, Optional, Tuple

import pytest


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _at(path: Any, dir_fd: Optional[int]) -> str:
    name: str = os.fsdecode(path)
    if dir_fd is None or os.path.isabs(name):
        return os.path.realpath(os.path.abspath(name))
    return os.path.join(_fd_path(dir_fd), name)


class DirSyncSpy:
    """The mkdir, fsync, rename and link calls of this process, in order, while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: List[Tuple[str, str]] = []
        self._lock = threading.Lock()
        real_mkdir, real_fsync = os.mkdir, os.fsync
        real_replace, real_rename, real_link = os.replace, os.rename, os.link

        def record(kind: str, path: str) -> None:
            with self._lock:
                self.events.append((kind, path))

        # The call and its record are made under one lock: the sealer's puts make directories
        # from several threads, and a record taken after the lock was let go could land behind
        # another thread's mkdir of a directory inside it (or its parent's fsync).
        def mkdir(path: Any, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> None:
            with self._lock:
                real_mkdir(path, mode, dir_fd=dir_fd)
                self.events.append(("mkdir", _at(path, dir_fd)))

        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            record("fsync", _fd_path(fd))
            real_fsync(fd)

        def renaming(real: Callable[..., None], kind: str) -> Callable[..., None]:
            def call(
                src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None, **kw: Any
            ) -> None:
                with self._lock:
                    real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **kw)
                    self.events.append((kind, _at(dst, dst_dir_fd)))

            return call

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", renaming(real_replace, "rename"))
        monkeypatch.setattr(os, "rename", renaming(real_rename, "rename"))
        monkeypatch.setattr(os, "link", renaming(real_link, "link"))

    def made(self, under: str) -> List[str]:
        """The directories made beneath ``under`` (or ``under`` itself), in order."""
        under = os.path.realpath(under)
        return [
            p
            for k, p in self.events
            if k == "mkdir" and (p == under or p.startswith(under + os.sep))
        ]

    def not_durable(self, under: str, before: Optional[str] = None, skip: str = "\0") -> List[str]:
        """Directories made beneath ``under`` whose parent was not fsynced after the mkdir (and,
        with ``before``, ahead of the first rename or link onto that path); names containing
        ``skip`` (a stage removed afterwards) are not asked about."""
        end = len(self.events)
        if before is not None:
            target = os.path.realpath(before)
            end = next(
                (
                    i
                    for i, (k, p) in enumerate(self.events)
                    if k != "mkdir" and k != "fsync" and p == target
                ),
                end,
            )
        out = []
        for i, (kind, path) in enumerate(self.events[:end]):
            if kind != "mkdir" or skip in path:
                continue
            under_r = os.path.realpath(under)
            if path != under_r and not path.startswith(under_r + os.sep):
                continue
            parent = os.path.dirname(path)
            if ("fsync", parent) not in self.events[i + 1 : end]:
                out.append(path)
        return out

    def unsynced_names(self, under: str, before: str) -> List[str]:
        """Names renamed or linked into place beneath ``under`` (temporary names aside) whose
        directory was not fsynced after the rename and ahead of the first rename or link onto
        ``before`` (the MANIFEST that names them)."""
        under_r, target = os.path.realpath(under), os.path.realpath(before)
        end = next(
            (i for i, (k, p) in enumerate(self.events) if k in ("rename", "link") and p == target),
            len(self.events),
        )
        out = []
        for i, (kind, path) in enumerate(self.events[:end]):
            if kind not in ("rename", "link") or ".rgt-tmp." in path:
                continue
            if not path.startswith(under_r + os.sep):
                continue
            if ("fsync", os.path.dirname(path)) not in self.events[i + 1 : end]:
                out.append(path)
        return out
