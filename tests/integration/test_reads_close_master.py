"""`rgt logs`, `rgt status` and `rgt stop` over a real ssh leave no ssh master behind.

Each opens a connection to the box whose master ssh keeps for 60 s after its last use
(ControlPersist, controller/remote.py); a command stops it when done (``Remote.close``). These
three never did: after each, its master stayed a minute, with its control socket. The box's
sshd is this test's own; a master left is killed by its PID.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import List

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.polling import wait
from tests.sshd import ssh_naming, start_sshd

JOB = "import time\nprint('job started', flush=True)\ntime.sleep(600)\n"


def _control_dir(ctl: str) -> str:
    """rgt's ssh control directory for the controller home ``ctl`` (controller/controldir.py)."""
    recorded = os.path.join(ctl, "cm-dir")
    if os.path.exists(recorded):
        with open(recorded) as f:
            return f.read().strip()
    return os.path.join(ctl, "cm")


def _left(ctl: str) -> List[int]:
    """The ssh processes still using rgt's control directory: a master left, killed by PID."""
    pids = ssh_naming(_control_dir(ctl))
    try:
        wait(lambda: not ssh_naming(_control_dir(ctl)), 20, "the ssh master to stop")
    except AssertionError:
        for pid in ssh_naming(_control_dir(ctl)):
            os.kill(pid, signal.SIGKILL)
        return pids
    return []


def test_logs_status_and_stop_stop_their_ssh_master(tmp_path: Path) -> None:
    ctl, box_home, proj = str(tmp_path / "ctl"), str(tmp_path / "box"), tmp_path / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    server = start_sshd(str(tmp_path / "sshd"))
    env = laptop_env(ctl, box_home)
    name = f"master-{os.getpid()}"
    argv = ["deploy", ssh_target(server), "--name", name, "--python", sys.executable]
    try:
        p = run_rgt([*argv, "--project", str(proj), "--", sys.executable, "job.py"], env, ctl)
        assert p.returncode == 0, p.stderr
        assert _left(ctl) == [], "rgt deploy left its master"
        left = {}
        for cmd in (["logs", name], ["status", name], ["stop", name]):
            p = run_rgt(cmd, env, ctl, timeout=120)
            assert p.returncode == 0, (cmd, p.stdout, p.stderr)
            left[cmd[0]] = _left(ctl)
        assert left == {"logs": [], "status": [], "stop": []}
    finally:
        for pid in ssh_naming(_control_dir(ctl)):
            os.kill(pid, signal.SIGKILL)
        server.stop()
        _kill_run_processes(box_home)
