"""Opt-in: the hf:// store against the REAL Hugging Face Hub (or the Hub that HF_ENDPOINT names).

Collected only with RGT_HF_TESTS=1 and HF_TOKEN set to a write token; otherwise the whole module
is skipped, under CI=true too (nothing here is a service CI is expected to have). It uses the
private repo RGT_HF_TEST_REPO (default: YOU/rgt-store-test, created if missing), works under a
fresh prefix and deletes that prefix at the end. Files go up by the LFS protocol
(onbox/sealing/stores/hfmoved.py; a Xet-backed repo moves them into Xet itself), downloads the
way huggingface_hub picks (Xet when hf_xet is installed): what the fake Hub of
tests/integration/test_store_hf.py cannot do.

    RGT_HF_TESTS=1 HF_TOKEN=hf_... .venv/bin/pytest -q tests/optin/test_store_hf_real.py
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Iterator, Tuple

import pytest

if os.environ.get("RGT_HF_TESTS") != "1" or not os.environ.get("HF_TOKEN"):
    pytest.skip(
        "opt-in: set RGT_HF_TESTS=1 and HF_TOKEN (a write token) to test against the real Hub",
        allow_module_level=True,
    )

from huggingface_hub import HfApi

from onbox.common.errors import IntegrityError
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import PreconditionFailed
from onbox.sealing.stores.hf import HFStore

# huggingface_hub 2.4 hands httpx2 a file object for LFS uploads (deprecated).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Use 'content=<...>' to upload raw bytes/text content:DeprecationWarning"
)

BIG = 11 * 1024 * 1024  # over the Hub's 10 MiB: stored in LFS/Xet


@pytest.fixture(scope="module")
def repo_id() -> str:
    repo = os.environ.get("RGT_HF_TEST_REPO")
    if repo:
        return repo
    user = HfApi().whoami()["name"]
    return f"{user}/rgt-store-test"


@pytest.fixture
def store(repo_id: str) -> Iterator[HFStore]:
    prefix = f"rgt-test-{uuid.uuid4().hex[:12]}"
    s = open_store(f"hf://{repo_id}/{prefix}")
    assert isinstance(s, HFStore)
    try:
        yield s
    finally:
        try:
            HfApi(endpoint=s.endpoint).delete_folder(
                prefix, repo_id=repo_id, commit_message="rgt: remove a test prefix"
            )
        except Exception:  # nothing left under it, or the test failed before writing
            pass


def local_file(tmp_path: Path, name: str, data: bytes) -> Tuple[str, str]:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path, hashlib.sha256(data).hexdigest()


def test_preflight_real_hub(store: HFStore, repo_id: str) -> None:
    findings = store.preflight("run1")
    assert findings[0].ok, findings
    assert list(store.list("run1/")) == []  # the probe was deleted
    if "RGT_HF_TEST_REPO" not in os.environ:
        assert HfApi(endpoint=store.endpoint).model_info(repo_id).private


def test_round_trip_real_hub(store: HFStore, tmp_path: Path) -> None:
    small = b"step 120\nloss 0.25\n"
    big = os.urandom(BIG)
    for name, data in (("meta.txt", small), ("model.pt", big)):
        src, sha = local_file(tmp_path, name, data)
        key = f"run1/checkpoints/120/{name}"
        info = store.put_file(key, src, sha256=sha, size=len(data))
        assert (info.size, info.sha256) == (len(data), sha)
        st = store.stat(key)
        assert st is not None and st.size == len(data)
        dest = str(tmp_path / f"got-{name}")
        store.get_file(key, dest)
        with open(dest, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha
    st = store.stat("run1/checkpoints/120/model.pt")
    assert st is not None and st.sha256 == hashlib.sha256(big).hexdigest()
    assert [o.key for o in store.list("run1/checkpoints/")] == [
        "run1/checkpoints/120/meta.txt",
        "run1/checkpoints/120/model.pt",
    ]
    store.delete("run1/checkpoints/120/meta.txt")
    assert store.get_bytes("run1/checkpoints/120/meta.txt") is None
    store.delete("run1/checkpoints/120/meta.txt")  # absent is fine


def test_wrong_sha256_is_caught_without_downloading_real_hub(
    store: HFStore, tmp_path: Path
) -> None:
    src, sha = local_file(tmp_path, "model.pt", os.urandom(BIG))
    wrong = hashlib.sha256(sha.encode()).hexdigest()
    with pytest.raises(IntegrityError, match="does not match its source"):
        store.put_file("run1/model.pt", src, sha256=wrong, size=BIG)
    assert store.stat("run1/model.pt") is None


def test_put_bytes_if_absent_real_hub(store: HFStore) -> None:
    store.put_bytes("run1/owner", b"mine", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("run1/owner", b"yours", if_absent=True)
    assert store.get_bytes("run1/owner") == b"mine"
