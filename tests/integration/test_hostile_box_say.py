"""`rgt deploy`'s progress lines carry the box's text: the job's first line, as the box's log
holds it. A job (the box) printing escape sequences there (a window title, a clipboard write:
OSC 52, a screen cleared) had them reach the laptop's terminal as they came
(onbox/common/terminal.py ``say`` wrote its message raw). Now each control character shows as
'?', as in rgt's errors. Over a real sshd of this test's own; the job is killed by PID at the
end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.sshd import start_sshd

# OSC 52 (the clipboard), OSC 0 (the title), CSI (screen cleared, cursor home), a bell.
FIRST = "\x1b]52;c;b3duZWQ=\x07\x1b]0;owned\x07\x1b[2J\x1b[Hstarted"
JOB = f"import time\nprint({FIRST!r}, flush=True)\ntime.sleep(600)\n"


def test_the_jobs_first_line_reaches_the_terminal_without_escapes(tmp_path: Path) -> None:
    ctl, box_home, proj = str(tmp_path / "ctl"), str(tmp_path / "box"), tmp_path / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    server = start_sshd(str(tmp_path / "sshd"))
    env = laptop_env(ctl, box_home)
    argv = ["deploy", ssh_target(server), "--name", "esc", "--python", sys.executable]
    try:
        p = run_rgt([*argv, "--project", str(proj), "--", sys.executable, "job.py"], env, ctl)
        assert p.returncode == 0, p.stderr
        assert "its first line: ?]52;c;b3duZWQ=??]0;owned??[2J?[Hstarted" in p.stderr
        assert "\x1b" not in p.stderr and "\x07" not in p.stderr
    finally:
        server.stop()
        _kill_run_processes(box_home)
