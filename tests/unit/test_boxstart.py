"""What `rgt deploy` says when the box's start fails, or the run it started has ended already
(controller/deploy/boxstart.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from controller.cli import cli
from controller.deploy import leftrelease
from controller.deploy.boxstart import MARK, ended, failure_words, start_failed
from controller.deploy.release import PushResult
from onbox.common.errors import FINAL_EXIT_CODES


@pytest.mark.parametrize("rc", [12, 13])
def test_a_start_cut_by_a_stop_or_preemption_names_a_command_rgt_has(rc: int) -> None:
    e = start_failed("box1", "gpt", rc, "rgt: run gpt did not start: a SIGTERM came ...")
    assert e.exit_code == rc
    named = re.findall(r"`rgt ([a-z-]+)", e.remedy or "")
    assert named, e.remedy
    for command in named:  # the user types what the remedy says
        assert command in cli.commands, (command, e.remedy)


@pytest.mark.parametrize("rc", [2, 5, 14])
def test_a_refusal_of_the_box_keeps_its_exit_code(rc: int) -> None:
    assert start_failed("box1", "gpt", rc, "rgt: what the box said").exit_code == rc


def test_an_exit_that_is_not_one_of_rgts_is_not_passed_on() -> None:
    # 3 and 4 mean on the laptop that the box did not answer or refused the login.
    for rc in (3, 4, 127):
        assert start_failed("box1", "gpt", rc, "sh: rgt-agent: not found").exit_code == 9


@pytest.mark.parametrize("rc", [2, 5, 12, 13, 14])
def test_one_of_rgts_codes_without_rgts_error_line_is_the_boxs(rc: int) -> None:
    """Python's "can't open file" exits 2: not a usage error of the user's."""
    e = start_failed("box1", "gpt", rc, "python3: can't open file '/x/rgt-agent'")
    assert e.exit_code == 9 and f"(exit {rc}) without an error of rgt's" in e.what, e.line()
    assert "can't open file" in e.what, e.line()


@pytest.mark.parametrize("state", ["FAILED", "STOPPED", "PREEMPTED"])
def test_a_run_seen_ended_exits_with_its_states_code_and_names_rgt_logs(state: str) -> None:
    e = ended("gpt", "box1", {"state": state, "last_exit": None})
    assert e is not None and e.exit_code == FINAL_EXIT_CODES[state], state
    assert e.what.startswith(f"run gpt {state} on box1"), e.what
    assert "`rgt logs gpt`" in (e.remedy or ""), e.remedy
    for command in re.findall(r"`rgt ([a-z-]+)", e.remedy or ""):
        assert command in cli.commands, (command, e.remedy)


def test_a_run_seen_succeeded_or_live_is_no_error() -> None:
    for state in ("SUCCEEDED", "RUNNING", "STARTING", "BACKOFF"):
        assert ended("gpt", "box1", {"state": state}) is None


def test_the_drop_word_is_read_from_the_last_line_only_and_never_trusted() -> None:
    """The start's stdout keeps what the agent printed; the words said after it are only compared
    with fixed ones: anything else says the release may be left (deploy/leftrelease.py)."""
    pushed = PushResult("0123456789abcdef", "/h/releases/0123456789abcdef", 1, 9, "rsync")
    out, words = failure_words(f"agent said\n\n{MARK}removed held\n")
    assert (out, words) == ("agent said\n", ["removed", "held"])
    assert "was removed from the box again" in leftrelease.line(pushed, "gpt", words[0])
    assert failure_words("agent said\n") == ("agent said\n", [])
    for odd in (None, "removed; rm -rf /", "\x1b[2J"):
        said = leftrelease.line(pushed, "gpt", odd)
        assert "may be left on the box" in said and "\x1b" not in said, said
    kept = dataclasses.replace(pushed, method="existing")
    assert "it was there before this deploy" in leftrelease.line(kept, "gpt", "removed")
