"""rgt ended from outside: SIGHUP (the terminal it ran in is gone: nobody sees its lines or can
answer it) and SIGTERM (`kill PID`, a service manager, `timeout`), each taken as the person's
Ctrl-C.

rgt's children run in sessions of their own (controller/children.py), so neither signal reaches
them, and rgt, ended at once by either (their default action), left them running: an ssh
following a log lived on until its next write to rgt's closed pipes (a quiet job: never). Here
each raises KeyboardInterrupt in the main thread, as a Ctrl-C does, so every command ends by the
path it has for one and keeps what it promises there: its children killed by their PIDs
(children.py ``run``, ``Child.kill``, controller/observe.py ``_follow``), a deploy's half-made
release dropped (controller/deploy/leftrelease.py), `rgt sweep`'s deploys in flight let end and
recorded, and a second ask leaving them cut off (controller/sweep/run.py ``drive``).

A hang-up is only ever that first ask: one that comes after another ask (a Ctrl-C, a SIGTERM, a
hang-up before: a terminal can hang up twice) is noted, not raised. Closing the window says
nothing more than that nobody is there; the deploys a first Ctrl-C lets end are not cut off by
it (each ends within its own timeouts). A Ctrl-C or a SIGTERM raises each time, as before.

Work that must not be cut (stopping the processes a command started) runs ``held``: an ask
there is noted, not raised, and raises at its end. Within ``held``, ``raised_once`` lets the
first ask raise, as outside, and holds the later ones, so that the unwinding it starts (the
finally clauses that stop those processes) is not cut by a second Ctrl-C or SIGTERM: `rgt
smoke` walks so (controller/smoke/walk.py), as its local box's agents, shims and jobs have no
other owner.

rgt then exits 128 + the first of these two signals (129, 143), once ``children.stop_all``
ended any child still running (``ended``); a Ctrl-C alone leaves the exit code as it was (130,
or 0 where it only stops a reading: `rgt logs -f`). A signal that was ignored when
rgt started (`nohup rgt sweep ...`: SIGHUP) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Iterator, List, Optional

from controller import children

_ASKS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The defaults replaced: Python's own for SIGINT (KeyboardInterrupt), the kernel's for the others.
_DEFAULTS: List[Any] = [signal.default_int_handler, signal.SIG_DFL]

_got: List[int] = []  # the signals received while ``handled``, first first
_live = False
# What an ask does now (main thread): raise; hold (noted in _pending, raised at the end of
# ``held``); raise once (``raised_once``), then hold.
_RAISE, _HOLD, _ONCE = "raise", "hold", "once"
_mode = _RAISE
_pending = False  # an ask was held and is not raised yet


def _ask(signum: int, frame: Optional[FrameType]) -> None:
    global _mode, _pending
    first = not _got
    _got.append(signum)
    if not _live or (not first and signum == signal.SIGHUP):
        return
    if _mode == _HOLD:
        _pending = True
        return
    if _mode == _ONCE:
        _mode = _HOLD  # (before raising: the unwinding is held from its first step)
    raise KeyboardInterrupt


@contextlib.contextmanager
def handled() -> Iterator[List[int]]:
    """Within it, SIGINT, SIGTERM and SIGHUP are asks to end (module docstring); it yields the
    signals received, first first. Outside the main thread (where no handler can be set) and
    for a signal ignored before, nothing changes. The handlers before are put back at its end."""
    global _live, _mode, _pending
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    before = {s: signal.getsignal(s) for s in _ASKS}
    del _got[:]
    _mode, _pending = _RAISE, False
    _live = True
    for s, h in before.items():
        if any(h is d for d in _DEFAULTS):
            signal.signal(s, _ask)
    try:
        yield _got
    finally:
        _live = False
        for s, h in before.items():
            signal.signal(s, h)


class held:
    """Within it (in the main thread, within ``handled``) an ask is noted, for the exit code,
    but not raised, so that the work there is not cut; at its end the first ask held raises
    KeyboardInterrupt, unless an exception is leaving already or it is itself within ``held``.
    Elsewhere it changes nothing."""

    def __enter__(self) -> None:
        global _mode
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.before, _mode = _mode, _HOLD

    def __exit__(self, typ: Any, value: Any, tb: Any) -> None:
        global _mode, _pending
        if not self.main:
            return
        asked = _pending and self.before != _HOLD
        # A raise-once region whose ask a held one uses up holds from now on, as after its own.
        _mode = _HOLD if asked and self.before == _ONCE else self.before
        if asked:
            _pending = False
            if typ is None:
                raise KeyboardInterrupt


class raised_once:
    """Within ``held``: the first ask raises KeyboardInterrupt, as outside ``held``, and the
    later ones are held again (noted, not raised) while the exception unwinds, so that its
    finally clauses (which stop what was started) are not cut; an ask held before it raises
    at its start. Elsewhere it changes nothing."""

    def __enter__(self) -> None:
        global _mode, _pending
        self.main = threading.current_thread() is threading.main_thread()
        if not self.main:
            return
        self.before = _mode
        if _pending and _mode == _HOLD:
            _pending = False
            raise KeyboardInterrupt
        _mode = _ONCE

    def __exit__(self, typ: Any, value: Any, tb: Any) -> None:
        global _mode
        if self.main:
            _mode = self.before


def outside(got: List[int]) -> Optional[int]:
    """The first SIGHUP or SIGTERM of ``got`` (``handled``'s), None when there is none: a
    Ctrl-C alone leaves the command's own exit code (130, or 0 where it stops a reading: `rgt
    logs -f`)."""
    return next((s for s in got if s != signal.SIGINT), None)


def ended(got: List[int], rc: int) -> int:
    """The exit code of an rgt whose command returned ``rc`` with ``got`` received: 128 + the
    first signal from outside (``outside``), once every child still running is stopped and
    stdout and stderr no longer fail at exit; else ``rc``."""
    global _mode
    signum = outside(got)
    if signum is None:
        return rc
    _mode = _HOLD  # rgt is ending: a later ask cuts neither stop_all nor the exit code
    children.stop_all()
    for f in (sys.stdout, sys.stderr):
        # A terminal that is gone fails the flush at exit (EIO), and Python then exits 120:
        # what is left to write goes nowhere, as nobody reads it.
        try:
            f.flush()
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError):
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, f.fileno())
                os.close(fd)
    return 128 + signum
