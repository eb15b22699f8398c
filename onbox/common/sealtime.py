"""How long a run takes to get a checkpoint into the store when asked for one, measured from
its own events, and the warning lead and stop grace that follow from it.

The measured time of one seal is from a ``checkpoint_asked`` event (the agent asked the job, on
its timer, a sync or a stop) to the first ``sealed`` event after it: the job's own write plus
rgt's upload and verification, which is what a time limit or a preemption has to fit. Where a
run was never asked (``trigger = "none"``), only the upload is known (``sealed``'s ``seconds``):
a lower bound, said so in ``source``.

A scheduler's warning (Slurm's ``--signal=B:USR2@T``) and a pod's
``terminationGracePeriodSeconds`` are derived here from that measurement, never from a constant:
``lead()`` is twice the longest recent seal plus the scheduler's own slack. With nothing measured
yet, the caller's assumption is used and ``source`` says so, so that the user is told to measure
(``rgt smoke``, or one run) and emit again.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Dict, Iterable, List, Optional

RECENT = 10  # the longest of the last RECENT seals counts: checkpoints grow as a run goes on
FACTOR = 2.0  # headroom over the longest measured seal (a busier store, a bigger checkpoint)


@dataclasses.dataclass(frozen=True)
class SealTime:
    """The longest recent seal of a run, in seconds (None: never measured), from how many
    seals, and in words where the number came from."""

    seconds: Optional[float]
    samples: int
    source: str
    upload_only: bool = False  # the job was never asked: the write itself is not included

    def lead(self, assumed: float, slack: float = 0.0, floor: float = 0.0) -> int:
        """Seconds of warning to ask for: FACTOR x the measured seal (``assumed`` when none
        was measured) plus ``slack`` (the scheduler's own lateness), at least ``floor``."""
        base = self.seconds if self.seconds is not None else assumed
        return int(max(floor, math.ceil(FACTOR * base + slack)))

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def event_time(ev: Dict[str, Any]) -> Optional[float]:
    """An event's ``time`` (the journal's ISO 8601, UTC) in epoch seconds; None when it has
    none or an unreadable one (events come from a file a crash may have cut)."""
    t = ev.get("time")
    if not isinstance(t, str):
        return None
    try:
        return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _seconds(ev: Dict[str, Any]) -> Optional[float]:
    s = ev.get("seconds")
    if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0:
        return float(s)
    return None


def measure(events: Iterable[Dict[str, Any]], run: str = "the run") -> SealTime:
    """The seal time of ``run`` from its events (oldest first; foreign or torn ones skipped)."""
    asked_at: Optional[float] = None
    full: List[float] = []
    uploads: List[float] = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        kind = ev.get("kind")
        if kind == "checkpoint_asked":
            t = event_time(ev)
            if t is not None and asked_at is None:
                asked_at = t
        elif kind == "sealed":
            up = _seconds(ev)
            if up is not None:
                uploads.append(up)
            t = event_time(ev)
            if asked_at is not None and t is not None and t >= asked_at:
                full.append(max(t - asked_at, up or 0.0))
                asked_at = None
    if full:
        recent = full[-RECENT:]
        return SealTime(
            max(recent),
            len(recent),
            f"measured: the longest of {len(recent)} asked-for checkpoints of {run} took "
            f"{max(recent):.1f} s from the ask to sealed",
        )
    if uploads:
        recent = uploads[-RECENT:]
        return SealTime(
            max(recent),
            len(recent),
            f"measured: the longest of {len(recent)} seals of {run} took {max(recent):.1f} s "
            "to upload and verify (the job was never asked, so its own write is not included)",
            upload_only=True,
        )
    return SealTime(None, 0, f"not measured: {run} has sealed nothing yet")
