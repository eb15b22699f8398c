"""The pipe between `rgt-agent start` and the agent it spawned (onbox/agent/detach.py): every
line the agent writes arrives whole, or `start` says plainly that it could not read it.

Real pipes and threads; the agent's side is ``ReadyPipe`` itself, the reader ``read_ready``, as
`start` runs them."""

from __future__ import annotations

import json
import os
import select
import threading
from typing import Any, Dict, List

import pytest

from onbox.agent.detach import ReadyPipe
from onbox.agent.runner import read_ready
from onbox.common.errors import HostError

WIDE = "\U0001f600"  # json.dumps writes it as a surrogate pair: 12 bytes for one character


def _first_line(fd: int) -> bytes:
    buf = b""
    while b"\n" not in buf:
        ready, _, _ = select.select([fd], [], [], 10)
        assert ready, "no beat within 10 s"
        chunk = os.read(fd, 65536)
        assert chunk, "the pipe closed before a beat"
        buf += chunk
    return buf.split(b"\n", 1)[0] + b"\n"


def test_a_beat_of_non_ascii_text_is_one_write_within_pipe_buf() -> None:
    """A beat is written with O_NONBLOCK: beyond PIPE_BUF the kernel may write part of it,
    and the reader then joins a torn line to the next. 500 characters of a store's path
    escaped by json.dumps came to 6,000 bytes."""
    r, w = os.pipe()
    pipe = ReadyPipe(w)
    try:
        pipe.working = lambda: {"working": "restoring " + WIDE * 600, "done": 1, "total": 2}
        line = b""
        for _ in range(3):  # the first beat may be the default one, written before the swap
            line = _first_line(r)
            if WIDE.encode("unicode_escape") in line or b"\\ud83d" in line:
                break
        assert len(line) <= select.PIPE_BUF, len(line)
        msg = json.loads(line)
        assert msg["working"].startswith("restoring " + WIDE), msg
        assert (msg["done"], msg["total"]) == (1, 2)
    finally:
        pipe.say({"ok": True})
        os.close(r)


def test_a_ready_message_longer_than_the_pipe_arrives_whole() -> None:
    """The ready message (an error's text and remedy, say) was written once to a non-blocking
    pipe: what did not fit (64 KiB) was dropped, and `start` said the agent did not come up.
    It is now written whole while the reader reads."""
    r, w = os.pipe()
    pipe = ReadyPipe(w)
    got: List[Dict[str, Any]] = []
    errors: List[BaseException] = []

    def reader() -> None:
        try:
            got.append(read_ready(r, 10.0))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    what = "x" * (300 * 1024)
    pipe.say({"ok": False, "exit_code": 2, "what": what, "remedy": "fix it"})
    t.join(30)
    os.close(r)
    assert not t.is_alive()
    assert not errors, errors
    assert got and got[0]["what"] == what and got[0]["remedy"] == "fix it"


def test_a_line_that_is_not_json_is_a_clear_error() -> None:
    """`start` raised a bare JSONDecodeError (a traceback) on a line it could not parse."""
    r, w = os.pipe()
    os.write(w, b'{"working": "restoring", "do\n')
    os.close(w)
    try:
        with pytest.raises(HostError) as ei:
            read_ready(r, 5.0)
    finally:
        os.close(r)
    assert "unreadable" in str(ei.value), ei.value
