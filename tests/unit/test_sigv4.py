"""sigv4.py signs a lean request exactly as botocore's S3SigV4Auth signs it for S3Store's client
(the request a store would otherwise reject as SignatureDoesNotMatch): the same Authorization,
X-Amz-Date, X-Amz-Content-SHA256 and X-Amz-Security-Token, byte for byte, for the same request
at the same moment, over keys that need encoding, headers with odd spacing, temporary
credentials, regions and hosts with and without ports. A real server accepting these signatures
is tested in tests/integration/test_store_s3_lean.py."""

from __future__ import annotations

import datetime
from typing import Dict, Optional

import pytest

# The S3 extra (boto3) is not in every environment the unit tests run in (the Python 3.9 stage).
pytest.importorskip("botocore")

import botocore.auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402
from botocore.utils import percent_encode  # noqa: E402

from onbox.sealing.stores.s3.sigv4 import Signer  # noqa: E402

WHEN = datetime.datetime(2026, 12, 3, 23, 59, 58, tzinfo=datetime.timezone.utc)
CASES = [
    ("PUT", "http://127.0.0.1:8333", "b", "run/checkpoints/5/shard-0001.bin",
     {"Content-Type": "application/octet-stream", "x-amz-meta-sha256": "ab" * 32,
      "x-amz-checksum-crc32": "AAAAAA=="}, None, "us-east-1"),
    ("PUT", "https://s3.example.org", "bucket.with.dots", "p/a b+c~d(1)&=é.bin",
     {"Content-Type": "application/octet-stream", "Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="},
     "FwoGZXIvYXdzEJr//////////wEaDH+token/with=chars", "eu-central-1"),
    ("GET", "http://[::1]:9000", "b", "run/x", {"Range": "bytes=0-67108863",
     "If-Match": '"0123abcd"'}, None, "us-west-2"),
    ("GET", "https://minio.local:443", "b", "k", {"Range": "bytes=5-9"}, None, "auto"),
    ("PUT", "http://host:80", "b", "x//y/./z", {"X-Amz-Meta-Sha256": "  spaced   value  ",
     "User-Agent": "not signed", "Expect": "100-continue"}, "tok", "us-east-1"),
]  # fmt: skip


def _botocore(
    method: str, url: str, headers: Dict[str, str], creds: Credentials, region: str
) -> Dict[str, str]:
    request = AWSRequest(method=method, url=url, data=b"", headers=dict(headers))
    request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    auth = botocore.auth.S3SigV4Auth(creds.get_frozen_credentials(), "s3", region)
    real = botocore.auth.get_current_datetime
    botocore.auth.get_current_datetime = lambda: WHEN.replace(tzinfo=None)
    try:
        auth.add_auth(request)
    finally:
        botocore.auth.get_current_datetime = real
    return dict(request.headers.items())


@pytest.mark.parametrize("method, endpoint, bucket, key, headers, token, region", CASES)
def test_a_lean_signature_is_botocores_byte_for_byte(
    method: str,
    endpoint: str,
    bucket: str,
    key: str,
    headers: Dict[str, str],
    token: Optional[str],
    region: str,
) -> None:
    creds = Credentials("AKIDEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    path = f"/{percent_encode(bucket, safe='~')}/{percent_encode(key, safe='/~')}"
    want = _botocore(method, endpoint + path, headers, creds, region)
    host = endpoint.split("://", 1)[1]
    if host.endswith((":80", ":443")):  # a scheme's own port is not part of the signed host
        host = host.rsplit(":", 1)[0]
    got = Signer(region).sign(method, host, path, headers, creds.get_frozen_credentials(), WHEN)
    for name in ("Authorization", "X-Amz-Date", "X-Amz-Content-SHA256"):
        assert got[name] == want[name], name
    assert got.get("X-Amz-Security-Token") == want.get("X-Amz-Security-Token")
    # The caller's own headers are sent as given.
    assert {k: got[k] for k in headers} == headers


def test_the_signing_key_follows_the_day_and_the_secret() -> None:
    """A run that seals across midnight UTC, or whose temporary credentials were refreshed,
    signs with the key of that day and that secret (a cached key would be refused)."""
    signer = Signer("us-east-1")
    a = Credentials("AKID", "secret-one").get_frozen_credentials()
    b = Credentials("AKID", "secret-two").get_frozen_credentials()
    path, h = "/b/k", {"Range": "bytes=0-1"}
    later = WHEN + datetime.timedelta(seconds=3)  # the next day
    for creds, when in ((a, WHEN), (a, later), (b, later), (a, WHEN)):
        got = signer.sign("GET", "h:1", path, h, creds, when)
        fresh = Signer("us-east-1").sign("GET", "h:1", path, h, creds, when)
        assert got["Authorization"] == fresh["Authorization"]
        if when == WHEN:
            plain = Credentials(creds.access_key, creds.secret_key)
            want = _botocore("GET", "http://h:1" + path, h, plain, "us-east-1")
            assert got["Authorization"] == want["Authorization"]
