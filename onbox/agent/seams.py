"""What the supervisor acts through, injected so that its policy is tested without processes or
sleeping: the ``Runner`` (the attempt's processes), the ``Clock``, the ``Journal`` (state.json
and events) and the ``Hooks`` later parts plug into (sealing at a stop, the sealed step)."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Protocol


class Journal(Protocol):
    """What the supervisor writes through; files in the agent, a list in policy tests."""

    def save(self, doc: Dict[str, Any]) -> None: ...

    def event(
        self, kind: str, reason: str, *, klass: Optional[str] = None, remedy: str = "", **data: Any
    ) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class RealClock:
    """The system clocks: monotonic for decisions, wall time for records."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


# Deadlines are monotonic in memory and wall-clock on disk (an agent started again converts).
def to_mono(clock: Clock, wall: Optional[float]) -> Optional[float]:
    """A wall-clock time (as state.json keeps it) on ``clock``'s monotonic scale."""
    return None if wall is None else clock.monotonic() + (wall - clock.time())


def to_wall(clock: Clock, mono: Optional[float]) -> Optional[float]:
    """A monotonic deadline of ``clock`` as a wall-clock time, for state.json."""
    return None if mono is None else clock.time() + (mono - clock.monotonic())


class Runner(Protocol):
    """The supervisor's hands: processes of the current attempt."""

    def spawn(self, attempt: int) -> int:
        """Start attempt ``attempt``; return the job's pid."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process of the current attempt (group and tagged)."""

    def alive(self) -> bool:
        """Whether any process of the current attempt is alive (zombies are dead)."""

    def tail(self, limit: int = ...) -> str:
        """The last ``limit`` bytes of the current attempt's output (TAIL_BYTES by default)."""

    def oom_kills(self) -> Optional[int]:
        """The cgroup's OOM-kill count, when the box exposes it."""

    def inodes_exhausted(self) -> bool:
        """Whether the job's filesystems ran out of inodes."""

    def kernel_log_mark(self) -> Optional[int]:
        """Where the kernel log ends now (None where it cannot be read): an attempt's start."""

    def kernel_oom_killed(self, pid: int, after: Optional[int]) -> bool:
        """Whether the kernel log says, after the mark ``after``, that the OOM killer took
        ``pid``."""


class Hooks:
    """Where later parts plug into a stop. The default does nothing.

    ``on_stop_requested`` runs when a stop or preemption begins, before the job is signalled
    (the sealer asks the job for a final checkpoint here); ``before_terminal`` runs once every
    process of the attempt is gone and before the terminal state is written, with ``reason``
    "stop", "preempt" or "success" (the sealer seals what fits, or writes DONE.json). Both get
    ``deadline``, a monotonic time they must return by.
    """

    def on_stop_requested(self, reason: str, deadline: float) -> None:
        pass

    def before_terminal(self, reason: str, deadline: float) -> None:
        pass

    def sealed_step(self) -> Optional[int]:
        """The step LATEST names in the store (None: no store, or nothing sealed yet); the
        crash-loop rule compares it across restarts."""
        return None
