"""Multipart uploads of an S3 store: the part size, reading a file's parts (a short read means it
shrank under us), sending them from a thread pool with bounded memory, completing the upload
and checking the store's composite answer. Any failure aborts the upload, so nothing is left
under the key (a multipart upload is atomic at completion).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import botocore.exceptions as bex

from onbox.common.errors import IntegrityError, PermanentStoreError
from onbox.sealing.stores.base import ObjectInfo
from onbox.sealing.stores.s3.checksums import (
    SHA256_META,
    SSE_ETAGS,
    b64,
    checked_crc32,
    composite,
    digest,
    etag,
    header,
)
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

MiB = 1 << 20
MULTIPART_THRESHOLD = 8 * MiB  # at most this: one put_object
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
MAX_PARTS = 10000  # S3's most parts in one upload
# Parts in flight are held in memory; bound them so a 5 TiB object cannot take the box's RAM.
MAX_INFLIGHT_BYTES = 576 * MiB


def part_size_for(size: int) -> int:
    """Part size for an object of ``size`` bytes: about 64 parts, 8..64 MiB each (16 MiB for
    1 GiB), larger only where 10000 parts would not hold the object; whole MiB."""
    target = min(max(size // 64, 8 * MiB), 64 * MiB)
    need = -(-size // MAX_PARTS)
    part = max(target, need)
    return -(-part // MiB) * MiB


def _shrank(path: str, read: int) -> IntegrityError:
    return IntegrityError(
        f"{path} shrank while it was uploaded (read {read} bytes, expected more)",
        "write checkpoints to a new name and upload them once complete",
    )


def pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    """``length`` bytes at ``offset``; a short read means the file shrank under us."""
    chunks = []
    got = 0
    while got < length:
        try:
            b = os.pread(fd, length - got, offset + got)
        except OSError as e:
            raise PermanentStoreError(f"reading {path}: {e.strerror or e}") from None
        if not b:
            raise _shrank(path, offset + got)
        chunks.append(b)
        got += len(b)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _pread_into(fd: int, buf: bytearray, offset: int, path: str) -> None:
    """Fill ``buf`` with the bytes at ``offset``; a short read means the file shrank under us."""
    view = memoryview(buf)
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            raise PermanentStoreError(f"reading {path}: {e.strerror or e}") from None
        if n == 0:
            raise _shrank(path, offset + got)
        got += n


def changed(doing: str, sha256: str) -> IntegrityError:
    """The error for bytes read whose sha256 is not the one the caller computed."""
    return IntegrityError(
        f"{doing}: the bytes read do not have the sha256 {sha256[:12]}... they were "
        "given: the file changed after its checksum was taken; nothing was stored",
        "write checkpoints to a new name and upload them once complete",
    )


def put_multipart(
    store: S3Store, key: str, fd: int, path: str, sha256: Optional[str], size: int, doing: str
) -> ObjectInfo:
    """Upload the open file ``fd`` (``path``, ``size`` bytes) to ``key`` in parts; ``sha256``
    the caller's, or None to take it from the bytes sent. Aborted on any failure."""
    part = store.part_size or part_size_for(size)
    count = -(-size // part)
    if count > MAX_PARTS:
        raise ValueError(f"part size {part} gives {count} parts, over {MAX_PARTS}")
    crc = store.checksum(key.split("/")[0]) == "crc32"
    full = store.full_key(key)
    r = store.call(
        doing,
        "create_multipart_upload",
        Key=full,
        ContentType="application/octet-stream",
        # Unknown until the whole file is read when the caller lets us hash it (then the
        # MANIFEST alone carries the sha256; the checksums still prove the bytes).
        Metadata={SHA256_META: sha256} if sha256 is not None else {},
        **({"ChecksumAlgorithm": "CRC32"} if crc else {}),
    )
    up = _Upload(store, full, str(r["UploadId"]), fd, path, size, part, crc, doing)
    try:
        got_sha = up.send_parts(sha256)
        expected = composite(up.digests, crc)
        r = up.complete(sha256, expected)
    except BaseException:
        up.abort()
        raise
    got = etag(r.get("ETag"))
    # Every part was checked on arrival and again, by its CRC32, at completion; the
    # composite, where the store states one, must be the one the parts make.
    answered = r.get("ChecksumCRC32") if crc else got
    if answered != expected and (answered is not None or not crc):
        store.delete_quietly(full)
        what = "CRC32" if crc else "ETag"
        raise IntegrityError(
            f"{doing}: the store's {what} {answered!r} is not {expected!r}, the "
            f"{'CRC32' if crc else 'MD5'} of the {count} parts' checksums that were sent; "
            "the object was removed",
            "the data was altered on the way" + ("" if crc else f", or {SSE_ETAGS}"),
        )
    return ObjectInfo(key, size, got_sha, got)


@dataclasses.dataclass
class _Upload:
    """One multipart upload under way: where, what, and the parts' answers so far."""

    store: S3Store
    full: str
    upload_id: str
    fd: int
    path: str
    size: int
    part: int
    crc: bool
    doing: str
    digests: List[bytes] = dataclasses.field(default_factory=list)
    etags: List[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return -(-self.size // self.part)

    def send_parts(self, sha256: Optional[str]) -> str:
        """Read the parts in order (hashing the whole file as read) and upload them from a
        thread pool; at most ``workers + 1`` parts of this upload are in memory at once, and
        the store's ``part_buffers`` bound those of every upload together. The sha256 read.

        Each part is read into a buffer reused from part to part, and that buffer itself is
        the request's body: a bytearray, which botocore sends with a single ``sendall`` (a
        ``bytes`` body it wraps in a BytesIO and copies out again in 128 KiB pieces, after an
        ``Expect: 100-continue`` round trip). A buffer goes back to the free list only when its
        request is over, retries included."""
        count, part = self.count, self.part
        workers = max(1, min(self.store.concurrency, count, MAX_INFLIGHT_BYTES // part))
        whole = hashlib.sha256()
        self.digests = [b""] * count
        self.etags = [""] * count
        bufs = self.store.part_buffers.for_upload(min(workers + 1, count))
        failed = threading.Event()

        def done(buf: bytearray) -> Callable[[concurrent.futures.Future[None]], None]:
            def release(fut: concurrent.futures.Future[None]) -> None:
                if fut.cancelled() or fut.exception() is not None:
                    failed.set()
                bufs.put(buf)

            return release

        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rgt-s3-put")
        futures: List[concurrent.futures.Future[None]] = []
        try:
            for n in range(count):
                offset = n * part
                buf = bufs.get(min(part, self.size - offset))
                if failed.is_set():
                    bufs.put(buf)
                    break
                _pread_into(self.fd, buf, offset, self.path)
                whole.update(buf)
                fut = pool.submit(self._send, n, buf)
                fut.add_done_callback(done(buf))
                futures.append(fut)
                del buf  # back on the free list once sent, not held here
            for fut in futures:
                fut.result()  # the first failure, mapped already by store.call
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bufs.close()
        if sha256 is not None and whole.hexdigest() != sha256:
            raise changed(self.doing, sha256)
        return whole.hexdigest()

    def _send(self, n: int, buf: bytearray) -> None:
        sent = digest(buf, self.crc)
        what = f"{self.doing} (part {n + 1} of {self.count})"
        with self.store.slots:  # one of the store's requests in flight, whoever sends them
            r = self.store.call(
                what,
                "upload_part",
                Key=self.full,
                UploadId=self.upload_id,
                PartNumber=n + 1,
                Body=buf,
                **{header(self.crc): b64(sent)},
            )
        if self.crc:
            checked_crc32(what, b64(sent), r.get("ChecksumCRC32"))
        self.digests[n] = sent
        self.etags[n] = str(r["ETag"])
        self.store.moved()

    def complete(self, sha256: Optional[str], expected: str) -> Dict[str, Any]:
        """Complete the upload; the store's answer (a HEAD of the object where the answer to a
        complete that succeeded was lost)."""
        store, crc = self.store, self.crc
        parts = [
            {
                "PartNumber": n + 1,
                "ETag": self.etags[n],
                **({"ChecksumCRC32": b64(self.digests[n])} if crc else {}),
            }
            for n in range(self.count)
        ]
        try:
            r: Dict[str, Any] = store.client.complete_multipart_upload(
                Bucket=store.bucket,
                Key=self.full,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
            return r
        except bex.ClientError as e:
            if error_code(e) != "NoSuchUpload":
                raise client_error(store, e, self.doing) from None
            # A retried complete whose first try succeeded but whose answer was lost:
            # the upload is gone, and the object is ours if it carries our checksums.
            head = store.call_missing_ok(
                self.doing,
                "head_object",
                Key=self.full,
                **({"ChecksumMode": "ENABLED"} if crc else {}),
            )
            if head is None or not _is_ours(head, sha256, crc, expected):
                raise client_error(store, e, self.doing) from None
            return dict(head)
        except bex.BotoCoreError as e:
            raise boto_error(store, e, self.doing) from None

    def abort(self) -> None:
        store = self.store
        try:
            store.client.abort_multipart_upload(
                Bucket=store.bucket, Key=self.full, UploadId=self.upload_id
            )
        except Exception:
            # Best effort: the upload is invisible under the key either way, and a dangling
            # one is swept by abort_stale_uploads (and by a bucket lifecycle rule, if any).
            pass


class PartBuffers:
    """The part buffers of every multipart upload of one store, at most ``limit`` bytes of
    them in all: the sealer puts several files at once, and each large one reads its parts
    ahead of the requests that send them. An upload takes a buffer (a free one of its own, or
    a new one while the total allows) and gives it back when its request is over; when the
    upload ends, its buffers are freed. Nothing waits forever: an upload that holds none may
    always make one, and every buffer held is one that a request in flight gives back."""

    def __init__(self, limit: int = MAX_INFLIGHT_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def for_upload(self, most: int) -> _UploadBuffers:
        """The buffers of one upload, at most ``most`` of them."""
        return _UploadBuffers(self, most)


class _UploadBuffers:
    def __init__(self, pool: PartBuffers, most: int) -> None:
        self.pool = pool
        self.most = most
        self.free: List[bytearray] = []
        self.held = 0  # bytes of this upload's buffers, free or in flight
        self.count = 0

    def get(self, length: int) -> bytearray:
        """A buffer of ``length`` bytes (its contents undefined)."""
        pool = self.pool
        with pool.cond:
            while True:
                if self.free:
                    buf = self.free.pop()
                    if len(buf) == length:
                        return buf
                    self._drop(buf)  # a full-size buffer goes before a short last part is made
                if self.count < self.most and (pool.used + length <= pool.limit or self.count == 0):
                    pool.used += length
                    self.held += length
                    self.count += 1
                    break
                pool.cond.wait()
        return bytearray(length)

    def put(self, buf: bytearray) -> None:
        with self.pool.cond:
            self.free.append(buf)
            self.pool.cond.notify_all()

    def _drop(self, buf: bytearray) -> None:
        self.pool.used -= len(buf)
        self.held -= len(buf)
        self.count -= 1
        self.pool.cond.notify_all()

    def close(self) -> None:
        """The upload is over (every request of it ended): all its buffers are freed."""
        with self.pool.cond:
            self.pool.used -= self.held
            self.held = self.count = 0
            self.free = []
            self.pool.cond.notify_all()


def _is_ours(head: Dict[str, Any], sha256: Optional[str], crc: bool, expected: str) -> bool:
    if sha256 is not None:
        return bool((head.get("Metadata") or {}).get(SHA256_META) == sha256)
    if crc:
        return bool(head.get("ChecksumCRC32") == expected)
    return etag(head.get("ETag")) == expected


def abort_stale(store: S3Store, prefix: str) -> int:
    """``Store.abort_stale_uploads``: every unfinished multipart upload under ``prefix`` aborted."""
    full = f"{store.prefix}/{prefix}" if store.prefix else prefix
    doing = f"aborting unfinished uploads under {store.url}/{prefix}"
    aborted = 0
    try:
        pages = store.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=store.bucket, Prefix=full
        )
        for page in pages:
            for up in page.get("Uploads") or []:
                try:
                    store.client.abort_multipart_upload(
                        Bucket=store.bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )
                except bex.ClientError as e:
                    if error_code(e) == "NoSuchUpload":
                        continue  # finished or aborted meanwhile
                    raise
                aborted += 1
    except bex.ClientError as e:
        raise client_error(store, e, doing) from None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    return aborted
