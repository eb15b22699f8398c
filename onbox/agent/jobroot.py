"""Reading the job's files from another container: a pod's outputs through ``/proc/PID/root``.

In a pod (onbox/agent/podrunner.py) the job's workdir lives in the job container's filesystem,
which the agent's container does not have; with a shared PID namespace the kernel shows it at
``/proc/<launcher pid>/root``. Everything there is written by the job, so it is untrusted, and a
symlink in it is dangerous twice over: the kernel resolves an absolute target (``/etc/...``)
and a climbing one (``../../..``) from the *agent's* root, so following it would seal the
agent's own files (its store credentials) as the job's outputs.

So nothing here lets the kernel follow a link. ``JobFiles`` walks every path one component at
a time from a descriptor of the job's root, each directory opened ``O_NOFOLLOW | O_DIRECTORY``
relative to the one before; a symlink is resolved here, as the kernel would inside that root
(``RESOLVE_IN_ROOT``: an absolute target starts at the job's root, ``..`` stops there); and an
output whose resolved path leaves the job's workdir is refused, said why. Inside a directory
output a symlink or a non-regular file is refused, never followed. What is read is a
descriptor opened that way, handed to the uploader as ``/proc/self/fd/N``: the bytes are those
of the very file that was checked, whatever the job container renames meanwhile.

Standard library only; Python 3.9.
"""

from __future__ import annotations

import os
import stat
from typing import Callable, Iterator, List, Optional, Tuple

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under an output name must not hang the agent in open().
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_REG = "it is not a regular file or a directory"
MAX_LINKS = 40  # the kernel's own limit on symlinks in one resolution

Refuse = Callable[[str, str], None]  # (the output's path, why): the caller's event


class Refused(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _parts(path: str) -> List[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


class JobFiles:
    """The job's files under ``root`` (``/proc/PID/root``), walked without following links."""

    def __init__(self, root: str, workdir: str, refuse: Refuse) -> None:
        self.root = root
        self.refuse = refuse
        self.workdir = workdir
        self._base: Optional[List[str]] = None  # the workdir's own path, resolved in the root

    def _resolve(self, path: str) -> Tuple[List[int], List[str], Optional[int]]:
        """``path`` (absolute, as the job sees it) resolved in the job's root: the directory
        descriptors walked (the caller closes them), the link-free components, and the final
        file's descriptor (None when the path is a directory). FileNotFoundError when it does
        not exist; Refused when it cannot be read safely."""
        stack = [os.open(self.root, _DIR & ~os.O_NOFOLLOW)]  # the magic link itself, on purpose
        parts: List[str] = []
        todo = _parts(path)
        links = 0
        try:
            while todo:
                name = todo.pop(0)
                if name == "..":
                    if parts:  # at the root '..' stays there, as inside a chroot
                        os.close(stack.pop())
                        parts.pop()
                    continue
                st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise Refused(f"more than {MAX_LINKS} symlinks on the way")
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):  # from the job's root, not the agent's
                        for fd in stack[1:]:
                            os.close(fd)
                        del stack[1:], parts[:]
                    todo = _parts(target) + todo
                elif stat.S_ISDIR(st.st_mode):
                    stack.append(os.open(name, _DIR, dir_fd=stack[-1]))
                    parts.append(name)
                elif todo:
                    raise FileNotFoundError(path)  # a file where the path needs a directory
                elif stat.S_ISREG(st.st_mode):
                    fd = _open_file(name, stack[-1])
                    return stack, parts + [name], fd
                else:
                    raise Refused(_NOT_REG)
            return stack, parts, None
        except OSError as e:
            _close(stack)
            if isinstance(e, FileNotFoundError):
                raise
            raise Refused(f"it could not be read safely ({e.strerror or e})") from None
        except Refused:
            _close(stack)
            raise

    def _workdir(self) -> List[str]:
        if self._base is None:
            stack, self._base, fd = self._resolve(self.workdir)
            _close(stack + ([] if fd is None else [fd]))
        return self._base

    def output(self, rel: str) -> Optional[Iterator[Tuple[str, str]]]:
        """The files of the declared output ``rel`` (under the workdir) as (a path that reads
        the checked file, its name relative to the workdir); None when it does not exist; an
        empty iterator when it is refused (``refuse`` said why). The descriptors are open
        while the iterator runs: consume it (uploading each file) before the next."""
        try:
            base = self._workdir()
            stack, parts, fd = self._resolve("/".join(["", *base, rel]))
        except FileNotFoundError:
            return None
        except Refused as e:
            self.refuse(rel, e.why)
            return iter(())
        if parts[: len(base)] != base:
            _close(stack + ([] if fd is None else [fd]))
            where = "/" + "/".join(parts)
            self.refuse(rel, f"it resolves to {where} in the job container, outside its workdir")
            return iter(())
        return self._files(stack, fd, rel)

    def _files(self, stack: List[int], fd: Optional[int], rel: str) -> Iterator[Tuple[str, str]]:
        try:
            if fd is not None:
                yield f"/proc/self/fd/{fd}", rel
            else:
                yield from self._walk(stack[-1], rel.rstrip("/"))
        finally:
            _close(stack + ([] if fd is None else [fd]))

    def _walk(self, dfd: int, rel: str) -> Iterator[Tuple[str, str]]:
        for name in sorted(os.listdir(dfd)):
            r = f"{rel}/{name}"
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    sub = os.open(name, _DIR, dir_fd=dfd)
                    try:
                        yield from self._walk(sub, r)
                    finally:
                        os.close(sub)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    link = stat.S_ISLNK(st.st_mode)
                    self.refuse(r, "it is a symlink (never followed)" if link else _NOT_REG)
                    continue
                fd = _open_file(name, dfd)
            except Refused as e:
                self.refuse(r, e.why)
                continue
            except OSError as e:  # it changed under us (replaced by a link, removed)
                self.refuse(r, f"it could not be read safely ({e.strerror or e})")
                continue
            try:
                yield f"/proc/self/fd/{fd}", r
            finally:
                os.close(fd)


def _open_file(name: str, dfd: int) -> int:
    fd = os.open(name, _FILE, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
        os.close(fd)
        raise Refused(_NOT_REG)
    return fd


def _close(fds: List[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
