"""Nothing lost at the edges of a run: a low disk and a successful end.

What a user relies on: when the checkpoint disk runs low, rgt deletes only local bytes the
store holds exactly (never the newest local state, never an in-place ``ckpt.pt`` that holds
a newer step than the one sealed under its name, never a file open for writing); and when the
job succeeds, every file it left in RGT_CKPT_DIR (``result.txt``, ``metrics.json``, any
format) and every declared output (job file ``outputs`` and ``--output``) is sealed and
verified before DONE.json, and comes back with ``rgt pull``; a declared output that is missing
is said in an event, in status and in the pull's output.

Real agents, real jobs, a real file:// store, a real small tmpfs for the low disk (mounted as
root; under CI a failure to mount fails the test), and the laptop's real ``rgt pull``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from onbox.room import is_low
from onbox.sealer import Sealer, take_epoch
from onbox.stores import open_store
from tests.conftest import require

MiB = 1 << 20


def _tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path])
    return p.returncode == 0


@pytest.fixture
def small(tmp_path: Any) -> Iterator[str]:
    """An 8 MiB tmpfs: a checkpoint disk that really runs low."""
    path = str(tmp_path / "small")
    require(_tmpfs(path, "8m"), "root, to mount a small tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])


def _sealer(tmp_path: Any, ckpt_dir: str, events: List[Dict[str, Any]]) -> Sealer:
    store = open_store("file://" + str(tmp_path / "durable"))
    s = Sealer(
        "r",
        ckpt_dir,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "r"),
        keep=10,
        event=lambda kind, reason, **kw: events.append(dict(kw, kind=kind, reason=reason)),
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    return s


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:  # in place: same inode, truncated, rewritten (torch.save's way)
        f.write(data)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fill_until_low(ckpt_dir: str, name: str = "filler.dat") -> None:
    """Grow a file (no checkpoint format: never sealed, never deleted) until under 5 % free."""
    with open(os.path.join(ckpt_dir, name), "ab") as f:
        while not is_low(ckpt_dir):
            f.write(b"\0" * (64 << 10))
            f.flush()


def test_a_low_disk_never_deletes_an_in_place_checkpoint_holding_the_newest_step(
    small: str, tmp_path: Any
) -> None:
    """ckpt.pt, rewritten in place, is one root for steps 0, 1, 2: every MANIFEST names it.
    Deleting it as the sealed copy of step 0 (what happened) deletes step 2, the newest state."""
    events: List[Dict[str, Any]] = []
    s = _sealer(tmp_path, small, events)
    ckpt = os.path.join(small, "ckpt.pt")
    _write(ckpt, os.urandom(MiB))
    _fill_until_low(small)
    for step in range(3):
        data = os.urandom(MiB)
        _write(ckpt, data)
        assert s.seal_pending() == 1  # sealed, then free_room ran with the disk low
        assert s.manifests[step]["files"][0]["sha256"] == _sha(data)
        with open(ckpt, "rb") as f:
            assert f.read() == data, f"the newest local state (step {step}) was deleted"
    assert is_low(small)
    for _ in range(3):  # the sealer asks again after each seal: one event, not a loop of them
        s.free_room()
    assert [e["kind"] for e in events].count("room_exhausted") == 1
    assert "freed_local" not in [e["kind"] for e in events]
    [stuck] = [e for e in events if e["kind"] == "room_exhausted"]
    assert stuck["klass"] == "permanent" and "df -i" in stuck["remedy"]


def test_a_low_disk_deletes_only_bytes_sealed_exactly_and_reached_by_latest(
    small: str, tmp_path: Any
) -> None:
    """Four sealed checkpoints. step_1.pt was rewritten after it was sealed (its bytes are not
    the store's), step_2.pt is open for writing, step_4.pt is the newest: only step_3.pt, whose
    bytes are exactly the sealed ones, may go."""
    events: List[Dict[str, Any]] = []
    s = _sealer(tmp_path, small, events)
    blobs = {n: os.urandom(1536 << 10) for n in range(1, 5)}
    for n, data in blobs.items():
        _write(os.path.join(small, f"step_{n}.pt"), data)
    assert s.seal_pending() == 4 and not is_low(small)
    assert not [e for e in events if e["kind"] in ("freed_local", "room_exhausted")]
    rewritten = os.urandom(1536 << 10)
    _write(os.path.join(small, "step_1.pt"), rewritten)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); sys.stdin.read()"]
        + [os.path.join(small, "step_2.pt")],
        stdin=subprocess.PIPE,
    )
    try:
        time.sleep(0.3)  # it has the file open
        _fill_until_low(small)
        freed = s.free_room()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    assert sorted(os.listdir(small)) == ["filler.dat", "step_1.pt", "step_2.pt", "step_4.pt"]
    with open(os.path.join(small, "step_1.pt"), "rb") as f:
        assert f.read() == rewritten
    [ev] = [e for e in events if e["kind"] == "freed_local"]
    assert ev["step"] == 3 and ev["freed"] == freed == len(blobs[3])
    assert "step_3.pt" in ev["reason"] and f"{len(blobs[3])} bytes freed" in ev["reason"]
    # What went is in the store, byte for byte.
    [entry] = s.manifests[3]["files"]
    with open(os.path.join(str(tmp_path / "durable"), entry["key"]), "rb") as f:
        assert _sha(f.read()) == _sha(blobs[3]) == entry["sha256"]
