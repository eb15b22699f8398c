"""`rgt pull` and `rgt down` of a store-backed run that has nothing sealed yet.

A run whose job failed, or was stopped, before its first checkpoint was sealed has no LATEST.json
and no DONE.json in its store. `rgt pull N` pulls what there is (nothing) and writes a receipt
that records that nothing was sealed; `rgt down N` accepts it only while the store still has
nothing sealed, and its plan lists as lost the checkpoint files left on the box. A store with
no trace of the run (not even its agent's epoch) is not said to have nothing sealed. Each run is
a real agent with a real file:// store (the Box of tests/integration/test_down.py), or an S3
store on a real SeaweedFS.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, List, Tuple

import pytest

from controller.registry import Registry
from controller.remote import SshRemote, open_remote
from controller.results.down import down, plan_down
from controller.target import Target
from onbox.common.errors import IntegrityError, UnsafeRefused
from tests.conftest import Cli
from tests.integration.test_down import RUN, Box, _pod_profile
from tests.seaweed import SeaweedServer
from tests.sshd import SshServer


def _rgt(capsys: pytest.CaptureFixture[str], *argv: str) -> Tuple[int, str, str]:
    """`rgt ARGV` in this process: its exit code, stdout and stderr."""
    from controller.cli import main as rgt_main

    capsys.readouterr()
    code = rgt_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _never(prompt: str) -> str:
    raise AssertionError(f"down asked {prompt!r} before it should have")


def test_a_pull_of_a_run_with_nothing_sealed_lets_down_go_only_while_nothing_is_sealed(
    cli: Cli, tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `rgt pull N` of a run with nothing sealed stopped (exit 8, "has nothing sealed
    yet") and wrote no receipt, so `rgt down N` was refused for ever ("rgt pull N first").
    Now the pull writes a receipt recording that nothing was sealed; down accepts it; once a
    checkpoint is sealed after the pull, down refuses again."""
    box = Box(cli, tmp_path)
    rec = box.record()
    assert box.latest() is None
    dest = tmp_path / "dest"
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(dest))
    assert code == 0, err
    assert "nothing is sealed" in out, out
    with open(dest / ".rgt-receipt.json") as f:
        doc = json.load(f)
    assert doc["files"] == [] and doc["sealed"]["step"] is None and not doc["sealed"]["done"]
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    assert "nothing was sealed" in text, text
    # The store's directory gone (a mount that is not there): no store to say nothing is sealed.
    os.rename(box.store_root, box.store_root + ".away")
    with pytest.raises(UnsafeRefused) as e:
        plan_down(rec, open_remote(rec.target))
    assert "is not a directory on this machine" in e.value.what, e.value.what
    os.rename(box.store_root + ".away", box.store_root)

    box.checkpoint(1)  # sealed after the pull: the receipt no longer covers the newest state
    with pytest.raises(UnsafeRefused) as e:
        plan_down(rec, open_remote(rec.target))
    assert "step 1" in e.value.what and "nothing was sealed" in e.value.what, e.value.what
    box.intact()


