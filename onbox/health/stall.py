"""The stall probe: is the job still stepping? Liveness is the step counter (progress.json, or
the job's progress pattern in its new output lines), never the log's freshness: a telemetry
thread that keeps printing while the training loop hangs in a collective is a stall.

The budget is learned per attempt. Until the first step: ``startup``. The first ``warmup`` step
changes are the warm-up (compilation, cache filling): still the startup budget, and their
intervals teach nothing. Then ``max(floor, factor x the longest interval between step changes
seen since)``, once one was seen (until then, still the startup budget). A one-off slowness
can outlast the warm-up's count (a compile or graph capture spread over many steps, dataloader
workers spinning up, a first epoch filling a cache): once the job runs ``warmup`` alike
intervals in a row (its speed), what came before is forgotten, and again when a later run is
more than ``factor`` x faster, so a later hang is judged by the fast steps (``StepTime``). Until
then the longest interval of all stands. A step slower than ``factor`` x the job's speed that
comes once it is at speed (an eval or a save every N steps) is never forgotten. While
progress.json says ``"phase": "checkpoint"`` or ``"eval"``, that phase's own budget, counted
from when the phase was first seen, and the interval around it teaches nothing. A stall also
needs the GPU idle where one is seen (the GPU probe's ``idle`` sample): a busy or unreadable GPU
means the job may be computing a long step.

On a stall, once per attempt, every thread's stack of each Python process of the attempt goes to
the attempt's stacks file (onbox/health/stacks.py), a ``stall`` event names it with the first
frames, and (``action = "restart"``) the probe asks the agent to end the attempt: the next one
resumes from the newest sealed checkpoint, on the error budget (and the supervisor's crash-loop
rule stops a run whose restarts never advance the sealed step).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common import progress
from onbox.common.logscan import LogScanner
from onbox.common.rundir import RunDir
from onbox.health import stacks
from onbox.health.config import StallConfig
from onbox.health.verdict import Action, Context, Reading, Verdict, ok, unavailable

SCAN_BUDGET = 1 << 20  # bytes of new output read per tick (the rest waits for the next)
PHASES = ("checkpoint", "eval")


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.1f} s"


class _Attempt:
    """What the probe learned of one attempt."""

    def __init__(
        self,
        attempt: int,
        since: float,
        rx: Optional[re.Pattern[str]],
        warmup: int,
        factor: float,
    ) -> None:
        self.attempt = attempt
        self.since = since  # the last step change (or the start, before the first step)
        self.scanner = LogScanner(rx) if rx is not None else None
        self.step: Optional[int] = None
        self.changes = 0  # step changes after the first step seen
        self.learned = StepTime(warmup, factor)  # the step interval, after the warm-up
        self.phase: Optional[str] = None
        self.phase_since = since
        self.phase_seen = False  # a phase came between the last two step changes
        self.fired: Optional[Verdict] = None  # the stall verdict, once it fired
        self.rate: Optional[float] = None


class StepTime:
    """The step interval the budget is learned from, after the warm-up: the longest interval
    since the job found its fastest steady speed. The speed is ``run`` intervals in a row that
    are alike (the longest at most ``factor`` x the shortest), said by the longest of them. A
    run more than ``factor`` x faster than the speed so far (a compile spread over many steps,
    a first epoch filling a cache, done) makes what came before it forgotten. Once the job, at
    its speed, takes a step slower than ``factor`` x it (an eval or a save every N steps), that
    step and every later one stay learned for the rest of the attempt: such a step recurs."""

    def __init__(self, run: int, factor: float) -> None:
        self.run, self.factor = max(1, run), factor
        self.longest = 0.0
        self.speed: Optional[float] = None
        self.recent: List[float] = []  # the last ``run`` intervals
        self.kept = False  # a slow step came at speed: nothing is forgotten any more

    def add(self, interval: float) -> None:
        self.longest = max(self.longest, interval)
        if self.kept:
            return
        if self.speed is not None and interval > self.factor * self.speed:
            self.kept = True
            return
        self.recent = (self.recent + [interval])[-self.run :]
        top = max(self.recent)
        if len(self.recent) < self.run or top > self.factor * min(self.recent):
            return  # not steady (yet): the longest of all stands
        if self.speed is None or self.factor * top < self.speed:
            self.speed = self.longest = top


class StallProbe:
    name = "stall"

    def __init__(
        self,
        cfg: StallConfig,
        rd: RunDir,
        progress_pattern: Optional[str],
        owner: Callable[[Optional[str], Optional[str]], Optional[str]],
        event: Callable[..., None],
        environ: Optional[Dict[str, str]] = None,
    ) -> None:
        self.cfg, self.rd, self.owner, self.event = cfg, rd, owner, event
        # Checked when the run was set up (onbox/agent/spec.py): compiling cannot fail here.
        self.rx = re.compile(progress_pattern) if progress_pattern else None
        self.environ = environ if environ is not None else os.environ
        self.cur: Optional[_Attempt] = None

    def check(self, ctx: Context) -> Reading:
        if self.cfg.action == "off":
            return Reading(unavailable(self.name, "stall detection is off ([health.stall] action)"))
        if not ctx.running:
            return Reading(ok(self.name, "no attempt running"))
        a = self.cur
        if a is None or a.attempt != ctx.attempt:
            # A restarted agent adopting a running attempt counts from now, not from its start.
            start = ctx.now if self.cur is None else (ctx.attempt_started or ctx.now)
            a = self.cur = _Attempt(ctx.attempt, start, self.rx, self.cfg.warmup, self.cfg.factor)
        self._observe(a, ctx)
        since = ctx.now - a.since
        budget, why = self._budget(a, ctx.now)
        sample: Dict[str, Any] = {
            "step": a.step,
            "steps_per_s": a.rate,
            "since_step": round(since, 3),
            "budget": round(budget, 3),
        }
        if a.fired is not None:
            return Reading(a.fired, sample)
        last = f"last step {a.step}" if a.step is not None else "no step yet"
        if since <= budget:
            return Reading(ok(self.name, f"{last}, {_fmt(since)} ago (budget {why})"), sample)
        gpu = self._gpu(ctx)
        if gpu is not None:
            return Reading(
                Verdict(
                    self.name,
                    "warn",
                    "slow_gpu_busy",
                    f"no step for {_fmt(since)} (budget {why}), {last}; not a stall: {gpu}",
                    remedy="a long step, or a phase the job does not report "
                    '(with onbox.train.phase("eval"): ...)',
                    klass="transient",
                ),
                sample,
            )
        return self._stall(a, ctx, since, why, last, sample)

    # ---- the step counter
    def _read_step(self, a: _Attempt, ctx: Context) -> Optional[int]:
        doc = progress.read(self.rd.path)
        if doc is not None and doc.get("attempt") != ctx.attempt:
            doc = None  # an earlier attempt's report
        phase = doc.get("phase") if doc is not None else None
        phase = phase if phase in PHASES else None
        if phase != a.phase:
            a.phase, a.phase_since = phase, ctx.now
        if phase is not None:
            a.phase_seen = True
        if a.scanner is not None:
            found = a.scanner.last(self.rd.output_log(ctx.attempt), SCAN_BUDGET)
            return found if found is not None else a.step
        return doc["step"] if doc is not None else None

    def _observe(self, a: _Attempt, ctx: Context) -> None:
        step = self._read_step(a, ctx)
        if step is None or step == a.step:
            return
        interval = ctx.now - a.since
        if a.step is not None:
            a.changes += 1
            # The warm-up's intervals and one with a checkpoint or eval in it teach nothing.
            if a.changes > self.cfg.warmup and not a.phase_seen:
                a.learned.add(interval)
            if interval > 0:
                a.rate = round(abs(step - a.step) / interval, 4)
        a.step, a.since, a.phase_seen = step, ctx.now, a.phase is not None

    def _budget(self, a: _Attempt, now: float) -> Tuple[float, str]:
        """(seconds, how it was set) for the attempt now."""
        cfg = self.cfg
        if a.phase is not None:
            b = cfg.checkpoint if a.phase == "checkpoint" else cfg.eval
            # The phase's budget counts from when it began, on top of the time before it.
            extra = max(0.0, a.phase_since - a.since)
            return b + extra, f"{_fmt(b)} while in {a.phase}"
        if a.step is None:
            return cfg.startup, f"{_fmt(cfg.startup)} until the first step"
        if a.changes < cfg.warmup:
            return cfg.startup, f"{_fmt(cfg.startup)} during the warm-up ({a.changes}/{cfg.warmup})"
        longest = a.learned.longest
        if longest <= 0:
            # Nothing learned yet (the first interval after the warm-up, or one with a phase in
            # it): the floor alone would end a steady job whose steps are longer than it.
            return cfg.startup, f"{_fmt(cfg.startup)} until a step interval is learned"
        learned = cfg.factor * longest
        if learned <= cfg.floor:
            return cfg.floor, (
                f"{_fmt(cfg.floor)}: the floor, over {cfg.factor:g} x longest interval "
                f"{_fmt(longest)}"
            )
        return learned, f"{_fmt(learned)} = {cfg.factor:g} x longest interval {_fmt(longest)}"

    # ---- the GPU's word
    @staticmethod
    def _gpu(ctx: Context) -> Optional[str]:
        """Why the GPU says "not a stall" (busy, or unreadable: a signal that cannot be read is
        busy, never idle), None when it is idle or there is none: then the step counter alone
        decides."""
        r = ctx.readings.get("gpu")
        if r is None or r.verdict.level == "unavailable":
            return None
        if r.verdict.level == "unknown":
            return "the GPU could not be read (counted as busy)"
        idle = r.sample.get("idle")
        if idle is False:
            return "the GPU is busy"
        if idle is None:  # a GPU whose utilisation cannot be read (MIG): unknown is busy
            return "the GPU's utilisation could not be read (counted as busy)"
        return None

    # ---- the stall
    def _stall(
        self, a: _Attempt, ctx: Context, since: float, why: str, last: str, sample: Dict[str, Any]
    ) -> Reading:
        path = self.rd.stacks(ctx.attempt)
        reason = f"stalled: no step for {_fmt(since)}, budget {why}, {last}"
        try:
            procs = stacks.attempt_processes(ctx.tag, self.owner)
            got = stacks.dump(path, procs, self.environ, why=f"attempt {ctx.attempt}: {reason}")
            how, frames, trouble = got.how, got.frames, ""
        except OSError as e:  # a full disk: the restart matters more than the stacks
            how, frames, trouble = {}, [], f" (stacks not written: {e})"
        answered = sum(1 for v in how.values() if v != "none")
        remedy = f"the stacks of attempt {ctx.attempt} are in {path}{trouble}"
        self.event(
            "stall",
            f"attempt {ctx.attempt} {reason}; stacks of {answered} of {len(how)} Python "
            f"process(es) in {path}",
            klass="transient",
            remedy=remedy,
            stacks=path,
            frames=frames,
            how={str(k): v for k, v in how.items()},
            attempt=ctx.attempt,
            step=a.step,
        )
        a.fired = Verdict(
            self.name,
            "alert",
            "stalled",
            reason,
            remedy=remedy,
            klass="transient",
            data={"stacks": path, "frames": frames, "step": a.step},
        )
        actions: List[Action] = []
        if self.cfg.action == "restart":
            actions.append(Action("restart", reason, klass="transient", remedy=remedy, data={}))
        return Reading(a.fired, sample, actions)

    def close(self) -> None:
        pass
