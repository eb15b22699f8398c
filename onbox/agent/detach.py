"""`rgt-agent start`'s hand-over: the agent spawned as a daemon (onbox/agent/daemon.py), and
what its ready message means for the command.

The agent says it is up once it has prepared the run (taken its epoch, restored) and begun its
first attempt, or re-attached to a live job. Two things it may say instead are not a start:
it could not begin (the run is FAILED, or gone when it was new: that error, with its exit code,
onbox/agent/beginning.py ``forget_unbegun``), or the run ended before
its first attempt, because a SIGTERM (a preemption), a Ctrl-C or `rgt-agent stop` came while
the agent prepared it, during a long restore most likely. The latter is ``NotStarted``: one
line saying so, and the exit code `rgt-agent run` gives that final state (FINAL_EXIT_CODES:
13 PREEMPTED, 12 STOPPED), never "started run ..." with exit 0. Both ends of that message are
here: the agent writes it (``ReadyPipe``), ``detach`` reads it.

The restore may take minutes (20 GiB from S3), and `start` waits for it all the same. So the
agent, while it prepares the run, writes a line of what it is doing (``{"working": ..., "done":
bytes, "total": bytes}``) every BEAT seconds before its ready message, from a thread of its own
started before its epoch: `start` shows it (PROGRESS_EVERY), and gives up only on an agent
silent for READY_TIMEOUT (hung, stopped, dead), never on one that is busy.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from typing import Any, Callable, Dict, Optional

from onbox.agent.daemon import spawn_agent
from onbox.agent.lock import RunLock
from onbox.agent.runner import read_ready
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import FINAL_EXIT_CODES, HostError, RgtError, error_from_code
from onbox.common.rundir import RunDir
from onbox.common.size import human
from onbox.common.terminal import printable

# The longest silence `start` takes from the agent it spawned before it gives up on it. Tests
# make it short (RGT_TEST_READY_SILENCE): the agent reads it too, and beats in step.
READY_TIMEOUT = 10.0
SILENCE_ENV = "RGT_TEST_READY_SILENCE"
PROGRESS_EVERY = 10.0  # `start` repeats the agent's progress this often (and on a new step)
PROGRESS_PREFIX = "rgt-agent: "  # each progress line's, as `boot` tells them from the rest
QUIET = 2.0  # and says none of it in a start's first seconds: a quick start prints as before
# A beat is one write to a non-blocking pipe: within PIPE_BUF the kernel writes it whole or not
# at all (a full pipe: the beat is dropped); beyond it, it may write part of the line.
BEAT_MAX = select.PIPE_BUF


def ready_silence() -> float:
    """READY_TIMEOUT, or a test's shorter one."""
    return float(os.environ.get(SILENCE_ENV) or READY_TIMEOUT)


def progress_every() -> float:
    """PROGRESS_EVERY, or a test's silence bound where that is shorter (what reads `start`
    from the laptop bounds its silence too: controller/deploy/flow.py START_SILENCE)."""
    return min(PROGRESS_EVERY, ready_silence())


def beat_every() -> float:
    """How often the agent says it is working: well inside the silence `start` takes."""
    return min(2.0, ready_silence() / 4)


class NotStarted(RgtError):
    """The run ended before its job started (its first attempt, or the next one of a run an
    agent took over after a power-on), while its agent prepared it: ``exit_code`` is its final
    state's (FINAL_EXIT_CODES), as `rgt-agent run` exits."""

    def __init__(self, name: str, state: str) -> None:
        why = {
            "PREEMPTED": "a SIGTERM (a preemption) came",
            "STOPPED": "a stop (Ctrl-C, `rgt-agent stop`) came",
        }.get(state, "it ended")
        super().__init__(
            f"run {name} did not start: {why} while its agent prepared it (took its epoch, "
            f"restored from the store), before the job started; the run is {state}",
            f"start it again: rgt-agent start --name {name}"
            + ("; a power-on does it too, rgt-agent boot" if state == "PREEMPTED" else ""),
        )
        self.exit_code = FINAL_EXIT_CODES.get(state) or 1


