"""A new user's walk through `rgt` against a real box (the session's loopback sshd, tests/sshd.py):
the real CLI as a process (tests/laptop.py), what it prints held against what README.md promises.

- a run deployed, stopped and deployed again: the second deploy shows the first line of the
  attempt it started, not the run's first attempt's (a traceback fixed since);
- `rgt logs -f` in one terminal goes on while another rgt command on the same box ends (they
  share ssh's control master: the one that ends must not take the other's session with it);
- typos: a job file with a wrong key is refused (exit 2, naming the file and the key) before the
  box is touched, and so is a wrong value the laptop can tell (a command given as one string, a
  non-string [env] value); a command the box cannot find is the box's usage error, exit 2, not a
  bug's 1;
- a job that fails at once: deploy says so, with the box's reason and `rgt logs NAME`, and exits
  11 (FAILED) as `rgt-agent run` does, not 0; one that succeeded at once exits 0;
- no `--store` on a profile with no durable mount: one warning line that the checkpoints live only
  on the box, and no warning with a store; no store under the name of a run recorded with one:
  refused (exit 2) before anything changes, with no such warning;
- a run held by another agent (exit 5): the remedy names the laptop's commands;
- `rgt down` on a terminal asks for the run's name in one prompt (``...: ``, not ``...: : ``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from onbox.agent import procfs
from onbox.common.errors import FINAL_EXIT_CODES
from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, rgt_exe, run_rgt, ssh_target
from tests.sshd import SshServer

RUN = f"walk-{os.getpid()}"
# The job: one line naming its attempt, then a tick every half second until it is stopped.
JOB = """\
import os, time
print("first line of attempt", os.environ["RGT_ATTEMPT"], flush=True)
while True:
    print("tick", flush=True)
    time.sleep(0.5)
"""


@dataclasses.dataclass
class Walk:
    sshd: SshServer
    ctl_home: str
    box_home: str
    project: str

    @property
    def target(self) -> str:
        return ssh_target(self.sshd)

    def rgt(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run_rgt(args, laptop_env(self.ctl_home, self.box_home), self.project, timeout)

    def deploy(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.rgt("deploy", self.target, "--python", sys.executable, *args)

    def sessions(self) -> int:
        """Commands the box's sshd has started so far."""
        return self.sshd.log().count("Starting session: ")

    def ssh_clients(self) -> List[int]:
        """This laptop's ssh processes: their command line names its control socket directory."""
        dirs = [os.path.join(self.ctl_home, "cm").encode()]
        with contextlib.suppress(OSError), open(os.path.join(self.ctl_home, "cm-dir"), "rb") as f:
            dirs.append(f.read().strip())
        out = []
        for pid in procfs.pids():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
                if line.startswith(b"ssh") and any(d and d in line for d in dirs):
                    out.append(pid)
        return out


