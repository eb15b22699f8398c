"""A fresh box restores the newest *usable* checkpoint, against real file:// and S3 stores.

What a user relies on: an object of LATEST's checkpoint deleted, bit-flipped or truncated in
the store, or its MANIFEST garbled, does not stop the run: ``rgt-agent run`` on a fresh box
quarantines that checkpoint (kept, flagged with the reason) and resumes from the previous
verified one. When none is left, the run fails at once with one message listing what was
tried, a clear exit code, and a FAILED state (never PENDING). A store that does not answer
quarantines nothing. `rgt-agent checkpoints`, `rgt pull` and status never offer a quarantined
step, and `rgt down` never counts a receipt for one as covering the run.

The checkpoints are made by the real Sealer, the restores by the real agent (a process), the
damage with the store's own tools (the filesystem, an S3 client).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from controller.registry import RunRecord
from controller.results.pull import covers_newest, newest_sealed, pull
from controller.target import Target
from onbox.common.errors import HostError, IntegrityError
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import NoVerifiedCheckpoint, restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store, StoreError
from onbox.sealing.stores.s3 import download
from tests.conftest import Cli
from tests.mounts import tmpfs
from tests.sealsvc import old_box_sealer
from tests.seaweed import SeaweedServer, closed_port

RUN = "fb"
# The job of the fresh box: says what it was given to resume from, and ends.
JOB = [sys.executable, "-c", "import os; print('resume=' + os.environ['RGT_RESUME_FROM'])"]


class Raw:
    """The store's bytes as its own tools see them (a directory, an S3 client): how a test
    damages an object the way a disk, a person or a bug would."""

    def __init__(self, url: str, get: Callable[[str], Optional[bytes]], put: Any, rm: Any) -> None:
        self.url = url
        self.get, self.put, self.rm = get, put, rm

    def manifest(self, step: int) -> Dict[str, Any]:
        data = self.get(mf.manifest_key(RUN, step))
        assert data is not None
        out: Dict[str, Any] = json.loads(data)
        return out

    def first_object(self, step: int) -> str:
        return str(self.manifest(step)["files"][0]["key"])


def _file_raw(root: str) -> Raw:
    def get(key: str) -> Optional[bytes]:
        try:
            with open(os.path.join(root, key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put(key: str, data: bytes) -> None:
        with open(os.path.join(root, key), "wb") as f:
            f.write(data)

    return Raw("file://" + root, get, put, lambda key: os.unlink(os.path.join(root, key)))


def _s3_raw(s3: SeaweedServer, bucket: str) -> Raw:
    client = s3.client()

    def get(key: str) -> Optional[bytes]:
        try:
            body: bytes = client.get_object(Bucket=bucket, Key=f"rgt/{key}")["Body"].read()
            return body
        except client.exceptions.NoSuchKey:
            return None

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"rgt/{key}", Body=data)

    def rm(key: str) -> None:
        client.delete_object(Bucket=bucket, Key=f"rgt/{key}")

    return Raw(f"s3://{bucket}/rgt", get, put, rm)


@pytest.fixture(params=["file", "s3"])
def where(request: Any, cli: Cli, tmp_path: Any) -> Iterator[Raw]:
    """A store (file:// or SeaweedFS S3) the CLI is pointed at, and its raw bytes."""
    if request.param == "file":
        root = str(tmp_path / "durable")
        os.makedirs(root)
        yield _file_raw(root)
        return
    s3: SeaweedServer = request.getfixturevalue("s3_server")
    cli.env.update(s3.env(cli.env))
    yield _s3_raw(s3, s3.bucket())


def _open(raw: Raw, cli: Cli) -> Store:
    """The store of ``raw`` opened as the agent opens it (for S3: the CLI's AWS_* settings)."""
    if raw.url.startswith("s3://"):
        from onbox.sealing.stores.s3 import S3Store

        bucket = raw.url[len("s3://") :].split("/")[0]
        env = cli.env

        return S3Store(
            bucket,
            "rgt",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )
    return open_store(raw.url)


def _seal(store: Store, tmp_path: Any, steps: List[int]) -> None:
    """Each step a 64 KiB checkpoint ``step_N.pt`` sealed by the real Sealer (LATEST: last)."""
    ckpt = str(tmp_path / "old-box-ckpt")
    os.makedirs(ckpt, exist_ok=True)
    s = old_box_sealer(RUN, ckpt, store, tmp_path)
    for step in steps:
        with open(os.path.join(ckpt, f"step_{step}.pt"), "wb") as f:
            f.write(os.urandom(64 << 10))
        assert s.seal_pending() == 1


def _damage(raw: Raw, step: int, how: str) -> str:
    """Damage checkpoint ``step`` in the store; the word its quarantine reason must hold."""
    key = raw.first_object(step)
    if how == "delete":
        raw.rm(key)
        return "missing"
    if how == "manifest":
        raw.put(mf.manifest_key(RUN, step), b'{"schema": 1, "step": "twenty"')
        return "JSON"
    data = raw.get(key)
    assert data is not None
    if how == "flip":
        raw.put(key, data[:-1] + bytes([data[-1] ^ 1]))
        return "sha256"
    raw.put(key, data[: len(data) // 2])  # truncate
    return "bytes"


def _quarantine(raw: Raw, step: int) -> Optional[Dict[str, Any]]:
    data = raw.get(mf.quarantine_key(RUN, step))
    return None if data is None else dict(json.loads(data))


def _fresh_run(cli: Cli, raw: Raw) -> Any:
    return cli("run", "--name", RUN, "--store", raw.url, "--", *JOB, timeout=120)


@pytest.mark.parametrize("how", ["delete", "flip", "truncate", "manifest"])
def test_a_fresh_box_falls_back_from_an_unusable_latest_and_quarantines_it(
    cli: Cli, where: Raw, tmp_path: Any, how: str
) -> None:
    _seal(_open(where, cli), tmp_path, [10, 20])
    word = _damage(where, 20, how)
    p = _fresh_run(cli, where)
    assert p.returncode == 0, (p.stdout, p.stderr)
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    assert f"resume={os.path.join(ckpt, 'step_10.pt')}" in cli("logs", RUN, check=True).stdout
    assert not os.path.exists(os.path.join(ckpt, "step_20.pt"))  # nothing unverified in place
    record = _quarantine(where, 20)
    assert record is not None and record["step"] == 20 and word in record["reason"], record
    assert _quarantine(where, 10) is None
    if how != "delete":  # the damaged checkpoint is kept for a person to look at
        assert where.get(where.first_object(20) if how != "manifest" else mf.manifest_key(RUN, 20))
    kinds = [e["kind"] for e in cli.events(RUN)]
    assert kinds.count("quarantined") == 1 and "restored" in kinds
    # Status says which step is in effect, and why it is not LATEST's.
    st = cli.status(RUN)
    warn = [w for w in st["warnings"] if w["kind"] == "quarantined"]
    assert warn and warn[0]["step"] == 10 and warn[0]["skipped"] == [20], st["warnings"]
    assert "resumed from step 10" in cli("status", RUN, check=True).stdout
    # checkpoints never marks the quarantined step LATEST nor verified, and says which is.
    rows = {
        r["step"]: r
        for r in json.loads(cli("checkpoints", "--store", where.url, "--name", RUN, "--json",
                                check=True).stdout)
    }  # fmt: skip
    assert rows[20]["latest"] is False and rows[20]["verified"] is False
    assert word in rows[20]["quarantined"]
    assert rows[10]["latest"] is True and rows[10]["verified"] is True
    text = cli("checkpoints", "--store", where.url, "--name", RUN, check=True).stdout
    assert "LATEST names step 20, which is quarantined" in text
    assert "step 10 is the newest verified checkpoint" in text


def test_a_store_with_no_usable_checkpoint_fails_the_run_at_once_listing_what_was_tried(
    cli: Cli, where: Raw, tmp_path: Any
) -> None:
    _seal(_open(where, cli), tmp_path, [10, 20])
    _damage(where, 20, "delete")
    _damage(where, 10, "flip")
    p = _fresh_run(cli, where)
    assert p.returncode == 6, (p.stdout, p.stderr)
    assert "no verified checkpoint left" in p.stderr
    assert "step 20:" in p.stderr and "step 10:" in p.stderr, p.stderr
    assert p.stderr.index("step 20:") < p.stderr.index("step 10:")  # newest first
    st = cli.status(RUN)
    assert st["state"] == "FAILED" and st["attempt"] == 0 and not st["agent"]["alive"]
    assert "no verified checkpoint left" in st["last_exit"]["reason"]
    failed = [e for e in cli.events(RUN) if e["kind"] == "restore_failed"]
    assert len(failed) == 1 and failed[0]["class"] == "integrity"
    assert [t["step"] for t in failed[0]["tried"]] == [20, 10]
    attempts = os.path.join(cli.home, "runs", RUN, "attempts")
    assert not os.path.isdir(attempts) or not os.listdir(attempts)  # the job never ran
    assert _quarantine(where, 20) and _quarantine(where, 10)
    # A second start (detached) says the same, quickly, and still leaves the run FAILED.
    p = cli("start", "--name", RUN, "--store", where.url, "--", *JOB, timeout=120)
    assert p.returncode == 6 and "step 20: quarantined before" in p.stderr, p.stderr
    assert cli.status(RUN)["state"] == "FAILED"
    # restore on its own says the same, and creates nothing.
    dest = str(tmp_path / "restored")
    p = cli("restore", "--store", where.url, "--name", RUN, "--to", dest)
    assert p.returncode == 6 and "tried step 20" in p.stderr and not os.path.exists(dest)


def test_a_store_that_does_not_answer_quarantines_nothing(
    cli: Cli, s3_server: SeaweedServer, tmp_path: Any
) -> None:
    cli.env.update(s3_server.env(cli.env))
    raw = _s3_raw(s3_server, s3_server.bucket())
    _seal(_open(raw, cli), tmp_path, [10, 20])
    bucket = raw.url[len("s3://") :].split("/")[0]
    # An endpoint where nothing listens: the restore fails as the store's error, flags nothing.
    dead = s3_server.store(bucket, "rgt", endpoint_url=f"http://127.0.0.1:{closed_port()}")
    events: List[str] = []
    with pytest.raises(StoreError) as info:
        restore_latest(dead, RUN, str(tmp_path / "box1"), lambda kind, *a, **k: events.append(kind))
    assert not isinstance(info.value, NoVerifiedCheckpoint) and events == []
    # The real server stopped, for a restore as a person runs it: exit 14, nothing flagged.
    s3_server.stop()
    try:
        p = cli("restore", "--store", raw.url, "--name", RUN, "--to", str(tmp_path / "box2"))
    finally:
        s3_server.start()
    assert p.returncode == 14, (p.stdout, p.stderr)
    assert not [k for k in s3_server_keys(s3_server, bucket) if "/quarantine/" in k]
    # Back up: the newest checkpoint is restored, as if nothing happened.
    p = cli("restore", "--store", raw.url, "--name", RUN, "--to", str(tmp_path / "box3"))
    assert p.returncode == 0 and p.stdout.strip().endswith("step_20.pt"), (p.stdout, p.stderr)


def s3_server_keys(s3: SeaweedServer, bucket: str) -> List[str]:
    out: List[str] = []
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def test_a_restore_killed_after_an_object_leaves_nothing_that_blocks_the_next(
    cli: Cli, tmp_path: Any
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    raw = _file_raw(root)
    store = open_store(raw.url)
    ckpt = str(tmp_path / "old-box-ckpt")
    d = os.path.join(ckpt, "step_7")
    os.makedirs(d)
    for name in ("model.bin", "optim.bin", "rng.bin"):
        with open(os.path.join(d, name), "wb") as f:
            f.write(os.urandom(32 << 10))
    with open(os.path.join(d, ".rgt-complete"), "w") as marker:
        json.dump({"step": 7}, marker)
    s = Sealer(RUN, ckpt, store, str(tmp_path / "stage"), epoch=take_epoch(store, RUN),
               event=lambda *a, **k: None, state_path=str(tmp_path / "seq.json"))  # fmt: skip
    s.load()
    assert s.seal_pending() == 1
    dest = str(tmp_path / "box")
    cli.env["RGT_CRASH_AT"] = "restore.after_object:2"
    p = cli("restore", "--store", raw.url, "--name", RUN, "--to", dest)
    assert p.returncode == 137, (p.stdout, p.stderr)
    assert [n for n in os.listdir(dest) if n.startswith(".rgt-restore-")]  # the kill's leftover
    assert not os.path.exists(os.path.join(dest, "step_7"))  # nothing half put in place
    del cli.env["RGT_CRASH_AT"]
    p = cli("restore", "--store", raw.url, "--name", RUN, "--to", dest, check=True)
    assert p.stdout.strip().endswith(os.path.join(dest, "step_7"))
    assert not [n for n in os.listdir(dest) if n.startswith(".rgt-restore-")]
    for f in raw.manifest(7)["files"]:
        with open(os.path.join(dest, f["path"]), "rb") as got:
            assert hashlib.sha256(got.read()).hexdigest() == f["sha256"]
    assert _quarantine(raw, 7) is None


def test_pull_and_down_never_take_a_quarantined_step(cli: Cli, tmp_path: Any) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    raw = _file_raw(root)
    store = open_store(raw.url)
    _seal(store, tmp_path, [10, 20])
    rec = RunRecord(RUN, Target("local"), profile="local", store=raw.url)
    home = str(tmp_path / "laptop")
    receipt20 = pull(rec, str(tmp_path / "pulled20"), "store", home=home)
    assert receipt20.sealed.step == 20 and receipt20.sealed.note is None
    assert covers_newest(rec, receipt20)
    _damage(raw, 20, "flip")
    with pytest.raises(IntegrityError):  # not quarantined yet: pull refuses the bad bytes
        pull(rec, str(tmp_path / "pulled-bad"), "store", home=home)
    assert restore_latest(store, RUN, str(tmp_path / "box"), lambda *a, **k: None) is not None
    newest = newest_sealed(rec)
    assert newest.step == 10 and "step 20, which is quarantined" in str(newest.note)
    # A receipt of the quarantined step no longer covers the run: `rgt down` is refused.
    cover = covers_newest(rec, receipt20)
    assert not cover and "newest sealed step is 10" in cover.reason
    receipt10 = pull(rec, str(tmp_path / "pulled10"), "store", home=home)
    assert receipt10.sealed.step == 10 and "quarantined" in str(receipt10.sealed.note)
    assert os.path.exists(os.path.join(tmp_path, "pulled10", "checkpoints", "step_10.pt"))
    assert not os.path.exists(os.path.join(tmp_path, "pulled10", "checkpoints", "step_20.pt"))
    assert covers_newest(rec, receipt10)


# A many-file checkpoint: files in flight at once, one of them large enough for ranged GETs
# on S3 (over the single-GET limit, lowered for these tests by ``ranged``: three 4 MiB
# ranges), the rest small.
BIG_AT = 17  # the large file's place among the others
SIZES = [4096 * (i % 7 + 1) for i in range(40)]
SIZES[BIG_AT] = 12 << 20


@pytest.fixture
def ranged(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 downloads of more than 8 MiB in 4 MiB ranges (the real limits, 256 MiB and 16 MiB
    ranges, would need a checkpoint of hundreds of MiB to reach the ranged path)."""
    monkeypatch.setattr(download, "WHOLE_MAX", 8 << 20)
    monkeypatch.setattr(download, "RANGE", 4 << 20)


def _seal_dirs(
    store: Store,
    tmp_path: Any,
    steps: List[int],
    sizes: List[int] = SIZES,
    extra: Optional[Dict[str, bytes]] = None,
) -> Dict[int, Dict[str, bytes]]:
    """Each step a directory checkpoint ``step_N/`` of len(sizes) random files (and ``extra``'s,
    by their paths under it) and rgt's marker, sealed by the real Sealer; every file's bytes by
    its path under the ckpt dir."""
    ckpt = str(tmp_path / "old-box-ckpt")
    s = old_box_sealer(RUN, ckpt, store, tmp_path)
    out: Dict[int, Dict[str, bytes]] = {}
    for step in steps:
        d = os.path.join(ckpt, f"step_{step}")
        os.makedirs(d)
        out[step] = {}
        for i, size in enumerate(sizes):
            data = os.urandom(size)
            with open(os.path.join(d, f"shard-{i:02d}.bin"), "wb") as f:
                f.write(data)
            out[step][f"step_{step}/shard-{i:02d}.bin"] = data
        for rel, data in (extra or {}).items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "wb") as f:
                f.write(data)
            out[step][f"step_{step}/{rel}"] = data
        with open(os.path.join(d, ".rgt-complete"), "w") as marker:
            json.dump({"step": step}, marker)
        assert s.seal_pending() == 1
    return out


def _tree(root: str) -> List[str]:
    """Every file and directory under ``root``, relative, hidden ones (a stage) included."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    return sorted(out)


def test_a_many_file_checkpoint_is_restored_equal_to_what_was_sealed(
    cli: Cli, where: Raw, tmp_path: Any, ranged: None
) -> None:
    sealed = _seal_dirs(_open(where, cli), tmp_path, [10])[10]
    dest = str(tmp_path / "box")
    doc = restore_latest(_open(where, cli), RUN, dest, lambda *a, **k: None)
    assert doc is not None and doc["step"] == 10
    for rel, data in sealed.items():
        with open(os.path.join(dest, rel), "rb") as f:
            assert f.read() == data, rel
    assert _tree(dest) == sorted(["step_10", "step_10/.rgt-complete", *sealed])  # no stage


# Files on both sides of the size from which a download is written past the page cache
# (download.DIRECT_MIN), most with a tail that is not a whole block, more of them than there
# are lanes (each lane reuses its buffer from file to file), and one of ranged GETs.
EDGE = download.DIRECT_MIN
EDGE_SIZES = [EDGE - 1, EDGE, EDGE + 1, EDGE + 4095, 3 * EDGE + 12345, 5, 4096 * 3, 70001] * 2
EDGE_SIZES[BIG_AT % len(EDGE_SIZES)] = (12 << 20) + 777


@pytest.mark.parametrize("disk", ["ext4", "ramfs"])
def test_files_around_the_direct_write_size_are_restored_byte_for_byte_with_or_without_o_direct(
    cli: Cli, where: Raw, tmp_path: Any, ranged: None, disk: str
) -> None:
    """On the test's own disk the larger files are written with O_DIRECT; a ramfs refuses
    O_DIRECT, so every file goes through the page cache there: both give the sealed bytes."""
    sealed = _seal_dirs(_open(where, cli), tmp_path, [10], EDGE_SIZES)[10]
    with contextlib.ExitStack() as stack:
        root = str(tmp_path)
        if disk == "ramfs":
            root = stack.enter_context(tmpfs(str(tmp_path / "ram"), "mode=0700", kind="ramfs"))
        dest = os.path.join(root, "box")
        doc = restore_latest(_open(where, cli), RUN, dest, lambda *a, **k: None)
        assert doc is not None and doc["step"] == 10
        for rel, data in sealed.items():
            with open(os.path.join(dest, rel), "rb") as f:
                assert f.read() == data, rel
        assert _tree(dest) == sorted(["step_10", "step_10/.rgt-complete", *sealed])


def test_a_corrupt_object_among_many_restores_the_previous_checkpoint_and_nothing_of_it(
    cli: Cli, where: Raw, tmp_path: Any, ranged: None
) -> None:
    sealed = _seal_dirs(_open(where, cli), tmp_path, [10, 20])
    key = next(f["key"] for f in where.manifest(20)["files"] if f["size"] == SIZES[BIG_AT])
    data = where.get(key)
    assert data is not None
    mid = len(data) // 2  # a bit flipped in the middle of the object of ranged GETs
    where.put(key, data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1 :])
    dest = str(tmp_path / "box")
    kinds: List[str] = []
    doc = restore_latest(_open(where, cli), RUN, dest, lambda kind, *a, **k: kinds.append(kind))
    assert doc is not None and doc["step"] == 10 and kinds == ["quarantined", "restored"]
    record = _quarantine(where, 20)
    assert record is not None and "sha256" in record["reason"] and key in record["reason"]
    # Step 20's other 39 files downloaded and verified: none of them is under a final name.
    assert _tree(dest) == sorted(["step_10", "step_10/.rgt-complete", *sealed[10]])
    for rel, data in sealed[10].items():
        with open(os.path.join(dest, rel), "rb") as f:
            assert f.read() == data, rel


@pytest.mark.parametrize("grown", [0, BIG_AT], ids=["small-object", "large-object"])
def test_an_object_larger_than_sealed_is_refused_unread_and_the_previous_restored(
    cli: Cli, where: Raw, tmp_path: Any, ranged: None, grown: int
) -> None:
    """An object of the newest checkpoint replaced in the store by 32 MiB (a bug, a person,
    another tool writing under the same key), on a box with 20 MiB free: the restore refuses
    it by the size the store gives before its bytes (an S3 answer's length or HEAD, a file's
    size), so the disk is not filled; the checkpoint is quarantined and the previous one
    restored. Without that bound the download fills the disk and the run cannot start."""
    sealed = _seal_dirs(_open(where, cli), tmp_path, [10, 20])
    path = f"step_20/shard-{grown:02d}.bin"
    (key,) = [f["key"] for f in where.manifest(20)["files"] if f["path"] == path]
    where.put(key, os.urandom(32 << 20))
    with tmpfs(str(tmp_path / "small-disk"), "size=20m") as disk:
        dest = os.path.join(disk, "ckpt")
        kinds: List[str] = []
        doc = restore_latest(_open(where, cli), RUN, dest, lambda kind, *a, **k: kinds.append(kind))
        assert doc is not None and doc["step"] == 10 and kinds == ["quarantined", "restored"]
        assert _tree(dest) == sorted(["step_10", "step_10/.rgt-complete", *sealed[10]])
    record = _quarantine(where, 20)
    assert record is not None and key in record["reason"], record
    assert f"{32 << 20} bytes in the store, the MANIFEST says {SIZES[grown]}" in record["reason"]


def test_a_download_failing_midway_leaves_nothing_in_the_target(
    cli: Cli, where: Raw, tmp_path: Any, ranged: None
) -> None:
    """The box's disk fills while the files are in flight (an 8 MiB tmpfs, the large file
    12 MiB): the restore fails as this box's fault, after every download in flight is over,
    with no staging directory left, nothing under a final name and nothing quarantined."""
    _seal_dirs(_open(where, cli), tmp_path, [10])
    with tmpfs(str(tmp_path / "small-disk"), "size=8m") as disk:
        dest = os.path.join(disk, "ckpt")
        with pytest.raises(HostError) as info:
            restore_latest(_open(where, cli), RUN, dest, lambda *a, **k: None)
        assert "no room on this box" in info.value.what, info.value.what
        assert _tree(dest) == []  # no stage, nothing under a final name
        assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks  # every byte given back
    assert _quarantine(where, 10) is None


def test_a_box_out_of_inodes_fails_the_restore_as_its_own_and_quarantines_nothing(
    cli: Cli, where: Raw, tmp_path: Any
) -> None:
    """The box's disk has bytes free but no inodes left (a tmpfs of 20 inodes, checkpoints of
    41 files): creating a file fails with ENOSPC, which says nothing about the store. The
    restore fails as this box's fault, naming df -i, with nothing left in the target; neither
    checkpoint is quarantined, so both are still offered once the disk is fixed. (Taken for
    the store's fault, every checkpoint was quarantined in turn and none offered again.)"""
    _seal_dirs(_open(where, cli), tmp_path, [10, 20], sizes=[4096] * 40)
    with tmpfs(str(tmp_path / "few-inodes"), "size=64m,nr_inodes=20") as disk:
        dest = os.path.join(disk, "ckpt")
        kinds: List[str] = []
        with pytest.raises(HostError) as info:
            restore_latest(_open(where, cli), RUN, dest, lambda kind, *a, **k: kinds.append(kind))
        assert "No space left on device" in info.value.what, info.value.what
        assert "df -i" in (info.value.remedy or "")
        assert kinds == [] and _tree(dest) == []
    assert _quarantine(where, 20) is None and _quarantine(where, 10) is None


def test_a_checkpoint_file_named_manifest_is_no_step_and_a_stray_object_stops_no_fallback(
    cli: Cli, where: Raw, tmp_path: Any
) -> None:
    """Step 20 holds a file of its own at ``15/MANIFEST.json`` (a framework's), and the store a
    stray object under step 10 with a name rgt never writes (a backslash); step 20 is
    damaged. The fallback goes straight to step 10: no phantom step 15 tried and quarantined
    (the listing took any key ending in /MANIFEST.json for a step's), and the stray name does
    not stop the listing (it raised UnsafePath, and no step below LATEST was tried)."""
    store = _open(where, cli)
    _seal_dirs(store, tmp_path, [10], sizes=[4096])
    sealed = _seal_dirs(store, tmp_path, [20], sizes=[4096], extra={"15/MANIFEST.json": b"{}"})
    assert "step_20/15/MANIFEST.json" in sealed[20]
    where.put(f"{RUN}/checkpoints/10/e1/stray\\name", b"not rgt's")
    _damage(where, 20, "flip")
    kinds: List[str] = []
    dest = str(tmp_path / "new-box-ckpt")
    doc = restore_latest(_open(where, cli), RUN, dest, lambda kind, *a, **k: kinds.append(kind))
    assert doc is not None and doc["step"] == 10 and kinds == ["quarantined", "restored"], kinds
    assert _quarantine(where, 15) is None and _quarantine(where, 20) is not None


class _Listings:
    """The real store, with every listing it is asked for recorded (its prefix)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.listed: List[str] = []

    def list(self, prefix: str) -> Any:
        self.listed.append(prefix)
        return self._store.list(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_restoring_latest_lists_no_checkpoint_and_an_unusable_one_falls_back(
    cli: Cli, where: Raw, tmp_path: Any
) -> None:
    # Listing checkpoints/ is every object of every kept checkpoint (pages of it for a
    # checkpoint of many files): a restore of LATEST's step goes straight to its MANIFEST.
    _seal(_open(where, cli), tmp_path, [10, 20])
    store = _Listings(_open(where, cli))
    doc = restore_latest(store, RUN, str(tmp_path / "a"), lambda *a, **k: None)  # type: ignore[arg-type]
    assert doc is not None and doc["step"] == 20
    assert not [p for p in store.listed if p.startswith(mf.checkpoints_prefix(RUN))]
    _damage(where, 20, "delete")
    store = _Listings(_open(where, cli))
    doc = restore_latest(store, RUN, str(tmp_path / "b"), lambda *a, **k: None)  # type: ignore[arg-type]
    assert doc is not None and doc["step"] == 10 and _quarantine(where, 20) is not None
    assert mf.checkpoints_prefix(RUN) in store.listed


def test_a_beginning_that_fails_before_the_restore_says_what_failed(
    cli: Cli, tmp_path: Any
) -> None:
    """A store whose epoch cannot be taken (here ``RUN/epochs`` is a file, not a directory: the
    preflight passes, the epoch's write fails) fails the run before any attempt, saying that
    the epoch failed. It said "nothing to resume from", whatever had failed: a person read it
    as a missing checkpoint and looked in the wrong place."""
    root = str(tmp_path / "durable")
    os.makedirs(os.path.join(root, RUN))
    with open(os.path.join(root, RUN, "epochs"), "w") as f:
        f.write("in the way\n")
    p = _fresh_run(cli, _file_raw(root))
    assert p.returncode == 14, (p.stdout, p.stderr)
    (failed,) = [e for e in cli.events(RUN) if e["kind"] == "restore_failed"]
    want = f"taking the run's epoch in file://{root} failed: "
    assert failed["reason"].startswith(want), failed
    assert "nothing to resume from" not in failed["reason"] and "tried" not in failed
    st = cli.status(RUN)
    assert st["state"] == "FAILED" and st["attempt"] == 0
    assert st["last_exit"]["reason"] == failed["reason"], st["last_exit"]