def test_down_of_a_stopped_run_with_nothing_sealed_names_its_unsealed_checkpoint_as_lost(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    sshd: SshServer,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run stopped before any checkpoint was sealed, a checkpoint file the job left on the box
    unsealed: `rgt pull N --from box` (a file:// store read on the box, over a real sshd) gives a
    receipt down accepts, with the job's log its agent sealed as the run ended (ENDED.json);
    down's plan says, before it does anything, that the file is lost (the log is not: it is
    pulled); the store is left as it is."""
    box = Box(cli, tmp_path)
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(RUN, lambda s: s["state"] == "STOPPED", what="the run stopped")
    assert box.latest() is None
    left = os.path.join(box.run_dir, "ckpt", "step_5.pt")
    with open(left, "wb") as f:
        f.write(b"a checkpoint no seal took")
    target = Target(
        "ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key
    )
    request.addfinalizer(SshRemote(target).close)
    rec = box.record(target)
    # The store's directory gone from the box (a mount that is not there): that the store has
    # nothing sealed is not known, so no receipt says it.
    os.rename(box.store_root, box.store_root + ".away")
    code, out, err = _rgt(capsys, "pull", RUN, "--from", "box", "--to", str(tmp_path / "away"))
    assert code == 8 and "not a directory on" in err, (code, out, err)
    os.rename(box.store_root + ".away", box.store_root)
    # A directory that is there but is not the run's store (no epoch of the run in it): not a
    # store with nothing sealed either.
    os.mkdir(tmp_path / "other")
    Registry().put(dataclasses.replace(rec, store=f"file://{tmp_path}/other"))
    code, out, err = _rgt(capsys, "pull", RUN, "--from", "box", "--to", str(tmp_path / "away"))
    assert code == 8 and f"{tmp_path}/other holds nothing of run {RUN}" in err, (code, out, err)
    assert "a wrong directory" in err, err
    assert not os.path.exists(tmp_path / "away" / ".rgt-receipt.json")
    Registry().put(rec)
    code, out, err = _rgt(capsys, "pull", RUN, "--from", "box", "--to", str(tmp_path / "dest"))
    assert code == 0, err

    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    text = "\n".join(shown)
    lost = text.split("will be lost")[1].split("\nkept:")[0]
    assert "checkpoint step_5.pt" in lost and "job log" not in lost, text
    assert "(it holds the job's logs, which the receipt has, and no sealed checkpoint)" in lost
    assert "the pulled files in" in text, text
    assert not os.path.exists(box.run_dir)
    assert os.path.isdir(box.store_root)


def test_a_store_that_holds_no_trace_of_the_run_is_not_said_to_have_nothing_sealed(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The box's agent writes to s3://B/a (its epoch is there, nothing sealed); the laptop's
    record names s3://B/b (a typo, or a store that differs between box and laptop). Before:
    `rgt pull N` said nothing was sealed (exit 0), wrote a receipt, and `rgt down N` took it,
    the box's checkpoints with it. Now the pull stops (exit 8, no receipt), naming the store
    and the run, and down refuses; with the run's own store the pull of nothing goes."""
    cli.env = s3_server.env(cli.env)
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    bucket = s3_server.bucket()
    box = Box(cli, tmp_path, store=f"s3://{bucket}/a")
    rec = box.record()
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "dest"))
    assert code == 0 and "nothing is sealed" in out, (code, out, err)

    wrong = dataclasses.replace(rec, store=f"s3://{bucket}/b")
    Registry().put(wrong)
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "wrong"))
    assert code == 8, (code, out, err)
    assert f"the store s3://{bucket}/b holds nothing of run {RUN}" in err, err
    assert "wrong bucket" in err and "--from box" not in err, err
    assert not os.path.exists(tmp_path / "wrong" / ".rgt-receipt.json")
    # The receipt of the pull from the run's own store does not let down go on the wrong one.
    with pytest.raises(UnsafeRefused) as e:
        plan_down(wrong, open_remote(wrong.target))
    assert f"s3://{bucket}/b holds nothing of run {RUN}" in e.value.what, e.value.what
    box.intact()


