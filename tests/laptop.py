"""The laptop side of a test: the real `rgt` CLI as a process, with a controller home and a box
home of the test's own, reaching a test sshd by the command line a platform would print.

``laptop_env(ctl, box)`` is the environment for it (no user ssh config, short keepalive and
connect timeouts so that a cut link ends in seconds, no RGT_HOME of the caller's);
``run_rgt(argv, env, cwd)`` runs it (stdin closed, output captured, bounded by ``timeout``);
``nesting(line)`` says how deep an error line's parentheses go.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Mapping, Sequence

from tests.sshd import SshServer


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
