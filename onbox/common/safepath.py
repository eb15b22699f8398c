"""One gate for every path that comes from outside: a box, a store, a manifest.

The laptop treats the box as untrusted input, and the box treats the store the same way: a name
the box prints (``find`` output, ``spec.json``) or a store holds (a key, a MANIFEST path) decides
where bytes land only after ``safe_rel`` has accepted it as a plain relative path. Nothing is
normalised: a name that would need it (``a/./b``, ``a//b``, ``a/../b``) is not one rgt writes,
so it is refused, never reinterpreted.

The file helpers then walk such a path under a directory the caller trusts (a pull's DEST,
restore's target, a ``file://`` store's root) one component at a time, each directory opened
``O_NOFOLLOW | O_DIRECTORY`` relative to the one before, and open or rename the last component
through that directory's descriptor with ``O_NOFOLLOW``. A symlink on the way, or under the
final name, planted in the target or in the store, is refused (``UnsafePath``, exit 6) instead
of followed; the base directory itself is the caller's and may be a symlink (a user's ``--to``).
Where the kernel has ``openat2`` (Linux 5.6+), the directories under the base are opened in
that one call, with every symlink on the way refused by the kernel (``RESOLVE_NO_SYMLINKS``)
and nothing outside the base reachable (``RESOLVE_BENEATH``): the same walk, one system call
instead of two per component (a seal of 10,000 small files to a ``file://`` store walks 10,000
keys). Whatever it refuses or cannot do (a missing directory to make, a symlink to name, an
older kernel, a sandbox that forbids the call) goes the component-by-component way.

Standard library only and Python 3.9: the agent imports it on the box, the laptop through onbox.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Callable, List, Optional, Tuple

from onbox.common.durable import sha256_fd
from onbox.common.errors import IntegrityError
from onbox.common.libc import linux_function

MAX_COMPONENT = 255  # bytes: NAME_MAX of every filesystem a box or a laptop runs on
MAX_TOTAL = 4096  # bytes: PATH_MAX
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_REMEDY = "rgt never writes such a name: whatever supplied it (the box, the store) is damaged"


class UnsafePath(IntegrityError):
    """A path was refused: not a plain relative one, or a symlink where rgt would write or read.

    ``path`` is the path concerned, as given."""

    def __init__(self, what: str, path: str, remedy: Optional[str] = _REMEDY) -> None:
        super().__init__(what, remedy)
        self.path = path


class NotRegularFile(IntegrityError):
    """A file to be read is no regular file (a symlink, a FIFO, a socket, a device)."""


def file_kind(mode: int) -> Optional[str]:
    """What a non-regular file of ``mode`` (an lstat's) is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), f"of mode {mode:o}")


_OWN_FD = re.compile(r"/proc/self/fd/[0-9]+\Z")


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, for reading a file found by a
    listing: never through a symlink under its name (O_NOFOLLOW), never blocking on the open
    (O_NONBLOCK: a FIFO would wait for a writer forever), and only a regular file (fstat), so
    a name swapped for something else since it was listed is NotRegularFile, not read. A
    ``/proc/self/fd/N`` is this process's own descriptor, opened with those checks already
    (onbox/agent/jobroot.py: a pod's outputs): reopened through its link, as it must be."""
    own = _OWN_FD.match(path) is not None
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if own else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            kind: Optional[str] = "a symlink"
        elif e.errno == errno.ENXIO:  # what opening a Unix socket gives
            kind = "a socket"
        else:
            raise
    else:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is None:
            return fd
        os.close(fd)
    raise NotRegularFile(
        f"{_show(path)} is {kind}, not a regular file",
        "only regular files are read: it was one when it was listed, so it was replaced since",
    )


def sha256_regular(path: str) -> Tuple[str, int]:
    """(sha256 hex, size) of the regular file ``path``, opened by ``open_regular``: a FIFO, a
    socket, a device or a symlink under the name is NotRegularFile, never opened to be read
    (a FIFO without a writer would block the reader forever)."""
    fd = open_regular(path)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def _why_not(path: str) -> Optional[str]:
    """Why ``path`` is not a plain relative path; None when it is."""
    if not path:
        return "it is empty"
    if "\x00" in path:
        return "it holds a NUL byte"
    if path.startswith("/"):
        return "it is absolute"
    if "\\" in path:
        return "it holds a backslash"
    for c in path:
        o = ord(c)
        # TAB and LF stay allowed: POSIX names may hold them, the sealer seals such files and
        # every transport carries them byte for byte. Any other control character (ESC, CR,
        # DEL, C1) serves only to disguise a name on a terminal.
        if (o < 0x20 and c not in "\t\n") or 0x7F <= o <= 0x9F:
            return f"it holds the control character {c!r}"
    try:
        raw = path.encode("utf-8", "surrogateescape")  # undecodable bytes round-trip as such
    except UnicodeEncodeError:
        return "it holds a lone surrogate that names no byte"
    if len(raw) > MAX_TOTAL:
        return f"it is {len(raw)} bytes long (at most {MAX_TOTAL})"
    for part in path.split("/"):
        if not part:
            return "it has an empty component (a leading, trailing or doubled '/')"
        if part in (".", ".."):
            return f"it has a {part!r} component"
        n = len(part.encode("utf-8", "surrogateescape"))
        if n > MAX_COMPONENT:
            return f"a component is {n} bytes long (at most {MAX_COMPONENT})"
    return None


def _show(path: str) -> str:
    """repr of ``path``, cut short when long (a refused 300-byte name stays one readable line)."""
    return repr(path) if len(path) <= 160 else f"{path[:120]!r}... ({len(path)} characters)"


def safe_rel(path: object, what: str = "path", remedy: Optional[str] = _REMEDY) -> str:
    """``path`` itself when it is a plain relative path ('/'-separated, each component a real
    name: no absolute path, no empty, '.' or '..' component, no NUL, no backslash, no control
    character but TAB and LF, at most 255 bytes per component and 4096 in all); otherwise
    UnsafePath (exit 6) naming it (repr), ``what`` it is, and why."""
    if not isinstance(path, str):
        shown = _show(repr(path))[1:-1]
        raise UnsafePath(f"{what} {shown} is refused: it is not a string", repr(path), remedy)
    why = _why_not(path)
    if why is not None:
        raise UnsafePath(f"{what} {_show(path)} is refused: {why}", path, remedy)
    return path


def safe_abs(path: object, what: str = "path", remedy: Optional[str] = _REMEDY) -> str:
    """``path`` itself when it is an absolute path as rgt writes one (``os.path.abspath``'s
    form: '/' and then a path ``safe_rel`` accepts, so never '/' alone, never a '..' that would
    climb out of a root on the laptop); otherwise UnsafePath naming it."""
    if not isinstance(path, str) or not path.startswith("/"):
        shown = _show(path) if isinstance(path, str) else repr(path)
        raise UnsafePath(
            f"{what} {shown} is refused: it is not an absolute path", str(path), remedy
        )
    why = _why_not(path[1:])
    if why is not None:
        raise UnsafePath(f"{what} {_show(path)} is refused: {why}", path, remedy)
    return path


def safe_join(base: str, path: str, what: str = "path") -> str:
    """``base`` joined with the checked relative ``path`` (a string only: the file system is not
    consulted; the helpers below are for that)."""
    return os.path.join(base, *safe_rel(path, what).split("/"))


def _split(rel: str, what: str) -> Tuple[List[str], str]:
    parts = safe_rel(rel, what).split("/")
    return parts[:-1], parts[-1]


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _symlink(base: str, parts: List[str]) -> UnsafePath:
    return symlink_error(os.path.join(base, *parts))


def symlink_error(shown: str) -> UnsafePath:
    """The refusal of the symlink at ``shown`` (exit 6)."""
    return UnsafePath(
        f"{shown} is a symlink: rgt neither writes nor reads through one",
        shown,
        "remove it (or use another directory); rgt itself never makes one there",
    )


def _load_openat2() -> Optional[Callable[[int, str, int], int]]:
    """``openat2(dir_fd, path, flags)`` resolving no symlink and nothing outside ``dir_fd``
    (a descriptor; OSError as ``os.open`` raises), or None off Linux or without ctypes."""
    syscall = linux_function("syscall")
    if syscall is None:
        return None
    import ctypes

    class OpenHow(ctypes.Structure):
        _fields_ = [
            ("flags", ctypes.c_uint64),
            ("mode", ctypes.c_uint64),
            ("resolve", ctypes.c_uint64),
        ]

    nr = ctypes.c_long(437)  # SYS_openat2: one number on every architecture (Linux 5.6)
    resolve = 0x04 | 0x08  # RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
    size = ctypes.c_size_t(ctypes.sizeof(OpenHow))
    syscall.restype = ctypes.c_long

    def openat2(dir_fd: int, path: str, flags: int) -> int:
        how = OpenHow(flags, 0, resolve)
        raw = os.fsencode(path)
        fd = int(syscall(nr, ctypes.c_int(dir_fd), ctypes.c_char_p(raw), ctypes.byref(how), size))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        return fd

    return openat2


_openat2 = _load_openat2()
# The kernel or a sandbox does not have it: the component-by-component walk from then on.
_NO_OPENAT2 = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG, errno.EOPNOTSUPP)


def _open_at_once(fd: int, parts: List[str]) -> Optional[int]:
    """A descriptor of ``parts`` under the directory ``fd`` opened by ``openat2`` in one call,
    or None where it did not (then the walk does it, and says why)."""
    global _openat2
    if _openat2 is None or not parts:
        return None
    try:
        return _openat2(fd, "/".join(parts), _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in _NO_OPENAT2:
            _openat2 = None
        return None  # ENOENT, ELOOP, ENOTDIR, EXDEV, EAGAIN...: the walk finds and names it


def open_dir(
    base: str,
    parts: List[str],
    *,
    create: bool = False,
    mode: int = 0o777,
    made: Optional[List[str]] = None,
) -> int:
    """A descriptor of the directory ``base/parts...``, each component under ``base`` opened
    ``O_NOFOLLOW | O_DIRECTORY`` from the one before: a symlink on the way is refused
    (UnsafePath), a file where a directory should be is NotADirectoryError, a missing one is
    FileNotFoundError unless ``create`` (then it is made with ``mode``, its parent fsynced, and
    its path appended to ``made``). ``parts`` must come from ``safe_rel``. The caller closes the
    descriptor."""
    fd = os.open(base, _DIR_FLAGS)
    nfd = _open_at_once(fd, parts)
    if nfd is not None:
        os.close(fd)
        return nfd
    try:
        for i, name in enumerate(parts):
            for _ in range(3):  # made or removed by someone else in between: look again
                try:
                    nfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, mode, dir_fd=fd)
                    except FileExistsError:
                        continue
                    # The new entry is durable only once its parent is fsynced: a file
                    # fsynced inside it, and a MANIFEST or LATEST naming that file, could
                    # otherwise outlive a crash that takes the directory itself away.
                    os.fsync(fd)
                    if made is not None:
                        made.append(os.path.join(base, *parts[: i + 1]))
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                        raise _symlink(base, parts[: i + 1]) from None
                    if e.errno == errno.ENOTDIR:
                        where = os.path.join(base, *parts[: i + 1])
                        raise NotADirectoryError(e.errno, "not a directory", where) from None
                    raise
            else:
                raise FileNotFoundError(errno.ENOENT, "keeps vanishing", os.path.join(base, name))
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(base: str, rel: str, what: str = "path") -> Optional[os.stat_result]:
    """The lstat of ``base/rel`` (the last component is not followed), every directory on the
    way checked as ``open_dir`` does; None when it, or a directory on the way, is missing."""
    parents, name = _split(rel, what)
    try:
        fd = open_dir(base, parents)
    except FileNotFoundError:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def open_beneath(
    base: str,
    rel: str,
    flags: int,
    mode: int = 0o600,
    *,
    what: str = "path",
    create_dirs: bool = False,
    dir_mode: int = 0o777,
    made: Optional[List[str]] = None,
) -> int:
    """``os.open`` of ``base/rel`` with ``flags | O_NOFOLLOW``: a symlink under the name, or on
    the way, is refused (UnsafePath; with ``O_CREAT | O_EXCL`` any existing name, a symlink
    too, is FileExistsError). ``create_dirs``: missing directories are made (``open_dir``)."""
    parents, name = _split(rel, what)
    fd = open_dir(base, parents, create=create_dirs, mode=dir_mode, made=made)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    except OSError as e:
        if e.errno == errno.ELOOP and _is_link(fd, name):
            raise _symlink(base, parents + [name]) from None
        raise
    finally:
        os.close(fd)


def replace_beneath(
    src_base: str,
    src_rel: str,
    dst_base: str,
    dst_rel: str,
    *,
    what: str = "path",
    dir_mode: int = 0o777,
    made: Optional[List[str]] = None,
) -> None:
    """Rename ``src_base/src_rel`` to ``dst_base/dst_rel`` (one filesystem), making the missing
    directories of the destination (``dir_mode``, appended to ``made``). A symlink on either
    path, or under the destination name, is refused (UnsafePath): rgt replaces only files."""
    sparents, sname = _split(src_rel, what)
    dparents, dname = _split(dst_rel, what)
    sfd = open_dir(src_base, sparents)
    try:
        dfd = open_dir(dst_base, dparents, create=True, mode=dir_mode, made=made)
        try:
            if _is_link(dfd, dname):
                raise _symlink(dst_base, dparents + [dname])
            if _is_link(sfd, sname):
                raise _symlink(src_base, sparents + [sname])
            os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def unlink_beneath(base: str, rel: str, what: str = "path") -> bool:
    """Remove the name ``base/rel`` (a symlink there is removed itself, never followed); False
    when it was not there."""
    parents, name = _split(rel, what)
    try:
        fd = open_dir(base, parents)
    except FileNotFoundError:
        return False
    try:
        os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def conflicts(paths: List[str]) -> Optional[Tuple[str, str]]:
    """Two of ``paths`` (checked relative paths) that cannot both be files: one is a directory
    on the way to the other (``a`` and ``a/b``); None when there are none."""
    names = set(paths)
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            head = "/".join(parts[:i])
            if head in names:
                return head, p
    return None


__all__ = [
    "MAX_COMPONENT",
    "MAX_TOTAL",
    "UnsafePath",
    "conflicts",
    "lstat_beneath",
    "open_beneath",
    "open_dir",
    "replace_beneath",
    "safe_abs",
    "safe_join",
    "safe_rel",
    "symlink_error",
    "unlink_beneath",
]
