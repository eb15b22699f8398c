"""checkpoint.interval = "auto": Daly's formula (onbox/common/daly.py) against values computed by
hand and its limits, and the history the agent reads it from (onbox/agent/interval.py): up time
and unplanned stops across agents and boxes, planned stops left out, the interval's events."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Dict, List

import pytest

from onbox.agent import interval
from onbox.agent.interval import MAX_STOPS, MAX_UP, AutoInterval, History, history, load_history
from onbox.agent.journal import iso
from onbox.agent.sealservice import SealService
from onbox.agent.spec import JobSpec, Overrides, build_spec
from onbox.common.daly import MAX_INTERVAL, choose, daly, mtbf, overhead_target
from onbox.common.errors import TransientStoreError, UsageError
from onbox.sealing import manifest as mf
from onbox.sealing.stores.base import with_retries
from tests.sealsvc import seal_service


def test_daly_matches_hand_computed_values() -> None:
    # d=1, M=50: sqrt(100) = 10; sqrt(1/100)/3 = 0.03333; 1/900 = 0.001111 -> 10 x 1.034444 - 1
    assert daly(1.0, 50.0) == pytest.approx(9.344444, abs=1e-5)
    # d=0.5, M=60: sqrt(60) = 7.745967 x (1 + 0.021517 + 0.000463) - 0.5
    assert daly(0.5, 60.0) == pytest.approx(7.416219, abs=1e-5)


def test_daly_limits() -> None:
    assert daly(2.0, 1.0) == 1.0  # d >= 2M: M
    assert daly(50.0, 1.0) == 1.0
    assert daly(1.999, 1.0) == pytest.approx(8 / 9, abs=1e-3)  # just under 2M: 2M x 13/9 - 2M
    d, m = 1e-6, 100.0  # a cheap checkpoint: Young's sqrt(2 d M)
    assert daly(d, m) / math.sqrt(2 * d * m) == pytest.approx(1.0, abs=1e-3)
    for bad in ((0.0, 1.0), (1.0, 0.0), (-1.0, 5.0), (math.inf, 5.0), (1.0, math.nan)):
        with pytest.raises(ValueError):
            daly(*bad)


def test_choose_starts_at_the_overhead_target_and_keeps_the_floor() -> None:
    assert overhead_target(3.0) == pytest.approx(30.0)  # d / t = 10 %
    assert choose(None, None, 120.0) == 120.0  # nothing measured: the floor
    assert choose(3.0, None, 5.0) == pytest.approx(30.0)  # no failure seen: 10 % overhead
    assert choose(1.0, 50.0, 5.0) == pytest.approx(9.344444, abs=1e-5)
    assert choose(1.0, 50.0, 120.0) == 120.0  # never below the hang-detection budget
    assert choose(1.0, None, 5.0, survived=20.0) == pytest.approx(10.0)  # the target is longer
    assert choose(1.0, None, 5.0, survived=1000.0) == pytest.approx(daly(1.0, 1000.0))


def test_mtbf_counts_covered_stops_as_evidence_not_as_failures() -> None:
    assert mtbf(3600.0, 0, 0) is None  # no stop yet: choose() grows with the time survived
    assert mtbf(0.0, 1, 0) is None
    # one stop in an hour, covered: the share that loses work is (0 + 1/2) / 2 -> 4 h
    assert mtbf(3600.0, 0, 1) == pytest.approx(4 * 3600.0)
    # four stops, all covered: 5 / (4 x 0.5) -> 2.5 h; more covered stops, longer still
    assert mtbf(3600.0, 0, 4) == pytest.approx(2.5 * 3600.0)
    # four stops that all lost work: 3600 x 5 / (4 x 4.5) = 1000 s, near plain counting's 900
    assert mtbf(3600.0, 4, 0) == pytest.approx(1000.0)
    # half of them covered: between the two
    assert mtbf(3600.0, 4, 0) < mtbf(3600.0, 2, 2) < mtbf(3600.0, 0, 4)  # type: ignore[operator]


T0 = 1_800_000_000.0


def ev(t: float, kind: str, **data: Any) -> Dict[str, Any]:
    return {"time": iso(T0 + t), "kind": kind, **data}


def state(t: float, s: str, reason: str = "") -> Dict[str, Any]:
    return ev(t, "state", state=s, reason=reason or s.lower())


def agent_preempted_after_a_crash() -> List[Dict[str, Any]]:
    """Up 300 s: one crash while RUNNING, one quick exit while STARTING, then a preemption."""
    return [
        ev(0, "incarnation"),
        ev(0, "epoch", epoch=1),
        state(1, "STARTING"),
        ev(2, "exit", exit_kind="python_exception"),  # STARTING: a quick exit, not counted
        state(3, "BACKOFF"),
        state(4, "STARTING"),
        state(10, "RUNNING"),
        ev(50, "checkpoint_asked"),
        ev(52.5, "sealed", seconds=0.4),
        ev(100, "exit", exit_kind="oom_killed"),  # RUNNING: an unplanned stop
        state(100, "BACKOFF"),
        state(101, "STARTING"),
        state(110, "RUNNING"),
        state(290, "STOPPING", "preempt: signalling the job"),
        ev(295, "exit", exit_kind="signal"),  # the agent's own stop: part of the preemption
        state(300, "PREEMPTED"),
    ]


def test_history_counts_unplanned_stops_and_up_time_across_agents() -> None:
    first = agent_preempted_after_a_crash()
    h = history(first, begin=True)
    assert (h.up, h.unplanned, h.d) == (pytest.approx(300), 2, pytest.approx(2.5))
    # a second agent on the same box, gone without a word after 200 s
    second = [ev(1000, "incarnation"), ev(1000, "epoch", epoch=2), state(1001, "RUNNING")]
    second.append(ev(1200, "sealed", seconds=0.1))
    h = history(first + second, begin=True)  # the next start begins anew: the box was lost
    assert (h.up, h.unplanned) == (pytest.approx(500), 3)
    h = history(first + second, begin=False)  # adopted: its job still ran, nothing stopped
    assert (h.up, h.unplanned) == (pytest.approx(500), 2)


@pytest.mark.parametrize(
    "ending",
    [
        [state(100, "STOPPING", "stop: signalling the job"), state(101, "STOPPED")],
        [state(100, "SUCCEEDED")],
        [ev(90, "slurm_warning"), state(100, "STOPPING", "preempt: x"), state(101, "PREEMPTED")],
        [ev(90, "meter_cap"), state(100, "STOPPED")],
    ],
)
def test_planned_stops_are_not_failures(ending: List[Dict[str, Any]]) -> None:
    events = [ev(0, "epoch", epoch=1), state(1, "RUNNING"), *ending]
    assert history(events, begin=True).unplanned == 0


def preempted(sealed_in_grace: List[Dict[str, Any]], why: bool = True) -> List[Dict[str, Any]]:
    """An agent that sealed step 100, then was preempted at 200 s with a 5 s grace, its events
    in the agent's order: the final ask, then STOPPING (``why``: events before that field
    existed have an ask without it, after STOPPING)."""
    ask = [ev(200, "checkpoint_asked", why="preemption")]
    stopping = [state(200, "STOPPING", "preempt: signalling the job")]
    return [
        ev(0, "epoch", epoch=1),
        state(1, "RUNNING"),
        ev(50, "checkpoint_asked", why="timer"),
        ev(51, "sealed", step=100, seconds=0.5),
        *(ask + stopping if why else stopping + [ev(200, "checkpoint_asked")]),
        *sealed_in_grace,
        state(205, "PREEMPTED"),
    ]


@pytest.mark.parametrize("why", [True, False])
def test_a_preemption_whose_final_checkpoint_was_sealed_lost_no_work(why: bool) -> None:
    # The grace saw the job's answer sealed: nothing was lost, the interval guarded nothing.
    final = [ev(202, "sealed", step=180, seconds=0.5)]
    h = history(preempted(final, why), True)
    assert (h.unplanned, h.covered) == (0, 1)
    # Only an older checkpoint finished sealing in the grace (or nothing did): work was lost.
    older = [ev(202, "sealed", step=100, seconds=0.5)]
    h = history(preempted(older, why), True)
    assert (h.unplanned, h.covered) == (1, 0)
    assert history(preempted([], why), True).unplanned == 1
    # The agent vanished mid-grace, after the final seal: still no work lost.
    assert history(preempted(final, why)[:-1], begin=True).unplanned == 0


def test_a_notice_that_came_to_nothing_covers_no_later_preemption() -> None:
    events = [
        ev(0, "epoch", epoch=1),
        state(1, "RUNNING"),
        ev(100, "checkpoint_asked", why="preemption notice"),
        ev(101, "sealed", step=100),
        ev(400, "checkpoint_asked", why="timer"),  # no preemption came: training went on
        ev(401, "sealed", step=400),
        state(500, "STOPPING", "preempt: signalling the job"),  # no grace: nothing asked
        state(500, "PREEMPTED"),
    ]
    assert history(events, begin=True).unplanned == 1


@pytest.mark.parametrize("landed", ["before STOPPING", "after STOPPING"])
def test_a_seal_after_the_agents_sigterm_is_judged_the_same_wherever_it_lands(landed: str) -> None:
    """The agent writes ``preempt`` when its SIGTERM is handled, then STOPPING; the sealer's
    thread writes ``sealed`` when it is done. A checkpoint sealed after the SIGTERM is judged
    against what was sealed when the SIGTERM came, whichever of the two the thread beat: the
    stop's count does not follow a race between two threads of one agent."""
    seal = [ev(200.05, "sealed", step=180)]
    stop = [
        ev(200.1, "checkpoint_not_asked"),
        state(200.1, "STOPPING", "preempt: signalling the job, SIGKILL after 0.0s"),
    ]
    start = [ev(0, "epoch", epoch=1), state(1, "RUNNING"), ev(51, "sealed", step=100)]
    body = seal + stop if landed == "before STOPPING" else stop + seal
    events = start + [ev(200, "preempt")] + body + [state(201, "PREEMPTED")]
    h = history(events, begin=True)
    assert (h.unplanned, h.covered) == (0, 1)
    # nothing newer sealed after the SIGTERM: the stop lost work
    old = [ev(200.05, "sealed", step=100)]
    body = old + stop if landed == "before STOPPING" else stop + old
    events = start + [ev(200, "preempt")] + body + [state(201, "PREEMPTED")]
    assert (history(events, begin=True).unplanned, history(events, True).covered) == (1, 0)


