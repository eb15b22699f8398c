"""What the laptop keeps of a command the box runs: a bounded amount, read as it comes.

Everything the box sends is untrusted: a runaway agent, a job printing into something rgt reads,
an events.jsonl or a state document grown huge, or a hostile box, must not make the laptop hold
gigabytes until the command's timeout. ``capture`` runs the local argv (ssh, or the command
itself for ``local``) and reads its stdout and stderr incrementally, writing its input as the
child takes it. Of stdout it keeps at most ``limit`` bytes, and past them (``over``):

- ``"fail"``: the child is killed by its PID at once and ``TooMuch`` is raised: the caller
  needs all of it (a document, a listing) and more than a box of rgt's prints is not one;
- ``"cut"``: the first ``limit`` bytes are kept and the child is killed (the caller needs the
  beginning only: a job's first line); ``Captured.cut`` says so;
- ``"tail"``: the last ``limit`` bytes are kept and the command runs to its end (a message for
  the user, whose last lines say what happened).

With ``sink`` the stdout is written there as it comes (``rgt logs``: the job's bytes, raw) and
none of it is kept; ``timeout`` is then the most seconds without a byte. With ``relay`` the
stderr goes on to the user's terminal a line at a time as it comes (``LineRelay``), besides
being kept, and ``timeout`` is the most seconds without a byte on the stderr: a command that
says how it is getting on there (`rgt-agent start` in a long restore) is waited for as long as
it does (its stdout, kept whole, is what it prints at the end); the error a failed command
ends with is not shown but handed to the caller (``Captured.held``), whose own error says it
(``LineRelay``). stderr is never a
failure: its first ERR_HEAD and last ERR_TAIL bytes are kept (ssh and a login shell say why a
connection failed first; a command's error is in its last lines), the middle dropped with a
marker. Killing ssh ends the session on the box: its sshd closes the command's pipes, and the
command's next write fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import subprocess
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence, Tuple

from controller.children import Child
from onbox.common.terminal import QUOTED, label, labelled, printable, write_line

ERR_HEAD = 16 << 10
ERR_TAIL = 48 << 10
_CHUNK = 64 << 10
_DROPPED = b"\n[... rgt dropped %d bytes here ...]\n"


class TooMuch(Exception):
    """The command printed more than ``limit`` bytes on stdout (over "fail"); it was killed."""

    def __init__(self, limit: int, stderr: bytes) -> None:
        super().__init__(limit)
        self.limit = limit
        self.stderr = stderr


@dataclasses.dataclass
class Captured:
    """A finished command: its exit status (negative: the signal that ended it), what was kept of
    its stdout and stderr, whether stdout was cut (over "cut": the child was killed), and the
    error lines its relay held back from the terminal (``LineRelay``: the command failed), for
    the caller to say; b"" when none."""

    rc: int
    stdout: bytes
    stderr: bytes
    cut: bool = False
    held: bytes = b""


class Kept:
    """At most ``head`` bytes from the start of a stream and ``tail`` from its end; ``seen``
    counts every byte, kept or not."""

    def __init__(self, head: int, tail: int) -> None:
        self.head_max, self.tail_max = head, tail
        self.head = bytearray()
        self.tail = bytearray()
        self.seen = 0

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if self.tail_max:
            self.tail += data[-self.tail_max :]
            if len(self.tail) > self.tail_max:
                del self.tail[: len(self.tail) - self.tail_max]

    @property
    def kept(self) -> int:
        return len(self.head) + len(self.tail)

    def value(self) -> bytes:
        dropped = self.seen - self.kept
        if dropped and self.head and self.tail:
            return bytes(self.head) + _DROPPED % dropped + bytes(self.tail)
        return bytes(self.head) + bytes(self.tail)


def capture(
    argv: Sequence[str],
    *,
    timeout: Optional[float],
    limit: int,
    over: str = "fail",
    input: Optional[bytes] = None,
    sink: Optional[IO[bytes]] = None,
    cwd: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    relay: bool = False,
) -> Captured:
    """Run ``argv`` to its end (module docstring; ``timeout`` None: no limit, as for an rsync
    with its own). Raises TooMuch, subprocess.TimeoutExpired (the child killed) and
    FileNotFoundError (no such program); on any exception (a ^C included) the child is killed
    and reaped."""
    assert over in ("fail", "cut", "tail"), over
    out = Kept(0, limit) if over == "tail" else Kept(limit, 0)
    err = Kept(ERR_HEAD, ERR_TAIL)
    shown = LineRelay() if relay else None
    p = Child(
        argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    assert p.stdout is not None and p.stderr is not None
    failed = False  # the command ran to its end, and failed
    held = b""
    try:
        cut, deadline = _pump(p, input, timeout, out, err, over, sink, shown)
        if not cut:  # both pipes closed: the child is ending (or closed them and hangs on)
            p.wait(timeout=None if timeout is None else max(0.0, deadline - time.monotonic()))
            failed = p.returncode != 0
    finally:
        if shown is not None:
            held = shown.flush(hold_error=failed)
        if p.returncode is None:
            p.kill()  # by its PID; its own children lose the pipes' read ends we close below
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                f.close()
        rc = p.wait()
    if out.seen > limit and over == "fail":
        raise TooMuch(limit, err.value())
    return Captured(rc, out.value(), err.value(), cut, held)


def _pump(
    p: subprocess.Popen[bytes],
    input: Optional[bytes],
    timeout: Optional[float],
    out: Kept,
    err: Kept,
    over: str,
    sink: Optional[IO[bytes]],
    shown: Optional[LineRelay] = None,
) -> Tuple[bool, float]:
    """Feed ``input`` and read both pipes until they close (False), or until stdout went past
    its limit with over "fail" or "cut" (True: the caller kills the child); and the deadline
    then. TimeoutExpired past ``timeout`` (with a ``sink``: that long without a byte of
    stdout; with ``shown``, the stderr's relay: that long without a byte of the stderr)."""
    assert p.stdout is not None and p.stderr is not None
    never = timeout is None
    timeout = float("inf") if timeout is None else timeout
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, out)
    sel.register(p.stderr, selectors.EVENT_READ, err)
    view = memoryview(input or b"")
    if p.stdin is not None:
        os.set_blocking(p.stdin.fileno(), False)
        if view:
            sel.register(p.stdin, selectors.EVENT_WRITE, None)
        else:
            p.stdin.close()
    with sel:
        while sel.get_map():
            left = None if never else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(p.args, timeout)
            for key, _ in sel.select(left):
                if key.data is None:  # stdin: as much as the pipe takes now
                    view = _feed(sel, key.fileobj, view)  # type: ignore[arg-type]
                    continue
                data = os.read(key.fd, _CHUNK)
                if not data:
                    sel.unregister(key.fileobj)
                elif key.data is err:
                    err.add(data)
                    if shown is not None:
                        shown.add(data)
                        deadline = time.monotonic() + timeout
                elif sink is not None:
                    sink.write(data)
                    sink.flush()
                    deadline = time.monotonic() + timeout
                else:
                    out.add(data)
                    if over != "tail" and out.seen > out.head_max:
                        return True, deadline
    return False, deadline


