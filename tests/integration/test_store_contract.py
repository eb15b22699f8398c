"""The Store contract (onbox/sealing/stores/base.py), the same tests against every store: a
directory
(LocalStore) and a real S3 server (S3Store on SeaweedFS, tests/seaweed.py).

The promise to users: whichever durable store a run seals its checkpoints to, a checkpoint comes
back byte for byte, a failed or mismatched upload never leaves something under the final name
that a resume would trust, create-if-absent writes refuse a second writer, and no key can
escape the store's root.

The S3 store runs with 5 MiB parts (S3's smallest), so the 20 MiB file is a real five-part
multipart upload with a short last part.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import random
import threading
import uuid
from typing import Iterator, Tuple

import pytest

from onbox.common.errors import IntegrityError
from onbox.sealing.stores.base import (
    Lanes,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    TransientStoreError,
)
from onbox.sealing.stores.local import LocalStore
from tests.seaweed import SeaweedServer

MiB = 1 << 20
BIG = 20 * MiB + 12345  # multipart on S3: four 5 MiB parts and a short fifth


def _file(path: str, size: int) -> Tuple[str, str]:
    """Write ``size`` random bytes to ``path``; the path and its sha256."""
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
    return path, hashlib.sha256(data).hexdigest()


def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _rewritten(path: str, size: int) -> Iterator[None]:
    """Inside the block, a thread rewrites 4 KiB at a random place of ``path`` (``size``
    bytes) again and again, without pausing: a writer changing a file in place."""
    stop = threading.Event()

    def rewrite() -> None:
        with open(path, "r+b") as f:
            while not stop.is_set():
                f.seek(random.randrange(size - 4096))
                f.write(os.urandom(4096))
                f.flush()

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


def _local(tmp_path: os.PathLike[str]) -> LocalStore:
    """A ``file://`` store in a directory made for it (a store root is the user's to make)."""
    root = os.path.join(tmp_path, "store")
    os.mkdir(root)
    return LocalStore(root)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Store]:
    """A fresh, empty store of each kind (S3: a new prefix in a session bucket)."""
    if request.param == "local":
        yield _local(tmp_path)
        return
    server: SeaweedServer = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("contract_bucket")
    yield server.store(bucket, f"contract/{uuid.uuid4().hex[:8]}", part_size=5 * MiB)


@pytest.fixture(scope="session")
def contract_bucket(s3_server: SeaweedServer) -> str:
    return s3_server.bucket()


@pytest.mark.parametrize("size", [0, 1000, BIG], ids=["empty", "small", "multipart"])
def test_put_file_round_trip(store: Store, tmp_path: os.PathLike[str], size: int) -> None:
    """A sealed checkpoint downloads byte for byte, and stat reports its size (and, where the
    store keeps it, its sha256) without a download."""
    src, sha = _file(os.path.join(tmp_path, "src"), size)
    info = store.put_file("run/ckpt/1/model.pt", src, sha256=sha, size=size)
    assert (info.key, info.size, info.sha256) == ("run/ckpt/1/model.pt", size, sha)

    dest = os.path.join(tmp_path, "dest")
    store.get_file("run/ckpt/1/model.pt", dest)
    assert os.path.getsize(dest) == size and _sha256_of(dest) == sha

    st = store.stat("run/ckpt/1/model.pt")
    assert st is not None and st.size == size
    if isinstance(store, LocalStore):
        assert st.sha256 in (None, sha)  # a directory keeps no checksum of its own
    else:
        assert st.sha256 == sha


@pytest.mark.parametrize("length", [240, 255])
def test_a_name_of_up_to_255_bytes_round_trips(
    store: Store, tmp_path: os.PathLike[str], length: int
) -> None:
    """Any file name the box's filesystem allows (NAME_MAX, 255 bytes) is sealed and comes
    back: a store's temporary name must not be longer than the name itself (file:// made
    ``.NAME.rgt-tmp.PID.HEX``, too long past ~230 bytes, and then a raw OSError hid it)."""
    name = "w" * (length - 4) + ".bin"
    src, sha = _file(os.path.join(tmp_path, name), 1000)
    key = f"run/ckpt/1/{name}"
    assert store.put_file(key, src, sha256=sha, size=1000).sha256 == sha
    assert store.put_bytes(key, b"again").size == 5  # a replace of the same name
    assert store.get_bytes(key) == b"again"
    assert [o.key for o in store.list("run/ckpt/1/")] == [key]


