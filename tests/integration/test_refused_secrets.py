"""A run's `--secret-env` values leave the box with the run: a deploy whose start the box refused
before the run existed there (no runs/N) leaves no secrets file behind (the laptop keeps no
record of such a run, so no `rgt down` could ever remove it); a refused start of a run that does
exist never takes that run's secrets; a run that never ran an attempt and could not begin
(FAILED before its first attempt) keeps none, and says so (a new one goes whole); and `rgt
down N` removes them with the run.

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.sshd import SshServer

SECRET = {"RGT_TEST_TOKEN": "tok-" + os.urandom(8).hex()}


class Laptop:
    """`rgt` with this test's homes and a secret in its environment, in a project of one job."""

    def __init__(self, sshd: SshServer, tmp_path: Path) -> None:
        self.project = tmp_path / "project"
        self.project.mkdir()
        (self.project / "job.py").write_text(
            "import os\nopen(os.environ['RGT_CKPT_DIR'] + '/step_1.bin', 'wb').write(b'w')\n"
        )
        self.ctl, self.box = tmp_path / "ctl", tmp_path / "box"
        self.ctl.mkdir()
        self.env = laptop_env(str(self.ctl), str(self.box), **SECRET)
        self.target = ssh_target(sshd)

    def rgt(self, *args: str) -> tuple[int, str]:
        p = run_rgt(args, self.env, str(self.project))
        return p.returncode, p.stdout + p.stderr

    def deploy(self, name: str, *args: str) -> tuple[int, str]:
        return self.rgt(
            "deploy", self.target, "--python", sys.executable, "--name", name,
            "--secret-env", "RGT_TEST_TOKEN", *args,
        )  # fmt: skip

    def secrets(self, name: str) -> Path:
        return self.box / "secrets" / name

    def runs(self, name: str) -> Path:
        return self.box / "runs" / name


