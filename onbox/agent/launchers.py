"""What a distributed job's output says of how it ended, for onbox/agent/classify.py.

A job of several ranks prints differently from one process, in three ways that hid the cause
of its end:

- PyTorch prefixes every line of an uncaught exception in a process of a process group with
  its rank (``[rank1]: ModuleNotFoundError: ...``), and torchrun's ``--tee`` each line of a
  worker with its local rank (``[default1]:``): the traceback was not found, and an import
  error, which no retry can mend, was retried as a bare "exited with code 1".
- torchrun (``torch.distributed.run``) ends with its own ChildFailedError, whose summary names
  the first rank that failed and how ("Root Cause (first observed failure)": its rank, its
  exit code, negative for a signal). The job's status is torchrun's exit code 1, so a rank the
  OOM killer ended, or one killed from outside, read as a Python exception of the launcher.
- A rank whose peer stopped (another node preempted or crashed, a network fault, a hang) fails
  in a collective: NCCL's watchdog aborts it (SIGABRT) after its timeout, gloo raises that
  the connection was closed or reset by the peer. That is no fault of this rank's code.

A job that starts its processes with ``torch.multiprocessing.spawn`` (``mp.spawn``) ends, when
a child fails, on the parent's ProcessRaisedException, whose message carries the child's own
traceback ("-- Process N terminated with the following error:"), or on ProcessExitedException
("process N terminated with signal SIGKILL") for a child ended by a signal or an exit code.
Read as the parent's own exception, a child's import error was retried as any exception, and a
child the OOM killer ended, or one killed from outside, was a Python exception of the parent.

``root_cause`` reads torchrun's summary, ``rank_lines`` one rank's own lines, ``unprefixed``
the output with the rank prefixes taken off, ``spawned`` mp.spawn's failed child, and
``peer_lost`` the line that says a peer went.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from typing import List, Optional

# torchrun's --tee puts its own in front of PyTorch's: "[default1]:[rank1]: Traceback ...".
_PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]:[ ]?)+", re.MULTILINE)
_ROOT = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
# What a rank says when another one stopped taking part in a collective: NCCL's watchdog (its
# timeout, then SIGABRT: "taking the entire process down") and a remote error, and gloo's TCP
# transport. Checked only in the failing rank's own last error (classify.py), never anywhere
# in the output, where another rank's lines may say it of this one. A lost connection counts
# only where gloo's transport says it: any socket says "Connection reset by peer" (a plain job's
# dataset download), and that is the job's own exception.
PEER = re.compile(
    r"Watchdog caught collective operation timeout|NCCL communicator was aborted"
    r"|Some NCCL operations have failed or timed out|ncclRemoteError"
    r"|remote process exited or there was a network error"
    r"|gloo/transport/\S*\] [^\n]*Connection (?:closed|reset) by peer"
)


@dataclasses.dataclass(frozen=True)
class RootCause:
    """torchrun's first failed rank: its global and local rank and its exit code (negative: the
    signal that ended it)."""

    rank: int
    local_rank: Optional[int]
    exitcode: int


def root_cause(tail: str) -> Optional[RootCause]:
    """The first failed rank of torchrun's last ChildFailedError summary in ``tail``; None when
    there is none (or it is cut off before its exit code)."""
    at = tail.rfind(_ROOT)
    if at < 0:
        return None
    rank: Optional[int] = None
    local: Optional[int] = None
    for line in tail[at + len(_ROOT) :].splitlines():
        if line.startswith("====="):
            break
        m = _FIELD.match(line)
        if m is None:
            continue
        if m.group(1) == "rank":
            rank = int(m.group(2))
            local = int(m.group(3)) if m.group(3) is not None else None
        elif rank is not None:
            return RootCause(rank, local, int(m.group(2)))
    return None


def rank_lines(tail: str, cause: RootCause) -> str:
    """The lines ``cause``'s rank printed under its prefix, the prefix taken off. Where no
    line has a rank prefix (the ranks' output is not told apart), all before torchrun's own
    traceback; where others do and this rank has none, nothing (a rank killed by a signal
    prints nothing, and another's words are not its own)."""
    if not _PREFIX.search(tail):
        return _before_launcher(tail)
    heads = (f"[rank{cause.rank}]:",) + (
        (f"[default{cause.local_rank}]:",) if cause.local_rank is not None else ()
    )
    out = [ln for ln in tail.splitlines() if ln.startswith(heads)]
    return unprefixed("\n".join(out) + "\n") if out else ""


def _before_launcher(tail: str) -> str:
    """``tail`` up to torchrun's own traceback (its ChildFailedError), for a rank that printed
    nothing under its prefix."""
    at = tail.rfind("Traceback (most recent call last):", 0, tail.rfind(_ROOT))
    return tail[:at] if at >= 0 else tail


def unprefixed(tail: str) -> str:
    """``tail`` with each line's rank prefix taken off."""
    return _PREFIX.sub("", tail)


# mp.spawn's two exceptions (torch/multiprocessing/spawn.py) as Python prints them uncaught.
_RAISED = re.compile(
    r"^(?:torch\.multiprocessing\.spawn\.)?ProcessRaisedException: *\n\s*\n"
    r"-- Process (\d+) terminated with the following error:\n",
    re.MULTILINE,
)
_EXITED = re.compile(
    r"(?:torch\.multiprocessing\.spawn\.)?ProcessExitedException: process (\d+) terminated "
    r"with (?:signal (?:(SIG[A-Z0-9]+)|<Unknown signal (\d+)>)|exit code (-?\d+))"
)
_TB = "Traceback (most recent call"
# The line Python prints between two tracebacks of one chain (a cause, a context).
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


@dataclasses.dataclass(frozen=True)
class Spawned:
    """mp.spawn's failed child: its index, its exit code (negative: the signal that ended it;
    1 when it raised) and its own lines: its traceback when it raised, else the output before
    the parent's traceback (the children's lines are not told apart)."""

    index: int
    exitcode: int
    lines: str


def spawned(tail: str) -> Optional[Spawned]:
    """The failed child of the mp.spawn that ended the job, from the parent's uncaught
    exception at the end of ``tail``; None when the job did not end on one."""
    found = list(_RAISED.finditer(tail))
    if found:
        child = tail[found[-1].end() :]
        lines = child.splitlines()
        heads = [i for i, ln in enumerate(lines) if ln.startswith(_TB)]
        # The child's traceback (a chain, maybe), then nothing: a traceback after it that is
        # not chained to it is the parent's own, later.
        if heads[:1] == [0] and all(lines[i - 2] in _CHAINED for i in heads[1:]):
            return Spawned(int(found[-1].group(1)), 1, child)
    lines = tail.splitlines(keepends=True)
    heads = [i for i, ln in enumerate(lines) if ln.startswith(_TB)]
    if not heads:
        return None
    # The exception line of the parent's last traceback: the first unindented line after it.
    end = len(lines)
    at = next((i for i in range(heads[-1] + 1, end) if not lines[i][0].isspace()), end)
    m = _EXITED.match(lines[at]) if at < end else None
    code = _exit_code(m) if m is not None else None
    # Only the job's final traceback says how it ended: one it printed and went on from (a
    # retry loop's log) is not its end, and a child's signal read from it would put a job
    # that crash-loops on the preemption budget.
    if m is None or code is None or not _ends(lines[at + 1 :]):
        return None
    return Spawned(int(m.group(1)), code, "".join(lines[: heads[-1]]))


# What Python may print after an uncaught exception as it shuts down: a warning (the
# multiprocessing resource tracker's "leaked semaphore objects") with its source line.
_SHUTDOWN_WARNING = re.compile(r"^\S[^\n]*:\d+: \w*Warning: ")


def _ends(after: List[str]) -> bool:
    """Whether ``after``, the lines after an exception, are no more of the job's own: blank, or
    a warning Python printed as it shut down."""
    warned = False
    for ln in after:
        if _SHUTDOWN_WARNING.match(ln):
            warned = True
        elif ln.strip() and not (warned and ln[0].isspace()):
            return False
    return True


def _exit_code(m: re.Match[str]) -> Optional[int]:
    """The child's exit code in ProcessExitedException's message, negative for a signal."""
    if m.group(4) is not None:
        return int(m.group(4))
    if m.group(3) is not None:
        return -int(m.group(3))
    try:
        return -int(signal.Signals[m.group(2)])
    except KeyError:
        return None


def peer_lost(text: str) -> Optional[str]:
    """The first line of ``text`` that says a peer stopped taking part, shortened."""
    m = PEER.search(text)
    if m is None:
        return None
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start : end if end >= 0 else len(text)].strip()
    return line if len(line) <= 200 else line[:197] + "..."
