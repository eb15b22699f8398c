"""The pull's progress watch (controller/results/progress.py Monitor) on a real staging
directory: a file growing anywhere in the list is seen while it grows, not only once finished,
and the reports add up, however many files the pull has."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import List

import pytest

from controller.results.entries import Entry
from controller.results.progress import Monitor, Progress, terminal_progress


def _entries(n: int, size: int) -> List[Entry]:
    return [
        Entry(f"f/{i:04d}.bin", "checkpoint", size, "0" * 64, None, f"f/{i:04d}.bin")
        for i in range(n)
    ]


def _write(stage: Path, e: Entry, n: int) -> None:
    p = stage / e.stage
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * n)


def test_a_file_in_flight_far_down_the_list_is_seen_growing(tmp_path: Path) -> None:
    """rsync takes the files in its own sorted order: the one it is writing may be the 900th
    of the list while the first ones are not begun. A poll looks at a bounded number of files,
    and still reports that file's partial size within a few polls."""
    items = _entries(1000, 4096)
    reports: List[Progress] = []
    m = Monitor(str(tmp_path), items, reports.append)
    _write(tmp_path, items[900], 1000)  # in flight, far from the head
    polls = 0
    while not [p for p in reports if p.path == items[900].path] and polls < 100:
        m.poll()
        polls += 1
    seen = [p for p in reports if p.path == items[900].path]
    assert seen and seen[-1].done == 1000 and seen[-1].total_done == 1000, (polls, seen)
    assert polls <= 1000 // Monitor.POLL_AHEAD + 2

    m.finished(items[900])  # the transport says it is whole
    _write(tmp_path, items[0], 4096)  # the head, whole before it is announced
    m.poll()
    assert reports[-1].total_done == 2 * 4096 and m.done == 2 * 4096


def test_reports_add_up_to_the_total_once_every_file_is_finished(tmp_path: Path) -> None:
    items = _entries(500, 100)
    reports: List[Progress] = []
    m = Monitor(str(tmp_path), items, reports.append)
    for i, e in enumerate(items):
        _write(tmp_path, e, 50 if i % 2 else 100)
        if i % 7 == 0:
            m.poll()
        if not i % 2:
            m.finished(e)
    for e in items[1::2]:
        _write(tmp_path, e, 100)
        m.finished(e)
    m.poll()
    totals = [p.total_done for p in reports]
    assert totals == sorted(totals) and totals[-1] == m.total == 500 * 100
    assert os.path.isdir(tmp_path / "f")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_file_name_is_shown_as_it_is_never_as_markup_or_a_line_of_its_own(tty: bool) -> None:
    """The names come from the box or the store: on a terminal, rich read "[/]" in one as
    markup and the pull ended in a MarkupError; a newline (a name may hold one) forged a line."""
    out = _Terminal() if tty else io.StringIO()
    name = "checkpoints/a[/]b [bold]c\nFORGED LINE"
    with terminal_progress(out) as show:
        show(Progress("fetch", name, 5, 10, 5, 10))  # in flight: its bar is drawn at the end
    text = out.getvalue()
    assert "a[/]b [bold]c?FORGED LINE" in text, text
    assert "\nFORGED" not in text


def test_a_plain_progress_line_of_small_files_says_their_size() -> None:
    """Off a terminal each line gave whole MiB: a pull of a few KiB read "(0/0 MiB)"."""
    out = io.StringIO()
    with terminal_progress(out) as show:
        show(Progress("done", "", 3000, 3000, 3000, 3000))
    text = out.getvalue()
    assert "0/0 MiB" not in text, text
    assert "rgt pull: done 100% (2.9 KiB of 2.9 KiB)" in text, text