@pytest.mark.parametrize("size", [0, 1000, BIG], ids=["empty", "small", "multipart"])
@pytest.mark.parametrize("hint", [True, False], ids=["size-known", "size-unknown"])
def test_fetch_file_returns_the_sha256_of_what_it_wrote(
    store: Store, tmp_path: os.PathLike[str], size: int, hint: bool
) -> None:
    """A restore verifies each file by the sha256 the store computed while writing it (S3:
    ranged parts in shared lanes, hashed behind the writers): it must be the written bytes'.
    A stopped restore starts no download and leaves no file."""
    src, sha = _file(os.path.join(tmp_path, "src"), size)
    store.put_file("run/f", src, sha256=sha, size=size)
    lanes = Lanes(3)
    try:
        dest = os.path.join(tmp_path, "dest")
        got = store.fetch_file("run/f", dest, size=size if hint else None, lanes=lanes)
        assert got == sha and _sha256_of(dest) == sha
        with pytest.raises(PermanentStoreError):  # a new file, never over an existing name
            store.fetch_file("run/f", dest, lanes=lanes)
        lanes.stop()
        with pytest.raises(concurrent.futures.CancelledError):
            store.fetch_file("run/f", os.path.join(tmp_path, "stopped"), lanes=lanes)
        assert not os.path.exists(os.path.join(tmp_path, "stopped"))
    finally:
        lanes.close()


@pytest.mark.parametrize("size", [0, BIG], ids=["empty", "multipart"])
def test_put_file_without_a_sha256_returns_the_stored_bytes_hash(
    store: Store, tmp_path: os.PathLike[str], size: int
) -> None:
    """The sealer skips its own hashing pass for stores that hash while they upload: the sha256
    they return must be that of the bytes now in the store."""
    assert store.hashes_while_uploading
    src, sha = _file(os.path.join(tmp_path, "src"), size)
    info = store.put_file("run/x", src, sha256=None, size=size)
    assert info.sha256 == sha
    dest = os.path.join(tmp_path, "dest")
    store.get_file("run/x", dest)
    assert _sha256_of(dest) == sha


def test_a_source_rewritten_during_the_upload_is_refused_or_hashed_as_stored(
    store: Store, tmp_path: os.PathLike[str]
) -> None:
    """A job rewriting its file in place while it is sealed: each upload either fails with an
    IntegrityError and leaves nothing under the key, or stores bytes whose sha256 it returns.
    Never a mix under a final name with a checksum that does not describe it."""
    src, _ = _file(os.path.join(tmp_path, "src"), BIG)
    outcomes = []
    with _rewritten(src, BIG):
        for i in range(4):
            key = f"run/rewritten/{i}"
            try:
                info = store.put_file(key, src, sha256=None, size=BIG)
            except IntegrityError:
                assert store.stat(key) is None
                outcomes.append("refused")
                continue
            dest = os.path.join(tmp_path, f"dest{i}")
            store.get_file(key, dest)
            assert _sha256_of(dest) == info.sha256
            outcomes.append("stored")
    if isinstance(store, LocalStore):
        # It compares the source's mtime before and after; the writer never pauses. (S3 hashes
        # the very buffers it sends, so what it stores always matches what it returns; the
        # sealer then refuses the mix by the same mtime check.)
        assert "refused" in outcomes


@pytest.mark.parametrize("size", [MiB, BIG], ids=["read-whole", "kernel-copy"])
def test_a_file_store_object_rewritten_during_a_download_is_refused_or_hashed_as_written(
    tmp_path: os.PathLike[str], size: int
) -> None:
    """file:// only (an S3 object is never rewritten in place): something rewriting an object
    of a durable mount while a restore copies it. Each download either fails as transient and
    leaves nothing at its destination, or returns the sha256 of exactly the bytes it wrote
    (which the restore then compares with the MANIFEST's). Both copies: an object of up to
    4 MiB read whole and hashed in memory, a larger one copied by the kernel while a second
    thread hashes the source."""
    store = _local(tmp_path)
    src, _ = _file(os.path.join(tmp_path, "src"), size)
    store.put_file("run/x", src, sha256=None, size=size)
    outcomes = []
    with _rewritten(os.path.join(store.root, "run", "x"), size):
        for i in range(20):
            dest = os.path.join(tmp_path, f"dest{i}")
            try:
                got = store.fetch_file("run/x", dest, size=size)
            except TransientStoreError:
                assert not os.path.exists(dest)
                outcomes.append("refused")
                continue
            assert got == _sha256_of(dest)
            outcomes.append("copied")
    if size > 4 * MiB:
        # The copy takes long enough that the writer, which never pauses, moves the object's
        # mtime within it every time (a 1 MiB read may fall between two clock ticks).
        assert "refused" in outcomes


def test_put_file_twice_is_idempotent(store: Store, tmp_path: os.PathLike[str]) -> None:
    """A retried upload (the first one's answer lost) succeeds and leaves the same object."""
    src, sha = _file(os.path.join(tmp_path, "src"), BIG)
    store.put_file("run/a", src, sha256=sha, size=BIG)
    store.put_file("run/a", src, sha256=sha, size=BIG)
    dest = os.path.join(tmp_path, "dest")
    store.get_file("run/a", dest)
    assert _sha256_of(dest) == sha


def test_stat_and_get_of_a_missing_key(store: Store) -> None:
    """Looking for a checkpoint that was never sealed answers 'absent', not an error."""
    assert store.stat("run/nothing") is None
    assert store.get_bytes("run/nothing") is None


