"""Downloads of an S3 store: an object up to WHOLE_MAX in one GET (no HEAD first when the
caller's expected size says it is no larger), a larger one in ranged GETs in parallel, every
range pinned to the ETag the HEAD saw (``If-Match``), so an object replaced during the
download fails it (transient: a retry fetches the new one whole).

Every request runs in a lane of the caller's ``Lanes`` (base.py), so one restore's files and
the parts of its large files share one bound on requests in flight. The sha256 is computed
while the bytes arrive: a single GET hashes each chunk before it writes it; the parts of a
ranged download receive into buffers of one in-order hasher (``_InOrder``), which the file's own
thread hashes in file order as they are handed over (what arrives ahead of the hashed prefix
waits in its buffer, bounded): nothing is copied, nothing is read back from the disk.

Where the store has a lean reader (lean.py, on wire.py's connections) every GET is sent there
and its body received straight into a reused buffer (a lane's own, kept from one file to the
next), from which it is hashed and written: one copy of every byte in this process, where
boto3's streamed body makes three. An
object of DIRECT_MIN or more is written past the page cache where the filesystem allows it
(O_DIRECT, onbox.common.writeback): on a box the server or the training job shares, allocating,
filling, writing back and reclaiming a GiB of page cache costs more CPU than the download
itself, and the fsync at the end then has only the file's tail and metadata left. Otherwise
every stretch written is handed to the disk at once (writeback), so the fsync finds little.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import botocore.exceptions as bex

from onbox.common.errors import (
    IntegrityError,
    PermanentStoreError,
    PreconditionFailed,
    TransientStoreError,
)
from onbox.common.writeback import Direct, Writeback, open_direct
from onbox.sealing.stores.base import Lanes, new_download
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code
from onbox.sealing.stores.s3.multipart import MiB
from onbox.sealing.stores.s3.wire import Cut

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

STREAM_CHUNK = 4 * MiB  # one request's buffer: large writes keep a direct write's waits few
# One GET for an object up to this size; a larger one in ranges of RANGE (at most MAX_RANGES
# of them), several in flight. What arrives ahead of the hashed prefix stays in its buffers
# (KEEP_MAX at most per file) rather than being read back from the disk.
WHOLE_MAX = 256 * MiB
RANGE = 16 * MiB
MAX_RANGES = 10000
KEEP_MAX = 160 * MiB
Reader = Callable[[memoryview], int]
# An object of at least this size, fetched whole, is written past the page cache (O_DIRECT,
# onbox.common.writeback): see the module docstring. A 1 MiB file is already cheaper so: 1,000
# of them restored with 2.0 s of client CPU against 3.1 s through the page cache (bench/README).
DIRECT_MIN = 1 * MiB


def download(
    store: S3Store, key: str, dest: str, size: Optional[int], lanes: Optional[Lanes]
) -> str:
    """``store.fetch_file``: ``key`` into ``dest``, a new file (base.new_download); its sha256."""
    if lanes is not None:
        return _download(store, key, dest, size, lanes)
    own = Lanes(store.concurrency)
    try:
        return _download(store, key, dest, size, own)
    finally:
        own.close()


def _download(store: S3Store, key: str, dest: str, expect: Optional[int], lanes: Lanes) -> str:
    full = store.full_key(key)
    doing = f"downloading {store.url}/{key}"
    with new_download(dest, doing, lanes=lanes) as fd:  # a new file, never through a symlink
        if expect is not None and expect <= WHOLE_MAX:
            # Small by the MANIFEST: one GET (a HEAD first would double the requests of a
            # many-file restore), refused unread when the store answers another size.
            return lanes.run(_get_whole, store, doing, full, fd, lanes, dest, expect, True)
        head = lanes.run(_head, store, doing, full, lanes)
        if head is None:
            raise PermanentStoreError(f"{key} is not in {store.url}")
        size = int(head["ContentLength"])
        if expect is not None and size != expect:  # not fetched: it could fill the target
            raise IntegrityError(
                f"{doing}: {size} bytes in the store, the MANIFEST says {expect} bytes",
                "the object in the store is not the one sealed, damaged or replaced: "
                "nothing of it was kept",
            )
        version = str(head.get("ETag") or "")
        if size <= WHOLE_MAX:
            return lanes.run(_get_whole, store, doing, full, fd, lanes, dest, size)
        return _get_ranged(store, doing, full, version, (fd, dest), size, lanes)


def _open(
    store: S3Store, doing: str, full: str, headers: Dict[str, str], lanes: Lanes
) -> Optional[Tuple[Optional[int], Reader, Callable[[], None], Callable[[], None]]]:
    """GET ``full`` (``headers``: Range, If-Match): (the body's length, a reader of it into a
    buffer, its close, its cut from another thread: a no-op on boto3's), on the lean reader
    where the store has one, else boto3's; None where the object is missing. On the lean
    reader a stop of ``lanes`` while the answer is awaited ends the wait at once (the body's
    receive is the caller's to put under ``lanes.abortable`` with the cut)."""
    lean = store.lean_reader()
    if lean is None:
        kwargs: Dict[str, Any] = {"Key": full}
        if "Range" in headers:
            kwargs["Range"] = headers["Range"]
        if "If-Match" in headers:
            kwargs["IfMatch"] = headers["If-Match"]
        r = store.call_missing_ok(doing, "get_object", **kwargs)
        if r is None:
            return None
        body = r["Body"]

        def read(view: memoryview) -> int:
            chunk = body.read(len(view))
            view[: len(chunk)] = chunk
            return len(chunk)

        length = r.get("ContentLength")
        return (None if length is None else int(length)), read, body.close, _nothing
    cut = Cut()
    answer = _lean(store, doing, lanes, cut, lambda: lean.open_get(full, headers, cut))
    if answer is None:
        return None
    return answer.length, answer.readinto, answer.close, cut.cut


def _head(store: S3Store, doing: str, full: str, lanes: Lanes) -> Optional[Dict[str, Any]]:
    """HEAD ``full`` (``ContentLength``, ``ETag``), on the lean reader where the store has one
    (so that a stop of ``lanes`` ends a HEAD the store never answers, as it ends a GET's wait),
    else boto3's; None where the object is missing."""
    lean = store.lean_reader()
    if lean is None:
        head: Optional[Dict[str, Any]] = store.call_missing_ok(doing, "head_object", Key=full)
        return head
    cut = Cut()
    got: Optional[Dict[str, Any]] = _lean(store, doing, lanes, cut, lambda: lean.head(full, cut))
    return got


def _lean(store: S3Store, doing: str, lanes: Lanes, cut: Cut, send: Callable[[], Any]) -> Any:
    """``send()``, one lean request made with ``cut``, which a stop of ``lanes`` pulls while
    it waits (a store that never answers ends the wait at once); its errors mapped as boto3's
    would be, None where the object is missing."""
    try:
        with lanes.abortable(cut.cut):
            if lanes.stopped:  # stopped before the cut was armed: nothing is sent
                raise concurrent.futures.CancelledError()
            return send()
    except bex.ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise client_error(store, e, doing) from None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None


def _nothing() -> None:
    pass


def _get_whole(
    store: S3Store,
    doing: str,
    full: str,
    fd: int,
    lanes: Lanes,
    dest: str,
    size: int,
    sealed: bool = False,
) -> str:
    """One GET of the whole object into ``fd`` (``dest``, of ``size`` bytes by a HEAD, or by
    the MANIFEST where ``sealed``), hashed as it is written; its sha256. Never more than one
    byte past ``size`` is received: a store's object larger than what it was sealed as (or
    than its HEAD said a moment before) cannot fill the disk it is downloaded to. Where
    ``sealed`` and the store answers with another length, IntegrityError before any byte."""
    got = _open(store, doing, full, {}, lanes)
    if got is None:
        raise PermanentStoreError(f"{doing}: the object is not in the store")
    length, read, close, abort = got
    if sealed and length is not None and length != size:
        close()
        raise IntegrityError(
            f"{doing}: {length} bytes in the store, the MANIFEST says {size} bytes",
            "the object in the store is not the one sealed, damaged or replaced: "
            "nothing of it was kept",
        )
    h = hashlib.sha256()
    direct = open_direct(dest, fd) if size >= DIRECT_MIN else None
    try:
        with lanes.abortable(abort):  # a stop cuts a stalled receive short
            done = _stream(
                store, doing, read, close, fd, 0, lambda: lanes.stopped, h.update, direct, size + 1
            )
    finally:
        if direct is not None:
            direct.close()
    if length is not None and done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")
    return h.hexdigest()


class _InOrder:
    """The sha256 of a file whose ranged parts arrive at once, each in order, computed in file
    order by the file's own thread (``run``) from the very buffers the parts received into:
    a part takes a buffer from here for each chunk (``take``), writes it to the file, and hands
    it over (``give``); once hashed it is free for the next chunk. Nothing is copied and nothing
    is read back from the disk, and no part waits while another hashes. At most ``limit``
    buffers exist, so what arrives ahead of the hashed prefix is bounded; the chunk at the
    prefix's end never waits for one (the lanes start parts in file order, so its part is
    running), so the bound cannot stall the download."""

    def __init__(
        self,
        size: int,
        make: Callable[[], memoryview],
        limit: int,
        stop: Callable[[], bool],
        drop: Callable[[memoryview], None] = lambda buf: None,
    ) -> None:
        self.size = size
        self.make = make
        self.drop = drop  # frees a buffer of ``make`` at once (one a Direct writer mapped)
        self.limit = limit
        self.stop = stop
        self.made = 0
        self.free: List[memoryview] = []
        self.ready: Dict[int, Tuple[memoryview, int]] = {}  # offset -> (buffer, bytes in it)
        self.offset = 0  # hashed up to here
        self.cond = threading.Condition()

    def take(self, at: int) -> memoryview:
        """A buffer for the chunk at ``at``, waited for while ``limit`` are out."""
        with self.cond:
            while not self.free:
                if self.made < self.limit or at == self.offset:
                    self.made += 1
                    break
                if self.stop():
                    raise concurrent.futures.CancelledError()
                self.cond.wait(0.5)
            else:
                return self.free.pop()
        return self.make()

    def give(self, at: int, buf: memoryview, n: int) -> None:
        """The chunk at ``at``: ``n`` bytes of ``buf`` (0: the buffer was not used)."""
        with self.cond:
            if n:
                self.ready[at] = (buf, n)
            else:
                self._release(buf)
            self.cond.notify_all()

    def _release(self, buf: memoryview) -> None:
        """A buffer back to the free ones, or dropped while more than ``limit`` exist (those
        made for the prefix's chunk beyond the bound)."""
        if self.made > self.limit:
            self.made -= 1
            self.drop(buf)
        else:
            self.free.append(buf)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def run(self) -> Optional[str]:
        """Hash the chunks in file order as they are given; the sha256, or None once stopped."""
        h = hashlib.sha256()
        while self.offset < self.size:
            with self.cond:
                while self.offset not in self.ready:
                    if self.stop():
                        return None
                    self.cond.wait(0.5)
                buf, n = self.ready.pop(self.offset)
            h.update(buf[:n])
            with self.cond:
                self.offset += n
                self._release(buf)
                self.cond.notify_all()
        return h.hexdigest()


def _get_ranged(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    file: Tuple[int, str],
    size: int,
    lanes: Lanes,
) -> str:
    """Ranged GETs in the lanes, hashed in file order as they arrive (``file``: the
    descriptor and path written). Every part is over (done, failed, or never started) before
    this returns or raises: none writes to the file after."""
    fd, dest = file
    direct = open_direct(dest, fd)
    try:
        return _ranges(store, doing, full, version, fd, size, lanes, direct)
    finally:
        if direct is not None:
            direct.close()


def _ranges(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    fd: int,
    size: int,
    lanes: Lanes,
    direct: Optional[Direct],
) -> str:
    part = max(RANGE, -(-size // MAX_RANGES))
    count = -(-size // part)
    halt = threading.Event()  # this file's parts give up: another part failed

    def stop() -> bool:
        return halt.is_set() or lanes.stopped

    limit = KEEP_MAX // STREAM_CHUNK
    if direct is not None:
        hasher = _InOrder(size, lambda: direct.buffer(STREAM_CHUNK), limit, stop, direct.free)
    else:
        hasher = _InOrder(size, lambda: memoryview(bytearray(STREAM_CHUNK)), limit, stop)

    def on_done(fut: concurrent.futures.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            halt.set()
            hasher.wake()

    futures: List[concurrent.futures.Future[None]] = []
    digest = None
    try:
        for n in range(count):
            length = min(part, size - n * part)
            fut = lanes.submit(
                _get_range, store, doing, full, version, (fd, direct), (n * part, length),
                hasher, stop, lanes,
            )  # fmt: skip
            fut.add_done_callback(on_done)
            futures.append(fut)
        digest = hasher.run()
    finally:  # all done; or one failed (or this thread was interrupted): the rest give up
        halt.set()
        for fut in futures:
            fut.cancel()
        concurrent.futures.wait(futures)
    errors = [None if f.cancelled() else f.exception() for f in futures]
    for e in errors:  # the first real failure, in file order
        if e is not None and not isinstance(e, concurrent.futures.CancelledError):
            raise e
    if digest is None or any(f.cancelled() for f in futures):
        raise concurrent.futures.CancelledError()  # the lanes were stopped
    return digest


def _get_range(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    file: Tuple[int, Optional[Direct]],
    where: Tuple[int, int],
    hasher: _InOrder,
    stop: Callable[[], bool],
    lanes: Lanes,
) -> None:
    """The range ``where`` (offset, length) of the object into ``file`` (its descriptor, and
    its direct writer where it has one), each chunk received into a buffer of ``hasher``'s and
    handed to it; a stalled receive cut short when ``lanes`` stop."""
    fd, direct = file
    offset, length = where
    if stop():
        raise concurrent.futures.CancelledError()
    headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
    if version:
        headers["If-Match"] = version  # every range from the same object, even if it is replaced
    try:
        got = _open(store, doing, full, headers, lanes)
    except PreconditionFailed:
        raise TransientStoreError(f"{doing}: the object was replaced during the download") from None
    if got is None:
        raise TransientStoreError(f"{doing}: the object was removed during the download")
    answered, read, close, abort = got
    if answered is not None and answered != length:  # e.g. a proxy that drops Range: 200, all
        close()
        raise TransientStoreError(
            f"{doing}: asked for {length} bytes at {offset}, the store answered {answered}"
        )
    with lanes.abortable(abort):
        done = _stream(store, doing, read, close, fd, offset, stop, hasher, direct, length)
    if done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")


_scratch = threading.local()


def _own_buffer() -> memoryview:
    """The buffer of a request that hashes as it goes (each chunk is written and hashed
    before it reads the next): the calling thread's own, made once and reused by every such
    request the thread runs (a lane runs one at a time); page-aligned, so a direct write
    takes it as it is. A restore of many small files would otherwise allocate, zero and
    free a STREAM_CHUNK per file, which cost more CPU than receiving them."""
    buf: Optional[memoryview] = getattr(_scratch, "buf", None)
    if buf is None:
        # Private: an anonymous shared mapping is shmem, dearer to fault in and to free.
        buf = _scratch.buf = memoryview(mmap.mmap(-1, STREAM_CHUNK, flags=mmap.MAP_PRIVATE))
    return buf


def _stream(
    store: S3Store,
    doing: str,
    read: Reader,
    close: Callable[[], None],
    fd: int,
    offset: int,
    stop: Callable[[], bool],
    hashing: Union[Callable[[memoryview], None], _InOrder],
    direct: Optional[Direct] = None,
    length: Optional[int] = None,
) -> int:
    """A body (``read`` into a buffer, ``close``d at the end) into ``fd`` from ``offset`` on,
    chunk by chunk, each written by ``direct`` where there is one, else through the page cache
    (handed to the disk by stretches), and hashed: given to ``hashing`` before it is written,
    or, an _InOrder, received into one of its buffers and handed over once written. A body of
    ``length`` (a range) is not read past it. CancelledError once ``stop()``. The bytes
    written."""
    pool = hashing if isinstance(hashing, _InOrder) else None
    feed = None if isinstance(hashing, _InOrder) else hashing
    own = _own_buffer() if pool is None else None
    done = 0
    flush = Writeback(fd, offset)
    try:
        while length is None or done < length:
            if stop():
                raise concurrent.futures.CancelledError()
            buf = pool.take(offset + done) if pool is not None else own
            assert buf is not None
            got = read(buf)
            if not got:
                if pool is not None:
                    pool.give(offset + done, buf, 0)
                break
            chunk, at = buf[:got], done
            if feed is not None:
                feed(chunk)
            if direct is not None:
                k = direct.write(chunk, offset + done)
                chunk, done = chunk[k:], done + k
                if k:
                    flush.passed(k)
            while chunk:
                k = os.pwrite(fd, chunk, offset + done)
                chunk = chunk[k:]
                done += k
                flush.wrote(k)
            if pool is not None:
                pool.give(offset + at, buf, got)
        return done
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    finally:
        close()