def sigterm_exit(t: float, shell: bool = False) -> Dict[str, Any]:
    """The job's exit by SIGTERM, as the supervisor writes it (a shell wrapper exits 143)."""
    how = {"code": 143, "signal": None} if shell else {"code": None, "signal": 15}
    return ev(t, "exit", exit_kind="signal", **how)


@pytest.mark.parametrize("shell", [False, True])
def test_a_preemption_whose_sigterm_reached_the_job_first_is_one_stop(shell: bool) -> None:
    """The box's SIGTERM reaches the job and the agent together. When the job's exit is
    written before the agent handles its own, the exit came while RUNNING: it was counted as
    an unplanned stop, and the preemption that followed as a second one."""
    start = [ev(0, "epoch", epoch=1), state(1, "RUNNING"), ev(51, "sealed", step=100)]
    term = [sigterm_exit(200, shell), state(200, "BACKOFF")]
    end = [state(200.2, "STOPPING", "preempt: signalling the job"), state(201, "PREEMPTED")]
    h = history(start + term + end, begin=True)
    assert (h.unplanned, h.covered) == (1, 0)
    # The job saved on SIGTERM and the final seal sealed it: nothing was lost, before or
    # after the agent's own STOPPING.
    saved = [ev(200.1, "sealed", step=180)]
    h = history(start + term + saved + end, begin=True)
    assert (h.unplanned, h.covered) == (0, 1)
    h = history(start + term + end[:1] + saved + end[1:], begin=True)
    assert (h.unplanned, h.covered) == (0, 1)
    # The agent was SIGKILLed before it handled its SIGTERM: one box lost, one stop.
    assert history(start + term, begin=True).unplanned == 1


