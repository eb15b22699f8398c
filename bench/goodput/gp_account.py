"""Goodput and badput by cause, from what the job printed on each box of one setup.

The job's lines (bench/goodput/gp_job.py) are the record: ``resumed at step N`` starts a
process that continues from N, ``step N attempt A at T`` is a step trained at wall time T,
``saved step N blocked X`` a checkpoint that held the loop X seconds. Replayed in order, each
resume throws away the steps trained past its restore point (they were lost with the box) and
keeps the rest: the steps that counted are the ones kept at the end, each trained once; the
steps lost were trained and thrown away. A process whose first step is not the step after the
one it resumed from is an error (a counted step redone, or one skipped).

Time, in seconds of the budget: goodput time is the counted steps at the preemption-free run's
pace; badput by cause is the provisioning delay (no box), the restart (a box up to its job's
first step: process start, the agent, the restore, torch's import, the job's load; the rsync
back of the hand-made setup is shown apart as restore), the lost work (steps thrown away, at
the job's step time) and the time blocked on checkpoints; what remains is "other" (a job
slowed by the agent or the CPU it shares).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

_RESUMED = re.compile(r"^resumed at step (\d+)\s*$")
_STEP = re.compile(r"^step (\d+) attempt (\S+) at ([0-9.]+)\s*$")
_SAVED = re.compile(r"^saved step (\d+) blocked ([0-9.]+)\s*$")


class Redone(AssertionError):
    """A process's first step does not continue from the step it resumed from."""


@dataclasses.dataclass
class Process:
    """One job process as its output shows it."""

    resumed: int
    steps: List[Tuple[int, float]]  # (step, wall time)
    blocked: float = 0.0


def processes(text: str) -> List[Process]:
    """The job processes in ``text`` (one box's output, or several concatenated), in order."""
    out: List[Process] = []
    resumed: Optional[int] = None
    attempt: Optional[str] = None
    for line in text.splitlines():
        m = _RESUMED.match(line)
        if m:
            resumed, attempt = int(m.group(1)), None
            continue
        m = _STEP.match(line)
        if m:
            step, who, at = int(m.group(1)), m.group(2), float(m.group(3))
            first = resumed is not None or who != attempt or not out
            if not first and out and out[-1].steps and step <= out[-1].steps[-1][0]:
                first = True  # a process started again from scratch by hand (no resume line)
            if first:
                out.append(Process(resumed or 0, []))
                resumed, attempt = None, who
            out[-1].steps.append((step, at))
            continue
        m = _SAVED.match(line)
        if m and out:
            out[-1].blocked += float(m.group(2))
    return out


def replay(procs: Sequence[Process]) -> Tuple[int, int]:
    """(steps that counted, steps trained in all); raises Redone when a process does not
    continue exactly from its restore point, or resumes past what was trained."""
    kept = 0
    trained = 0
    for p in procs:
        if not p.steps:
            continue
        if p.steps[0][0] != p.resumed + 1:
            raise Redone(f"resumed at {p.resumed} but trained step {p.steps[0][0]} first")
        if p.resumed > kept:
            raise Redone(f"resumed at {p.resumed} but only {kept} steps were ever trained")
        for i, (step, _) in enumerate(p.steps):
            if step != p.resumed + 1 + i:
                raise Redone(f"step {step} after {p.steps[i - 1][0]} in one process")
        kept = p.steps[-1][0]
        trained += len(p.steps)
    return kept, trained


@dataclasses.dataclass
class Result:
    setup: str
    counted: int
    trained: int
    boxes: int
    restart_s: float
    restore_s: float
    down_s: float
    blocked_s: float
    lost_s: float

    def goodput(self, ref_steps: int) -> float:
        return self.counted / ref_steps if ref_steps else 0.0

    def causes(self, budget: float, ref_steps: int) -> Dict[str, float]:
        """Badput by cause, in seconds of the budget (``other`` is what is left)."""
        good = budget * self.goodput(ref_steps)
        named = {
            "down": self.down_s,
            "restart": self.restart_s,
            "restore": self.restore_s,
            "lost work": self.lost_s,
            "checkpoints": self.blocked_s,
        }
        named["other"] = max(0.0, budget - good - sum(named.values()))
        return named


def account(
    setup: str, boxes: Sequence[Tuple[float, float, float, str]], down_s: float, step_time: float
) -> Result:
    """``boxes``: (wall time the box was up, and preempted, seconds its hand-made restore
    took, its output). A box preempted before its job's first step spent all its time
    restarting."""
    procs: List[Process] = []
    restart = restore = 0.0
    for up_at, gone_at, restore_s, text in boxes:
        mine = processes(text)
        restore += restore_s
        first = mine[0].steps[0][1] if mine and mine[0].steps else gone_at
        restart += max(0.0, first - up_at - restore_s)
        procs += mine
    counted, trained = replay(procs)
    blocked = sum(p.blocked for p in procs)
    return Result(
        setup,
        counted,
        trained,
        len(boxes),
        restart,
        restore,
        down_s,
        blocked,
        (trained - counted) * step_time,
    )
