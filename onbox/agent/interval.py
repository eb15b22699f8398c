"""``checkpoint.interval = "auto"``: how often the agent asks the job for a checkpoint, from the
run's own history, recomputed as the run goes (the formula: onbox/common/daly.py).

Three measurements, all from the run's events:

- ``d``, what one checkpoint costs the job: the seconds its save held the training loop, as
  the job reports it (rgt's training API does, in progress.json; the sealer carries it on the
  ``sealed`` event as ``blocked_s``). The upload and verification run beside training and cost
  it nothing, so they are not in d: counting them made the interval several times the one
  that loses least (a 20 ms save sealed in a second). A job that does not report its saves
  is measured from the agent's ask to the checkpoint sealed (paired as
  onbox/common/sealtime.py pairs them), which is its cost seen from outside. The median of
  the last SAMPLES (not their longest: an ask that waited for a job still importing its
  framework must not set the interval);
- the seal time, ask to sealed: the interval never goes below it, so that seals do not queue
  behind one another;
- ``M``, the mean time between UNPLANNED stops that LOST WORK, from the seconds the run was up
  under its agents, across restarts and boxes, and its stops (onbox/common/daly.py's ``mtbf``).
  A stop that lost work: a job that died while RUNNING (a crash, an OOM kill, a hang the stall
  probe ended), a preemption whose grace did not see a newer checkpoint sealed, a box that
  vanished without a word (a job that took the box's SIGTERM before its agent did is part of
  that one stop, not a crash before it). A preemption whose final checkpoint was sealed in
  its grace is a covered stop: it lost nothing, and it is evidence that the next one may not
  either. A stop that was asked for (``rgt-agent stop``, success, the meter cap, Slurm's
  warning before its time limit and the requeue after it) is neither.

With no stop yet, M is the time the run has survived (a lower bound on its mean), so the
interval starts at the overhead target (onbox/common/daly.py) and grows, as Daly's with M = up,
while the run keeps running.

The history crosses boxes through the events themselves: each agent's first interval event
(``checkpoint_interval`` with ``at_start``) carries the totals of every agent before it, and
the store's mirror of the events (``state/events.jsonl``) is what a fresh box reads, before its
own first mirror replaces it. That copy is then the run's only record of its history: a store
that does not answer the read (after the retries every store read gets) leaves it in place,
unreplaced, until a later pass has read it (``AutoInterval.settle``). An agent's own time
counts from its ``epoch`` event to its last event. The interval never goes below the stall
watcher's floor (``[health.stall] floor``).

The events are untrusted input (the store's copy, a file a crash cut, an older agent's): a
carried total that is no finite amount >= 0 sets that record's totals aside, said once
(``interval_history_unusable``), and absurd ones are bounded (MAX_UP, MAX_STOPS, daly.MAX_D),
so that no record can stop an agent from starting.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common import daly, jsondoc
from onbox.common.errors import StoreError
from onbox.common.sealtime import event_time
from onbox.sealing.stores.base import with_retries

KIND = "checkpoint_interval"
PLANNED = ("slurm_warning", "meter_cap")  # an end that follows these was planned
CHANGE = 0.10  # a new interval this much off the last one is logged
SAMPLES = 9  # the recent measurements of d whose median counts, carried across agents
# The largest totals a history carries (ten years up, a million stops): beyond them a record is
# damaged, and is read as these rather than given to the formula.
MAX_UP = 10 * 365 * 86400.0
MAX_STOPS = 1_000_000


@dataclasses.dataclass
class History:
    """What the agents before this one saw: seconds up, stops that lost work, stops a final
    checkpoint covered, recent ``d``s."""

    up: float = 0.0
    unplanned: int = 0
    ds: Tuple[float, ...] = ()  # the recent measurements of d, oldest first
    covered: int = 0
    reports: bool = False  # the ds are the job's own reports of its blocked saves
    # Why the totals a record carried were set aside (a damaged record): said once, at start.
    unusable: str = dataclasses.field(default="", compare=False)

    @property
    def d(self) -> Optional[float]:
        return statistics.median(self.ds) if self.ds else None


class Segment:
    """One agent's life in the events, from its ``epoch`` event on."""

    def __init__(self, start: float, reports: bool = False) -> None:
        self.start = self.last = start
        self.unplanned = 0
        self.state = ""
        self.stopping = ""
        self.planned = False
        self.final_sealed = False  # a checkpoint newer than the preemption's ask was sealed
        self._sealed_step = -1
        self._final_above: Optional[int] = None  # the newest sealed step at the preemption ask
        # The job ended by SIGTERM while RUNNING, and has not run since: the box's own SIGTERM
        # reaches the job and the agent together, and when the job's exit is written first it
        # is the same stop as the preemption that follows (counted once, by how that ended),
        # else someone else's SIGTERM (counted once the job runs again, or at the end).
        self._term_exit = False
        self._sealed_at_term = -1  # the newest sealed step when the job took that SIGTERM
        # The newest sealed step when the agent's own SIGTERM was handled (``preempt``): the
        # sealer's thread may write a seal between that and STOPPING, and the stop must not be
        # judged by which of the two threads wrote first.
        self._sealed_at_sigterm: Optional[int] = None
        self.samples: List[float] = []  # d: the job's blocked save, else ask to sealed
        self.seals: List[float] = []  # ask to sealed, seconds
        # The job reports its saves' blocked time: from the history on (a new box's first seal
        # can come before the job's report of that save; its ask-to-sealed is no measure of d).
        self.reports = reports
        self._asked: Optional[float] = None

    def feed(self, ev: Dict[str, Any], t: float) -> None:
        self.last = max(self.last, t)
        kind = ev.get("kind")
        if kind == "state":
            self.state = str(ev.get("state") or "")
            if self.state == "STOPPING":
                self.stopping = str(ev.get("reason") or "")
                if self.stopping.startswith("preempt"):
                    self._preempted()
            elif self.state == "RUNNING" and self._term_exit:  # it ran again: not the box's end
                self.unplanned, self._term_exit = self.unplanned + 1, False
        elif kind == "exit" and self.state == "RUNNING" and ev.get("exit_kind") != "success":
            # RUNNING: past the start grace (a crash loop's quick exits lose no work to guard)
            if _by_sigterm(ev):
                self._term_exit, self._sealed_at_term = True, self._sealed_step
            else:
                self.unplanned += 1
        elif kind in PLANNED:
            self.planned = True
        elif kind == "preempt" and self._sealed_at_sigterm is None:
            self._sealed_at_sigterm = self._sealed_step
        elif kind == "checkpoint_asked":
            # The final ask of a preemption (or of its notice) comes before the STOPPING state;
            # events written before ``why`` existed are judged by the state alone.
            why = str(ev.get("why") or "")
            if why.startswith("preemption") or self.stopping.startswith("preempt"):
                self._preempted()
            elif why:  # the timer again (a notice that came to nothing): its cover is spent
                self._final_above, self.final_sealed = None, False
            if self._asked is None:
                self._asked = t
        elif kind == "sealed":
            step = int(_num(ev.get("step")))
            if self._final_above is not None and step > self._final_above:
                self.final_sealed = True
            self._sealed_step = max(self._sealed_step, step)
            blocked = _amount(ev.get("blocked_s"))  # a NaN or infinite report is none
            if blocked is not None:
                # the job's own cost; once a job reports it, the outside view is not mixed in
                self.reports = True
                self._sample(min(max(blocked, 1e-3), daly.MAX_D))
            if self._asked is not None:
                seal = max(t - self._asked, _num(ev.get("seconds")))
                self.seals.append(seal)
                del self.seals[:-SAMPLES]
                if not self.reports:
                    self._sample(seal)
                self._asked = None

    def _preempted(self) -> None:
        """The preemption's first sign (its final ask, or STOPPING): what it must see sealed
        to have lost nothing is a step newer than the newest sealed when the job was stopped,
        by the box's SIGTERM where the job or the agent took it first (its own save on
        SIGTERM, or a checkpoint whose seal ended after it, sealed since, covers it)."""
        if self._final_above is None:
            signs = [self._sealed_step]  # each a snapshot of a rising step: the first is least
            if self._term_exit:
                signs.append(self._sealed_at_term)
            if self._sealed_at_sigterm is not None:
                signs.append(self._sealed_at_sigterm)
            self._final_above = min(signs)
            self.final_sealed = self._sealed_step > self._final_above

    def _sample(self, d: float) -> None:
        self.samples.append(d)
        del self.samples[:-SAMPLES]

    def ds(self, base: History) -> Tuple[float, ...]:
        return (base.ds + tuple(self.samples))[-SAMPLES:]

    def seal_time(self) -> float:
        return statistics.median(self.seals) if self.seals else 0.0

    def ended_covered(self) -> bool:
        """Whether this agent ended in a preemption its final checkpoint covered."""
        if self.planned or self.state not in ("PREEMPTED", "STOPPING"):
            return False
        return self.stopping.startswith("preempt") and self.final_sealed

    def ended_unplanned(self, begin: bool) -> bool:
        """Whether this agent's end was an unplanned stop; ``begin``: the next agent began a
        new incarnation (a vanished agent whose job is still running is no stop)."""
        if self.planned or self.state in ("SUCCEEDED", "STOPPED", "FAILED"):
            return False
        if self.state == "PREEMPTED" or self.state == "STOPPING":
            # a preemption lost work only when its grace saw no newer checkpoint sealed
            return self.stopping.startswith("preempt") and not self.final_sealed
        return begin

    def term_exit_alone(self, begin: bool) -> bool:
        """Whether a job's SIGTERM exit that nothing followed is a stop of its own: not when
        this agent's end was a preemption, or a box gone without a word (the same stop)."""
        if not self._term_exit or self.ended_unplanned(begin):
            return False
        return not (self.state in ("PREEMPTED", "STOPPING") and self.stopping.startswith("preempt"))

    def close(self, base: History, begin: bool) -> History:
        ended = int(self.ended_unplanned(begin)) + int(self.term_exit_alone(begin))
        return History(
            base.up + (self.last - self.start),
            base.unplanned + self.unplanned + ended,
            self.ds(base),
            base.covered + int(self.ended_covered()),
            self.measured_by_reports(base),
            base.unusable,
        )

    def measured_by_reports(self, base: History) -> bool:
        """Whether the newest ds are the job's reports (this agent's, else those before it)."""
        return self.reports if self.samples else base.reports