def _feed(sel: selectors.BaseSelector, stdin: IO[bytes], view: memoryview) -> memoryview:
    """Write what the child's stdin takes of ``view``; the rest. Closed once all is written, or
    when the child closed its end (its output then says what it made of that)."""
    try:
        view = view[os.write(stdin.fileno(), view[:_CHUNK]) :]
    except BlockingIOError:
        return view
    except BrokenPipeError:
        view = view[:0]
    if not view:
        sel.unregister(stdin)
        stdin.close()
    return view


def drain(f: IO[bytes], kept: Kept) -> None:
    """Read ``f`` to its end into ``kept`` (a thread's work: the stderr of a child whose stdin
    or stdout the caller handles itself)."""
    for data in iter(lambda: os.read(f.fileno(), _CHUNK), b""):
        kept.add(data)


def command_name(argv: List[str], width: int = 100) -> str:
    """How an error names a remote command: its argv without an ``env K=V`` prefix, a program
    by its base name, a ``sh -c`` script by its first line (rgt's scripts start with a comment
    that names them); cut to ``width``."""
    words = list(argv)
    if words[:1] == ["env"]:
        words = words[1:]
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
    if words[:2] == ["sh", "-c"] and len(words) >= 3:
        first = next((ln.strip() for ln in words[2].splitlines() if ln.strip()), "")
        words = ["sh", "-c", f"'{first}'", *words[4:]]
    elif words:
        words[0] = os.path.basename(words[0]) or words[0]
    text = " ".join(words)
    return text if len(text) <= width else text[: width - 3] + "..."


class Relayed(Child):
    """A box's command whose stdout the caller reads (a log followed, a file streamed) and
    whose stderr goes on to the user's terminal as it comes, a line at a time through
    ``printable`` and under ``QUOTED``: what the box prints there is untrusted, and neither an
    escape sequence nor a line passing for rgt's own ("rgt: ...") must reach the terminal.
    ``wait`` lets the relay finish its last lines; ``err_tail`` keeps the last of them for an
    error message."""

    relay: Optional[threading.Thread] = None
    err_tail = b""

    def wait(self, timeout: Optional[float] = None) -> int:
        rc = super().wait(timeout)
        if self.relay is not None:
            self.relay.join(5)  # its pipe ends with the process (a child holding it: let go)
        return rc


