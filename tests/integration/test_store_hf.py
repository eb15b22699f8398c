"""The hf:// store against a FAKE Hub (tests/fakehub.py): real HTTP on loopback, real
huggingface_hub. Every test here uses the fake, and says so in its name.

The store's uploads of files take huggingface_hub's LFS protocol (onbox/sealing/stores/hfmoved.py);
its downloads use Xet when hf_xet is installed, which the fake does not speak, so the fixture
turns Xet off (HF_HUB_DISABLE_XET, as a user can). The Xet path is covered by the opt-in test
against the real Hub (tests/optin/test_store_hf_real.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
from huggingface_hub import close_session
from huggingface_hub import constants as hf_constants

from controller.registry import RunRecord
from controller.results.pull import pull
from controller.target import Target
from onbox.common.errors import AuthError, IntegrityError
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import hfdownload, open_store
from onbox.sealing.stores.base import (
    ObjectInfo,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    StoreError,
    TransientStoreError,
    with_retries,
)
from onbox.sealing.stores.hf import HFStore
from onbox.sealing.stores.hfhub import AUTH_MESSAGE, git_blob_id
from tests.conftest import ROOT
from tests.fakehub import FakeHub, Request
from tests.mounts import tmpfs

# huggingface_hub 2.4 hands httpx2 a file object for the LFS upload, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Use 'content=<...>' to upload raw bytes/text content:DeprecationWarning"
)

WRITE_TOKEN = "hf_fake_alice_write"
READ_TOKEN = "hf_fake_alice_read"
REPO = "alice/ckpts"
URL = f"hf://{REPO}/rgt"
BIG = 11 * 1024 * 1024  # over the Hub's 10 MiB: an LFS file whatever its content


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A fresh fake Hub; huggingface_hub pointed at it with HF_ENDPOINT and HF_TOKEN, as a user
    would, after it was imported (so the store must read HF_ENDPOINT itself)."""
    hub = FakeHub().start()
    hub.add_token(WRITE_TOKEN, "alice")
    hub.add_token(READ_TOKEN, "alice", write=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", os.path.join(tmp_path, "hf-hub-cache"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", os.path.join(tmp_path, "no-hf-token"))
    try:
        yield hub
    finally:
        hub.stop()
        close_session()  # drop the pooled connections to this server
    assert not hub.bugs, hub.bugs


def hf_store(url: str = URL) -> HFStore:
    store = open_store(url)
    assert isinstance(store, HFStore)
    return store


def local_file(tmp_path: Path, name: str, data: bytes) -> Tuple[str, str]:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path, hashlib.sha256(data).hexdigest()


def commits(hub: FakeHub) -> List[Request]:
    return [r for r in hub.requests if r.method == "POST" and "/commit/" in r.path]


def test_round_trip_small_file_fake_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    store = hf_store()
    data = b"step 120\nloss 0.25\n"
    src, sha = local_file(tmp_path, "meta.txt", data)
    key = "run1/checkpoints/120/meta.txt"

    info = store.put_file(key, src, sha256=sha, size=len(data))

    assert info == ObjectInfo(key, len(data), sha, git_blob_id(data))
    stored = fake_hub.file(REPO, "rgt/" + key)
    assert stored is not None and stored.content == data and not stored.lfs  # a regular file
    assert store.stat(key) == ObjectInfo(key, len(data), None, git_blob_id(data))
    dest = os.path.join(tmp_path, "got")
    store.get_file(key, dest)
    with open(dest, "rb") as f:
        assert f.read() == data
    assert store.get_bytes(key) == data
    assert [o.key for o in store.list("run1/")] == [key]
    # downloads leave nothing behind: no temporary folder, no huggingface_hub cache
    assert sorted(os.listdir(tmp_path)) == ["got", "meta.txt"]
    assert not os.path.exists(hf_constants.HF_HUB_CACHE)

    store.delete(key)
    assert store.stat(key) is None
    assert store.get_bytes(key) is None
    store.delete(key)  # absent is fine
    with pytest.raises(PermanentStoreError, match="is not in"):
        store.get_file(key, os.path.join(tmp_path, "again"))


