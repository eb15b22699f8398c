"""A release one run is about to start in is never removed under it: two deploys of the same
code under two names share one release (content-addressed), and the second finds it complete
before its spec or its ``current`` link names it. The first one's failed start dropped it
(controller/deploy/leftrelease.py), and so did `rgt down` of a third run in it, and the second
run's start then failed. A deploy holds the release from before it trusts it to its start
(``deploys/N/pending``, controller/shell/release_use.sh), and a drop or a down keeps a release
another deploy holds. One removed before the start held it, after the deploy found it complete
(no command of its own), is pushed again by that deploy (``boxstart.start_pushed``).

Real processes: the `rgt` CLI against real loopback sshds that share one box home. Each deploy
that must wait goes through an sshd of its own whose sessions hold the agent in its store's
preflight (``RGT_HOLD_AT=store.get``, onbox/common/faults.py), after the start's shell took
the release and before the run's spec names it, until the test lets it go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from controller.deploy.boxstart import start_pushed
from controller.deploy.project import project_files
from controller.deploy.release import BoxRelease, PushResult, push_release
from controller.registry import Registry, RunRecord
from controller.remote import SshRemote
from controller.target import parse_target
from tests.conftest import _kill_run_processes, require
from tests.integration.test_deploy_unbegun import _block_epochs
from tests.integration.test_refused_secrets import Laptop
from tests.laptop import rgt_exe, ssh_target
from tests.sshd import SshServer, missing, start_sshd

JOB = ("--", sys.executable, "job.py")
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(300)\n"


class Held:
    """A loopback sshd whose agents wait at their first store read until ``let_go``."""

    def __init__(self, d: Path) -> None:
        d.mkdir()
        self.reached, self.until = d / "reached", d / "until"
        env = {
            "RGT_HOLD_AT": "store.get",
            "RGT_HOLD_REACHED": str(self.reached),
            "RGT_HOLD_UNTIL": str(self.until),
        }
        self.server: SshServer = start_sshd(str(d / "sshd"), set_env=env)
        p = self.server.run("true", timeout=60)  # records the host key
        assert p.returncode == 0, p.stderr

    def let_go(self) -> None:
        self.until.touch()


@contextlib.contextmanager
def _deploying(lap: Laptop, target: str, name: str, store: Path) -> Iterator[subprocess.Popen[str]]:
    """`rgt deploy` of run ``name`` through ``target``, in the background; killed by PID on
    leaving if it still runs."""
    argv = [*rgt_exe(), "deploy", target, "--python", sys.executable, "--name", name]
    argv += ["--store", f"file://{store}", *JOB]
    p = subprocess.Popen(
        argv, env=lap.env, cwd=str(lap.project), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=60)


def _until_held(held: Held, p: subprocess.Popen[str]) -> None:
    """Wait for the deploy ``p`` to reach its hold (its output, should it end first)."""
    deadline = time.monotonic() + 120
    while not held.reached.exists():
        if p.poll() is not None:
            pytest.fail(f"the deploy ended before its hold: {p.communicate()[0]}")
        assert time.monotonic() < deadline, "the deploy never reached its hold"
        time.sleep(0.1)


def _finish(p: subprocess.Popen[str]) -> Tuple[int, str]:
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def _releases(lap: Laptop) -> List[str]:
    return sorted(n for n in os.listdir(lap.box / "releases") if not n.startswith("."))


def _current(lap: Laptop, name: str) -> str:
    return os.path.basename(os.readlink(lap.box / "deploys" / name / "current"))


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Tuple[Held, Held]]:
    """Two holding sshds, stopped by PID at the end."""
    why = missing()
    require(why is None, why or "")
    servers: List[Held] = []
    try:
        for n in ("first", "second"):
            servers.append(Held(tmp_path / f"held-{n}"))
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.let_go()
            s.server.stop()


def test_a_failed_deploy_keeps_the_release_another_deploy_of_the_same_code_starts_in(
    sshd: SshServer, tmp_path: Path, held: Tuple[Held, Held]
) -> None:
    first, second = held
    lap = Laptop(sshd, tmp_path)
    (lap.project / "job.py").write_text(SLEEPER)
    store_a, store_b = tmp_path / "store-a", tmp_path / "store-b"
    store_b.mkdir()
    blocker = _block_epochs(store_a, "a")  # run a's start fails once past its preflight
    try:
        with _deploying(lap, ssh_target(first.server), "a", store_a) as a:
            _until_held(first, a)  # a pushed the release and its agent is in it
            pushed = _releases(lap)
            assert len(pushed) == 1, pushed
            with _deploying(lap, ssh_target(second.server), "b", store_b) as b:
                _until_held(second, b)  # b found it complete, its spec not yet written
                first.let_go()
                rc, out = _finish(a)
                assert rc == 14 and "epochs/00000001: not a directory" in out, out
                assert "is kept on the box: another run or deploy on the box uses it" in out
                assert _releases(lap) == pushed, "a's failed start removed b's release"
                second.let_go()
                rc, out = _finish(b)
                assert rc == 0 and "its first line: up" in out, out
        assert _releases(lap) == pushed and _current(lap, "b") == pushed[0]
        assert not (lap.box / "deploys" / "a").exists(), "the failed deploy left its hold"
        blocker.unlink()
    finally:
        _kill_run_processes(str(lap.box))


def test_rgt_down_keeps_the_release_a_deploy_of_another_run_is_starting_in(
    sshd: SshServer, tmp_path: Path, held: Tuple[Held, Held]
) -> None:
    first, _ = held
    lap = Laptop(sshd, tmp_path)
    (lap.project / "job.py").write_text(SLEEPER)
    store = tmp_path / "store"
    store.mkdir()
    try:
        rc, out = lap.deploy("c", "--store", f"file://{store}", *JOB)
        assert rc == 0, out
        rc, out = lap.rgt("stop", "c")
        assert rc == 0, out
        rc, out = lap.rgt("pull", "c", "--to", str(tmp_path / "pulled"))  # down needs its receipt
        assert rc == 0, out
        used = _releases(lap)
        with _deploying(lap, ssh_target(first.server), "b", store) as b:
            _until_held(first, b)  # b found c's release complete, its spec not yet written
            rc, out = lap.rgt("down", "c", "--yes")
            assert rc == 0, out
            assert not (lap.box / "runs" / "c").exists(), out
            assert _releases(lap) == used, "rgt down c removed the release b starts in"
            first.let_go()
            rc, out = _finish(b)
            assert rc == 0 and "its first line: up" in out, out
        assert _releases(lap) == used and _current(lap, "b") == used[0]
    finally:
        _kill_run_processes(str(lap.box))


def test_a_start_whose_release_went_after_the_deploy_found_it_pushes_it_again(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit found the release complete (no command of its own: another run's release),
    and it went before the start held it (that run's `rgt down`, or a failed start that pushed
    it): the start's shell says so, and the deploy pushes it again and starts in it, once,
    rather than fail with exit 8 and ask to be run again."""
    monkeypatch.setenv("RGT_SSH_CONFIG", "/dev/null")
    project, home = tmp_path / "project", tmp_path / "box"
    project.mkdir()
    (project / "job.py").write_text("print(1)\n")
    remote = SshRemote(parse_target(ssh_target(sshd)), home=str(tmp_path / "ctl"))
    registry = Registry(str(tmp_path / "ctl"))
    rec = RunRecord("late", remote.target, box_home=str(home))
    said: List[str] = []
    try:
        files = project_files(str(project))
        first = push_release(remote, str(project), str(home), name="other", files=files)
        seen = BoxRelease(first.id, True, False)
        found = push_release(remote, str(project), str(home), name="late", files=files, seen=seen)
        assert found.method == "existing"
        shutil.rmtree(first.path)  # removed as a drop or `rgt down` removes it

        def again(name: str) -> PushResult:
            return push_release(remote, str(project), str(home), name=name, files=files)

        argv = ["sh", "-c", "test -f job.py"]  # run in the release pushed again
        assert start_pushed(remote, registry, rec, argv, found, False, said.append, again)
        assert (Path(first.path) / ".rgt-release").is_file()
        assert any("went from the box before the start took it" in s for s in said), said
        held = os.readlink(home / "deploys" / "late" / "pending")
        assert held == f"../../releases/{first.id}"
    finally:
        remote.close()
