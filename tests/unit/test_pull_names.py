"""`rgt pull` and the names a store supplies in DONE.json, and the laptop's receipt of an earlier
pull, against a real file:// store and real directories (controller/results/documents.py,
destination.py, receipt.py); and what `rgt pull`'s line says it pulled.

DONE.json is the box's: each file it lists has ``path`` and ``key``, and the agent writes the key
as ``RUN/outputs/PATH``, ``RUN/logs/PATH`` or ``RUN/results/PATH`` (onbox/agent/completion.py
``_put_files``). A key that is not that (``r1/logs``: no file under logs/) put a file named
``DEST/logs`` where the pull's logs directory goes."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Tuple

import pytest

from controller.cli import main
from controller.registry import Registry, RunRecord
from controller.results.down import DownPlan
from controller.results.entries import Entry, Sealed, checked
from controller.results.pull import Progress, covers_newest, pull
from controller.results.receipt import Coverage, Receipt, SealedId, load_state_receipt, receipt_path
from controller.target import Target
from onbox.common.errors import IntegrityError
from onbox.common.safepath import UnsafePath
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store

RUN = "r1"


def _done(store: Store, files: Dict[str, Dict[str, Any]]) -> None:
    """A DONE.json listing ``files`` (key: its entry, without size and sha256), each object
    written to the store under its key."""
    entries: List[Dict[str, Any]] = []
    for key, entry in files.items():
        data = f"bytes of {key}".encode()
        store.put_bytes(key, data)
        sha = hashlib.sha256(data).hexdigest()
        entries.append(dict(entry, key=key, size=len(data), sha256=sha))
    doc = {"schema": 1, "run": RUN, "files": entries, "missing_outputs": []}
    store.put_bytes(f"{RUN}/DONE.json", json.dumps(doc).encode())


def _setup(tmp_path: Any) -> Tuple[Store, RunRecord]:
    root = tmp_path / "store"
    root.mkdir()
    store = open_store(f"file://{root}")
    rec = RunRecord(
        RUN, Target("local"), profile="local", store=store.url, box_home=str(tmp_path / "box")
    )
    return store, rec


@pytest.mark.parametrize(
    "key, entry",
    [
        (f"{RUN}/logs", {"path": "attempt-0001.log"}),  # the key names the logs directory
        (f"{RUN}/outputs", {"path": "outputs"}),
        (f"{RUN}/outputs/a.txt", {"path": "b.txt"}),  # not the file's path under outputs/
        (f"{RUN}/results", {"path": "result.txt", "root": "ckpt"}),
    ],
)
def test_a_done_key_that_is_not_a_file_under_its_kind_is_refused_and_nothing_is_created(
    tmp_path: Any, laptop: str, key: str, entry: Dict[str, Any]
) -> None:
    store, rec = _setup(tmp_path)
    _done(store, {key: entry})
    dest = str(tmp_path / "dest")
    with pytest.raises(IntegrityError) as info:
        pull(rec, dest, "store")
    assert info.value.exit_code == 6
    assert repr(key) in info.value.what, info.value.what
    assert not os.path.lexists(dest)  # nothing created on the laptop
    assert load_state_receipt(RUN, laptop) is None


def test_done_files_land_under_their_kind_as_the_agent_names_them(
    tmp_path: Any, laptop: str
) -> None:
    store, rec = _setup(tmp_path)
    _done(
        store,
        {
            f"{RUN}/outputs/model/w.bin": {"path": "model/w.bin"},
            f"{RUN}/logs/attempt-0001.log": {"path": "attempt-0001.log"},
            f"{RUN}/results/result.txt": {"path": "result.txt", "root": "ckpt"},
        },
    )
    dest = str(tmp_path / "dest")
    receipt = pull(rec, dest, "store")
    assert sorted(f.path for f in receipt.files) == [
        "checkpoints/result.txt",
        "logs/attempt-0001.log",
        "outputs/model/w.bin",
    ]
    with open(os.path.join(dest, "outputs", "model", "w.bin"), "rb") as f:
        assert f.read() == f"bytes of {RUN}/outputs/model/w.bin".encode()


@pytest.mark.parametrize("path", ["logs", "outputs", "checkpoints"])
def test_no_source_may_name_a_file_in_place_of_a_kinds_directory(path: str) -> None:
    """The one gate every source's names pass (a store's documents, the box's listing)."""
    entry = Entry(path, "log", 1, "0" * 64, f"{RUN}/{path}")
    with pytest.raises(UnsafePath, match="is not a file under checkpoints/, outputs/, logs/"):
        checked(Sealed(SealedId(), [entry], "store"), "pull of r1")


def _checkpoint(store: Store, latest: Dict[str, Any]) -> None:
    """A sealed checkpoint of one file at LATEST's step, as the sealer writes it, and
    ``latest`` as LATEST.json (its fields as given: a store's, untrusted)."""
    data = b"weights"
    key = f"{RUN}/checkpoints/{latest['step']}/e1/w.bin"
    store.put_bytes(key, data)
    sha = hashlib.sha256(data).hexdigest()
    manifest = {
        "schema": 1,
        "run": RUN,
        "step": latest["step"],
        "epoch": 1,
        "root": "w.bin",
        "kind": "file",
        "files": [{"path": "w.bin", "size": len(data), "sha256": sha, "key": key}],
    }
    store.put_bytes(
        f"{RUN}/checkpoints/{latest['step']}/MANIFEST.json", json.dumps(manifest).encode()
    )
    store.put_bytes(f"{RUN}/LATEST.json", json.dumps(dict(latest, schema=1, run=RUN)).encode())


