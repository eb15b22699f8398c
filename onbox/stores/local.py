"""``file:///path``: a durable mount (AutoDL's autodl-fs, a RunPod network volume, NFS).

Every object is written to a temporary name in its directory with a kernel-side copy while a
second thread hashes the source (one read from the disk: whichever of the two gets there first
pulls the pages in, the other finds them cached), fsynced, renamed into place, and the directory
fsynced. The copy is verified by what can fail here: the source must not have changed while it
was copied (same size, mtime and ctime before and after, and the hash of the caller, when given,
must match), fsync must succeed, and the copy must have the source's size. A read-back after
fsync would be served from the page cache, not the disk, so it would prove nothing more; a
directory has no checksum of its own to compare with. The preflight proves the mount really
renames and fsyncs: FUSE bucket mounts (s3fs, goofys, some vendors' volumes) do neither reliably.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
from typing import Any, BinaryIO, Iterator, List, Optional, Tuple

from onbox.durable import fsync_dir
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
HASH_CHUNK = 8 << 20  # large reads keep the hashing thread in OpenSSL, off the GIL
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
        _copy_from(f, dst_fd, os.fstat(f.fileno()).st_size)


def _copy_from(f: BinaryIO, dst_fd: int, size: int) -> None:
    """Copy ``size`` bytes of the open file ``f`` into ``dst_fd``, in the kernel where it can."""
    done = 0
    cfr = getattr(os, "copy_file_range", None)
    try:
        while done < size:
            if cfr is not None:
                n = cfr(f.fileno(), dst_fd, size - done, done)
            else:
                n = os.sendfile(dst_fd, f.fileno(), done, size - done)
            if n == 0:
                break
            done += n
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # Positional reads: the hashing thread shares this descriptor's file offset.
        os.lseek(dst_fd, done, os.SEEK_SET)
        while True:
            b = os.pread(f.fileno(), CHUNK, done)
            if not b:
                break
            done += len(b)
            view = memoryview(b)
            while view:
                view = view[os.write(dst_fd, view) :]


def _copy_hashing(src: str, dst_fd: int) -> Tuple[str, int, os.stat_result]:
    """Copy ``src`` into ``dst_fd`` while another thread hashes it: (sha256, bytes hashed, the
    source's stat before). Both threads spend their time in the kernel or in OpenSSL with the
    GIL released, so on two cores the hash costs almost no wall time."""
    with open(src, "rb") as f:
        fd = f.fileno()
        before = os.fstat(fd)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        out: List[Any] = []

        def hash_all() -> None:
            try:
                h, off = hashlib.sha256(), 0
                while True:
                    b = os.pread(fd, HASH_CHUNK, off)
                    if not b:
                        break
                    h.update(b)
                    off += len(b)
                out.append((h.hexdigest(), off))
            except BaseException as e:  # handed to the copying thread, raised there
                out.append(e)

        hasher = threading.Thread(target=hash_all, name="rgt-hash", daemon=True)
        hasher.start()
        try:
            _copy_from(f, dst_fd, before.st_size)
        finally:
            hasher.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        sha, n = out[0]
        return sha, n, before


def _sig(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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

    hashes_while_uploading = True

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        dest = self._path(key)
        tmp = self._tmp(dest)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                got, hashed, before = _copy_hashing(path, fd)
                os.fsync(fd)
                copied = os.fstat(fd).st_size
            finally:
                os.close(fd)
            after = os.stat(path)
            changed = _sig(after) != _sig(before) or hashed != before.st_size
            if changed or copied != size or hashed != size or sha256 not in (None, got):
                raise IntegrityError(
                    f"{key}: the copy in {self.root} does not match its source "
                    f"({copied} bytes copied, {hashed} hashed with sha256 {got[:12]}; expected "
                    f"{size} bytes{'' if sha256 is None else ' sha256 ' + sha256[:12]})",
                    "the source changed while it was copied: write checkpoints to a new "
                    "name and let the job finish them before they are sealed",
                )
            self._commit(tmp, dest, if_absent=False)
        except OSError as e:
            raise _fail(e, f"writing {dest}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ObjectInfo(key, size, got)

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
