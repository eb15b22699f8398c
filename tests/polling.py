"""Waiting in tests for what a real process does by itself: a predicate polled until it holds,
bounded (``wait``), or a reading taken until it is the one waited for (``wait_value``); and the
step a ``file://`` store's LATEST.json names."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, List, Optional, TypeVar

T = TypeVar("T")


def wait(
    pred: Callable[..., Any],  # called with no arguments (a lambda may bind a loop variable)
    timeout: float = 30,
    what: str = "condition",
    poll: float = 0.05,
    info: Optional[Callable[[], Any]] = None,
) -> Any:
    """``pred()``'s first true value, polled every ``poll`` seconds (longer where each poll
    starts a process); AssertionError naming ``what`` after ``timeout``, with ``info()``'s
    account of what was seen when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}" + (f": {info()}" if info else ""))


def wait_value(
    read: Callable[[], T],
    ok: Callable[[T], Any],
    timeout: float = 30,
    what: str = "condition",
    poll: float = 0.05,
    show: Callable[[T], Any] = repr,
) -> T:
    """``read()``'s first value for which ``ok`` holds, read every ``poll`` seconds;
    AssertionError naming ``what`` after ``timeout``, with ``show`` of the last value read."""
    last: List[T] = []

    def held() -> Any:
        last[:] = [read()]
        return ok(last[0])

    wait(held, timeout, what, poll, info=lambda: show(last[0]) if last else "nothing read")
    return last[0]


def latest_step(root: str, run: str) -> Optional[int]:
    """The step of ``root/run/LATEST.json`` in a file:// store; None while there is none."""
    try:
        with open(os.path.join(root, run, "LATEST.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return None
