"""Ending what is left of a run's last attempt once the run is over (or was found over).

An agent that lets go of a run makes sure no process of its last attempt outlives it
(``end_leftovers``). A run can still be found over with processes left: an agent killed between
writing the terminal state and ending them, or whose SIGKILL did not take (a process stuck in
the kernel). ``rgt-agent stop`` of such a run ends them too (onbox/agent/mailbox.py,
``end_found_leftovers``) rather than saying "already STOPPED" over a job that still holds the GPU;
a person's Ctrl-C (or a SIGTERM) to that command ends its waiting at once, saying what was sent,
what is still alive and how to finish, and leaves the run as it ended.

While the run goes on, what an ended attempt left alive is ended before the next one starts
(``Reaper``, which the state machine asks on each tick in BACKOFF): the same SIGTERM, then
SIGKILL after LEFTOVER_GRACE, without blocking the machine.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable, Iterator, List, Optional

from onbox.agent.seams import Runner
from onbox.common.errors import StopFailed
from onbox.common.faults import hold_point

# Orphans of an attempt that ended on its own get this long after SIGTERM before SIGKILL.
LEFTOVER_GRACE = 5.0
KILL_FOR = 10.0  # seconds of SIGKILLs before a process is taken to be stuck in the kernel
Event = Callable[..., None]


def end_leftovers(runner: Runner, event: Event, why: str, sent: Optional[List[str]] = None) -> bool:
    """SIGTERM every live process of ``runner``'s attempt, SIGKILL after LEFTOVER_GRACE, with a
    ``leftovers`` event (``why``); ``leftovers_survived`` when SIGKILL did not take. False when
    nothing was alive; else whether every process is gone now. ``sent`` gets the name of each
    signal as it is first sent."""
    sent = [] if sent is None else sent
    if not runner.alive():
        return False
    event(
        "leftovers",
        why,
        klass="transient",
        remedy="make the job's children exit with it",
    )
    runner.signal(signal.SIGTERM)
    sent.append("SIGTERM")
    hold_point("leftovers.after_term")  # a test kills the agent here, before any SIGKILL
    deadline = time.monotonic() + LEFTOVER_GRACE
    while runner.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + KILL_FOR
    while runner.alive() and time.monotonic() < deadline:
        runner.signal(signal.SIGKILL)
        if "SIGKILL" not in sent:
            sent.append("SIGKILL")
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


class Cut(BaseException):
    """SIGINT or SIGTERM to `rgt-agent stop` while it ends a run's leftovers or waits for a
    live run's stop (onbox/agent/mailbox.py) (a BaseException: nothing on the way keeps it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def cut_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Cut, once (a second one must not cut the clean-up); the
    handlers before are put back after."""
    cut: List[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if not cut:
            cut.append(signum)
            raise Cut(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def end_found_leftovers(
    name: str, attempt: int, runner: Runner, event: Event, alive: Callable[[], List[int]]
) -> None:
    """`rgt-agent stop` of run ``name``, found over with processes of its last ``attempt``
    alive: they end as its agent would have ended them (``end_leftovers``). A Ctrl-C or a
    SIGTERM to the command stops its waiting at once: StopFailed says which signals were sent,
    which pids (``alive``) are left and how to finish. The run's record is not touched: it
    was over and stays as it ended; the caller lets go of the run's lock."""
    sent: List[str] = []
    why = f"processes of attempt {attempt} outlived the run; stopping them"
    try:
        with cut_by_signals():
            end_leftovers(runner, event, why, sent)
    except Cut as cut:
        left = alive()
        did = " then ".join(sent) + " sent to them" if sent else "no signal sent to them yet"
        still = f"still alive: pid {', '.join(map(str, left))}" if left else "none is alive now"
        raise StopFailed(
            f"interrupted ({signal.Signals(cut.signum).name}) while ending the processes attempt "
            f"{attempt} of run {name!r} left: {did}; {still}",
            f"the run stays as it ended; run `rgt-agent stop {name}` again to end them: SIGTERM, "
            f"then SIGKILL after {LEFTOVER_GRACE:.0f}s"
            if left
            else "nothing to do: the run stays as it ended",
        ) from None


class Reaper:
    """Ends what is left of an ended attempt before the next one starts (the supervisor's
    BACKOFF): SIGTERM once, SIGKILL from ``kill_at`` on, one step per ``reaping`` call."""

    def __init__(self, runner: Runner, event: Event) -> None:
        self.runner = runner
        self.event = event
        self.kill_at: Optional[float] = None  # when SIGKILL follows; None until SIGTERM is sent

    def reaping(self, now: float, attempt: int) -> bool:
        """Kill what is left of ``attempt``; True while something is."""
        if not self.runner.alive():
            self.kill_at = None
            return False
        if self.kill_at is None:
            self.event(
                "leftovers",
                f"processes of attempt {attempt} outlived it; stopping them before the next start",
                klass="transient",
                remedy="make the job's children exit with it",
            )
            self.runner.signal(signal.SIGTERM)
            self.kill_at = now + LEFTOVER_GRACE
        elif now >= self.kill_at:
            self.runner.signal(signal.SIGKILL)
        return True
