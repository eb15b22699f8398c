"""S3Store against a real S3 server (SeaweedFS ``weed mini``, tests/seaweed.py): what the
shared contract (test_store_contract.py) cannot show.

The promises to users:

- a misconfigured store is refused before training starts, by a message that names the step
  that failed and why: a missing bucket, refused credentials, an unreachable endpoint,
  credentials that may read but not write;
- a checkpoint upload is verified without downloading it (a CRC32 per part that the store
  checks, and the composite CRC32 of the whole; Content-MD5 and the ETag on a store that
  ignores flexible checksums), a body damaged on the way is refused by the store, and an
  upload that cannot be verified, or whose file changed while it was read, leaves no object
  behind and no half upload;
- unfinished uploads of a dead writer are swept; a lost answer to the last request of an
  upload does not fail it;
- the standard AWS configuration (AWS_* variables, AWS_ENDPOINT_URL) is all a user sets;
- an outage of the store is a retryable error, and the store's data is there when it is back.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
import uuid
import zlib
from typing import Any, Iterator, List, Tuple

import pytest
from botocore.awsrequest import AWSResponse

from onbox.common.errors import AuthError, IntegrityError
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import (
    PermanentStoreError,
    StoreError,
    TransientStoreError,
    with_retries,
)
from onbox.sealing.stores.s3 import S3Store, part_size_for
from tests.conftest import ROOT
from tests.seaweed import SeaweedServer, closed_port, start_seaweed

MiB = 1 << 20


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedServer) -> str:
    return s3_server.bucket()


@pytest.fixture
def prefix() -> str:
    return f"s3test/{uuid.uuid4().hex[:8]}"


def _file(path: str, size: int) -> Tuple[str, bytes, str]:
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
    return path, data, hashlib.sha256(data).hexdigest()


def _uploads(server: SeaweedServer, bucket: str, prefix: str) -> List[str]:
    r = server.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return sorted(str(u["Key"]) for u in r.get("Uploads") or [])


# -- preflight -------------------------------------------------------------------------------


def test_preflight_refuses_a_missing_bucket(s3_server: SeaweedServer) -> None:
    """A typo in the bucket name is caught before training, named, and no bucket is created
    (weed creates a bucket on an admin's first PUT: the preflight must stop before any)."""
    name = f"rgt-missing-{uuid.uuid4().hex[:8]}"
    store = s3_server.store(name, "p")
    with pytest.raises(PermanentStoreError) as e:
        store.preflight("run")
    msg = e.value.what
    assert msg.startswith("store preflight failed at 'resolve': ")
    assert f"bucket '{name}' does not exist" in msg
    assert e.value.remedy and "create the bucket" in e.value.remedy
    names = [b["Name"] for b in s3_server.client().list_buckets().get("Buckets", [])]
    assert name not in names


@pytest.mark.parametrize(
    "access_key, secret_key, says",
    [
        ("rgtaccesskey", "not-the-secret", "the secret key does not match the access key"),
        ("nosuchaccesskey", "whatever", "the store does not know the access key"),
    ],
    ids=["wrong-secret", "unknown-key"],
)
def test_wrong_credentials_are_named(
    s3_server: SeaweedServer, bucket: str, prefix: str, access_key: str, secret_key: str, says: str
) -> None:
    """Wrong credentials are a StoreAuthError (an AuthError and a StoreError, exit 14) that says
    'credentials refused' and which half is wrong, at the preflight's first step and on any
    later operation."""
    store = s3_server.store(
        bucket, prefix, aws_access_key_id=access_key, aws_secret_access_key=secret_key
    )
    with pytest.raises(AuthError) as e:
        store.preflight("run")
    assert e.value.what.startswith("store preflight failed at 'resolve': credentials refused: ")
    assert says in e.value.what and e.value.remedy
    assert isinstance(e.value, StoreError) and e.value.exit_code == 14
    with pytest.raises(AuthError, match="credentials refused"):
        store.put_bytes("run/x", b"x")
    with pytest.raises(AuthError, match="credentials refused"):
        store.get_bytes("run/x")


def test_preflight_names_an_unreachable_endpoint(s3_server: SeaweedServer) -> None:
    """An endpoint where nothing listens is reported as unreachable (retryable), at 'resolve',
    within seconds: botocore's own retries are kept modest."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    store = s3_server.store("some-bucket", "p", endpoint_url=endpoint)
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError) as e:
        store.preflight("run")
    assert time.monotonic() - t0 < 30
    assert e.value.what.startswith("store preflight failed at 'resolve': cannot reach ")
    assert endpoint in e.value.what


def test_preflight_names_the_write_step_for_read_only_credentials(
    s3_server: SeaweedServer, bucket: str, prefix: str
) -> None:
    """Credentials that may list and read but not write pass 'resolve' and are refused at
    'write probe', as access denied with a remedy; nothing is left behind."""
    store = s3_server.store(
        bucket,
        prefix,
        aws_access_key_id=s3_server.reader_access_key,
        aws_secret_access_key=s3_server.reader_secret_key,
    )
    with pytest.raises(PermanentStoreError) as e:
        store.preflight("run")
    assert e.value.what.startswith("store preflight failed at 'write probe': access denied")
    assert e.value.remedy
    assert list(s3_server.store(bucket, prefix).list("")) == []


def test_preflight_reports_conditional_writes(
    s3_server: SeaweedServer, bucket: str, prefix: str
) -> None:
    """The preflight says what it proved, including that create-if-absent writes are atomic on
    this store (SeaweedFS honours If-None-Match: *)."""
    findings = s3_server.store(bucket, prefix).preflight("run")
    assert all(f.ok for f in findings), findings
    assert any("conditional writes" in f.what for f in findings)


# -- verified uploads ------------------------------------------------------------------------


def _crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def test_multipart_upload_is_verified_by_composite_crc32_and_keeps_sha256(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any
) -> None:
    """SeaweedFS checks flexible checksums, so the probe picks CRC32: the object's composite
    CRC32 is the CRC32 of the parts' CRC32s (what rgt verified), and the sha256 travels as
    metadata for stat."""
    path, data, sha = _file(str(tmp_path / "f"), 20 * MiB + 1)
    store = s3_server.store(bucket, prefix, part_size=5 * MiB)
    info = store.put_file("run/f", path, sha256=sha, size=len(data))
    assert store.checksum("run") == "crc32"
    parts = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    crcs = b"".join(zlib.crc32(p).to_bytes(4, "big") for p in parts)
    head = s3_server.client().head_object(
        Bucket=bucket, Key=f"{prefix}/run/f", ChecksumMode="ENABLED"
    )
    assert head["ChecksumCRC32"] == f"{_crc32_b64(crcs)}-5"
    assert head["Metadata"] == {"sha256": sha}
    assert info.sha256 == sha and info.size == len(data)
    # The probe that found this out left nothing behind.
    assert [o.key for o in store.list("run/")] == ["run/f"]


def test_a_store_that_ignores_flexible_checksums_simulated_gets_content_md5(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any
) -> None:
    """A store that ignores x-amz-checksum-crc32 (simulated: the header is dropped on its way
    to the real server) stores the probe's deliberately wrong CRC32: rgt deletes that probe,
    says so in the preflight, and verifies by Content-MD5 and ETag instead."""
    store = s3_server.store(bucket, prefix)

    def drop_checksum(request: Any, **_: Any) -> None:
        for name in [h for h in request.headers if h.lower().startswith("x-amz-checksum-")]:
            del request.headers[name]

    store.client.meta.events.register("before-sign.s3.PutObject", drop_checksum)
    findings = store.preflight("run")
    assert store.checksum("run") == "md5"
    assert any(not f.ok and "Content-MD5" in f.what for f in findings), findings
    assert "Content-MD5 and ETag verified" in findings[0].what
    assert list(store.list("run/")) == []
    path, data, sha = _file(str(tmp_path / "f"), 11 * MiB)
    store.put_file("run/f", path, sha256=sha, size=len(data))
    assert store.get_bytes("run/f") == data


@pytest.mark.parametrize("checksum", ["crc32", "md5"])
@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["single", "multipart"])
def test_a_body_damaged_on_the_way_is_refused_by_the_store(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any, checksum: str, size: int
) -> None:
    """A byte flipped after rgt took the checksum (on the wire, in a proxy) is refused by the
    real server, as a transient error (send it again); the upload is aborted and nothing is
    stored."""
    path, _, sha = _file(str(tmp_path / "f"), size)
    store = s3_server.store(bucket, prefix, part_size=5 * MiB, checksum=checksum)

    def flip(request: Any, **_: Any) -> None:
        raw = request.body
        if hasattr(raw, "read"):  # botocore wraps a bytes body in a file object
            raw.seek(0)
            raw = raw.read()
        body = bytearray(raw)
        body[len(body) // 2] ^= 0x01
        request.body = bytes(body)

    store.client.meta.events.register("before-send.s3.PutObject", flip)
    store.client.meta.events.register("before-send.s3.UploadPart", flip)
    with pytest.raises(TransientStoreError, match="BadDigest"):
        store.put_file("run/f", path, sha256=sha, size=size)
    assert store.stat("run/f") is None
    assert _uploads(s3_server, bucket, prefix) == []


def test_multipart_upload_is_verified_by_etag_and_keeps_sha256(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any
) -> None:
    """Where uploads carry Content-MD5: a multipart checkpoint is stored as parts of the
    chosen size, its ETag is the MD5 of the parts' MD5s (what rgt verified), and its sha256
    travels as metadata for stat."""
    path, data, sha = _file(str(tmp_path / "f"), 20 * MiB + 1)
    store = s3_server.store(bucket, prefix, part_size=5 * MiB, checksum="md5")
    info = store.put_file("run/f", path, sha256=sha, size=len(data))
    parts = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    assert info.etag == f"{expected}-5"
    head = s3_server.client().head_object(Bucket=bucket, Key=f"{prefix}/run/f")
    assert head["ETag"].strip('"') == f"{expected}-5"
    assert head["Metadata"] == {"sha256": sha}
    assert head["ContentType"] == "application/octet-stream"


def test_default_part_size_follows_the_object() -> None:
    """Part sizes suit the object: 8 MiB parts for small multipart objects, 16 MiB for 1 GiB,
    64 MiB at most until 10000 parts would not hold the object."""
    assert part_size_for(20 * MiB) == 8 * MiB
    assert part_size_for(1024 * MiB) == 16 * MiB
    assert part_size_for(100 * 1024 * MiB) == 64 * MiB
    huge = 5 * 1024 * 1024 * MiB
    assert part_size_for(huge) * 10000 >= huge and part_size_for(huge) % MiB == 0


# What a store that lies (or data altered after the store checked it) answers, per checksum.
_LIES = {
    "md5": ("ETag", "0123456789abcdef0123456789abcdef"),
    "crc32": ("ChecksumCRC32", "AAAAAA=="),
}


@pytest.mark.parametrize("checksum", ["crc32", "md5"])
@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["single", "multipart"])
def test_an_answer_that_does_not_verify_fails_the_upload(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any, size: int, checksum: str
) -> None:
    """If the checksum the store answers is not the one rgt computed (the ETag where uploads
    carry Content-MD5: data altered, or an SSE-KMS bucket; the CRC32, or for the whole object
    the composite of the parts' CRC32s), the upload fails with IntegrityError and the
    unverifiable object is removed."""
    path, _, sha = _file(str(tmp_path / "f"), size)
    store = s3_server.store(bucket, prefix, part_size=5 * MiB, checksum=checksum)
    field, value = _LIES[checksum]

    def lie(parsed: Any, **_: Any) -> None:
        if field in parsed:
            parsed[field] = value + ("-3" if "-" in parsed[field] else "")

    store.client.meta.events.register("after-call.s3.PutObject", lie)
    store.client.meta.events.register("after-call.s3.CompleteMultipartUpload", lie)
    with pytest.raises(IntegrityError, match="ETag" if checksum == "md5" else "CRC32"):
        store.put_file("run/f", path, sha256=sha, size=size)
    assert store.stat("run/f") is None
    assert _uploads(s3_server, bucket, prefix) == []


def test_file_changed_during_upload_leaves_nothing(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any
) -> None:
    """A checkpoint file rewritten while it is being uploaded (the trainer saved over it) is
    refused with IntegrityError, the multipart upload is aborted, and no object appears."""
    path, data, sha = _file(str(tmp_path / "f"), 20 * MiB + 7)
    # One part in flight and one read ahead: the last part is read only after the first
    # part's upload returned, and by then the file's tail has changed.
    store = s3_server.store(bucket, prefix, part_size=5 * MiB, concurrency=1)
    changed: List[bool] = []

    def rewrite_tail(**_: Any) -> None:
        if not changed:
            with open(path, "r+b") as f:
                f.seek(len(data) - 100)
                f.write(os.urandom(100))
            changed.append(True)

    store.client.meta.events.register("after-call.s3.UploadPart", rewrite_tail)
    with pytest.raises(IntegrityError, match="changed"):
        store.put_file("run/f", path, sha256=sha, size=len(data))
    assert changed
    assert store.stat("run/f") is None
    assert _uploads(s3_server, bucket, prefix) == []


@pytest.mark.parametrize("retry_answer", ["ok", "NoSuchUpload"])
def test_lost_answer_to_complete_is_recovered(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any, retry_answer: str
) -> None:
    """When the answer to CompleteMultipartUpload is lost and botocore retries it, the upload
    still succeeds: SeaweedFS (like AWS) answers the retry 200 with the same ETag; a store
    that answers NoSuchUpload instead (simulated) gets the object checked by its sha256
    metadata and ETag."""
    path, data, sha = _file(str(tmp_path / "f"), 11 * MiB)
    store = s3_server.store(bucket, prefix, part_size=5 * MiB)
    sends: List[int] = []

    def lose_first_answer(response: Any, attempts: int, **_: Any) -> Any:
        if attempts == 1 and response is not None and response[0].status_code == 200:
            return 0  # retry at once, as if the 200 had never arrived
        return None

    def answer_retry(request: Any, **_: Any) -> Any:
        sends.append(1)
        if len(sends) == 2 and retry_answer == "NoSuchUpload":
            body = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchUpload</Code>"
                b"<Message>The specified upload does not exist.</Message></Error>"
            )
            return AWSResponse(request.url, 404, {"Content-Type": "application/xml"}, _Raw(body))
        return None

    events = store.client.meta.events
    events.register("needs-retry.s3.CompleteMultipartUpload", lose_first_answer)
    events.register("before-send.s3.CompleteMultipartUpload", answer_retry)
    info = store.put_file("run/f", path, sha256=sha, size=len(data))
    assert len(sends) == 2
    assert info.etag and info.etag.endswith("-3")
    assert store.get_bytes("run/f") == data


class _Raw:
    """The raw body of a simulated HTTP answer (what botocore reads a response from)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def test_abort_stale_uploads_sweeps_only_under_the_prefix(
    s3_server: SeaweedServer, bucket: str, prefix: str
) -> None:
    """Half-finished uploads a dead writer left under a run are aborted (they cost storage and
    are invisible), those of other runs are not, and no object appears."""
    client = s3_server.client()
    for key in (f"{prefix}/run/ckpt/1/model.pt", f"{prefix}/other/ckpt/1/model.pt"):
        up = client.create_multipart_upload(Bucket=bucket, Key=key)
        client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * MiB
        )
    store = s3_server.store(bucket, prefix)
    assert store.abort_stale_uploads("run/") == 1
    assert _uploads(s3_server, bucket, prefix) == [f"{prefix}/other/ckpt/1/model.pt"]
    assert store.abort_stale_uploads("run/") == 0
    assert store.stat("run/ckpt/1/model.pt") is None
    assert store.abort_stale_uploads("other/") == 1


def test_get_file_of_a_missing_key_or_bucket(
    s3_server: SeaweedServer, bucket: str, prefix: str, tmp_path: Any
) -> None:
    """Downloading a checkpoint that is not there says so; a missing bucket is not mistaken
    for an empty one when reading."""
    store = s3_server.store(bucket, prefix)
    with pytest.raises(PermanentStoreError, match="is not in"):
        store.get_file("run/none", str(tmp_path / "d"))
    gone = s3_server.store(f"rgt-missing-{uuid.uuid4().hex[:8]}", "p")
    with pytest.raises(PermanentStoreError, match="does not exist"):
        gone.get_bytes("run/x")
    with pytest.raises(PermanentStoreError, match="does not exist"):
        list(gone.list("run/"))


# -- configuration and outages ---------------------------------------------------------------


def test_standard_aws_configuration_is_enough(
    s3_server: SeaweedServer, bucket: str, prefix: str
) -> None:
    """A user sets only the standard AWS_* variables (AWS_ENDPOINT_URL included) and an
    s3:// URL: the store finds the endpoint, addresses it path-style, and works."""
    code = (
        "import sys\n"
        "from onbox.sealing.stores import open_store\n"
        "s = open_store(sys.argv[1])\n"
        "print(s.client.meta.config.s3['addressing_style'], s.endpoint)\n"
        "s.preflight('run')\n"
        "s.put_bytes('run/x', b'hello')\n"
        "print(s.get_bytes('run/x').decode())\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, f"s3://{bucket}/{prefix}"],
        env=s3_server.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["path", s3_server.endpoint, "hello"]


def test_outage_is_transient_and_data_survives_a_restart(
    s3_server: SeaweedServer, tmp_path: Any
) -> None:
    """While the store is down every operation fails as retryable (never as 'absent');
    base.with_retries carries a write over a short outage; what was stored before is there
    after the restart. (Its own weed, so the session's server is not disturbed.)"""
    server = start_seaweed(str(tmp_path / "weed"))
    try:
        bucket = server.bucket()
        store = server.store(bucket, "p")
        store.put_bytes("run/a", b"before")
        server.stop()
        for op in (lambda: store.get_bytes("run/a"), lambda: store.stat("run/a")):
            with pytest.raises(TransientStoreError, match="cannot reach"):
                op()

        def sleep_then_restart(_: float) -> None:
            if server.proc is not None and server.proc.poll() is not None:
                server.start()

        with_retries(lambda: store.put_bytes("run/b", b"during"), sleep=sleep_then_restart)
        assert store.get_bytes("run/a") == b"before"
        assert store.get_bytes("run/b") == b"during"
        server.restart(down_for=0.5)
        # weed's S3 gateway answers before its volume server has reloaded, and a read in that
        # window gets a 500 (seen in CI): a transient answer, which the agent's retry carries.
        assert with_retries(lambda: store.get_bytes("run/b")) == b"during"
    finally:
        server.stop()


def test_bad_arguments_are_refused_early() -> None:
    """Part sizes below S3's minimum, or too much concurrency, are programming errors."""
    with pytest.raises(ValueError):
        S3Store("bucket", "p", part_size=MiB)
    with pytest.raises(ValueError):
        S3Store("bucket", "p", concurrency=9)


def test_the_store_clock_is_read_from_the_servers_date(
    s3_server: SeaweedServer, bucket: str, tmp_path: Any
) -> None:
    """The sealing probe's clock skew: the server's Date header against this box's clock. The
    server runs on this very machine, so the skew is the Date's rounding (a second) and the
    request's time; a store without a clock of its own (a mount) says it cannot tell."""
    skew = s3_server.store(bucket, "skew").clock_skew()
    assert skew is not None and abs(skew) < 3.0, skew
    assert open_store(f"file://{tmp_path}").clock_skew() is None
    # a bucket that is not there: unknown, not an error and not 0
    assert s3_server.store(f"rgt-missing-{uuid.uuid4().hex[:8]}", "p").clock_skew() is None
