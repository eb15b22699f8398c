"""The resume contract check with a real agent: a job restarted after a checkpoint at step S
that reports a step below S is flagged, once, with what to do; one that resumes is recorded
quietly. Reports come from the progress file (onbox.common.progress) or a log pattern."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import pytest

from tests.conftest import Cli, fixture
from tests.polling import wait

JOB = fixture("resume_job.py")


def _job(
    cli: Cli,
    name: str,
    resume: str,
    report: str,
    end: str,
    store: Optional[str] = None,
    pattern: Optional[str] = None,
) -> str:
    lines = [f"name = {json.dumps(name)}", f"command = {json.dumps([*JOB, resume, report, end])}"]
    if store is not None:
        lines.append(f"store = {json.dumps(store)}")
    lines += ["[restart]", 'start_grace = "0.5s"']
    if pattern is not None:
        lines += ["[progress]", f"pattern = {json.dumps(pattern)}"]
    path = os.path.join(cli.home, f"{name}.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _store(tmp_path: Any) -> str:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    return "file://" + root


def _of(cli: Cli, name: str, *kinds: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(name) if e["kind"] in kinds]


def _agent_log(cli: Cli, name: str) -> str:
    with open(os.path.join(cli.home, "runs", name, "agent.log")) as f:
        return f.read()


def test_a_restart_that_starts_again_from_step_0_is_flagged(cli: Cli, tmp_path: Any) -> None:
    cli("start", _job(cli, "rc1", "ignore", "progress", "crash", _store(tmp_path)), check=True)
    st = cli.wait_state("rc1", "SUCCEEDED", timeout=90)
    found = _of(cli, "rc1", "resume_mismatch", "resumed")
    assert [e["kind"] for e in found] == ["resume_mismatch"], found  # once, for attempt 2
    ev = found[0]
    assert ev["class"] == "usage" and ev["attempt"] == 2 and ev["source"] == "progress"
    assert ev["resume_step"] == 5 and ev["reported_step"] < 5
    assert (
        f"after a checkpoint at step 5 but the job reports step {ev['reported_step']}"
        in (ev["reason"])
    )
    assert "RGT_RESUME_FROM" in ev["remedy"] and "onbox.train" in ev["remedy"]
    assert ev["reason"] in _agent_log(cli, "rc1")
    # rgt-agent status shows the job's last report
    assert st["progress"]["attempt"] == 2 and st["progress"]["step"] == 2
    assert isinstance(st["progress"]["time"], float)


def test_a_restart_that_resumes_is_recorded_quietly(cli: Cli, tmp_path: Any) -> None:
    cli("start", _job(cli, "rc2", "honor", "progress", "crash", _store(tmp_path)), check=True)
    cli.wait_state("rc2", "SUCCEEDED", timeout=90)
    found = _of(cli, "rc2", "resume_mismatch", "resumed")
    assert [e["kind"] for e in found] == ["resumed"], found
    ev = found[0]
    assert ev["class"] is None and ev["attempt"] == 2
    assert ev["resume_step"] == 5 and ev["reported_step"] >= 5


@pytest.mark.parametrize("resume,kind", [("ignore", "resume_mismatch"), ("honor", "resumed")])
def test_the_log_pattern_reports_the_first_step(cli: Cli, resume: str, kind: str) -> None:
    # No store: S is the newest complete checkpoint on the local disk.
    name = f"rl-{resume}"
    job = _job(cli, name, resume, "log", "crash", pattern=r"^step (?P<step>\d+)$")
    cli("start", job, check=True)
    st = cli.wait_state(name, "SUCCEEDED", timeout=90)
    found = _of(cli, name, "resume_mismatch", "resumed")
    assert [e["kind"] for e in found] == [kind], found
    assert found[0]["source"] == "log" and found[0]["resume_step"] == 5
    assert found[0]["reported_step"] == (0 if resume == "ignore" else 5)  # the first line
    assert st["progress"] is None  # this job writes no progress file


def test_a_restored_checkpoint_the_job_does_not_load_is_flagged(cli: Cli, tmp_path: Any) -> None:
    store = _store(tmp_path)
    cli("start", _job(cli, "rc3", "ignore", "progress", "hang", store), check=True)
    latest = os.path.join(store[len("file://") :], "rc3", "LATEST.json")
    wait(lambda: os.path.exists(latest), 60, "step 5 sealed")
    cli("stop", "rc3", "--grace", "1", check=True)
    cli("start", "--name", "rc3", check=True)  # a new incarnation: restore, RGT_RESUME_FROM
    cli.wait_state("rc3", "SUCCEEDED", timeout=90)
    assert [e["step"] for e in _of(cli, "rc3", "restored")] == [5]
    found = _of(cli, "rc3", "resume_mismatch", "resumed")
    assert [e["kind"] for e in found] == ["resume_mismatch"], found
    ev = found[0]
    assert ev["attempt"] == 2 and ev["resume_step"] == 5
    assert ev["resume_from"] == os.path.join(cli.home, "runs", "rc3", "ckpt", "step_5.pt")
    assert "resumed from step 5 but the job reports step" in ev["reason"]
    assert ev["reason"].endswith("is it loading RGT_RESUME_FROM?")
    assert ev["resume_from"] in ev["remedy"]


def test_a_restart_after_a_restore_resumes_from_the_newer_checkpoint(
    cli: Cli, tmp_path: Any
) -> None:
    # Attempt 2 begins a new incarnation from restored step 5, writes step 10 and dies;
    # attempt 3 must not be sent back to step 5 by RGT_RESUME_FROM: it gets '' and resumes
    # from its own newest checkpoint, step 10.
    store = _store(tmp_path)
    cli("start", _job(cli, "rc4", "honor", "progress", "hang,crash", store), check=True)
    latest = os.path.join(store[len("file://") :], "rc4", "LATEST.json")
    wait(lambda: os.path.exists(latest), 60, "step 5 sealed")
    cli("stop", "rc4", "--grace", "1", check=True)
    cli("start", "--name", "rc4", check=True)
    cli.wait_state("rc4", "SUCCEEDED", timeout=90)
    found = _of(cli, "rc4", "resume_mismatch", "resumed")
    assert [(e["kind"], e["attempt"], e["resume_step"]) for e in found] == [
        ("resumed", 2, 5),
        ("resumed", 3, 10),
    ], found
    ckpt = os.path.join(cli.home, "runs", "rc4", "ckpt")
    assert [e["resume_from"] for e in found] == [os.path.join(ckpt, "step_5.pt"), ""]
    assert found[1]["reported_step"] >= 10
