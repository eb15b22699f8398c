"""`rgt status NAME`'s lines (controller/observe.py ``describe``) from the box's document."""

from __future__ import annotations

from typing import Any, Dict

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


def _restored_doc() -> Dict[str, Any]:
    """A new box's run whose agent restored step 40 from the store and has not sealed since:
    its newest 'sealed'-or-'restored' event is the restore (controller/shell/observe.sh)."""
    return {
        "name": "gpt",
        "state": "RUNNING",
        "attempt": 1,
        "job_alive": True,
        "read_at": "2026-12-06T13:00:00Z",
        "box": {
            "sealed": {"kind": "restored", "step": 40, "time": "2026-12-06T12:59:00.000Z"},
            "box_time": 1796562000,  # 2026-12-06T13:00:00Z
        },
    }


def test_a_restored_step_is_the_newest_sealed_and_says_it_came_from_the_store() -> None:
    lines = describe(_restored_doc()).splitlines()
    assert (
        "  newest sealed checkpoint: step 40 (restored from the store at 2026-12-06T12:59:00.000Z)"
    ) in lines, lines


def test_watch_shows_a_restored_step_as_restored_from_the_store() -> None:
    from rich.console import Console

    from controller.watch import render

    console = Console(record=True, width=200)
    console.print(render(_restored_doc(), None, None))
    assert "step 40, restored from the store 1m00s ago" in console.export_text()


def test_the_last_exit_says_its_remedy_where_it_has_one() -> None:
    """A success whose completion seal the store cut is left RUNNING, its last exit the success
    whose results are not sealed, its remedy the start that completes it. Before: `rgt status`
    said why and never what to do (``rgt-agent status`` did)."""
    doc: Dict[str, Any] = {
        "name": "gpt",
        "state": "RUNNING",
        "attempt": 1,
        "job_alive": False,
        "read_at": "2026-12-06T13:00:00Z",
        "last_exit": {
            "attempt": 1,
            "kind": "success",
            "reason": "exited with code 0; its results are not sealed (no DONE.json)",
            "remedy": "`rgt-agent start --name gpt` once the store answers",
        },
    }
    last: Dict[str, Any] = doc["last_exit"]
    lines = describe(doc).splitlines()
    assert (
        "  last exit (attempt 1): success: exited with code 0; its results are not sealed "
        "(no DONE.json) (`rgt-agent start --name gpt` once the store answers)"
    ) in lines, lines
    del last["remedy"]  # none: nothing added
    assert describe(doc).splitlines()[-1].endswith("(no DONE.json)"), describe(doc)
