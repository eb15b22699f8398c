"""The job's logs of a box that is preempted reach the store, and no box's logs replace another's.

Before, a run that ended PREEMPTED sealed no log: the preempted box's attempt log died with the
box while the run went on elsewhere. And a newer box (a new epoch, its attempts numbered from 1
again) sealed its log under the older box's key (``logs/attempt-0001.log``): the older box's
log was gone, and a pull that had read the older document failed its sha256 check (exit 6).
Now the agent seals the logs within what is left of the grace after the final checkpoint, each
agent under its own epoch (``logs/e<epoch>/``) with its own log document
(``logs/e<epoch>.json``), and `rgt pull` brings every box's. Real agents (one RGT_HOME per
box), a real SIGTERM with a grace, real stores (a directory; SeaweedFS), real `rgt pull`
processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from typing import Any, Dict, Iterator, List

import pytest

from controller.registry import Registry
from controller.remote import SshRemote, open_remote
from controller.results.down import plan_down
from tests.conftest import Cli, _kill_run_processes
from tests.integration.test_pull import RUN, _read, _rec, _ssh_target
from tests.integration.test_sealing_s3 import _keys
from tests.laptop import laptop_env, run_rgt
from tests.polling import wait
from tests.seaweed import SeaweedServer
from tests.sshd import SshServer

# A box's job: its log says which box it ran on. "fail" exits 3 at once, "ok" 0; "run" writes
# step_1.pt (unless a restore put it back) and waits to be preempted.
JOB = """\
import os, sys, time
who, how = sys.argv[1], sys.argv[2]
print(f"box {who}: step 1 loss 2.5", flush=True)
if how == "fail":
    print(f"box {who}: RuntimeError: CUDA error", file=sys.stderr, flush=True)
    sys.exit(3)
if how == "ok":
    print(f"box {who}: done", flush=True)
    sys.exit(0)
d = os.environ["RGT_CKPT_DIR"]
os.makedirs(d, exist_ok=True)
if not os.path.exists(os.path.join(d, "step_1.pt")):
    with open(os.path.join(d, "step_1.pt.tmp"), "wb") as f:
        f.write(b"weights of step 1" * 100)
    os.replace(os.path.join(d, "step_1.pt.tmp"), os.path.join(d, "step_1.pt"))
print(f"box {who}: ready", flush=True)
while True:
    time.sleep(3600)
