"""What `rgt-agent boot` says of a run whose `rgt-agent start` failed (onbox/agent/boot.py): the
start's error and warnings, not again the progress lines it printed while its agent restored
(a long restore prints one every few seconds: boot's one line per run became dozens)."""

from __future__ import annotations

from onbox.agent.boot import _outcome


def test_a_failed_start_is_its_error_and_warnings_without_its_progress() -> None:
    err = "\n".join(
        [
            "warning: the profile's proxy hook is not on the box",
            *(f"rgt-agent: restoring step 7 from s3://b/r: {n} GiB of 20 GiB" for n in range(9)),
            "rgt: run b4 did not start: a SIGTERM (a preemption) came (start it again)",
            "  | the store said: slow down",
        ]
    )
    said = _outcome(13, "", err)
    lines = said.splitlines()
    assert lines[0] == (
        "not started: run b4 did not start: a SIGTERM (a preemption) came (start it again)"
    ), said
    assert "rgt-agent: restoring" not in said, said
    assert "warning: the profile's proxy hook is not on the box" in lines, said
    assert "  | the store said: slow down" in lines, said


def test_a_start_that_said_nothing_is_said_so() -> None:
    assert _outcome(9, "", "") == "not started: `rgt-agent start` failed (exit 9)"