def test_a_receipt_of_nothing_sealed_does_not_hide_the_logs_sealed_as_the_run_ended(
    cli: Cli, tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pulled while nothing was sealed (the receipt says so), then the run stopped before any
    checkpoint: its agent sealed the job's log with ENDED.json. Down still goes on that receipt
    (the log is in a store that outlives the box, not a sealed checkpoint the pull missed),
    and its plan says the store holds the log. Before: its first line said "nothing is sealed
    now: no file of the run is in a pull or in the store" above the kept line of that log. A
    pull now brings the log, and down goes on its receipt too."""
    box = Box(cli, tmp_path)
    rec = box.record()
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "dest"))
    assert code == 0 and "nothing is sealed" in out, (code, out, err)
    assert "goes only while no checkpoint nor DONE.json is sealed" in out, out
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "STOPPED" and not s["agent"]["alive"],
        what="STOPPED and the agent gone",
    )
    assert os.path.exists(os.path.join(box.store_root, RUN, "ENDED.json"))
    assert box.latest() is None
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    head = text.splitlines()[1]
    assert "no file of the run is in a pull or in the store" not in head, text
    held = "the store holds the job's log of 1 attempt (sealed as its agent let go of the run)"
    assert held in head, text
    assert f"rgt pull {RUN} brings it" in head, text
    assert f"job log of attempt 1: sealed in the store {box.store}" in text, text

    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "again"))
    assert code == 0 and "the job's logs only (ENDED.json" in out, (code, out, err)
    with open(tmp_path / "again" / ".rgt-receipt.json") as f:
        doc = json.load(f)
    assert [x["path"] for x in doc["files"]] == ["logs/e1/attempt-0001.log"], doc
    assert doc["sealed"]["ended_sha256"] and doc["sealed"]["step"] is None, doc
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    assert "job log" not in "\n".join(shown).split("will be lost")[1].split("\nkept:")[0]
    assert not os.path.exists(box.run_dir)


def test_a_store_the_meter_stop_deletes_is_not_said_to_hold_nothing_when_it_holds_ended_logs(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file:// store on a pod's volume disk (the terminate deletes it), pulled while nothing
    was sealed; then the run stopped before any checkpoint and its agent sealed the job's log
    there with ENDED.json. Before: down's plan said the store, lost with the pod, "holds nothing
    sealed of the run" (the receipt's word, not the store's). Now it reads the store and says
    that it holds the job's logs, which the receipt does not have. With ENDED.json damaged,
    no plan is made that could call the store empty on its word: down refuses. Before, it said
    only "rgt: r1/ENDED.json is not valid JSON"; now it says that down did nothing, that it
    could not read the document, in which store, and what to do."""
    box = Box(cli, tmp_path)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles))
    _pod_profile(str(profiles), os.path.dirname(box.store_root), network_volume=False)
    rec = dataclasses.replace(box.record(), profile="pod")
    Registry().put(rec)
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "dest"))
    assert code == 0 and "nothing is sealed" in out, (code, out, err)

    def store_line() -> str:
        text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
        lost = text.split("will be lost")[1].split("\nbilling:")[0]
        [line] = [x for x in lost.splitlines() if x.startswith(f"  the store {box.store} (")]
        assert "the provider deletes it at the meter-stop (terminate)" in line, text
        return line

    assert "the job's logs" not in store_line()  # nothing sealed yet, logs included
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "STOPPED" and not s["agent"]["alive"],
        what="STOPPED and the agent gone",
    )
    assert os.path.exists(os.path.join(box.store_root, RUN, "ENDED.json"))
    assert box.latest() is None
    line = store_line()
    assert "nothing sealed" not in line and "nor job log" not in line, line
    assert "the job's logs" in line and "the receipt does not have" in line, line

    with open(os.path.join(box.store_root, RUN, "ENDED.json"), "wb") as f:
        f.write(b'{"files": [tru')  # torn or damaged: no log it lists can be known
    with pytest.raises(IntegrityError, match=f"{RUN}/ENDED.json is not valid JSON"):
        plan_down(rec, open_remote(rec.target))
    code, out, err = _rgt(capsys, "down", RUN, "--yes")
    assert code == IntegrityError.exit_code and not out, (code, out, err)
    said = f"run {RUN}: rgt down did nothing: the run's sealed state in the store {box.store}"
    assert said in err and f"cannot be read: {RUN}/ENDED.json is not valid JSON" in err, err
    assert f"look at the document it names in the store {box.store}" in err, err
    assert os.path.exists(os.path.join(box.store_root, RUN, "ENDED.json"))
    assert Registry().get(RUN).down_at is None


def test_the_plan_for_a_live_run_pulled_with_nothing_sealed_says_its_stop_seals_the_log(
    cli: Cli, tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live run pulled while nothing was sealed: down stops it first, and the stop seals the
    job's log into the store (ENDED.json), which a kept line says. Before: the plan's first line
    said "nothing is sealed now: no file of the run is in a pull or in the store" above that
    kept line; now it says no checkpoint is sealed now and the stop seals the job's log."""
    box = Box(cli, tmp_path)
    rec = box.record()
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "dest"))
    assert code == 0 and "nothing is sealed" in out, (code, out, err)
    lines = plan_down(rec, open_remote(rec.target)).lines()
    text = "\n".join(lines)
    kept = text.split("\nkept:")[1].split("\nbilling:")[0]
    assert f"job log of attempt 1: the stop seals it into the store {box.store}" in kept, text
    head = lines[1]
    assert "nothing is sealed now" not in head and "no file of the run" not in head, head
    assert "no checkpoint is sealed now" in head, head
    assert "the stop seals the job's log into the store (ENDED.json)" in head, head
    box.intact()
