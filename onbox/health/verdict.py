"""What a probe says: a ``Verdict`` (one per probe per tick), the samples it read, and the
actions it asks the agent for; the ``Context`` a probe reads; the ``Probe`` protocol.

Levels, in order of concern: ``ok``; ``unavailable`` (the probe cannot run here: no GPU, no
library); ``unknown`` (it could not read its signal this time: treated as busy, never as idle
or dead); ``warn``; ``alert``. A verdict's ``code`` is a short stable name ("inodes_high",
"stalled"): a change of (level, code) is an event, the same verdict again is not. A verdict about
several things at once (the disk probe's filesystems short of room) names them in ``about``: a
change of those is an event too (a second disk running out while the first still is).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

LEVELS = ("ok", "unavailable", "unknown", "warn", "alert")
RANK = {name: i for i, name in enumerate(LEVELS)}
ACTIONS = ("restart", "fail", "free_room", "save")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One probe's judgement of the run now."""

    probe: str
    level: str
    code: str
    reason: str
    remedy: str = ""
    klass: Optional[str] = None  # the event's class when the level is warn or alert
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    about: Tuple[str, ...] = ()  # what the verdict is of, when several things (part of the key)

    def __post_init__(self) -> None:
        assert self.level in RANK, self.level

    @property
    def key(self) -> tuple:  # type: ignore[type-arg]
        return (self.level, self.code, self.about)

    def to_doc(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {"level": self.level, "code": self.code, "reason": self.reason}
        if self.remedy:
            doc["remedy"] = self.remedy
        if self.data:
            doc["data"] = dict(self.data)
        return doc


def ok(probe: str, reason: str, **data: Any) -> Verdict:
    return Verdict(probe, "ok", "ok", reason, data=data)


def unknown(probe: str, reason: str, **data: Any) -> Verdict:
    return Verdict(probe, "unknown", "unknown", reason, data=data)


def unavailable(probe: str, reason: str, **data: Any) -> Verdict:
    return Verdict(probe, "unavailable", "unavailable", reason, data=data)


@dataclasses.dataclass(frozen=True)
class Action:
    """What a probe asks the agent's loop to do (the loop is the one that changes state).

    ``restart``: end the attempt and start again from the newest sealed checkpoint, on the
    error budget; ``fail``: end the attempt and the run (FAILED), sealing nothing newer than
    ``data["keep_step"]``; ``free_room``: let the sealer delete local copies already verified in
    the store; ``save``: write state.json (the verdicts changed)."""

    kind: str
    reason: str = ""
    klass: str = "transient"
    remedy: str = ""
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.kind in ACTIONS, self.kind


@dataclasses.dataclass
class Reading:
    """A probe's answer for one tick: its verdict, the samples for the time series (flat
    name -> number, None when unread), and the actions it asks for."""

    verdict: Verdict
    sample: Dict[str, Any] = dataclasses.field(default_factory=dict)
    actions: List[Action] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SealView:
    """What the sealing service tells the probes (read from its thread; plain values)."""

    latest_step: Optional[int] = None  # LATEST in the store
    latest_wall: Optional[float] = None  # when it was sealed (epoch seconds)
    backlog: Optional[int] = None  # complete checkpoints found, not yet sealed
    last_ok_wall: Optional[float] = None  # the last seal pass that reached the store
    last_error: Optional[str] = None  # the last pass's error, None when it reached the store
    last_error_wall: Optional[float] = None
    skew: Optional[float] = None  # the store's clock minus this box's, seconds (None: unknown)
    ckpt_bytes: Optional[int] = None  # bytes of the newest sealed checkpoint
    interval: Optional[float] = None  # the checkpoint interval now in force (auto: its latest)


@dataclasses.dataclass
class Context:
    """What a probe reads of the run, taken at the start of a tick. Probes run in a fixed
    order and see the readings of the ones before them (``readings``: the stall probe asks
    whether the GPU is idle)."""

    now: float  # monotonic
    wall: float
    state: str
    attempt: int
    attempt_started: Optional[float]  # monotonic
    job_pid: Optional[int]
    tag: Optional[str]  # the attempt's environment tag (onbox/agent/runner.py)
    sealing: Optional[SealView]
    run_started: Optional[float] = None  # wall time this incarnation began (the danger clocks)
    readings: Dict[str, Reading] = dataclasses.field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.state in ("STARTING", "RUNNING") and self.job_pid is not None


class Probe(Protocol):
    """A cheap check, run each tick off the agent's loop. It never raises for a signal it cannot
    read (that is an ``unknown`` verdict); whatever may hang runs in a subprocess with a
    timeout. ``close`` lets go of what it holds (a subprocess, a thread)."""

    name: str

    def check(self, ctx: Context) -> Reading: ...

    def close(self) -> None: ...
