"""The agent's Slurm side (onbox/agent/slurm.py) without a cluster: how a job's end is read from
``scontrol show job -o`` (as Slurm 22.05 prints it while the job is still COMPLETING), the
requeue decision, the allocation from the environment, the agent's own timer against its
measured seal time, and a failed requeue reported with its remedy. The real thing runs in
tests/integration/test_slurm_requeue.py."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.agent.slurm import (
    SlurmJob,
    SlurmWatch,
    how_it_ended,
    parse_show,
    requeue_decision,
)
from onbox.agent.slurmlogin import status_lines

# `scontrol show job -o` of a job cancelled with scancel, read from inside it at its SIGTERM
# (Slurm 22.05): COMPLETING, no reason, no PreemptTime.
CANCELLED_LINE = (
    "JobId=4 JobName=t4.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901756 "
    "Nice=0 Account=(null) QOS=(null) JobState=COMPLETING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:04 "
    "TimeLimit=00:05:00 TimeMin=N/A SubmitTime=2026-12-02T10:56:57 EndTime=2026-12-02T10:57:01 "
    "Command=/tmp/s1/t4.sh WorkDir=/tmp/s1 StdOut=/tmp/s1/t4-4.out Power="
)


def _fields(**kw: str) -> Dict[str, str]:
    out = parse_show(CANCELLED_LINE)
    out.update(kw)
    return out


def test_parse_show_reads_the_one_line_record() -> None:
    f = parse_show(CANCELLED_LINE)
    assert f["JobId"] == "4" and f["JobState"] == "COMPLETING" and f["Reason"] == "None"
    assert f["EndTime"] == "2026-12-02T10:57:01" and f["Power"] == ""


@pytest.mark.parametrize(
    "fields,ended,requeue",
    [
        ({}, "CANCELLED", False),  # COMPLETING, Reason=None, no PreemptTime: a scancel
        ({"JobState": "CANCELLED"}, "CANCELLED", False),
        ({"Reason": "TimeLimit"}, "TIMEOUT", True),  # the time limit, still completing
        ({"JobState": "TIMEOUT", "Reason": "TimeLimit"}, "TIMEOUT", True),
        ({"PreemptTime": "2026-12-02T11:00:48"}, "PREEMPTED", True),
        ({"PreemptTime": "None"}, "CANCELLED", False),
        ({"JobState": "PREEMPTED"}, "PREEMPTED", True),
        ({"JobState": "NODE_FAIL"}, "NODE_FAIL", True),
        ({"Reason": "NodeDown"}, "NODE_FAIL", True),
        ({"JobState": "RUNNING"}, "RUNNING", False),  # a SIGTERM from outside Slurm
        ({"JobState": "PENDING"}, "PENDING", False),
    ],
)
def test_the_end_of_a_job_decides_its_requeue(
    fields: Dict[str, str], ended: str, requeue: bool
) -> None:
    f = _fields(**fields)
    assert how_it_ended(f) == ended
    ok, why = requeue_decision(f, warned=False)
    assert ok is requeue
    if ended == "CANCELLED":
        assert "cancelled" in why


def test_after_a_warning_the_job_is_always_requeued_and_unknown_is_never() -> None:
    assert requeue_decision(_fields(), warned=True)[0] is True
    assert requeue_decision(None, warned=True)[0] is True
    assert requeue_decision(None, warned=False) == (False, "Slurm did not say how the job ended")


def test_the_allocation_comes_from_slurms_environment() -> None:
    assert SlurmJob.from_env({}) is None
    assert SlurmJob.from_env({"SLURM_JOB_ID": "x1"}) is None
    job = SlurmJob.from_env(
        {
            "SLURM_JOB_ID": "1207",
            "SLURM_ARRAY_JOB_ID": "1200",
            "SLURM_ARRAY_TASK_ID": "7",
            "SLURM_RESTART_COUNT": "2",
            "RGT_SLURM_LEAD": "150",
        }
    )
    assert job == SlurmJob("1207", "1200", "7", 2, 150)
    first = SlurmJob.from_env({"SLURM_JOB_ID": "5", "RGT_SLURM_LEAD": "nope"})
    assert first == SlurmJob("5", None, None, 0, None)
    doc = {"slurm": {**job.to_json(), "warned": True, "requeued": True}}
    (line,) = status_lines(doc)
    assert "job 1207 (array 1200_7)" in line and "allocation attempt 3" in line
    assert "requeued" in line and status_lines({}) == []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(
    tmp_path: Any, events: List[Dict[str, Any]], lead: Optional[int], grace: float = 30.0
) -> Tuple[SlurmWatch, Clock, List[Tuple[str, Any]]]:
    path = os.path.join(str(tmp_path), "events.jsonl")
    with open(path, "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write("not json\n")
    said: List[Tuple[str, Any]] = []
    clock = Clock()
    w = SlurmWatch(
        SlurmJob("42", None, None, 0, lead),
        grace,
        path,
        lambda kind, reason, **kw: said.append((kind, reason + " " + kw.get("remedy", ""))),
        clock=clock,
    )
    w.end_at = clock.now + 600  # as begin() reads it from EndTime
    return w, clock, said


def _seal(t0: str, t1: str) -> List[Dict[str, Any]]:
    return [
        {"kind": "checkpoint_asked", "time": f"2026-12-02T11:00:{t0}Z"},
        {"kind": "sealed", "time": f"2026-12-02T11:00:{t1}Z", "seconds": 1.0},
    ]


def test_its_own_timer_fires_when_the_end_is_nearer_than_its_measured_seal_needs(
    tmp_path: Any,
) -> None:
    # Measured: a 45 s seal (asked at :00, sealed at :45) needs 90 s, more than the 20 s lead.
    w, clock, said = _watch(tmp_path, _seal("00", "45"), lead=20)
    stops: List[Tuple[str, float]] = []
    w.tick(lambda reason, grace: stops.append((reason, grace)), active=True)
    assert stops == [] and w.wait() == 60.0  # looks again within a minute
    clock.now += 600 - 91
    w.tick(lambda reason, grace: stops.append((reason, grace)), active=True)
    assert stops == []
    clock.now += 1
    w.tick(lambda reason, grace: stops.append((reason, grace)), active=True)
    assert stops == [("preempt", 20.0)]  # the budget is the lead, not the grace
    assert said[-1][0] == "slurm_warning" and "own timer" in said[-1][1]
    w.tick(lambda reason, grace: stops.append((reason, grace)), active=True)
    w.on_usr2(lambda reason, grace: stops.append((reason, grace)))
    assert len(stops) == 1 and w.wait() is None  # one warning path per allocation


def test_with_nothing_measured_the_timer_uses_the_grace_and_a_late_end_cuts_the_budget(
    tmp_path: Any,
) -> None:
    w, clock, said = _watch(tmp_path, [], lead=None, grace=40.0)
    stops: List[Tuple[str, float]] = []
    clock.now += 600 - 41
    w.tick(lambda r, g: stops.append((r, g)), active=True)
    assert stops == []
    clock.now += 15  # 26 s left: the budget is what is left, not the 40 s grace
    w.tick(lambda r, g: stops.append((r, g)), active=True)
    assert stops == [("preempt", 26.0)]


def test_the_usr2_warning_takes_the_preemption_path_with_the_lead(tmp_path: Any) -> None:
    w, clock, said = _watch(tmp_path, [], lead=120)
    stops: List[Tuple[str, float]] = []
    w.on_usr2(lambda r, g: stops.append((r, g)))
    assert stops == [("preempt", 120.0)] and w.warned
    assert said[-1][0] == "slurm_warning" and "USR2" in said[-1][1]


def test_a_requeue_slurm_refuses_is_reported_with_its_remedy(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node without Slurm's tools on PATH: the requeue cannot even be asked for.
    monkeypatch.setenv("PATH", str(tmp_path))
    w, clock, said = _watch(tmp_path, [], lead=60)
    w.on_usr2(lambda r, g: None)
    extra: Dict[str, Any] = {}
    saves: List[int] = []
    w.after("PREEMPTED", extra, lambda: saves.append(1))
    assert said[-1][0] == "slurm_requeue_failed" and "not on PATH" in said[-1][1], said
    assert "sbatch" in said[-1][1]  # the remedy: submit it again
    assert extra["slurm"]["requeued"] is False and saves
    # a run that ended otherwise is left alone
    said.clear()
    w.after("SUCCEEDED", extra, lambda: None)
    assert said == []


def test_a_bare_sigterm_whose_job_state_cannot_be_read_is_not_requeued(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    w, clock, said = _watch(tmp_path, [], lead=60)
    w.on_term()
    w.after("PREEMPTED", {}, lambda: None)
    assert said[-1][0] == "slurm_not_requeued" and "scontrol requeue 42" in said[-1][1]


def _fake_scontrol(tmp_path: Any, show: str) -> str:
    """A ``scontrol`` on PATH that prints ``show`` for `show job` and records a `requeue`."""
    marker = os.path.join(str(tmp_path), "requeued")
    path = os.path.join(str(tmp_path), "scontrol")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\ncase $1 in requeue) : > {marker};; show) echo '{show}';; esac\n")
    os.chmod(path, 0o755)
    return marker


def test_a_stop_asked_as_a_warned_run_ended_keeps_its_job_out_of_the_queue(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rgt-agent stop` after the warning's seal ended the run PREEMPTED, before the requeue:
    the stop wins, the job is not requeued and the event says why."""
    marker = _fake_scontrol(tmp_path, "JobId=42 JobState=COMPLETING Restarts=0")
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    w, clock, said = _watch(tmp_path, [], lead=60)
    w.on_usr2(lambda r, g: None)
    extra: Dict[str, Any] = {}
    w.after("PREEMPTED", extra, lambda: None, stop_asked=lambda: True)
    assert said[-1][0] == "slurm_not_requeued" and "stopped by the user" in said[-1][1], said
    assert not os.path.exists(marker) and extra["slurm"]["requeued"] is False
    w, clock, said = _watch(tmp_path, [], lead=60)  # with no stop: requeued
    w.on_usr2(lambda r, g: None)
    w.after("PREEMPTED", {}, lambda: None, stop_asked=lambda: False)
    assert said[-1][0] == "slurm_requeued" and os.path.exists(marker), said
