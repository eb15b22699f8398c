"""The S3Store itself (see the package docstring): the client, keys under the prefix, calls
with their errors mapped (errors.py), puts (plain; the conditional ones in conditional.py),
reads, ranged parallel downloads, stat, list, delete and the stale-upload sweep. The checksum
protocol, multipart uploads and the preflight are their own modules beside it.
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bex

from onbox.common.errors import IntegrityError, UsageError
from onbox.common.safepath import open_regular
from onbox.sealing.stores.base import (
    Finding,
    Lanes,
    ObjectInfo,
    PermanentStoreError,
    Store,
    check_key,
)
from onbox.sealing.stores.hangbound import HangBound, answers
from onbox.sealing.stores.s3.checksums import (
    CHECKSUMS,
    SHA256_META,
    b64,
    check_put,
    digest,
    etag,
    header,
    probe_crc32,
)
from onbox.sealing.stores.s3.client import MAX_CONCURRENCY, config, is_aws, lean_client
from onbox.sealing.stores.s3.conditional import put_if_absent, put_if_match
from onbox.sealing.stores.s3.download import download
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code
from onbox.sealing.stores.s3.lean import Lean, lean_headers
from onbox.sealing.stores.s3.multipart import (
    MIN_PART,
    MULTIPART_THRESHOLD,
    MiB,
    PartBuffers,
    abort_stale,
    changed,
    pread_exact,
    put_multipart,
)
from onbox.sealing.stores.s3.preflight import preflight as run_preflight
from onbox.sealing.stores.s3.tcpmoved import tcp_moved

SMALL_SLOTS = 8  # bodies of up to TINY in flight per ``concurrency`` (see S3Store.__init__)
TINY = 1 << 20


class S3Store(HangBound, Store):
    """A store under ``s3://bucket/prefix`` on AWS or any S3-compatible endpoint; its calls
    before a download may be bounded (hangbound.py: botocore waits 4 x 60 s for a server that
    stopped answering, and with_retries five times that)."""

    hangs = "the store, or the network to it, stopped answering"
    to_check = "check the store's server and the network to it"

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
        lean: bool = True,
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
        # The sealer puts many files at once (onbox/sealing/upload.py). Every body of more than
        # TINY bytes (a whole file up to the multipart threshold, or one part of a larger one)
        # holds one of ``concurrency`` slots while it is read and sent, and the part buffers of
        # all uploads share one memory bound. A body of up to TINY bytes holds one of
        # SMALL_SLOTS x ``concurrency`` slots instead: a checkpoint of thousands of small files
        # is as many requests, each mostly a round trip and the server's per-object work, which
        # an S3 server does cheaper per object the more it is given at once (SeaweedFS here:
        # ~2.2 ms of its CPU per 16 KiB put one at a time, ~1.2 ms at 8 in flight, ~1.0 ms at
        # 32 to 64; s5cmd keeps 256 in flight). As many files as small slots are worked on at
        # once (at most that many x TINY bytes read ahead); at most ``concurrency`` multipart
        # uploads of them run together.
        self.slots = threading.BoundedSemaphore(concurrency)
        self.small_slots = threading.BoundedSemaphore(SMALL_SLOTS * concurrency)
        self.large_files = threading.BoundedSemaphore(concurrency)
        self.part_buffers = PartBuffers()
        self.parallel_puts = SMALL_SLOTS * concurrency
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
        # Whole-object puts without conditions go out on the lean path where it applies
        # (lean.py: botocore's per-call CPU is what limits a seal of many small files).
        self.lean = lean
        self._lean: Optional[Lean] = None
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
                client = self._make_client()
                if self.lean:
                    self._lean = Lean.for_store(self, client, self._session)
                self._client = client
            return self._client

    def lean_reader(self) -> Optional[Lean]:
        """The lean path for a download's GETs (download.py), where it applies: lean.py on
        wire.py's connections; None keeps them on boto3."""
        lean = self._lean if self.client is not None else None  # the client makes _lean
        return lean if lean is not None and lean.wire is not None else None

    def credentials(self) -> Any:
        """The session's credentials (botocore's object, refreshed as it refreshes them)."""
        return self._session.get_credentials() if self._session is not None else None

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def _make_client(self) -> Any:
        try:
            session = self._session = boto3.session.Session(**self._session_args)
            if self._endpoint_arg is None:
                # Where boto3's own configuration points (AWS_ENDPOINT_URL, the profile's
                # endpoint_url, else AWS): only AWS itself is addressed virtual-hosted.
                default = session.client("s3", config=config())
                if is_aws(default.meta.endpoint_url):
                    return lean_client(default)
                endpoint = default.meta.endpoint_url
            else:
                endpoint = self._endpoint_arg
            return lean_client(
                session.client(
                    "s3",
                    endpoint_url=endpoint,
                    config=config(
                        # Every body we send carries a Content-MD5, which is a signed header: it
                        # pins the body as well as a payload hash would, without hashing it twice
                        # (botocore otherwise sha256-signs every body on plain http).
                        s3={"addressing_style": "path", "payload_signing_enabled": False}
                    ),
                )
            )
        except bex.ProfileNotFound as e:
            raise UsageError("store", f"{self.url}: {e}", "check AWS_PROFILE") from None
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise UsageError(
                "store", f"{self.url}: {e}", "the endpoint is a URL like https://host:port"
            ) from None

    def full_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        # A listed key becomes a key rgt reads, deletes or downloads to a local path: one that
        # rgt could not have written (``..``, an empty part, a NUL) is refused, not used.
        return check_key(full[len(self.prefix) + 1 :] if self.prefix else full)

    def access_key_hint(self) -> str:
        """The access key in use, shortened, so a message shows which one was refused."""
        try:
            creds = self._session.get_credentials() if self._session is not None else None
            ak = str(creds.access_key) if creds is not None else ""
        except Exception:  # only for a message: never mask the error being reported
            ak = ""
        return repr(ak[:4] + "..." + ak[-2:]) if len(ak) > 8 else repr(ak)

    # -- calls, their errors mapped (errors.py) ---------------------------------------------

    def call(self, doing: str, method: str, **kwargs: Any) -> Any:
        """``client.method(Bucket=..., **kwargs)`` with its errors mapped to store errors."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except bex.ClientError as e:
            raise client_error(self, e, doing) from None
        except bex.BotoCoreError as e:
            raise boto_error(self, e, doing) from None

    def call_missing_ok(self, doing: str, method: str, **kwargs: Any) -> Any:
        """As ``call``, but None when the key is absent (a missing bucket still raises)."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except bex.ClientError as e:
            code = error_code(e)
            # HEAD answers a bare 404 for a missing key and a missing bucket alike; the
            # preflight's head_bucket tells a missing bucket apart before anything runs.
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise client_error(self, e, doing) from None
        except bex.BotoCoreError as e:
            raise boto_error(self, e, doing) from None

    def clock_skew(self) -> Optional[float]:
        """From the ``Date`` of a HEAD of the bucket: whole seconds, so the skew is known to a
        second or so (the midpoint of the request stands for the server's moment)."""
        t0 = time.time()
        try:
            got = self.client.head_bucket(Bucket=self.bucket)
        except (bex.ClientError, bex.BotoCoreError):
            return None
        t1 = time.time()
        date = (got.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
        if not date:
            return None
        try:
            server = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return None
        return server - (t0 + t1) / 2

    # -- checksums --------------------------------------------------------------------------

    def checksum(self, scope: str, doing: Optional[str] = None) -> str:
        """The checksum uploads carry, ``crc32`` or ``md5``. Probed once, under ``scope`` (a
        run's key prefix), where the store was made with ``checksum="auto"``."""
        with self._checksum_lock:
            if self._checksum == "auto":
                self._checksum = "crc32" if probe_crc32(self, scope, doing) else "md5"
            return self._checksum

    # -- writing ----------------------------------------------------------------------------

    def put_object(
        self,
        key: str,
        data: bytes,
        sha256: str,
        *,
        if_absent: bool,
        doing: str,
        if_match: Optional[str] = None,
    ) -> ObjectInfo:
        """Put ``data`` (whose sha256 is ``sha256``) under ``key`` with the checksum the store
        verifies, and check the store's answer (checksums.check_put); ``if_absent`` or
        ``if_match`` as in ``put_bytes``. Errors say ``doing``."""
        full = self.full_key(key)
        crc = self.checksum(key.split("/")[0]) == "crc32"
        sent = digest(data, crc)
        kwargs: Dict[str, Any] = dict(
            Key=full,
            Body=data,
            ContentType="application/octet-stream",
            Metadata={SHA256_META: sha256},
        )
        kwargs[header(crc)] = b64(sent)
        lean = self._lean if self.client is not None else None  # the client makes _lean
        if lean is not None and if_match is None and not if_absent:
            r = lean.put(full, lean_headers(crc, sent, sha256), data, doing)
        elif if_match is not None:
            r = put_if_match(self, full, kwargs, if_match, doing)
        elif if_absent:
            r = put_if_absent(self, full, kwargs, doing)
        else:
            r = self.call(doing, "put_object", **kwargs)
        # Checked by the store on arrival where it takes CRC32s; else the ETag must be the MD5.
        check_put(self, doing, full, sent, crc, r)
        self.moved()
        return ObjectInfo(key, len(data), sha256, etag(r.get("ETag")))

    def delete_quietly(self, full: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=full)
        except Exception:  # best effort on a path that already fails with a better error
            pass

    @answers("writing {}")
    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        sha = hashlib.sha256(data).hexdigest()
        return self.put_object(
            key,
            data,
            sha,
            if_absent=if_absent,
            if_match=if_match,
            doing=f"writing {key} to {self.url}",
        )

    hashes_while_uploading = True
    puts_data = True
    watches_uploads = True  # each object and each part put is ``moved`` (hangbound.py)

    def movement(self) -> object:
        # The pieces put, and the bytes the store's connections moved meanwhile (tcpmoved.py):
        # a part is 8 to 64 MiB, each request's body one send.
        client = self._client
        if client is None:
            return self.sent
        url = urlsplit(str(client.meta.endpoint_url))
        port = url.port or (443 if url.scheme == "https" else 80)
        return self.sent, tcp_moved(port)

    def put_data(self, key: str, data: bytes, sha256: str) -> ObjectInfo:
        if len(data) > self.multipart_threshold:
            return super().put_data(key, data, sha256)
        doing = f"uploading {key} to {self.url}"
        with self._slot(len(data)):
            return self.put_object(key, data, sha256, if_absent=False, doing=doing)

    def _slot(self, size: int) -> Any:
        """The slot a whole body of ``size`` bytes holds while it is read and sent."""
        return self.small_slots if size <= TINY else self.slots

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        check_key(key)  # a bad key is refused before the file is opened
        doing = f"uploading {path} to {self.url}/{key}"
        try:
            fd = open_regular(path)  # a FIFO, a link, a device: NotRegularFile, never read
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
                with self._slot(size):  # read in the slot: what is in memory stays bounded
                    data = pread_exact(fd, size, 0, path)
                    got_sha = hashlib.sha256(data).hexdigest()
                    if sha256 is not None and got_sha != sha256:
                        raise changed(doing, sha256)
                    return self.put_object(key, data, got_sha, if_absent=False, doing=doing)
            with self.large_files:
                return put_multipart(self, key, fd, path, sha256, size, doing)
        finally:
            os.close(fd)

    # -- reading ----------------------------------------------------------------------------

    @answers("reading {}")
    def get_bytes(self, key: str) -> Optional[bytes]:
        return self.read(key, f"reading {key} from {self.url}")

    def read(self, key: str, doing: str) -> Optional[bytes]:
        r = self.call_missing_ok(doing, "get_object", Key=self.full_key(key))
        if r is None:
            return None
        try:
            data: bytes = r["Body"].read()
            return data
        except bex.BotoCoreError as e:
            raise boto_error(self, e, doing) from None

    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        doing = f"reading {key} from {self.url}"
        r = self.call_missing_ok(doing, "get_object", Key=self.full_key(key))
        if r is None:
            return None
        try:
            data: bytes = r["Body"].read()
        except bex.BotoCoreError as e:
            raise boto_error(self, e, doing) from None
        return data, etag(r.get("ETag"))

    def get_file(self, key: str, dest: str) -> None:
        download(self, key, dest, None, None)

    def fetch_file(
        self, key: str, dest: str, *, size: Optional[int] = None, lanes: Optional[Lanes] = None
    ) -> Optional[str]:
        return download(self, key, dest, size, lanes)

    @answers("looking at {}")
    def stat(self, key: str) -> Optional[ObjectInfo]:
        return self.head(key, f"looking up {key} in {self.url}")

    def head(self, key: str, doing: str) -> Optional[ObjectInfo]:
        r = self.call_missing_ok(doing, "head_object", Key=self.full_key(key))
        if r is None:
            return None
        meta = r.get("Metadata") or {}
        modified = r.get("LastModified")
        return ObjectInfo(
            key,
            int(r["ContentLength"]),
            meta.get(SHA256_META),
            etag(r.get("ETag")) or None,
            modified.timestamp() if modified is not None else None,
        )

    @answers("listing {}", whole=True)
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
                        etag(obj.get("ETag")) or None,
                        modified.timestamp() if modified is not None else None,
                    )
        except bex.ClientError as e:
            raise client_error(self, e, doing) from None
        except bex.BotoCoreError as e:
            raise boto_error(self, e, doing) from None

    @answers("deleting {}")
    def delete(self, key: str) -> None:
        # S3 answers 204 whether or not the key existed; a missing bucket still raises.
        self.call(f"deleting {key} from {self.url}", "delete_object", Key=self.full_key(key))

    @answers("aborting the uploads left under {}")
    def abort_stale_uploads(self, prefix: str) -> int:
        return abort_stale(self, prefix)

    @answers("its preflight for {}")
    def preflight(self, run: str) -> List[Finding]:
        return run_preflight(self, run)