"""
GRACE = "5"  # the agent keeps 1 s of it for its exit; the logs take a fraction of the rest


@pytest.fixture
def other_box(tmp_path: Any, cli: Cli) -> Iterator[Cli]:
    """A second box: an RGT_HOME of its own (a fresh disk), its processes killed by PID after."""
    home = str(tmp_path / "box-b")
    os.makedirs(home)
    box = Cli(home, dict(cli.env, RGT_HOME=home))
    try:
        yield box
    finally:
        _kill_run_processes(home)


def _start(box: Cli, tmp_path: Any, store: str, who: str, how: str, grace: str = GRACE) -> None:
    """``box`` runs JOB as run RUN with ``store``, ``grace``, no restart on an error."""
    job_py = tmp_path / "job.py"
    job_py.write_text(JOB)
    job = tmp_path / f"job-{who}.toml"
    job.write_text(
        f"command = {json.dumps([sys.executable, str(job_py), who, how])}\n"
        f'store = "{store}"\n[restart]\nmax_error_restarts = 0\n'
        # "run" waits to be preempted: RUNNING (what _preempted waits for) 1 s after the
        # start, not 5. The others exit at once, judged against the default grace as before.
        + ('start_grace = "1s"\n' if how == "run" else "")
    )
    box("start", str(job), "--name", RUN, "--grace", grace, check=True, cwd=box.home)


def _preempted(
    box: Cli, tmp_path: Any, store: str, who: str, latest: Any, grace: str = GRACE
) -> None:
    """``box`` runs JOB until step 1 is sealed (``latest()`` says), then takes a real SIGTERM
    (the platform's preemption) and ends PREEMPTED, its agent gone."""
    _start(box, tmp_path, store, who, "run", grace)
    box.wait_state(RUN, "RUNNING")
    box.wait_output(RUN, f"box {who}: ready")
    wait(lambda: latest() == 1, 60, "step 1 sealed")
    os.kill(box.status(RUN)["agent"]["pid"], signal.SIGTERM)
    over = box.wait_over(RUN, "PREEMPTED", "STOPPED", "FAILED", timeout=60)
    assert over["state"] == "PREEMPTED", over


def _failed(box: Cli, tmp_path: Any, store: str, who: str) -> None:
    _start(box, tmp_path, store, who, "fail")
    box.wait_over(RUN, "FAILED", "STOPPED", "PREEMPTED", timeout=120)


def _file_latest(root: str) -> Any:
    try:
        with open(os.path.join(root, RUN, "LATEST.json")) as f:
            return json.load(f)["step"]
    except FileNotFoundError:
        return None


def _store_root(tmp_path: Any) -> str:
    root = str(tmp_path / "store")
    os.makedirs(root)
    return root


def _pull(laptop: str, box: Cli, dest: Any, *more: str) -> Any:
    """`rgt pull RUN --to DEST` as a user runs it."""
    env = laptop_env(laptop, box.home)
    return run_rgt(["pull", RUN, "--to", str(dest), *more], env, str(dest.parent), timeout=300)


def _events(box: Cli, kind: str) -> List[Dict[str, Any]]:
    return [e for e in box.events(RUN) if e["kind"] == kind]


def test_a_preempted_boxs_log_is_sealed_in_its_grace_and_pulled_after_the_box_is_gone(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Before: the run ended PREEMPTED with its checkpoint sealed and no log in the store;
    the box gone, `rgt pull` brought the checkpoint alone."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _preempted(cli, tmp_path, store, "A", lambda: _file_latest(root))
    sealed = _events(cli, "logs_sealed")
    assert sealed and sealed[-1]["state"] == "PREEMPTED", cli.events(RUN)
    assert not _events(cli, "seal_error") and not _events(cli, "logs_not_sealed")
    with open(os.path.join(root, RUN, "logs", "e1.json")) as f:
        doc = json.load(f)
    assert doc["epoch"] == 1 and doc["state"] == "PREEMPTED", doc
    assert [x["path"] for x in doc["files"]] == ["e1/attempt-0001.log"], doc
    assert not os.path.exists(os.path.join(root, RUN, "ENDED.json"))  # the run goes on

    Registry().put(_rec(store, cli.home))
    shutil.rmtree(os.path.join(cli.home, "runs", RUN))  # the box is gone
    dest = tmp_path / "dest"
    p = _pull(laptop, cli, dest)
    assert p.returncode == 0, (p.stdout, p.stderr)
    log = _read(str(dest / "logs" / "e1" / "attempt-0001.log"))
    assert b"box A: step 1 loss 2.5" in log and b"box A: ready" in log, log
    assert _read(str(dest / "checkpoints" / "step_1.pt")) == b"weights of step 1" * 100
    with open(dest / ".rgt-receipt.json") as f:
        receipt = json.load(f)
    assert receipt["sealed"]["step"] == 1 and receipt["sealed"]["logs_sha256"], receipt


def test_a_newer_boxs_logs_never_replace_an_older_boxs_and_every_box_is_pulled(
    cli: Cli, other_box: Cli, tmp_path: Any, laptop: str
) -> None:
    """Box A fails, then box B (a new epoch, its attempt numbered 1 again) fails too. Before:
    B's log replaced A's ``logs/attempt-0001.log``, and a pull that had read A's ENDED.json
    (put back here: the window between a pull's read and its fetch) failed with exit 6, its
    sha256 A's, the bytes B's; pulling again brought B's log alone. Now both logs keep their
    own keys, that pull succeeds, and every pull brings both."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    with open(os.path.join(root, RUN, "ENDED.json"), "rb") as f:
        ended_a = f.read()
    _failed(other_box, tmp_path, store, "B")
    Registry().put(_rec(store, other_box.home))

    with open(os.path.join(root, RUN, "ENDED.json"), "wb") as f:
        f.write(ended_a)  # the document a pull read before B sealed
    dest = tmp_path / "in-the-window"
    p = _pull(laptop, other_box, dest)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert b"box A: RuntimeError" in _read(str(dest / "logs" / "e1" / "attempt-0001.log"))

    later = tmp_path / "later"
    p = _pull(laptop, other_box, later)
    assert p.returncode == 0, (p.stdout, p.stderr)
    a = _read(str(later / "logs" / "e1" / "attempt-0001.log"))
    b = _read(str(later / "logs" / "e2" / "attempt-0001.log"))
    assert b"box A: RuntimeError" in a and b"box B" not in a, a
    assert b"box B: RuntimeError" in b and b"box A" not in b, b


def test_a_preempted_box_then_one_that_succeeds_are_both_pulled(
    cli: Cli, other_box: Cli, tmp_path: Any, laptop: str
) -> None:
    """Box A is preempted, box B restores step 1 and succeeds (DONE.json lists its logs): the
    pull brings the checkpoint, B's log from DONE.json and A's from its log document."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _preempted(cli, tmp_path, store, "A", lambda: _file_latest(root))
    _start(other_box, tmp_path, store, "B", "ok")
    other_box.wait_over(RUN, "SUCCEEDED", "FAILED", "STOPPED", timeout=120)
    with open(os.path.join(root, RUN, "DONE.json")) as f:
        done = json.load(f)
    assert [x["path"] for x in done["files"]] == ["e2/attempt-0001.log"], done
    Registry().put(_rec(store, other_box.home))
    dest = tmp_path / "dest"
    p = _pull(laptop, other_box, dest)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert b"box A: ready" in _read(str(dest / "logs" / "e1" / "attempt-0001.log"))
    assert b"box B: done" in _read(str(dest / "logs" / "e2" / "attempt-0001.log"))
    assert os.path.exists(dest / "checkpoints" / "step_1.pt")


def test_an_older_agents_ended_json_is_pulled_beside_a_newer_boxs_logs(
    cli: Cli, other_box: Cli, tmp_path: Any, laptop: str
) -> None:
    """A store an agent from before epochs named the logs wrote to (box A's failed run, its
    log at ``logs/attempt-0001.log`` and ENDED.json naming it, no log document: made so here
    from what the agent sealed), then box B preempted: the pull reads both, A's log under its
    old name."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    run = os.path.join(root, RUN)
    os.rename(os.path.join(run, "logs", "e1", "attempt-0001.log"), os.path.join(run, "x.log"))
    shutil.rmtree(os.path.join(run, "logs"))
    os.mkdir(os.path.join(run, "logs"))
    os.rename(os.path.join(run, "x.log"), os.path.join(run, "logs", "attempt-0001.log"))
    with open(os.path.join(run, "ENDED.json")) as f:
        ended = json.load(f)
    for entry in ended["files"]:
        entry["path"], entry["key"] = "attempt-0001.log", f"{RUN}/logs/attempt-0001.log"
    with open(os.path.join(run, "ENDED.json"), "w") as f:
        json.dump(ended, f)

    _preempted(other_box, tmp_path, store, "B", lambda: _file_latest(root))
    Registry().put(_rec(store, other_box.home))
    dest = tmp_path / "dest"
    p = _pull(laptop, other_box, dest)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert b"box A: RuntimeError" in _read(str(dest / "logs" / "attempt-0001.log"))
    assert b"box B: ready" in _read(str(dest / "logs" / "e2" / "attempt-0001.log"))


def test_a_preempted_box_then_a_failed_one_are_both_pulled_from_the_box(
    cli: Cli, other_box: Cli, tmp_path: Any, laptop: str, sshd: SshServer
) -> None:
    """Box A is preempted (its log sealed in its grace), box B restores step 1 and fails.
    `rgt pull --from box` reads the file:// store on the box over ssh: A's log, B's log and
    the checkpoint come; down's plan calls none of B's logs lost."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _preempted(cli, tmp_path, store, "A", lambda: _file_latest(root))
    _failed(other_box, tmp_path, store, "B")
    target = _ssh_target(sshd)
    try:
        rec = _rec(store, other_box.home, target)
        Registry().put(rec)
        dest = tmp_path / "dest"
        p = _pull(laptop, other_box, dest, "--from", "box")
        assert p.returncode == 0, (p.stdout, p.stderr)
        assert b"box A: ready" in _read(str(dest / "logs" / "e1" / "attempt-0001.log"))
        assert b"box B: RuntimeError" in _read(str(dest / "logs" / "e2" / "attempt-0001.log"))
        assert os.path.exists(dest / "checkpoints" / "step_1.pt")
        for home in (other_box.home, cli.home):  # each box's log, by the epoch it sealed it as
            rec = _rec(store, home, target)
            Registry().put(rec)
            text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
            lost = (
                text.split("will be lost")[1].split("\nkept:")[0] if "will be lost" in text else ""
            )
            assert "job log" not in lost, text
    finally:
        SshRemote(target).close()


def test_a_failed_log_seal_at_a_preemption_is_said_and_the_run_still_ends_preempted(
    cli: Cli, tmp_path: Any
) -> None:
    """The store refuses the logs (``logs`` there is a file, not a directory): a seal_error
    event says so, and the agent lets go of the run PREEMPTED within its grace."""
    root = _store_root(tmp_path)
    store = f"file://{root}"

    def latest() -> Any:
        step = _file_latest(root)
        if step == 1 and not os.path.exists(os.path.join(root, RUN, "logs")):
            with open(os.path.join(root, RUN, "logs"), "w") as f:
                f.write("not a directory\n")
        return step

    _preempted(cli, tmp_path, store, "A", latest)
    errors = _events(cli, "seal_error")
    assert errors and "the job's logs stay on this box" in errors[-1]["remedy"], errors
    assert not _events(cli, "logs_sealed")


def test_a_preemption_with_no_grace_says_the_logs_are_not_sealed(cli: Cli, tmp_path: Any) -> None:
    """A grace of 0 (vast.ai's): nothing is left for the logs; ``logs_not_sealed`` says so and
    where they are, and no log document claims them. The store's state says PREEMPTED."""
    root = _store_root(tmp_path)
    _preempted(cli, tmp_path, f"file://{root}", "A", lambda: _file_latest(root), grace="0")
    [ev] = _events(cli, "logs_not_sealed")
    assert "stay on this box's disk" in ev["reason"] and "--grace" in ev["remedy"], ev
    assert not _events(cli, "logs_sealed")
    assert not os.path.exists(os.path.join(root, RUN, "logs", "e1.json"))
    # The store's copy of the run's state is the final one all the same: its mirror, a moment
    # past a grace of 0, when the box is gone is what `rgt status` reads (before: RUNNING).
    with open(os.path.join(root, RUN, "state", "state.json")) as f:
        assert json.load(f)["state"] == "PREEMPTED"


def test_a_log_seal_that_hangs_past_the_grace_is_said_and_the_agent_lets_go_in_time(
    cli: Cli, tmp_path: Any
) -> None:
    """The store's upload of the logs hangs (as on a mount whose server stopped: a hold point
    that lasts 120 s, released here only while step 1 is sealed): the agent ends the run
    PREEMPTED and exits within the test's 60 s wait, a seal_error event says the logs were
    still being sealed when the grace ended, and no log document claims them."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    release = tmp_path / "uploads-go-on"
    release.write_text("")
    cli.env.update(RGT_HOLD_AT="store.put_file", RGT_HOLD_UNTIL=str(release))

    def latest() -> Any:
        step = _file_latest(root)
        if step == 1 and release.exists():
            release.unlink()  # from here on an upload of a file hangs
        return step

    _preempted(cli, tmp_path, store, "A", latest)
    errors = _events(cli, "seal_error")
    assert errors and "still being sealed when the grace ended" in errors[-1]["reason"], errors
    assert not _events(cli, "logs_sealed")
    assert not os.path.exists(os.path.join(root, RUN, "logs", "e1.json"))


@pytest.mark.parametrize(
    "how, needle",
    [
        ("other-epoch", "not a job's log"),
        ("old-name", "not a job's log"),
        ("key-elsewhere", "not a job's log"),
        ("path-escapes", "'..'"),
        ("epoch-lies", "says it is of another epoch"),
        ("files-not-a-list", "lists no files"),
        ("not-json", "not valid JSON"),
    ],
)
def test_a_hostile_log_document_is_refused_before_dest_exists(
    cli: Cli, tmp_path: Any, laptop: str, how: str, needle: str
) -> None:
    """``logs/e<epoch>.json`` is the store's, so untrusted: an entry that is not a log of that
    very epoch as the agent seals it stops `rgt pull` (exit 6) before DEST is made."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    os.unlink(os.path.join(root, RUN, "ENDED.json"))  # the log document alone names the log
    path = os.path.join(root, RUN, "logs", "e1.json")
    with open(path) as f:
        doc = json.load(f)
    entry = doc["files"][0]
    if how == "other-epoch":
        entry["path"], entry["key"] = "e2/attempt-0001.log", f"{RUN}/logs/e2/attempt-0001.log"
    elif how == "old-name":
        entry["path"], entry["key"] = "attempt-0001.log", f"{RUN}/logs/attempt-0001.log"
    elif how == "key-elsewhere":
        entry["key"] = f"{RUN}/checkpoints/1/model.pt"
    elif how == "path-escapes":
        entry["path"], entry["key"] = "../../x.log", f"{RUN}/logs/../../x.log"
    elif how == "epoch-lies":
        doc["epoch"] = 2
    elif how == "files-not-a-list":
        doc["files"] = {"a": entry}
    with open(path, "wb") as f:
        f.write(b'{"files": [' if how == "not-json" else json.dumps(doc).encode())
    Registry().put(_rec(store, cli.home))
    dest = tmp_path / "dest"
    p = _pull(laptop, cli, dest)
    assert p.returncode == 6 and needle in p.stderr, (p.returncode, p.stderr)
    assert not dest.exists()


def test_a_preempted_boxs_log_lands_in_the_bucket_and_is_pulled(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on an S3 store (SeaweedFS): the preempted box's log and its log document are
    in the bucket, and `rgt pull` brings the log with the checkpoint."""
    cli.env.update(s3_server.env(cli.env))
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    url = f"s3://{s3_server.bucket()}/rgt"

    def latest() -> Any:
        return 1 if f"{RUN}/LATEST.json" in _keys(s3_server, url) else None

    _preempted(cli, tmp_path, url, "A", latest)
    keys = _keys(s3_server, url)
    assert f"{RUN}/logs/e1.json" in keys and f"{RUN}/logs/e1/attempt-0001.log" in keys, keys
    Registry().put(_rec(url, cli.home))
    dest = tmp_path / "dest"
    p = _pull(laptop, cli, dest, "--from", "store")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert b"box A: ready" in _read(str(dest / "logs" / "e1" / "attempt-0001.log"))
    assert os.path.exists(dest / "checkpoints" / "step_1.pt")
