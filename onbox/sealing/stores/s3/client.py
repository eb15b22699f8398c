"""How S3Store's boto3 client is configured, and the per-request savings registered on it: no
``Expect: 100-continue`` and one send for small bodies, no parameter validation (with what that
validation told rgt read from the model instead), a pooled connection for every thread that may
send. Measured on a seal of many small files to SeaweedFS (bench/bench_seal.py, row 5).
"""

from __future__ import annotations

from typing import Any, Dict
from urllib.parse import urlsplit

from botocore.config import Config

MAX_CONCURRENCY = 8


def is_aws(endpoint: str) -> bool:
    host = (urlsplit(endpoint).hostname or "").lower()
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


# Below this a body goes out with its headers in one send and no ``Expect: 100-continue``
# (see _no_expect): the multipart threshold's order, where waiting a round trip for the
# server's go-ahead costs more than sending a body that may be refused.
EXPECT_MIN = 8 << 20


def config(**extra: Any) -> Any:
    kwargs: Dict[str, Any] = dict(
        # Modest: the caller's base.with_retries retries whole operations on top of this.
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        # Every request rgt sends is built here from values it checked itself (keys by
        # check_key, checksums it computed); botocore's validation of them against the
        # model costs a tenth of a small PUT's client CPU, for every request.
        parameter_validation=False,
        # The puts in flight (``concurrency`` slots) and the reads, HEADs and lists of the
        # threads that wait for a slot each keep a connection: none is closed and reopened.
        max_pool_connections=3 * MAX_CONCURRENCY,
        **extra,
    )
    try:
        # boto3 >= 1.36 adds CRC32 trailers (aws-chunked bodies) to every upload by default;
        # several S3-compatible stores reject or mangle those, and every body we send already
        # carries a Content-MD5 the server checks. Older boto3 has no such option (TypeError).
        return Config(request_checksum_calculation="when_required", **kwargs)
    except TypeError:
        return Config(**kwargs)


def _no_expect(params: Dict[str, Any], **_: Any) -> None:
    """A small body is sent as bytes with its headers, without ``Expect: 100-continue``.

    botocore makes every PutObject/UploadPart body a file and asks for a 100 Continue before
    sending it: a second round trip per request and a second send, which for a 16 KiB object
    doubles its latency (measured: two sends and a poll per put). A refused request (a wrong
    key, a missing bucket) then costs the body's bytes once, which below EXPECT_MIN is less
    than the round trip saved on every accepted one."""
    body: Any = params.get("body")
    if not hasattr(body, "getvalue"):  # ours are BytesIO (botocore's wrapping of our bytes)
        return
    data = body.getvalue()
    if len(data) < EXPECT_MIN:
        params["headers"].pop("Expect", None)
        params["body"] = data


def lean_client(client: Any) -> Any:
    """``client`` with the per-request savings above registered (after botocore's own)."""
    for op in ("PutObject", "UploadPart"):
        client.meta.events.register_last(f"before-call.s3.{op}", _no_expect)
    return client


def takes(client: Any, operation: str, param: str) -> bool:
    """Whether this botocore's model has ``param`` on ``operation``: with parameter
    validation off (config) an unknown parameter would be dropped silently, not refused."""
    shape = client.meta.service_model.operation_model(operation).input_shape
    return param in shape.members
