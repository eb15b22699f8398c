"""``s3://bucket/prefix``: any S3-compatible object store (AWS S3, R2, B2, MinIO, SeaweedFS...).

Credentials, region and endpoint come from boto3's standard configuration (``AWS_*``
environment variables including ``AWS_ENDPOINT_URL``, ``~/.aws/config``, profiles); the
``endpoint_url`` argument overrides the endpoint. Any endpoint that is not AWS's own is
addressed path-style (``http://host/bucket/key``): most S3-compatible servers have no wildcard
DNS for virtual-hosted buckets.

Uploads verify without downloading. Every body goes out with a checksum the server checks, so
it refuses a body that arrived different from what was read; which checksum depends on what the
store verifies, found out once per store by a probe (``checksum="auto"``, the default):

- ``crc32``: S3's flexible checksums (``x-amz-checksum-crc32``), where the store refuses a body
  whose CRC32 is deliberately wrong (SeaweedFS 4.48, tested; AWS documents it). Each part's
  CRC32 is checked on arrival and again when the upload is completed, and the object's
  composite CRC32 (``crc32(part CRC32s)-N``) must be what was sent. CRC32 costs a sixth of
  MD5's CPU, which matters on a box whose cores the training job needs.
- ``md5``: ``Content-MD5`` on every body, for stores that ignore flexible checksums; after
  completion the ETag must be the MD5 of the object (one put) or ``md5(part MD5s)-N``.

``put_file`` hashes exactly the bytes it sends: their sha256 must equal the caller's (otherwise
the file changed after the caller hashed it, and the upload is aborted). The sha256 is stored as
``x-amz-meta-sha256`` so ``stat`` returns it. A multipart upload is atomic at completion, so
aborting on any failure leaves nothing under the final key.

Conditional writes fence the run's documents: ``put_bytes(if_absent=True)`` sends
``If-None-Match: *`` and ``put_bytes(if_match=ETAG)`` sends ``If-Match`` (AWS supports both
since 2024; SeaweedFS 4.48 refuses either with 412 when it does not hold, tested). A store that
answers NotImplemented gets a HEAD and a compare before a plain put instead, which is not
atomic; the sealer's read-back after every document write covers that.

boto3 is an optional extra (``pip install remote-gpu-trainer[s3]``): this module is imported
only when an ``s3://`` URL is used. boto3 >= 1.35 is needed for ``If-None-Match`` puts.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import ipaddress
import os
import queue
import threading
import uuid
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from onbox.common.errors import AuthError, IntegrityError, UsageError
from onbox.sealing.stores.base import (
    Finding,
    ObjectInfo,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    TransientStoreError,
    check_key,
    new_download,
)

MiB = 1 << 20
MULTIPART_THRESHOLD = 8 * MiB  # at most this: one put_object
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
MAX_PARTS = 10000  # S3's most parts in one upload
MAX_CONCURRENCY = 8
# Parts in flight are held in memory; bound them so a 5 TiB object cannot take the box's RAM.
MAX_INFLIGHT_BYTES = 576 * MiB
STREAM_CHUNK = MiB
SHA256_META = "sha256"  # stored as x-amz-meta-sha256

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "BadDigest",  # a body arrived different from its checksum: corrupted in transit
    "IncompleteBody",
    "ConditionalRequestConflict",  # AWS: a concurrent conditional write; a retry settles it
    "NoSuchUpload",  # our upload was aborted under us (a stale-upload sweep): start again
    "OperationAborted",
}
_AUTH_CODES = {
    "InvalidAccessKeyId": (
        "the store does not know the access key {key}",
        "check AWS_ACCESS_KEY_ID (or the profile) and that the key belongs to this endpoint",
    ),
    "SignatureDoesNotMatch": (
        "the secret key does not match the access key {key}",
        "check AWS_SECRET_ACCESS_KEY (or the profile)",
    ),
    "ExpiredToken": (
        "the session token has expired",
        "refresh the temporary credentials (AWS_SESSION_TOKEN, sso login)",
    ),
    "InvalidToken": ("the session token is invalid", "refresh the temporary credentials"),
    "TokenRefreshRequired": ("the session token must be refreshed", "refresh the credentials"),
}


def part_size_for(size: int) -> int:
    """Part size for an object of ``size`` bytes: about 64 parts, 8..64 MiB each (16 MiB for
    1 GiB), larger only where 10000 parts would not hold the object; whole MiB."""
    target = min(max(size // 64, 8 * MiB), 64 * MiB)
    need = -(-size // MAX_PARTS)
    part = max(target, need)
    return -(-part // MiB) * MiB


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def _md5(data: Union[bytes, bytearray]) -> Any:
    # MD5 here is S3's transport checksum, not a security measure (FIPS builds refuse it else).
    return hashlib.md5(data, usedforsecurity=False)


def _crc32(data: Union[bytes, bytearray]) -> bytes:
    """The CRC32 (S3's flexible checksum, zlib's polynomial) of ``data``, big-endian."""
    return zlib.crc32(data).to_bytes(4, "big")


# What a store answers to a body whose flexible checksum is wrong: proof that it checks them.
_CHECKSUM_REFUSED = {"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"}
CHECKSUMS = ("auto", "crc32", "md5")
_VERIFIED_BY = {"crc32": "its CRC32 checked by the store", "md5": "Content-MD5 and ETag verified"}


def _etag(value: Optional[str]) -> str:
    return (value or "").strip().strip('"').lower()


def _pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    """``length`` bytes at ``offset``; a short read means the file shrank under us."""
    chunks = []
    got = 0
    while got < length:
        try:
            b = os.pread(fd, length - got, offset + got)
        except OSError as e:
            raise PermanentStoreError(f"reading {path}: {e.strerror or e}") from None
        if not b:
            raise IntegrityError(
                f"{path} shrank while it was uploaded (read {offset + got} bytes, expected more)",
                "write checkpoints to a new name and upload them once complete",
            )
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
            raise IntegrityError(
                f"{path} shrank while it was uploaded (read {offset + got} bytes, expected more)",
                "write checkpoints to a new name and upload them once complete",
            )
        got += n


def _is_aws(endpoint: str) -> bool:
    host = (urlsplit(endpoint).hostname or "").lower()
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _is_loopback(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _config(**extra: Any) -> Any:
    kwargs: Dict[str, Any] = dict(
        # Modest: the caller's base.with_retries retries whole operations on top of this.
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=MAX_CONCURRENCY + 2,
        **extra,
    )
    try:
        # boto3 >= 1.36 adds CRC32 trailers (aws-chunked bodies) to every upload by default;
        # several S3-compatible stores reject or mangle those, and every body we send already
        # carries a Content-MD5 the server checks. Older boto3 has no such option (TypeError).
        return Config(request_checksum_calculation="when_required", **kwargs)
    except TypeError:
        return Config(**kwargs)


class S3Store(Store):
    """A store under ``s3://bucket/prefix`` on AWS or any S3-compatible endpoint."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: Optional[str] = None,
        *,
        part_size: Optional[int] = None,
        concurrency: int = MAX_CONCURRENCY,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        aws_access_key_id: Optional[str] = None,
        aws_secret_access_key: Optional[str] = None,
        aws_session_token: Optional[str] = None,
        region_name: Optional[str] = None,
        profile_name: Optional[str] = None,
        checksum: str = "auto",
    ) -> None:
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}, not {checksum!r}")
        if part_size is not None and part_size < MIN_PART:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {MIN_PART}")
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be 1..{MAX_CONCURRENCY}, not {concurrency}")
        if not 0 <= multipart_threshold <= 5 * 1024 * MiB:
            raise ValueError(f"multipart_threshold {multipart_threshold} is out of range")
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.part_size = part_size
        self.concurrency = concurrency
        self.multipart_threshold = multipart_threshold
        self._endpoint_arg = endpoint_url
        self._session_args = {
            k: v
            for k, v in (
                ("aws_access_key_id", aws_access_key_id),
                ("aws_secret_access_key", aws_secret_access_key),
                ("aws_session_token", aws_session_token),
                ("region_name", region_name),
                ("profile_name", profile_name),
            )
            if v is not None
        }
        self._client: Any = None
        self._session: Any = None
        self._client_lock = threading.Lock()
        # None: not known yet; False: the store answered NotImplemented to If-None-Match.
        self.conditional_writes: Optional[bool] = None
        # "crc32" or "md5" once known (see the module docstring); "auto" probes on first need.
        self._checksum = checksum
        self._checksum_lock = threading.Lock()

    # -- the client -------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The boto3 S3 client, made on first use (making one loads boto3's models, ~0.2 s)."""
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def _make_client(self) -> Any:
        try:
            session = self._session = boto3.session.Session(**self._session_args)
            if self._endpoint_arg is None:
                # Where boto3's own configuration points (AWS_ENDPOINT_URL, the profile's
                # endpoint_url, else AWS): only AWS itself is addressed virtual-hosted.
                default = session.client("s3", config=_config())
                if _is_aws(default.meta.endpoint_url):
                    return default
                endpoint = default.meta.endpoint_url
            else:
                endpoint = self._endpoint_arg
            return session.client(
                "s3",
                endpoint_url=endpoint,
                config=_config(
                    # Every body we send carries a Content-MD5, which is a signed header: it
                    # pins the body as well as a payload hash would, without hashing it twice
                    # (botocore otherwise sha256-signs every body on plain http).
                    s3={"addressing_style": "path", "payload_signing_enabled": False}
                ),
            )
        except bex.ProfileNotFound as e:
            raise UsageError("store", f"{self.url}: {e}", "check AWS_PROFILE") from None
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise UsageError(
                "store", f"{self.url}: {e}", "the endpoint is a URL like https://host:port"
            ) from None

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        # A listed key becomes a key rgt reads, deletes or downloads to a local path: one that
        # rgt could not have written (``..``, an empty part, a NUL) is refused, not used.
        return check_key(full[len(self.prefix) + 1 :] if self.prefix else full)

    # -- error mapping ----------------------------------------------------------------------

    def _access_key(self) -> str:
        """The access key in use, shortened, so a message shows which one was refused."""
        try:
            creds = self._session.get_credentials() if self._session is not None else None
            ak = str(creds.access_key) if creds is not None else ""
        except Exception:  # only for a message: never mask the error being reported
            ak = ""
        return repr(ak[:4] + "..." + ak[-2:]) if len(ak) > 8 else repr(ak)

    def _client_error(self, e: Any, doing: str) -> Exception:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = str(err.get("Message") or code)
        if code in _AUTH_CODES:
            what, remedy = _AUTH_CODES[code]
            return AuthError(
                f"{doing}: credentials refused: {what.format(key=self._access_key())}", remedy
            )
        if code == "NoSuchBucket":
            return PermanentStoreError(
                f"{doing}: bucket '{self.bucket}' does not exist at {self.endpoint}",
                "create the bucket, or fix the bucket name or the endpoint",
            )
        if code == "PreconditionFailed" or status == 412:
            return PreconditionFailed(f"{doing}: the object already exists")
        if code == "RequestTimeTooSkewed":
            return PermanentStoreError(
                f"{doing}: the store refuses requests because this machine's clock is off",
                "synchronise the clock (NTP)",
            )
        if code == "AccessDenied" or status == 403:
            return PermanentStoreError(
                f"{doing}: access denied ({code or status}: {detail})",
                f"grant these credentials read, write, list, delete and multipart-abort "
                f"rights on {self.url}, or check that they are the right ones",
            )
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return TransientStoreError(f"{doing}: the store answered {status} {code}: {detail}")
        return PermanentStoreError(f"{doing}: the store answered {status} {code}: {detail}")

    def _boto_error(self, e: Exception, doing: str) -> Exception:
        if isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            return AuthError(
                f"{doing}: no usable S3 credentials found ({e})",
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
            )
        if isinstance(e, bex.CredentialRetrievalError):
            return AuthError(f"{doing}: credentials refused: {e}", "check the AWS profile")
        if isinstance(e, bex.SSLError):
            return PermanentStoreError(
                f"{doing}: TLS to {self.endpoint} failed: {e}",
                "check the endpoint URL and AWS_CA_BUNDLE",
            )
        if isinstance(e, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
            return TransientStoreError(
                f"{doing}: cannot reach {self.endpoint} ({e})",
                "check the endpoint URL and the network",
            )
        if isinstance(
            e,
            (
                bex.ConnectionError,
                bex.HTTPClientError,
                bex.IncompleteReadError,
                bex.FlexibleChecksumError,
            ),
        ):
            return TransientStoreError(f"{doing}: the connection to {self.endpoint} failed: {e}")
        if isinstance(e, bex.NoRegionError):
            return PermanentStoreError(f"{doing}: {e}", "set AWS_REGION or AWS_DEFAULT_REGION")
        return PermanentStoreError(f"{doing}: {type(e).__name__}: {e}")

    def _call(self, doing: str, method: str, **kwargs: Any) -> Any:
        """``client.method(Bucket=..., **kwargs)`` with its errors mapped to store errors."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except bex.ClientError as e:
            raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None

    def _call_missing_ok(self, doing: str, method: str, **kwargs: Any) -> Any:
        """As ``_call``, but None when the key is absent (a missing bucket still raises)."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except bex.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            # HEAD answers a bare 404 for a missing key and a missing bucket alike; the
            # preflight's head_bucket tells a missing bucket apart before anything runs.
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None

    # -- checksums --------------------------------------------------------------------------

    def checksum(self, scope: str, doing: Optional[str] = None) -> str:
        """The checksum uploads carry, ``crc32`` or ``md5``. Probed once, under ``scope`` (a
        run's key prefix), where the store was made with ``checksum="auto"``."""
        with self._checksum_lock:
            if self._checksum == "auto":
                self._checksum = "crc32" if self._probe_crc32(scope, doing) else "md5"
            return self._checksum

    def _probe_crc32(self, scope: str, doing: Optional[str]) -> bool:
        """Whether the store checks flexible checksums: a small put whose CRC32 is deliberately
        wrong must be refused. A store that stores it anyway ignores the header (the object is
        deleted again); one that rejects the header itself does not support it."""
        doing = doing or f"checking which checksums {self.url} verifies"
        full = self._key(f"{scope}/.rgt-preflight/{uuid.uuid4().hex}")
        body = b"rgt: a deliberately wrong CRC32, to see that the store refuses it"
        wrong = bytes(b ^ 0xFF for b in _crc32(body))
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=full, Body=body, ChecksumCRC32=_b64(wrong)
            )
        except bex.ParamValidationError:
            return False  # a boto3 too old to send flexible checksums
        except bex.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in _CHECKSUM_REFUSED:
                return True
            if status in (400, 501) and code not in _AUTH_CODES and code != "NoSuchBucket":
                return False  # the store refuses the header itself: it does not take it
            raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None
        self._delete_quietly(full)
        return False

    def _checked_crc32(self, doing: str, sent: str, answered: Optional[str]) -> None:
        """A store that checks CRC32s echoes the one it stored; a different one is an error."""
        if answered is not None and answered != sent:
            raise IntegrityError(
                f"{doing}: the store answered CRC32 {answered!r} for a body sent with {sent!r}",
                "the data was altered on the way; nothing is kept under the key",
            )

    # -- writing ----------------------------------------------------------------------------

    def _put_object(
        self,
        key: str,
        data: bytes,
        sha256: str,
        *,
        if_absent: bool,
        doing: str,
        if_match: Optional[str] = None,
    ) -> ObjectInfo:
        full = self._key(key)
        crc = self.checksum(key.split("/")[0]) == "crc32"
        digest = _crc32(data) if crc else _md5(data).digest()
        kwargs: Dict[str, Any] = dict(
            Key=full,
            Body=data,
            ContentType="application/octet-stream",
            Metadata={SHA256_META: sha256},
        )
        kwargs["ChecksumCRC32" if crc else "ContentMD5"] = _b64(digest)
        if if_match is not None:
            r = self._put_if_match(full, kwargs, if_match, doing)
        elif if_absent and self.conditional_writes is not False:
            try:
                r = self.client.put_object(Bucket=self.bucket, IfNoneMatch="*", **kwargs)
                self.conditional_writes = True
            except bex.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = e.response.get("Error", {}).get("Code")
                if code != "NotImplemented" and status != 501:
                    raise self._client_error(e, doing) from None
                self.conditional_writes = False
                r = self._put_if_absent_unconditionally(full, kwargs, doing)
            except bex.ParamValidationError:
                raise PermanentStoreError(
                    f"{doing}: this boto3 ({boto3.__version__}) cannot send If-None-Match",
                    "pip install 'boto3>=1.35'",
                ) from None
            except bex.BotoCoreError as e:
                raise self._boto_error(e, doing) from None
        elif if_absent:
            r = self._put_if_absent_unconditionally(full, kwargs, doing)
        else:
            r = self._call(doing, "put_object", **kwargs)
        got = _etag(r.get("ETag"))
        if crc:
            # Checked by the store on arrival (a wrong CRC32 is refused); its echo must agree.
            try:
                self._checked_crc32(doing, _b64(digest), r.get("ChecksumCRC32"))
            except IntegrityError:
                self._delete_quietly(full)
                raise
        elif got != digest.hex():
            # The object is there but is not what we sent: remove it rather than leave it.
            self._delete_quietly(full)
            raise IntegrityError(
                f"{doing}: the store's ETag {got!r} is not the MD5 {digest.hex()!r} of the "
                "bytes sent; the object was removed",
                "the data was altered on the way, or the bucket encrypts with SSE-KMS/SSE-C "
                "(whose ETags are not MD5s, so uploads cannot be verified without reading back)",
            )
        return ObjectInfo(key, len(data), sha256, got)

    def _put_if_match(self, full: str, kwargs: Dict[str, Any], version: str, doing: str) -> Any:
        """PutObject with ``If-Match: "<ETag>"`` (AWS since 2024; SeaweedFS 4.48 refuses a
        stale one with 412, tested). A store that answers NotImplemented gets a HEAD, a compare
        and a plain put: not atomic, so the caller reads back after the write."""
        if self.conditional_writes is not False:
            try:
                return self.client.put_object(Bucket=self.bucket, IfMatch=f'"{version}"', **kwargs)
            except bex.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = e.response.get("Error", {}).get("Code")
                if code != "NotImplemented" and status != 501:
                    raise self._client_error(e, doing) from None
                self.conditional_writes = False
            except bex.ParamValidationError:
                raise PermanentStoreError(
                    f"{doing}: this boto3 ({boto3.__version__}) cannot send If-Match",
                    "pip install 'boto3>=1.35'",
                ) from None
            except bex.BotoCoreError as e:
                raise self._boto_error(e, doing) from None
        head = self._call_missing_ok(doing, "head_object", Key=full)
        if head is None or _etag(head.get("ETag")) != version:
            raise PreconditionFailed(f"{doing}: the object is not at version {version} any more")
        return self._call(doing, "put_object", **kwargs)

    def _put_if_absent_unconditionally(self, full: str, kwargs: Dict[str, Any], doing: str) -> Any:
        # The store does not do If-None-Match (it answered NotImplemented): check, then write.
        # Not atomic between two writers, but a run has one writer: the agent holding its lock.
        if self._call_missing_ok(doing, "head_object", Key=full) is not None:
            raise PreconditionFailed(f"{doing}: the object already exists")
        return self._call(doing, "put_object", **kwargs)

    def _delete_quietly(self, full: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=full)
        except Exception:  # best effort on a path that already fails with a better error
            pass

    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        sha = hashlib.sha256(data).hexdigest()
        return self._put_object(
            key,
            data,
            sha,
            if_absent=if_absent,
            if_match=if_match,
            doing=f"writing {key} to {self.url}",
        )

    hashes_while_uploading = True

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        full = self._key(key)
        doing = f"uploading {path} to {self.url}/{key}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise PermanentStoreError(f"{doing}: cannot read it: {e.strerror or e}") from None
        try:
            actual = os.fstat(fd).st_size  # cannot fail on an open descriptor
            if actual != size:
                raise IntegrityError(
                    f"{doing}: it is {actual} bytes, expected {size}",
                    "the file changed after its checksum was taken",
                )
            if size <= self.multipart_threshold:
                data = _pread_exact(fd, size, 0, path)
                got_sha = hashlib.sha256(data).hexdigest()
                if sha256 is not None and got_sha != sha256:
                    raise self._changed(doing, sha256)
                return self._put_object(key, data, got_sha, if_absent=False, doing=doing)
            return self._put_multipart(key, full, fd, path, sha256, size, doing)
        finally:
            os.close(fd)

    @staticmethod
    def _changed(doing: str, sha256: str) -> IntegrityError:
        return IntegrityError(
            f"{doing}: the bytes read do not have the sha256 {sha256[:12]}... they were "
            "given: the file changed after its checksum was taken; nothing was stored",
            "write checkpoints to a new name and upload them once complete",
        )

    def _put_multipart(
        self,
        key: str,
        full: str,
        fd: int,
        path: str,
        sha256: Optional[str],
        size: int,
        doing: str,
    ) -> ObjectInfo:
        part = self.part_size or part_size_for(size)
        count = -(-size // part)
        if count > MAX_PARTS:
            raise ValueError(f"part size {part} gives {count} parts, over {MAX_PARTS}")
        crc = self.checksum(key.split("/")[0]) == "crc32"
        r = self._call(
            doing,
            "create_multipart_upload",
            Key=full,
            ContentType="application/octet-stream",
            # Unknown until the whole file is read when the caller lets us hash it (then the
            # MANIFEST alone carries the sha256; the checksums still prove the bytes).
            Metadata={SHA256_META: sha256} if sha256 is not None else {},
            **({"ChecksumAlgorithm": "CRC32"} if crc else {}),
        )
        upload_id = str(r["UploadId"])
        try:
            digests, etags, got_sha = self._send_parts(
                full, upload_id, fd, path, sha256, size, part, crc, doing
            )
            # What the store must answer for the whole: crc32(part CRC32s)-N, as AWS defines
            # the composite checksum, or the multipart ETag md5(part MD5s)-N.
            if crc:
                expected = _b64(_crc32(b"".join(digests))) + f"-{count}"
            else:
                expected = _md5(b"".join(digests)).hexdigest() + f"-{count}"
            parts = [
                {
                    "PartNumber": n + 1,
                    "ETag": etags[n],
                    **({"ChecksumCRC32": _b64(digests[n])} if crc else {}),
                }
                for n in range(count)
            ]
            try:
                r = self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except bex.ClientError as e:
                if e.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise self._client_error(e, doing) from None
                # A retried complete whose first try succeeded but whose answer was lost:
                # the upload is gone, and the object is ours if it carries our checksums.
                head = self._call_missing_ok(
                    doing, "head_object", Key=full, **({"ChecksumMode": "ENABLED"} if crc else {})
                )
                if head is None or not self._is_ours(head, sha256, crc, expected):
                    raise self._client_error(e, doing) from None
                r = head
            except bex.BotoCoreError as e:
                raise self._boto_error(e, doing) from None
        except BaseException:
            self._abort(full, upload_id)
            raise
        got = _etag(r.get("ETag"))
        # Every part was checked on arrival and again, by its CRC32, at completion; the
        # composite, where the store states one, must be the one the parts make.
        answered = r.get("ChecksumCRC32") if crc else got
        if answered != expected and (answered is not None or not crc):
            self._delete_quietly(full)
            what = "CRC32" if crc else "ETag"
            raise IntegrityError(
                f"{doing}: the store's {what} {answered!r} is not {expected!r}, the "
                f"{'CRC32' if crc else 'MD5'} of the {count} parts' checksums that were sent; "
                "the object was removed",
                "the data was altered on the way"
                + (
                    ""
                    if crc
                    else ", or the bucket encrypts with SSE-KMS/SSE-C (whose ETags are not "
                    "MD5s, so uploads cannot be verified without reading back)"
                ),
            )
        return ObjectInfo(key, size, got_sha, got)

    @staticmethod
    def _is_ours(head: Dict[str, Any], sha256: Optional[str], crc: bool, expected: str) -> bool:
        if sha256 is not None:
            return bool((head.get("Metadata") or {}).get(SHA256_META) == sha256)
        if crc:
            return bool(head.get("ChecksumCRC32") == expected)
        return _etag(head.get("ETag")) == expected

    def _send_parts(
        self,
        full: str,
        upload_id: str,
        fd: int,
        path: str,
        sha256: Optional[str],
        size: int,
        part: int,
        crc: bool,
        doing: str,
    ) -> Tuple[List[bytes], List[str], str]:
        """Read the parts in order (hashing the whole file as read) and upload them from a
        thread pool; at most ``workers + 1`` parts are in memory at once.

        Each part is read into one of those ``workers + 1`` buffers, reused from part to part,
        and that buffer itself is the request's body: a bytearray, which botocore sends with a
        single ``sendall`` (a ``bytes`` body it wraps in a BytesIO and copies out again in
        128 KiB pieces, after an ``Expect: 100-continue`` round trip). A buffer goes back to
        the free list only when its request is over, retries included."""
        count = -(-size // part)
        workers = max(1, min(self.concurrency, count, MAX_INFLIGHT_BYTES // part))
        whole = hashlib.sha256()
        digests: List[bytes] = [b""] * count
        etags: List[str] = [""] * count
        # Free buffers; None: one not allocated yet (a part may be read into it).
        free: queue.SimpleQueue[Optional[bytearray]] = queue.SimpleQueue()
        for _ in range(min(workers + 1, count)):
            free.put(None)
        failed = threading.Event()

        def send(n: int, buf: bytearray) -> None:
            digest = _crc32(buf) if crc else _md5(buf).digest()
            what = f"{doing} (part {n + 1} of {count})"
            r = self._call(
                what,
                "upload_part",
                Key=full,
                UploadId=upload_id,
                PartNumber=n + 1,
                Body=buf,
                **{("ChecksumCRC32" if crc else "ContentMD5"): _b64(digest)},
            )
            if crc:
                self._checked_crc32(what, _b64(digest), r.get("ChecksumCRC32"))
            digests[n] = digest
            etags[n] = str(r["ETag"])

        def done(buf: bytearray) -> Callable[[concurrent.futures.Future[None]], None]:
            def release(fut: concurrent.futures.Future[None]) -> None:
                if fut.cancelled() or fut.exception() is not None:
                    failed.set()
                free.put(buf if len(buf) == part else None)

            return release

        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rgt-s3-put")
        futures: List[concurrent.futures.Future[None]] = []
        try:
            for n in range(count):
                buf = free.get()
                if failed.is_set():
                    break
                offset = n * part
                length = min(part, size - offset)
                if buf is None or len(buf) != length:
                    buf = None  # a full-size buffer is freed before a short last part is made
                    buf = bytearray(length)
                _pread_into(fd, buf, offset, path)
                whole.update(buf)
                fut = pool.submit(send, n, buf)
                fut.add_done_callback(done(buf))
                futures.append(fut)
                del buf  # back on the free list once sent, not held here
            for fut in futures:
                fut.result()  # the first failure, mapped already by _call
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if sha256 is not None and whole.hexdigest() != sha256:
            raise self._changed(doing, sha256)
        return digests, etags, whole.hexdigest()

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception:
            # Best effort: the upload is invisible under the key either way, and a dangling
            # one is swept by abort_stale_uploads (and by a bucket lifecycle rule, if any).
            pass

    # -- reading ----------------------------------------------------------------------------

    def get_bytes(self, key: str) -> Optional[bytes]:
        return self._get_bytes(key, f"reading {key} from {self.url}")

    def _get_bytes(self, key: str, doing: str) -> Optional[bytes]:
        r = self._call_missing_ok(doing, "get_object", Key=self._key(key))
        if r is None:
            return None
        try:
            data: bytes = r["Body"].read()
            return data
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None

    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        doing = f"reading {key} from {self.url}"
        r = self._call_missing_ok(doing, "get_object", Key=self._key(key))
        if r is None:
            return None
        try:
            data: bytes = r["Body"].read()
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None
        return data, _etag(r.get("ETag"))

    def get_file(self, key: str, dest: str) -> None:
        full = self._key(key)
        doing = f"downloading {self.url}/{key}"
        head = self._call_missing_ok(doing, "head_object", Key=full)
        if head is None:
            raise PermanentStoreError(f"{key} is not in {self.url}")
        size = int(head["ContentLength"])
        etag = str(head.get("ETag") or "")
        with new_download(dest, doing) as fd:  # a new file, never through a symlink
            if size <= self.multipart_threshold:
                self._get_range(doing, full, etag, fd, 0, size, ranged=False)
            else:
                part = self.part_size or part_size_for(size)
                count = -(-size // part)
                workers = max(1, min(self.concurrency, count))
                with concurrent.futures.ThreadPoolExecutor(
                    workers, thread_name_prefix="rgt-s3-get"
                ) as pool:
                    futures = [
                        pool.submit(
                            self._get_range,
                            doing,
                            full,
                            etag,
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
        self, doing: str, full: str, etag: str, fd: int, offset: int, length: int, *, ranged: bool
    ) -> None:
        kwargs: Dict[str, Any] = {"Key": full}
        if etag:
            kwargs["IfMatch"] = etag  # every range from the same object, even if it is replaced
        if ranged:
            kwargs["Range"] = f"bytes={offset}-{offset + length - 1}"
        try:
            r = self._call(doing, "get_object", **kwargs)
        except PreconditionFailed:
            raise TransientStoreError(
                f"{doing}: the object was replaced during the download"
            ) from None
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
            raise self._boto_error(e, doing) from None
        finally:
            body.close()
        if done != length:
            raise TransientStoreError(f"{doing}: got {done} bytes of {length}")

    def stat(self, key: str) -> Optional[ObjectInfo]:
        return self._stat(key, f"looking up {key} in {self.url}")

    def _stat(self, key: str, doing: str) -> Optional[ObjectInfo]:
        r = self._call_missing_ok(doing, "head_object", Key=self._key(key))
        if r is None:
            return None
        meta = r.get("Metadata") or {}
        modified = r.get("LastModified")
        return ObjectInfo(
            key,
            int(r["ContentLength"]),
            meta.get(SHA256_META),
            _etag(r.get("ETag")) or None,
            modified.timestamp() if modified is not None else None,
        )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        doing = f"listing {self.url}/{prefix}"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents") or []:
                    modified = obj.get("LastModified")
                    yield ObjectInfo(
                        self._rel(str(obj["Key"])),
                        int(obj["Size"]),
                        None,
                        _etag(obj.get("ETag")) or None,
                        modified.timestamp() if modified is not None else None,
                    )
        except bex.ClientError as e:
            raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None

    def delete(self, key: str) -> None:
        # S3 answers 204 whether or not the key existed; a missing bucket still raises.
        self._call(f"deleting {key} from {self.url}", "delete_object", Key=self._key(key))

    def abort_stale_uploads(self, prefix: str) -> int:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        doing = f"aborting unfinished uploads under {self.url}/{prefix}"
        aborted = 0
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for up in page.get("Uploads") or []:
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                        )
                    except bex.ClientError as e:
                        if e.response.get("Error", {}).get("Code") == "NoSuchUpload":
                            continue  # finished or aborted meanwhile
                        raise
                    aborted += 1
        except bex.ClientError as e:
            raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None
        return aborted

    # -- preflight ---------------------------------------------------------------------------

    def preflight(self, run: str) -> List[Finding]:
        check_key(run)
        probe = f"{run}/.rgt-preflight/{uuid.uuid4().hex}"
        payload = os.urandom(1024)
        sha = hashlib.sha256(payload).hexdigest()
        found: List[Finding] = []
        written = False
        step = "resolve"
        try:
            self._resolve(run, f"store preflight failed at '{step}'")
            step = "write probe"
            doing = f"store preflight failed at '{step}'"
            try:
                checksum = self.checksum(run, doing)
                self._put_object(probe, payload, sha, if_absent=False, doing=doing)
            except IntegrityError as e:
                raise PermanentStoreError(e.what, e.remedy) from None
            written = True
            step = "read back"
            doing = f"store preflight failed at '{step}'"
            got = self._get_bytes(probe, doing)
            info = self._stat(probe, doing)
            step = "compare"
            if got != payload:
                raise PermanentStoreError(
                    f"store preflight failed at '{step}': read back {len(got or b'')} bytes "
                    f"that differ from the {len(payload)} written",
                    "the store, or a proxy on the way, alters data",
                )
            if info is None or info.sha256 != sha:
                found.append(
                    Finding(
                        False,
                        f"{self.url}: the store does not keep object metadata "
                        "(x-amz-meta-sha256); checkpoints are still verified by their ETags",
                    )
                )
            step = "conditional write"
            found.append(self._probe_conditional(probe, payload, sha))
            step = "delete"
            self._call(f"store preflight failed at '{step}'", "delete_object", Key=self._key(probe))
            written = False
        finally:
            if written:
                self._delete_quietly(self._key(probe))
        found.insert(
            0,
            Finding(
                True,
                f"{self.url} at {self.endpoint}: bucket reachable; a probe was written "
                f"({_VERIFIED_BY[checksum]}), read back identical, and deleted",
            ),
        )
        if checksum == "md5":
            found.append(
                Finding(
                    False,
                    f"{self.url}: the store does not check S3 flexible checksums (a body with "
                    "a wrong x-amz-checksum-crc32 was stored); uploads carry Content-MD5 "
                    "instead, which costs more CPU",
                )
            )
        if self.endpoint.startswith("http://") and not _is_loopback(self.endpoint):
            found.append(
                Finding(
                    False,
                    f"{self.endpoint} is plain http: requests are signed, but data and "
                    "checkpoints travel unencrypted",
                )
            )
        return found

    def _resolve(self, run: str, doing: str) -> None:
        """The bucket exists and these credentials may use it."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except bex.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NotFound", "NoSuchBucket"):
                raise PermanentStoreError(
                    f"{doing}: bucket '{self.bucket}' does not exist at {self.endpoint}",
                    "create the bucket, or fix the bucket name or the endpoint",
                ) from None
            if code not in ("403", "400", "Forbidden", "BadRequest"):
                raise self._client_error(e, doing) from None
        except bex.BotoCoreError as e:
            raise self._boto_error(e, doing) from None
        # HEAD answers carry no error body (a bare 403): ask again with a request whose answer
        # says why (InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied).
        self._call(doing, "list_objects_v2", Prefix=self._key(run) + "/", MaxKeys=1)

    def _probe_conditional(self, probe: str, payload: bytes, sha: str) -> Finding:
        doing = "store preflight failed at 'conditional write'"
        try:
            self._put_object(probe, payload, sha, if_absent=True, doing=doing)
        except PreconditionFailed:
            if self.conditional_writes is False:
                return Finding(
                    False,
                    f"{self.url}: the store does not support conditional writes "
                    "(If-None-Match); rgt checks before writing instead, which is not atomic "
                    "between two writers",
                )
            return Finding(True, f"{self.url}: conditional writes (If-None-Match: *) work")
        except IntegrityError as e:
            raise PermanentStoreError(e.what, e.remedy) from None
        return Finding(
            False,
            f"{self.url}: the store ignored If-None-Match and overwrote an existing object; "
            "create-if-absent writes are not protected there",
        )