class ReadyPipe:
    """The agent's end of `start`'s pipe: from its creation a thread writes ``working()`` every
    beat_every() seconds, until ``say`` writes the ready message and closes the pipe. Each line
    is one write of less than PIPE_BUF, so no two interleave; none is written after the ready
    message. A gone reader is no error (`start` may have given up waiting), and a reader that
    does not read never blocks the agent: a beat that finds the pipe full is dropped."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.working: Callable[[], Dict[str, Any]] = lambda: {"working": "starting the agent"}
        self._lock = threading.Lock()
        self._said = threading.Event()
        os.set_blocking(fd, False)
        self._thread = threading.Thread(target=self._beat, name="rgt-ready", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        every = beat_every()
        while not self._said.is_set():
            try:
                msg = self.working()
            except Exception:  # a sign of life all the same; what it says is only for show
                msg = {"working": "preparing the run"}
            line = beat_line(msg)
            with self._lock:
                if self._said.is_set():
                    return
                try:
                    os.write(self.fd, line)
                except OSError:  # full (a reader behind), or gone: the next beat tries again
                    pass
            self._said.wait(every)

    def say(self, msg: Dict[str, Any]) -> None:
        """Write the ready message (after the last beat) whole, however long (an error's text),
        and close the pipe. A reader that is behind gets the silence bound to make room for
        each piece; then the rest is dropped, and `start` says the agent did not come up."""
        with self._lock:
            if self._said.is_set():
                return
            self._said.set()
            left = memoryview((json.dumps(msg) + "\n").encode())
            try:
                poller = select.poll()
                poller.register(self.fd, select.POLLOUT)
                while left and poller.poll(int(ready_silence() * 1000)):
                    left = left[os.write(self.fd, left) :]
            except OSError:  # the reader gone: `start` gave up waiting
                pass
            finally:
                os.close(self.fd)


def beat_line(msg: Dict[str, Any]) -> bytes:
    """The beat ``msg`` as one line of at most BEAT_MAX bytes: its text shortened until it
    fits (json.dumps escapes a character outside ASCII into up to 12 bytes)."""
    text = str(msg.get("working"))[:500]
    sizes = {k: msg[k] for k in ("done", "total") if isinstance(msg.get(k), int)}
    while True:
        line = (json.dumps({"working": text, **sizes}) + "\n").encode()
        if len(line) <= BEAT_MAX or not text:
            return line
        text = text[: len(text) // 2]


class Progress:
    """`start`'s lines of what its agent is doing (``tell``): after QUIET seconds, a new step at
    once, the same one every progress_every() seconds. The text is the agent's, with the store's
    URL in it: printed through ``printable``."""

    def __init__(self, tell: Callable[[str], None]) -> None:
        self.tell = tell
        self._last = ""
        self._at = self._began = time.monotonic()

    def __call__(self, msg: Dict[str, Any]) -> None:
        what = printable(str(msg.get("working")))
        now = time.monotonic()
        if now - self._began < QUIET or (what == self._last and now - self._at < progress_every()):
            return
        done, total = msg.get("done"), msg.get("total")
        if isinstance(done, int) and isinstance(total, int) and total > 0:
            what_now = f"{what}: {human(done)} of {human(total)}"
        else:
            what_now = what
        self.tell(f"{PROGRESS_PREFIX}{what_now}")
        self._last, self._at = what, now


def detach(
    rd: RunDir, lock: RunLock, tell: Optional[Callable[[str], None]] = None
) -> Dict[str, Any]:
    """Spawn the agent of ``rd`` holding ``lock`` (let go here: the agent holds its own copy of
    the descriptor) and return its ready message once it is up and the run started or was
    re-attached to; meanwhile ``tell`` gets a line of what the agent is doing now and then.
    Raises the agent's own error when it could not begin, NotStarted when the run ended before
    its first attempt, HostError when the agent went silent before it said it was up."""
    r, w = os.pipe()
    try:
        spawn_agent(rd, lock.fd, ready_fd=w)
    finally:
        os.close(w)
        lock.release()
    try:
        msg = read_ready(r, ready_silence(), Progress(tell or (lambda line: None)))
    except HostError as e:  # silent, gone, or a message it could not read (e.what)
        raise HostError(
            f"the agent for {rd.name!r} did not come up: {e.what}", f"see {rd.agent_log}"
        ) from None
    finally:
        os.close(r)
    if msg.get("ok") is False:  # it could not begin (onbox/agent/loop.py): the run is FAILED, why
        code = int(msg.get("exit_code") or 1)
        raise error_from_code(code, str(msg.get("what")), msg.get("remedy"))
    state = str(msg.get("state"))
    if msg.get("cut") in ("PREEMPTED", "STOPPED"):  # its beginning cut by a signal
        raise NotStarted(rd.name, str(msg["cut"]))
    if not msg.get("adopted") and state in TERMINAL_NAMES and FINAL_EXIT_CODES.get(state):
        raise NotStarted(rd.name, state)
    return msg
