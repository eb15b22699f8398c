"""`rgt logs N -f` over a real ssh, ended by a person's Ctrl-C.

A terminal's Ctrl-C is a SIGINT to its whole foreground process group: `rgt` and the ssh client
it follows the log through. The client exits 255 on it, which `rgt logs -f` took for a lost
box: "rgt: lost HOST while following the log", exit 3 ("the box does not answer"), to a person
who only stopped reading. The box's sshd is this test's own; every process is stopped by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, rgt_exe, run_rgt, ssh_target
from tests.sshd import start_sshd

JOB = "import time\nprint('job started', flush=True)\ntime.sleep(600)\n"


def test_ctrl_c_ends_logs_follow_quietly_not_as_a_lost_box(tmp_path: Path) -> None:
    ctl, box_home, proj = str(tmp_path / "ctl"), str(tmp_path / "box"), tmp_path / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    server = start_sshd(str(tmp_path / "sshd"))
    env = laptop_env(ctl, box_home)
    name = f"follow-{os.getpid()}"
    argv = ["deploy", ssh_target(server), "--name", name, "--python", sys.executable]
    follower = None
    try:
        p = run_rgt([*argv, "--project", str(proj), "--", sys.executable, "job.py"], env, ctl)
        assert p.returncode == 0, p.stderr
        out = tmp_path / "follow.out"
        with open(out, "wb") as f:
            # Its own process group, as a shell's foreground job: the SIGINT goes to all of it.
            follower = subprocess.Popen(
                [*rgt_exe(), "logs", name, "-f"],
                env=env,
                cwd=ctl,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while b"job started" not in out.read_bytes():
            assert follower.poll() is None, out.read_bytes()[-2000:]
            assert time.monotonic() < deadline, "rgt logs -f printed nothing"
            time.sleep(0.1)
        os.killpg(follower.pid, signal.SIGINT)
        rc = follower.wait(30)
        said = out.read_bytes().decode(errors="replace")
        assert "lost" not in said, said
        assert rc == 0, said
        p = run_rgt(["status", name], env, ctl, timeout=120)
        assert p.returncode == 0 and "RUNNING" in p.stdout, p.stdout + p.stderr
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait(10)
        server.stop()
        _kill_run_processes(box_home)
