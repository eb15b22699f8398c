"""The laptop side of a test: the real `rgt` CLI as a process, with a controller home and a box
home of the test's own, reaching a test sshd by the command line a platform would print.

``laptop_env(ctl, box)`` is the environment for it (no user ssh config, short keepalive and
connect timeouts so that a cut link ends in seconds, no RGT_HOME of the caller's);
``run_rgt(argv, env, cwd)`` runs it (stdin closed, output captured, bounded by ``timeout``);
``nesting(line)`` says how deep an error line's parentheses go. ``job_box(tmp, job, name)`` is
a job deployed over a test sshd of its own, for a test of what rgt does around a live run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Sequence

from tests.conftest import _kill_run_processes
from tests.sshd import SshServer, start_sshd


def rgt_exe() -> List[str]:
    """The `rgt` command next to this Python (the installed script), else the module."""
    script = os.path.join(os.path.dirname(sys.executable), "rgt")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "controller.cli"]


def ssh_target(server: SshServer) -> str:
    """TARGET for ``server`` as a pasted ssh line (``ssh -p PORT -i KEY user@host``)."""
    return f"ssh -p {server.port} -i {server.client_key} {server.user}@{server.host}"


def laptop_env(ctl_home: str, box_home: str, **more: str) -> Dict[str, str]:
    """`rgt`'s environment: this test's controller home and box home, no ssh config; ``more``
    added last."""
    env = dict(os.environ)
    env.pop("RGT_HOME", None)
    env.update(
        RGT_CONTROLLER_HOME=str(ctl_home),
        RGT_BOX_HOME=str(box_home),
        RGT_SSH_CONFIG="/dev/null",
        RGT_SSH_KEEPALIVE="2",
        RGT_SSH_CONNECT_TIMEOUT="5",
    )
    env.update(more)
    return env


def run_rgt(
    args: Sequence[str], env: Mapping[str, str], cwd: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`rgt ARGS` as a user runs it, bounded by ``timeout``."""
    return subprocess.run(
        [*rgt_exe(), *args],
        env=dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd),
    )


def nesting(text: str) -> int:
    """How deep parentheses go in ``text``: the CLI's line puts the remedy in one pair, so
    a remedy of its own in parentheses reads as a riddle."""
    depth = most = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        most = max(most, depth)
    return most


@dataclasses.dataclass
class JobBox:
    """A test's own sshd and laptop with ``job.py`` deployed as run ``name``; ``deploy`` is the
    `rgt deploy` that did it."""

    server: SshServer
    ctl: str
    box_home: str
    env: Dict[str, str]
    name: str
    deploy: subprocess.CompletedProcess[str]


@contextlib.contextmanager
def job_box(tmp: Path, job: str, name: str, *args: str) -> Iterator[JobBox]:
    """``job`` (a script's text) deployed as ``python job.py ARGS`` over a test sshd of its own
    (its controller home and box home under ``tmp``); the deploy must succeed. On leaving, the
    sshd is stopped and the run's processes killed by PID."""
    ctl, box_home, proj = str(tmp / "ctl"), str(tmp / "box"), tmp / "proj"
    os.mkdir(ctl)
    proj.mkdir()
    (proj / "job.py").write_text(job)
    server = start_sshd(str(tmp / "sshd"))
    env = laptop_env(ctl, box_home)
    argv = ["deploy", ssh_target(server), "--name", name, "--python", sys.executable]
    argv += ["--project", str(proj), "--", sys.executable, "job.py", *args]
    try:
        p = run_rgt(argv, env, ctl)
        assert p.returncode == 0, p.stderr
        yield JobBox(server, ctl, box_home, env, name, p)
    finally:
        server.stop()
        _kill_run_processes(box_home)
