"""`rgt deploy`'s progress lines carry the box's text: the job's first line, as the box's log
holds it. A job (the box) printing escape sequences there (a window title, a clipboard write:
OSC 52, a screen cleared) had them reach the laptop's terminal as they came
(onbox/common/terminal.py ``say`` wrote its message raw). Now each control character shows as
'?', as in rgt's errors. Over a real sshd of this test's own; the job is killed by PID at the
end.
"""

from __future__ import annotations

from pathlib import Path

from tests.laptop import job_box

# OSC 52 (the clipboard), OSC 0 (the title), CSI (screen cleared, cursor home), a bell.
FIRST = "\x1b]52;c;b3duZWQ=\x07\x1b]0;owned\x07\x1b[2J\x1b[Hstarted"
JOB = f"import time\nprint({FIRST!r}, flush=True)\ntime.sleep(600)\n"


def test_the_jobs_first_line_reaches_the_terminal_without_escapes(tmp_path: Path) -> None:
    with job_box(tmp_path, JOB, "esc") as box:
        said = box.deploy.stderr
        assert "its first line: ?]52;c;b3duZWQ=??]0;owned??[2J?[Hstarted" in said
        assert "\x1b" not in said and "\x07" not in said
