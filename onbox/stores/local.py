"""``file:///path``: a durable mount (AutoDL's autodl-fs, a RunPod network volume, NFS).

Every object is written to a temporary name in its directory with a kernel-side copy, fsynced,
read back and compared with the caller's sha256 (a directory computes no checksum of its own),
renamed into place, and the directory fsynced. The preflight proves the mount really renames and
fsyncs: FUSE bucket mounts (s3fs, goofys, some vendors' volumes) do neither reliably.
"""

from __future__ import annotations

import errno
import hashlib
import os
from typing import Iterator, List, Optional

from onbox.durable import fsync_dir, sha256_file
from onbox.errors import IntegrityError
from onbox.stores.base import (
    Finding,
    ObjectInfo,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    TransientStoreError,
    check_key,
)

CHUNK = 1 << 20
_PERMANENT = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
}


def _fail(e: OSError, doing: str) -> Exception:
    what = f"{doing}: {e.strerror or e}"
    if e.errno in _PERMANENT:
        remedy = {
            errno.ENOSPC: "free space on the durable mount",
            errno.EROFS: "the mount is read-only; remount it read-write",
        }.get(e.errno or 0, "check the mount's permissions")
        return PermanentStoreError(what, remedy)
    return TransientStoreError(what)


def _copy(src: str, dst_fd: int) -> None:
    """Kernel-side copy (copy_file_range, else sendfile), falling back to read/write."""
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        done = 0
        cfr = getattr(os, "copy_file_range", None)
        try:
            while done < size:
                if cfr is not None:
                    n = cfr(f.fileno(), dst_fd, size - done)
                else:
                    n = os.sendfile(dst_fd, f.fileno(), None, size - done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            f.seek(done)
            os.lseek(dst_fd, done, os.SEEK_SET)
            while True:
                b = f.read(CHUNK)
                if not b:
                    break
                view = memoryview(b)
                while view:
                    view = view[os.write(dst_fd, view) :]


class LocalStore(Store):
    """A store in a directory of a (durable) mount."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _tmp(self, path: str) -> str:
        return os.path.join(
            os.path.dirname(path),
            f".{os.path.basename(path)}.rgt-tmp.{os.getpid()}.{os.urandom(3).hex()}",
        )

    def _commit(self, tmp: str, path: str, if_absent: bool) -> None:
        if if_absent:
            try:
                os.link(tmp, path)  # fails if present: an atomic create-if-absent
            except FileExistsError:
                raise PreconditionFailed(f"{path} already exists") from None
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        if sha256 is None:
            raise ValueError("this store needs the caller's sha256")
        dest = self._path(key)
        tmp = self._tmp(dest)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _copy(path, fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            got_size = os.stat(tmp).st_size
            got = sha256_file(tmp)[0]
            if got_size != size or got != sha256:
                raise IntegrityError(
                    f"{key}: the copy in {self.root} does not match its source "
                    f"({got_size} bytes sha256 {got[:12]}, expected {size} bytes {sha256[:12]})",
                    "the source changed while it was copied, or the mount corrupts data",
                )
            self._commit(tmp, dest, if_absent=False)
        except OSError as e:
            raise _fail(e, f"writing {dest}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ObjectInfo(key, size, sha256)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> ObjectInfo:
        dest = self._path(key)
        tmp = self._tmp(dest)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._commit(tmp, dest, if_absent)
        except OSError as e:
            raise _fail(e, f"writing {dest}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest())

    def get_bytes(self, key: str) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _fail(e, f"reading {key}") from None

    def get_file(self, key: str, dest: str) -> None:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _copy(self._path(key), fd)
            os.fsync(fd)
        except FileNotFoundError:
            raise PermanentStoreError(f"{key} is not in {self.url}") from None
        except OSError as e:
            raise _fail(e, f"reading {key}") from None
        finally:
            os.close(fd)

    def stat(self, key: str) -> Optional[ObjectInfo]:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, None, None, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root
        start = os.path.join(base, *[p for p in prefix.split("/") if p][:-1]) if prefix else base
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            for name in sorted(filenames):
                if ".rgt-tmp." in name:
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, base).replace(os.sep, "/")
                if key.startswith(prefix):
                    st = os.stat(full)
                    yield ObjectInfo(key, st.st_size, None, None, st.st_mtime)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _fail(e, f"deleting {key}") from None

    def abort_stale_uploads(self, prefix: str) -> int:
        """Remove temporary files a killed writer left under ``prefix`` (never a final name)."""
        n = 0
        start = os.path.join(self.root, *[p for p in prefix.split("/") if p])
        for dirpath, _, filenames in os.walk(start):
            for name in filenames:
                if ".rgt-tmp." in name:
                    try:
                        os.unlink(os.path.join(dirpath, name))
                        n += 1
                    except OSError:
                        pass
        return n

    def same_filesystem_as(self, path: str) -> bool:
        probe = self.root
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            return os.stat(probe).st_dev == os.stat(path).st_dev
        except OSError:
            return False

    def fs_type(self) -> str:
        """The filesystem type of the root, from /proc/self/mountinfo."""
        best, kind = "", "unknown"
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    left, _, right = line.partition(" - ")
                    mount = left.split()[4].replace("\\040", " ")
                    if (self.root + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(
                        best
                    ):
                        best, kind = mount, right.split()[0]
        except (OSError, IndexError):
            pass
        return kind

    def preflight(self, run: str) -> List[Finding]:
        found: List[Finding] = []
        kind = self.fs_type()
        step = "create the run directory"
        d = os.path.join(self.root, run, ".rgt-preflight")
        try:
            os.makedirs(d, exist_ok=True)
            step = "write and fsync a probe file"
            a, b = os.path.join(d, "a"), os.path.join(d, "b")
            payload = os.urandom(4096)
            for p in (a, b):
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, payload)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            step = "rename a file over another (atomic replace)"
            os.replace(a, b)
            if os.path.exists(a):
                raise OSError(errno.EIO, "the source of the rename still exists")
            step = "fsync the directory"
            fsync_dir(d)
            step = "read the probe back and compare"
            with open(b, "rb") as f:
                if f.read() != payload:
                    raise OSError(errno.EIO, "read back different bytes")
            step = "delete the probe"
            os.unlink(b)
            os.rmdir(d)
        except OSError as e:
            err = _fail(e, f"store preflight failed at '{step}' in {self.root}")
            raise err from None
        found.append(Finding(True, f"{self.url} ({kind}): writes, fsyncs, renames atomically"))
        if kind.startswith("fuse"):
            found.append(
                Finding(
                    False,
                    f"{self.url} is a FUSE mount ({kind}): renames and fsync "
                    "may not be atomic or durable there; prefer s3:// directly",
                )
            )
        return found
