"""What the laptop says when ``rgt-agent start`` fails on the box at the deploy's last step.

Most failures are said as the box said them. One is not a failure of the start at all: the box's
agent took its epoch and restored the run's checkpoint, and a SIGTERM (the box preempted) or a
stop came before the job started, so the run ended PREEMPTED (exit 13) or STOPPED (exit 12)
before its first attempt (onbox/agent/detach.py ``NotStarted``). That is said as what happened,
with what to do, and `rgt run` exits with the box's code (13 or 12), as `rgt-agent run` does.
"""

from __future__ import annotations

from onbox.common.errors import FINAL_EXIT_CODES, RgtError

_WHY = {
    "PREEMPTED": "the box was preempted (SIGTERM to its agent)",
    "STOPPED": "a stop (Ctrl-C on the box, `rgt stop`) came",
}
_REMEDY = {
    "PREEMPTED": "run `rgt run` again, on this box once it is back or on another with the same "
    "store: the run restores its newest sealed checkpoint and resumes from it",
    "STOPPED": "run `rgt run` again to start it; it restores its newest sealed checkpoint",
}


def start_failed(label: str, name: str, rc: int, said: str) -> RgtError:
    """The error for ``rgt-agent start`` of run ``name`` exiting ``rc`` on ``label``, which
    printed ``said`` (its stderr, or its stdout when that is empty)."""
    state = next((s for s, code in FINAL_EXIT_CODES.items() if code == rc and s in _WHY), None)
    if state is None:
        return RgtError(f"rgt-agent start failed on {label} (exit {rc}): {said.strip()}")
    err = RgtError(
        f"run {name} did not start on {label}: {_WHY[state]} while its agent restored the "
        f"run's checkpoint, before the job started; the run is {state}",
        _REMEDY[state],
    )
    err.exit_code = rc
    return err
