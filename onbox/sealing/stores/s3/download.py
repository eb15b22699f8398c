"""Downloads of an S3 store: an object up to WHOLE_MAX in one GET (no HEAD first when the
caller's expected size says it is no larger), a larger one in ranged GETs in parallel, every
range pinned to the ETag the HEAD saw (``If-Match``), so an object replaced during the
download fails it (transient: a retry fetches the new one whole).

Every request runs in a lane of the caller's ``Lanes`` (base.py), so one restore's files and
the parts of its large files share one bound on requests in flight. The sha256 is computed
while the bytes arrive: a single GET hashes each chunk before it writes it; the parts of a
ranged download hand their chunks to one in-order hasher (``_InOrder``), which hashes the chunk
at the end of the hashed prefix at once and keeps (in memory, bounded) what arrives ahead of it:
nothing is read back from the disk.

Where the store has a lean reader (lean.py, on wire.py's connections) every GET is sent there
and its body received straight into one reused buffer per request, from which it is hashed and
written: one copy of every byte in this process, where boto3's streamed body makes three. An
object of DIRECT_MIN or more is written past the page cache where the filesystem allows it
(O_DIRECT, onbox.common.writeback): on a box the server or the training job shares, allocating,
filling, writing back and reclaiming a GiB of page cache costs more CPU than the download
itself, and the fsync at the end then has only the file's tail and metadata left. Otherwise
every stretch written is handed to the disk at once (writeback), so the fsync finds little.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import botocore.exceptions as bex

from onbox.common.errors import PermanentStoreError, PreconditionFailed, TransientStoreError
from onbox.common.writeback import Direct, Writeback, open_direct
from onbox.sealing.stores.base import Lanes, new_download
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code
from onbox.sealing.stores.s3.multipart import MiB

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

STREAM_CHUNK = 4 * MiB  # one request's buffer: large writes keep a direct write's waits few
# One GET for an object up to this size; a larger one in ranges of RANGE (at most MAX_RANGES
# of them), several in flight. Ranges are small so that the parts in flight are near the
# hashed prefix: what arrives ahead of it is kept in memory (KEEP_MAX at most per file) rather
# than read back from the disk.
WHOLE_MAX = 256 * MiB
RANGE = 16 * MiB
MAX_RANGES = 10000
KEEP_MAX = 160 * MiB
Reader = Callable[[memoryview], int]
# An object of at least this size, fetched whole, is written past the page cache (O_DIRECT,
# onbox.common.writeback): see the module docstring.
DIRECT_MIN = 8 * MiB


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
            # Small by the MANIFEST: one GET, whatever its real size (a wrong size is the
            # caller's to find); a HEAD first would double the requests of a many-file restore.
            return lanes.run(_get_whole, store, doing, full, fd, lanes, dest, expect)
        head = lanes.run(functools.partial(store.call_missing_ok, doing, "head_object", Key=full))
        if head is None:
            raise PermanentStoreError(f"{key} is not in {store.url}")
        size = int(head["ContentLength"])
        version = str(head.get("ETag") or "")
        if size <= WHOLE_MAX:
            return lanes.run(_get_whole, store, doing, full, fd, lanes, dest, size)
        return _get_ranged(store, doing, full, version, (fd, dest), size, lanes)


def _open(
    store: S3Store, doing: str, full: str, headers: Dict[str, str]
) -> Optional[Tuple[Optional[int], Reader, Callable[[], None]]]:
    """GET ``full`` (``headers``: Range, If-Match): (the body's length, a reader of it into a
    buffer, its close), on the lean reader where the store has one, else boto3's; None where
    the object is missing."""
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
        return (None if length is None else int(length)), read, body.close
    try:
        answer = lean.open_get(full, headers)
    except bex.ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise client_error(store, e, doing) from None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    return answer.length, answer.readinto, answer.close


def _get_whole(
    store: S3Store, doing: str, full: str, fd: int, lanes: Lanes, dest: str, size: int
) -> str:
    """One GET of the whole object into ``fd`` (``dest``, of about ``size`` bytes), hashed as
    it is written; its sha256."""
    got = _open(store, doing, full, {})
    if got is None:
        raise PermanentStoreError(f"{doing}: the object is not in the store")
    length, read, close = got
    h = hashlib.sha256()
    direct = open_direct(dest, fd) if size >= DIRECT_MIN else None
    try:
        done = _stream(store, doing, read, close, fd, 0, lambda: lanes.stopped, h.update, direct)
    finally:
        if direct is not None:
            direct.close()
    if length is not None and done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")
    return h.hexdigest()


class _InOrder:
    """The sha256 of a file whose ranged parts arrive at once, each in order: a chunk at the
    end of the hashed prefix is hashed by the thread that brings it (with the kept chunks that
    follow it); one further on is kept, a copy, until the prefix reaches it. Nothing is read
    back from the disk. The lanes start parts in file order, so the prefix's end is always in
    a running part, which never waits here; a part whose chunks would keep more than KEEP_MAX
    waits for the prefix (its connection stalls meanwhile), so memory stays bounded."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self.h = hashlib.sha256()
        self.offset = 0
        self.kept: Dict[int, bytes] = {}
        self.held = 0
        self.stop = stop
        self.cond = threading.Condition()

    def feeder(self, start: int) -> Callable[[memoryview], None]:
        """What a part starting at ``start`` hands each chunk to, in its order."""
        at = [start]

        def feed(chunk: memoryview) -> None:
            self.feed(at[0], chunk)
            at[0] += len(chunk)

        return feed

    def feed(self, offset: int, chunk: memoryview) -> None:
        with self.cond:
            while offset != self.offset and self.held + len(chunk) > KEEP_MAX:
                if self.stop():
                    raise concurrent.futures.CancelledError()
                self.cond.wait(0.5)
            if offset != self.offset:
                self.kept[offset] = bytes(chunk)
                self.held += len(chunk)
                return
            self.h.update(chunk)
            self.offset += len(chunk)
            while self.offset in self.kept:
                data = self.kept.pop(self.offset)
                self.held -= len(data)
                self.h.update(data)
                self.offset += len(data)
            self.cond.notify_all()


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

    hasher = _InOrder(stop)

    def on_done(fut: concurrent.futures.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            halt.set()
            with hasher.cond:
                hasher.cond.notify_all()

    futures: List[concurrent.futures.Future[None]] = []
    try:
        for n in range(count):
            length = min(part, size - n * part)
            fut = lanes.submit(
                _get_range, store, doing, full, version, (fd, direct), (n * part, length),
                hasher.feeder(n * part), stop,
            )  # fmt: skip
            fut.add_done_callback(on_done)
            futures.append(fut)
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    finally:  # all done; or one failed (or this thread was interrupted): the rest give up
        halt.set()
        for fut in futures:
            fut.cancel()
        concurrent.futures.wait(futures)
    errors = [None if f.cancelled() else f.exception() for f in futures]
    for e in errors:  # the first real failure, in file order
        if e is not None and not isinstance(e, concurrent.futures.CancelledError):
            raise e
    if hasher.offset < size or any(f.cancelled() for f in futures):
        raise concurrent.futures.CancelledError()  # the lanes were stopped
    return hasher.h.hexdigest()


def _get_range(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    file: Tuple[int, Optional[Direct]],
    where: Tuple[int, int],
    feed: Callable[[memoryview], None],
    stop: Callable[[], bool],
) -> None:
    """The range ``where`` (offset, length) of the object into ``file`` (its descriptor, and
    its direct writer where it has one), each chunk handed to ``feed`` (the file's hash)."""
    fd, direct = file
    offset, length = where
    if stop():
        raise concurrent.futures.CancelledError()
    headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
    if version:
        headers["If-Match"] = version  # every range from the same object, even if it is replaced
    try:
        got = _open(store, doing, full, headers)
    except PreconditionFailed:
        raise TransientStoreError(f"{doing}: the object was replaced during the download") from None
    if got is None:
        raise TransientStoreError(f"{doing}: the object was removed during the download")
    _, read, close = got
    done = _stream(store, doing, read, close, fd, offset, stop, feed, direct)
    if done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")


def _stream(
    store: S3Store,
    doing: str,
    read: Reader,
    close: Callable[[], None],
    fd: int,
    offset: int,
    stop: Callable[[], bool],
    hash_chunk: Callable[[memoryview], None],
    direct: Optional[Direct] = None,
) -> int:
    """A body (``read`` into a buffer, ``close``d at the end) into ``fd`` from ``offset`` on,
    chunk by chunk: each given to ``hash_chunk``, then written (by ``direct`` where there is
    one, else through the page cache, handed to the disk by stretches); CancelledError once
    ``stop()``. The bytes written."""
    done = 0
    buf = direct.buffer(STREAM_CHUNK) if direct is not None else memoryview(bytearray(STREAM_CHUNK))
    flush = Writeback(fd, offset)
    try:
        while True:
            if stop():
                raise concurrent.futures.CancelledError()
            got = read(buf)
            if not got:
                return done
            chunk = buf[:got]
            hash_chunk(chunk)
            if direct is not None:
                k = direct.write(chunk, offset + done)
                chunk, done = chunk[k:], done + k
            while chunk:
                k = os.pwrite(fd, chunk, offset + done)
                chunk = chunk[k:]
                done += k
                flush.wrote(k)
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    finally:
        close()
