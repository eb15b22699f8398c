"""Text from another machine (the box, the store, a provider), made safe to print on the
user's terminal: what it holds must not drive the terminal (an escape sequence that sets the
title, clears the screen or moves the cursor) or forge lines of rgt's own (a newline inside a
one-line error or note)."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each control character (C0, newline and tab included, DEL, C1) as '?'."""
    return "".join("?" if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F else c for c in text)


def printable_lines(text: str) -> str:
    """``text`` with each line ``printable``: its line breaks kept, every other control
    character '?' (for text of several lines by design: a command's output, the tail of a
    tool's error output inside an error)."""
    return "\n".join(printable(line) for line in text.split("\n"))
