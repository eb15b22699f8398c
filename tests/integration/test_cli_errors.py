"""Bad input to ``rgt-agent``: one line naming the field, a distinct exit code, nothing started.

"Nothing started" is checked on the box itself: no run directory, no process of the run.
"""

from __future__ import annotations

import os
import subprocess
from typing import List

import pytest

from onbox import procfs
from tests.conftest import Cli, fixture, require


def _no_processes_of(home: str) -> bool:
    key = home.encode()
    for pid in procfs.pids():
        env = procfs.environ(pid)
        if env and env.get(b"RGT_HOME") == key and pid != os.getpid():
            return False
    return True


def _assert_refused(cli: Cli, args: List[str], code: int, field: str) -> None:
    p = cli(*args)
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert field in lines[0], lines[0]
    assert p.stdout == ""
    assert not os.path.exists(os.path.join(cli.home, "runs"))
    assert _no_processes_of(cli.home)


@pytest.mark.parametrize(
    "args,field",
    [
        (["start", "--name", "x", "--"], "command"),
        (["start", "--name", "x"], "command"),
        (["start", "--name", "x", "--", ""], "command"),
        (["start", "--name", "x", "--", "no-such-program-rgt"], "command"),
        (["start", "--name", "a/b", "--", "true"], "--name"),
        (["start", "--name", "..", "--", "true"], "--name"),
        (["start", "--name", "x;rm -rf /", "--", "true"], "--name"),
        (["start", "--name", "$(reboot)", "--", "true"], "--name"),
        (["start", "--name", "x", "--grace", "-5", "--", "true"], "--grace"),
        (["start", "--name", "x", "--grace", "soon", "--", "true"], "--grace"),
        (["start", "--name", "x", "--grace", "nan", "--", "true"], "--grace"),
        (["start", "python", "train.py"], "train.py"),
        (["start", "nope.toml", "--", "true"], "JOB.toml"),
        (["run", "--name", "x"], "command"),
    ],
)
def test_bad_values_are_usage_errors(cli: Cli, args: List[str], field: str) -> None:
    _assert_refused(cli, args, 2, field)


def test_unknown_flag(cli: Cli) -> None:
    _assert_refused(cli, ["start", "--nmae", "x", "--", "true"], 2, "--nmae")


def test_stop_with_a_bad_grace(cli: Cli) -> None:
    cli("start", "--name", "g", "--", *fixture("hang.py"), check=True)
    p = cli("stop", "g", "--grace", "-1")
    assert p.returncode == 2 and "--grace" in p.stderr
    assert cli.status("g")["state"] in ("STARTING", "RUNNING")
    cli("stop", "g", "--grace", "1", check=True)


def test_unknown_run(cli: Cli) -> None:
    for args in (["status", "nope"], ["logs", "nope"], ["stop", "nope"]):
        p = cli(*args)
        assert p.returncode == 8 and "no run named 'nope'" in p.stderr, p.stderr


def test_run_directory_not_writable(cli: Cli, tmp_path: object) -> None:
    ro = os.path.join(cli.home, "ro")
    os.makedirs(ro)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro], capture_output=True
        ).returncode
        == 0
    )
    require(mounted, "root, to mount a read-only tmpfs")
    try:
        cli.env["RGT_HOME"] = os.path.join(ro, "home")
        p = cli("start", "--name", "x", "--", "true")
        assert p.returncode == 9, p.stderr
        line = p.stderr.strip()
        assert "\n" not in line and "not writable" in line and "RGT_HOME" in line
        assert _no_processes_of(cli.env["RGT_HOME"])
    finally:
        subprocess.run(["umount", ro], check=True)