def history(events: List[Any], begin: bool) -> History:
    """The totals of every agent in ``events`` (oldest first), the last one's end judged by
    ``begin`` (the agent now starting begins a new incarnation)."""
    base, seg, fresh, ended = History(), None, True, False
    for ev in events:
        t = event_time(ev) if isinstance(ev, dict) else None
        if t is None:
            continue
        kind = ev.get("kind")
        if kind in ("incarnation", "adopt", "boot"):  # the next agent, before its epoch
            fresh, ended = kind != "adopt", True
        if kind == "epoch":
            if seg is not None:
                base = seg.close(base, fresh)
            seg, ended = Segment(t, base.reports), False
            continue
        if ended:
            continue
        if kind == KIND and ev.get("at_start"):  # that agent's own reading of the history
            base = _carried(ev)
            if seg is not None:
                seg.reports = seg.reports or base.reports
        if seg is not None:
            seg.feed(ev, t)
    return seg.close(base, begin) if seg is not None else base


def _carried(ev: Dict[str, Any]) -> History:
    """The totals an agent's first interval event carries, bounded (absent ones are 0, as
    older agents left them out). The events come from the store's copy or a file a crash cut:
    where one of them is no amount at all (NaN, infinite, negative, not a number), the record
    is damaged and none of it is trusted: an empty history, saying why."""
    ds = ev.get("base_ds")
    ds = ds[-SAMPLES:] if isinstance(ds, list) else []
    keys = ("base_up_s", "base_unplanned", "base_covered")
    bad = [f"{k}={ev.get(k)!r:.40}" for k in keys if k in ev and _amount(ev[k]) is None]
    bad += [f"base_ds={ds!r:.80}"] if any(_amount(x) is None for x in ds) else []
    if bad:
        why = "the record of the run's history is damaged (" + ", ".join(bad) + ")"
        return History(unusable=why)
    return History(
        min(_num(ev.get("base_up_s")), MAX_UP),
        int(min(_num(ev.get("base_unplanned")), MAX_STOPS)),
        tuple(min(_num(x), daly.MAX_D) for x in ds),
        int(min(_num(ev.get("base_covered")), MAX_STOPS)),
        ev.get("base_reports") is True,
    )


