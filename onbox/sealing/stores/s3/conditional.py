"""S3Store's conditional puts, which fence the run's documents (the package docstring):
``If-None-Match: *`` (create if absent) and ``If-Match: "<ETag>"`` (replace if at a version),
and where the store answers NotImplemented a HEAD and a compare before a plain put instead,
which is not atomic (``conditional_writes`` is False from then on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import boto3
import botocore.exceptions as bex

from onbox.sealing.stores.base import PermanentStoreError, PreconditionFailed
from onbox.sealing.stores.s3.checksums import etag
from onbox.sealing.stores.s3.client import takes
from onbox.sealing.stores.s3.errors import boto_error, client_error, not_implemented

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store


def put_if_absent(store: S3Store, full: str, kwargs: Dict[str, Any], doing: str) -> Any:
    """PutObject with ``If-None-Match: *``; a store that answers NotImplemented (once is
    enough) gets a HEAD and a plain put instead."""
    if store.conditional_writes is not False:
        r = _conditionally(store, doing, "If-None-Match", IfNoneMatch="*", **kwargs)
        if r is not None:
            store.conditional_writes = True
            return r
    return _if_absent_unconditionally(store, full, kwargs, doing)


def put_if_match(
    store: S3Store, full: str, kwargs: Dict[str, Any], version: str, doing: str
) -> Any:
    """PutObject with ``If-Match: "<ETag>"`` (AWS since 2024; SeaweedFS 4.48 refuses a
    stale one with 412, tested). A store that answers NotImplemented gets a HEAD, a compare
    and a plain put: not atomic, so the caller reads back after the write."""
    if store.conditional_writes is not False:
        r = _conditionally(store, doing, "If-Match", IfMatch=f'"{version}"', **kwargs)
        if r is not None:
            return r
    head = store.call_missing_ok(doing, "head_object", Key=full)
    if head is None or etag(head.get("ETag")) != version:
        raise PreconditionFailed(f"{doing}: the object is not at version {version} any more")
    return store.call(doing, "put_object", **kwargs)


def _conditionally(store: S3Store, doing: str, condition: str, **kwargs: Any) -> Any:
    """PutObject with the ``condition`` header in ``kwargs``; None where the store answered
    NotImplemented (``conditional_writes`` is False from then on)."""
    if not takes(store.client, "PutObject", condition.replace("-", "")):
        raise PermanentStoreError(
            f"{doing}: this boto3 ({boto3.__version__}) cannot send {condition}",
            "pip install 'boto3>=1.35'",
        )
    try:
        return store.client.put_object(Bucket=store.bucket, **kwargs)
    except bex.ClientError as e:
        if not not_implemented(e):
            raise client_error(store, e, doing) from None
        store.conditional_writes = False
        return None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None


def _if_absent_unconditionally(
    store: S3Store, full: str, kwargs: Dict[str, Any], doing: str
) -> Any:
    # The store does not do If-None-Match (it answered NotImplemented): check, then write.
    # Not atomic between two writers, but a run has one writer: the agent holding its lock.
    if store.call_missing_ok(doing, "head_object", Key=full) is not None:
        raise PreconditionFailed(f"{doing}: the object already exists")
    return store.call(doing, "put_object", **kwargs)
