"""The training probe: the job's loss and step rate, judged each tick. It owns the rules for a
NaN/inf loss, a loss spike and a throughput drop, and the policy each follows (``alert``: a
verdict; ``stop``: end the run, keeping the last good sealed checkpoint; ``off``). A run with
no store keeps the newest checkpoint on the box at or before the last good loss the probe saw
(finite, not a spike, before the first NaN): the agent sets aside what is newer when the run is
started again (onbox/agent/freeze.py).

Where the loss comes from: progress.json's ``metrics[cfg.metric]`` when the report is of the
running attempt (the training API writes it, at most once a second), and with
``loss_pattern``, the new lines of the attempt's output (read incrementally: never the whole
log; the loss is its group ``loss``, else its first group other than ``step``). A value
counts once: a report or a line naming a step already counted is not new. A line without a
step (a pattern with no ``step`` group) always counts.

The step rate is the median of the step counter's per-tick rates over the last few ticks, or of
the stall probe's ``steps_per_s`` (the rate over its last step interval) when it measured one (a
tick spent writing a checkpoint, or the one interval around it, is not a drop), against the
median rate of the attempt since the job found its speed. As in the stall probe (``StepTime``),
a slow first phase (a compile, dataloader workers spinning up, a first epoch filling a cache)
must not lower that median, or a later throttle to half the speed would pass for normal: the
first ``RATE_WARMUP`` alike rates in a row (the job's speed) make the rates before them
forgotten, and again a later such run faster than ``FASTER`` x the median (the job at speed
after a slow start that had settled). A slower rate that lasts (a drop included) becomes the
median once it outlasted the time at speed.
"""

from __future__ import annotations

import collections
import math
import os
import re
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple, Union

from onbox.common import progress
from onbox.common.logscan import LineReader
from onbox.common.rundir import RunDir
from onbox.health.config import TrainingConfig
from onbox.health.verdict import Action, Context, Reading, Verdict, ok

WINDOW = 50  # finite values the spike median is taken over
MIN_VALUES = 10  # a spike is judged only once this many finite values were seen
RATE_TICKS = 5  # ticks the step rate is measured over
RATE_WARMUP = 5  # rates measured before a drop is judged (the first steps are slow)
RATE_HISTORY = 1000  # rates the attempt's median is taken over (bounded memory)
# A settled run of rates this much faster than the median is the job's speed: what came before
# was a slow start. Jitter seldom sets it off (five rates in a row, each over 1.25x the median;
# then the median is only taken afresh at speed), and a slow start within it lowers the floor
# by a fifth at most.
FASTER = 1.25
READ_BUDGET = 1 << 20  # bytes of new output read per tick at most
TAIL = 64 << 10  # where a probe meets a long log first (an agent that re-attached): its end


def _value(v: Any) -> Optional[float]:
    """A metric as a float ("nan", "inf" included), None when it is not a number."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _median(values: Sequence[float]) -> float:
    """The median (statistics.median, without its imports in the agent: decimal, fractions)."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


