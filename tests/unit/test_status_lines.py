"""`rgt status NAME`'s lines (controller/observe.py ``describe``) from the box's document."""

from __future__ import annotations

from controller.observe import describe


def test_the_last_exit_names_its_attempt_so_an_old_failure_is_not_read_as_the_current_one() -> None:
    """A run started again after a failure is RUNNING, and its last exit is still the earlier
    attempt's ("deterministic: not retried"): without the attempt it read as the current one's."""
    doc = {
        "name": "gpt",
        "state": "RUNNING",
        "attempt": 3,
        "job_alive": True,
        "read_at": "2026-12-06T13:00:00Z",
        "last_exit": {
            "attempt": 2,
            "at": "2026-12-06T12:10:00Z",
            "kind": "import_error",
            "reason": "ModuleNotFoundError: No module named 'x' (deterministic: not retried)",
        },
    }
    lines = describe(doc).splitlines()
    assert lines[0].startswith("gpt: RUNNING, attempt 3"), lines
    assert (
        "  last exit (attempt 2, at 2026-12-06T12:10:00Z): import_error: ModuleNotFoundError: "
        "No module named 'x' (deterministic: not retried)"
    ) in lines, lines