def test_a_sigterm_from_someone_else_is_still_an_unplanned_stop() -> None:
    """The job took a SIGTERM, was restarted and ran again: that stop was not the box's end;
    nor was one that a user's stop or the run's failure ended."""
    start = [ev(0, "epoch", epoch=1), state(1, "RUNNING"), sigterm_exit(100)]
    again = [state(100, "BACKOFF"), state(101, "STARTING"), state(110, "RUNNING")]
    preempt = [state(300, "STOPPING", "preempt: signalling the job"), state(301, "PREEMPTED")]
    assert history(start + again + preempt, begin=True).unplanned == 2
    stop = [state(100, "STOPPING", "stop: signalling the job"), state(101, "STOPPED")]
    assert history(start + stop, begin=True).unplanned == 1
    assert history(start + [state(100, "FAILED")], begin=True).unplanned == 1


def test_with_no_stop_that_lost_work_the_interval_grows_with_the_time_survived(
    tmp_path: Any,
) -> None:
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(ev(0, "epoch", epoch=1)) + "\n")
    # 6 preemptions before this box, every one sealed in its grace: 1000 s up, none lost work
    auto = AutoInterval(History(1000.0, 0, (), covered=6), 5.0, T0, path, lambda *a, **k: None)
    auto.start(T0)
    never = AutoInterval(History(1000.0, 0, ()), 5.0, T0, path, lambda *a, **k: None)
    never.start(T0)
    fresh = AutoInterval(History(), 5.0, T0, path, lambda *a, **k: None)
    fresh.start(T0)
    with open(path, "a") as f:
        for e in (state(1, "RUNNING"), ev(10, "checkpoint_asked"), ev(11, "sealed", step=10)):
            f.write(json.dumps(e) + "\n")
    assert never.update(T0 + 20) == pytest.approx(daly(1.0, 1020.0))  # M = the time survived
    assert never.seconds > overhead_target(1.0)  # longer than the 10 % start
    assert never.update(T0 + 3000) == pytest.approx(daly(1.0, 4000.0))
    # the covered stops say the stops come with a grace: longer still (M = 1020 x 7 / 3)
    assert auto.update(T0 + 20) == pytest.approx(daly(1.0, 1020.0 * 7 / 3))
    assert auto.seconds > daly(1.0, 1020.0)
    assert fresh.update(T0 + 20) == pytest.approx(10.0)  # a new run starts at 10 % overhead


