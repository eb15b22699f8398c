"""A job started with ``rgt-agent start`` over a real ssh session outlives that session.

The promise to users: start training from an ssh session, and then whatever happens to the
session, the job goes on as the same process, in its first attempt, its output still growing.
Each test runs ``rgt-agent start`` through a real sshd on loopback (tests/sshd.py) and checks
the run locally with the same RGT_HOME (loopback shares the filesystem).

- ``test_survives_ssh_client_killed``: the laptop's ssh dies (SIGKILL, lost network, lid
  closed) while the session is still open, with and without a pseudo-terminal; with one, the
  server hangs up the terminal (SIGHUP to the session).
- ``test_survives_session_closing_normally``: ``ssh box rgt-agent start ...`` returns at once
  (the agent must not hold the session's pipes, or ssh would hang) and the job runs on after
  the session ends, with and without ``-tt`` (closing a PTY session sends SIGHUP).
- ``test_survives_explicit_sighup``: SIGHUP sent to the agent, to its shim and to the remote
  shell's process group (what a terminal hangup does) neither stops nor restarts the job.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

import pytest

from onbox.agent import procfs
from onbox.common.durable import read_json
from onbox.common.rundir import RunDir
from tests.conftest import Cli, fixture
from tests.polling import wait
from tests.sshd import SshServer, remote_env

AGENT = os.path.join(os.path.dirname(sys.executable), "rgt-agent")
JOB = [*fixture("crash_after.py"), "600"]  # a step every 0.1 s, for ten minutes
GROWTH_STEPS = 20  # "still running" means: this many more steps (two seconds) of output
TIMEOUT = 30.0


def _start_line(cli: Cli, name: str) -> str:
    """The remote shell line that starts the run: env inline, rgt-agent by absolute path."""
    env = {"RGT_HOME": cli.home, "RGT_AGENT_RESPAWN_DELAY": cli.env["RGT_AGENT_RESPAWN_DELAY"]}
    return (
        remote_env(env)
        + f"cd {shlex.quote(cli.home)} && "
        + shlex.join([AGENT, "start", "--name", name, "--", *JOB])
    )


def _open_session_line(cli: Cli, name: str) -> str:
    """Print the shell's pid (its process group), start the run, keep the session open."""
    return f'echo "shell $$"; {_start_line(cli, name)} && exec sleep 300'


