"""Writing files so that a crash never leaves a torn one under its final name.

tmp file -> write -> fsync -> rename -> fsync the directory. A failed fsync is not retried:
the caller rewrites the data (the kernel may have dropped the dirty pages already).
"""

from __future__ import annotations

import errno
import json
import os
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Any, List, Optional


def fsync_file(path: str) -> None:
    """fsync a file that was written and closed elsewhere (by torch.save, safetensors, rsync)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str, mode: int = 0o700) -> List[str]:
    """Create ``path`` and each missing parent with ``mode`` (0700: rgt's directories are the
    user's alone), oldest first; the ones it created, for ``remove_dirs`` to undo.

    ``os.makedirs(path, mode)`` gives the mode to the leaf only and 0777 minus the umask (0755
    under the usual 022) to every parent it makes, so each component is made here itself. The
    umask still applies on top (it can only take bits away). A directory that exists already is
    left as it is (a user's own --ckpt-dir keeps its mode). Each one made has its parent
    fsynced before the next is made, so a file later made durable inside it is not lost with
    a directory entry that never reached the disk.
    """
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created: List[str] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue  # a concurrent start made it: it is not ours to remove
            created.append(d)
            _sync_parent(d)
    except BaseException:
        remove_dirs(created)
        raise
    return created


def _sync_parent(path: str) -> None:
    """fsync the directory that holds ``path``: the new entry survives a crash only from here.
    A parent this user may not read (mode -wx) cannot be opened to sync, and some filesystems
    refuse to sync a directory at all: there the directory stays as made, as it always was
    (what is written inside it is still fsynced itself), rather than failing the caller."""
    try:
        fsync_dir(os.path.dirname(path))
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP):
            raise


def remove_dirs(created: List[str]) -> None:
    """Undo ``make_dirs``: remove the directories it created, newest first, where empty (one
    that something else has put a file into since stays)."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    directory = os.path.dirname(path) or "."
    # One temporary name per thread, not per process: two threads replacing one path (a
    # sweep's side-by-side deploys, the agent's sealer beside its loop) must not share one.
    ident = f"{os.getpid()}.{threading.get_ident()}"
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{ident}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


def write_json(path: str, obj: Any) -> None:
    """``write_atomic`` of a JSON document."""
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: str) -> Optional[Any]:
    """The JSON document at ``path``, or None when it does not exist.

    A document that does not parse raises ``ValueError``: files here are only ever replaced
    atomically, so a torn one means something else wrote it.
    """
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def append_line(path: str, line: str, sync: bool = True) -> None:
    """Append one line with a single write (O_APPEND keeps concurrent writers whole)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in chunks of up to 1 MiB into one buffer (sized to
    the file: a checkpoint of 10,000 small files is hashed 10,000 times, and a fresh 1 MiB
    buffer per read is an allocation the kernel maps and unmaps each time)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def sha256_fd(fd: int) -> tuple[str, int]:
    """(sha256 hex, size) of what the open file ``fd`` holds from its offset on (sha256_file)."""
    import hashlib  # (here: OpenSSL's start is a few ms every `rgt-agent status` need not pay)

    h = hashlib.sha256()
    n = 0
    size = os.fstat(fd).st_size
    view = memoryview(bytearray(max(4096, min(1 << 20, size + 1))))
    while True:
        k = os.readv(fd, [view])
        if not k:
            return h.hexdigest(), n
        h.update(view[:k])
        n += k