def test_d_is_the_median_of_recent_seals_so_one_slow_start_does_not_set_it() -> None:
    events = [ev(0, "epoch", epoch=1), ev(5, "checkpoint_asked"), ev(35, "sealed", seconds=0.2)]
    for t in (40, 50, 60, 70):  # the job was still importing torch at the first ask
        events += [ev(t, "checkpoint_asked"), ev(t + 1, "sealed", seconds=0.2)]
    h = history(events, begin=True)
    assert h.d == pytest.approx(1.0) and len(h.ds) == 5


def test_d_is_the_jobs_blocked_save_where_it_reports_one_and_the_seal_bounds_the_interval(
    tmp_path: Any,
) -> None:
    events = [ev(0, "epoch", epoch=1), state(1, "RUNNING")]
    for t in (10, 20, 30):  # the job's saves held its loop 20 ms; the seals took 2 s
        events += [ev(t, "checkpoint_asked"), ev(t + 2, "sealed", seconds=1.5, blocked_s=0.02)]
    events += [ev(40, "checkpoint_asked"), ev(42, "sealed", seconds=1.5)]  # report not seen
    h = history(events, begin=True)
    assert h.d == pytest.approx(0.02) and len(h.ds) == 3  # the outside view is not mixed in
    # A job that reports nothing is measured from the ask to the seal, as before.
    plain = [e for e in events if e["kind"] != "sealed"] + [ev(12, "sealed", seconds=1.5)]
    assert history(sorted(plain, key=lambda e: e["time"]), begin=True).d == pytest.approx(2.0)

    # Live: d = 20 ms gives 0.2 s at 10 % overhead, under the 2 s seal: the seal sets it.
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(events[0]) + "\n")
    logged: List[Dict[str, Any]] = []
    auto = AutoInterval(History(), 0.1, T0, path, lambda k, r, **data: logged.append(data))
    auto.start(T0)
    with open(path, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events[1:4])
    assert auto.update(T0 + 13) == pytest.approx(2.0)
    assert logged[-1]["d"] == pytest.approx(0.02) and logged[-1]["seal_s"] == pytest.approx(2.0)


def test_a_fresh_box_reads_the_store_and_carries_the_totals_forward(_no_waits: None) -> None:
    # The previous box's events: its agent began with 1000 s and 4 stops behind it.
    prior = [
        ev(0, "epoch", epoch=5),
        ev(
            0,
            "checkpoint_interval",
            at_start=True,
            base_up_s=1000.0,
            base_unplanned=4,
            base_covered=2,
        ),
        state(1, "RUNNING"),
        ev(60, "checkpoint_asked"),
        ev(61, "sealed", seconds=0.2),
    ]
    remote = "\n".join(json.dumps(e) for e in prior).encode() + b"\n{torn"
    h = load_history([ev(100, "incarnation")], lambda: remote, begin=True)  # no epoch here
    assert h is not None
    assert (h.up, h.unplanned, h.covered, h.d) == (pytest.approx(1061), 5, 2, pytest.approx(1.0))

    def unreachable() -> bytes:
        raise TransientStoreError("the store did not answer")

    # A store that answers at the third try: read, as every store read is retried.
    answers: List[Any] = [unreachable, unreachable, lambda: remote]
    assert load_history([], lambda: answers.pop(0)(), begin=True) == h
    # One that never answers gives no history rather than an empty one, which the agent's
    # first mirror would have put over the run's.
    assert load_history([], unreachable, begin=True) is None