@pytest.mark.parametrize("size", [1000, BIG], ids=["small", "multipart"])
def test_wrong_sha256_stores_nothing(store: Store, tmp_path: os.PathLike[str], size: int) -> None:
    """A file that is not what its checksum says (changed after it was hashed) is refused, and
    nothing a resume could trust is left under the key, nor a half upload."""
    src, _ = _file(os.path.join(tmp_path, "src"), size)
    with pytest.raises(IntegrityError):
        store.put_file("run/bad", src, sha256="0" * 64, size=size)
    assert store.stat("run/bad") is None
    assert list(store.list("run/")) == []
    assert store.abort_stale_uploads("run/") == 0


def test_wrong_size_stores_nothing(store: Store, tmp_path: os.PathLike[str]) -> None:
    """A file whose size is not the one given is refused and leaves nothing."""
    src, sha = _file(os.path.join(tmp_path, "src"), 1000)
    with pytest.raises(IntegrityError):
        store.put_file("run/bad", src, sha256=sha, size=999)
    assert store.stat("run/bad") is None


def test_put_bytes_if_absent_refuses_a_second_writer(store: Store) -> None:
    """Create-if-absent (a run's claim, a manifest written once) refuses the second writer and
    keeps the first one's bytes; a plain put replaces."""
    store.put_bytes("run/claim", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run/claim", b"second", if_absent=True)
    assert store.get_bytes("run/claim") == b"first"
    info = store.put_bytes("run/claim", b"third")
    assert info.size == 5 and info.sha256 == hashlib.sha256(b"third").hexdigest()
    assert store.get_bytes("run/claim") == b"third"


def test_put_bytes_if_match_replaces_only_the_version_that_was_read(store: Store) -> None:
    """Compare-and-swap (how MANIFEST and LATEST are fenced): a writer that read version V
    replaces it; a second writer that read V too is refused and the first one's bytes stay;
    a version of an absent key is refused, as is one that never existed."""
    assert store.get_versioned("run/doc") is None
    store.put_bytes("run/doc", b"v1", if_absent=True)
    got = store.get_versioned("run/doc")
    assert got is not None and got[0] == b"v1"
    info = store.put_bytes("run/doc", b"v2 by A", if_match=got[1])
    assert store.get_bytes("run/doc") == b"v2 by A"
    with pytest.raises(PreconditionFailed):  # B read v1 as well: too late
        store.put_bytes("run/doc", b"v2 by B", if_match=got[1])
    assert store.get_bytes("run/doc") == b"v2 by A"
    now = store.get_versioned("run/doc")
    assert now is not None and now[1] != got[1]
    assert info.etag == now[1]  # the version a put returns is the one a read returns
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run/absent", b"x", if_match=now[1])
    assert store.get_bytes("run/absent") is None
    assert [i.key for i in store.list("run/")] == ["run/doc"]  # no lock or temporary listed


def test_list_by_prefix(store: Store) -> None:
    """Listing a run's checkpoints finds exactly the keys under that prefix, with sizes."""
    for key in ("run/a/1", "run/a/2", "run/ab/3", "run/b/4", "other/5"):
        store.put_bytes(key, key.encode())
    assert sorted(o.key for o in store.list("run/a/")) == ["run/a/1", "run/a/2"]
    assert sorted(o.key for o in store.list("run/a")) == ["run/a/1", "run/a/2", "run/ab/3"]
    assert {o.key: o.size for o in store.list("run/")} == {
        "run/a/1": 7,
        "run/a/2": 7,
        "run/ab/3": 8,
        "run/b/4": 7,
    }
    assert list(store.list("none/")) == []


def test_delete_is_idempotent(store: Store) -> None:
    """Deleting an old checkpoint twice (a retried cleanup) or one already gone is fine."""
    store.put_bytes("run/old", b"x")
    store.delete("run/old")
    assert store.stat("run/old") is None
    store.delete("run/old")
    store.delete("run/never-was")


@pytest.mark.parametrize("key", ["../escape", "run/../../x", "/abs", "run//x", "", "run/./x"])
def test_unclean_keys_are_refused(store: Store, tmp_path: os.PathLike[str], key: str) -> None:
    """No key can reach outside the store's root or alias another key."""
    src, sha = _file(os.path.join(tmp_path, "src"), 10)
    with pytest.raises(IntegrityError):
        store.put_bytes(key, b"x")
    with pytest.raises(IntegrityError):
        store.put_file(key, src, sha256=sha, size=10)
    with pytest.raises(IntegrityError):
        store.get_bytes(key)
    with pytest.raises(IntegrityError):
        store.get_file(key, os.path.join(tmp_path, "dest"))
    with pytest.raises(IntegrityError):
        store.stat(key)
    with pytest.raises(IntegrityError):
        store.delete(key)


def test_preflight_proves_the_store_and_leaves_nothing(store: Store) -> None:
    """Before training starts the store is proven to write, read back and delete, and the
    probe does not stay behind in the run's prefix."""
    findings = store.preflight("run")
    assert findings and findings[0].ok, findings
    assert list(store.list("run/")) == []
