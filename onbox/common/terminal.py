"""Text from another machine (the box, the store, a provider), made safe to print on the
user's terminal: what it holds must not drive the terminal (an escape sequence that sets the
title, clears the screen or moves the cursor) or forge lines of rgt's own (a newline inside a
one-line error or note)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator


def printable(text: str) -> str:
    """``text`` with each control character (C0, newline and tab included, DEL, C1) as '?'."""
    return "".join("?" if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F else c for c in text)


def printable_lines(text: str) -> str:
    """``text`` with each line ``printable``: its line breaks kept, every other control
    character '?' (for text of several lines by design: a command's output)."""
    return "\n".join(printable(line) for line in text.split("\n"))


# What starts each line of an error after its first: another machine's text that the error
# carries (a box's stderr, pip's lines) stays readable, and none of its lines can pass for a
# line of rgt's own, which starts at the margin ("rgt: ...").
QUOTED = "  | "


def printable_error(text: str) -> str:
    """An error's ``text`` for the terminal: each line ``printable``, every line after the
    first under ``QUOTED``, empty lines at its end dropped."""
    first, *rest = text.rstrip("\n").split("\n")
    return "\n".join([printable(first), *(QUOTED + printable(line) for line in rest)])


# One line on stderr at a time: `rgt sweep` deploys to several boxes at once, each from its own
# thread, and a line written in two pieces (print writes the text, then the newline) could be
# split by another thread's.
_lines = threading.Lock()
_where = threading.local()


def write_line(text: str) -> None:
    """``text`` and its newline on stderr in one write, whole among other threads' lines
    (OSError or ValueError from a stderr that will not take it, for the caller to drop)."""
    with _lines:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Within it, this thread's lines of another machine's text (a box's stderr relayed as it
    comes, controller/capture.py) start with ``label``: in a sweep that deploys to several
    boxes at once, the box each came from."""
    was = getattr(_where, "label", "")
    _where.label = label
    try:
        yield
    finally:
        _where.label = was


def label() -> str:
    """This thread's ``labelled`` label ("" outside one)."""
    return str(getattr(_where, "label", ""))


def labelled_say(label: str, say: Callable[[str], None]) -> Callable[[str], None]:
    """``say`` with ``label`` starting each line of what it says (a sweep's deploy: its box),
    the message as ``printable_error`` renders it: one line by design, so a line after its
    first is text it carries (a box's reason or stderr in an error) and goes under ``QUOTED``,
    its control characters '?'. Only the first line had the label: the others read as rgt's
    own, or as another box's. Each line is said on its own, a line ``say`` shows as it is
    (``say`` renders too: one rendering, never two)."""

    def said(msg: str) -> None:
        for line in printable_error(msg).split("\n"):
            say(label + line)

    return said


def say(msg: str) -> None:
    """A progress line of a command that changes a box (a deploy, a sweep) on stderr, as
    ``printable_error`` renders it: a message may carry the box's text (a reason, a record that
    could not be read, the job's first line), which must not drive the terminal or pass for a
    line of rgt's own. One that cannot be written (``rgt deploy ... | head`` once head is done:
    EPIPE; a closed stderr) is dropped: the command goes on to a whole end (its job started, or
    its release dropped) rather than stop between two of its steps on a write."""
    try:
        write_line(printable_error(msg))
    except (OSError, ValueError):
        pass
