"""`rgt pull`'s destination (controller/results/destination.py), against real file:// stores and
a real tmpfs: one pull at a time into DEST for the whole pull, a DEST that holds another run's
verified pull refused, a full disk while placing the files one clear error that keeps the last
verified pull and its receipt, what a killed pull left in the way of a staging name cleared, and
no more bytes taken from the box than a file was sealed with."""

from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Any, List

import pytest

import controller.results.pull as pull_module
from controller.registry import RunRecord
from controller.results import destination
from controller.results.entries import stage_path
from controller.results.pull import pull
from controller.results.receipt import load_state_receipt, receipt_path, write_receipt
from controller.results.sealed import covers_newest
from onbox.common.errors import HostError, IntegrityError, RgtError, UnsafeRefused, UsageError
from tests.conftest import require
from tests.integration.test_pull import (
    RUN,
    _finals,
    _object_key,
    _rec,
    _seal,
    _store,
    _store_file,
)


def test_a_second_pull_into_dest_is_refused_until_the_first_has_cleaned_up(
    tmp_path: Any, laptop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock was a file inside the staging directory, let go before the receipt was written
    and the directory removed: a pull started in that gap ran, and the first one's clean-up
    then removed its lock and staged files (and a third pull ran beside it)."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(5000)})
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    dest = str(tmp_path / "dest")
    seen: List[BaseException] = []
    real = write_receipt

    def receipt_then_another_pull(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        try:  # a second pull, as another terminal would start it right now
            pull(rec, dest, "store")
        except RgtError as e:
            seen.append(e)

    monkeypatch.setattr(pull_module, "write_receipt", receipt_then_another_pull)
    pull(rec, dest, "store")
    assert len(seen) == 1 and isinstance(seen[0], UsageError), seen
    assert "another pull into" in seen[0].what
    monkeypatch.setattr(pull_module, "write_receipt", real)
    pull(rec, dest, "store")  # once it is over, the next pull runs
    assert not os.path.exists(os.path.join(dest, ".rgt-part"))


def test_a_dest_holding_another_runs_pull_is_refused_and_down_sees_a_replaced_receipt(
    tmp_path: Any, laptop: str
) -> None:
    """`rgt pull r2 --to D` over r1's verified pull replaced r1's files and removed D's receipt,
    and `rgt down r1` (sizes only) still believed r1's receipt. Now the pull is refused, and a
    receipt whose DEST no longer holds it covers nothing."""
    store = _store(tmp_path)
    _seal(str(tmp_path / "a"), store, 5, {"model.bin": b"1" * 1000})
    _seal(str(tmp_path / "b"), store, 5, {"model.bin": b"2" * 1000}, run="r2")
    rec1 = _rec(store.url, str(tmp_path / "boxhome"))
    rec2 = RunRecord("r2", rec1.target, profile="local", store=store.url)
    dest = str(tmp_path / "dest")
    pull(rec1, dest, "store")
    with pytest.raises(UsageError) as info:
        pull(rec2, dest, "store")
    assert f"holds the verified pull of run {RUN!r}" in info.value.what
    with open(os.path.join(dest, "checkpoints", "step_5", "model.bin"), "rb") as f:
        assert f.read() == b"1" * 1000
    receipt = load_state_receipt(RUN)
    assert receipt is not None and covers_newest(rec1, receipt)
    os.unlink(receipt_path(dest))  # as a pull cut midway, or any other, leaves it
    why = covers_newest(rec1, receipt)
    assert not why and "no longer holds this pull's receipt" in why.reason


def test_a_full_disk_while_placing_keeps_the_last_verified_pull_and_its_receipt(
    tmp_path: Any, laptop: str
) -> None:
    """Two equal files of one checkpoint are one object in the store: staged once, copied for
    the second name while placing. On a full disk that copy raised a traceback after the old
    receipts were removed, with the new checkpoint's completeness marker already in place."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "rgt-test-pull", str(mnt)], capture_output=True
    )
    require(mounted.returncode == 0, "root, to mount a small tmpfs")
    try:
        store = _store(tmp_path)
        _seal(str(tmp_path), store, 5, {"small.txt": b"s" * 100})
        rec = _rec(store.url, str(tmp_path / "boxhome"))
        dest = str(mnt / "dest")
        pull(rec, dest, "store")
        before = sorted(_finals(dest))
        blob = os.urandom(400 * 1024)
        _seal(str(tmp_path), store, 6, {"w1.bin": blob, "w2.bin": blob})
        with pytest.raises(HostError) as info:
            pull(rec, dest, "store")
        assert "No space left" in info.value.what and "df -h" in (info.value.remedy or "")
        assert sorted(_finals(dest)) == before  # nothing of step 6 under a final name
        assert os.path.exists(receipt_path(dest)) and load_state_receipt(RUN) is not None
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_killed_pulls_directory_in_the_way_of_a_staging_name_is_cleared(
    tmp_path: Any, laptop: str
) -> None:
    """A pull that failed left ``.rgt-part/<key>/x``; the store lists ``<key>`` itself as a
    file now: every later pull ended in IsADirectoryError."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": b"m" * 100})
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    dest = str(tmp_path / "dest")
    key = _object_key(store, 5, "step_5/model.bin")
    os.makedirs(os.path.join(dest, ".rgt-part", *key.split("/"), "x"))
    pull(rec, dest, "store")
    with open(os.path.join(dest, "checkpoints", "step_5", "model.bin"), "rb") as f:
        assert f.read() == b"m" * 100