@pytest.fixture(scope="module")
def walk(sshd: SshServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walk]:
    tmp = tmp_path_factory.mktemp("walk")
    project = tmp / "project"
    project.mkdir()
    (project / "job.py").write_text(JOB)
    w = Walk(sshd, str(tmp / "ctl"), str(tmp / "box"), str(project))
    os.makedirs(w.ctl_home)
    try:
        yield w
    finally:
        _kill_run_processes(w.box_home)
        for pid in w.ssh_clients():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _on_a_terminal(walk: Walk, *args: str, answer: str) -> tuple[int, str]:
    """`rgt ARGS` on a pseudo-terminal, as a person runs it: ``answer`` typed once it asks.
    Its exit code and what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*rgt_exe(), *args],
        env=laptop_env(walk.ctl_home, walk.box_home),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=walk.project,
        close_fds=True,
    )
    os.close(slave)
    shown, typed = b"", False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side closed, rgt ended
                break
            if not chunk:
                break
            shown += chunk
            if not typed and shown.rstrip().endswith(b":"):
                os.write(master, answer.encode() + b"\n")
                typed = True
        return proc.wait(timeout=60), shown.decode("utf-8", "replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)


def _first_line(err: str) -> str:
    said = [ln for ln in err.splitlines() if "its first line:" in ln]
    assert len(said) == 1, err
    return said[0]


def test_a_deploy_again_shows_the_first_line_of_the_attempt_it_started(walk: Walk) -> None:
    p = walk.deploy("--name", RUN, "--", sys.executable, "job.py")
    assert p.returncode == 0, p.stderr
    assert _first_line(p.stderr).endswith("its first line: first line of attempt 1"), p.stderr
    p = walk.rgt("stop", RUN, "--grace", "2")
    assert p.returncode == 0, p.stderr

    p = walk.deploy("--name", RUN, "--", sys.executable, "job.py")
    assert p.returncode == 0, p.stderr
    assert _first_line(p.stderr).endswith("its first line: first line of attempt 2"), p.stderr


def test_logs_follow_goes_on_while_another_rgt_command_on_the_box_ends(
    walk: Walk, tmp_path: Path
) -> None:
    out = tmp_path / "follow.out"
    with open(out, "wb") as f:
        follower = subprocess.Popen(
            [*rgt_exe(), "logs", RUN, "-f"],
            env=laptop_env(walk.ctl_home, walk.box_home),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=walk.project,
        )
    try:
        deadline = time.monotonic() + 60
        while b"tick" not in out.read_bytes():
            assert follower.poll() is None, out.read_bytes()[-2000:]
            assert time.monotonic() < deadline, "rgt logs -f printed nothing"
            time.sleep(0.1)
        # Another terminal: a command that opens, uses and closes its ssh connection to the box.
        p = walk.rgt("doctor", walk.target)
        assert p.returncode in (0, 9), p.stderr
        p = walk.rgt("stop", RUN, "--grace", "2")
        assert p.returncode == 0, p.stderr
        # The follower ends with the run, having followed it to its end, not with the doctor.
        assert follower.wait(timeout=60) == 0, out.read_bytes()[-2000:]
    finally:
        follower.kill()
        follower.wait(10)


def _listing(path: str) -> List[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_a_job_file_with_a_wrong_key_is_refused_before_the_box_is_touched(walk: Walk) -> None:
    job = Path(walk.project) / "typo.toml"
    releases = os.path.join(walk.box_home, "releases")
    before = _listing(releases)  # (none yet when this test runs alone)
    for text, key in [
        ('name = "typo"\ncomand = ["python", "job.py"]\n', "comand"),
        (
            'name = "typo"\ncommand = ["python", "job.py"]\n[checkpoint]\nintervall = "5m"\n',
            "checkpoint.intervall",
        ),
    ]:
        job.write_text(text)
        sessions = walk.sessions()
        p = walk.deploy(str(job))
        assert p.returncode == 2, p.stderr
        assert f"{job}: {key}: unknown setting" in p.stderr and "valid: " in p.stderr, p.stderr
        assert walk.sessions() == sessions, p.stderr  # not one command on the box
    assert _listing(releases) == before  # no release pushed for it
    assert not os.path.exists(os.path.join(walk.box_home, "runs", "typo"))
    job.unlink()


def test_a_job_file_with_a_wrong_value_is_refused_before_the_box_is_touched(walk: Walk) -> None:
    """A command given as one string, an [env] value that is not a string: the box refused them
    only after the push, the install and the secrets stored for a run that then never existed."""
    job = Path(walk.project) / "typo.toml"
    for text, said in [
        ('name = "typo"\ncommand = "python job.py"\n', "command: must be a list of strings"),
        ('name = "typo"\ncommand = []\n', "command: is empty"),
        (
            'name = "typo"\ncommand = ["python", "job.py"]\n[env]\nSEED = 1\n',
            "env: must be a table of string values",
        ),
    ]:
        job.write_text(text)
        sessions = walk.sessions()
        p = walk.deploy(str(job))
        assert p.returncode == 2, p.stderr
        assert f"{job}: {said}" in p.stderr, p.stderr
        assert walk.sessions() == sessions, p.stderr  # not one command on the box
    # The command after `--` replaces the file's: its shape is not the file's to refuse.
    job.write_text('name = "typo"\ncommand = "python job.py"\n')
    p = walk.deploy(str(job), "--", "no-such-command-here")
    assert p.returncode == 2 and "'no-such-command-here' is not found on PATH" in p.stderr
    job.unlink()


def test_a_command_the_box_cannot_find_is_a_usage_error(walk: Walk) -> None:
    p = walk.deploy("--name", "nocmd", "--", "no-such-command-here", "job.py")
    assert p.returncode == 2, p.stderr
    assert "'no-such-command-here' is not found on PATH" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(walk.box_home, "runs", "nocmd"))


def test_a_job_that_fails_at_once_makes_deploy_exit_with_the_failed_code(walk: Walk) -> None:
    p = walk.deploy("--name", "fails", "--", sys.executable, "-c", "import no_such_module")
    assert p.returncode == FINAL_EXIT_CODES["FAILED"], p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("rgt: run fails FAILED"), p.stderr
    assert "No module named 'no_such_module'" in last, p.stderr  # the box's reason
    assert "`rgt logs fails`" in last, p.stderr
    assert "runs on without this laptop" not in p.stderr, p.stderr
    assert p.stdout == "", p.stdout  # no run name: nothing runs


def test_a_job_that_succeeded_at_once_exits_0_and_says_it_ended(walk: Walk) -> None:
    p = walk.deploy("--name", "quick", "--", sys.executable, "-c", "pass")
    assert p.returncode == 0, p.stderr
    assert "quick SUCCEEDED" in p.stderr and "`rgt pull quick`" in p.stderr, p.stderr
    assert "runs on without this laptop" not in p.stderr, p.stderr


def test_down_asks_for_the_runs_name_in_one_prompt_on_a_terminal(
    walk: Walk, tmp_path: Path
) -> None:
    """The prompt ended in ": : " (click added its own suffix to down's)."""
    job = "import os; open(os.environ['RGT_CKPT_DIR'] + '/step_1.bin', 'wb').write(b'w')"
    store = tmp_path / "store"
    store.mkdir()
    p = walk.deploy(
        "--name", "asked", "--store", f"file://{store}", "--", sys.executable, "-c", job
    )
    assert p.returncode == 0, p.stderr
    p = walk.rgt("pull", "asked", "--to", str(tmp_path / "pulled"))
    assert p.returncode == 0, p.stderr
    code, shown = _on_a_terminal(walk, "down", "asked", answer="not-it")
    assert code == 7 and "does not match; nothing done" in shown, shown
    assert shown.count("Type the run's name (asked) to take it down: ") == 1, shown
    assert "take it down: :" not in shown, shown
    assert os.path.isdir(os.path.join(walk.box_home, "runs", "asked"))  # nothing done


def _store_warnings(err: str) -> List[str]:
    return [ln for ln in err.splitlines() if "only on the box" in ln]


def test_no_store_on_a_profile_without_a_durable_mount_is_warned_once(
    walk: Walk, tmp_path: Path
) -> None:
    p = walk.deploy("--name", "nostore", "--", sys.executable, "-c", "pass")
    assert p.returncode == 0, p.stderr
    said = _store_warnings(p.stderr)
    assert len(said) == 1, p.stderr
    assert said[0].startswith("rgt: warning: no --store"), said
    assert "--store s3://" in said[0] and "--store file://" in said[0], said
    store = tmp_path / "store"
    store.mkdir()
    p = walk.deploy(
        "--name", "nostore", "--store", f"file://{store}", "--", sys.executable, "-c", "pass"
    )
    assert p.returncode == 0, p.stderr
    assert _store_warnings(p.stderr) == [], p.stderr


def test_a_deploy_without_the_store_the_runs_record_names_is_refused_first(
    walk: Walk, tmp_path: Path
) -> None:
    """A deploy with no store under the name of a run this laptop recorded with one warned
    "checkpoints stay only on the box", then started the run without its store (its sealed
    checkpoints neither restored nor added to, and the laptop's record forgot the store). It is
    refused (exit 2) before anything changes, with no such warning; the store given again
    deploys."""
    store = tmp_path / "store"
    store.mkdir()
    p = walk.deploy("--name", "kept", "--store", f"file://{store}", "--", sys.executable, "job.py")
    assert p.returncode == 0, p.stderr
    p = walk.rgt("stop", "kept", "--grace", "1")
    assert p.returncode == 0, p.stderr
    p = walk.deploy("--name", "kept", "--", sys.executable, "job.py")
    assert p.returncode == 2, p.stderr
    assert _store_warnings(p.stderr) == [], p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert f"run kept was deployed with store file://{store}" in last, p.stderr
    assert f"give --store file://{store} again" in last, p.stderr
    assert "first line of attempt 2" not in p.stderr, p.stderr  # nothing started
    p = walk.rgt("status", "kept", "--json")
    assert p.returncode == 0 and '"STOPPED"' in p.stdout, (p.stdout, p.stderr)
    p = walk.deploy("--name", "kept", "--store", f"file://{store}", "--", sys.executable, "job.py")
    assert p.returncode == 0, p.stderr
    assert "first line of attempt 2" in p.stderr, p.stderr
    p = walk.rgt("stop", "kept", "--grace", "1")
    assert p.returncode == 0, p.stderr


def test_a_run_held_by_another_agent_names_the_laptops_commands(walk: Walk) -> None:
    p = walk.deploy("--name", "held", "--", sys.executable, "-c", "pass")
    assert p.returncode == 0, p.stderr
    lock = os.path.join(walk.box_home, "runs", "held", "lock")
    hold = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, lock], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        p = walk.deploy("--name", "held", "--", sys.executable, "-c", "pass")
        assert p.returncode == 5, p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert "is held by" in last, p.stderr
        assert "`rgt status held`" in last and "`rgt stop held`" in last, p.stderr
        assert "`rgt-agent" not in last, p.stderr  # no box command offered to the laptop
    finally:
        holder.kill()
        holder.wait(10)
        assert holder.stdout is not None
        holder.stdout.close()
