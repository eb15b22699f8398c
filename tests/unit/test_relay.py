"""A relayed command's stderr on the terminal (controller/capture.py LineRelay): every line as it
comes, except the rgt error a failed command ends with, which its caller's error says once
(`rgt deploy`'s start: controller/deploy/boxstart.py)."""

from __future__ import annotations

import pytest

from controller.capture import ERR_TAIL
from controller.remote import LocalRemote

PROGRESS = "printf 'rgt-agent: restoring 1 of 2\\n' >&2; "
WARNING = "printf 'rgt: warning: the store is slow\\n' >&2; "
ERROR = (
    "printf 'rgt: command: x is not found (give its full path)\\n  | what the box said\\n' >&2; "
)


def _shown(capsys: pytest.CaptureFixture[str], script: str) -> str:
    capsys.readouterr()
    LocalRemote().sh(script, relay=True, timeout=30)
    return capsys.readouterr().err


def test_a_failed_commands_error_is_left_to_the_caller(capsys: pytest.CaptureFixture[str]) -> None:
    err = _shown(capsys, PROGRESS + WARNING + ERROR + "exit 2")
    assert "  | rgt-agent: restoring 1 of 2\n" in err, err
    assert "  | rgt: warning: the store is slow\n" in err, err
    assert "is not found" not in err and "what the box said" not in err, err


def test_a_command_that_succeeds_shows_every_line_in_its_place(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _shown(capsys, WARNING + PROGRESS + ERROR + "exit 0")
    assert err.splitlines() == [
        "  | rgt: warning: the store is slow",
        "  | rgt-agent: restoring 1 of 2",
        "  | rgt: command: x is not found (give its full path)",
        "  |   | what the box said",
    ], err


def test_an_error_that_goes_on_and_on_is_shown_not_held(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The relay holds an rgt error and the "  | " lines it carries for the caller's error; a
    box that sends such lines without end was held whole, in the laptop's memory, however much
    it sent. Past ERR_TAIL bytes they are shown as they come, and nothing is held."""
    lines = 20000
    flood = f"i=0; while [ $i -lt {lines} ]; do printf '  | %060d\\n' $i >&2; i=$((i+1)); done; "
    capsys.readouterr()
    r = LocalRemote().sh(ERROR + flood + "exit 2", relay=True, timeout=60)
    err = capsys.readouterr().err
    assert r.rc == 2 and len(r.stderr) > ERR_TAIL  # more than the relay may hold
    assert len(r.held) <= ERR_TAIL, len(r.held)
    assert err.count("\n") >= lines - ERR_TAIL // 60, err[-300:]
