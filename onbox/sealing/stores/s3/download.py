"""Downloads of an S3 store: an object up to the multipart threshold in one GET, a larger one in
ranged GETs in parallel, every range pinned to the ETag the HEAD saw (``If-Match``), so an
object replaced during the download fails it (transient: a retry fetches the new one whole).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import TYPE_CHECKING, Any, Dict

import botocore.exceptions as bex

from onbox.common.errors import PermanentStoreError, PreconditionFailed, TransientStoreError
from onbox.sealing.stores.base import new_download
from onbox.sealing.stores.s3.errors import boto_error
from onbox.sealing.stores.s3.multipart import MiB, part_size_for

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

STREAM_CHUNK = MiB


def download(store: S3Store, key: str, dest: str) -> None:
    """``store.get_file``: ``key`` into ``dest``, a new file (base.new_download)."""
    full = store.full_key(key)
    doing = f"downloading {store.url}/{key}"
    head = store.call_missing_ok(doing, "head_object", Key=full)
    if head is None:
        raise PermanentStoreError(f"{key} is not in {store.url}")
    size = int(head["ContentLength"])
    version = str(head.get("ETag") or "")
    with new_download(dest, doing) as fd:  # a new file, never through a symlink
        if size <= store.multipart_threshold:
            _get_range(store, doing, full, version, fd, 0, size, ranged=False)
            return
        part = store.part_size or part_size_for(size)
        count = -(-size // part)
        workers = max(1, min(store.concurrency, count))
        with concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="rgt-s3-get"
        ) as pool:
            futures = [
                pool.submit(
                    _get_range,
                    store,
                    doing,
                    full,
                    version,
                    fd,
                    n * part,
                    min(part, size - n * part),
                    ranged=True,
                )
                for n in range(count)
            ]
            try:
                for fut in futures:
                    fut.result()
            finally:
                for fut in futures:
                    fut.cancel()


def _get_range(
    store: S3Store,
    doing: str,
    full: str,
    version: str,
    fd: int,
    offset: int,
    length: int,
    *,
    ranged: bool,
) -> None:
    kwargs: Dict[str, Any] = {"Key": full}
    if version:
        kwargs["IfMatch"] = version  # every range from the same object, even if it is replaced
    if ranged:
        kwargs["Range"] = f"bytes={offset}-{offset + length - 1}"
    try:
        r = store.call(doing, "get_object", **kwargs)
    except PreconditionFailed:
        raise TransientStoreError(f"{doing}: the object was replaced during the download") from None
    body = r["Body"]
    done = 0
    try:
        while True:
            chunk = body.read(STREAM_CHUNK)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                n = os.pwrite(fd, view, offset + done)
                view = view[n:]
                done += n
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    finally:
        body.close()
    if done != length:
        raise TransientStoreError(f"{doing}: got {done} bytes of {length}")
