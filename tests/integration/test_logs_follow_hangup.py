"""`rgt logs N -f` over a real ssh, ended from outside: SIGHUP (its terminal closed) or SIGTERM
(`kill PID`, a service manager, `timeout`).

rgt's children run in sessions of their own (controller/children.py), out of the terminal's
reach, so rgt must end them itself. It had no handler for either signal: rgt died at once and
its ssh lived on, following the box's log into a pipe nobody read, until the job's next line
made its write fail (a quiet job: never). Now rgt ends as on the person's Ctrl-C, its ssh by its
PID, and exits 128 + the signal (129, 143). The SIGHUP case writes to a pseudo-terminal whose
other end is closed first, as a closed terminal window leaves it (writes fail: EIO). And a
reader gone (`| head`): rgt's write fails and rgt ends, its ssh with it (it lived on too). The
box's sshd is this test's own; every process is stopped by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, Dict, List, Optional, Union

import psutil

from tests.laptop import job_box, rgt_exe, run_rgt
from tests.polling import wait

JOB = "import time\nprint('job started', flush=True)\ntime.sleep(600)\n"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _follow(env: Dict[str, str], ctl: str, name: str, sig: int, pty: bool) -> None:
    """`rgt logs NAME -f` until the job's line came, then ``sig`` to rgt by its PID: rgt and
    its ssh gone, rgt's exit 128 + ``sig``."""
    seen: List[bytes] = []
    if pty:
        master, slave = os.openpty()
        out: Union[int, IO[bytes]] = slave
    else:
        r, w = os.pipe()
        master, out = r, w
    follower = subprocess.Popen(
        [*rgt_exe(), "logs", name, "-f"], env=env, cwd=ctl, stdin=subprocess.DEVNULL,
        stdout=out, stderr=out, start_new_session=True,  # a shell's job of its own
    )  # fmt: skip
    os.close(out if isinstance(out, int) else out.fileno())

    def read() -> None:
        try:
            for chunk in iter(lambda: os.read(master, 4096), b""):
                seen.append(chunk)
        except OSError:  # (a pty's reading end: EIO once every writer is gone)
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ssh: List[int] = []
    try:
        wait(lambda: b"job started" in b"".join(seen) or follower.poll() is not None, 60,
             "the job's line through rgt logs -f")  # fmt: skip
        assert follower.poll() is None, b"".join(seen)[-2000:]
        ssh = [c.pid for c in psutil.Process(follower.pid).children() if c.name() == "ssh"]
        assert ssh, [c.name() for c in psutil.Process(follower.pid).children()]
        if pty:
            os.close(master)  # the terminal window closed: rgt's writes fail from here on
        os.kill(follower.pid, sig)
        wait(lambda: follower.poll() is not None, 60, "rgt to end", info=lambda: seen[-3:])
        wait(lambda: all(_gone(p) for p in ssh), 60, "rgt's ssh to end")
        assert follower.returncode == 128 + sig, (follower.returncode, b"".join(seen)[-2000:])
    finally:
        for pid in [follower.pid, *ssh]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        follower.wait(10)
        if not pty:
            os.close(master)
        reader.join(10)


def test_sighup_and_sigterm_end_logs_follow_and_its_ssh(tmp_path: Path) -> None:
    name = f"hangup-{os.getpid()}"
    with job_box(tmp_path, JOB, name) as box:
        _follow(box.env, box.ctl, name, signal.SIGHUP, pty=True)
        _follow(box.env, box.ctl, name, signal.SIGTERM, pty=False)
        p = run_rgt(["status", name], box.env, box.ctl, timeout=120)
        assert p.returncode == 0 and "RUNNING" in p.stdout, p.stdout + p.stderr


# A job that prints a line, then another once NEXT exists (the path its first argument).
TWO_LINES = """\
import os, sys, time
print('job started', flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
print('second line', flush=True)
time.sleep(600)
"""


def test_a_reader_gone_ends_logs_follow_and_its_ssh(tmp_path: Path) -> None:
    """`rgt logs N -f | head -1`: once head is done, rgt's next write fails (EPIPE) and rgt
    ends; its ssh went on following the log until the job's next line after that. It is
    killed with rgt now."""
    nxt = tmp_path / "next"
    name = f"reader-{os.getpid()}"
    follower = None
    ssh: List[int] = []
    with job_box(tmp_path, TWO_LINES, name, str(nxt)) as box:
        try:
            follower = subprocess.Popen(
                [*rgt_exe(), "logs", name, "-f"],
                env=box.env,
                cwd=box.ctl,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            assert follower.stdout is not None
            assert follower.stdout.readline() == b"job started\n"
            ssh = [c.pid for c in psutil.Process(follower.pid).children() if c.name() == "ssh"]
            assert ssh, [c.name() for c in psutil.Process(follower.pid).children()]
            follower.stdout.close()  # head is done
            nxt.touch()
            wait(lambda: follower.poll() is not None, 60, "rgt to end")
            wait(lambda: all(_gone(p) for p in ssh), 60, "rgt's ssh to end")
        finally:
            _end(([follower.pid] if follower else []) + ssh, follower)


def _end(pids: List[int], follower: Optional[subprocess.Popen[bytes]]) -> None:
    """Kill by PID what of rgt and its ssh is left, and reap rgt."""
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    if follower is not None:
        follower.wait(10)