def test_a_refused_start_of_a_new_run_leaves_no_secrets_on_the_box(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    try:
        rc, out = lap.deploy("leak", "--", "no-such-command-here")
        assert rc == 2 and "'no-such-command-here' is not found on PATH" in out, out
        assert "secrets RGT_TEST_TOKEN stored on the box" in out, out  # they were sent
        assert not lap.runs("leak").exists()
        assert not lap.secrets("leak").exists(), "the refused run's secrets stayed on the box"
    finally:
        _kill_run_processes(str(lap.box))


def test_a_refused_start_of_a_run_that_exists_keeps_its_secrets(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    try:
        rc, out = lap.deploy("kept", "--", sys.executable, "-c", "pass")
        assert rc == 0 and "kept SUCCEEDED" in out, out
        assert lap.secrets("kept").is_file()
        rc, out = lap.deploy("kept", "--", "no-such-command-here")
        assert rc == 2 and "'no-such-command-here' is not found on PATH" in out, out
        assert lap.runs("kept").is_dir()
        assert lap.secrets("kept").is_file(), "a refused start took an existing run's secrets"
    finally:
        _kill_run_processes(str(lap.box))


def test_down_removes_the_runs_secrets_from_the_box(sshd: SshServer, tmp_path: Path) -> None:
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    try:
        rc, out = lap.deploy("gone", "--store", f"file://{store}", "--", sys.executable, "job.py")
        assert rc == 0, out
        assert lap.secrets("gone").is_file()
        # What a deploy cut off between its secrets and its start left for that start.
        staged = lap.box / "secrets" / ".gone.staged"
        staged.write_text('{"RGT_TEST_TOKEN": "staged"}')
        staged.chmod(0o600)
        rc, out = lap.rgt("pull", "gone", "--to", str(tmp_path / "pulled"))
        assert rc == 0, out
        rc, out = lap.rgt("down", "gone", "--yes")
        assert rc == 0, out
        # The plan, shown before the confirmation, names everything down removes.
        plan = out.split("down will:")[1]
        assert f"{staged} (secrets a deploy cut off before its start left for it)" in plan, out
        assert not lap.runs("gone").exists()
        assert not lap.secrets("gone").exists(), "down left the run's secrets on the box"
        assert not staged.exists(), "down left the secrets staged for the run's start"
    finally:
        _kill_run_processes(str(lap.box))


def test_a_run_that_fails_before_its_first_attempt_leaves_no_secrets_on_the_box(
    sshd: SshServer, tmp_path: Path
) -> None:
    """The box made runs/N and its agent took the start, but the run could not begin (here its
    store's epoch cannot be taken: RUN/epochs is a file), so it ended FAILED with no attempt,
    and went from the box whole (tests/integration/test_deploy_unbegun.py)."""
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    (store / "nobegin").mkdir(parents=True)
    (store / "nobegin" / "epochs").write_text("in the way\n")
    try:
        rc, out = lap.deploy(
            "nobegin", "--store", f"file://{store}", "--", sys.executable, "job.py"
        )
        assert rc == 14, out
        assert "secrets RGT_TEST_TOKEN stored on the box" in out, out  # they were sent
        assert not lap.runs("nobegin").exists()
        assert not lap.secrets("nobegin").exists(), "a run that never began kept its secrets"
        # Said: what happened to the run and its secrets, and what to do.
        assert "run nobegin could not begin: taking the run's epoch in file://" in out, out
        assert "its secrets were removed from the box" in out, out
        assert "give them again when you start it, `rgt deploy --secret-env VAR`" in out, out
    finally:
        _kill_run_processes(str(lap.box))


def test_a_refused_deploy_of_a_run_that_exists_keeps_its_secrets_and_leaves_none_of_its_own(
    sshd: SshServer, tmp_path: Path
) -> None:
    """The run's own values are what it restarts with; the refused deploy's new ones are left
    nowhere on the box (not over the run's, not beside them)."""
    lap = Laptop(sshd, tmp_path)
    try:
        rc, out = lap.deploy("mine", "--", sys.executable, "-c", "pass")
        assert rc == 0 and "mine SUCCEEDED" in out, out
        own = lap.secrets("mine").read_bytes()
        new = "new-" + os.urandom(8).hex()
        lap.env["RGT_TEST_TOKEN"] = new
        rc, out = lap.deploy("mine", "--", "no-such-command-here")
        assert rc == 2 and "'no-such-command-here' is not found on PATH" in out, out
        assert "secrets RGT_TEST_TOKEN stored on the box" in out, out  # they were sent
        assert lap.secrets("mine").read_bytes() == own, "a refused deploy replaced the secrets"
        left = [p for p in lap.box.rglob("*") if p.is_file() and new.encode() in p.read_bytes()]
        assert not left, f"the refused deploy's secret values stayed on the box: {left}"
        # The next deploy that starts gives the run its new values.
        rc, out = lap.deploy("mine", "--", sys.executable, "-c", "pass")
        assert rc == 0, out
        assert new.encode() in lap.secrets("mine").read_bytes()
    finally:
        _kill_run_processes(str(lap.box))


def test_a_deploy_without_secrets_never_takes_those_a_cut_off_deploy_left_staged(
    sshd: SshServer, tmp_path: Path
) -> None:
    """A deploy cut off between its secrets and its start leaves them staged for that start; the
    next deploy that gives no `--secret-env` starts the run with none of them, and removes them."""
    lap = Laptop(sshd, tmp_path)
    staged = lap.box / "secrets" / ".stale.staged"
    staged.parent.mkdir(parents=True, mode=0o700)
    staged.write_text('{"RGT_TEST_TOKEN": "left-by-a-cut-off-deploy"}')
    staged.chmod(0o600)
    job = "import os\nprint(os.environ.get('RGT_TEST_TOKEN', 'none'), flush=True)\n"
    (lap.project / "show.py").write_text(job)
    try:
        rc, out = lap.rgt(
            "deploy", lap.target, "--python", sys.executable, "--name", "stale",
            "--", sys.executable, "show.py",
        )  # fmt: skip
        assert rc == 0, out
        assert "first line: none" in out, out
        assert not lap.secrets("stale").exists(), "the run took a cut-off deploy's secrets"
        assert not staged.exists(), "the cut-off deploy's secrets stayed staged on the box"
    finally:
        _kill_run_processes(str(lap.box))


def test_a_deploy_that_cannot_remove_a_cut_off_deploys_staged_secrets_starts_nothing(
    sshd: SshServer, tmp_path: Path
) -> None:
    """Here the staged path is a directory, which `rm -f` refuses: the deploy stops with the
    path and what to do (exit 9), and no run is made."""
    lap = Laptop(sshd, tmp_path)
    staged = lap.box / "secrets" / ".odd.staged"
    (staged / "inside").mkdir(parents=True)
    try:
        rc, out = lap.rgt(
            "deploy", lap.target, "--python", sys.executable, "--name", "odd",
            "--", sys.executable, "job.py",
        )  # fmt: skip
        assert rc == 9, out
        assert f"cannot remove {staged} on " in out and "nothing was started" in out, out
        assert not lap.runs("odd").exists()
    finally:
        _kill_run_processes(str(lap.box))
