"""`rgt pull` into a DEST that holds an older pull of the same run, against a real file://
store sealed by the real Sealer: the new receipt covers exactly what this pull brought, and the
older pull's files it did not replace are named in it as not covered, never passed off as this
pull's (controller/results/destination.py ``not_covered``)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry
from controller.remote import SshRemote
from controller.results.pull import pull
from controller.results.receipt import load_receipt, load_state_receipt, receipt_path
from onbox.sealing.epochs import take_epoch
from tests.conftest import Cli
from tests.integration.test_pull import RUN, _rec, _seal, _ssh_target, _store
from tests.sshd import SshServer


def test_a_pull_of_nothing_over_an_older_pull_names_its_files_as_not_covered(
    tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's store has nothing sealed now (a new store, a wiped one), DEST holds the older
    pull of step 5: before, the new receipt said "nothing sealed" over step 5's files, which no
    receipt covered any more, and nothing said so."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": b"m" * 100})
    dest = str(tmp_path / "dest")
    pull(_rec(store.url, str(tmp_path / "boxhome")), dest, "store")
    shutil.rmtree(str(tmp_path / "store"))
    empty = _store(tmp_path)
    take_epoch(empty, RUN)  # the run's agent took its epoch; nothing is sealed
    rec = _rec(empty.url, str(tmp_path / "boxhome"))
    receipt = pull(rec, dest, "store")
    assert receipt.sealed.nothing and receipt.files == []
    older = ["checkpoints/step_5/.rgt-complete", "checkpoints/step_5/model.bin"]
    assert receipt.not_covered == older
    for r in (load_receipt(receipt_path(dest)), load_state_receipt(RUN)):
        assert r is not None and r.not_covered == older
    # `rgt pull` says so, after "nothing pulled"
    Registry().put(rec)
    capsys.readouterr()
    assert rgt_main(["pull", RUN, "--to", dest, "--from", "store"]) == 0
    out = capsys.readouterr().out
    assert "nothing pulled" in out and "did not bring" in out, out
    assert "checkpoints/step_5/model.bin" in out, out
    assert os.path.exists(os.path.join(dest, "checkpoints", "step_5", "model.bin"))  # kept


def test_a_newer_pull_names_the_older_checkpoint_it_no_longer_has_as_not_covered(
    tmp_path: Any, laptop: str
) -> None:
    """The job removed step 5 (keep the newest only) and sealed step 6: step 5's files stay
    in DEST from the older pull, named as not covered; step 6's are the receipt's."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": b"5" * 100})
    dest = str(tmp_path / "dest")
    rec = _rec(store.url, str(tmp_path / "boxhome"))
    first = pull(rec, dest, "store")
    assert first.not_covered == []
    shutil.rmtree(str(tmp_path / "ckpt" / "step_5"))
    _seal(str(tmp_path), store, 6, {"model.bin": b"6" * 100})
    receipt = pull(rec, dest, "store")
    assert {f.path for f in receipt.files} == {
        "checkpoints/step_6/.rgt-complete",
        "checkpoints/step_6/model.bin",
    }
    assert receipt.not_covered == [
        "checkpoints/step_5/.rgt-complete",
        "checkpoints/step_5/model.bin",
    ]


_LINKED_JOB = """
import os
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(os.path.join(ckpt, "step-1"))
with open(os.path.join(ckpt, "step-1", "model.dat"), "wb") as f:
    f.write(b"weights")
os.symlink("model.dat", os.path.join(ckpt, "step-1", "last.dat"))
"""


def test_a_file_of_an_older_pull_where_a_link_goes_is_kept_and_named_not_covered(
    cli: Cli, tmp_path: Any, sshd: SshServer, laptop: str
) -> None:
    """A run without a store, pulled from a real box over a real sshd: its link
    ``step-1/last.dat -> model.dat`` finds a regular file of an older pull at its name in
    DEST. The file is kept (never replaced by a link) and, since this pull did not bring it,
    named as not covered, not counted as this pull's link."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(_LINKED_JOB)
    argv = [sys.executable, "job.py"]
    ckpt = str(work / "ckpt")
    cli("run", "--name", RUN, "--ckpt-dir", ckpt, "--", *argv, check=True, cwd=str(work))
    target = _ssh_target(sshd)
    try:
        rec = _rec(None, cli.home, target)
        dest = tmp_path / "dest"
        (dest / "checkpoints" / "step-1").mkdir(parents=True)
        (dest / "checkpoints" / "step-1" / "last.dat").write_bytes(b"older")
        receipt = pull(rec, str(dest), "box")
    finally:
        SshRemote(target).close()  # the control master ssh keeps for a while
    assert (dest / "checkpoints" / "step-1" / "last.dat").read_bytes() == b"older"
    assert "checkpoints/step-1/model.dat" in {f.path for f in receipt.files}
    assert receipt.not_covered == ["checkpoints/step-1/last.dat"]
