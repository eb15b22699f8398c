"""The one interface every durable store implements, and its errors.

A store is a URL naming a root (``file:///mnt/durable/rgt``, ``s3://bucket/prefix``,
``hf://user/repo/prefix``). Keys are '/'-separated paths relative to that root
(``RUN/checkpoints/120/model.pt``); a key never starts with '/', never holds '..' or an empty
part. Each run lives under ``RUN/``.

Contract, for every implementation:

- ``put_file`` and ``put_bytes`` are atomic: a reader sees the old object or the whole new one,
  never a part; a failed put leaves no object under the final key. Both are idempotent, so a
  retried put is safe.
- ``put_file`` is given the sha256 the caller computed while reading the file, and verifies
  what the store holds against it without downloading it again where the store computes a
  checksum of its own (S3 additional checksums or ETags, the Hub's sha256); only a store that
  computes none (a plain directory) is read back. A mismatch raises ``IntegrityError``.
- ``put_bytes(..., if_absent=True)`` creates only when the key does not exist (S3
  ``If-None-Match: *`` where the store supports it), else raises ``PreconditionFailed``.
- ``fetch_file(key, dest)`` is ``get_file`` returning the sha256 of the bytes it wrote,
  computed while writing them (None where the store's client cannot: the caller then reads the
  file back); the caller verifies it. Downloads of one restore share a ``Lanes``: the bound on
  requests in flight, across files and the ranged parts of large ones.
- ``get_versioned(key)`` returns an object's bytes with its version (``ObjectInfo.etag``: S3's
  ETag, the Hub's git blob id, a ``file://`` store's sha256), read together; and
  ``put_bytes(..., if_match=VERSION)`` replaces the object only while it still is that version,
  else raises ``PreconditionFailed`` (S3 ``If-Match``, a Hub commit whose parent is the head
  that was checked, a ``file://`` check and rename under the run's lock). This compare-and-swap
  is how one writer per run is enforced at the documents that matter (MANIFEST, LATEST: see
  onbox/sealing/sealer.py); where a store cannot do it atomically the caller's read-back after the
  write is the check.
- Errors are ``TransientStoreError`` (retry: network, throttling, 5xx) or
  ``PermanentStoreError`` (never retried in a loop: auth, no bucket, ENOSPC, EACCES), refused
  credentials a ``StoreAuthError`` (a PermanentStoreError and an AuthError): all StoreErrors,
  exit 14 (onbox.common.errors draws the tree).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import os
import threading
import time
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple, TypeVar

# The store errors are drawn in onbox.common.errors' tree (exit 14); imported here too because
# every user of a Store catches them.
from onbox.common.errors import (
    HostError,
    PermanentStoreError,
    PreconditionFailed,
    StoreAuthError,
    StoreError,
    TransientStoreError,
)
from onbox.common.safepath import safe_rel
from onbox.sealing.stall import Daemons
from onbox.sealing.stores.hangbound import StoreHung

__all__ = [
    "Finding",
    "Lanes",
    "ObjectInfo",
    "PermanentStoreError",
    "PreconditionFailed",
    "Store",
    "StoreAuthError",
    "StoreError",
    "TransientStoreError",
    "check_key",
    "new_download",
    "os_error",
    "target_error",
    "WRITE_ERRNOS",
    "with_retries",
]

T = TypeVar("T")

_PERMANENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
}


def os_error(e: OSError, doing: str) -> StoreError:
    """The StoreError for an OSError on a store's own disk (a ``file://`` root, a download's
    file): permanent where retrying cannot help (a full, read-only or forbidden place), else
    transient."""
    what = f"{doing}: {e.strerror or e}"
    if e.errno in _PERMANENT_ERRNOS:
        remedy = {
            errno.ENOSPC: "free space on the durable mount",
            errno.EROFS: "the mount is read-only; remount it read-write",
        }.get(e.errno or 0, "check the mount's permissions")
        return PermanentStoreError(what, remedy)
    return TransientStoreError(what)


# What only a write can be refused with: raised while copying into a download's file, these
# are its disk's (the box's, or the laptop's for a pull), never the store's object's.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def target_error(e: OSError, doing: str) -> HostError:
    """The error for an OSError on a download's own file: this machine's disk refused it (full,
    out of inodes, read-only, failing). A HostError, not a StoreError: nothing it says about
    the object in the store, so a restore never quarantines a checkpoint for it."""
    # No parentheses of its own: the CLI's line puts the whole remedy in a pair.
    remedy = {
        errno.ENOSPC: "free space and inodes on that disk, df -h and df -i say, then start again",
        errno.EDQUOT: "the disk quota of this user is used up: free some, then start again",
        errno.EROFS: "the filesystem is read-only, perhaps remounted after errors: check dmesg",
    }.get(e.errno or 0, "check that disk in dmesg, then start again")
    return HostError(f"{doing}: {e.strerror or e}", remedy)


@contextlib.contextmanager
def new_download(
    dest: str,
    doing: str,
    fail: Callable[[OSError, str], Exception] = target_error,
    lanes: Optional[Lanes] = None,
) -> Iterator[int]:
    """The file descriptor of ``dest``, a new file a ``get_file`` fills: created O_EXCL and
    O_NOFOLLOW (the caller's staging name is its own, so an existing name, a symlink too, is
    refused rather than written through), fsynced when the block ends, removed when it fails
    (it is ours, so a retry creates it afresh). Opened read-write: a hasher may read back what
    ranged writers have put (base.Lanes). Once ``lanes`` is stopped, CancelledError: a stopped
    restore starts no new file.

    Errors of creating and fsyncing ``dest``, and those only a write can raise (a full disk),
    are this machine's (target_error); any other OSError of the block is mapped by ``fail``:
    the store's error where the block also reads the store's own files (a ``file://`` copy),
    this machine's by default (a network store's errors are mapped before they get here)."""
    if lanes is not None and lanes.stopped:
        raise concurrent.futures.CancelledError()
    where = f"{doing} to {dest}"
    try:
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise PermanentStoreError(
            f"{doing}: {dest} exists already", "a download writes a new file"
        ) from None
    except OSError as e:
        raise target_error(e, where) from None
    done = False
    try:
        try:
            yield fd
        except OSError as e:
            raise (target_error if e.errno in WRITE_ERRNOS else fail)(e, where) from None
        try:
            os.fsync(fd)
        except OSError as e:
            raise target_error(e, where) from None
        done = True
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(dest)


class Lanes:
    """The requests one restore may have in flight, shared by all its downloads: ``n`` threads,
    each running one request (a GET, a ranged GET, a HEAD) at a time. A download waiting on its
    requests holds no lane, so the downloads of many files and the ranged parts of large ones
    share one bound without waiting on each other (no request waits on another: no deadlock).
    After ``stop()`` a request not yet started fails with CancelledError and a running one is
    told (``stopped``) to give up at its next chunk: one failed file ends the others early. A
    request under ``abortable`` (waiting for its answer, or receiving its body) is also cut off
    by ``stop()``: a receive blocked on a stalled connection then ends at once, not at the
    store's read timeout (Ctrl-C during a pull whose network went away). The threads are
    daemons (stall.Daemons): one that no stop reaches (boto3's path, whose requests wait out
    botocore's timeouts, 4 x 60 s) does not hold the process's exit after a stall."""

    def __init__(self, n: int) -> None:
        self._pool = Daemons(n, "rgt-lane")
        self._stop = threading.Event()
        self._aborts: List[Callable[[], None]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        # Under the lock stop() sets the flag under: nothing is queued after close()'s end of
        # the queue, where no worker would ever run it and its caller would wait for ever.
        with self._lock:
            if self._stop.is_set():
                raise concurrent.futures.CancelledError()
            return self._pool.submit(functools.partial(self._guarded, fn, *args))

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        if self._stop.is_set():  # queued before stop(), started after: not sent
            raise concurrent.futures.CancelledError()
        return fn(*args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a lane, waited for."""
        return self.submit(fn, *args).result()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def pause(self, seconds: float) -> None:
        """A retry's backoff, cut short by ``stop()``."""
        self._stop.wait(seconds)

    @contextlib.contextmanager
    def abortable(self, abort: Callable[[], None]) -> Iterator[None]:
        """While the block runs, ``stop()`` calls ``abort`` (from the stopping thread), which
        must make the block's blocked receive fail. Once stopped already, the block is left to
        see ``stopped`` itself (and close what it opened)."""
        with self._lock:
            armed = not self._stop.is_set()
            if armed:
                self._aborts.append(abort)
        try:
            yield
        finally:
            if armed:
                with self._lock:
                    self._aborts.remove(abort)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            aborts = list(self._aborts)
        for abort in aborts:
            with contextlib.suppress(Exception):  # best effort: the read timeout still bounds it
                abort()

    def close(self, wait: bool = True) -> None:
        """Stop, and wait for the requests running (each gives up at its next chunk); with
        ``wait`` false, leave those a stop does not reach (fetch.in_parallel after a stall)."""
        self.stop()
        self._pool.shutdown(wait=wait)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store says about one object."""

    key: str
    size: int
    sha256: Optional[str] = None  # hex, when the store knows it
    etag: Optional[str] = None
    mtime: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a preflight found, for people: ``ok`` false means a warning."""

    ok: bool
    what: str


def check_key(key: str) -> str:
    """``key`` when it cannot escape the root or collide (onbox.common.safepath.safe_rel: the rule
    of every path rgt takes from outside); else UnsafePath, an IntegrityError (exit 6). A
    ``file://`` listing leaves out the names it refuses (no object rgt wrote); what a network
    store lists is checked by whoever uses the key."""
    return safe_rel(key, "store key")


class Store(abc.ABC):
    """A durable store root. See the module docstring for the contract."""

    url: str
    # True when put_file can take sha256=None: the store hashes every byte as it sends it and
    # the server verifies what it received (S3: a CRC32 or Content-MD5 per part, then the
    # whole), so the caller need not read the file once more beforehand. The sha256 comes back
    # in ObjectInfo.
    hashes_while_uploading = False
    # How many put_file calls the sealer makes at once (onbox/sealing/upload.py). 1 where puts
    # must not overlap (the Hub: each put is a commit on the branch's head); a store that takes
    # more bounds what that means for it (S3: requests in flight, part buffers).
    parallel_puts = 1

    @abc.abstractmethod
    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        """Upload the local file ``path`` (``size`` bytes, ``sha256`` hex) and verify it;
        ``sha256=None`` only where ``hashes_while_uploading``."""

    @abc.abstractmethod
    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        """Write a small object (a manifest, LATEST, state) atomically; ``if_absent`` only when
        absent, ``if_match`` only while it is still the version ``get_versioned`` returned
        (PreconditionFailed else). The ObjectInfo's etag is the new version."""

    # True where put_data is the store's own (the sealer then reads a small file once); else
    # the sealer puts every file with put_file.
    puts_data = False

    def put_data(self, key: str, data: bytes, sha256: str) -> ObjectInfo:
        """Put a checkpoint file already read into memory (``data``, whose sha256 the caller
        took), as ``put_file`` would put it from disk: the sealer reads a small file once,
        hashes it to find duplicates, and hands the same bytes here (no second read, no second
        hash where the store can take the caller's). Only where ``puts_data``."""
        return self.put_bytes(key, data)

    @abc.abstractmethod
    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        """A small object's bytes and its version (what ``put_bytes(if_match=...)`` takes),
        read together; None when absent."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> Optional[bytes]:
        """A small object's bytes, or None when absent."""

    @abc.abstractmethod
    def get_file(self, key: str, dest: str) -> None:
        """Download ``key`` to ``dest``, a new file: created with O_EXCL and O_NOFOLLOW (an
        existing name, a symlink too, is a PermanentStoreError). The caller downloads to a
        temporary name under a directory of its own and verifies before renaming."""

    def fetch_file(
        self, key: str, dest: str, *, size: Optional[int] = None, lanes: Optional[Lanes] = None
    ) -> Optional[str]:
        """``get_file`` for a restore, fsynced once at the end: returns the sha256 (hex) of the
        bytes written, computed while writing them, or None where this store cannot (the
        caller reads the file back). ``size``: what the caller expects (a MANIFEST's): it may
        save a request, and a store that learns the object's size before its bytes (S3, a
        directory, the Hub) refuses another one with IntegrityError, so that an object larger than
        sealed cannot fill the target; the caller still checks what was written. ``lanes``:
        the requests in flight, shared with the caller's other downloads (else the store's
        own). CancelledError once ``lanes`` is stopped. This default is ``get_file`` (files in
        parallel are the caller's pool)."""
        if lanes is not None and lanes.stopped:
            raise concurrent.futures.CancelledError()
        self.get_file(key, dest)
        return None

    def plan_fetch(self, sizes: Mapping[str, int]) -> None:
        """Said before a restore's or a pull's ``fetch_file`` of every key in ``sizes`` (key ->
        the size the MANIFEST gives it): a store that learns every size at once where it would
        otherwise ask once per file (the Hub: one ``paths-info`` for all, against a HEAD per
        file) does so here, so that each fetch finds its answer ready. Best effort: it raises
        nothing, and what it could not learn each fetch asks for itself. This default: nothing
        (S3 needs no request of its own for the size, a directory no round trip)."""
        return None

    @abc.abstractmethod
    def stat(self, key: str) -> Optional[ObjectInfo]:
        """What the store says about ``key``, or None when absent."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine."""

    @abc.abstractmethod
    def preflight(self, run: str) -> List[Finding]:
        """Prove the store works for ``run`` before training starts (write, read back, compare,
        delete under ``run/``); raise StoreError naming the step that failed."""

    @contextlib.contextmanager
    def calls_bounded(self, seconds: float, longer: str = "") -> Iterator[None]:
        """While entered, a call that may block far longer than a user waits (a ``file://``
        store's on a hung mount, an S3 store's whose server stopped answering) gives up after
        ``seconds``, its error saying ``longer`` (hangbound.py); a store without the bound
        changes nothing."""
        yield

    def bound_calls(self, seconds: float, longer: str = "") -> None:
        """As ``calls_bounded``, for the rest of this store's life."""
        return None  # no bound here: hangbound.py's

    def abort_stale_uploads(self, prefix: str) -> int:
        """Abort half-finished uploads under ``prefix`` left by a dead writer; how many."""
        return 0

    def same_filesystem_as(self, path: str) -> bool:
        """Whether the store lives on the filesystem holding ``path`` (so it is not durable)."""
        return False

    def clock_skew(self) -> Optional[float]:
        """The store's clock minus this box's, in seconds, from the server's ``Date`` where the
        store has one (S3); None where it cannot say (a mount's clock is this box's own)."""
        return None


def with_retries(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    base: float = 0.5,
    cap: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn``; retry TransientStoreError with exponential backoff, nothing else. A
    ``StoreHung`` is raised at once: the store already had the whole bound the user set
    (stores/hangbound.py) and is no hiccup a retry outlasts, and while its call is still hung
    each retry fails at once anyway, so the backoffs only added to the wait (a 3 s bound took
    12 s)."""
    for n in range(attempts):
        try:
            return fn()
        except StoreHung:
            raise
        except TransientStoreError:
            if n == attempts - 1:
                raise
            sleep(min(cap, base * 2**n))
    raise AssertionError("unreachable")
