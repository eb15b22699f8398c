"""The release a deploy pushed for a start that failed goes from the box again when nothing uses
it: a redeploy of changed code whose start the box failed (the run's epoch cannot be taken)
left ``releases/<new id>`` there, which neither the laptop's record nor ``deploys/N/current``
named and no `rgt down` removed, so failed redeploys filled the box's disk. A release that was
on the box before the deploy (another run's) is kept, and so is one that a deploy's current link
or another run's spec names, or the run's own spec, whatever the run's state: its start claimed
it before it failed, and starting the run's spec again runs there (``rgt_release_drop``,
controller/shell/release_use.sh, run here as the start runs it: sh on its own). So does a
deploy that fails after its push and before its start: its secrets' staging or its profile
override failing, or the run live on another release (the live run keeps its release, and runs
on).

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from controller.deploy.leftrelease import Left, line
from controller.deploy.release import PushResult
from controller.remote import SshRemote
from controller.shell import script
from controller.target import parse_target
from onbox.common.durable import write_json
from onbox.common.errors import HostError
from tests.conftest import _kill_run_processes
from tests.integration.test_deploy_unbegun import _block_epochs
from tests.integration.test_refused_secrets import Laptop
from tests.laptop import ssh_target
from tests.sshd import SshServer

JOB = ("--", sys.executable, "job.py")


def _releases(lap: Laptop) -> List[str]:
    """The complete releases on the box (not a push's temporary directory)."""
    d = lap.box / "releases"
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def _current(lap: Laptop, name: str) -> str:
    return os.path.basename(os.readlink(lap.box / "deploys" / name / "current"))


def test_a_failed_start_of_changed_code_removes_the_release_no_run_names(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    (lap.project / "job.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    try:
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        rc, out = lap.rgt("stop", "held")
        assert rc == 0, out
        first = _releases(lap)
        assert len(first) == 1 and _current(lap, "held") == first[0], first
        # The code changed, and a new run's epoch cannot be taken: its start fails, and leaves
        # nothing of the run on the box, nor the release it pushed.
        (lap.project / "job.py").write_text("print('changed')\n")
        _block_epochs(store, "fresh")
        rc, out = lap.deploy("fresh", "--store", f"file://{store}", *JOB)
        assert rc == 14 and "run fresh could not begin" in out, out  # the box's error
        assert _releases(lap) == first, "the failed start's release stayed on the box"
        assert "was removed from the box again: the start failed" in out, out
        # The store fails the start of "held" too (its epochs/ is in the way), then comes back
        # as it was (a pull says "nothing sealed" only of a store holding the run's epoch). Its
        # start claimed the run before it failed: the run's spec names the release, kept.
        os.rename(store / "held" / "epochs", tmp_path / "epochs-aside")
        blocker = _block_epochs(store, "held")
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 14 and "epochs/00000001: not a directory" in out, out  # the box's error
        assert "is kept on the box: run held's spec there names it" in out, out
        kept = _releases(lap)
        assert len(kept) == 2 and _current(lap, "held") == first[0], kept
        # Another run deployed with the changed code: its release is the one this deploy
        # pushes, which was on the box before it, so it stays when the start fails.
        rc, out = lap.deploy("other", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        both = _releases(lap)
        assert both == kept and _current(lap, "other") in both, both
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 14 and "epochs/00000001: not a directory" in out, out
        assert "is kept on the box: it was there before this deploy" in out, out
        assert _releases(lap) == both
        # Once the store answers, the same deploy starts the run in that release.
        blocker.unlink()
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        assert _current(lap, "held") == _current(lap, "other")
    finally:
        _kill_run_processes(str(lap.box))


@pytest.mark.parametrize("step", ["secrets", "override"])
def test_a_deploy_that_fails_before_its_start_removes_the_release_it_pushed(
    sshd: SshServer, tmp_path: Path, step: str
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    # A user override of the profile, which each deploy puts on the box before the start.
    (lap.ctl / "profiles").mkdir()
    (lap.ctl / "profiles" / "generic-ssh.toml").write_text('[reach]\nnote = "this test\'s"\n')
    (lap.project / "job.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    profile = ("--profile", "generic-ssh", "--store", f"file://{store}")
    try:
        rc, out = lap.deploy("held", *profile, *JOB)
        assert rc == 0, out
        rc, out = lap.rgt("stop", "held")
        assert rc == 0, out
        first = _releases(lap)
        assert len(first) == 1 and _current(lap, "held") == first[0], first
        # The code changed, and the step after the push cannot write on the box: a file is
        # where its directory goes.
        (lap.project / "job.py").write_text("print('changed')\n")
        blocked = lap.box / ("secrets" if step == "secrets" else "profiles")
        shutil.rmtree(blocked)
        blocked.write_text("in the way\n")
        rc, out = lap.deploy("held", *profile, *JOB)
        assert rc == 9, out
        said = "storing the secrets on the box failed" if step == "secrets" else "cannot write"
        assert said in out and "sent (" in out, out  # it failed after pushing the new code
        assert _releases(lap) == first, "the failed deploy's release stayed on the box"
        assert "was removed from the box again: the deploy failed before its start" in out, out
        assert _current(lap, "held") == first[0]
        # The run is as it was: the same deploy starts it once the box takes the step.
        blocked.unlink()
        rc, out = lap.deploy("held", *profile, *JOB)
        assert rc == 0, out
        now = _current(lap, "held")
        # The release it ran in before goes once the link moved on (nothing names it).
        assert now not in first and _releases(lap) == [now]
    finally:
        _kill_run_processes(str(lap.box))


def test_a_deploy_refused_as_the_run_is_live_on_another_release_removes_its_release(
    sshd: SshServer, tmp_path: Path
) -> None:
    """Deployed from another laptop, the run is live on its release; this laptop has no record
    of it, so its deploy of other code learns that only after the push, and is refused there."""
    other = Laptop(sshd, tmp_path)
    (tmp_path / "here").mkdir()
    lap = Laptop(sshd, tmp_path / "here")
    lap.box, lap.env["RGT_BOX_HOME"] = other.box, str(other.box)  # one box, two laptops
    (other.project / "job.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    (lap.project / "job.py").write_text("print('other code')\n")
    try:
        rc, out = other.deploy("live", *JOB)
        assert rc == 0 and "its first line: up" in out, out
        live = _releases(other)
        assert live == [_current(other, "live")], live
        rc, out = lap.deploy("live", *JOB)
        assert rc == 5 and f"with release {live[0]}" in out and "sent (" in out, out
        assert _releases(lap) == live, "the refused deploy's release stayed on the box"
        assert "was removed from the box again: the deploy failed before its start" in out, out
        # The run goes on, in its release.
        rc, out = other.rgt("status", "live", "--json")
        assert rc == 0 and json.loads(out)["state"] in ("STARTING", "RUNNING"), out
        assert _current(other, "live") == live[0]
    finally:
        _kill_run_processes(str(other.box))


def _left(
    remote: SshRemote,
    home: Path,
    said: List[str],
    method: str = "rsync",
    say: Optional[Callable[[str], None]] = None,
) -> Left:
    rid = "0123456789abcdef"
    pushed = PushResult(rid, str(home / "releases" / rid), 3, 9, method)
    return Left(remote, pushed, str(home), "early", say or said.append)


def test_a_ctrl_c_before_the_start_removes_the_release_and_stays_a_ctrl_c(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy interrupted between its push and its start: nothing runs in the release, which
    goes in one command (the ssh master outlives the person's ^C), then the ^C goes on."""
    monkeypatch.setenv("RGT_SSH_CONFIG", "/dev/null")
    home = tmp_path / "box"
    rel = _release(home, "0123456789abcdef")
    remote = SshRemote(parse_target(ssh_target(sshd)), home=str(tmp_path / "ctl"))
    said: List[str] = []
    try:
        kept = _left(remote, home, said, method="existing")  # on the box before: left alone
        with pytest.raises(KeyboardInterrupt), kept.until_start():
            raise KeyboardInterrupt
        # Said as a failed start says it (leftrelease.line), once.
        assert said == [line(kept.pushed, "early", None)] and rel.is_dir()
        assert said[0].endswith("is kept on the box: it was there before this deploy"), said
        kept.drop("once more")
        assert len(said) == 1
        said.clear()
        left = _left(remote, home, said)
        with pytest.raises(KeyboardInterrupt), left.until_start():
            raise KeyboardInterrupt
        assert not rel.exists() and os.listdir(home / "releases") == []
        assert len(said) == 1 and "was removed from the box again: the deploy was " in said[0]
        left.drop("once more")  # never twice
        assert len(said) == 1
    finally:
        remote.close()


def test_a_drop_that_cannot_reach_the_box_says_so_and_keeps_the_deploys_error(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The box went with the deploy's own failure: the line says the release was not removed,
    and the deploy's error is raised as it was, with its exit code."""
    monkeypatch.setenv("RGT_SSH_CONFIG", "/dev/null")
    monkeypatch.setenv("RGT_SSH_CONNECT_TIMEOUT", "5")
    with socket.socket() as nobody:
        nobody.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        line = f"ssh -p {nobody.getsockname()[1]} -i {sshd.client_key} {sshd.user}@127.0.0.1"
        remote = SshRemote(parse_target(line), home=str(tmp_path / "ctl"))
        said: List[str] = []
        err = HostError("storing the secrets on the box failed: it went")
        with pytest.raises(HostError) as got, _left(remote, tmp_path, said).until_start():
            raise err
        remote.close()
    assert got.value is err and got.value.exit_code == 9
    assert len(said) == 1 and "was not removed from the box: the deploy failed" in said[0]
    assert "could not be reached" in said[0], said


@pytest.mark.parametrize("stderr", ["broken", "closed"])
def test_a_drop_whose_line_cannot_be_written_keeps_the_deploys_error(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stderr: str
) -> None:
    """The drop's line goes to a stderr that is gone: a pipe nobody reads any longer (``rgt
    deploy 2>&1 | head`` once head is done) or a closed file. The release is removed all the
    same, and the deploy's own error is raised as it was, with its exit code: not the write's."""
    monkeypatch.setenv("RGT_SSH_CONFIG", "/dev/null")
    home = tmp_path / "box"
    rel = _release(home, "0123456789abcdef")
    read_end, write_end = os.pipe()
    err_file = os.fdopen(write_end, "w")
    os.close(read_end)  # each write now fails: EPIPE (Python ignores SIGPIPE)
    if stderr == "closed":
        err_file.close()

    def say(msg: str) -> None:
        print(msg, file=err_file, flush=True)

    with pytest.raises(OSError if stderr == "broken" else ValueError):
        say("the stderr is gone")  # as a real write to it fails
    remote = SshRemote(parse_target(ssh_target(sshd)), home=str(tmp_path / "ctl"))
    err = HostError("storing the secrets on the box failed: no space left")
    try:
        with pytest.raises(HostError) as got, _left(remote, home, [], say=say).until_start():
            raise err
        assert got.value is err and got.value.exit_code == 9
        assert not rel.exists() and os.listdir(home / "releases") == []
        kept = _left(remote, home, [], method="existing", say=say)
        with pytest.raises(KeyboardInterrupt), kept.until_start():
            raise KeyboardInterrupt
    finally:
        remote.close()
        if stderr == "broken":
            with contextlib.suppress(OSError):
                err_file.close()


def _drop(home: Path, name: str, rid: str) -> str:
    """``rgt_release_drop`` of release ``rid`` after a failed start of run ``name``: its word."""
    argv = [
        "sh", "-c", script("release_use.sh") + 'rgt_release_drop "$@"', "rgt",
        str(home / "releases" / rid), str(home / "runs" / name), str(home / "deploys" / name),
    ]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr, p
    return p.stdout.strip()


def _release(home: Path, rid: str) -> Path:
    d = home / "releases" / rid
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "job.py").write_text("print(1)\n")
    (d / ".rgt-release").write_text("{}\n")
    return d


def _run(home: Path, name: str, rid: str, state: str) -> None:
    d = home / "runs" / name
    d.mkdir(parents=True)
    write_json(str(d / "spec.json"), {"workdir": str(home / "releases" / rid), "command": ["x"]})
    write_json(str(d / "state.json"), {"state": state, "last_exit": {"state": "FAILED"}})


def _link(home: Path, name: str, rid: str) -> None:
    (home / "deploys" / name).mkdir(parents=True)
    os.symlink(f"../../releases/{rid}", home / "deploys" / name / "current")


def test_the_drop_keeps_a_release_that_a_deploy_or_a_run_uses(tmp_path: Path) -> None:
    home = tmp_path / "box home 'q'"
    rid = "0123456789abcdef"
    assert _drop(home, "me", rid) == "gone"
    rel = _release(home, rid)
    _link(home, "other", rid)
    assert _drop(home, "me", rid) == "used" and rel.is_dir()
    shutil.rmtree(home / "deploys")
    _link(home, "me", rid)
    assert _drop(home, "me", rid) == "current" and rel.is_dir()
    shutil.rmtree(home / "deploys")
    _run(home, "other", rid, "SUCCEEDED")
    assert _drop(home, "me", rid) == "used" and rel.is_dir()
    shutil.rmtree(home / "runs")
    # The run's own spec names it (its start wrote it): kept, whatever the run's state (a
    # start of its spec again runs there).
    for state in ("PENDING", "PREEMPTED", "STOPPED", "FAILED"):
        _run(home, "me", rid, state)
        assert _drop(home, "me", rid) == "run" and rel.is_dir(), state
        shutil.rmtree(home / "runs")
    _run(home, "me", "fedcba9876543210", "FAILED")  # its spec names another release
    os.chmod(rel / "sub", 0o500)  # a directory the job made read-only
    assert _drop(home, "me", rid) == "removed"
    assert os.listdir(home / "releases") == []


def test_a_run_the_box_held_whose_start_failed_is_recorded_on_this_laptop(
    sshd: SshServer, tmp_path: Path
) -> None:
    """Deployed from another laptop, the run's start from this one fails: the box holds it,
    FAILED, and this laptop records it from the box's record, so `rgt status` finds it."""
    other = Laptop(sshd, tmp_path)
    (tmp_path / "here").mkdir()
    lap = Laptop(sshd, tmp_path / "here")
    lap.box, lap.env["RGT_BOX_HOME"] = other.box, str(other.box)  # one box, two laptops
    store = tmp_path / "store"
    store.mkdir()
    (other.project / "job.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    try:
        rc, out = other.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        rc, out = other.rgt("stop", "held")
        assert rc == 0, out
        # The store fails this start (its epochs/ is in the way), then comes back as it was
        # (a pull says "nothing sealed" only of a store holding the run's epoch).
        os.rename(store / "held" / "epochs", tmp_path / "epochs-aside")
        blocker = _block_epochs(store, "held")
        rc, out = lap.rgt("status", "held")
        assert rc == 8, out  # this laptop has not met the run
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 14 and "epochs/00000001: not a directory" in out, out  # the box's error
        rc, said = lap.rgt("status", "held")
        assert rc != 8 and "FAILED" in said, said
        assert "which this laptop had no record of: recorded from the box's" in out, out
        # What the box holds: its spec's store and workdir (the release this deploy pushed,
        # kept: the start claimed the run, whose spec names it), and the release the run last
        # started in.
        rec = json.loads((lap.ctl / "runs.json").read_text())["runs"]["held"]
        spec = json.loads((lap.box / "runs" / "held" / "spec.json").read_text())
        assert (rec["store"], rec["workdir"]) == (f"file://{store}", spec["workdir"]), rec
        assert "which this deploy pushed, is kept on the box: run held's spec there" in out, out
        pushed = os.path.basename(spec["workdir"])
        assert rec["release"] == _current(other, "held") != pushed, rec
        assert _releases(lap) == sorted([rec["release"], pushed])
        # And `rgt down` takes it off the box, both releases too.
        blocker.unlink()
        os.rename(tmp_path / "epochs-aside", store / "held" / "epochs")
        rc, out = lap.rgt("pull", "held", "--to", str(tmp_path / "pulled"))
        assert rc == 0, out
        rc, out = lap.rgt("down", "held", "--yes")
        assert rc == 0, out
        assert not lap.runs("held").exists() and _releases(lap) == []
        assert not (lap.box / "deploys" / "held").exists()
    finally:
        _kill_run_processes(str(other.box))
