"""A redeploy of changed code to a run on the box whose start failed after the agent claimed the
run (its epoch could not be taken) left the run's spec naming the release it pushed; the failed
deploy's drop removed that release all the same (the run was FAILED), so `rgt deploy T --name N`
with no command, which starts the run's spec again, found no release to run in (exit 8). A
release a run's own spec names is kept now, and the retry runs what the user last deployed. One
that nothing names any longer (a later deploy moved the spec off it) goes at that deploy's start,
failed or not, and at `rgt down` of the run, rather than stay on the box for good
(``rgt_release_left``, controller/shell/release_use.sh). So does the release the deploy's
current link named once the link moves on after a start (a redeploy's or a restart's), unless the
job wrote in it: before, every redeploy of changed code left one that `rgt down` never removed.

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

from controller.shell import script
from tests.conftest import _kill_run_processes
from tests.integration.test_deploy_unbegun import _block_epochs
from tests.integration.test_refused_secrets import Laptop
from tests.sshd import SshServer

JOB = ("--", sys.executable, "job.py")


def _job(lap: Laptop, says: str) -> None:
    (lap.project / "job.py").write_text(
        f"import time\nprint({says!r}, flush=True)\ntime.sleep(300)\n"
    )


def _releases(lap: Laptop) -> List[str]:
    """The complete releases on the box (not a push's temporary directory)."""
    return sorted(n for n in os.listdir(lap.box / "releases") if not n.startswith("."))


def _spec_release(lap: Laptop, name: str) -> str:
    spec = json.loads((lap.box / "runs" / name / "spec.json").read_text())
    return os.path.basename(str(spec["workdir"]))


def _current(lap: Laptop, name: str) -> str:
    return os.path.basename(os.readlink(lap.box / "deploys" / name / "current"))


class _Store:
    """A file:// store whose run ``name`` cannot take its next epoch while ``blocked``."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.root, self.name, self.aside = tmp_path / "store", name, tmp_path / "epochs-aside"
        self.root.mkdir()
        self.url = f"file://{self.root}"

    def block(self) -> None:
        os.rename(self.root / self.name / "epochs", self.aside)
        _block_epochs(self.root, self.name)

    def unblock(self) -> None:
        (self.root / self.name / "epochs").unlink()
        os.rename(self.aside, self.root / self.name / "epochs")


KEPT = "which this deploy pushed, is kept on the box: run held's spec there names it"


def _deploy_and_stop(lap: Laptop, store: _Store) -> str:
    """Deploy the project to run "held" and stop it: the release it ran in."""
    rc, out = lap.deploy("held", "--store", store.url, *JOB)
    assert rc == 0, out
    rc, out = lap.rgt("stop", "held")
    assert rc == 0, out
    return _current(lap, "held")


def _fail_redeploy(lap: Laptop, store: _Store, says: str) -> Tuple[str, str]:
    """Deploy changed code (it prints ``says``) to run "held", whose start fails past its claim:
    the release it pushed, which the run's spec now names, and what the deploy said."""
    _job(lap, says)
    store.block()
    rc, out = lap.deploy("held", "--store", store.url, *JOB)
    store.unblock()
    assert rc == 14 and "epochs/00000001: not a directory" in out, out  # the box's error
    return _spec_release(lap, "held"), out


def test_a_failed_redeploy_keeps_its_release_and_a_restart_runs_it(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = _Store(tmp_path, "held")
    _job(lap, "first code")
    try:
        first = _deploy_and_stop(lap, store)
        new, said = _fail_redeploy(lap, store, "changed code")
        # The restart of the run's recorded spec runs what was deployed last.
        rc, out = lap.deploy("held")
        assert rc == 0 and "its first line: changed code" in out, out
        assert _spec_release(lap, "held") == new and new != first
        assert KEPT in said, said
        # The restart moved the deploy's current link to the release it runs in, and the one
        # it ran in before, which nothing names any longer, went (else `rgt down` left it).
        assert _current(lap, "held") == new and _releases(lap) == [new]
        rc, out = lap.rgt("stop", "held")
        assert rc == 0, out
        rc, out = lap.rgt("pull", "held", "--to", str(tmp_path / "pulled"))
        assert rc == 0, out
        rc, out = lap.rgt("down", "held", "--yes")
        assert rc == 0 and _releases(lap) == [], out
    finally:
        _kill_run_processes(str(lap.box))


def test_a_release_nothing_names_any_longer_goes_at_the_next_start_and_at_down(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = _Store(tmp_path, "held")
    _job(lap, "first code")
    try:
        first = _deploy_and_stop(lap, store)
        second, said = _fail_redeploy(lap, store, "second code")
        assert KEPT in said and second in _releases(lap), said
        # A second failed redeploy moves the spec on: the second release is named by nothing.
        third, said = _fail_redeploy(lap, store, "third code")
        assert KEPT in said, said
        assert _releases(lap) == sorted([first, third]), "a release nothing names stayed"
        assert second not in _releases(lap)
        # `rgt down` removes the release its record names and the one the run's spec names.
        rc, out = lap.rgt("pull", "held", "--to", str(tmp_path / "pulled"))
        assert rc == 0, out
        rc, out = lap.rgt("down", "held", "--yes")
        assert rc == 0, out
        assert f"releases/{third} (the release run held's spec names, which" in out, out
        assert not lap.runs("held").exists() and _releases(lap) == []
    finally:
        _kill_run_processes(str(lap.box))


def test_a_deploy_that_starts_removes_the_release_a_failed_one_left(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = _Store(tmp_path, "held")
    _job(lap, "first code")
    try:
        first = _deploy_and_stop(lap, store)
        failed, said = _fail_redeploy(lap, store, "failed code")
        assert KEPT in said and failed in _releases(lap), said
        _job(lap, "fixed code")
        rc, out = lap.deploy("held", "--store", store.url, *JOB)
        assert rc == 0 and "its first line: fixed code" in out, out
        fixed = _current(lap, "held")
        # The failed release goes, and once the current link moved on, the one the run ran in
        # before: nothing names it, and the job wrote nothing in it.
        assert _releases(lap) == [fixed] and first != fixed, _releases(lap)
    finally:
        _kill_run_processes(str(lap.box))


def test_a_redeploy_keeps_the_previous_release_only_where_the_job_wrote_in_it(
    sshd: SshServer, tmp_path: Path
) -> None:
    """The current link's move drops the release it named before, but never one the job wrote
    in (its outputs in its working directory): those are for `rgt down` to show first."""
    lap = Laptop(sshd, tmp_path)
    store = _Store(tmp_path, "held")
    (lap.project / "job.py").write_text(
        "import time\nopen('out.txt', 'w').write('made by the job')\n"
        "print('writer', flush=True)\ntime.sleep(300)\n"
    )
    try:
        first = _deploy_and_stop(lap, store)
        _job(lap, "second code")
        rc, out = lap.deploy("held", "--store", store.url, *JOB)
        assert rc == 0 and "its first line: second code" in out, out
        second = _current(lap, "held")
        assert _releases(lap) == sorted([first, second])
        assert (lap.box / "releases" / first / "out.txt").read_text() == "made by the job"
    finally:
        _kill_run_processes(str(lap.box))


def _left(home: Path, rid: str) -> None:
    """``rgt_release_left`` of release ``rid`` for run "me", as a start calls it."""
    argv = [
        "sh", "-c", script("release_use.sh") + 'rgt_release_left "$@"', "rgt",
        str(home / "releases" / rid), str(home / "runs" / "me"), str(home / "deploys" / "me"),
    ]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr, p


def test_a_release_the_job_wrote_in_is_left_where_nothing_names_it(tmp_path: Path) -> None:
    """What the job wrote in a release (a checkpoint dir inside it) is never removed by a start
    that only found the release unnamed: `rgt down` shows it as lost first."""
    home = tmp_path / "box"
    rid = "0123456789abcdef"
    rel = home / "releases" / rid
    rel.mkdir(parents=True)
    (rel / "job.py").write_text("print(1)\n")
    (rel / ".rgt-release").write_text("{}\n")
    os.link(rel / "job.py", tmp_path / "shared")  # another release's hard link to a file
    (rel / "ckpt").mkdir()
    step = rel / "ckpt" / "step_1.bin"
    # Written after the marker, as find sees it: a changed ctime later than the marker's (the
    # clock a filesystem stamps with may be coarse, so written until it is).
    for _ in range(100_000):
        step.write_bytes(b"w")
        if step.stat().st_ctime_ns > (rel / ".rgt-release").stat().st_ctime_ns:
            break
    else:
        raise AssertionError("the file's ctime never passed the marker's")
    _left(home, rid)
    assert rel.is_dir()
    step.unlink()
    _left(home, rid)
    assert not rel.exists()
