"""The job's log of a store-backed run that FAILED or was STOPPED outlives its box.

Before, the store got the logs only with DONE.json (a run that succeeded): `rgt pull N` of a
failed run brought its checkpoints (or nothing) and no log, and `rgt down N` listed the log as
lost. Now the agent seals each attempt's log (a redacted copy where it holds a secret) and
ENDED.json as it lets go of a run that ended FAILED or STOPPED; the pull brings them, from the
store after the box is gone too, and down's plan no longer lists them as lost. A real agent, a
real file:// store, a real sshd on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, List

import pytest

from controller.registry import Registry
from controller.remote import SshRemote, open_remote
from controller.results.down import down, plan_down
from controller.results.pull import covers_newest, pull
from controller.target import Target
from onbox.common.errors import IntegrityError
from tests.conftest import Cli
from tests.integration.test_down import Box
from tests.integration.test_down_unsealed import _rgt
from tests.integration.test_pull import RUN, _read, _rec, _ssh_target
from tests.sshd import SshServer

# A job that fails before any checkpoint, its log holding what the user needs (the error) and
# a key id (a token shape the redactor masks).
_FAIL = (
    "import sys\n"
    "print('step 1 loss 2.5', flush=True)\n"
    "print('key ' + 'AKIA' + 'ABCDEFGHIJKLMNOP', flush=True)\n"
    "print('RuntimeError: CUDA error: an illegal memory access', file=sys.stderr, flush=True)\n"
    "sys.exit(3)\n"
)


def _failed_run(cli: Cli, tmp_path: Any) -> str:
    """A run whose job failed (no restart), its agent gone; the store's URL."""
    root = tmp_path / "store"
    root.mkdir()
    (tmp_path / "fail.py").write_text(_FAIL)
    job = tmp_path / "job.toml"
    job.write_text(
        f"command = {json.dumps([sys.executable, str(tmp_path / 'fail.py')])}\n"
        f'store = "file://{root}"\n[restart]\nmax_error_restarts = 0\n'
    )
    cli("start", str(job), "--name", RUN, check=True)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "FAILED" and not s["agent"]["alive"],
        timeout=120,
        what="FAILED and the agent gone",
    )
    return f"file://{root}"


