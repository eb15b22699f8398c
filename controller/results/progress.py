"""Progress of a pull: the reports ``pull`` makes (Progress), the watch on the staged copies
that makes them while files are fetched (Monitor), and how a terminal shows them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Set

from controller.results.entries import Entry, stage_path
from onbox.common.size import human
from onbox.common.terminal import printable


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress report. ``phase`` is "fetch", "verify" or "done"; ``path`` the file
    concerned (relative to DEST, "" for a total). Reported from a background thread while
    fetching, from the caller's thread otherwise."""

    phase: str
    path: str
    done: int
    size: int
    total_done: int
    total: int


ProgressFn = Callable[[Progress], None]


class Monitor:
    """Reports fetch progress by watching the temporary files grow (every transport), and
    each file the moment a transport says it is finished.

    Its cost does not grow with the square of the files: the total is kept as it changes
    (not summed over every file at each report), and a poll looks at no more than POLL_AHEAD
    unfinished files from the first one on, where the store's downloads and the stream are
    (they take the files in this order), and as many again from a cursor that goes round the
    rest, where rsync may be (it takes them in its own sorted order): each file in flight is
    seen within a few polls, and every file is reported whole when it is finished."""

    POLL_AHEAD = 64

    def __init__(self, stage_dir: str, items: List[Entry], fn: Optional[ProgressFn]) -> None:
        self.stage_dir = stage_dir
        self.items = items
        self.fn = fn
        self.total = sum(e.size for e in items)
        self.seen: Dict[str, int] = {}
        self.done = 0  # the sum of ``seen``
        self._complete: Set[str] = set()
        self._first = 0  # every file before this one is complete
        self._cursor = 0  # where the window round the rest looks next
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> Monitor:
        if self.fn is not None:
            self._thread = threading.Thread(
                target=self._loop, name="rgt-pull-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if exc[0] is None:
                self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.poll()

    def _size(self, e: Entry) -> int:
        try:
            return min(os.path.getsize(stage_path(self.stage_dir, e)), e.size)
        except OSError:
            return 0

    def poll(self) -> None:
        if self.fn is None:
            return
        with self._lock:
            n = len(self.items)
            while self._first < n and self.items[self._first].stage in self._complete:
                self._first += 1
            head = self._look(range(self._first, n))
            if head < n:  # more unfinished files than the head holds: a window round the rest
                start = max(self._cursor, head)
                end = min(n, start + self.POLL_AHEAD)
                self._look(range(start, end))
                self._cursor = end if end < n else head

    def _look(self, indexes: range) -> int:
        """Stat and report up to POLL_AHEAD unfinished files of ``indexes``; the index after
        the last one looked at."""
        looked = 0
        for i in indexes:
            e = self.items[i]
            if e.stage in self._complete:
                continue
            size = self._size(e)
            if size == e.size:  # whole (an earlier pull's copy, or one not announced yet)
                self._complete.add(e.stage)
            self._report(e, size)
            looked += 1
            if looked == self.POLL_AHEAD:
                return i + 1
        return indexes.stop

    def finished(self, e: Entry) -> None:
        """A transport finished ``e`` (its copy is complete, not yet verified)."""
        if self.fn is None:
            return
        with self._lock:
            self._complete.add(e.stage)
            self._report(e, e.size)

    def _report(self, e: Entry, size: int) -> None:
        assert self.fn is not None
        old = self.seen.get(e.stage)
        if old != size:
            self.seen[e.stage] = size
            self.done += size - (old or 0)
            self.fn(Progress("fetch", e.path, size, e.size, self.done, self.total))


# ---- progress on a terminal


@contextlib.contextmanager
def terminal_progress(stream: Optional[IO[str]] = None) -> Iterator[ProgressFn]:
    """A progress callback for ``pull``: rich bars (a total and one per file being fetched)
    on a terminal, a plain line every few seconds otherwise."""
    out = stream or sys.stderr
    if not out.isatty():
        last = [0.0]

        def plain(p: Progress) -> None:
            now = time.monotonic()
            # a line every few seconds, at the end, and when a file of some size is complete
            # (not for each of a checkpoint's 10,000 small files)
            whole = p.phase == "fetch" and p.done == p.size and p.size * 100 >= p.total
            if p.phase == "done" or now - last[0] >= 5 or whole:
                last[0] = now
                pct = 100 * p.total_done // max(p.total, 1)
                print(
                    f"rgt pull: {p.phase} {pct}% ({human(p.total_done)} of {human(p.total)})"
                    + (f" {printable(p.path)}" if p.path else ""),
                    file=out,
                    flush=True,
                )

        yield plain
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bars

    bars = Bars(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(file=out),
        transient=False,
    )
    lock = threading.Lock()
    tasks: Dict[str, Any] = {}

    def show(p: Progress) -> None:
        if p.phase == "done":
            return
        with lock:
            key = "total:" + p.phase
            if key not in tasks:
                tasks[key] = bars.add_task(p.phase, total=p.total)
            bars.update(tasks[key], completed=p.total_done, total=p.total)
            if p.phase == "fetch" and p.path:
                if p.done < p.size:
                    if p.path not in tasks:
                        # The name is the box's or the store's: shown as it is, never read
                        # as rich markup ("[/]" in it raised MarkupError) nor as a new line.
                        shown = escape(printable(p.path))
                        tasks[p.path] = bars.add_task(f"  {shown}", total=p.size)
                    bars.update(tasks[p.path], completed=p.done)
                elif p.path in tasks:  # done: its bar goes (rich redraws every bar it keeps)
                    bars.remove_task(tasks.pop(p.path))

    with bars:
        yield show