def test_a_latest_whose_epoch_is_no_integer_pulls_with_a_receipt_that_reads_back(
    tmp_path: Any, laptop: str
) -> None:
    """The receipt takes LATEST's epoch, and a receipt with "epoch": true is damaged (exit 6
    at `rgt down`): a pull that succeeded must not write one it cannot read back."""
    store, rec = _setup(tmp_path)
    _checkpoint(store, {"step": 5, "epoch": True})
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert receipt.sealed.epoch is None
    assert load_state_receipt(RUN, laptop) == receipt


def test_a_latest_whose_step_is_true_is_refused_and_nothing_is_created(
    tmp_path: Any, laptop: str
) -> None:
    store, rec = _setup(tmp_path)
    _checkpoint(store, {"step": True, "epoch": 1})
    dest = str(tmp_path / "dest")
    with pytest.raises(IntegrityError, match="LATEST.json names no step"):
        pull(rec, dest, "store")
    assert not os.path.lexists(dest)


def _pull_cut_while_placing(rec: RunRecord, dest: str, elsewhere: str) -> None:
    """A pull into ``dest`` that fails once the old receipts are gone, while placing: a symlink
    put at DEST/outputs after DEST was checked is refused there (exit 6)."""
    link = os.path.join(dest, "outputs")

    def plant(p: Progress) -> None:
        if p.phase == "verify" and not os.path.islink(link):
            if os.path.isdir(link):
                os.rename(link, link + ".moved")
            os.symlink(elsewhere, link)

    with pytest.raises(IntegrityError, match="symlink"):
        pull(rec, dest, "store", plant)


def test_a_pull_into_another_dest_cut_while_placing_keeps_the_older_verified_pulls_receipt(
    tmp_path: Any, laptop: str
) -> None:
    """The laptop's receipt of the run was removed by any pull that began to place files, into
    whichever DEST: `rgt down` then refused, though the older DEST still held its verified
    copy untouched. It stays now, and still covers the newest state; a pull cut while placing
    into the receipt's own DEST removes it, as before."""
    store, rec = _setup(tmp_path)
    _done(store, {f"{RUN}/outputs/a.txt": {"path": "a.txt"}})
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    (tmp_path / "elsewhere").mkdir()
    first = pull(rec, old, "store")
    os.makedirs(new)
    _pull_cut_while_placing(rec, new, str(tmp_path / "elsewhere"))
    assert os.listdir(tmp_path / "elsewhere") == []  # nothing written through the symlink
    kept = load_state_receipt(RUN, laptop)
    assert kept == first and covers_newest(rec, kept)

    _pull_cut_while_placing(rec, old, str(tmp_path / "elsewhere"))
    assert load_state_receipt(RUN, laptop) is None
    assert not os.path.exists(receipt_path(old))


def test_rgt_pull_prints_a_redacted_logs_name_on_one_line(
    tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name may hold a newline (safe_rel lets LF through: POSIX names may): printed as is,
    a log's name from DONE.json forged a line of rgt's own output."""
    store, rec = _setup(tmp_path)
    key = f"{RUN}/logs/attempt-0001.log\nrgt: FORGED"
    _done(store, {key: {"path": key[len(f"{RUN}/logs/") :], "redacted": True}})
    Registry().put(rec)
    assert main(["pull", RUN, "--to", str(tmp_path / "dest"), "--from", "store"]) == 0
    out = capsys.readouterr().out
    assert "attempt-0001.log?rgt: FORGED" in out, out
    assert "\nrgt: FORGED" not in out


def test_rgt_down_shows_what_the_box_names_on_one_line_each() -> None:
    """What down shows before the run's name is typed: a checkpoint's name on the box, the
    state the box reports, are the box's; an escape sequence or a newline in one could redraw
    or forge the list of what will be lost."""
    receipt = Receipt("r1", "store", "local", None, "/d", SealedId(step=5), [])
    lost = ["checkpoint a\x1b[2J\nwill be lost (on the box only, not in the receipt):\n  nothing"]
    plan = DownPlan(
        RunRecord(RUN, Target("local"), profile="local"),
        receipt,
        Coverage(True),
        "RUNNING\x1b[8m",
        lost,
        ["the checkpoint dir /ck\rpt on the box"],
        [],
        [],
    )
    lines = plan.lines()
    assert not [ln for ln in lines if "\x1b" in ln or "\n" in ln or "\r" in ln], lines
    assert (
        "  checkpoint a?[2J?will be lost (on the box only, not in the receipt):?  nothing" in lines
    )


def test_rgt_pull_of_a_finished_run_with_no_checkpoint_says_it_pulled_its_results_only(
    tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DONE.json and no LATEST (the job never sealed a checkpoint): the line said "step None
    pulled"."""
    store, rec = _setup(tmp_path)
    _done(
        store,
        {
            f"{RUN}/outputs/w.bin": {"path": "w.bin"},
            f"{RUN}/logs/attempt-0001.log": {"path": "attempt-0001.log"},
        },
    )
    Registry().put(rec)
    dest = str(tmp_path / "dest")
    assert main(["pull", RUN, "--to", dest, "--from", "store"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "None" not in first, first
    want = f"{RUN}: results only (DONE.json; no checkpoint was sealed) pulled to {dest} and "
    assert first.startswith(want + "verified: 2 files"), first
