"""The checksum protocol of an S3 store (see the package docstring): which checksum a body
carries (``crc32``, S3's flexible checksums, where the store proves it checks them; else
``md5``, Content-MD5), how a store is probed for it, and how the store's answer to a put is
checked against what was sent (the CRC32 it echoes, or the ETag that must be the MD5).
"""

from __future__ import annotations

import base64
import hashlib
import uuid
import zlib
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Union

import botocore.exceptions as bex

from onbox.common.errors import IntegrityError
from onbox.sealing.stores.s3.client import takes
from onbox.sealing.stores.s3.errors import (
    AUTH_CODES,
    boto_error,
    client_error,
    error_code,
    http_status,
)

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

SHA256_META = "sha256"  # stored as x-amz-meta-sha256
# What a store answers to a body whose flexible checksum is wrong: proof that it checks them.
CHECKSUM_REFUSED = {"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"}
CHECKSUMS = ("auto", "crc32", "md5")
VERIFIED_BY = {"crc32": "its CRC32 checked by the store", "md5": "Content-MD5 and ETag verified"}
# Why an ETag that is not the MD5 need not mean damage: the remedy of every ETag mismatch.
SSE_ETAGS = (
    "the bucket encrypts with SSE-KMS/SSE-C, whose ETags are not MD5s, so uploads cannot be "
    "verified without reading back"
)


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def md5(data: Union[bytes, bytearray]) -> Any:
    # MD5 here is S3's transport checksum, not a security measure (FIPS builds refuse it else).
    return hashlib.md5(data, usedforsecurity=False)


def crc32(data: Union[bytes, bytearray]) -> bytes:
    """The CRC32 (S3's flexible checksum, zlib's polynomial) of ``data``, big-endian."""
    return zlib.crc32(data).to_bytes(4, "big")


def digest(data: Union[bytes, bytearray], crc: bool) -> bytes:
    """The checksum a body carries: its CRC32 where ``crc``, else its MD5."""
    return crc32(data) if crc else md5(data).digest()


def header(crc: bool) -> str:
    """The request parameter that carries a body's checksum."""
    return "ChecksumCRC32" if crc else "ContentMD5"


def etag(value: Optional[str]) -> str:
    """An ETag as rgt compares them: unquoted, lowercase."""
    return (value or "").strip().strip('"').lower()


def composite(digests: List[bytes], crc: bool) -> str:
    """What the store must answer for a multipart object made of parts with ``digests``:
    crc32(part CRC32s)-N, as AWS defines the composite checksum, or the multipart ETag
    md5(part MD5s)-N."""
    if crc:
        return b64(crc32(b"".join(digests))) + f"-{len(digests)}"
    return str(md5(b"".join(digests)).hexdigest()) + f"-{len(digests)}"


def probe_crc32(store: S3Store, scope: str, doing: Optional[str]) -> bool:
    """Whether the store checks flexible checksums: a small put whose CRC32 is deliberately
    wrong must be refused. A store that stores it anyway ignores the header (the object is
    deleted again); one that rejects the header itself does not support it."""
    doing = doing or f"checking which checksums {store.url} verifies"
    full = store.full_key(f"{scope}/.rgt-preflight/{uuid.uuid4().hex}")
    body = b"rgt: a deliberately wrong CRC32, to see that the store refuses it"
    wrong = bytes(b ^ 0xFF for b in crc32(body))
    if not takes(store.client, "PutObject", "ChecksumCRC32"):
        return False  # a boto3 too old to send flexible checksums
    try:
        store.client.put_object(Bucket=store.bucket, Key=full, Body=body, ChecksumCRC32=b64(wrong))
    except bex.ClientError as e:
        code = error_code(e)
        if code in CHECKSUM_REFUSED:
            return True
        if http_status(e) in (400, 501) and code not in AUTH_CODES and code != "NoSuchBucket":
            return False  # the store refuses the header itself: it does not take it
        raise client_error(store, e, doing) from None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    store.delete_quietly(full)
    return False


def checked_crc32(doing: str, sent: str, answered: Optional[str]) -> None:
    """A store that checks CRC32s echoes the one it stored; a different one is an error."""
    if answered is not None and answered != sent:
        raise IntegrityError(
            f"{doing}: the store answered CRC32 {answered!r} for a body sent with {sent!r}",
            "the data was altered on the way; nothing is kept under the key",
        )


def check_put(
    store: S3Store, doing: str, full: str, sent: bytes, crc: bool, answer: Mapping[str, Any]
) -> None:
    """The store's ``answer`` to one put of a body whose checksum was ``sent``: the CRC32 it
    echoes must agree (it checked the body on arrival), or its ETag must be the MD5. Else the
    object, there but not what was sent, is removed and IntegrityError raised."""
    if crc:
        try:
            checked_crc32(doing, b64(sent), answer.get("ChecksumCRC32"))
        except IntegrityError:
            store.delete_quietly(full)
            raise
        return
    got = etag(answer.get("ETag"))
    if got != sent.hex():
        store.delete_quietly(full)
        raise IntegrityError(
            f"{doing}: the store's ETag {got!r} is not the MD5 {sent.hex()!r} of the "
            "bytes sent; the object was removed",
            f"the data was altered on the way, or {SSE_ETAGS}",
        )
