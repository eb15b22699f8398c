"""``file:///path``: a durable mount (AutoDL's autodl-fs, a RunPod network volume, NFS).

Every object is written to a temporary name in its directory with a kernel-side copy while a
second thread hashes the source (one read from the disk: whichever of the two gets there first
pulls the pages in, the other finds them cached; a file of up to 4 MiB is read once into memory
and hashed there instead), fsynced, renamed into place, and the directory fsynced. The copy is
verified by what can fail here: the source must not have changed while it was copied (same
size, mtime and ctime before and after, and the hash of the caller, when given, must match),
fsync must succeed, and the copy must have the source's size. A read-back after
fsync would be served from the page cache, not the disk, so it would prove nothing more; a
directory has no checksum of its own to compare with. The preflight proves the mount really
renames and fsyncs: FUSE bucket mounts (s3fs, goofys, some vendors' volumes) do neither reliably.

A conditional replace (``put_bytes(if_match=VERSION)``, the version being the object's sha256)
compares and renames while holding ``RUN/.rgt-lock`` with ``flock`` (NFS turns it into a lock
the server keeps, across hosts): POSIX has no rename-if-unchanged, and without the lock a writer
paused between its check and its rename would replace what another wrote meanwhile. The lock is
held for one read and one rename, never across an upload; a mount that has no locks (some FUSE
filesystems) gets the check and rename without it, and the caller's read-back is the check.
A create-if-absent is a ``link()``, atomic by itself.

The store is input, not trusted: every key is walked under the root one directory at a time
(onbox.common.safepath, ``O_NOFOLLOW``), so a symlink planted in the store, a key that points to
``/etc/hostname`` or a directory that points elsewhere, is refused (UnsafePath, exit 6) when it
is read, listed or deleted, and never written through. rgt itself never makes one there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat as statmod
import time
from typing import Iterator, List, Optional, Tuple

from onbox.common import writeback
from onbox.common.durable import make_dirs
from onbox.common.errors import IntegrityError, NotFound
from onbox.common.faults import hold_point
from onbox.common.safepath import (
    UnsafePath,
    lstat_beneath,
    open_beneath,
    open_dir,
    open_regular,
    symlink_error,
)
from onbox.sealing.stores.base import (
    Finding,
    Lanes,
    ObjectInfo,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    TransientStoreError,
    check_key,
    new_download,
    os_error,
)
from onbox.sealing.stores.filecopy import copy_file, never, write_all
from onbox.sealing.stores.hangbound import HangBound, answers
from onbox.sealing.stores.localpreflight import check_root, fs_type
from onbox.sealing.stores.localpreflight import preflight as run_preflight

LOCK_NAME = ".rgt-lock"  # RUN/.rgt-lock: held around a conditional replace, never listed
LOCK_WAIT = 30.0  # seconds a conditional replace waits for another writer's lock


def _sig(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class LocalStore(HangBound, Store):
    """A store in a directory of a (durable) mount; its calls before a download may be bounded
    (hangbound.py: a hung mount)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        self._dev: Optional[int] = None  # the root's filesystem at this process's first write

    def _path(self, key: str) -> str:
        """The key's path, for messages (every access goes through ``_parent``)."""
        return os.path.join(self.root, *check_key(key).split("/"))

    def _parent(self, key: str, create: bool = False) -> Tuple[int, str]:
        """A descriptor of the key's directory, walked from the root with O_NOFOLLOW (a symlink
        on the way is UnsafePath; missing directories are made when ``create``), and the key's
        last component. The caller closes the descriptor."""
        parts = check_key(key).split("/")
        if create:
            self._same_filesystem()
        try:
            return open_dir(self.root, parts[:-1], create=create), parts[-1]
        except FileNotFoundError:
            if not create or os.path.isdir(self.root):
                raise
        try:
            check_root(self.root)
        except NotFound:
            # The root the preflight saw is gone, most likely a durable mount that was
            # unmounted: making it again would put the checkpoints on the box's own disk.
            raise PermanentStoreError(
                f"the store root {self.root} is gone (was the durable mount unmounted?)",
                f"mount it again at {os.path.dirname(self.root)}; rgt makes a missing root "
                "only on a mount of its own, never on the box's own disk",
            ) from None
        make_dirs(self.root, 0o777)  # the root itself, once (not tried at every put), as durable
        return open_dir(self.root, parts[:-1], create=create), parts[-1]

    def _same_filesystem(self) -> None:
        """Refuse a write once the root has moved onto the box's root filesystem from another:
        a root that is itself a mount point stays a directory when the mount drops, and what
        is written there is on the box's own disk. Another filesystem (a volume mounted again)
        is taken as the new one."""
        try:
            dev = os.stat(self.root).st_dev
            moved = self._dev is not None and dev != self._dev and dev == os.stat("/").st_dev
        except OSError:
            return  # the walk that follows says what is wrong
        if moved:
            raise PermanentStoreError(
                f"the store root {self.root} is on the box's root filesystem now, no longer on "
                "the one it was on (was the durable mount unmounted?)",
                f"mount it again at {self.root}; rgt never seals onto the box's own disk in its "
                "place",
            )
        self._dev = dev

    @staticmethod
    def _tmp() -> str:
        # Not derived from the object's name: a name of up to NAME_MAX bytes must fit, and
        # ".NAME.rgt-tmp.PID.HEX" did not past ~230. The PID tells a live writer's file from
        # a killed one's; the random part, one thread's from another's (O_EXCL refuses a clash).
        return f".rgt-tmp.{os.getpid()}.{os.urandom(6).hex()}"

    @staticmethod
    def _new(dir_fd: int, name: str) -> int:
        # A fresh name, never through a symlink: the temporary file is this writer's alone.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o600, dir_fd=dir_fd)

    @staticmethod
    def _drop_tmp(dir_fd: int, tmp: str) -> None:
        # Best effort, in a finally: an OSError here must not replace the error being raised
        # (a stale temporary file is removed by abort_stale_uploads).
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)

    @contextlib.contextmanager
    def _run_lock(self, key: str) -> Iterator[None]:
        """``flock`` on ``RUN/.rgt-lock`` (RUN: the key's first part), waited for up to
        LOCK_WAIT seconds; a filesystem without locks yields without one."""
        run = check_key(key).split("/")[0]
        dfd = open_dir(self.root, [run], create=True)
        try:
            fd = os.open(
                LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
            )
        finally:
            os.close(dfd)
        try:
            deadline = time.monotonic() + LOCK_WAIT
            locked = False
            while not locked:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TransientStoreError(
                            f"{self.root}/{run}/{LOCK_NAME} has been locked by another writer "
                            f"for {LOCK_WAIT:.0f}s",
                            "another agent of this run is writing (or is frozen mid-write)",
                        ) from None
                    time.sleep(0.05)
                except OSError as e:
                    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    break  # no locks on this mount: check and rename without one
            yield
        finally:
            os.close(fd)  # releases the lock

    def _current_version(self, dir_fd: int, name: str) -> Optional[str]:
        """The sha256 of the object ``name`` in ``dir_fd``, or None when absent."""
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except FileNotFoundError:
            return None
        with open(fd, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def _commit(
        self,
        dir_fd: int,
        tmp: str,
        name: str,
        path: str,
        if_absent: bool,
        if_match: Optional[str] = None,
    ) -> None:
        if if_match is not None:
            with self._run_lock(path[len(self.root) + 1 :]):
                if self._current_version(dir_fd, name) != if_match:
                    raise PreconditionFailed(f"{path} is not at version {if_match[:12]} any more")
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.fsync(dir_fd)
            return
        if if_absent:
            try:  # fails if present: an atomic create-if-absent
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileExistsError:
                raise PreconditionFailed(f"{path} already exists") from None
            finally:
                os.unlink(tmp, dir_fd=dir_fd)
        else:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a symlink there: replaced
        os.fsync(dir_fd)

    def _open_read(self, key: str) -> Tuple[int, os.stat_result]:
        """A descriptor of the regular file under ``key`` and its fstat. FileNotFoundError when
        absent; UnsafePath when it, or a directory on the way, is a symlink, or it is no
        regular file (O_NONBLOCK: a FIFO planted there must not hang the open)."""
        try:
            fd = open_beneath(self.root, key, os.O_RDONLY | os.O_NONBLOCK, what="store key")
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "no such key", key) from None
        st = os.fstat(fd)
        if statmod.S_ISREG(st.st_mode):
            return fd, st
        os.close(fd)
        if statmod.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory, not an object", self._path(key))
        raise IntegrityError(
            f"{self._path(key)} is not a regular file (mode {st.st_mode:o})",
            "rgt writes only regular files into a store: remove it",
        )

    hashes_while_uploading = True
    # Puts at once: each is a copy while hashed, then an fsync of the file and one of its
    # directory, which wait on the disk; several fsyncs in flight share the filesystem's
    # journal commits. Not one syncfs for the whole checkpoint instead: a FUSE mount (many
    # vendors' volumes) forwards fsync to its daemon but not syncfs, so the objects would not
    # be known durable before their MANIFEST.
    parallel_puts = 8

    puts_data = True  # put_data writes as put_bytes does: written, fsynced, renamed into place
    watches_uploads = True  # each copy's piece, and each file put, is ``moved`` (hangbound.py)

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        hold_point("store.put_file")  # a test's hung mount
        dest = self._path(key)
        try:
            dfd, name = self._parent(key, create=True)
        except OSError as e:
            raise os_error(e, f"writing {dest}") from None
        tmp = self._tmp()
        try:
            fd = self._new(dfd, tmp)
            try:
                with open(open_regular(path), "rb") as f:  # a FIFO, a link: refused
                    got, hashed, before = copy_file(f, fd, moved=self.moved)
                writeback.settle(fd, before.st_size, self.moved)  # its waits are movement
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
            self._commit(dfd, tmp, name, dest, if_absent=False)
            self.moved()
            tmp = ""  # renamed into place: nothing left to remove
        except OSError as e:
            raise os_error(e, f"writing {dest}") from None
        finally:
            if tmp:
                self._drop_tmp(dfd, tmp)
            os.close(dfd)
        return ObjectInfo(key, size, got)

    @answers("writing {}")
    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        return self._write(key, data, if_absent, if_match, hashlib.sha256(data).hexdigest())

    def put_data(self, key: str, data: bytes, sha256: str) -> ObjectInfo:
        # A checkpoint's small file, as put_file puts a large one: not bounded by
        # calls_bounded (the stall bound watches copies of files), where a document's put is.
        # The agent bounds its store calls for the whole run, and a bounded call runs in a
        # thread of its own: some 0.1-0.2 ms more per put, a third of a 16 KiB file's.
        return self._write(key, data, False, None, sha256)

    def _write(
        self, key: str, data: bytes, if_absent: bool, if_match: Optional[str], sha: str
    ) -> ObjectInfo:
        dest = self._path(key)
        try:
            dfd, name = self._parent(key, create=True)
        except OSError as e:
            raise os_error(e, f"writing {dest}") from None
        tmp = self._tmp()
        try:
            fd = self._new(dfd, tmp)
            try:
                write_all(fd, data, self.moved)
                writeback.settle(fd, len(data), self.moved)
            finally:
                os.close(fd)
            self._commit(dfd, tmp, name, dest, if_absent, if_match)
            self.moved()
            tmp = ""  # renamed into place (or linked, then removed): nothing left to remove
        except OSError as e:
            raise os_error(e, f"writing {dest}") from None
        finally:
            if tmp:
                self._drop_tmp(dfd, tmp)
            os.close(dfd)
        return ObjectInfo(key, len(data), sha, sha)

    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        data = self.get_bytes(key)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    @answers("reading {}")
    def get_bytes(self, key: str) -> Optional[bytes]:
        hold_point("store.get")  # a test's hung mount
        try:
            fd, _ = self._open_read(key)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise os_error(e, f"reading {key}") from None
        with open(fd, "rb") as f:
            try:
                return f.read()
            except OSError as e:
                raise os_error(e, f"reading {key}") from None

    def get_file(self, key: str, dest: str) -> None:
        self.fetch_file(key, dest)

    def fetch_file(
        self, key: str, dest: str, *, size: Optional[int] = None, lanes: Optional[Lanes] = None
    ) -> Optional[str]:
        try:
            src, st = self._open_read(key)
        except FileNotFoundError:
            raise PermanentStoreError(f"{key} is not in {self.url}") from None
        except OSError as e:
            raise os_error(e, f"reading {key}") from None
        if size is not None and st.st_size != size:  # not copied: it could fill the target
            os.close(src)
            raise IntegrityError(
                f"{self._path(key)}: {st.st_size} bytes in the store, the MANIFEST says "
                f"{size} bytes",
                "the object in the store is not the one sealed, damaged or replaced: "
                "nothing of it was copied",
            )
        with open(src, "rb") as f, new_download(dest, f"downloading {key}", os_error, lanes) as fd:
            # A stopped restore (a SIGTERM, another file failed) copies no further piece.
            stopped = (lambda: lanes.stopped) if lanes is not None else never
            got, hashed, before = copy_file(f, fd, stopped)
            if _sig(os.fstat(f.fileno())) != _sig(before) or os.fstat(fd).st_size != hashed:
                raise TransientStoreError(f"downloading {key}: it changed while it was copied")
        return got

    @answers("looking at {}")
    def stat(self, key: str) -> Optional[ObjectInfo]:
        try:
            st = lstat_beneath(self.root, key, "store key")
        except NotADirectoryError:
            return None
        if st is None:
            return None
        if statmod.S_ISLNK(st.st_mode):
            raise symlink_error(self._path(key))
        return ObjectInfo(key, st.st_size, None, None, st.st_mtime)

    @answers("listing {}", whole=True)
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, symlinks never followed: a symlink to a directory is
        not descended into, one to a file (or to nothing) is listed with its own lstat (reading
        it is refused). A name rgt could not have written (a key check_key refuses) is no
        object of rgt's and is left out: one stray file must not stop a restore's listing."""
        base = self.root
        parts = [p for p in prefix.split("/") if p]
        if not prefix.endswith("/"):  # a partial last name ("run/step_1"): walk its parent
            parts = parts[:-1]
        try:
            os.close(open_dir(base, [check_key(p) for p in parts]))
        except (FileNotFoundError, NotADirectoryError):
            return
        start = os.path.join(base, *parts)
        hold_point("store.list")  # a test's hung mount
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            for name in sorted(filenames):
                if ".rgt-tmp." in name or name == LOCK_NAME:
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, base).replace(os.sep, "/")
                try:
                    check_key(key)
                except UnsafePath:
                    continue
                if key.startswith(prefix):
                    try:
                        st = os.lstat(full)
                    except FileNotFoundError:
                        continue  # deleted since the directory was read
                    yield ObjectInfo(key, st.st_size, None, None, st.st_mtime)

    @answers("deleting {}")
    def delete(self, key: str) -> None:
        try:
            dfd, name = self._parent(key)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise os_error(e, f"deleting {key}") from None
        try:
            os.unlink(name, dir_fd=dfd)  # a symlink is removed itself, never followed
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(e, f"deleting {key}") from None
        finally:
            os.close(dfd)

    @answers("removing what a killed writer left under {}")
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

    @answers("looking at its mount beside {}")
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
        return fs_type(self.root)

    @answers("its preflight for {}")
    def preflight(self, run: str) -> List[Finding]:
        return run_preflight(self, run)
