"""The bound on a download that moves nothing (onbox/sealing/fetch.py ``in_parallel``: a
restore's, and the laptop's pull from a store, controller/results/transport.py): ``Stall``
reads what is under the download's stage (``stage_marks``: any store's files, its temporary
ones too) and, once that has not changed for the bound, raises ``RestoreStalled``, a
TransientStoreError (exit 14). A store that still sends, however slowly, is never cut.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

from onbox.common.errors import TransientStoreError

T = TypeVar("T")


# How a user gives a store longer, as an error says it: the job file's setting, which a run's
# agent and the laptop go by; a command with a bound of its own (`rgt-agent restore --stall`)
# says its option instead.
STALL_SETTING = "[store] stall in the job file"


class RestoreStalled(TransientStoreError):
    """A download (a restore's, a pull's) moved nothing for its bound (``Stall``)."""


def took(bound: float) -> str:
    """``bound`` seconds as an error says it: "5 min", "3s"."""
    return f"{bound / 60:g} min" if bound >= 60 else f"{bound:g}s"


def stage_marks(stage: str) -> Tuple[int, int, int]:
    """What is under ``stage`` now: (files, bytes allocated, bytes long), any store's temporary
    files included (the Hub's download directory): any change is movement."""
    files = blocks = length = 0
    for top, _, names in os.walk(stage):
        for name in names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:  # gone meanwhile (renamed into place, a temporary file)
                continue
            files, blocks, length = files + 1, blocks + st.st_blocks, length + st.st_size
    return files, blocks, length


class Stall:
    """The bound on a download that moves nothing: ``check()``, called in in_parallel's wait,
    raises ``stalled()`` once ``moved()`` has given the same answer for ``bound`` seconds
    (read at most every ``every`` seconds: it walks the stage), and is ``fired`` from then on;
    ``reset()`` when a file ends."""

    def __init__(
        self, bound: float, moved: Callable[[], object], stalled: Callable[[], Exception]
    ) -> None:
        self.bound, self.moved, self.stalled = bound, moved, stalled
        self.every = min(2.0, bound / 5)
        self._seen: object = None
        self.fired = False
        self._since = self._read_at = time.monotonic()

    def reset(self) -> None:
        self._seen, self._since = None, time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now - self._read_at < self.every:
            return
        self._read_at = now
        seen = self.moved()
        if seen != self._seen:
            self._seen, self._since = seen, now
        elif now - self._since >= self.bound:
            self.fired = True
            raise self.stalled()


class Daemons:
    """The workers of a download a stall may leave behind: ``n`` daemon threads, each running
    the jobs submitted in turn. One blocked where no stop reaches (a read from a hung mount, a
    request on boto3's path waiting for botocore's timeouts) then does not keep the process
    from exiting once it has said the stall, as a ThreadPoolExecutor's worker would (Python
    joins those at exit). The fetch workers (fetch.in_parallel) and the lanes of their requests
    (base.Lanes) are these."""

    def __init__(self, n: int, name: str) -> None:
        Job = Tuple[concurrent.futures.Future[Any], Callable[[], Any]]
        self._jobs: queue.SimpleQueue[Optional[Job]] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fut, fn))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn = job
            if not fut.set_running_or_notify_cancel():  # cancelled before it began
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller's to raise
                fut.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """No more jobs; with ``wait``, once every worker is over."""
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()
