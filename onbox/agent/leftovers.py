"""Ending what is left of a run's last attempt once the run is over (or was found over).

An agent that lets go of a run makes sure no process of its last attempt outlives it
(``end_leftovers``). A run can still be found over with processes left: an agent killed between
writing the terminal state and ending them, or whose SIGKILL did not take (a process stuck in
the kernel). ``rgt-agent stop`` of such a run ends them too (onbox/agent/mailbox.py) rather
than saying "already STOPPED" over a job that still holds the GPU.
"""

from __future__ import annotations

import signal
import time
from typing import Callable

from onbox.agent.seams import Runner
from onbox.common.faults import hold_point

# Orphans of an attempt that ended on its own get this long after SIGTERM before SIGKILL.
LEFTOVER_GRACE = 5.0
KILL_FOR = 10.0  # seconds of SIGKILLs before a process is taken to be stuck in the kernel
Event = Callable[..., None]


def end_leftovers(runner: Runner, event: Event, why: str) -> bool:
    """SIGTERM every live process of ``runner``'s attempt, SIGKILL after LEFTOVER_GRACE, with a
    ``leftovers`` event (``why``); ``leftovers_survived`` when SIGKILL did not take. False when
    nothing was alive; else whether every process is gone now."""
    if not runner.alive():
        return False
    event(
        "leftovers",
        why,
        klass="transient",
        remedy="make the job's children exit with it",
    )
    runner.signal(signal.SIGTERM)
    hold_point("leftovers.after_term")  # a test kills the agent here, before any SIGKILL
    deadline = time.monotonic() + LEFTOVER_GRACE
    while runner.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + KILL_FOR
    while runner.alive() and time.monotonic() < deadline:
        runner.signal(signal.SIGKILL)
        time.sleep(0.05)
    if runner.alive():
        event(
            "leftovers_survived",
            "processes of the last attempt survived SIGKILL (stuck in the kernel?)",
            klass="permanent",
            remedy="look for D-state processes; GPU memory may be held",
        )
        return False
    return True