def test_round_trip_large_lfs_file_fake_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    store = hf_store()
    data = os.urandom(BIG)
    src, sha = local_file(tmp_path, "model.pt", data)
    key = "run1/checkpoints/120/model.pt"

    info = store.put_file(key, src, sha256=sha, size=len(data))

    assert (info.size, info.sha256) == (len(data), sha)
    stored = fake_hub.file(REPO, "rgt/" + key)
    assert stored is not None and stored.lfs and stored.content == data
    st = store.stat(key)
    assert st is not None and (st.size, st.sha256) == (len(data), sha)
    dest = os.path.join(tmp_path, "got.pt")
    store.get_file(key, dest)
    with open(dest, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == sha
    # the bytes went through the storage server (LFS upload, CDN download), without the token
    storage = [r for r in fake_hub.requests if r.server == "storage"]
    assert {r.method for r in storage} == {"PUT", "GET"}
    assert not any(r.token for r in storage)
    assert not os.path.exists(hf_constants.HF_HUB_CACHE)


@pytest.mark.parametrize("size", [200, BIG], ids=["regular", "lfs"])
def test_corrupted_upload_raises_integrity_error_fake_hub(
    fake_hub: FakeHub, tmp_path: Path, size: int
) -> None:
    store = hf_store()
    data = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    src, sha = local_file(tmp_path, "f", data)
    store.put_bytes("run1/other", b"unrelated")
    fake_hub.corrupt_next_commit("rgt/run1/f")

    with pytest.raises(IntegrityError, match="does not match its source.*removed it again"):
        store.put_file("run1/f", src, sha256=sha, size=size)

    # verified from the Hub's own hashes, not by downloading again
    assert not any("/resolve/" in r.path for r in fake_hub.requests)
    assert store.stat("run1/f") is None  # a failed put leaves no object under the key
    assert store.get_bytes("run1/other") == b"unrelated"


def test_source_changed_after_hashing_fake_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    store = hf_store()
    small, _ = local_file(tmp_path, "small", b"new contents")
    with pytest.raises(IntegrityError, match="does not match the sha256"):
        store.put_file("run1/small", small, sha256=hashlib.sha256(b"old").hexdigest(), size=12)
    assert commits(fake_hub) == []  # refused before anything was sent

    # A large file goes up as it is read: huggingface_hub's sha256 of the bytes it sent is
    # compared before the commit, so nothing is committed either.
    big, sha = local_file(tmp_path, "big", os.urandom(BIG))
    wrong = hashlib.sha256(sha.encode()).hexdigest()
    with pytest.raises(IntegrityError, match="expected .*nothing was committed"):
        store.put_file("run1/big", big, sha256=wrong, size=BIG)
    assert commits(fake_hub) == []
    assert store.stat("run1/big") is None


def test_first_write_creates_a_private_repo_fake_hub(fake_hub: FakeHub) -> None:
    store = hf_store()
    assert REPO not in fake_hub.repos
    store.put_bytes("run1/state.json", b"{}")
    assert fake_hub.repos[REPO].private
    assert fake_hub.create_payloads[0]["visibility"] == "private"
    assert fake_hub.create_payloads[0]["type"] == "model"
    store.put_bytes("run1/state.json", b"{1}")
    assert len(fake_hub.create_payloads) == 1  # once per store


def test_existing_public_repo_is_used_and_warned_about_fake_hub(fake_hub: FakeHub) -> None:
    fake_hub.create_repo(REPO, private=False)
    findings = hf_store().preflight("run1")
    assert findings[0].ok
    assert [f.what for f in findings if not f.ok] == [
        f"{REPO} is a public repo: anyone can download its checkpoints; "
        "make it private in its settings on the Hub"
    ]
    assert not fake_hub.repos[REPO].private  # not changed behind the user's back


def test_hf_endpoint_is_honoured_fake_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    # In this process huggingface_hub was imported before HF_ENDPOINT was set: its own default
    # is still huggingface.co, and the store must read the variable itself.
    assert fake_hub.url != hf_constants.ENDPOINT
    store = hf_store()
    assert store.endpoint == fake_hub.url
    store.put_bytes("run1/x", b"1")
    assert fake_hub.file(REPO, "rgt/run1/x") is not None

    # A fresh process, as on a box behind a mirror: HF_ENDPOINT set before anything is imported.
    env = dict(os.environ)
    env.update(
        HF_ENDPOINT=fake_hub.url + "/",
        HF_TOKEN=WRITE_TOKEN,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=os.path.join(tmp_path, "hf-home"),
    )
    script = textwrap.dedent(
        """
        from onbox.sealing.stores import open_store
        s = open_store("hf://alice/mirrored/p")
        s.put_bytes("a/b.txt", b"hello")
        print(s.endpoint, s.get_bytes("a/b.txt").decode())
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [fake_hub.url, "hello"]
    stored = fake_hub.file("alice/mirrored", "p/a/b.txt")
    assert stored is not None and stored.content == b"hello"
    assert not os.path.exists(os.path.join(tmp_path, "hf-home", "hub"))


def test_refused_token_raises_auth_error_fake_hub(fake_hub: FakeHub) -> None:
    store = hf_store()
    store.put_bytes("run1/x", b"1")
    fake_hub.refuse_token(WRITE_TOKEN)
    calls: List[Callable[[], object]] = [
        lambda: store.put_bytes("run1/y", b"2"),
        lambda: store.get_bytes("run1/x"),
        lambda: store.stat("run1/x"),
        lambda: list(store.list("run1/")),
        lambda: store.delete("run1/x"),
        lambda: hf_store().put_bytes("run1/z", b"3"),  # a new store: creating the repo
    ]
    for call in calls:
        with pytest.raises(AuthError) as e:
            call()
        assert AUTH_MESSAGE in str(e.value)
        assert "HTTP 401" in str(e.value)
        assert e.value.remedy == f"write tokens are made at {fake_hub.url}/settings/tokens"
        assert isinstance(e.value, StoreError) and e.value.exit_code == 14
    with pytest.raises(AuthError, match="create or resolve the private repo.*" + AUTH_MESSAGE):
        hf_store().preflight("run1")


def test_read_only_token_cannot_write_fake_hub(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.create_repo(REPO)
    fake_hub.write(REPO, "rgt/run1/x", b"1")
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    store = hf_store()
    assert store.get_bytes("run1/x") == b"1"
    with pytest.raises(AuthError, match="HTTP 403.*" + AUTH_MESSAGE):
        store.put_bytes("run1/y", b"2")
    with pytest.raises(AuthError, match="write a probe.*HTTP 403"):
        store.preflight("run1")


def test_without_a_token_fake_hub(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.create_repo(REPO)
    monkeypatch.delenv("HF_TOKEN")
    store = hf_store()
    with pytest.raises(AuthError, match="'find a Hub token'.*no Hugging Face token"):
        store.preflight("run1")
    with pytest.raises(AuthError, match="no Hugging Face token"):
        store.get_bytes("run1/x")  # the Hub answers 401 for a private repo
    assert not any(r.token for r in fake_hub.requests)


def test_preflight_steps_fake_hub(fake_hub: FakeHub) -> None:
    store = hf_store()
    findings = store.preflight("run1")
    assert [f.ok for f in findings] == [True]
    assert fake_hub.repos[REPO].private
    assert fake_hub.paths(REPO) == [".gitattributes"]  # the probe was deleted
    assert len(commits(fake_hub)) == 2  # the probe's upload, its deletion

    fake_hub.fail_next("GET", "/api/models/", 500)  # a new store first reads the repo
    with pytest.raises(TransientStoreError, match="'create or resolve the private repo'.*500"):
        hf_store().preflight("run1")
    fake_hub.fail_next("POST", "/commit/", 503)
    with pytest.raises(TransientStoreError, match="'write a probe.*'.*503"):
        store.preflight("run1")
    fake_hub.fail_next("HEAD", "/resolve/", 403)
    with pytest.raises(AuthError, match="'read the probe back'"):
        store.preflight("run1")
    # the probe's upload commits; its deletion, the next commit, fails
    n = len(commits(fake_hub))
    fake_hub.before_next_commit(lambda: fake_hub.fail_next("POST", "/commit/", 500))
    with pytest.raises(TransientStoreError, match="'delete the probe'"):
        store.preflight("run1")
    assert len(commits(fake_hub)) == n + 2


def test_put_bytes_if_match_fake_hub(fake_hub: FakeHub) -> None:
    """Compare-and-swap on the fake Hub: the version is the git blob id; a commit another writer
    lands between the check and the commit makes the Hub refuse ours (stale parent), and the
    store, looking again, finds the file changed: PreconditionFailed, their bytes kept."""
    store = hf_store()
    store.put_bytes("run1/LATEST.json", b"v1", if_absent=True)
    got = store.get_versioned("run1/LATEST.json")
    assert got is not None and got == (b"v1", git_blob_id(b"v1"))
    store.put_bytes("run1/LATEST.json", b"v2", if_match=got[1])
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run1/LATEST.json", b"v2 late", if_match=got[1])
    now = store.get_versioned("run1/LATEST.json")
    assert now is not None and now[0] == b"v2"
    fake_hub.before_next_commit(lambda: fake_hub.write(REPO, "rgt/run1/LATEST.json", b"theirs"))
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run1/LATEST.json", b"mine", if_match=now[1])
    assert store.get_bytes("run1/LATEST.json") == b"theirs"
    # A commit to another file in between only makes the store look again: ours lands.
    now = store.get_versioned("run1/LATEST.json")
    assert now is not None
    fake_hub.before_next_commit(lambda: fake_hub.write(REPO, "rgt/run1/state/x", b"mirror"))
    store.put_bytes("run1/LATEST.json", b"mine", if_match=now[1])
    assert store.get_bytes("run1/LATEST.json") == b"mine"


def test_put_bytes_if_absent_fake_hub(fake_hub: FakeHub) -> None:
    store = hf_store()
    store.put_bytes("run1/owner", b"mine", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run1/owner", b"yours", if_absent=True)
    assert store.get_bytes("run1/owner") == b"mine"

    # Another writer creates the key between the check and the commit: the Hub refuses the
    # commit (its parent is stale), and the store finds the key there.
    fake_hub.before_next_commit(lambda: fake_hub.write(REPO, "rgt/run2/owner", b"theirs"))
    with pytest.raises(PreconditionFailed, match="already exists"):
        store.put_bytes("run2/owner", b"mine", if_absent=True)
    assert store.get_bytes("run2/owner") == b"theirs"
    assert commits(fake_hub)[-1].status == 412

    # Another writer commits something else meanwhile: the store looks again and creates.
    fake_hub.before_next_commit(lambda: fake_hub.write(REPO, "rgt/run3/log", b"x"))
    store.put_bytes("run3/owner", b"mine", if_absent=True)
    assert store.get_bytes("run3/owner") == b"mine"
    assert [r.status for r in commits(fake_hub)[-2:]] == [412, 200]


def test_server_errors_are_transient_and_leave_nothing_fake_hub(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    store = hf_store()
    data = os.urandom(BIG)
    src, sha = local_file(tmp_path, "model.pt", data)
    store.put_bytes("run1/first", b"1")

    fake_hub.fail_next("POST", "/commit/", 500)
    with pytest.raises(TransientStoreError, match="HTTP 500"):
        store.put_file("run1/model.pt", src, sha256=sha, size=BIG)
    assert store.stat("run1/model.pt") is None

    fake_hub.fail_next("POST", "/commit/", 502)
    slept: List[float] = []
    info = with_retries(
        lambda: store.put_file("run1/model.pt", src, sha256=sha, size=BIG), sleep=slept.append
    )
    assert info.sha256 == sha and slept == [0.5]

    fake_hub.fail_next("POST", "/paths-info/", 429)
    with pytest.raises(TransientStoreError, match="HTTP 429"):
        store.stat("run1/model.pt")

    # huggingface_hub itself retries a failed upload to storage (after a second)
    fake_hub.fail_next("PUT", "/upload/", 503)
    src2, sha2 = local_file(tmp_path, "model2.pt", os.urandom(BIG))
    store.put_file("run1/model2.pt", src2, sha256=sha2, size=BIG)
    assert [r.status for r in fake_hub.requests if r.method == "PUT"][-2:] == [503, 200]


def test_unreachable_hub_is_transient_fake_hub(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.stop()  # nothing listens on its port any more
    with pytest.raises(TransientStoreError, match="ConnectError"):
        hf_store().put_bytes("run1/x", b"1")


def test_missing_or_foreign_repo_fake_hub(fake_hub: FakeHub) -> None:
    missing = hf_store("hf://alice/missing")
    for call in (
        lambda: missing.get_bytes("x"),
        lambda: missing.stat("x"),
        lambda: list(missing.list("")),
    ):
        with pytest.raises(PermanentStoreError, match="the Hub has no repo alice/missing"):
            call()
    fake_hub.create_repo("bob/secret")
    with pytest.raises(PermanentStoreError, match="no repo bob/secret"):
        hf_store("hf://bob/secret").get_bytes("x")  # private: invisible to alice
    with pytest.raises(AuthError, match="HTTP 403"):
        hf_store("hf://bob/other").put_bytes("x", b"1")  # not alice's namespace


def test_list_by_key_prefix_fake_hub(fake_hub: FakeHub) -> None:
    store: Store = hf_store()
    keys = [
        "run1/checkpoints/120/a",
        "run1/checkpoints/1200/b",
        "run1/checkpoints/13/c",
        "run1/x",
        "run2/y",
    ]
    for k in keys:
        store.put_bytes(k, k.encode())
    fake_hub.write(REPO, "elsewhere/z", b"not under the store's prefix")
    assert [o.key for o in store.list("run1/checkpoints/12")] == keys[:2]
    assert [o.key for o in store.list("run1/")] == keys[:4]
    assert [o.key for o in store.list("")] == keys
    assert list(store.list("nope/")) == []
    assert [(o.size, o.sha256) for o in store.list("run2/")] == [(6, None)]
    assert fake_hub.paths(REPO)[-1] == "rgt/run2/y"

    root = hf_store(f"hf://{REPO}")
    assert [o.key for o in root.list("")] == ["elsewhere/z"] + ["rgt/" + k for k in keys]


def test_offline_mode_is_permanent_fake_hub(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PermanentStoreError, match="HF_HUB_OFFLINE is set"):
        hf_store().put_bytes("run1/x", b"1")
    with pytest.raises(PermanentStoreError, match="HF_HUB_OFFLINE is set"):
        hf_store().get_bytes("run1/x")
    assert fake_hub.requests == []


@pytest.mark.parametrize("size", [1000, BIG], ids=["regular", "lfs"])
def test_a_file_replaced_on_the_hub_by_another_size_is_refused_before_its_bytes_fake_hub(
    fake_hub: FakeHub, tmp_path: Path, size: int
) -> None:
    """A restore or a pull fetches with the MANIFEST's size. When the file under that path on
    the Hub was replaced by one four times as large, fetch_file refuses it with IntegrityError
    naming both sizes after the HEAD alone: no GET of its bytes (from the Hub or its storage),
    nothing at the destination, no temporary directory left; a box's disk cannot be filled by
    it. The file at its sealed size comes back whole."""
    store = hf_store()
    data = os.urandom(size)
    src, sha = local_file(tmp_path, "model.pt", data)
    store.put_file("run1/model.pt", src, sha256=sha, size=size)
    back = tmp_path / "back"
    back.mkdir()
    assert store.fetch_file("run1/model.pt", str(back / "a"), size=size) is None
    assert (back / "a").read_bytes() == data

    fake_hub.write(REPO, "rgt/run1/model.pt", os.urandom(4 * size))
    seen = len(fake_hub.requests)
    with pytest.raises(IntegrityError) as e:
        store.fetch_file("run1/model.pt", str(back / "b"), size=size)
    assert f"{4 * size} bytes in the store, the MANIFEST says {size} bytes" in str(e.value)
    asked = [(r.server, r.method) for r in fake_hub.requests[seen:] if "model.pt" in r.path]
    assert asked and all(a == ("hub", "HEAD") for a in asked), asked
    assert sorted(os.listdir(back)) == ["a"]


def test_a_fetch_downloads_the_commit_whose_size_it_checked_fake_hub(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new commit lands on the Hub between fetch_file's HEAD (size checked) and its download
    (another writer replacing the file by a larger one): the download is of the commit the
    HEAD answered for, so the bytes received are the ones whose size was checked."""
    store = hf_store()
    data = os.urandom(BIG)
    src, sha = local_file(tmp_path, "model.pt", data)
    store.put_file("run1/model.pt", src, sha256=sha, size=BIG)
    real = hfdownload.download

    def replaced_meanwhile(*a: Any, **k: Any) -> Optional[str]:
        fake_hub.write(REPO, "rgt/run1/model.pt", os.urandom(2 * BIG))
        return real(*a, **k)

    monkeypatch.setattr(hfdownload, "download", replaced_meanwhile)
    dest = tmp_path / "back"
    store.fetch_file("run1/model.pt", str(dest), size=BIG)
    assert dest.read_bytes() == data
    now = fake_hub.file(REPO, "rgt/run1/model.pt")
    assert now is not None and len(now.content) == 2 * BIG  # the Hub has the new one


def _seal_steps_fake_hub(
    store: HFStore, tmp_path: Path, files: Dict[int, Dict[str, bytes]]
) -> None:
    """Each step's files sealed into the (FAKE) Hub by the real Sealer, run r1."""
    store.preflight("r1")  # as the agent does first: the repo is made
    ckpt = str(tmp_path / "old-box")
    s = Sealer(
        "r1",
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "r1"),
        event=lambda *a, **k: None,
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    for step, named in files.items():
        d = os.path.join(ckpt, f"step_{step}")
        os.makedirs(d)
        for name, data in named.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        with open(os.path.join(d, ".rgt-complete"), "w") as marker:
            json.dump({"step": step}, marker)
        assert s.seal_pending() == 1


def test_a_restore_from_the_hub_refuses_a_replaced_larger_file_unread_and_falls_back_fake_hub(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    """Two checkpoints sealed by the real Sealer into the (FAKE) Hub; a file of the newest is
    replaced there by one of 32 MiB. A fresh box with 20 MiB free restores: the Hub's HEAD
    gives the size before any byte, the newest checkpoint is quarantined with both sizes in
    its reason, and the previous one comes back whole; without the bound the download fills
    the disk and the run cannot start."""
    store = hf_store()
    sealed = {step: os.urandom(1 << 20) for step in (10, 20)}
    _seal_steps_fake_hub(store, tmp_path, {step: {"model.bin": sealed[step]} for step in sealed})
    doc = json.loads(store.get_bytes(mf.manifest_key("r1", 20)) or b"{}")
    (key,) = [f["key"] for f in doc["files"] if f["path"] == "step_20/model.bin"]
    fake_hub.write(REPO, "rgt/" + key, os.urandom(32 << 20))
    with tmpfs(str(tmp_path / "small-disk"), "size=20m") as disk:
        kinds: List[str] = []
        dest = os.path.join(disk, "ckpt")
        got = restore_latest(store, "r1", dest, lambda k, *a, **kw: kinds.append(k))
        assert got is not None and got["step"] == 10 and kinds == ["quarantined", "restored"]
        with open(os.path.join(dest, "step_10", "model.bin"), "rb") as back:
            assert back.read() == sealed[10]
    record = json.loads(store.get_bytes(mf.quarantine_key("r1", 20)) or b"{}")
    assert f"{32 << 20} bytes in the store, the MANIFEST says {1 << 20} bytes" in record["reason"]


def test_a_restore_from_the_hub_asks_all_sizes_at_once_and_downloads_that_commit_fake_hub(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of 30 files sealed into the (FAKE) Hub is restored with its sizes asked in
    one paths-info, not with a HEAD of rgt's own per file (huggingface_hub's download makes
    one of its own: a file costs one round trip fewer). A commit landing on the Hub during the
    restore (a file replaced by a larger one) changes nothing restored: every file comes from
    the commit whose sizes were checked."""
    store = hf_store()
    files = {f"shard-{i:02d}.bin": os.urandom(4096 + i) for i in range(30)}
    _seal_steps_fake_hub(store, tmp_path, {10: files})
    doc = json.loads(store.get_bytes(mf.manifest_key("r1", 10)) or b"{}")
    paths = {"rgt/" + f["key"]: f["path"] for f in doc["files"]}
    first = sorted(paths)[0]
    real = hfdownload.download
    replaced: List[str] = []

    def another_commit_meanwhile(*a: Any, **k: Any) -> Optional[str]:
        if a[2] in paths and not replaced:
            replaced.append(a[2])
            fake_hub.write(REPO, first, os.urandom(1 << 20))
        return real(*a, **k)

    monkeypatch.setattr(hfdownload, "download", another_commit_meanwhile)
    seen = len(fake_hub.requests)
    dest = str(tmp_path / "ckpt")
    got = restore_latest(store, "r1", dest, lambda *a, **k: None)
    assert got is not None and got["step"] == 10 and replaced
    for name, data in files.items():
        with open(os.path.join(dest, "step_10", name), "rb") as back:
            assert back.read() == data, name
    asked = fake_hub.requests[seen:]
    heads: Dict[str, int] = {}
    for r in asked:
        hit = [p for p in paths if r.method == "HEAD" and r.path.endswith("/" + p)]
        for p in hit:
            heads[p] = heads.get(p, 0) + 1
    assert sorted(heads) == sorted(paths) and max(heads.values()) == 1, heads
    assert [r.method for r in asked if "paths-info" in r.path] == ["POST"]


def test_a_pull_from_the_hub_asks_all_sizes_at_once_and_verifies_every_file_fake_hub(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rgt pull --from store` of a checkpoint sealed into the (FAKE) Hub: every file comes back
    verified and in place, its size asked in one paths-info with the others (one HEAD per file,
    huggingface_hub's own)."""
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "laptop"))
    store = hf_store()
    files = {f"part-{i}.bin": os.urandom(3000 + i) for i in range(12)}
    _seal_steps_fake_hub(store, tmp_path, {7: files})
    doc = json.loads(store.get_bytes(mf.manifest_key("r1", 7)) or b"{}")
    paths = ["rgt/" + f["key"] for f in doc["files"]]
    rec = RunRecord(
        "r1", Target("local"), profile="local", store=URL, box_home=str(tmp_path / "box")
    )
    seen = len(fake_hub.requests)
    dest = str(tmp_path / "pulled")
    receipt = pull(rec, dest, "store")
    assert receipt.source == "store" and receipt.sealed.step == 7
    for name, data in files.items():
        with open(os.path.join(dest, "checkpoints", "step_7", name), "rb") as back:
            assert back.read() == data, name
    asked = fake_hub.requests[seen:]
    heads = [p for r in asked for p in paths if r.method == "HEAD" and r.path.endswith("/" + p)]
    assert sorted(heads) == sorted(paths), heads
    assert [r.method for r in asked if "paths-info" in r.path] == ["POST"]
