"""The deploy's last step: ``rgt-agent start`` on the box (``start_on_box``), and what the
laptop says when it fails (``start_failed``).

The start returns once the job runs, so it waits for the agent's restore: minutes for a large
checkpoint. Meanwhile it says what the agent is doing on its stderr (onbox/agent/detach.py),
shown as it comes, so START_SILENCE bounds its silence, not its run; ssh's keepalive finds a
dead link. Whatever ends the laptop's wait (the link gone, a person's Ctrl-C), the run is
recorded: its agent may well be starting it. So is a run that ended before its job started
(below): the box holds it in that state, and `rgt deploy` there again resumes it.

Most failures are said as the box said them. One is not a failure of the start at all: the box's
agent took its epoch and restored the run's checkpoint, and a SIGTERM (the box preempted) or a
stop came before the job started, so the run ended PREEMPTED (exit 13) or STOPPED (exit 12)
before its first attempt (onbox/agent/detach.py ``NotStarted``). That is said as what happened,
with what to do, and `rgt deploy` exits with the box's code (13 or 12), as `rgt-agent run` does.
Any other refusal of the box's agent keeps its code too where it is one of rgt's (2 a job the
box cannot run, 5 a run held by another agent, 14 the store...): exit 1 is a bug's.
"""

from __future__ import annotations

from typing import Sequence

from controller.registry import Registry, RunRecord
from controller.remote import Remote
from onbox.common.errors import (
    FINAL_EXIT_CODES,
    HostError,
    IntegrityError,
    LockedError,
    NotFound,
    RemoteUnreachable,
    RgtError,
    StoreError,
    UnsafeRefused,
    UsageError,
    WaitInterrupted,
)

# The longest silence of `rgt-agent start` (it says how its agent's restore goes every few
# seconds: onbox/agent/detach.py PROGRESS_EVERY).
START_SILENCE = 120.0

_WHY = {
    "PREEMPTED": "the box was preempted (SIGTERM to its agent)",
    "STOPPED": "a stop (Ctrl-C on the box, `rgt stop`) came",
}
_REMEDY = {
    "PREEMPTED": "run the same `rgt deploy` again, on this box once it is back or on another "
    "with the same store: the run restores its newest sealed checkpoint and resumes from it",
    "STOPPED": "run the same `rgt deploy` again to start it; it restores its newest sealed "
    "checkpoint",
}
# The codes a refusing `rgt-agent start` means as rgt means them (not 3 and 4: on the laptop
# they say the box did not answer or refused the login, which it did not).
_BOX_CODES = {
    c.exit_code
    for c in (
        UsageError,
        LockedError,
        IntegrityError,
        UnsafeRefused,
        NotFound,
        HostError,
        StoreError,
    )
}


def start_failed(label: str, name: str, rc: int, said: str) -> RgtError:
    """The error for ``rgt-agent start`` of run ``name`` exiting ``rc`` on ``label``, which
    printed ``said`` (its stderr, or its stdout when that is empty)."""
    state = next((s for s, code in FINAL_EXIT_CODES.items() if code == rc and s in _WHY), None)
    if state is None:
        err = RgtError(f"rgt-agent start failed on {label} (exit {rc}): {_its_error(said)}")
        if rc in _BOX_CODES:
            err.exit_code = rc
        return err
    err = RgtError(
        f"run {name} did not start on {label}: {_WHY[state]} while its agent restored the "
        f"run's checkpoint, before the job started; the run is {state}",
        _REMEDY[state],
    )
    err.exit_code = rc
    return err


def _its_error(said: str) -> str:
    """What the start said of its failure: from its last ``rgt:`` line on (its error, with the
    lines that error carries), else all of it. Its progress and warnings were on the terminal
    as they came (the relay): not again in the error."""
    lines = said.strip().splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.startswith("rgt: ")), default=None)
    if last is None:
        return "\n".join(lines)
    return "\n".join([lines[last][len("rgt: ") :], *lines[last + 1 :]])


def start_on_box(
    remote: Remote, registry: Registry, rec: RunRecord, label: str, argv: Sequence[str], path: str
) -> None:
    """``argv`` (the agent's start of run ``rec``) in the release's directory ``path`` on
    ``label``; returns once the job runs."""
    try:
        r = remote.sh(
            'cd "$1" || exit 9; shift; exec "$@"', path, *argv, timeout=START_SILENCE, relay=True
        )
    except RemoteUnreachable:
        # The link went while the agent was starting, so it may well be running: remember
        # the run, so that `rgt status` finds it and the next deploy sees it live.
        registry.put(rec)
        raise
    except KeyboardInterrupt:  # the person's Ctrl-C ends the wait, not the start on the box
        registry.put(rec)
        raise WaitInterrupted(
            f"interrupted while {label}'s agent started run {rec.name}: the start goes on "
            "there (its restore, then the job)",
            f"rgt status {rec.name} to see it; rgt stop {rec.name} to stop it",
        ) from None
    if r.rc != 0:  # a preemption during the restore is said as such
        err = start_failed(label, rec.name, r.rc, r.err or r.text)
        if err.exit_code in (FINAL_EXIT_CODES["PREEMPTED"], FINAL_EXIT_CODES["STOPPED"]):
            registry.put(rec)  # the run is there, in that state: `rgt status` must find it
        raise err
