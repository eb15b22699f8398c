"""The lean PUT of small objects (onbox/sealing/stores/s3/lean.py) against a real S3 server
(SeaweedFS ``weed mini``): it means what boto3's put_object means.

The promises: a small object put on the lean path is stored as boto3 would store it (key,
bytes, ``x-amz-meta-sha256``, content type, the checksum the store verified); every failure a
user can meet on it (a wrong secret key, an unknown access key, credentials that may only read,
a body damaged on the way, an endpoint that does not answer) is the same rgt error, with the
same message and remedy, as on the boto3 path; no credential appears in any error text. The
store contract (test_store_contract.py), test_store_s3.py and the many-file seal and restore
(test_sealing_many.py) run on the lean path too: it is the default.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any, Callable, List, Tuple

import pytest

from onbox.common.errors import RgtError, StoreAuthError
from onbox.sealing.stores.base import PermanentStoreError, TransientStoreError
from onbox.sealing.stores.s3 import S3Store, download
from tests.seaweed import SeaweedServer, closed_port

SIZE = 20_000


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedServer) -> str:
    return s3_server.bucket()


@pytest.fixture
def small(tmp_path: Any) -> Tuple[str, bytes, str]:
    data = os.urandom(SIZE)
    path = str(tmp_path / "shard.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data, hashlib.sha256(data).hexdigest()


def _boto_puts(store: S3Store) -> List[str]:
    """The PutObject calls that went through boto3's client layer (not the lean path)."""
    calls: List[str] = []
    store.client.meta.events.register(
        "before-call.s3.PutObject", lambda **kw: calls.append(kw["params"]["url_path"])
    )
    return calls


@pytest.mark.parametrize("checksum", ["crc32", "md5"])
def test_a_lean_put_stores_what_a_boto3_put_stores(
    s3_server: SeaweedServer, bucket: str, small: Tuple[str, bytes, str], checksum: str
) -> None:
    path, data, sha = small
    prefix = f"lean/{uuid.uuid4().hex[:8]}"
    heads = []
    for lean in (True, False):
        store = s3_server.store(bucket, prefix, lean=lean, checksum=checksum)
        via_boto = _boto_puts(store)
        key = f"run/{'lean' if lean else 'boto'} a+b~c.bin"  # characters that need encoding
        info = store.put_file(key, path, sha256=None, size=SIZE)
        assert (info.size, info.sha256) == (SIZE, sha)
        assert bool(via_boto) is not lean  # the lean store never used boto3 for the put
        assert store.get_bytes(key) == data
        head = s3_server.client().head_object(
            Bucket=bucket, Key=f"{prefix}/{key}", ChecksumMode="ENABLED"
        )
        heads.append(
            (
                info.etag,
                head["ETag"].strip('"'),
                head["ContentType"],
                head["Metadata"],
                head.get("ChecksumCRC32"),
            )
        )
    assert heads[0] == heads[1]
    assert heads[0][1] == hashlib.md5(data).hexdigest() and heads[0][3] == {"sha256": sha}


def _both(make: Callable[[bool], S3Store], act: Callable[[S3Store], Any]) -> List[RgtError]:
    """The error ``act`` raises on a lean and on a boto3 store made by ``make``."""
    errors: List[RgtError] = []
    for lean in (True, False):
        with pytest.raises(RgtError) as got:
            act(make(lean))
        errors.append(got.value)
    return errors


def _same(errors: List[RgtError], cls: type, *words: str) -> None:
    lean, boto = errors
    assert type(lean) is type(boto) and isinstance(lean, cls), errors
    assert (lean.what, lean.remedy) == (boto.what, boto.remedy)
    for w in words:
        assert w in str(lean), lean