@pytest.fixture
def _no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store reads' retries, without their backoff."""
    fast = functools.partial(with_retries, sleep=lambda s: None)
    monkeypatch.setattr(interval, "with_retries", fast, raising=False)


def test_auto_interval_follows_the_events_and_logs_its_changes(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(ev(0, "epoch", epoch=3)) + "\n")
    logged: List[Dict[str, Any]] = []
    auto = AutoInterval(
        History(),
        5.0,
        T0,
        path,
        lambda kind, reason, **data: logged.append({"kind": kind, "reason": reason, **data}),
    )
    auto.start(T0)
    assert auto.seconds == 5.0 and logged[-1]["at_start"] is True  # nothing measured: floor

    def append(*events: Dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)

    append(state(1, "RUNNING"), ev(10, "checkpoint_asked"), ev(11, "sealed", seconds=0.3))
    assert auto.update(T0 + 15) == pytest.approx(10.0)  # d = 1 s, no failure: 10 % overhead
    append(ev(20, "exit", exit_kind="oom_killed"), state(20, "BACKOFF"))
    m = 20.0 * 2 / 1.5  # 20 s up, 1 stop that lost work (daly.mtbf)
    assert auto.update(T0 + 20) == pytest.approx(daly(1.0, m))
    assert [e["seconds"] for e in logged] == [5.0, 10.0, pytest.approx(daly(1.0, m), abs=1e-3)]
    assert logged[-1]["unplanned"] == 1 and logged[-1]["mtbf"] == pytest.approx(m)
    assert auto.update(T0 + 21) > daly(1.0, m)  # M grows with the time up...
    assert len(logged) == 3  # ...but by under 10 %: no new event


def test_job_file_interval_auto(tmp_path: Any) -> None:
    def build(ckpt: str) -> JobSpec:
        job = os.path.join(str(tmp_path), "job.toml")
        with open(job, "w") as f:
            f.write(f'command = ["true"]\n[checkpoint]\n{ckpt}\n')
        return build_spec(
            job,
            Overrides(),
            cwd=str(tmp_path),
            environ=os.environ,
            default_name="job",
            run_dir_of=lambda n: os.path.join(str(tmp_path), n),
        )

    spec = build('interval = "auto"\ntrigger = "file"')
    assert spec.ckpt_auto is True and spec.ckpt_interval is None
    assert JobSpec.from_json(spec.to_json()).ckpt_auto is True
    assert build('interval = "90s"\ntrigger = "file"').ckpt_auto is False
    with pytest.raises(UsageError):
        build('interval = "auto"')  # nothing to ask the job with


def test_the_jobs_save_report_is_read_only_when_well_formed(tmp_path: Any) -> None:
    from onbox.common import progress

    progress.write(str(tmp_path), 12, 0, save=(10, 0.0421))
    doc = progress.read(str(tmp_path))
    assert doc is not None and progress.last_save(doc) == (10, pytest.approx(0.0421))
    for bad in ({"step": "10", "blocked_s": 1}, {"step": 10, "blocked_s": -1.0}, [10, 1.0]):
        assert progress.last_save({"step": 12, "save": bad}) is None
    for cost in (math.nan, math.inf, -math.inf, 10**400):  # no measurement: none, not a d
        assert progress.last_save({"step": 12, "save": {"step": 10, "blocked_s": cost}}) is None
    assert progress.last_save({"step": 12}) is None and progress.last_save(None) is None


def test_a_new_agents_first_choice_says_where_the_d_it_inherits_came_from(tmp_path: Any) -> None:
    """The d a new agent starts from was measured by the agents before it: the job's reported
    saves stay named so in its first interval event and in the history the next box reads from
    that event; a job that reports nothing is measured from the ask to the seal, named so."""
    reported = [
        ev(0, "epoch", epoch=5),
        state(1, "RUNNING"),
        ev(10, "checkpoint_asked"),
        ev(11, "sealed", step=1, seconds=0.5, blocked_s=0.02),
    ]
    h = history(reported, begin=True)
    assert h.reports and h.d == pytest.approx(0.02)
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(ev(100, "epoch", epoch=6)) + "\n")
    logged: List[Any] = []
    auto = AutoInterval(h, 0.1, T0 + 100, path, lambda k, r, **data: logged.append((r, data)))
    auto.start(T0 + 100)
    reason, data = logged[-1]
    assert "0.020 s, the job's blocked save" in reason and data["base_reports"] is True
    first = ev(100, "checkpoint_interval", **data)
    after = history(reported + [ev(100, "incarnation"), ev(100, "epoch", epoch=6), first], True)
    assert after.reports and after.d == pytest.approx(0.02)

    plain = [e for e in reported if e["kind"] != "sealed"] + [ev(11, "sealed", step=1, seconds=1)]
    h = history(plain, begin=True)
    assert not h.reports and h.d == pytest.approx(1.0)
    logged.clear()
    AutoInterval(h, 0.1, T0 + 100, path, lambda k, r, **data: logged.append(r)).start(T0 + 100)
    assert "1.000 s, ask to sealed" in logged[-1]


