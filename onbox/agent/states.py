"""The run's states and the one table of allowed transitions. Standard library only.

Lifecycle of one incarnation (each ``rgt-agent start`` of a run begins a new one at PENDING)::

    PENDING ──> STARTING ──(start grace passes)──> RUNNING
                   │  ▲                               │
       exit early  │  │ backoff over, no process left │ exit (restartable)
                   ▼  │                               ▼
                 BACKOFF <─────────────────────────────┘
    exit 0 ─────────────────────────────────> SUCCEEDED
    budget spent / deterministic failure ───> FAILED
    PENDING ──(no usable checkpoint to resume, store down)──> FAILED, before any attempt
    STARTING | RUNNING | BACKOFF ──(the same, at a power-on: the power cut the attempt)──> FAILED
    stop or SIGTERM ──> STOPPING ──> STOPPED (asked by `stop`) | PREEMPTED (SIGTERM to the agent)

Terminal states have no exits within an incarnation.
"""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet


class State(str, enum.Enum):
    """A run's state; the value is the name written in state.json."""

    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"

    def __str__(self) -> str:
        return self.value


S = State

TRANSITIONS: Dict[State, FrozenSet[State]] = {
    S.PENDING: frozenset({S.STARTING, S.FAILED, S.STOPPED, S.PREEMPTED}),
    S.STARTING: frozenset({S.RUNNING, S.BACKOFF, S.SUCCEEDED, S.FAILED, S.STOPPING}),
    S.RUNNING: frozenset({S.BACKOFF, S.SUCCEEDED, S.FAILED, S.STOPPING}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPING, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.PREEMPTED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.STOPPED: frozenset(),
    S.PREEMPTED: frozenset(),
}

TERMINAL: FrozenSet[State] = frozenset(s for s, exits in TRANSITIONS.items() if not exits)

# States in which an attempt's processes may exist and must be watched.
# The same as the names state.json holds: what the laptop compares a box's answer with.
TERMINAL_NAMES: FrozenSet[str] = frozenset(s.value for s in TERMINAL)
LIVE_NAMES: FrozenSet[str] = frozenset(s.value for s in State if s not in TERMINAL)
ACTIVE: FrozenSet[State] = frozenset({S.STARTING, S.RUNNING, S.STOPPING, S.BACKOFF})


def can_transition(src: State, dst: State) -> bool:
    """Whether ``src -> dst`` is an edge of the table."""
    return dst in TRANSITIONS[src]
