"""The preflight of an S3 store: before training starts, prove the bucket is there and these
credentials may use it, and that a probe is written (with the checksum the store verifies), read
back identical and deleted; report what works less well (no metadata, no conditional writes, no
flexible checksums, plain http) as warnings.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import uuid
from typing import TYPE_CHECKING, List
from urllib.parse import urlsplit

import botocore.exceptions as bex

from onbox.common.errors import IntegrityError, PermanentStoreError, PreconditionFailed
from onbox.sealing.stores.base import Finding, check_key
from onbox.sealing.stores.s3.checksums import VERIFIED_BY
from onbox.sealing.stores.s3.errors import boto_error, client_error, error_code

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store


def is_loopback(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def preflight(store: S3Store, run: str) -> List[Finding]:
    """Prove ``store`` works for ``run`` (Store.preflight); a StoreError names the failed step."""
    check_key(run)
    probe = f"{run}/.rgt-preflight/{uuid.uuid4().hex}"
    payload = os.urandom(1024)
    sha = hashlib.sha256(payload).hexdigest()
    found: List[Finding] = []
    written = False
    step = "resolve"
    try:
        _resolve(store, run, f"store preflight failed at '{step}'")
        step = "write probe"
        doing = f"store preflight failed at '{step}'"
        try:
            checksum = store.checksum(run, doing)
            store.put_object(probe, payload, sha, if_absent=False, doing=doing)
        except IntegrityError as e:
            raise PermanentStoreError(e.what, e.remedy) from None
        written = True
        step = "read back"
        doing = f"store preflight failed at '{step}'"
        got = store.read(probe, doing)
        info = store.head(probe, doing)
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
                    f"{store.url}: the store does not keep object metadata "
                    "(x-amz-meta-sha256); checkpoints are still verified by their ETags",
                )
            )
        step = "conditional write"
        found.append(_probe_conditional(store, probe, payload, sha))
        step = "delete"
        store.call(
            f"store preflight failed at '{step}'", "delete_object", Key=store.full_key(probe)
        )
        written = False
    finally:
        if written:
            store.delete_quietly(store.full_key(probe))
    return _findings(store, checksum, found)


def _findings(store: S3Store, checksum: str, found: List[Finding]) -> List[Finding]:
    """What the preflight proved first, then its warnings."""
    found.insert(
        0,
        Finding(
            True,
            f"{store.url} at {store.endpoint}: bucket reachable; a probe was written "
            f"({VERIFIED_BY[checksum]}), read back identical, and deleted",
        ),
    )
    if checksum == "md5":
        found.append(
            Finding(
                False,
                f"{store.url}: the store does not check S3 flexible checksums (a body with "
                "a wrong x-amz-checksum-crc32 was stored); uploads carry Content-MD5 "
                "instead, which costs more CPU",
            )
        )
    if store.endpoint.startswith("http://") and not is_loopback(store.endpoint):
        found.append(
            Finding(
                False,
                f"{store.endpoint} is plain http: requests are signed, but data and "
                "checkpoints travel unencrypted",
            )
        )
    return found


def _resolve(store: S3Store, run: str, doing: str) -> None:
    """The bucket exists and these credentials may use it."""
    try:
        store.client.head_bucket(Bucket=store.bucket)
        return
    except bex.ClientError as e:
        code = error_code(e)
        if code in ("404", "NotFound", "NoSuchBucket"):
            raise PermanentStoreError(
                f"{doing}: bucket '{store.bucket}' does not exist at {store.endpoint}",
                "create the bucket, or fix the bucket name or the endpoint",
            ) from None
        if code not in ("403", "400", "Forbidden", "BadRequest"):
            raise client_error(store, e, doing) from None
    except bex.BotoCoreError as e:
        raise boto_error(store, e, doing) from None
    # HEAD answers carry no error body (a bare 403): ask again with a request whose answer
    # says why (InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied).
    store.call(doing, "list_objects_v2", Prefix=store.full_key(run) + "/", MaxKeys=1)


def _probe_conditional(store: S3Store, probe: str, payload: bytes, sha: str) -> Finding:
    doing = "store preflight failed at 'conditional write'"
    try:
        store.put_object(probe, payload, sha, if_absent=True, doing=doing)
    except PreconditionFailed:
        if store.conditional_writes is False:
            return Finding(
                False,
                f"{store.url}: the store does not support conditional writes "
                "(If-None-Match); rgt checks before writing instead, which is not atomic "
                "between two writers",
            )
        return Finding(True, f"{store.url}: conditional writes (If-None-Match: *) work")
    except IntegrityError as e:
        raise PermanentStoreError(e.what, e.remedy) from None
    return Finding(
        False,
        f"{store.url}: the store ignored If-None-Match and overwrote an existing object; "
        "create-if-absent writes are not protected there",
    )
