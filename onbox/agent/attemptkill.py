"""Ending the running attempt on a probe's word (``Supervisor.kill_attempt``): what the end is
for, the stop signal, and the SIGKILL after the grace.

A health probe (onbox/agent/healthuse.py) can have the agent end the running attempt: a stall
(then it restarts) or a training stop such as a NaN loss (then the run fails). ``AttemptKill``
owns that request for the attempt's life: state.json's ``kill`` (the reason, what follows, the
exit kind and class the end is given: classify.ended_by_agent) and when SIGKILL follows. It is
apart from the state machine because it changes no state: the attempt's end comes back to the
supervisor as any exit does, and the supervisor decides it (``_change`` stays its one place).
"""

from __future__ import annotations

import signal
from typing import Any, Dict, Optional

from onbox.agent.classify import Kind
from onbox.agent.journal import iso
from onbox.agent.seams import Clock, Journal, Runner, to_mono, to_wall
from onbox.agent.spec import JobSpec


class AttemptKill:
    """The end of the running attempt asked on a probe's word; ``doc`` is None until asked."""

    def __init__(
        self,
        spec: JobSpec,
        runner: Runner,
        clock: Clock,
        journal: Journal,
        doc: Optional[Dict[str, Any]],
    ) -> None:
        self.spec = spec
        self.runner = runner
        self.clock = clock
        self.journal = journal
        self.doc = doc  # state.json's "kill": what the end was asked for
        self.sigkill_at = to_mono(clock, doc.get("kill_at_ts") if doc else None)

    def clear(self) -> None:
        """A new attempt (or incarnation): nothing asked of it yet."""
        self.doc = None
        self.sigkill_at = None

    def ask(self, reason: str, *, then: str, kind: str, klass: str, remedy: str) -> None:
        """Record the end asked for (``then``: "restart" or "fail"), SIGKILL due after the
        stop grace; ``signal_job`` acts on it once the supervisor has saved it."""
        assert then in ("restart", "fail"), then
        self.sigkill_at = self.clock.monotonic() + self.spec.grace
        at, kill_at = iso(self.clock.time()), to_wall(self.clock, self.sigkill_at)
        kind = Kind(kind).value
        self.doc = dict(reason=reason, then=then, kind=kind, klass=klass, remedy=remedy, at=at)
        self.doc["kill_at_ts"] = kill_at

    def signal_job(self, attempt: int) -> None:
        """The ``kill_attempt`` event, then the stop signal to the attempt's processes."""
        assert self.doc is not None
        then = self.doc["then"]
        self.journal.event(
            "kill_attempt",
            f"ending attempt {attempt} "
            f"({'then restarting' if then == 'restart' else 'and the run'}): {self.doc['reason']}",
            klass=self.doc["klass"],
            remedy=self.doc["remedy"],
            attempt=attempt,
        )
        if self.runner.alive():
            self.runner.signal(self.spec.stop_signal)

    def sigkill_if_due(self, now: float) -> None:
        """SIGKILL what is left of the attempt once the grace after the stop signal is over."""
        due = self.doc is not None and self.sigkill_at is not None and now >= self.sigkill_at
        if due and self.runner.alive():
            self.runner.signal(signal.SIGKILL)

    def wakeup(self, now: float) -> float:
        """Seconds until the supervisor should tick again while the attempt is being ended."""
        return max(0.05, min(0.5, (self.sigkill_at or now) - now))
