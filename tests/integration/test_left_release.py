"""The release a deploy pushed for a start that failed goes from the box again when nothing uses
it: a redeploy of changed code whose start the box failed (the run's epoch cannot be taken)
left ``releases/<new id>`` there, which neither the laptop's record nor ``deploys/N/current``
named and no `rgt down` removed, so failed redeploys filled the box's disk. A release that was
on the box before the deploy (another run's) is kept, and so is one that a deploy's current link
or another run's spec names, or the run's own spec while it is not FAILED (``rgt_release_drop``,
controller/shell/release_use.sh, run here as the start runs it: sh on its own).

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

from controller.shell import script
from onbox.common.durable import write_json
from tests.conftest import _kill_run_processes
from tests.integration.test_deploy_unbegun import _block_epochs
from tests.integration.test_refused_secrets import Laptop
from tests.sshd import SshServer

JOB = ("--", sys.executable, "job.py")


def _releases(lap: Laptop) -> List[str]:
    """The complete releases on the box (not a push's temporary directory)."""
    d = lap.box / "releases"
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def _current(lap: Laptop, name: str) -> str:
    return os.path.basename(os.readlink(lap.box / "deploys" / name / "current"))


def test_a_failed_start_of_changed_code_removes_the_release_it_pushed(
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
        # The code changed, and the run's epoch cannot be taken: the start fails.
        (lap.project / "job.py").write_text("print('changed')\n")
        # The store fails this start (its epochs/ is in the way), then comes back as it was
        # (a pull says "nothing sealed" only of a store holding the run's epoch).
        os.rename(store / "held" / "epochs", tmp_path / "epochs-aside")
        blocker = _block_epochs(store, "held")
        rc, out = lap.deploy("held", "--store", f"file://{store}", *JOB)
        assert rc == 14 and "epochs/00000001: not a directory" in out, out  # the box's error
        assert _releases(lap) == first, "the failed start's release stayed on the box"
        assert "was removed from the box again: the start failed" in out, out
        assert _current(lap, "held") == first[0]
        # Another run deployed with the changed code: its release is the one this deploy
        # pushes, which was on the box before it, so it stays when the start fails.
        rc, out = lap.deploy("other", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        both = _releases(lap)
        assert len(both) == 2 and _current(lap, "other") in both, both
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
    # The run's own spec names it (its start wrote it): kept while the run may run there.
    for state in ("PENDING", "PREEMPTED", "STOPPED"):
        _run(home, "me", rid, state)
        assert _drop(home, "me", rid) == "run" and rel.is_dir(), state
        shutil.rmtree(home / "runs")
    _run(home, "me", rid, "FAILED")
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
        # removed again: the run is FAILED), and the release the run last started in.
        rec = json.loads((lap.ctl / "runs.json").read_text())["runs"]["held"]
        spec = json.loads((lap.box / "runs" / "held" / "spec.json").read_text())
        assert (rec["store"], rec["workdir"]) == (f"file://{store}", spec["workdir"]), rec
        assert "which this deploy pushed, was removed from the box again" in out, out
        assert _releases(lap) == [_current(other, "held")] == [rec["release"]], rec
        # And `rgt down` takes it off the box, the release it ran in too.
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
