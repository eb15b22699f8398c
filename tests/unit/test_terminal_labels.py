"""A deploy's messages in `rgt sweep`, each under its box's label (onbox/common/terminal.py
``labelled_say``, as controller/sweep/run.py gives it to each deploy): a message that holds a
newline (an error carrying a box's lines, its reason or its stderr) showed its continuation
lines at the margin, without the label, where they read as a line of rgt's own or of another
box's; and the box's control characters went to the terminal as they came."""

from __future__ import annotations

from typing import Any, List

from onbox.common.terminal import QUOTED, labelled_say, say

LABEL = "  [box-a] "


def _said(msg: str) -> List[str]:
    out: List[str] = []
    labelled_say(LABEL, out.append)(msg)
    return "\n".join(out).split("\n")


def test_every_line_of_a_message_carries_its_boxs_label() -> None:
    lines = _said("rgt: run r1 FAILED on box-a right after its start: Traceback\nValueError: x")
    assert lines == [
        LABEL + "rgt: run r1 FAILED on box-a right after its start: Traceback",
        LABEL + QUOTED + "ValueError: x",
    ], lines


def test_a_boxs_text_in_a_message_cannot_pass_for_a_line_or_drive_the_terminal() -> None:
    lines = _said("rgt: run r1 FAILED: \x1b]0;owned\x07\n  [box-b] rgt sweep: c1 succeeded\n")
    assert lines == [
        LABEL + "rgt: run r1 FAILED: ?]0;owned?",
        LABEL + QUOTED + "  [box-b] rgt sweep: c1 succeeded",
    ], lines


def test_a_one_line_message_is_as_it_was() -> None:
    assert _said("rgt: auditing box-a ...") == [LABEL + "rgt: auditing box-a ..."]


def test_say_renders_a_boxs_lines_and_escapes_as_an_error_does(capsys: Any) -> None:
    """``say`` (a deploy's progress, outside a sweep) wrote its message raw: a box's reason
    with a newline forged a line of rgt's own, its escape sequences drove the terminal."""
    say("rgt: warning: could not be read (\x1b]52;c;eA==\x07\nrgt: run r1 SUCCEEDED)")
    assert capsys.readouterr().err == (
        "rgt: warning: could not be read (?]52;c;eA==?\n" + QUOTED + "rgt: run r1 SUCCEEDED)\n"
    )


def test_a_labelled_say_over_say_renders_once(capsys: Any) -> None:
    labelled_say(LABEL, say)("rgt: failed: \x1b[2J\nValueError: x")
    assert capsys.readouterr().err == (
        LABEL + "rgt: failed: ?[2J\n" + LABEL + QUOTED + "ValueError: x\n"
    )