def test_a_huge_d_or_m_still_gives_an_interval_the_timer_reaches(tmp_path: Any) -> None:
    """A d or M no run could have measured (a damaged record, a clock's jump) gives an interval
    between the floor and a day: never infinite, never one the timer would not reach."""
    assert math.isfinite(daly(5.0, 1e308)) and daly(5.0, 1e308) < 1e308
    cases = [(1e9, None, 100.0), (math.inf, None, 0.0), (5.0, 1e308, 0.0), (5.0, None, 1e308)]
    cases += [(5.0, math.inf, math.inf), (math.nan, None, 0.0), (1e300, 1e-300, 0.0)]
    for d, m, survived in cases:
        assert 120.0 <= choose(d, m, 120.0, survived) <= MAX_INTERVAL, (d, m, survived)
    # The agent: the stored record says one checkpoint cost 1e9 s.
    prior = [
        ev(0, "epoch", epoch=1),
        ev(1, "checkpoint_interval", at_start=True, base_up_s=100.0, base_ds=[1e9]),
        state(2, "RUNNING"),
        ev(10, "checkpoint_asked"),
        ev(11, "sealed", step=1, seconds=1e300),  # nor does a seal time no seal took
    ]
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in prior[:2])
    auto = AutoInterval(history(prior, True), 120.0, T0, path, lambda *a, **k: None)
    auto.start(T0)
    assert 120.0 <= auto.seconds <= MAX_INTERVAL
    with open(path, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in prior[2:])
    assert 120.0 <= auto.update(T0 + 20) <= MAX_INTERVAL


def _agent(tmp_path: Any, stored: bytes) -> SealService:
    """An agent with interval "auto" on a fresh box, whose store holds ``stored`` as the run's
    events (the history it reads at start)."""
    svc = seal_service(tmp_path, ckpt_auto=True)
    svc.store.put_bytes(mf.state_key("r", "events.jsonl"), stored)
    return svc


def _kinds(svc: SealService) -> List[str]:
    with open(svc.rd.events) as f:
        return [json.loads(line)["kind"] for line in f if line.strip()]


@pytest.mark.parametrize(
    "carried",
    [
        '"base_up_s": NaN',
        '"base_up_s": Infinity',
        '"base_up_s": 1e999',
        '"base_up_s": -1e9',
        '"base_unplanned": Infinity',
        '"base_unplanned": NaN',
        '"base_covered": 1' + "0" * 400,
        '"base_unplanned": -1, "base_covered": 2',
        '"base_ds": [NaN]',
        '"base_ds": [Infinity]',
        '"base_ds": [-5.0]',
        '"base_ds": ["x", null]',
    ],
)
def test_a_damaged_history_in_the_store_does_not_stop_the_agent(
    tmp_path: Any, carried: str
) -> None:
    """The history comes from the store's copy of the events: a value no run could have
    written (Python's json reads NaN, Infinity and 1e999) makes the agent start afresh,
    saying so once, and go on sealing; it never gets as far as the formula."""
    first = json.dumps(ev(1, "checkpoint_interval", at_start=True, base_up_s=100.0))
    stored = "\n".join(
        [json.dumps(ev(0, "epoch", epoch=1)), first.replace('"base_up_s": 100.0', carried)]
        + [json.dumps(state(2, "RUNNING")), json.dumps(ev(3600, "sealed", step=1))]
    )
    svc = _agent(tmp_path, stored.encode())
    try:
        svc.start(begin=True)
        assert svc.auto is not None and 120.0 <= svc.auto.seconds <= MAX_INTERVAL
        assert svc.auto.base == History(3600.0, 1, ())  # the last box's own hour is kept
        assert _kinds(svc).count("interval_history_unusable") == 1
        assert svc.auto.update(T0 + 10**6) >= 120.0  # and the next passes go on
    finally:
        svc.close()


