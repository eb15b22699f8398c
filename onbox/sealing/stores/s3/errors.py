"""What an S3 store's failures mean: botocore's exceptions and the store's error codes mapped to
rgt's store errors (onbox.common.errors): transient (retry), permanent, a StoreAuthError where
the credentials are refused or missing, PreconditionFailed where a conditional write lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import botocore.exceptions as bex

from onbox.common.errors import (
    PermanentStoreError,
    PreconditionFailed,
    StoreAuthError,
    TransientStoreError,
)

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

TRANSIENT_CODES = {
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
AUTH_CODES = {
    "InvalidAccessKeyId": (
        "the store does not know the access key {key}",
        "check AWS_ACCESS_KEY_ID or the profile, and that the key belongs to this endpoint",
    ),
    "SignatureDoesNotMatch": (
        "the secret key does not match the access key {key}",
        "check AWS_SECRET_ACCESS_KEY or the profile",
    ),
    "ExpiredToken": (
        "the session token has expired",
        "refresh the temporary credentials: AWS_SESSION_TOKEN, sso login",
    ),
    "InvalidToken": ("the session token is invalid", "refresh the temporary credentials"),
    "TokenRefreshRequired": ("the session token must be refreshed", "refresh the credentials"),
}


def error_code(e: Any) -> str:
    """The error code of a botocore ClientError (``NoSuchKey``, ``404``...); '' when none."""
    return str(e.response.get("Error", {}).get("Code", ""))


def http_status(e: Any) -> int:
    """The HTTP status of a botocore ClientError's answer; 0 when unknown."""
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def not_implemented(e: Any) -> bool:
    """Whether the store answered that it does not do what was asked (a conditional write)."""
    return error_code(e) == "NotImplemented" or http_status(e) == 501


def client_error(store: S3Store, e: Any, doing: str) -> Exception:
    """The store error for a ClientError (the store answered, and refused) while ``doing``."""
    err = e.response.get("Error", {})
    code = error_code(e)
    status = http_status(e)
    detail = str(err.get("Message") or code)
    if code in AUTH_CODES:
        what, remedy = AUTH_CODES[code]
        return StoreAuthError(
            f"{doing}: credentials refused: {what.format(key=store.access_key_hint())}", remedy
        )
    if code == "NoSuchBucket":
        return PermanentStoreError(
            f"{doing}: bucket '{store.bucket}' does not exist at {store.endpoint}",
            "create the bucket, or fix the bucket name or the endpoint",
        )
    if code == "PreconditionFailed" or status == 412:
        return PreconditionFailed(f"{doing}: the object already exists")
    if code == "RequestTimeTooSkewed":
        return PermanentStoreError(
            f"{doing}: the store refuses requests because this machine's clock is off",
            "synchronise the clock, with NTP",
        )
    if code == "AccessDenied" or status == 403:
        return PermanentStoreError(
            f"{doing}: access denied ({code or status}: {detail})",
            f"grant these credentials read, write, list, delete and multipart-abort "
            f"rights on {store.url}, or check that they are the right ones",
        )
    if code in TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientStoreError(f"{doing}: the store answered {status} {code}: {detail}")
    return PermanentStoreError(f"{doing}: the store answered {status} {code}: {detail}")


def boto_error(store: S3Store, e: Exception, doing: str) -> Exception:
    """The store error for a BotoCoreError (no answer: credentials, TLS, the network)."""
    if isinstance(e, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return StoreAuthError(
            f"{doing}: no usable S3 credentials found ({e})",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
        )
    if isinstance(e, bex.CredentialRetrievalError):
        return StoreAuthError(f"{doing}: credentials refused: {e}", "check the AWS profile")
    if isinstance(e, bex.SSLError):
        return PermanentStoreError(
            f"{doing}: TLS to {store.endpoint} failed: {e}",
            "check the endpoint URL and AWS_CA_BUNDLE",
        )
    if isinstance(e, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
        return TransientStoreError(
            f"{doing}: cannot reach {store.endpoint} ({e})",
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
        return TransientStoreError(f"{doing}: the connection to {store.endpoint} failed: {e}")
    if isinstance(e, bex.NoRegionError):
        return PermanentStoreError(f"{doing}: {e}", "set AWS_REGION or AWS_DEFAULT_REGION")
    return PermanentStoreError(f"{doing}: {type(e).__name__}: {e}")
