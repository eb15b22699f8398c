"""`rgt-agent start`'s hand-over: the agent spawned as a daemon (onbox/agent/daemon.py), and
what its ready message means for the command.

The agent says it is up once it has prepared the run (taken its epoch, restored) and begun its
first attempt, or re-attached to a live job. Two things it may say instead are not a start:
it could not begin (the run is FAILED: that error, with its exit code), or the run ended before
its first attempt, because a SIGTERM (a preemption), a Ctrl-C or `rgt-agent stop` came while
the agent prepared it, during a long restore most likely. The latter is ``NotStarted``: one
line saying so, and the exit code `rgt-agent run` gives that final state (FINAL_EXIT_CODES:
13 PREEMPTED, 12 STOPPED), never "started run ..." with exit 0. Both ends of that message are
here: the agent writes it (``say_ready``), ``detach`` reads it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from onbox.agent.daemon import spawn_agent
from onbox.agent.lock import RunLock
from onbox.agent.runner import read_ready
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import FINAL_EXIT_CODES, HostError, RgtError, error_from_code
from onbox.common.rundir import RunDir

READY_TIMEOUT = 10.0


class NotStarted(RgtError):
    """The run ended before its first attempt, while its agent prepared it: ``exit_code`` is
    its final state's (FINAL_EXIT_CODES), as `rgt-agent run` exits."""

    def __init__(self, name: str, state: str) -> None:
        why = {
            "PREEMPTED": "a SIGTERM (a preemption) came",
            "STOPPED": "a stop (Ctrl-C, `rgt-agent stop`) came",
        }.get(state, "it ended")
        super().__init__(
            f"run {name} did not start: {why} while its agent prepared it (took its epoch, "
            f"restored from the store), before its first attempt; the run is {state}",
            f"start it again: rgt-agent start --name {name}"
            + ("; a power-on does it too, rgt-agent boot" if state == "PREEMPTED" else ""),
        )
        self.exit_code = FINAL_EXIT_CODES.get(state) or 1


def say_ready(fd: int, msg: Dict[str, Any]) -> None:
    """The agent's side: write its ready message on ``fd`` and close it (a gone reader is no
    error: `start` may have given up waiting)."""
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
        os.close(fd)
    except OSError:
        pass


def detach(rd: RunDir, lock: RunLock) -> Dict[str, Any]:
    """Spawn the agent of ``rd`` holding ``lock`` (let go here: the agent holds its own copy of
    the descriptor) and return its ready message once it is up and the run started or was
    re-attached to. Raises the agent's own error when it could not begin, NotStarted when the
    run ended before its first attempt, HostError when the agent never said it was up."""
    r, w = os.pipe()
    try:
        spawn_agent(rd, lock.fd, ready_fd=w)
    finally:
        os.close(w)
        lock.release()
    try:
        msg = read_ready(r, READY_TIMEOUT)
    except HostError:
        raise HostError(
            f"the agent for {rd.name!r} did not come up", f"see {rd.agent_log}"
        ) from None
    finally:
        os.close(r)
    if msg.get("ok") is False:  # it could not begin (onbox/agent/loop.py): the run is FAILED, why
        code = int(msg.get("exit_code") or 1)
        raise error_from_code(code, str(msg.get("what")), msg.get("remedy"))
    state = str(msg.get("state"))
    if not msg.get("adopted") and state in TERMINAL_NAMES and FINAL_EXIT_CODES.get(state):
        raise NotStarted(rd.name, state)
    return msg