@pytest.mark.parametrize(
    "who",
    ["wrong-secret", "unknown-key", "reader"],
)
def test_refused_credentials_are_the_same_error_on_the_lean_path(
    s3_server: SeaweedServer, bucket: str, small: Tuple[str, bytes, str], who: str
) -> None:
    """A wrong secret key, an access key the store does not know, credentials that may only
    read: the same class, message and remedy as boto3's, and no secret in the text."""
    path, _, _ = small
    keys = {
        "wrong-secret": (s3_server.access_key, "not-the-secret-key"),
        "unknown-key": ("AKIDNOTKNOWNHERE", s3_server.secret_key),
        "reader": (s3_server.reader_access_key, s3_server.reader_secret_key),
    }[who]

    def make(lean: bool) -> S3Store:
        return s3_server.store(
            bucket,
            "lean/refused",
            lean=lean,
            checksum="crc32",  # no probe: the first request is the put itself
            aws_access_key_id=keys[0],
            aws_secret_access_key=keys[1],
        )

    errors = _both(make, lambda s: s.put_file("run/x.bin", path, sha256=None, size=SIZE))
    if who == "reader":
        _same(errors, PermanentStoreError, "access denied")
        assert not isinstance(errors[0], StoreAuthError)
    else:
        _same(errors, StoreAuthError, "credentials refused")
    for e in errors:
        text = f"{e} {e!r}"
        assert keys[1] not in text and s3_server.secret_key not in text
        assert "Signature=" not in text and "Credential=" not in text


@pytest.mark.parametrize("who", ["wrong-secret", "unknown-key"])
def test_refused_credentials_at_a_ranged_downloads_head_are_the_same_error_on_the_lean_path(
    s3_server: SeaweedServer,
    bucket: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    who: str,
) -> None:
    """A download of a file fetched in ranges asks its size and ETag with a HEAD first (on
    the lean path since the HEAD, too, must be cut off by a stop); refused there, it is the
    same error as boto3's (access denied: a HEAD's bare 403 has no body to tell a wrong key
    from a denied one; a restore's or pull's GETs of LATEST and the MANIFEST before it tell
    them apart), and nothing is left."""
    monkeypatch.setattr(download, "WHOLE_MAX", 64 << 10)
    prefix = f"lean/{uuid.uuid4().hex[:8]}"
    s3_server.store(bucket, prefix).put_bytes("run/big.bin", os.urandom(100 << 10))
    keys = {
        "wrong-secret": (s3_server.access_key, "not-the-secret-key"),
        "unknown-key": ("AKIDNOTKNOWNHERE", s3_server.secret_key),
    }[who]

    def make(lean: bool) -> S3Store:
        store = s3_server.store(
            bucket, prefix, lean=lean, aws_access_key_id=keys[0], aws_secret_access_key=keys[1]
        )
        assert (store.lean_reader() is not None) is lean
        return store

    dest = str(tmp_path / "big.bin")
    errors = _both(make, lambda s: s.fetch_file("run/big.bin", dest, size=100 << 10))
    _same(errors, PermanentStoreError, "access denied")
    assert not os.path.exists(dest)


@pytest.mark.parametrize("checksum", ["crc32", "md5"])
def test_a_body_damaged_on_the_way_is_the_same_error_on_the_lean_path(
    s3_server: SeaweedServer, bucket: str, small: Tuple[str, bytes, str], checksum: str
) -> None:
    """A byte flipped after the checksum was taken (at the send, as a proxy would) is refused
    by the real server on both paths, as the same transient error; nothing is stored."""
    path, _, _ = small
    prefix = f"lean/{uuid.uuid4().hex[:8]}"

    def flip(request: Any, **_: Any) -> None:
        body = bytearray(request.body if isinstance(request.body, bytes) else b"")
        body[len(body) // 2] ^= 0x01
        request.body = bytes(body)

    def make(lean: bool) -> S3Store:
        store = s3_server.store(bucket, prefix, lean=lean, checksum=checksum)
        store.client.meta.events.register("before-send.s3.PutObject", flip)
        return store

    errors = _both(make, lambda s: s.put_file("run/x.bin", path, sha256=None, size=SIZE))
    _same(errors, TransientStoreError, "BadDigest" if checksum == "md5" else "")
    assert s3_server.store(bucket, prefix).stat("run/x.bin") is None


def test_an_endpoint_that_does_not_answer_is_the_same_error_on_the_lean_path(
    s3_server: SeaweedServer, small: Tuple[str, bytes, str]
) -> None:
    path, _, _ = small
    endpoint = f"http://127.0.0.1:{closed_port()}"

    def make(lean: bool) -> S3Store:
        return s3_server.store("b", lean=lean, checksum="crc32", endpoint_url=endpoint)

    errors = _both(make, lambda s: s.put_file("run/x.bin", path, sha256=None, size=SIZE))
    _same(errors, TransientStoreError, "cannot reach")
