"""Bad input to ``rgt-agent`` beyond the one-command rows of the hostile-input table
(test_hostile_input.py): a bad value to a live run, unknown runs, an unwritable RGT_HOME; and
what ``start`` creates is the user's alone (0700), parents included.

"Nothing started" is checked on the box itself: no run directory, no process of the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

from onbox.agent import procfs
from tests.conftest import Cli, _kill_run_processes, agent_exe, fixture, require
from tests.laptop import laptop_env, rgt_exe, run_rgt


def _no_processes_of(home: str) -> bool:
    key = home.encode()
    for pid in procfs.pids():
        env = procfs.environ(pid)
        if env and env.get(b"RGT_HOME") == key and pid != os.getpid():
            return False
    return True


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


def _modes(root: str) -> Dict[str, str]:
    """relative path -> octal mode of every directory under root, root included."""
    out = {".": oct(os.stat(root).st_mode & 0o777)}
    for here, dirs, _ in os.walk(root):
        for d in dirs:
            path = os.path.join(here, d)
            out[os.path.relpath(path, root)] = oct(os.stat(path).st_mode & 0o777)
    return out


def test_start_makes_rgt_home_runs_and_the_ckpt_dir_0700_parents_too(
    cli: Cli, tmp_path: Path
) -> None:
    # Under the usual umask 022 a directory made without a mode is 0755: on a shared box every
    # user could read the job's checkpoints and logs.
    home = str(tmp_path / "new" / "home")
    ckpt = str(tmp_path / "ckpts" / "deep" / "ckpt")
    cli.env["RGT_HOME"] = home
    start = [*agent_exe(), "start", "--", *fixture("hang.py")]
    for name, extra in (("dflt", []), ("given", ["--ckpt-dir", ckpt])):
        argv = [*start[:2], "--name", name, *extra, *start[2:]]
        p = subprocess.run(argv, env=cli.env, cwd=cli.home, capture_output=True, text=True,
                           timeout=60, umask=0o022)  # fmt: skip
        assert p.returncode == 0, p.stderr
    try:
        for root in (str(tmp_path / "new"), str(tmp_path / "ckpts")):
            modes = _modes(root)
            assert set(modes.values()) == {"0o700"}, modes
        assert "runs/dflt/ckpt" in _modes(home)
    finally:
        for name in ("dflt", "given"):
            cli("stop", name, "--grace", "0")
        _kill_run_processes(home)


def test_an_existing_ckpt_dir_keeps_its_mode(cli: Cli, tmp_path: Path) -> None:
    ckpt = tmp_path / "mine"
    ckpt.mkdir()
    ckpt.chmod(0o755)
    cli("start", "--name", "keep", "--ckpt-dir", str(ckpt), "--", *fixture("hang.py"), check=True)
    try:
        assert oct(ckpt.stat().st_mode & 0o777) == "0o755"
    finally:
        cli("stop", "keep", "--grace", "0")


def test_secrets_makes_rgt_home_0700(cli: Cli, tmp_path: Path) -> None:
    # `rgt deploy` stores secrets before the first start: it is often what makes RGT_HOME.
    home = tmp_path / "fresh" / "home"
    cli.env["RGT_HOME"] = str(home)
    p = subprocess.run([*agent_exe(), "secrets", "s"], env=cli.env, input='{"A": "b"}',
                       capture_output=True, text=True, timeout=60,
                       umask=0o022)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert set(_modes(str(tmp_path / "fresh")).values()) == {"0o700"}


def test_an_error_said_to_a_stderr_that_is_gone_keeps_its_exit_code(
    cli: Cli, tmp_path: Path
) -> None:
    """``rgt deploy ... 2>&1 | head``, head done: the error's line cannot be written (EPIPE),
    and the exit code is still the error's (2: a bad run name; 8: no such run), not 1 from
    the write's traceback. A closed stderr (fd 2) is the same."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads the pipe any longer: each write to it fails
    env = laptop_env(str(tmp_path / "ctl"), str(tmp_path / "box"))
    deploy = [*rgt_exe(), "deploy", "local", "--name", "a/b", "--", "true"]
    try:
        for argv, code in ((deploy, 2), ([*agent_exe(), "status", "nope"], 8)):
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=write_end, env=env | {"RGT_HOME": cli.home},
                               cwd=str(tmp_path), timeout=60)  # fmt: skip
            assert p.returncode == code, (argv, p.returncode)
        p = subprocess.run(deploy, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, env=env, cwd=str(tmp_path), timeout=60,
                           preexec_fn=lambda: os.close(2))  # fmt: skip
        assert p.returncode == 2
    finally:
        os.close(write_end)


def test_a_deploy_whose_stderr_is_gone_still_starts_its_job(tmp_path: Path) -> None:
    """``rgt deploy ... 2>&1 | head -1``, head done after the first line: every later progress
    line fails to be written (EPIPE). The deploy goes on and starts the job (exit 0), rather
    than stopping at that line with a traceback (exit 1) between its steps, its release pushed
    and the job not started."""
    ctl, box = tmp_path / "ctl", tmp_path / "box"
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    env = laptop_env(str(ctl), str(box))
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads the pipe any longer: each write to it fails
    argv = [*rgt_exe(), "deploy", "local", "--name", "gone", "--python", sys.executable,
            "--project", str(proj), "--", sys.executable, "job.py"]  # fmt: skip
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=write_end, env=env, cwd=str(tmp_path), timeout=300)  # fmt: skip
        assert p.returncode == 0, p.returncode
        st = run_rgt(["status", "gone", "--json"], env, str(tmp_path), timeout=60)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["state"] in ("STARTING", "RUNNING"), st.stdout
    finally:
        os.close(write_end)
        _kill_run_processes(str(box))