def test_a_history_line_nested_too_deep_is_skipped_and_the_agent_starts(tmp_path: Any) -> None:
    """A line of the store's events copy nested past the parser's depth raised RecursionError
    (not the ValueError a torn line raises) out of the history read, and the agent never
    started; it is skipped like a torn line."""
    stored = "\n".join(
        [json.dumps(ev(0, "epoch", epoch=1)), "[" * 100_000 + "]" * 100_000]
        + [json.dumps(state(2, "RUNNING")), json.dumps(ev(3600, "sealed", step=1))]
    )
    svc = _agent(tmp_path, stored.encode())
    try:
        svc.start(begin=True)
        assert svc.auto is not None and svc.auto.base == History(3600.0, 1, ())
    finally:
        svc.close()


def test_absurd_but_finite_totals_are_bounded_not_trusted(tmp_path: Any) -> None:
    big = ev(1, "checkpoint_interval", at_start=True, base_up_s=1e308, base_unplanned=10**30)
    h = history([ev(0, "epoch", epoch=1), big, ev(2, "sealed", step=1, blocked_s=1e9)], True)
    assert h.up <= MAX_UP + 2 and h.unplanned <= MAX_STOPS + 1 and not h.unusable
    svc = _agent(tmp_path, b"\n".join(json.dumps(e).encode() for e in (ev(0, "epoch"), big)))
    try:
        svc.start(begin=True)
        assert svc.auto is not None and 120.0 <= svc.auto.seconds <= MAX_INTERVAL
        assert "interval_history_unusable" not in _kinds(svc)
    finally:
        svc.close()


