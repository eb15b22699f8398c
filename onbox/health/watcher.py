"""The health watcher: runs the probes every ``interval`` in its own thread, so that a slow
probe never delays the agent's loop, and turns what they say into events, state and samples.

Each tick takes a ``Context`` from the agent, runs the probes in order (a probe that raises is
an ``unknown`` verdict with the error, and the others go on), appends one row to the time
series, writes a ``health`` event for every verdict whose key changed (its level, its code, and
what it is about: ``Verdict.about``), and queues the actions the probes asked for. The agent's
loop takes them (``take_actions``) after it is woken: only the loop changes the run's state.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from onbox.health.config import HealthConfig
from onbox.health.series import Series
from onbox.health.verdict import RANK, Action, Context, Probe, Reading, Verdict


def _plain(v: Any) -> Any:
    """A sample as JSON holds it: NaN and infinities as strings (the loss may be one)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


SAVE_EVERY = 60.0


class HealthWatcher:
    """The probes of one agent, and what they last said."""

    def __init__(
        self,
        cfg: HealthConfig,
        probes: Sequence[Probe],
        context: Callable[[], Context],
        event: Callable[..., None],
        *,
        series: Optional[Series] = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.probes = list(probes)
        self.context = context
        self.event = event
        self.series = series
        self.wake = wake
        self.verdicts: Dict[str, Verdict] = {}
        self.ticks = 0
        self.cpu_s = 0.0  # this thread's CPU time in the probes, for status and the bench
        self.last_tick: Optional[float] = None  # wall time
        self._actions: List[Action] = []
        self._saved: Optional[float] = None  # monotonic, when a save was last asked for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the thread
    def start(self) -> None:
        if self._thread is not None or not self.probes:
            return
        self._thread = threading.Thread(target=self._loop, name="rgt-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for p in self.probes:
            try:
                p.close()
            except Exception:  # a probe's cleanup must not keep the agent from exiting
                pass

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.interval if self.ticks else 1.0):
            try:
                self.tick()
            except Exception as e:  # the watcher must never die of a bug: say so, go on
                self.event(
                    "health_bug",
                    f"{type(e).__name__}: {e}",
                    klass="permanent",
                    remedy="report this; supervision goes on",
                )

    # ---- one pass
    def tick(self) -> List[Verdict]:
        """Run every probe once; returns the verdicts (public for tests and the bench)."""
        t0 = time.thread_time()
        ctx = self.context()
        row: Dict[str, Any] = {"t": round(ctx.wall, 3), "attempt": ctx.attempt, "state": ctx.state}
        actions: List[Action] = []
        changed = False
        out = []
        for probe in self.probes:
            try:
                reading = probe.check(ctx)
            except Exception as e:
                reading = Reading(
                    Verdict(
                        probe.name,
                        "unknown",
                        "probe_bug",
                        f"the {probe.name} probe failed: {type(e).__name__}: {e}",
                        remedy="report this; the other probes go on",
                    )
                )
            ctx.readings[probe.name] = reading
            for k, v in reading.sample.items():
                row[f"{probe.name}.{k}"] = _plain(v)
            actions.extend(reading.actions)
            changed |= self._judge(reading.verdict)
            out.append(reading.verdict)
        if self.series is not None:
            try:
                self.series.append(row)
            except (OSError, ValueError) as e:  # a full disk must not stop the probes
                changed |= self._judge(
                    Verdict("series", "unknown", "series_unwritable", f"samples not written: {e}")
                )
        self.ticks += 1
        self.last_tick = ctx.wall
        self.cpu_s += time.thread_time() - t0
        # state.json's verdicts also say how fresh they are (status shows "12 s ago"): saved
        # on each change, and at least every SAVE_EVERY seconds.
        if changed or self._saved is None or ctx.now - self._saved >= SAVE_EVERY:
            self._saved = ctx.now
            actions.append(Action("save"))
        if actions:
            with self._lock:
                self._actions.extend(actions)
            self.wake()
        return out

    def _judge(self, v: Verdict) -> bool:
        """Record ``v``; an event when its key (level, code, about) changed. True when anything
        changed."""
        prev = self.verdicts.get(v.probe)
        self.verdicts[v.probe] = v
        if prev is not None and prev.key == v.key:
            return prev.reason != v.reason  # the same verdict, updated numbers: state only
        if prev is None and v.level in ("ok", "unavailable"):
            return True  # a first verdict with nothing to say (no GPU here): state only
        concern = RANK[v.level] >= RANK["warn"]
        self.event(
            "health",
            f"{v.probe}: {v.reason}",
            klass=(v.klass or "transient") if concern else None,
            remedy=v.remedy,
            probe=v.probe,
            level=v.level,
            code=v.code,
            was=prev.level if prev is not None else None,
            **({"data": dict(v.data)} if v.data else {}),
        )
        return True

    def take_actions(self) -> List[Action]:
        with self._lock:
            out, self._actions = self._actions, []
        return out

    def to_doc(self) -> Dict[str, Any]:
        """state.json's ``health``: each probe's verdict, and when they were taken."""
        return {
            "probes": {name: v.to_doc() for name, v in sorted(self.verdicts.items())},
            "at": self.last_tick,
            "interval": self.cfg.interval,
            "cpu_s": round(self.cpu_s, 3),
            "ticks": self.ticks,
        }

    def worst(self) -> Optional[Verdict]:
        """The verdict of most concern, None when all are ok (or none ran yet)."""
        bad = [v for v in self.verdicts.values() if RANK[v.level] >= RANK["warn"]]
        return max(bad, key=lambda v: RANK[v.level]) if bad else None