@pytest.mark.parametrize("transport", ["stream", "rsync"])
def test_a_box_file_larger_than_sealed_is_not_taken_whole(
    tmp_path: Any, laptop: str, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The box's copy is 64 MiB where 100 bytes were sealed: both transports took all of it
    (twice, with the retry) before verification refused it."""
    require(transport != "rsync" or subprocess.run(["which", "rsync"]).returncode == 0, "rsync")
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"a.bin": b"a" * 100})
    key = _object_key(store, 5, "step_5/a.bin")
    with open(_store_file(store, key), "wb") as f:  # other bytes, and far more of them
        f.truncate(64 << 20)
    staged: List[int] = []
    real = pull_module._mismatch

    def spy(stage_dir: str, e: Any) -> Any:
        if os.path.exists(stage_path(stage_dir, e)):  # rsync skips it whole
            staged.append(os.path.getsize(stage_path(stage_dir, e)))
        return real(stage_dir, e)

    monkeypatch.setattr(pull_module, "_mismatch", spy)
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    with pytest.raises(IntegrityError):
        pull(rec, str(tmp_path / "dest"), "box", transport=transport)
    assert max(staged, default=0) <= 100, staged


def test_the_stream_takes_exactly_the_sealed_prefix_of_a_file_grown_since(
    tmp_path: Any, laptop: str
) -> None:
    """A log that grew after it was sealed: the sealed bytes are what is verified and kept."""
    store = _store(tmp_path)
    data = b"line\n" * 50
    _seal(str(tmp_path), store, 5, {"log.txt": data})
    key = _object_key(store, 5, "step_5/log.txt")
    with open(_store_file(store, key), "ab") as f:
        f.write(b"written after the seal\n" * 1000)
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    receipt = pull(rec, str(tmp_path / "dest"), "box", transport="stream")
    (rec_file,) = [f for f in receipt.files if f.path.endswith("log.txt")]
    assert rec_file.sha256 == hashlib.sha256(data).hexdigest()


# Two pairs of names a folding filesystem takes for one: by case, and by Unicode normal form.
BY_CASE = ("Model.txt", "model.txt")
BY_FORM = ("caf\u00e9.txt", "cafe\u0301.txt")  # "café": NFC, NFD


@pytest.mark.parametrize(
    "twins,folds",
    [(BY_CASE, (True, False)), (BY_FORM, (False, True))],
    ids=["case", "normal-form"],
)
def test_twins_on_a_folding_dest_are_refused_before_anything_is_fetched_fake_probe(
    tmp_path: Any, laptop: str, monkeypatch: pytest.MonkeyPatch, twins: Any, folds: Any
) -> None:
    """On a DEST whose filesystem folds case (APFS's default, Windows) or normal forms (APFS),
    "Model.txt" and "model.txt" (or NFC and NFD "café") of one sealed state landed on one file,
    the second rename replacing the first, and the pull said verified with both in its receipt.
    This kernel has no case-folding filesystem to mount (no CONFIG_UNICODE: neither ext4's
    casefold nor tmpfs's; XFS's ascii-ci is gone), so the probe of DEST is the one fake: the
    store, the sealer and the pull are real."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {twins[0]: b"first" * 100, twins[1]: b"second" * 100})
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    dest = str(tmp_path / "dest")
    probed: List[str] = []

    def fake_probe(d: str) -> Any:
        probed.append(d)
        return destination.Folding(*folds)  # what folds: case, normal forms

    monkeypatch.setattr(destination, "probe_folding", fake_probe, raising=False)
    with pytest.raises(UnsafeRefused) as info:
        pull(rec, dest, "store")
    assert info.value.exit_code == 7 and probed == [dest]
    what = info.value.what
    # ascii(): NFC and NFD "café" look the same; their escapes do not.
    assert all(ascii(f"checkpoints/step_5/{n}") in what for n in twins), what
    assert "one would overwrite the other" in what and "case-sensitive" in (info.value.remedy or "")
    assert _finals(dest) == [] and load_state_receipt(RUN) is None
    # Folding the other way only, the same DEST takes both names: each lands, verified.
    other = destination.Folding(not folds[0], not folds[1])
    monkeypatch.setattr(destination, "probe_folding", lambda d: other)
    pull(rec, dest, "store")
    step = ["checkpoints/step_5/.rgt-complete", *(f"checkpoints/step_5/{n}" for n in twins)]
    assert _finals(dest) == sorted([".rgt-receipt.json", *step])


def test_twins_on_a_case_sensitive_dest_both_land_and_the_probe_leaves_nothing(
    tmp_path: Any, laptop: str
) -> None:
    """The real probe, on this machine's case-sensitive filesystem: it finds no folding, both
    names of each pair land with their own bytes, and nothing of the probe is left in DEST."""
    assert destination.probe_folding(str(tmp_path)) == destination.Folding(False, False)
    files = {n: n.encode() * 50 for n in (*BY_CASE, *BY_FORM)}
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, files)
    dest = str(tmp_path / "dest")
    receipt = pull(_rec(store.url, str(tmp_path / "boxhome")), dest, "store")
    assert len(receipt.files) == 5
    for name, data in files.items():
        with open(os.path.join(dest, "checkpoints", "step_5", name), "rb") as f:
            assert f.read() == data
    assert sorted(os.listdir(dest)) == [".rgt-receipt.json", "checkpoints"]


def test_a_dest_under_a_regular_file_names_that_file_and_what_to_do(
    tmp_path: Any, laptop: str
) -> None:
    """`rgt pull N --to FILE/sub`, FILE a regular file, said "FILE/sub is a file" (it is not
    there at all) and no remedy."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(100)})
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    with pytest.raises(UsageError) as e:
        pull(rec, str(afile / "sub"), "store")
    assert e.value.exit_code == 2
    assert e.value.what.startswith(f"--to: {afile} is a file"), e.value.line()
    assert f"{afile}/sub is a file" not in e.value.what, e.value.line()
    assert e.value.remedy and "--to" in e.value.remedy, e.value.line()
    assert afile.read_text() == "mine\n"  # left as it was
