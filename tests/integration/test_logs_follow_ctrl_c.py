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
import time
from pathlib import Path

from tests.laptop import job_box, rgt_exe, run_rgt

JOB = "import time\nprint('job started', flush=True)\ntime.sleep(600)\n"


def test_ctrl_c_ends_logs_follow_quietly_not_as_a_lost_box(tmp_path: Path) -> None:
    name = f"follow-{os.getpid()}"
    follower = None
    with job_box(tmp_path, JOB, name) as box:
        env, ctl = box.env, box.ctl
        try:
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