def test_the_log_of_a_failed_run_is_pulled_from_the_store_after_its_box_is_gone(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Before: the pull said nothing was sealed and brought no log; with the run's directory
    gone (the box taken down) the log was nowhere."""
    store = _failed_run(cli, tmp_path)
    rec = _rec(store, cli.home)
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert not receipt.sealed.nothing
    files = {f.path: f for f in receipt.files}
    assert set(files) == {"logs/e1/attempt-0001.log"}, files
    assert files["logs/e1/attempt-0001.log"].redacted
    log = _read(str(tmp_path / "dest" / "logs" / "e1" / "attempt-0001.log"))
    assert b"CUDA error: an illegal memory access" in log and b"step 1 loss" in log, log
    assert b"AKIAABCDEFGHIJKLMNOP" not in log, log
    assert covers_newest(rec, receipt)
    # The box's log is unaltered; the box gone, the store still gives the log.
    run_dir = os.path.join(cli.home, "runs", RUN)
    with open(os.path.join(run_dir, "attempts", "0001", "output.log"), "rb") as f:
        assert b"AKIAABCDEFGHIJKLMNOP" in f.read()
    shutil.rmtree(run_dir)
    again = pull(rec, str(tmp_path / "later"), "store")
    assert _read(str(tmp_path / "later" / "logs" / "e1" / "attempt-0001.log")) == log
    assert again.sealed == receipt.sealed
    kinds = [e["kind"] for e in _events(store, RUN)]
    assert "logs_sealed" in kinds and "done" not in kinds, kinds


@pytest.mark.parametrize(
    "how, needle",
    [
        ("key-elsewhere", "not a job's log"),
        ("other-epoch", "not a job's log"),
        ("path-escapes", "'..'"),
        ("not-a-log", "not a job's log"),
        ("with-root", "not a job's log"),
        ("files-not-a-list", "lists no files"),
        ("not-json", "not valid JSON"),
    ],
)
def test_a_hostile_ended_json_is_refused_before_anything_is_created(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    capsys: pytest.CaptureFixture[str],
    how: str,
    needle: str,
) -> None:
    """ENDED.json is the store's, so untrusted: a log entry that is not a job's log as the
    agent seals it (another key, a path out of logs/, a result's root) stops the pull with
    an IntegrityError (exit 6) naming it, the store and what to do, before DEST exists."""
    store = _failed_run(cli, tmp_path)
    path = os.path.join(store[len("file://") :], RUN, "ENDED.json")
    with open(path) as f:
        doc = json.load(f)
    entry = doc["files"][0]
    if how == "key-elsewhere":
        entry["key"] = f"{RUN}/checkpoints/1/model.pt"
    elif how == "other-epoch":  # a log of another box: never one this document's agent sealed
        entry["path"], entry["key"] = "e2/attempt-0001.log", f"{RUN}/logs/e2/attempt-0001.log"
    elif how == "path-escapes":
        entry["path"] = "../../x.log"
        entry["key"] = f"{RUN}/logs/../../x.log"
    elif how == "not-a-log":
        entry["path"], entry["key"] = "model.pt", f"{RUN}/logs/model.pt"
    elif how == "with-root":
        entry["root"] = "ckpt"
    elif how == "files-not-a-list":
        doc["files"] = {"a": entry}
    raw = b'{"files": [' if how == "not-json" else json.dumps(doc).encode()
    with open(path, "wb") as f:
        f.write(raw)
    dest = tmp_path / "dest"
    rec = _rec(store, cli.home)
    with pytest.raises(IntegrityError) as e:
        pull(rec, str(dest), "store")
    assert needle in e.value.what, e.value.what
    assert not dest.exists()
    # What, why and what to do: before, the document's own error alone ("rgt: r1/ENDED.json
    # is not valid JSON"), with no remedy, naming neither the pull nor the store.
    said = f"run {RUN}: rgt pull did nothing: the run's sealed state in the store {store}"
    assert e.value.what.startswith(said + " cannot be read: "), e.value.what
    remedy = e.value.remedy or ""
    assert "damaged" in remedy, remedy  # the document's own remedy where it has one
    assert remedy.endswith("pull creates nothing while it cannot be read"), remedy
    Registry().put(rec)
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(dest), "--from", "store")
    assert code == IntegrityError.exit_code and not out, (code, out, err)
    assert said in err and needle in err and "pull creates nothing" in err, err
    assert not dest.exists()


def _events(store: str, run: str) -> List[Any]:
    """The events the agent mirrored to the store."""
    path = os.path.join(store[len("file://") :], run, "state", "events.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def ssh_box(sshd: SshServer, laptop: str) -> Any:
    target = _ssh_target(sshd)
    yield target
    SshRemote(target).close()


def _never(prompt: str) -> str:
    raise AssertionError(f"down asked {prompt!r} before it should have")


def test_the_log_of_a_stopped_run_is_pulled_and_down_does_not_call_it_lost(
    cli: Cli, tmp_path: Any, ssh_box: Target
) -> None:
    """A run stopped after a sealed checkpoint, pulled from the box (its file:// store read
    there): the checkpoint and the log come; down's plan lists no job log as lost."""
    box = Box(cli, tmp_path)
    box.checkpoint(1)
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "STOPPED" and not s["agent"]["alive"],
        what="STOPPED and the agent gone",
    )
    rec = box.record(ssh_box)
    receipt = pull(rec, str(tmp_path / "dest"), "box")
    paths = {f.path for f in receipt.files}
    assert "logs/e1/attempt-0001.log" in paths, paths
    assert any(p.startswith("checkpoints/") for p in paths), paths
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    text = "\n".join(shown)
    lost = text.split("will be lost")[1].split("\nkept:")[0] if "will be lost" in text else ""
    assert "job log" not in lost, text
    assert not os.path.exists(box.run_dir)
    assert os.path.exists(os.path.join(box.store_root, RUN, "ENDED.json"))


def test_a_log_sealed_after_the_pull_is_kept_in_the_store_in_downs_plan(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Pulled while it ran, then stopped (its agent sealed the log with ENDED.json): the
    receipt still covers the run (the logs are in a store that outlives the box), and down's
    plan lists the log as kept there, not lost. Before: "job log of attempt 1" was lost."""
    box = Box(cli, tmp_path)
    box.checkpoint(1)
    rec = box.record()
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert "logs/e1/attempt-0001.log" not in {f.path for f in receipt.files}
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "STOPPED" and not s["agent"]["alive"],
        what="STOPPED and the agent gone",
    )
    assert covers_newest(rec, receipt)
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = text.split("will be lost")[1].split("\nkept:")[0]
    assert "job log" not in lost, text
    assert f"job log of attempt 1: sealed in the store {box.store}" in text, text
