"""Sealing a checkpoint of many files, many in flight at once, to a durable directory and to a
real S3 server (SeaweedFS): the real Sealer in this process on real stores.

What a user relies on, at any checkpoint shape: every file's sha256 in the MANIFEST is its
content's, and restore brings back the same bytes; one object that cannot be put stops the
seal with no MANIFEST and LATEST where it was (the next pass seals it); a checkpoint the job
deletes while it is being sealed is skipped as before, and the next one is sealed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from typing import Any, Dict, List, Optional

import pytest

from onbox.common.errors import StoreError
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store

MiB = 1 << 20


def _sealer(store: Store, ckpt: str, tmp: Any, events: List[Dict[str, Any]]) -> Sealer:
    s = Sealer(
        "many",
        ckpt,
        store,
        str(tmp / "stage"),
        epoch=take_epoch(store, "many"),
        event=lambda kind, reason, **kw: events.append({"kind": kind, "reason": reason, **kw}),
        state_path=str(tmp / "seq.json"),
    )
    s.load()
    return s


def _checkpoint(ckpt: str, step: int, files: Dict[str, bytes]) -> str:
    d = os.path.join(ckpt, f"step_{step}")
    for rel, data in files.items():
        path = os.path.join(d, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with open(os.path.join(d, ".rgt-complete"), "w") as f:
        json.dump({"step": step}, f)
    return d


def _latest(store: Store) -> Optional[int]:
    data = store.get_bytes("many/LATEST.json")
    return None if data is None else int(json.loads(data)["step"])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _put_threads() -> List[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rgt-seal-put")]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_many_file_checkpoint_seals_every_file_verified_and_restores_equal(
    kind: str, tmp_path: Any, request: Any
) -> None:
    if kind == "s3":
        srv = request.getfixturevalue("s3_server")
        # Parts of 5 MiB from 5 MiB on: the large file's parts share the store's slots with
        # the small files' puts.
        store: Store = srv.store(srv.bucket(), "p", part_size=5 * MiB, multipart_threshold=5 * MiB)
    else:
        os.makedirs(tmp_path / "durable", exist_ok=True)
        store = open_store("file://" + str(tmp_path / "durable"))
    rng = __import__("random").Random(17)
    files = {f"shard/{i:04d}.bin": os.urandom(rng.randrange(0, 48 << 10)) for i in range(250)}
    files["model/big.safetensors"] = os.urandom(11 * MiB + 3)  # multipart on S3
    twin = os.urandom(4096)
    files["tok/a.json"] = files["tok/b.json"] = files["tok/c.json"] = twin  # same bytes
    ckpt = str(tmp_path / "ckpt")
    _checkpoint(ckpt, 3, files)
    events: List[Dict[str, Any]] = []
    s = _sealer(store, ckpt, tmp_path, events)
    assert s.seal_pending() == 1 and _latest(store) == 3
    doc = json.loads(store.get_bytes(mf.manifest_key("many", 3)) or b"{}")
    entries = {e["path"]: e for e in doc["files"]}
    assert set(entries) == {f"step_3/{r}" for r in files} | {"step_3/.rgt-complete"}
    for rel, data in files.items():
        e = entries[f"step_3/{rel}"]
        assert (e["size"], e["sha256"]) == (len(data), _sha(data)), rel
    # The twins are one object in the store; every object holds its entry's bytes.
    assert len({entries[f"step_3/tok/{n}.json"]["key"] for n in "abc"}) == 1
    for key in {e["key"] for e in entries.values()}:
        held = store.get_bytes(key)
        assert held is not None
        assert _sha(held) in {e["sha256"] for e in entries.values() if e["key"] == key}
    sealed = [e for e in events if e["kind"] == "sealed"]
    distinct = {*files.values(), json.dumps({"step": 3}).encode()}
    assert sealed[0]["uploaded"] == sum(len(d) for d in distinct)  # each content put once
    assert _put_threads() == []
    fresh = str(tmp_path / "fresh")
    os.makedirs(fresh)
    got = restore_latest(store, "many", fresh, lambda *a, **k: None)
    assert got is not None and got["step"] == 3
    for rel, data in files.items():
        with open(os.path.join(fresh, "step_3", *rel.split("/")), "rb") as f:
            assert f.read() == data, rel


def test_a_put_that_fails_midway_leaves_no_manifest_and_the_retry_seals_it(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    events: List[Dict[str, Any]] = []
    s = _sealer(store, ckpt, tmp_path, events)
    _checkpoint(ckpt, 1, {"w.bin": b"one"})
    assert s.seal_pending() == 1 and _latest(store) == 1
    files = {f"part-{i:03d}.bin": os.urandom(2048 + i) for i in range(300)}
    _checkpoint(ckpt, 2, files)
    # A real fault of the store's disk for one object: a directory where it must go (the
    # rename into place fails, EISDIR: permanent, not retried).
    blocked = os.path.join(
        root, *mf.epoch_prefix("many", 2, s.epoch).split("/"), "step_2", "part-150.bin"
    )
    os.makedirs(os.path.join(blocked, "in-the-way"))
    with pytest.raises(StoreError, match="part-150.bin"):
        s.seal_pending()
    assert _put_threads() == []  # the puts in flight were awaited, none is left running
    assert store.get_bytes(mf.manifest_key("many", 2)) is None
    assert _latest(store) == 1
    litter = [n for _, _, names in os.walk(root) for n in names if ".rgt-tmp." in n]
    assert litter == []
    shutil.rmtree(blocked)
    assert s.seal_pending() == 1 and _latest(store) == 2  # the next pass seals it
    doc = json.loads(store.get_bytes(mf.manifest_key("many", 2)) or b"{}")
    for e in doc["files"]:
        held = store.get_bytes(e["key"])
        assert held is not None and _sha(held) == e["sha256"]
        rel = e["path"][len("step_2/") :]
        if rel in files:
            assert e["sha256"] == _sha(files[rel])


def test_a_checkpoint_deleted_during_a_parallel_seal_is_skipped_and_the_next_sealed(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    events: List[Dict[str, Any]] = []
    s = _sealer(store, ckpt, tmp_path, events)
    _checkpoint(ckpt, 1, {"w.bin": b"one"})
    assert s.seal_pending() == 1
    d = _checkpoint(ckpt, 2, {f"f-{i:04d}.bin": os.urandom(1024) for i in range(2000)})
    first = os.path.join(root, *mf.epoch_prefix("many", 2, s.epoch).split("/"))
    done = threading.Event()

    def rotate() -> None:  # the job deletes the checkpoint once its upload has begun
        while not os.path.isdir(first) and not done.is_set():
            done.wait(0.001)
        shutil.rmtree(d)

    job = threading.Thread(target=rotate)
    job.start()
    try:
        assert s.seal_pending() == 0
    finally:
        done.set()
        job.join()
    assert [e["kind"] for e in events].count("seal_skipped") == 1
    assert store.get_bytes(mf.manifest_key("many", 2)) is None and _latest(store) == 1
    _checkpoint(ckpt, 3, {f"f-{i:02d}.bin": os.urandom(1024) for i in range(20)})
    assert s.seal_pending() == 1 and _latest(store) == 3
