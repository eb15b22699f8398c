"""Crash points: where a test may kill the agent in the middle of a multi-step protocol.

The chaos suite (tests/chaos/) proves that a seal, a prune or a restore cut off at any step
leaves the store in a state the invariants allow (borg's "set one step to None" tests,
CrashMonkey's persistence points). Each step of such a protocol calls ``crash_point(NAME)``;
when the agent runs with ``RGT_CRASH_AT=NAME`` (optionally ``NAME:N``, the Nth time that point
is reached), the process ends there with ``os._exit(137)``, as a SIGKILL would: no ``finally``,
no flush, no clean-up. Unset, the call is one dictionary lookup.

Hold points (``hold_point(NAME, until)``) are where an integration test needs the agent to wait
for it rather than race it: with ``RGT_HOLD_AT=NAME`` the calling thread waits there until
``until()`` is true (at most HOLD_FOR seconds, then goes on), so that what the test does next (a
signal, a SIGKILL) lands at that point on any machine, under any load. With ``RGT_HOLD_UNTIL=PATH``
the hold also ends once the file PATH exists: a test that needs a step to last (a restore longer
than a bound) creates it when it has seen what it waits for. With ``RGT_HOLD_REACHED=PATH`` the
thread creates the file PATH as it begins to wait: a test acts once the agent is held there, not
before. Unset, the call is one dictionary lookup and does nothing.

Stop points: with ``RGT_TEST_STOP_AFTER_EVENT=KIND`` the process that writes an event of that
kind (onbox/agent/journal.py) stops itself (SIGSTOP) right after it, so that a test can queue a
signal at that exact point (the restore just complete, before the first attempt) and SIGCONT it.

Standard library only: the agent and the shim may both import it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

ENV = "RGT_CRASH_AT"
HOLD_ENV = "RGT_HOLD_AT"
RELEASE_ENV = "RGT_HOLD_UNTIL"
REACHED_ENV = "RGT_HOLD_REACHED"
STOP_AFTER_EVENT = "RGT_TEST_STOP_AFTER_EVENT"

# The named points, so that a test can loop over every step of a protocol and a typo in a
# test is an error rather than a scenario that silently never crashes.
POINTS = (
    "seal.after_object",  # one object of a checkpoint uploaded and verified
    "seal.before_manifest",  # every object uploaded, MANIFEST not yet written
    "seal.after_manifest",  # MANIFEST written, LATEST not yet advanced
    "seal.after_latest",  # LATEST advanced, pruning not yet done
    "prune.after_delete",  # one object of a pruned checkpoint deleted
    "restore.after_object",  # one object of the restored checkpoint downloaded
    "finish.before_done",  # outputs and logs sealed, DONE.json not yet written
    "logs.before_record",  # a log document written, logs-sealed.json not yet told (endlogs)
)

_seen = {}  # type: dict[str, int]


def crash_point(name: str) -> None:
    """End the process here, as SIGKILL would, when ``RGT_CRASH_AT`` names this point."""
    want = os.environ.get(ENV)
    if not want:
        return
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(POINTS)}")
    point, _, nth = want.partition(":")
    if point != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= (int(nth) if nth else 1):
        os._exit(137)


# The named hold points (a typo in a test is an error, not a hold that never happens).
HOLDS = (
    "copy.after_piece",  # a file:// copy wrote one piece (filecopy.copy_from); until: stopped
    "leftovers.after_term",  # the leftovers got SIGTERM, their grace not yet waited; until: never
    "store.get",  # a file:// store's read of a document (local.py get_bytes), hung; until: never
    "store.list",  # a file:// store's listing (local.py list), as on a hung mount; until: never
    "memo.half_written",  # a rank wrote half its memo (onbox/train/rankverify.py); until: never
    "store.put_file",  # a file:// store's upload of a file (local.py put_file), hung; never
)
HOLD_FOR = 120.0  # a hold is let go after this long: a test that never acts fails, not hangs


def hold_point(name: str, until: Callable[[], bool] = lambda: False) -> None:
    """Wait here until ``until()`` (or the file ``RGT_HOLD_UNTIL`` names exists), at most
    HOLD_FOR seconds, when ``RGT_HOLD_AT`` names this point; otherwise return at once."""
    want = os.environ.get(HOLD_ENV)
    if not want:
        return
    for point in (name, want):
        if point not in HOLDS:
            raise ValueError(f"unknown hold point {point!r}; known: {', '.join(HOLDS)}")
    if want != name:
        return
    release, reached = os.environ.get(RELEASE_ENV), os.environ.get(REACHED_ENV)
    if release and os.path.exists(release):
        return
    if reached:
        open(reached, "a").close()
    deadline = time.monotonic() + HOLD_FOR
    while not until() and time.monotonic() < deadline:
        if release and os.path.exists(release):
            return
        time.sleep(0.01)


def stop_after_event(kind: str) -> None:
    """SIGSTOP this process when ``RGT_TEST_STOP_AFTER_EVENT`` names ``kind`` (an event just
    written); otherwise return at once."""
    if os.environ.get(STOP_AFTER_EVENT) == kind:
        os.kill(os.getpid(), signal.SIGSTOP)
