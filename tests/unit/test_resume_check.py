"""The resume contract check on fake inputs: progress files, output logs and checkpoint dirs
written by the test, a journal in memory, a fake clock. The agent drives the same ResumeCheck
with a real job in tests/integration/test_resume_check.py."""

from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any, Dict, List, Optional

import pytest

from onbox.agent.journal import MemoryJournal
from onbox.agent.resumecheck import (
    FAST_FOR,
    POLL_FAST,
    POLL_SLOW,
    ResumeCheck,
)
from onbox.common import progress
from onbox.common.logscan import LogScanner
from onbox.common.rundir import RunDir
from onbox.sealing.discovery import newest_complete_step, newest_local_step


class Box:
    """A run directory and a checkpoint dir under tmp_path, and a check over them."""

    def __init__(self, tmp_path: Any, pattern: Optional[str] = None) -> None:
        self.rd = RunDir("r", home=str(tmp_path))
        os.makedirs(self.rd.path)
        self.ckpt = str(tmp_path / "ckpt")
        os.makedirs(self.ckpt)
        self.journal = MemoryJournal()
        self.now = 0.0
        self.pattern = pattern
        self.check = self.new_check()

    def new_check(self, doc: Optional[Dict[str, Any]] = None) -> ResumeCheck:
        return ResumeCheck(
            self.rd,
            self.ckpt,
            self.pattern,
            self.journal.event,
            doc=doc,
            clock=lambda: self.now,
        )

    def checkpoint(self, name: str, data: bytes = b"weights") -> str:
        path = os.path.join(self.ckpt, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def output(self, attempt: int, text: str) -> None:
        os.makedirs(self.rd.attempt_dir(attempt), exist_ok=True)
        with open(self.rd.output_log(attempt), "a") as f:
            f.write(text)

    def kinds(self) -> List[str]:
        return [e["kind"] for e in self.journal.events]


def _zip(path: str, torn: bool = False) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data", os.urandom(4096))
    if torn:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


# ---- S from the checkpoint dir
def test_newest_local_step_sees_what_the_sealer_would_seal(tmp_path: Any) -> None:
    d = str(tmp_path)
    assert newest_local_step(os.path.join(d, "missing")) is None
    assert newest_local_step(d) is None
    for name in ("step_3.pt", "step_10.pt"):
        _zip(os.path.join(d, name))
    _zip(os.path.join(d, "step_12.pt"), torn=True)  # its writer died mid-write
    for name in (".step_40.pt.tmp", "step_50.pt.partial", "step_60.txt", "notes_70.log"):
        open(os.path.join(d, name), "w").close()
    assert newest_local_step(d) == 10
    os.makedirs(os.path.join(d, "step_90"))  # no completeness marker: not a checkpoint
    os.makedirs(os.path.join(d, "checkpoint-7"))
    open(os.path.join(d, "checkpoint-7", "trainer_state.json"), "w").close()
    assert newest_local_step(d) == 10
    os.makedirs(os.path.join(d, "latest"))  # onbox.train's marker carries the step
    with open(os.path.join(d, "latest", ".rgt-complete"), "w") as f:
        json.dump({"step": 11}, f)
    assert newest_local_step(d) == 11


def test_newest_complete_step_leaves_out_what_is_still_open_for_writing(tmp_path: Any) -> None:
    """What `rgt-agent sync` asks for while the job writes: the sealer's complete checkpoints,
    so not a file or a directory with a file a process (here this one) holds open to write."""
    d = str(tmp_path)
    assert newest_complete_step(os.path.join(d, "missing")) is None
    _zip(os.path.join(d, "step_3.pt"))
    _zip(os.path.join(d, "step_12.pt"), torn=True)
    os.makedirs(os.path.join(d, "ckpt.pt.d"))  # a directory with no marker: nothing
    _zip(os.path.join(d, "ckpt.pt"))  # rewritten in place: its step is the sealer's
    assert newest_complete_step(d) == 3
    with open(os.path.join(d, "step_20.pt"), "wb") as f:
        assert newest_complete_step(d) == 3 and newest_local_step(d) == 20
    _zip(os.path.join(d, "step_20.pt"))
    assert newest_complete_step(d) == 20
    os.makedirs(os.path.join(d, "step_30"))
    with open(os.path.join(d, "step_30", "model.bin"), "wb"):
        with open(os.path.join(d, "step_30", ".rgt-complete"), "w") as f:
            json.dump({"step": 30}, f)
        assert newest_complete_step(d) == 20 and newest_local_step(d) == 30
    assert newest_complete_step(d) == 30


# ---- reading the output
def _scanner(pattern: str) -> LogScanner:
    return LogScanner(re.compile(pattern))


def test_the_scanner_counts_whole_lines_only_until_the_writer_is_gone(tmp_path: Any) -> None:
    log = str(tmp_path / "out.log")
    s = _scanner(r"step (\d+)")
    assert s.scan(log, 1024) is None  # no output yet
    with open(log, "w") as f:
        f.write("loading data\nstep 1")  # "step 1" may still become "step 12"
    assert s.scan(log, 1024) is None
    with open(log, "a") as f:
        f.write("2\n")
    assert s.scan(log, 1024) == 12
    s = _scanner(r"step (\d+)")
    assert s.scan(log, 1024, final=True) == 12
    with open(log, "w") as f:
        f.write("warming up\nstep 7")
    s = _scanner(r"step (\d+)")
    assert s.scan(log, 1024) is None
    assert s.scan(log, 1024, final=True) == 7  # the job exited: its last line is whole


def test_the_scanner_reads_a_bounded_amount_per_call(tmp_path: Any) -> None:
    log = str(tmp_path / "out.log")
    with open(log, "w") as f:
        f.write("noise\n" * 1000 + "step 42\n")
    s = _scanner(r"step (\d+)")
    calls = 0
    found = None
    while found is None:
        calls += 1
        assert calls < 100
        before = s.offset
        found = s.scan(log, 512)
        assert s.offset - before <= 512
    assert found == 42 and calls >= 6000 // 512


def test_the_scanner_splits_carriage_returns_and_uses_the_step_group() -> None:
    s = _scanner(r"(?:epoch (\d+) )?it=(?P<step>\d+)")
    assert s.match("epoch 3 it=120") == 120
    assert s.match("it=5") == 5
    assert s.match("nothing here") is None
    opt = _scanner(r"step(?: (\d+))?")
    assert opt.match("step") is None  # the group did not take part
    assert _scanner(r"step (\S+)").match("step abc") is None


def test_the_scanner_splits_tqdm_lines(tmp_path: Any) -> None:
    log = str(tmp_path / "out.log")
    with open(log, "w") as f:
        f.write("\r 10%| 3/30 [00:01]\r 20%| 6/30 [00:02]\r")
    assert _scanner(r"\| (\d+)/").scan(log, 1024) == 3


# ---- the check
def test_a_restart_reporting_below_the_checkpoint_is_flagged_once(tmp_path: Any) -> None:
    box = Box(tmp_path)
    box.checkpoint("step_500.pt")
    box.check.begin(2, latest_step=400)
    assert box.check.resume_step == 500  # the local one, not sealed yet, counts too
    assert box.check.next_wakeup() == POLL_FAST
    assert not box.check.poll()
    progress.write(box.rd.path, 480, 1)  # the last attempt's report: not this attempt's
    assert not box.check.poll()
    progress.write(box.rd.path, 0, 2)
    assert box.check.poll()
    [ev] = box.journal.events
    assert ev["kind"] == "resume_mismatch" and ev["class"] == "usage"
    assert ev["reason"] == (
        "attempt 2 restarted after a checkpoint at step 500 but the job reports step 0 in "
        "its progress file: is it loading its newest checkpoint?"
    )
    assert "RGT_CKPT_DIR" in ev["remedy"] and "onbox.train" in ev["remedy"]
    assert (ev["attempt"], ev["resume_step"], ev["reported_step"], ev["source"]) == (
        2,
        500,
        0,
        "progress",
    )
    progress.write(box.rd.path, 1, 2)
    assert not box.check.poll() and not box.check.finish()
    assert box.check.next_wakeup() is None
    assert len(box.journal.events) == 1


def test_a_restart_that_resumes_is_a_quiet_event(tmp_path: Any) -> None:
    box = Box(tmp_path)
    box.check.begin(3, latest_step=500)
    progress.write(box.rd.path, 500, 3)
    assert box.check.poll()
    [ev] = box.journal.events
    assert ev["kind"] == "resumed" and ev["class"] is None
    assert (ev["resume_step"], ev["reported_step"]) == (500, 500)
    assert box.check.to_doc()["verdict"] == "resumed"


def test_a_restored_checkpoint_names_rgt_resume_from(tmp_path: Any) -> None:
    box = Box(tmp_path)
    path = box.checkpoint("step_300.pt")
    box.check.begin(1, resume_from=path, restored_step=300, latest_step=300)
    assert box.check.resume_step == 300
    progress.write(box.rd.path, 0, 1)
    assert box.check.poll()
    [ev] = box.journal.events
    assert ev["reason"] == (
        "attempt 1 resumed from step 300 but the job reports step 0 in its progress file: "
        "is it loading RGT_RESUME_FROM?"
    )
    assert path in ev["remedy"] and ev["resume_from"] == path


@pytest.mark.parametrize(
    "attempt,kw,local",
    [
        (1, {"latest_step": 700}, True),  # a run's first attempt, nothing restored
        (2, {}, False),  # no store, no checkpoint on the box
        (2, {"latest_step": 0}, False),  # S is 0: there is nothing to lose
    ],
)
def test_nothing_to_check(tmp_path: Any, attempt: int, kw: Dict[str, Any], local: bool) -> None:
    box = Box(tmp_path)
    if local:
        box.checkpoint("step_700.pt")
    box.check.begin(attempt, **kw)
    progress.write(box.rd.path, 0, attempt)
    assert box.check.next_wakeup() is None
    assert not box.check.poll() and not box.check.finish()
    assert box.journal.events == []


def test_the_log_pattern_gives_the_first_step_of_the_attempt(tmp_path: Any) -> None:
    box = Box(tmp_path, pattern=r"^step (\d+)")
    box.output(1, "step 999\n")  # the last attempt's output is in its own file
    box.check.begin(2, latest_step=100)
    box.output(2, "resuming\nstep 0\nstep 1\n")
    assert box.check.poll()
    [ev] = box.journal.events
    assert (ev["kind"], ev["reported_step"], ev["source"]) == ("resume_mismatch", 0, "log")
    assert "its output (progress.pattern)" in ev["reason"]


def test_the_next_attempt_concludes_the_last_one_first(tmp_path: Any) -> None:
    box = Box(tmp_path, pattern=r"step (\d+)")
    box.check.begin(2, latest_step=100)
    box.output(2, "step 3")  # no newline: the job died right after
    assert not box.check.poll()
    box.check.begin(3, latest_step=100)
    assert [(e["attempt"], e["reported_step"]) for e in box.journal.events] == [(2, 3)]
    assert box.check.attempt == 3 and box.check.pending


def test_an_attempt_that_never_reports_ends_its_check_quietly(tmp_path: Any) -> None:
    box = Box(tmp_path, pattern=r"step (\d+)")
    box.check.begin(2, latest_step=100)
    box.output(2, "Traceback (most recent call last):\n")
    assert not box.check.finish()
    assert not box.check.pending and box.journal.events == []


def test_polls_slow_down_once_the_attempt_is_old(tmp_path: Any) -> None:
    box = Box(tmp_path)
    box.check.begin(2, latest_step=100)
    assert box.check.next_wakeup() == POLL_FAST
    box.now += FAST_FOR + 1
    assert box.check.next_wakeup() == POLL_SLOW


def test_an_agent_taking_over_goes_on_and_never_repeats(tmp_path: Any) -> None:
    box = Box(tmp_path)
    box.check.begin(2, latest_step=100)
    doc = json.loads(json.dumps(box.check.to_doc()))  # through state.json
    again = box.new_check(doc)
    again.skip(2)  # the same attempt: the record goes on
    assert again.pending and again.resume_step == 100
    progress.write(box.rd.path, 7, 2)
    assert again.poll()
    done = box.new_check(again.to_doc())
    assert not done.pending and not done.poll() and not done.finish()
    assert box.kinds() == ["resume_mismatch"]
    unknown = box.new_check(doc)
    unknown.skip(3)  # an attempt no agent recorded S for is not checked
    assert not unknown.pending and unknown.attempt == 3
    progress.write(box.rd.path, 0, 3)
    assert not unknown.poll()
    assert box.kinds() == ["resume_mismatch"]