def test_a_history_the_formula_refuses_gives_way_to_an_empty_one(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever slips past the bounds: the first interval is computed afresh, not raised."""
    from onbox.common import daly as formula

    calls: List[float] = []

    def refuses_once(*args: Any, **kw: Any) -> float:
        calls.append(1.0)
        if len(calls) == 1:
            raise ValueError("no")
        return 120.0

    monkeypatch.setattr(formula, "choose", refuses_once)
    path = os.path.join(str(tmp_path), "events.jsonl")
    logged: List[str] = []
    auto = AutoInterval(
        History(50.0, 1, (2.0,)), 120.0, T0, path, lambda k, r, **d: logged.append(k)
    )
    auto.start(T0)
    assert auto.base == History() and auto.seconds == 120.0
    assert logged == ["interval_history_unusable", "checkpoint_interval"]


def _mirrored(svc: SealService, what: bytes) -> bool:
    """Whether a pass of the sealing thread mirrored events that hold ``what`` to the store."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if what in (svc.store.get_bytes(mf.state_key("r", "events.jsonl")) or b""):
            return True
        time.sleep(0.05)
    return False


def test_an_infinite_save_cost_from_the_job_does_not_stop_sealing(tmp_path: Any) -> None:
    """The job reports a save that held its loop forever (progress.json's blocked_s:
    Infinity), or an older agent carried one on a sealed event: no d is taken from it, the
    interval stays finite, and the sealing thread's passes go on mirroring the run."""
    svc = _agent(tmp_path, b"")
    with open(os.path.join(svc.rd.path, "progress.json"), "w") as f:
        f.write('{"step": 10, "attempt": 1, "save": {"step": 10, "blocked_s": Infinity}}')
    ckpt = tmp_path / "ckpt" / "step_10"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(b"weights")
    try:
        svc.start(begin=True)
        assert svc.auto is not None
        svc.event("checkpoint_asked", "asked", why="timer")
        (ckpt / ".rgt-complete").write_text("{}")
        svc.wake()
        assert _mirrored(svc, b'"sealed"')  # step 10, sealed with no cost from the job
        svc.event("checkpoint_asked", "asked", why="timer")  # an older agent's record
        svc.event("sealed", "sealed", step=11, seconds=1.0, blocked_s=math.inf)
        svc.wake()
        assert _mirrored(svc, b'"step": 11')
        assert 120.0 <= svc.auto.seconds <= MAX_INTERVAL
        assert len(svc.auto.seg.samples) == 2 and all(0 < d < 60 for d in svc.auto.seg.samples)
        assert "seal_bug" not in _kinds(svc) and "interval_bug" not in _kinds(svc)
    finally:
        svc.close()


def test_an_interval_that_cannot_be_recomputed_keeps_the_last_and_sealing_goes_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onbox.common import daly as formula

    svc = _agent(tmp_path, b"")
    try:
        svc.start(begin=True)
        assert svc.auto is not None and svc.auto.seconds == 120.0

        def broken(*args: Any, **kw: Any) -> float:
            raise ZeroDivisionError("a bug")

        monkeypatch.setattr(formula, "choose", broken)
        svc.event("checkpoint_asked", "asked", why="timer")
        svc.wake()
        assert _mirrored(svc, b'"checkpoint_asked"')  # the pass went on to the mirror
        svc.event("sealed", "sealed", step=10, seconds=1.0)
        svc.wake()
        assert _mirrored(svc, b'"sealed"')
        assert svc.auto.seconds == 120.0 and svc.interval() == 120.0
        kinds = _kinds(svc)
        assert kinds.count("interval_bug") == 1 and "seal_bug" not in kinds  # said once
    finally:
        svc.close()


def test_a_store_that_does_not_answer_at_start_loses_no_history(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, _no_waits: None
) -> None:
    """The store's copy of the events is the run's history on a fresh box: while the store
    does not give it, the agent's passes mirror its state but leave that copy in place; once a
    pass reads it, the agent carries its totals on, and only then replaces it."""
    prior = [
        ev(0, "epoch", epoch=1),
        ev(1, "checkpoint_interval", at_start=True, base_up_s=5000.0, base_unplanned=2),
        state(2, "RUNNING"),
        ev(1000, "sealed", step=1),
    ]
    stored = "\n".join(json.dumps(e) for e in prior).encode()
    svc = _agent(tmp_path, stored)
    get, down = svc.store.get_bytes, [True]

    def flaky(key: str) -> Any:
        if down[0] and key.endswith("events.jsonl"):
            raise TransientStoreError("503 slow down")
        return get(key)

    monkeypatch.setattr(svc.store, "get_bytes", flaky)
    with open(svc.rd.state, "w") as f:
        f.write('{"state": "RUNNING"}')  # the supervisor's
    try:
        svc.start(begin=True)
        assert svc.auto is not None
        svc.wake()
        deadline = time.monotonic() + 20
        while svc.last_ok_wall is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(mf.state_key("r", "state.json")) is not None  # a pass mirrored the state
        assert get(mf.state_key("r", "events.jsonl")) == stored  # and left the history be
        down[0] = False
        svc.wake()
        assert _mirrored(svc, b'"base_up_s": 6000.0')  # this agent's events, carrying it on
        assert svc.auto.settled and svc.auto.base == History(6000.0, 3, ())
        assert _kinds(svc).count("interval_history_unread") == 1
    finally:
        svc.close()
    mirrored = interval.parse_lines(get(mf.state_key("r", "events.jsonl")) or b"")
    later = history(mirrored, begin=True)  # what the next fresh box reads
    assert later.up >= 6000.0 and later.unplanned >= 3


def test_a_new_agents_first_seal_without_a_report_does_not_mix_the_outside_view_in(
    tmp_path: Any,
) -> None:
    """The job reports its saves' blocked time (the agents before this one saw it), but the
    new box's first seal came before the job's report of that save (the sealer can beat the
    job's progress.json on a loaded box; a clean-clone CI run saw it): the ask-to-sealed time
    is no measure of d for such a job, here nor in the history the next box reads."""
    reported = [
        ev(0, "epoch", epoch=5),
        state(1, "RUNNING"),
        ev(10, "checkpoint_asked"),
        ev(11, "sealed", step=1, seconds=0.5, blocked_s=0.02),
    ]
    base = history(reported, begin=True)
    assert base.reports
    path = os.path.join(str(tmp_path), "events.jsonl")
    news = [
        ev(100, "epoch", epoch=6),
        ev(110, "checkpoint_asked"),
        ev(111.4, "sealed", step=2, seconds=1.4),  # the report of step 2's save not seen yet
    ]
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in news)
    logged: List[Any] = []
    auto = AutoInterval(base, 0.1, T0 + 100, path, lambda k, r, **data: logged.append((r, data)))
    auto.start(T0 + 100)
    auto.update(T0 + 112)
    reasons = [r for r, data in logged if data["d"] is not None]
    assert reasons and all("the job's blocked save" in r for r in reasons), logged
    assert all(data["d"] == pytest.approx(0.02) for r, data in logged if data["d"] is not None)
    after = history(reported + [ev(100, "incarnation")] + news, begin=True)
    assert after.reports and after.d == pytest.approx(0.02)