def _by_sigterm(ev: Dict[str, Any]) -> bool:
    """Whether an ``exit`` event is the job's end by SIGTERM (its signal, or a shell's 143)."""
    return ev.get("signal") == signal.SIGTERM or ev.get("code") == 128 + signal.SIGTERM


def _amount(v: Any) -> Optional[float]:
    """``v`` as a count or seconds: a finite number >= 0, else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:  # an int of hundreds of digits: JSON has no bound on them
            return None
        if math.isfinite(f) and f >= 0:
            return f
    return None


def _num(v: Any) -> float:
    """An amount from an event, 0 where there is none (never NaN, infinite or negative)."""
    f = _amount(v)
    return 0.0 if f is None else f


def parse_lines(data: bytes) -> List[Any]:
    out = []
    for raw in data.splitlines():
        try:
            out.append(jsondoc.loads(raw))
        except ValueError:
            continue
    return out


def load_history(
    local: List[Any], remote: Callable[[], Optional[bytes]], begin: bool
) -> Optional[History]:
    """The history from this box's events when an agent of the run ran here before, else from
    the store's mirror of them (a fresh box), read before this agent mirrors its own; None
    when the store did not give its copy (retried as every store read is): an empty history
    in its place, mirrored over it, would lose the run's for good."""
    if not any(isinstance(e, dict) and e.get("kind") == "epoch" for e in local):
        try:
            data = with_retries(remote)
        except StoreError:
            return None
        if data:
            local = parse_lines(data)
    return history(local, begin)


