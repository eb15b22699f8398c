"""`rgt logs`, `rgt status` and `rgt stop` over a real ssh leave no ssh master behind.

Each opens a connection to the box whose master ssh keeps for 60 s after its last use
(ControlPersist, controller/remote.py); a command stops it when done (``Remote.close``). These
three never did: after each, its master stayed a minute, with its control socket. The box's
sshd is this test's own; a master left is killed by its PID.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import List

from tests.laptop import job_box, run_rgt
from tests.polling import wait
from tests.sshd import ssh_naming

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
    name = f"master-{os.getpid()}"
    with job_box(tmp_path, JOB, name) as box:
        try:
            assert _left(box.ctl) == [], "rgt deploy left its master"
            left = {}
            for cmd in (["logs", name], ["status", name], ["stop", name]):
                p = run_rgt(cmd, box.env, box.ctl, timeout=120)
                assert p.returncode == 0, (cmd, p.stdout, p.stderr)
                left[cmd[0]] = _left(box.ctl)
            assert left == {"logs": [], "status": [], "stop": []}
        finally:
            for pid in ssh_naming(_control_dir(box.ctl)):
                os.kill(pid, signal.SIGKILL)
