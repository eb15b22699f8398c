"""Starting the agent as a daemon: its own session, stdin from /dev/null, output to agent.log,
umask 077, holding the run's lock that its starter hands it by fd.

Closing the SSH session, killing the ssh client, SIGHUP or the laptop sleeping reach neither the
agent nor the job: both are session leaders with no controlling terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import onbox
from onbox.common import jobenv
from onbox.common.rundir import RunDir

TAG_VAR = jobenv.ATTEMPT_TAG
# Variables the agent sets for each attempt of the job; never passed on from its own environment.
JOB_VARS = (
    jobenv.RUN,
    jobenv.RUN_DIR,
    jobenv.CKPT_DIR,
    jobenv.RESUME_FROM,
    jobenv.ATTEMPT,
    jobenv.CKPT_TRIGGER,
    jobenv.STACKS_FILE,
    TAG_VAR,
)


# The user's own PYTHONPATH, kept while rgt's processes run with their own (the job gets it back).
USER_PYTHONPATH = jobenv.USER_PYTHONPATH


def python_argv(module: str) -> List[str]:
    """``python -S -m MODULE``: rgt's own processes skip site (about 2 MiB each) and find their
    imports through the PYTHONPATH that ``agent_environ`` sets."""
    return [sys.executable, "-S", "-m", module]


def agent_argv(name: str) -> List[str]:
    """How the agent is started (the shim uses it too, to start a dead agent again)."""
    return [*python_argv("onbox.agent.loop"), name]


# The packages rgt's processes import from wherever the installer put them (locate only: nothing
# is imported here; setproctitle's own import is avoided, see onbox/agent/title.py).
_DEPENDENCIES = ("setproctitle", "psutil", "watchdog", "click")


def _internal_path() -> List[str]:
    # Wherever this onbox came from (a venv, a source checkout), rgt's processes import the same
    # one; its dependencies may live elsewhere (an editable checkout beside a venv's packages).
    paths = [onbox.import_root()]
    import importlib.util

    for name in _DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            where = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
            if where not in paths:
                paths.append(where)
    return paths


def agent_environ(rd: RunDir) -> Dict[str, str]:
    """The environment of rgt's own processes (agent, shim) for run ``rd``."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env[jobenv.HOME] = rd.home
    env.setdefault(USER_PYTHONPATH, env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(_internal_path())
    return env


def user_environ(environ: Dict[str, str]) -> Dict[str, str]:
    """The environment `start` was given, from an agent's own environment."""
    env = {k: v for k, v in environ.items() if k not in JOB_VARS and k != USER_PYTHONPATH}
    if USER_PYTHONPATH in environ:
        if environ[USER_PYTHONPATH]:
            env["PYTHONPATH"] = environ[USER_PYTHONPATH]
        else:
            env.pop("PYTHONPATH", None)
    return env


def spawn_agent(
    rd: RunDir,
    lock_fd: int,
    *,
    ready_fd: Optional[int] = None,
    adopt_only: bool = False,
    argv: Optional[List[str]] = None,
) -> subprocess.Popen[bytes]:
    """Start the agent detached; it keeps ``lock_fd`` (the caller may close its copy)."""
    args = list(argv or agent_argv(rd.name)) + ["--lock-fd", str(lock_fd)]
    fds = [lock_fd]
    if ready_fd is not None:
        args += ["--ready-fd", str(ready_fd)]
        fds.append(ready_fd)
    if adopt_only:
        args.append("--adopt-only")
    with open(rd.agent_log, "ab") as logf:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            pass_fds=tuple(fds),
            start_new_session=True,
            close_fds=True,
            cwd="/",
            env=agent_environ(rd),
            umask=0o077,
        )


def parse_agent_args(argv: List[str]) -> Dict[str, Any]:
    """``NAME --lock-fd N [--ready-fd N] [--adopt-only]`` (no argparse: the agent stays small)."""
    out: Dict[str, Any] = {"name": argv[0], "lock_fd": None, "ready_fd": None, "adopt_only": False}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--adopt-only":
            out["adopt_only"] = True
            i += 1
        elif a in ("--lock-fd", "--ready-fd"):
            out[a[2:].replace("-", "_")] = int(argv[i + 1])
            i += 2
        else:
            raise SystemExit(f"rgt-agent agent: unknown argument {a!r}")
    return out