class AutoInterval:
    """The live interval of one agent: its history, its own segment, read from its events
    file as it grows. A ``base`` of None: the store did not give the history at start; it
    counts as empty, and ``reread`` is tried again at each tick until it gives it."""

    def __init__(
        self,
        base: Optional[History],
        floor: float,
        started: float,
        events_path: str,
        event: Callable[..., None],
        reread: Optional[Callable[[], Optional[History]]] = None,
    ) -> None:
        self.base = base if base is not None else History()
        self.reread = reread if base is None else None
        self.floor = floor
        self.seg = Segment(started, self.base.reports)
        self.path = events_path
        self.event = event
        self.seconds = floor
        self._offset = 0
        self._logged: Optional[float] = None
        self._failed = ""  # the last failure of tick(), said once

    def start(self, now: float) -> None:
        """Skip what is already in the events file (the history), then the first interval.
        A history that cannot be used gives way to an empty one, said once: the agent must
        start (and seal) whatever the record it inherited holds."""
        try:
            self._offset = os.path.getsize(self.path)
        except OSError:
            self._offset = 0
        if self.base.unusable:  # the damaged record's totals are already set aside
            self._unusable(self.base.unusable)
        if self.reread is not None:
            self.event(
                "interval_history_unread",
                "the store did not give the run's history (state/events.jsonl): the interval "
                "starts without it, and the store's copy is not replaced until it is read",
                klass="transient",
                remedy="nothing to do: each sealing pass reads it again",
            )
        try:
            self.update(now, at_start=True)
        except Exception as e:  # carried() and daly's bounds are meant to make this unreachable
            self.base = History()
            self._unusable(f"the run's history gives no interval ({type(e).__name__}: {e})")
            self.update(now, at_start=True)

    def _unusable(self, why: str) -> None:
        self.event(
            "interval_history_unusable",
            f"{why}: the totals it carried are set aside, the interval is chosen without them",
            klass="integrity",
            remedy="nothing to do: the run's checkpoints are not affected",
        )

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being appended is read next time
        self._offset += end
        for ev in parse_lines(data[:end]):
            t = event_time(ev) if isinstance(ev, dict) else None
            if t is not None and ev.get("kind") != KIND:
                self.seg.feed(ev, t)

    def tick(self, now: float) -> float:
        """``update`` for the sealing thread's pass: a failure keeps the interval in force,
        said once, and the pass goes on (raised, it skipped the mirror and backed the
        sealing off, every pass for the rest of the run)."""
        try:
            self.settle(now)
            return self.update(now)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            if why != self._failed:
                self._failed = why
                self.event(
                    "interval_bug",
                    f"the checkpoint interval was not recomputed ({why}); "
                    f"{self.seconds:.0f} s stays in force",
                    klass="permanent",
                    remedy="report this; sealing and mirroring go on",
                )
            return self.seconds

    @property
    def settled(self) -> bool:
        """Whether the history was read: until it is, the store's copy of the events holds
        it alone, and the agent's mirror must not replace that copy."""
        return self.reread is None

    def settle(self, now: float) -> None:
        """Read the history the store did not give at start; once read, it is this agent's
        base, carried by a new at_start event (the one the next box's history() takes)."""
        base = self.reread() if self.reread is not None else None
        if base is None:
            return
        self.base, self.reread, self._logged = base, None, None
        self.seg.reports = self.seg.reports or base.reports
        if base.unusable:
            self._unusable(base.unusable)
        self.update(now, at_start=True)

    def update(self, now: float, at_start: bool = False) -> float:
        """Read new events, recompute; an event when the interval moved by CHANGE or more."""
        self._read()
        self.seg.last = max(self.seg.last, now)
        ds = self.seg.ds(self.base)
        d = statistics.median(ds) if ds else None
        up = self.base.up + (self.seg.last - self.seg.start)
        stops = self.base.unplanned + self.seg.unplanned
        covered = self.base.covered
        m = daly.mtbf(up, stops, covered)
        seal = self.seg.seal_time()
        # Before any stop, the time survived so far grows the interval (daly.py); a seal
        # slower than that sets it, so that seals do not queue (up to daly's longest).
        self.seconds = max(daly.choose(d, m, self.floor, survived=up), min(seal, daly.MAX_INTERVAL))
        old = self._logged
        if at_start or old is None or abs(self.seconds - old) >= CHANGE * old:
            self._logged = self.seconds
            how = (
                "nothing measured yet: the stall floor"
                if d is None
                else f"no stop yet in {up:.0f} s: Daly with M = {up:.0f} s, at most "
                f"{daly.OVERHEAD:.0%} overhead"
                if m is None
                else f"Daly, M = {m:.0f} s from {stops} stop(s) that lost work and {covered} "
                f"a final checkpoint covered in {up:.0f} s"
            )
            cost = (
                "unknown"
                if d is None
                else f"{d:.3f} s, "
                + (
                    "the job's blocked save"
                    if self.seg.measured_by_reports(self.base)
                    else "ask to sealed"
                )
            )
            self.event(
                KIND,
                f"checkpoint interval {self.seconds:.1f} s ({how}; checkpoint cost {cost}, "
                f"seal {seal:.2f} s, floor {self.floor:.0f} s)",
                seconds=round(self.seconds, 3),
                d=d,
                seal_s=round(seal, 3),
                mtbf=m,
                up_s=round(up, 1),
                unplanned=stops,
                covered=covered,
                at_start=at_start,
                base_up_s=round(self.base.up, 1),
                base_unplanned=self.base.unplanned,
                base_covered=self.base.covered,
                base_ds=[round(x, 3) for x in self.base.ds],
                base_reports=self.base.reports,
            )
        return self.seconds