class Session:
    """An ssh client left running in the background, its output going to a file."""

    def __init__(self, server: SshServer, command: str, out_path: str, *, tty: bool) -> None:
        self.out_path = out_path
        self.shell: Optional[procfs.Identity] = None
        with open(out_path, "wb") as out:
            self.proc = subprocess.Popen(
                server.ssh_argv(command, tty=tty),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def shell_identity(self, timeout: float = TIMEOUT) -> procfs.Identity:
        """The remote shell (after ``exec sleep``, the same process), from its first line."""
        deadline = time.monotonic() + timeout
        while self.shell is None:
            m = re.search(r"^shell (\d+)", self.output(), re.M)
            if m:
                self.shell = procfs.identity(int(m.group(1)))
                assert self.shell is not None, f"the remote shell is gone: {self.output()}"
            elif time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no shell pid from the session: {self.output()!r}")
            else:
                time.sleep(0.05)
        return self.shell

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the client and the remote shell by PID, if they still live."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.shell is not None and procfs.is_alive(self.shell):
            os.kill(self.shell.pid, signal.SIGKILL)


@pytest.fixture
def session_out(tmp_path: Path) -> str:
    return str(tmp_path / "ssh.out")


def _last_step(cli: Cli, name: str) -> int:
    out = cli.log_text(name)
    steps = re.findall(r"^step (\d+)$", out, re.M)
    return int(steps[-1]) if steps else 0


def _wait_gone(ident: procfs.Identity, what: str, timeout: float = TIMEOUT) -> None:
    wait(lambda: not procfs.is_alive(ident), timeout, f"{what} (pid {ident.pid}) to end")


def _session_and_tty(pid: int) -> Tuple[int, int]:
    """Session id and controlling terminal (0: none) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[3]), int(rest[4])


def _assert_detached(shell: procfs.Identity, **procs: procfs.Identity) -> None:
    """Each process is outside the ssh session and has no controlling terminal."""
    shell_sid, _ = _session_and_tty(shell.pid)
    for what, ident in procs.items():
        sid, tty = _session_and_tty(ident.pid)
        assert procfs.is_alive(ident), f"the {what} (pid {ident.pid}) is gone"
        assert sid != shell_sid, f"the {what} (pid {ident.pid}) is in the ssh session {sid}"
        assert tty == 0, f"the {what} (pid {ident.pid}) has a controlling terminal ({tty})"


def _running(cli: Cli, name: str) -> Tuple[procfs.Identity, procfs.Identity, int]:
    """Wait for RUNNING; the job's and the agent's identities and the job's last step."""
    st = cli.wait_state(name, "RUNNING", timeout=TIMEOUT)
    job = procfs.identity(st["pid"])
    agent = procfs.identity(st["agent"]["pid"]) if st["agent"]["alive"] else None
    assert job is not None and agent is not None, st
    return job, agent, _last_step(cli, name)


def _assert_survived(
    cli: Cli, name: str, job: procfs.Identity, agent: procfs.Identity, steps_before: int
) -> None:
    """The same job process and agent, attempt 1, no restart, and its output still grows."""
    deadline = time.monotonic() + TIMEOUT
    steps = _last_step(cli, name)
    while steps < steps_before + GROWTH_STEPS:
        assert time.monotonic() < deadline, (
            f"the job's output stopped at step {steps} (was {steps_before}); "
            f"status {cli.status(name)}"
        )
        time.sleep(0.1)
        steps = _last_step(cli, name)
    st = cli.status(name)
    assert procfs.is_alive(job), f"job pid {job.pid} died; status {st}"
    assert procfs.is_alive(agent), f"agent pid {agent.pid} died; status {st}"
    assert st["state"] == "RUNNING", st
    assert st["pid"] == job.pid and st["job_alive"], st
    assert (st["attempt"], st["restarts"]) == (1, 0), st
    assert st["agent"]["alive"] and st["agent"]["pid"] == agent.pid, st
    kinds = [e["kind"] for e in cli.events(name)]
    assert set(kinds) <= {"incarnation", "state"}, f"unexpected events: {cli.events(name)}"


def _stop(cli: Cli, name: str) -> None:
    cli("stop", name, "--grace", "2", check=True)
    assert cli.status(name)["state"] == "STOPPED"


@contextlib.contextmanager
def _stopped_after(cli: Cli, name: str) -> Iterator[None]:
    """Stop the run when the block ends: checked after a pass, best effort after a failure.

    (The rgt_home sweep alone does not stop a live agent: it finds processes by their
    environment, which setproctitle blanks in the agent and the shim, and the agent restarts
    the job the sweep kills.)
    """
    try:
        yield
    except BaseException:
        try:
            cli("stop", name, "--grace", "2")
        except subprocess.TimeoutExpired:
            pass
        raise
    _stop(cli, name)


@pytest.mark.parametrize("tty", [False, True], ids=["notty", "pty"])
def test_survives_ssh_client_killed(sshd: SshServer, cli: Cli, session_out: str, tty: bool) -> None:
    name = f"ssh-kill-{'pty' if tty else 'notty'}"
    line = _open_session_line(cli, name)
    with _stopped_after(cli, name), Session(sshd, line, session_out, tty=tty) as s:
        shell = s.shell_identity()
        job, agent, steps = _running(cli, name)
        assert s.proc.poll() is None, f"the session ended early: {s.output()}"
        _assert_detached(shell, agent=agent, job=job)

        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        sshd.wait_no_sessions()  # the server saw the connection drop and tore the session down
        if tty:  # closing the terminal hung up the remote session: the SIGHUP really came
            _wait_gone(shell, "the remote shell, after its terminal hung up")
        _assert_survived(cli, name, job, agent, steps)


@pytest.mark.parametrize("tty", [False, True], ids=["notty", "pty"])
def test_survives_session_closing_normally(sshd: SshServer, cli: Cli, tty: bool) -> None:
    name = f"ssh-close-{'pty' if tty else 'notty'}"
    with _stopped_after(cli, name):
        try:
            p = sshd.run(_start_line(cli, name), tty=tty, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                "ssh did not return after `rgt-agent start` (something holds the session "
                f"open): {e.stdout!r} {e.stderr!r}"
            ) from None
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
        m = re.search(r"started run \S+: agent pid (\d+), job pid (\d+), attempt 1", p.stdout)
        assert m, p.stdout
        sshd.wait_no_sessions()

        job, agent, steps = _running(cli, name)
        assert (agent.pid, job.pid) == (int(m.group(1)), int(m.group(2))), p.stdout
        _assert_survived(cli, name, job, agent, steps)


def test_survives_explicit_sighup(sshd: SshServer, cli: Cli, session_out: str) -> None:
    name = "ssh-sighup"
    line = _open_session_line(cli, name)
    with _stopped_after(cli, name), Session(sshd, line, session_out, tty=False) as s:
        shell = s.shell_identity()
        job, agent, steps = _running(cli, name)
        rec = read_json(RunDir(name, cli.home).job_record(1))
        assert rec is not None
        shim = procfs.Identity(rec["shim"]["pid"], rec["shim"]["start_ticks"])
        _assert_detached(shell, agent=agent, shim=shim, job=job)

        os.kill(agent.pid, signal.SIGHUP)
        os.kill(shim.pid, signal.SIGHUP)
        os.killpg(shell.pid, signal.SIGHUP)  # the shell leads its own group (sshd's setsid)
        _wait_gone(shell, "the remote shell, after SIGHUP")
        assert s.proc.wait(TIMEOUT) != 0  # the session ended: its command died of SIGHUP
        sshd.wait_no_sessions()
        _assert_survived(cli, name, job, agent, steps)
        assert procfs.is_alive(shim), "the shim died of SIGHUP"
