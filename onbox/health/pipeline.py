"""The sealing probe: is the run's work reaching the store? It owns the rules for the upload
backlog, the age of the newest sealed checkpoint, the store's reachability and the box's clock
skew against the store, all read from the sealing service's ``SealView`` (plain values the
sealer's thread keeps; nothing here touches the store).

- age: the newest sealed checkpoint older than ``max_age`` (default 3 x the checkpoint
  interval in force, ``interval = "auto"``'s as it moves, else 6 h; before the first seal, the
  run's age) warns;
- reachability: the store failing since its last good pass, for two failed passes or more,
  warns, and for ``UNREACHABLE_ALERT`` alerts (the checkpoints pile up on a box that may go);
- backlog: ``BACKLOG_WARN`` complete checkpoints or more waiting to be sealed warns (the store
  is slower than the job's checkpoints);
- skew: the store's clock minus the box's, beyond ``skew_warn``, warns (LATEST's times and
  the danger clocks are read against it). Unknown skew (a local store) is not judged.
"""

from __future__ import annotations

import time
from typing import List, Optional

from onbox.health.config import SealingConfig
from onbox.health.verdict import (
    RANK,
    Context,
    Reading,
    SealView,
    Verdict,
    ok,
    unavailable,
    unknown,
)

DEFAULT_MAX_AGE = 6 * 3600.0
UNREACHABLE_ALERT = 1800.0  # seconds the store may fail before the warning is an alert
FAILED_PASSES = 2  # failed seal passes seen before the store counts as unreachable
BACKLOG_WARN = 3


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SealingProbe:
    """Backlog, age of LATEST, store reachability and clock skew of a run with a store."""

    name = "pipeline"

    def __init__(self, cfg: SealingConfig, ckpt_interval: Optional[float], has_store: bool) -> None:
        self.cfg = cfg
        self.has_store = has_store
        self.ckpt_interval = ckpt_interval
        self.max_age = self._max_age(None)
        # The failed passes seen since the store last answered (each has its own error time).
        self._errors: List[float] = []

    def _max_age(self, view: Optional[SealView]) -> float:
        if self.cfg.max_age is not None:
            return self.cfg.max_age
        every = view.interval if view is not None and view.interval else self.ckpt_interval
        return 3 * every if every else DEFAULT_MAX_AGE

    def check(self, ctx: Context) -> Reading:
        if not self.has_store:
            return Reading(unavailable(self.name, "no store: nothing is sealed off the box"))
        view = ctx.sealing
        if view is None:
            return Reading(unknown(self.name, "the sealing service has not started"))
        age = ctx.wall - view.latest_wall if view.latest_wall is not None else None
        self.max_age = self._max_age(view)  # auto's interval moves as the run goes
        sample = {
            "latest_step": view.latest_step,
            "age_s": None if age is None else round(age, 1),
            "backlog": view.backlog,
        }
        found = [
            v
            for v in (
                self._reach(ctx, view),
                self._age(ctx, view, age),
                self._backlog(view),
                self._skew(view),
            )
            if v is not None
        ]
        if found:  # the one of most concern speaks; the others are in its data
            worst = max(found, key=lambda v: RANK[v.level])
            others = [v.reason for v in found if v is not worst]
            if others:
                worst = Verdict(
                    worst.probe,
                    worst.level,
                    worst.code,
                    worst.reason,
                    worst.remedy,
                    worst.klass,
                    {**worst.data, "also": others},
                )
            return Reading(worst, sample)
        if view.latest_step is None:
            return Reading(ok(self.name, "nothing sealed yet"), sample)
        return Reading(
            ok(self.name, f"LATEST is step {view.latest_step}, sealed {_span(age or 0)} ago"),
            sample,
        )

    def close(self) -> None:
        pass

    # ---- the rules
    def _reach(self, ctx: Context, view: SealView) -> Optional[Verdict]:
        failing = view.last_error is not None and view.last_error_wall is not None
        if failing and view.last_ok_wall is not None:
            assert view.last_error_wall is not None
            failing = view.last_error_wall > view.last_ok_wall
        if not failing:
            self._errors = []
            return None
        assert view.last_error_wall is not None
        if view.last_error_wall not in self._errors:
            self._errors.append(view.last_error_wall)
        if len(self._errors) < FAILED_PASSES:
            return None  # one failed pass is a blip; the sealer retries
        since = view.last_ok_wall if view.last_ok_wall is not None else self._errors[0]
        down = ctx.wall - since
        level = "alert" if down >= UNREACHABLE_ALERT else "warn"
        return Verdict(
            self.name,
            level,
            "store_unreachable",
            f"the store has not answered since {_when(since)} ({_span(down)}): {view.last_error}",
            "the checkpoints stay on the box meanwhile; check the store's network and "
            "credentials (rgt-agent status shows the sealer's last error)",
            "transient",
            {"since": since, "error": view.last_error},
        )

    def _age(self, ctx: Context, view: SealView, age: Optional[float]) -> Optional[Verdict]:
        if not ctx.running:
            return None  # a run that is not stepping makes no checkpoints to seal
        if age is None:
            if ctx.run_started is None or ctx.wall - ctx.run_started < self.max_age:
                return None
            reason = (
                f"nothing sealed in the run's first {_span(ctx.wall - ctx.run_started)} "
                f"(max {_span(self.max_age)})"
            )
        elif age < self.max_age:
            return None
        else:
            reason = (
                f"the newest sealed checkpoint (step {view.latest_step}) is {_span(age)} old "
                f"(max {_span(self.max_age)})"
            )
        return Verdict(
            self.name,
            "warn",
            "seal_stale",
            reason,
            "check that the job checkpoints (its trigger, its interval) and that the sealer "
            "finds them in the checkpoint directory; [health.sealing] max_age sets the limit",
            "transient",
        )

    def _backlog(self, view: SealView) -> Optional[Verdict]:
        if view.backlog is None or view.backlog < BACKLOG_WARN:
            return None
        return Verdict(
            self.name,
            "warn",
            "seal_backlog",
            f"{view.backlog} complete checkpoints wait to be sealed",
            "the store is slower than the job checkpoints: checkpoint less often, or make the "
            "checkpoints smaller",
            "transient",
        )

    def _skew(self, view: SealView) -> Optional[Verdict]:
        if view.skew is None or abs(view.skew) <= self.cfg.skew_warn:
            return None
        way = "behind" if view.skew > 0 else "ahead of"
        return Verdict(
            self.name,
            "warn",
            "clock_skew",
            f"this box's clock is {_span(abs(view.skew))} {way} the store's",
            "sync the clock (chrony/ntpd); ages and danger clocks are read against it",
            "transient",
            {"skew": view.skew},
        )
