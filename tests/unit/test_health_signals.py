"""The training, sealing-pipeline and danger-clock probes, rule by rule, on built Contexts (no
sleeping: time is the Context's ``now``/``wall``), reading real progress reports and real output
logs in a temporary run directory.

What a user relies on: a NaN/inf loss stops the run (policy stop) naming its step and the last
good sealed checkpoint, once, or only alerts / is ignored by policy; a spike warns and the run
goes on; a value counted once is not counted again; a slow step rate warns after a warm-up,
and at once after a long slow start (through the agent's watcher and the stall probe's rate); a
store that stopped answering, a stale LATEST, a backlog and a skewed clock each warn; a danger
clock warns at 80% and alerts at 100%, and only clocks that tick while the box runs count.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.agent import freeze
from onbox.agent.journal import MemoryJournal
from onbox.common import progress
from onbox.common.jobenv import COMPLETE_MARKER
from onbox.common.rundir import RunDir
from onbox.health.clocks import ClocksProbe
from onbox.health.config import HealthConfig, SealingConfig, StallConfig, TrainingConfig
from onbox.health.pipeline import SealingProbe
from onbox.health.stall import StallProbe
from onbox.health.training import TrainingProbe
from onbox.health.verdict import Context, Reading, SealView, ok
from onbox.health.watcher import HealthWatcher

WALL = 1_700_000_000.0


def _ctx(**kw: Any) -> Context:
    base: Dict[str, Any] = dict(
        now=100.0, wall=WALL, state="RUNNING", attempt=1, attempt_started=90.0, job_pid=4242,
        tag="r:1:abc", sealing=SealView(latest_step=40, latest_wall=WALL - 10),
        run_started=WALL - 100,
    )  # fmt: skip
    base.update(kw)
    return Context(**base)


@pytest.fixture
def rd(tmp_path: Any) -> RunDir:
    r = RunDir("r", str(tmp_path))
    r.create()
    os.makedirs(r.attempt_dir(1))
    os.makedirs(r.attempt_dir(2))
    return r


def _log(rd: RunDir, attempt: int, *lines: str) -> None:
    with open(rd.output_log(attempt), "a") as f:
        f.write("".join(line + "\n" for line in lines))


def _report(rd: RunDir, step: int, loss: Any, attempt: int = 1) -> None:
    progress.write(rd.path, step, attempt, {"loss": loss})


def _feed(probe: TrainingProbe, rd: RunDir, losses: List[float], **ctx: Any) -> List[Reading]:
    """One progress report and one tick per value, steps 1, 2, ..."""
    out = []
    for i, v in enumerate(losses, 1):
        _report(rd, i, v)
        out.append(probe.check(_ctx(now=100.0 + i, **ctx)))
    return out


# ---- training: NaN / inf
def test_a_nan_loss_stops_the_run_once_naming_its_step_and_the_last_sealed_checkpoint(
    rd: RunDir,
) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    readings = _feed(p, rd, [1.0, 0.9, float("nan")], sealing=SealView(latest_step=2))
    assert [r.verdict.level for r in readings] == ["ok", "ok", "alert"]
    v = readings[-1].verdict
    assert v.code == "nan_loss" and v.reason == "loss is nan at step 3"
    assert v.klass == "permanent" and "last good checkpoint is step 2 in the store" in v.remedy
    [a] = readings[-1].actions
    assert a.kind == "fail" and a.reason == "loss is nan at step 3" and a.klass == "permanent"
    assert a.data == {"keep_step": 2, "exit_kind": "nan_loss"}
    assert math.isnan(readings[-1].sample["loss"])
    # the run is being ended: the verdict stays, the action is not asked again, even when a
    # later value is finite and LATEST moved
    _report(rd, 4, 0.5)
    again = p.check(_ctx(now=110.0, sealing=SealView(latest_step=60)))
    assert again.verdict.code == "nan_loss" and again.verdict.data["keep_step"] == 2
    assert again.actions == []


def test_a_latest_sealed_after_the_nan_is_named_as_such(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _report(rd, 33, float("nan"))
    r = p.check(_ctx())  # LATEST is step 40: sealed before the probe saw the value
    assert "LATEST (step 40) was sealed after the loss went bad" in r.verdict.remedy
    assert "before step 33" in r.verdict.remedy


def test_an_inf_loss_in_the_log_counts_as_well(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(loss_pattern=r"step (?P<step>\d+) loss (?P<loss>\S+)"), rd)
    _log(rd, 1, "step 1 loss 0.5", "epoch 0 done", "step 2 loss inf", "step 3 loss nan")
    r = p.check(_ctx())
    assert r.verdict.level == "alert" and r.verdict.reason == "loss is inf at step 2"
    assert r.actions and r.actions[0].kind == "fail"


def test_nan_policy_alert_only_says_so_and_follows_the_newest_value(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(nan="alert"), rd)
    readings = _feed(p, rd, [1.0, float("nan"), 0.8])
    assert [r.verdict.level for r in readings] == ["ok", "alert", "ok"]
    assert all(not r.actions for r in readings)


def test_nan_policy_off_ignores_it(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(nan="off"), rd)
    readings = _feed(p, rd, [1.0, float("nan")])
    assert [r.verdict.level for r in readings] == ["ok", "ok"] and not readings[-1].actions


def test_a_nan_before_anything_was_sealed_keeps_nothing(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _report(rd, 7, float("nan"))
    r = p.check(_ctx(sealing=SealView()))
    assert r.actions[0].data["keep_step"] is None and "nothing was sealed" in r.verdict.remedy


def test_with_no_store_a_nan_keeps_the_newest_checkpoint_at_or_before_the_last_good_loss(
    rd: RunDir, tmp_path: Any
) -> None:
    """The box's checkpoints at steps 10, 11 (after a spike: not a good loss) and 12 (written
    with NaN weights): step 10 is kept, and the verdict says where it is."""
    ckpt = str(tmp_path / "ckpt")
    for step in (10, 11, 12):
        os.makedirs(os.path.join(ckpt, f"step_{step}"))
        with open(os.path.join(ckpt, f"step_{step}", COMPLETE_MARKER), "w") as f:
            f.write(f'{{"step": {step}}}')
    p = TrainingProbe(TrainingConfig(), rd, lambda good: freeze.last_good(ckpt, good))
    r = _feed(p, rd, [1.0] * 10 + [100.0, float("nan")], sealing=None)[-1]
    assert r.verdict.code == "nan_loss" and r.verdict.data["good_step"] == 10
    assert r.actions[0].data["keep_step"] == 10
    assert "last good checkpoint is step 10 in the checkpoint dir" in r.verdict.remedy


def test_a_nan_report_of_an_earlier_attempt_is_not_this_attempts(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _report(rd, 9, float("nan"), attempt=1)
    r = p.check(_ctx(attempt=2))
    assert r.verdict.level == "ok" and r.verdict.reason == "no loss reported yet"


# ---- training: spikes, counting once
def test_a_spike_warns_after_ten_values_and_the_run_goes_on(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    readings = _feed(p, rd, [1.0] * 9 + [50.0] + [1.0] * 2 + [50.0, 1.0])
    levels = [r.verdict.level for r in readings]
    # the 10th value has only 9 before it: not judged; the 13th is 50x the median of 12
    assert levels == ["ok"] * 12 + ["warn", "ok"]
    v = readings[12].verdict
    assert v.code == "loss_spike" and "at step 13" in v.reason and "50.0x the median 1" in v.reason
    assert all(not r.actions for r in readings)
    assert readings[12].sample["loss_median"] == 1.0


def test_spike_policy_stop_ends_the_run(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(spike="stop"), rd)
    r = _feed(p, rd, [1.0] * 10 + [100.0])[-1]
    assert r.verdict.level == "alert" and r.verdict.code == "loss_spike"
    assert r.actions[0].kind == "fail" and r.actions[0].data["exit_kind"] == "health"


def test_the_same_step_reported_again_is_not_a_new_value(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _feed(p, rd, [1.0] * 10)
    for i in range(5):  # step 10 again and again (a tick faster than the reports)
        p.check(_ctx(now=200.0 + i))
    _report(rd, 11, 50.0)
    assert p.check(_ctx(now=300.0)).verdict.code == "loss_spike"
    # with a median of five more copies of 1.0 the numbers would be the same; what tells is
    # the count of values the median was taken over: 10, not 15
    assert "of the last 10 values" in p.check(_ctx(now=301.0)).verdict.reason


def test_log_lines_and_progress_of_the_same_step_count_once(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(loss_pattern=r"step (?P<step>\d+) loss=(\S+)"), rd)
    _log(rd, 1, *(f"step {i} loss=1.0" for i in range(1, 11)))
    _report(rd, 10, 1.0)
    p.check(_ctx())
    _report(rd, 11, 30.0)
    _log(rd, 1, "step 11 loss=30.0", "step 12 loss=1.0")
    r = p.check(_ctx(now=101.0))
    assert r.verdict.level == "ok" and r.sample["loss"] == 1.0  # step 12 came after the spike
    # 12 values so far (steps 1..12), each once: a spike now names that count
    _report(rd, 13, 40.0)
    assert "of the last 12 values" in p.check(_ctx(now=102.0)).verdict.reason


def test_a_pattern_without_a_loss_group_uses_group_one_and_a_partial_line_waits(
    rd: RunDir,
) -> None:
    p = TrainingProbe(TrainingConfig(loss_pattern=r"loss[=: ]+(\S+)"), rd)
    with open(rd.output_log(1), "w") as f:
        f.write("loss: 0.5\nloss: 0.2")  # the second line is not whole yet
    assert p.check(_ctx()).sample["loss"] == 0.5
    with open(rd.output_log(1), "a") as f:
        f.write("5\n")
    assert p.check(_ctx(now=101.0)).sample["loss"] == 0.25


def test_a_new_attempt_starts_from_nothing(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _feed(p, rd, [float("nan")])
    _report(rd, 3, 0.5, attempt=2)
    r = p.check(_ctx(attempt=2))
    assert r.verdict.level == "ok" and r.sample["loss"] == 0.5 and r.sample["loss_median"] == 0.5


# ---- training: throughput
def _steady(p: TrainingProbe, rd: RunDir, ticks: int, per_tick: int, t0: float, s0: int) -> Any:
    """``ticks`` ticks one second apart, the step advancing ``per_tick`` each; the last
    reading and the step and time reached."""
    r = None
    for i in range(ticks):
        s0 += per_tick
        progress.write(rd.path, s0, 1)
        r = p.check(_ctx(now=t0 + i))
    return r, t0 + ticks, s0


def test_a_throughput_drop_warns_after_a_warm_up(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    r, t, s = _steady(p, rd, 15, 10, 0.0, 0)
    assert r.verdict.level == "ok" and r.sample["steps_per_s"] == 10.0
    r, t, s = _steady(p, rd, 2, 1, t, s)
    assert r.verdict.level == "ok"  # most of the window of 5 ticks is still fast
    r, t, s = _steady(p, rd, 1, 1, t, s)
    assert r.verdict.code == "throughput_drop" and r.verdict.level == "warn"
    assert r.verdict.reason == "1 steps/s, under 0.5x the attempt's median 10 steps/s"
    r, t, s = _steady(p, rd, 6, 10, t, s)
    assert r.verdict.level == "ok"


def test_a_tick_without_steps_while_a_checkpoint_is_written_is_not_a_drop(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    _, t, s = _steady(p, rd, 15, 10, 0.0, 0)
    r, t, s = _steady(p, rd, 1, 0, t, s)  # no step for a whole tick
    assert r.verdict.level == "ok" and r.sample["steps_per_s"] == 10.0
    r, _, _ = _steady(p, rd, 2, 10, t, s)
    assert r.verdict.level == "ok"


def test_no_drop_is_judged_before_the_job_steps_or_while_it_is_not_running(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    progress.write(rd.path, 0, 1)
    for i in range(20):  # loading: the step stays 0
        r = p.check(_ctx(now=float(i)))
        assert r.verdict.level == "ok"
    r = p.check(_ctx(now=30.0, state="BACKOFF", job_pid=None))
    assert r.sample["steps_per_s"] is None


def test_the_stall_probes_rate_is_used_when_it_measured_one(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(), rd)
    stall = Reading(ok("stall", "stepping"), {"steps_per_s": 3.5})
    progress.write(rd.path, 5, 1)
    p.check(_ctx(now=0.0))
    progress.write(rd.path, 6, 1)
    r = p.check(_ctx(now=1.0, readings={"stall": stall}))
    assert r.sample["steps_per_s"] == 3.5


def test_throughput_policy_off(rd: RunDir) -> None:
    p = TrainingProbe(TrainingConfig(throughput="off"), rd)
    _, t, s = _steady(p, rd, 15, 10, 0.0, 0)
    r, _, _ = _steady(p, rd, 6, 1, t, s)
    assert r.verdict.level == "ok"


def _watched(rd: RunDir, phases: List[Tuple[int, int]]) -> List[Tuple[int, str, str]]:
    """The agent's path: its watcher ticking every 10 s over the stall probe then the training
    probe (whose rate is the stall probe's), the job stepping ``per_tick`` steps each tick for
    ``ticks`` ticks, phase after phase; (tick, level, reason) of each training health event."""
    j = MemoryJournal()
    now = [0.0]
    stall = StallProbe(StallConfig(), rd, None, lambda tag, cur: None, j.event)
    w = HealthWatcher(
        HealthConfig(),
        [stall, TrainingProbe(TrainingConfig(), rd)],
        lambda: _ctx(now=now[0], wall=WALL + now[0], attempt_started=0.0, sealing=None),
        j.event,
    )
    step, tick, seen = 0, 0, 0
    out: List[Tuple[int, str, str]] = []
    for ticks, per_tick in phases:
        for _ in range(ticks):
            step += per_tick
            progress.write(rd.path, step, 1)
            w.tick()
            for e in j.events[seen:]:
                if e["kind"] == "health" and e["probe"] == "training":
                    out.append((tick, e["level"], e["reason"]))
            seen = len(j.events)
            tick, now[0] = tick + 1, now[0] + 10.0
    return out


@pytest.mark.parametrize("slow", [5, 14])
def test_a_drop_after_a_long_slow_start_is_reported_and_the_slow_start_never(
    rd: RunDir, slow: int
) -> None:
    """The first half hour at a quarter (or 0.7x) of the speed (a first epoch filling a cache),
    20 minutes at speed (2 steps/s), then a throttle to 0.8 steps/s for 10 minutes: the slow
    start does not lower what the throttle is judged against (it did: never reported)."""
    events = _watched(rd, [(180, slow), (120, 20), (60, 8), (30, 20)])
    assert events[:1] == [  # once most of the last 5 ticks' rates are slow
        (302, "warn", "training: 0.8 steps/s, under 0.5x the attempt's median 2 steps/s")
    ]
    assert [(t, level) for t, level, _ in events[1:]] == [(362, "ok")]  # while it lasted


def test_a_checkpoint_save_across_a_tick_is_not_a_drop_through_the_watcher(rd: RunDir) -> None:
    """A save of 12 s: one tick sees no step, the next only the 8 steps after it (the stall
    probe's rate over those 20 s is 0.4 steps/s); then a save across two ticks."""
    assert _watched(rd, [(60, 20), (1, 0), (1, 8), (30, 20), (2, 0), (1, 20), (30, 20)]) == []


def test_a_fast_start_is_a_drop_only_once_it_was_the_jobs_speed(rd: RunDir) -> None:
    """30 s at 3x the speed (a prefetched queue drained) is not a drop; 3 minutes at it (5
    alike rates in a row: the job's speed) is, until the speed after it outlasted it."""
    assert _watched(rd, [(3, 60), (60, 20)]) == []
    events = [(t, level) for t, level, _ in _watched(rd, [(18, 60), (60, 20)])]
    assert events == [(20, "warn"), (35, "ok")]


# ---- sealing pipeline
def _seal(view: SealView, probe: Optional[SealingProbe] = None, **ctx: Any) -> Reading:
    p = probe or SealingProbe(SealingConfig(), None, has_store=True)
    return p.check(_ctx(sealing=view, **ctx))


def test_no_store_is_unavailable_and_no_view_is_unknown() -> None:
    assert _seal(SealView(), SealingProbe(SealingConfig(), None, False)).verdict.level == (
        "unavailable"
    )
    p = SealingProbe(SealingConfig(), None, has_store=True)
    assert p.check(_ctx(sealing=None)).verdict.level == "unknown"


def test_a_fresh_latest_is_ok_with_its_samples() -> None:
    r = _seal(SealView(latest_step=40, latest_wall=WALL - 30, backlog=0, last_ok_wall=WALL - 1))
    assert r.verdict.level == "ok" and "LATEST is step 40" in r.verdict.reason
    assert r.sample == {"latest_step": 40, "age_s": 30.0, "backlog": 0}


def test_latest_older_than_three_checkpoint_intervals_warns() -> None:
    p = SealingProbe(SealingConfig(), 600.0, has_store=True)
    assert _seal(SealView(latest_step=5, latest_wall=WALL - 1700), p).verdict.level == "ok"
    v = _seal(SealView(latest_step=5, latest_wall=WALL - 1900), p).verdict
    assert v.level == "warn" and v.code == "seal_stale" and "(max 30 min)" in v.reason
    # not while nothing runs: no checkpoints are made then
    idle = _seal(SealView(latest_step=5, latest_wall=WALL - 1900), p, state="BACKOFF")
    assert idle.verdict.level == "ok"


def test_max_age_default_is_six_hours_and_the_job_file_sets_it() -> None:
    old = SealView(latest_step=5, latest_wall=WALL - 5 * 3600)
    assert _seal(old).verdict.level == "ok"
    p = SealingProbe(SealingConfig(max_age=3600.0), 600.0, has_store=True)
    assert _seal(old, p).verdict.code == "seal_stale"


def test_an_auto_interval_sets_the_age_limit_as_it_moves() -> None:
    # interval = "auto": the job file has no number; the sealer's view carries the live one.
    p = SealingProbe(SealingConfig(), None, has_store=True)
    old = SealView(latest_step=5, latest_wall=WALL - 1900, interval=600.0)
    v = _seal(old, p).verdict
    assert v.code == "seal_stale" and "(max 30 min)" in v.reason
    grown = SealView(latest_step=5, latest_wall=WALL - 1900, interval=1200.0)
    assert _seal(grown, p).verdict.level == "ok"  # the interval grew: 1 h now
    pinned = SealingProbe(SealingConfig(max_age=7200.0), None, has_store=True)
    assert _seal(old, pinned).verdict.level == "ok"  # the job file's max_age wins


def test_nothing_sealed_long_after_the_start_warns() -> None:
    p = SealingProbe(SealingConfig(max_age=60.0), None, has_store=True)
    assert _seal(SealView(), p).verdict.level == "warn"  # the run began 100 s ago
    assert _seal(SealView(), p, run_started=WALL - 30).verdict.reason == "nothing sealed yet"


def test_a_store_that_stops_answering_warns_after_two_passes_then_alerts() -> None:
    p = SealingProbe(SealingConfig(), None, has_store=True)
    base: Dict[str, Any] = dict(latest_step=40, latest_wall=WALL - 60, last_ok_wall=WALL - 60)
    one = SealView(**base, last_error="connection refused", last_error_wall=WALL - 50)
    assert _seal(one, p).verdict.level == "ok"  # one failed pass: a blip
    two = SealView(**base, last_error="connection refused", last_error_wall=WALL - 40)
    v = _seal(two, p).verdict
    assert v.level == "warn" and v.code == "store_unreachable"
    assert "has not answered since 2023-11-14 22:12:20 UTC (60s): connection refused" in v.reason
    late = SealView(**base, last_error="timeout", last_error_wall=WALL + 1800)
    assert _seal(late, p, wall=WALL + 1800).verdict.level == "alert"
    # it answered again: ok, and the count starts over
    back = SealView(latest_step=41, latest_wall=WALL + 1810, last_ok_wall=WALL + 1810)
    assert _seal(back, p, wall=WALL + 1811).verdict.level == "ok"
    assert _seal(one, p).verdict.level == "ok"


def test_a_backlog_and_a_skewed_clock_warn_and_the_worst_speaks() -> None:
    v = _seal(SealView(latest_step=40, latest_wall=WALL - 5, backlog=4)).verdict
    assert v.code == "seal_backlog" and "4 complete checkpoints wait" in v.reason
    v = _seal(SealView(latest_step=40, latest_wall=WALL - 5, skew=-300.0)).verdict
    assert v.code == "clock_skew" and "ahead of the store's" in v.reason
    assert _seal(SealView(latest_step=40, latest_wall=WALL - 5, skew=30.0)).verdict.level == "ok"
    both = _seal(SealView(latest_step=40, latest_wall=WALL - 5, backlog=5, skew=500.0)).verdict
    assert both.level == "warn" and len(both.data["also"]) == 1


# ---- danger clocks
COLAB = [
    ("vm-lifetime", 12 * 3600.0, "the VM lives about 12 hours at most", "checkpoint, reconnect"),
    ("idle-timeout", 90 * 60.0, "an idle notebook is disconnected after 90 minutes", "stay"),
]


def test_a_clock_warns_at_80_percent_and_alerts_at_100() -> None:
    p = ClocksProbe(COLAB)

    def hours(h: float) -> Context:
        return _ctx(wall=WALL + h * 3600, run_started=WALL)

    r = p.check(hours(9.5))
    assert r.verdict.level == "ok" and r.sample == {"age_s": 9.5 * 3600}
    v = p.check(hours(10)).verdict
    assert v.level == "warn" and v.code == "clock_vm-lifetime"
    assert v.reason.startswith("vm-lifetime (12.0 h) runs out in 2.0 h: the VM lives")
    assert v.remedy == "checkpoint, reconnect"
    v = p.check(hours(12.5)).verdict
    assert v.level == "alert" and "ran out 30 min ago" in v.reason


def test_clocks_that_start_when_the_box_stops_or_idles_are_not_the_runs() -> None:
    # the idle timeout (90 min) would otherwise warn a healthy 2-hour run
    assert ClocksProbe(COLAB).check(_ctx(wall=WALL + 7200, run_started=WALL)).verdict.level == (
        "ok"
    )
    released = [("auto-release", 15 * 86400.0, "a stopped instance is released", "restart it")]
    assert ClocksProbe(released).check(_ctx()).verdict.level == "unavailable"


def test_no_clocks_is_unavailable_and_an_unknown_start_unknown() -> None:
    assert ClocksProbe([]).check(_ctx()).verdict.level == "unavailable"
    assert ClocksProbe(COLAB).check(_ctx(run_started=None)).verdict.level == "unknown"
