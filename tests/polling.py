"""Waiting in tests for what a real process does by itself: a predicate polled until it holds,
bounded, and the step a ``file://`` store's LATEST.json names."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional


def wait(pred: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    """``pred()``'s first true value, polled every 50 ms; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def latest_step(root: str, run: str) -> Optional[int]:
    """The step of ``root/run/LATEST.json`` in a file:// store; None while there is none."""
    try:
        with open(os.path.join(root, run, "LATEST.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return None