class _Attempt:
    """What the probe knows of one attempt; a new attempt starts from nothing."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.reader = LineReader()
        self.opened = False  # the output was looked at once (to skip to its tail if long)
        self.drop_first = False  # the first line read after a skip is a partial line
        self.counted: Optional[int] = None  # the highest step whose loss was counted
        self.step: Optional[int] = None  # the newest step seen (progress or log)
        self.window: Deque[float] = collections.deque(maxlen=WINDOW)
        self.loss: Optional[float] = None
        self.loss_step: Optional[int] = None
        # (value, step) of the non-finite loss judged: the first one (stop: it ends the run),
        # else the newest value's while it is not finite
        self.nan: Optional[Tuple[float, Optional[int]]] = None
        self.failed = False  # the "fail" action was asked for (once)
        self.keep: Optional[int] = None  # LATEST when it was (no store: the box's, below)
        self.good: Optional[int] = None  # the step of the last good loss (finite, no spike)
        # value, step, median and how many values the median was taken over
        self.spike: Optional[Tuple[float, Optional[int], float, int]] = None
        self.ticks: Deque[Tuple[float, int]] = collections.deque(maxlen=RATE_TICKS + 1)
        self.theirs: Deque[float] = collections.deque(maxlen=RATE_TICKS)  # the stall probe's
        self.rates: Deque[float] = collections.deque(maxlen=RATE_HISTORY)
        self.recent: Deque[float] = collections.deque(maxlen=RATE_WARMUP)  # the last rates
        self.settled = False  # the job ran at a speed once: what came before it is forgotten
        self.first_step: Optional[int] = None


class TrainingProbe:
    """Loss NaN/inf and spikes, and throughput drops, of the running attempt."""

    name = "training"

    def __init__(
        self,
        cfg: TrainingConfig,
        rd: RunDir,
        local_keep: Optional[Callable[[int], Optional[int]]] = None,
    ) -> None:
        """``local_keep`` (a run with no store): the step of the newest complete checkpoint
        on the box at or before a step, the one kept when the run is stopped."""
        self.cfg = cfg
        self.rd = rd
        self.local_keep = local_keep
        self.rx = re.compile(cfg.loss_pattern) if cfg.loss_pattern else None
        # The loss is group "loss", else the first group that is not the step's.
        self.group: Union[int, str] = 1
        if self.rx is not None:
            step = self.rx.groupindex.get("step")
            others = [i for i in range(1, self.rx.groups + 1) if i != step]
            self.group = "loss" if "loss" in self.rx.groupindex else (others or [1])[0]
        self.at: Optional[_Attempt] = None

    def check(self, ctx: Context) -> Reading:
        if ctx.attempt < 1:
            return Reading(ok(self.name, "no attempt yet"))
        if self.at is None or self.at.number != ctx.attempt:
            self.at = _Attempt(ctx.attempt)
        at = self.at
        for step, value in self._new_values(ctx, at):
            self._count(at, step, value)
        rate, median_rate = self._rate(ctx, at)
        sample = {
            "loss": at.loss,
            "loss_median": _median(at.window) if at.window else None,
            "steps_per_s": None if rate is None else round(rate, 4),
        }
        verdict, actions = self._judge(ctx, at, rate, median_rate)
        return Reading(verdict, sample, actions)

    def close(self) -> None:
        pass

    # ---- reading
    def _new_values(self, ctx: Context, at: _Attempt) -> List[Tuple[Optional[int], float]]:
        """(step, loss) of the values not counted yet, oldest first; updates ``at.step``."""
        got: List[Tuple[Optional[int], float]] = []
        if self.rx is not None:
            got += self._from_log(ctx, at)
        doc = progress.read(self.rd.path)
        if doc is not None and doc.get("attempt") == ctx.attempt:
            reported = int(doc["step"])
            at.step = reported if at.step is None else max(at.step, reported)
            metrics = doc.get("metrics")
            v = _value(metrics.get(self.cfg.metric)) if isinstance(metrics, dict) else None
            if v is not None:
                got.append((reported, v))
        out: List[Tuple[Optional[int], float]] = []
        for step, v in got:
            if step is not None:
                if at.counted is not None and step <= at.counted:
                    continue  # the same step again (or the other source had it): not new
                at.counted = step
            out.append((step, v))
        return out

    def _from_log(self, ctx: Context, at: _Attempt) -> List[Tuple[Optional[int], float]]:
        assert self.rx is not None
        path = self.rd.output_log(ctx.attempt)
        if not at.opened:
            try:
                size = os.path.getsize(path)
            except OSError:
                return []
            at.opened = True
            if size > TAIL:  # meeting a long log (after a re-attach): only its end is live
                at.reader.offset = size - TAIL
                at.drop_first = True
        lines = at.reader.lines(path, READ_BUDGET, final=not ctx.running)
        if at.drop_first and lines:
            lines, at.drop_first = lines[1:], False
        out: List[Tuple[Optional[int], float]] = []
        with_step = "step" in self.rx.groupindex
        for line in lines:
            m = self.rx.search(line)
            if m is None:
                continue
            try:
                v = _value(m.group(self.group))
                step = int(m.group("step")) if with_step and m.group("step") else None
            except (IndexError, ValueError):
                continue
            if v is None:
                continue
            if step is not None:
                at.step = step if at.step is None else max(at.step, step)
            out.append((step, v))
        return out

    def _count(self, at: _Attempt, step: Optional[int], v: float) -> None:
        at.loss, at.loss_step = v, step if step is not None else at.step
        if not math.isfinite(v):
            if at.nan is None or self.cfg.nan != "stop":
                at.nan = (v, at.loss_step)
            return
        if self.cfg.nan != "stop":
            at.nan = None  # policy alert: the verdict follows the newest value
        at.spike = None
        if len(at.window) >= MIN_VALUES:
            median = _median(at.window)
            if median > 0 and v > self.cfg.spike_factor * median:
                at.spike = (v, at.loss_step, median, len(at.window))
        at.window.append(v)
        if at.nan is None and at.spike is None and at.loss_step is not None:
            at.good = at.loss_step

    def _rate(self, ctx: Context, at: _Attempt) -> Tuple[Optional[float], Optional[float]]:
        """The step rate now and the attempt's median rate (None while not measured)."""
        if not ctx.running or at.step is None:
            at.ticks.clear()  # a gap (a restart, a pause) is not a slow rate
            at.theirs.clear()
            return None, None
        if at.first_step is None:
            at.first_step = at.step
        at.ticks.append((ctx.now, at.step))
        rate: Optional[float] = None
        stall = ctx.readings.get("stall")
        theirs = _value(stall.sample.get("steps_per_s")) if stall is not None else None
        if theirs is not None and math.isfinite(theirs):
            # Its rate is over the last step interval alone: one that spans a checkpoint save
            # is slow once, and the median over the last few ticks is not.
            at.theirs.append(theirs)
            rate = _median(at.theirs)
            if len(at.theirs) < RATE_TICKS:
                return rate, None  # over a few ticks only, as below: not judged yet
        elif len(at.ticks) > RATE_TICKS:
            # The median of the per-tick rates: one tick spent writing a checkpoint (no steps)
            # is not a drop; a slowdown over most of the window is.
            pairs = list(at.ticks)
            each = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(pairs, pairs[1:]) if b[0] > a[0]]
            rate = _median(each) if each else None
        if rate is None or at.step == at.first_step:
            return rate, None  # warm-up: not stepping yet (loading, compiling)
        median = _median(at.rates) if len(at.rates) >= RATE_WARMUP else None
        at.rates.append(rate)
        at.recent.append(rate)
        if self._speed(at, median):
            at.rates.clear()
            at.rates.extend(at.recent)
            at.settled = True
        return rate, median

    def _speed(self, at: _Attempt, median: Optional[float]) -> bool:
        """The last rates are the job's speed, to be judged against from now on: alike (none a
        drop against another), and the first such run or one faster than ``FASTER`` x the
        median so far."""
        if len(at.recent) < RATE_WARMUP:
            return False
        slowest = min(at.recent)
        if slowest < self.cfg.drop_factor * max(at.recent):
            return False  # not steady (yet)
        return not at.settled or (median is not None and slowest > FASTER * median)

    # ---- judging
    def _judge(
        self, ctx: Context, at: _Attempt, rate: Optional[float], median_rate: Optional[float]
    ) -> Tuple[Verdict, List[Action]]:
        cfg = self.cfg
        if at.nan is not None and cfg.nan != "off":
            return self._nan(ctx, at)
        if at.spike is not None and cfg.spike != "off":
            v, step, median, n = at.spike
            where = f" at step {step}" if step is not None else ""
            reason = (
                f"loss {v:.4g}{where} is {v / median:.1f}x the median {median:.4g} of the "
                f"last {n} values"
            )
            remedy = "check the batch and the learning rate; the run goes on"
            return self._by_policy(cfg.spike, "loss_spike", reason, remedy, ctx, at)
        floor = cfg.drop_factor * median_rate if median_rate else None
        if floor is not None and rate is not None and rate < floor and cfg.throughput != "off":
            reason = (
                f"{rate:.3g} steps/s, under {cfg.drop_factor:g}x the attempt's median "
                f"{median_rate:.3g} steps/s"
            )
            remedy = "look for a slow disk or dataloader, throttling, or another process"
            return self._by_policy(cfg.throughput, "throughput_drop", reason, remedy, ctx, at)
        if at.loss is None:
            return ok(self.name, "no loss reported yet"), []
        where = f" at step {at.loss_step}" if at.loss_step is not None else ""
        return ok(self.name, f"loss {at.loss:.4g}{where}"), []

    def _nan(self, ctx: Context, at: _Attempt) -> Tuple[Verdict, List[Action]]:
        assert at.nan is not None
        value, step = at.nan
        where = f" at step {step}" if step is not None else ""
        reason = f"loss is {value}{where}"  # nan, inf or -inf
        if self.cfg.nan != "stop":
            v = Verdict(
                self.name, "alert", "nan_loss", reason, "check the learning rate and the data"
            )
            return v, []
        keep = self._keep(ctx, at)
        again = "fix the learning rate / data and start again"
        if ctx.sealing is None and self.local_keep is not None:  # no store: the box's
            remedy = (
                f"the last good checkpoint is step {keep} in the checkpoint dir"
                if keep is not None
                else "no checkpoint in the checkpoint dir is from before it"
            ) + f"; {again} (the checkpoints after it are set aside then)"
        elif keep is None:
            remedy = f"nothing was sealed before it; {again}"
        elif step is not None and keep > step:  # sealed before the probe saw the value
            remedy = (
                f"LATEST (step {keep}) was sealed after the loss went bad: resume from a "
                f"checkpoint before step {step} (rgt-agent checkpoints); fix the learning "
                "rate / data and start again"
            )
        else:
            remedy = (
                f"the last good checkpoint is step {keep} in the store; fix the learning "
                "rate / data and start again"
            )
        more = {"step": step, "good_step": at.good}
        return self._stop(ctx, at, "nan_loss", reason, remedy, "nan_loss", **more)

    def _keep(self, ctx: Context, at: _Attempt) -> Optional[int]:
        """LATEST when the run was first stopped (what the agent keeps: nothing newer is
        sealed after it). With no store, the newest checkpoint on the box at or before the
        last good loss: the job went on writing checkpoints after the NaN."""
        if not at.failed:
            if ctx.sealing is not None or self.local_keep is None:
                at.keep = ctx.sealing.latest_step if ctx.sealing is not None else None
            else:
                at.keep = None if at.good is None else self.local_keep(at.good)
        return at.keep

    def _by_policy(
        self, policy: str, code: str, reason: str, remedy: str, ctx: Context, at: _Attempt
    ) -> Tuple[Verdict, List[Action]]:
        """``alert``: a warning; ``stop``: an alert that ends the run (the last sealed step
        kept, as for a NaN)."""
        if policy != "stop":
            return Verdict(self.name, "warn", code, reason, remedy, "transient"), []
        return self._stop(ctx, at, code, reason, remedy, "health")

    def _stop(
        self,
        ctx: Context,
        at: _Attempt,
        code: str,
        reason: str,
        remedy: str,
        exit_kind: str,
        **more: Any,
    ) -> Tuple[Verdict, List[Action]]:
        """An alert that ends the run once, sealing nothing newer than LATEST now (the agent
        freezes the sealer at ``keep_step``)."""
        data = {"keep_step": self._keep(ctx, at), "exit_kind": exit_kind}
        v = Verdict(self.name, "alert", code, reason, remedy, "permanent", {**data, **more})
        actions: List[Action] = []
        if not at.failed and ctx.running:
            at.failed = True
            actions.append(Action("fail", reason, "permanent", remedy, data))
        return v, actions
