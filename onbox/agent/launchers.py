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

``root_cause`` reads torchrun's summary, ``rank_lines`` one rank's own lines, ``unprefixed``
the output with the rank prefixes taken off, and ``peer_lost`` the line that says a peer went.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

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


def peer_lost(text: str) -> Optional[str]:
    """The first line of ``text`` that says a peer stopped taking part, shortened."""
    m = PEER.search(text)
    if m is None:
        return None
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start : end if end >= 0 else len(text)].strip()
    return line if len(line) <= 200 else line[:197] + "..."