def relayed(argv: Sequence[str]) -> Relayed:
    """Start ``argv`` with its stdout piped back and its stderr relayed (``Relayed``)."""
    p = Relayed(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The caller's label goes with its lines (a sweep's deploy names its box on each).
    p.relay = threading.Thread(target=_relay, args=(p, label()), name="rgt-stderr", daemon=True)
    p.relay.start()
    return p


def _relay(p: Relayed, where: str) -> None:
    err = p.stderr
    assert err is not None
    with err, labelled(where):
        for line in iter(lambda: err.readline(_CHUNK), b""):
            p.err_tail = (p.err_tail + line)[-ERR_HEAD:]
            _show(line.rstrip(b"\n"))


class LineRelay:
    """A box's stderr for the user's terminal, given as it comes in chunks: each whole line
    shown through ``printable`` under ``QUOTED`` (as ``Relayed`` does), a line longer than
    _CHUNK in pieces of that, the last unended one at ``flush``.

    An rgt error line (``rgt: ...``, and the ``  | `` lines it carries: onbox/common/climain.py)
    is held until another line comes: a command that fails ends with its error, which the
    caller's own error says (controller/deploy/boxstart.py ``start_failed``); shown here too,
    it was on the terminal twice. ``flush(hold_error=True)`` returns it unshown, for the caller
    to say: in its error, or with ``show_lines`` when its error is another (ssh lost the
    connection: controller/remote.py). Anything else shows it, in its place. Past ERR_TAIL
    bytes it is no error of rgt's but a flood, which the laptop must not keep: shown as it
    comes."""

    def __init__(self) -> None:
        self._buf = b""
        self._held: List[bytes] = []
        self._held_bytes = 0

    def add(self, data: bytes) -> None:
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            self._line(line)
        while len(self._buf) > _CHUNK:
            self._line(self._buf[:_CHUNK])
            self._buf = self._buf[_CHUNK:]

    def _line(self, line: bytes) -> None:
        if self._held and line.startswith(QUOTED.encode()):
            self._held.append(line)  # a line the held error carries
            self._held_bytes += len(line)
            if self._held_bytes > ERR_TAIL:  # no error of rgt's: a flood, shown as it comes
                self._release()
            return
        self._release()
        if line.startswith(b"rgt: "):
            self._held.append(line)
        else:
            _show(line)

    def _release(self) -> None:
        for line in self._held:
            _show(line)
        self._held, self._held_bytes = [], 0

    def flush(self, hold_error: bool = False) -> bytes:
        """Show what is left; the held error too, unless ``hold_error``: then it is returned
        (its lines, each ended by a newline), else b""."""
        if self._buf:
            self._line(self._buf)
            self._buf = b""
        held = b"".join(line + b"\n" for line in self._held) if hold_error else b""
        if hold_error:
            self._held, self._held_bytes = [], 0
        self._release()
        return held


def show_lines(data: bytes) -> None:
    """Lines of a box's stderr (``Captured.held``) on the user's terminal, as the relay shows
    each line."""
    for line in data.splitlines():
        _show(line)


def _show(line: bytes) -> None:
    """One line of a box's stderr on the user's terminal, made safe (module docstring)."""
    text = label() + QUOTED + printable(line.decode(errors="replace"))
    with contextlib.suppress(OSError, ValueError):  # a closed terminal: nothing to tell
        write_line(text)


# The most digits a number the box prints may have to be read as one: Python's int() refuses a
# string of more than 4300 (ValueError), and str.isdigit() accepts digits int() does not take
# ("²"); either ended a reader of the box's output in a traceback.
MAX_DIGITS = 20
_NUMBER = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}(\.[0-9]{{1,{MAX_DIGITS}}})?")


def box_int(text: str) -> Optional[int]:
    """The non-negative integer a line of the box's output says (surrounding whitespace left
    out), or None when it is not ASCII digits, at most MAX_DIGITS of them."""
    m = _NUMBER.fullmatch(text.strip())
    return int(m.group(0)) if m and m.group(1) is None else None


def box_float(text: str) -> Optional[float]:
    """As ``box_int``, for a number that may have a fraction (``12.5``)."""
    m = _NUMBER.fullmatch(text.strip())
    return float(m.group(0)) if m else None
