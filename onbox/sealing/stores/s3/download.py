"""Downloads of an S3 store: an object up to the multipart threshold in one GET (no HEAD first
when the caller's expected size says it is small), a larger one in ranged GETs in parallel,
every range pinned to the ETag the HEAD saw (``If-Match``), so an object replaced during the
download fails it (transient: a retry fetches the new one whole).

Every request runs in a lane of the caller's ``Lanes`` (base.py), so one restore's files and
the parts of its large files share one bound on requests in flight. The sha256 is computed
while the bytes arrive: a single GET hashes each chunk it writes; a ranged download is hashed by
the downloading thread itself, which follows the parts' writers along the file's contiguous
prefix and reads back what they wrote (just written: from the page cache), so when the last
part lands only its tail is left to hash.

Where the store has a lean reader (lean.py, on wire.py's connections) every GET is sent there
and its body received straight into one reused buffer per request, from which it is hashed and
written: one copy of every byte in this process, where boto3's streamed body makes three. Every
stretch written is handed to the disk at once (onbox.common.writeback), so each file's fsync
at its end finds little left to write. Objects up to WHOLE_MAX come in one GET; larger ones in
ranges of at least RANGE_MIN (fewer, longer requests: each costs a request's CPU on both ends).
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
from onbox.common.writeback import Writeback
from onbox.sealing.stores.base import Lanes, new_download
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code
from onbox.sealing.stores.s3.multipart import MiB, part_size_for

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

STREAM_CHUNK = MiB
HASH_CHUNK = 8 * MiB  # reads of the follower: large, so hashlib runs long with the GIL released
# One GET for an object up to this size (its bytes hashed as they arrive, nothing read back);
# a larger one in ranges of at least RANGE_MIN, the order of s5cmd's 50 MiB parts.
WHOLE_MAX = 256 * MiB
RANGE_MIN = 64 * MiB
Reader = Callable[[memoryview], int]


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
            return lanes.run(_get_whole, store, doing, full, fd, lanes)
        head = lanes.run(functools.partial(store.call_missing_ok, doing, "head_object", Key=full))
        if head is None:
            raise PermanentStoreError(f"{key} is not in {store.url}")
        size = int(head["ContentLength"])
        version = str(head.get("ETag") or "")
        if size <= WHOLE_MAX:
            return lanes.run(_get_whole, store, doing, full, fd, lanes)
        return _get_ranged(store, doing, full, version, fd, size, lanes)


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


def _get_whole(store: S3Store, doing: str, full: str, fd: int, lanes: Lanes) -> str:
    """One GET of the whole object into ``fd``, hashed as it is written; its sha256."""
    got = _open(store, doing, full, {})
    if got is None:
        raise PermanentStoreError(f"{doing}: the object is not in the store")
    length, read, close = got
    h = hashlib.sha256()
    done = _stream(store, doing, read, close, fd, 0, lambda: lanes.stopped, h.update)
    if length is not None and done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")
    return h.hexdigest()


def _no_hash(chunk: memoryview) -> None:
    """A ranged part is hashed by the follower, in file order, not as it arrives."""


class _Prefix:
    """What the parts of a ranged download have written, part by part (each part's bytes
    arrive in order), for the follower that hashes the file's contiguous prefix."""

    def __init__(self, part: int, count: int) -> None:
        self.part = part
        self.done = [0] * count
        self.failed = False
        self.cond = threading.Condition()

    def wrote(self, n: int, total: int) -> None:
        with self.cond:
            self.done[n] = total
            self.cond.notify()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify()

    def ready(self, offset: int) -> int:
        """Bytes from ``offset`` on that are written (0 after a failure), waited for."""
        with self.cond:
            while True:
                if self.failed:
                    return 0
                n = offset // self.part
                have = n * self.part + self.done[n] - offset
                if have > 0:
                    return have
                self.cond.wait()


def _get_ranged(
    store: S3Store, doing: str, full: str, version: str, fd: int, size: int, lanes: Lanes
) -> str:
    """Ranged GETs in the lanes; this thread hashes behind them. Every part is over (done,
    failed, or never started) before this returns or raises: none writes to ``fd`` after."""
    part = max(store.part_size or part_size_for(size), RANGE_MIN)
    count = -(-size // part)
    prefix = _Prefix(part, count)
    halt = threading.Event()  # this file's parts give up: another part failed

    def stop() -> bool:
        return halt.is_set() or lanes.stopped

    def on_done(fut: concurrent.futures.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            prefix.fail()

    futures: List[concurrent.futures.Future[None]] = []
    try:
        for n in range(count):
            length = min(part, size - n * part)
            fut = lanes.submit(
                _get_range, store, doing, full, version, fd, (n, n * part, length), prefix, stop
            )
            fut.add_done_callback(on_done)
            futures.append(fut)
        h, offset = hashlib.sha256(), 0
        while offset < size:
            have = prefix.ready(offset)
            if not have:
                break
            data = os.pread(fd, min(have, HASH_CHUNK), offset)
            if not data:
                raise TransientStoreError(f"{doing}: the file shrank under its writers")
            h.update(data)
            offset += len(data)
    finally:
        halt.set()
        for fut in futures:
            fut.cancel()
        concurrent.futures.wait(futures)
    errors = [None if f.cancelled() else f.exception() for f in futures]
    for e in errors:  # the first real failure, in file order
        if e is not None and not isinstance(e, concurrent.futures.CancelledError):
            raise e
    if offset < size:  # a part was cancelled: the lanes were stopped
        raise concurrent.futures.CancelledError()
    return h.hexdigest()


def _get_range(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    fd: int,
    where: Tuple[int, int, int],
    prefix: _Prefix,
    stop: Callable[[], bool],
) -> None:
    """Part ``n`` (``where``: n, offset, length) of the object into ``fd``."""
    n, offset, length = where
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
    done = _stream(store, doing, read, close, fd, offset, stop, _no_hash, prefix.wrote, n)
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
    progress: Optional[Callable[[int, int], None]] = None,
    part: int = 0,
) -> int:
    """A body (``read`` into a buffer, ``close``d at the end) into ``fd`` from ``offset`` on,
    chunk by chunk: each given to ``hash_chunk``, written, handed to the disk by stretches
    (writeback), and its running total to ``progress(part, total)``; CancelledError once
    ``stop()``. The bytes written."""
    done = 0
    buf = memoryview(bytearray(STREAM_CHUNK))
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
            while chunk:
                k = os.pwrite(fd, chunk, offset + done)
                chunk = chunk[k:]
                done += k
                flush.wrote(k)
            if progress is not None:
                progress(part, done)
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    finally:
        close()
