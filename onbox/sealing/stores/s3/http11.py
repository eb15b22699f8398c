"""The HTTP/1.1 messages of wire.py: a request written in one send, an answer's status line and
headers read line by line, and its body framed by Content-Length, chunked transfer coding or
the connection's end (RFC 9112), read into the caller's buffer.

Why not ``http.client``: it parses every answer's headers with the ``email`` package (a feed
parser, a policy object per header), which costs more CPU than the rest of a small PUT's
answer; a seal of 10,000 small files reads 10,000 answers. Here a header is a split line.

What is taken as it comes: interim 1xx answers are skipped; obsolete line folding is joined; a
HEAD answer, 204 and 304 have no body. What is refused (``BadAnswer``, the connection closed): a
status line that is not HTTP/1.x, a head over 64 KiB, a header line without a colon, a
malformed chunk size, a body that ends before its length. A name or value rgt would send with
CR or LF in it is refused before anything is sent (``ValueError``).
"""

from __future__ import annotations

import io
import socket
from typing import List, Optional, Tuple, Union

Buffer = Union[bytearray, memoryview]
MAX_HEAD = 64 << 10  # bytes of status line and headers
MAX_LINE = 8 << 10
# A body up to this size is sent in the same send() as its headers (one segment, one wakeup of
# the server); a larger one after them (copying it would cost more than the second send).
JOIN_BODY = 1 << 20


class BadAnswer(Exception):
    """The server's answer is not well-formed HTTP/1.1 (or ended early)."""


class Closed(BadAnswer):
    """The connection ended before any byte of an answer: a kept connection the server had
    closed while it was idle (a retry on a new one is safe)."""


class Conn:
    """One connection: its socket and a buffered reader of it (what the reader holds past one
    answer's end is the next answer's beginning)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fp: io.BufferedReader = sock.makefile("rb")

    def send(self, method: str, target: str, headers: List[Tuple[str, str]], body: bytes) -> None:
        """The request in one send (``headers`` checked by ``check_headers`` first)."""
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in headers]
        if body or method in ("PUT", "POST"):
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if len(body) <= JOIN_BODY:
            self.sock.sendall(head + body)
        else:
            self.sock.sendall(head)
            self.sock.sendall(body)

    def close(self) -> None:
        try:
            self.fp.close()
        finally:
            self.sock.close()


def check_headers(headers: List[Tuple[str, str]]) -> None:
    """ValueError for a header that would break the request's framing (CR, LF; ':' in a
    name): nothing rgt sends has one, so one is refused before anything is sent."""
    for name, value in headers:
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
            raise ValueError(f"refused header {name!r}: CR, LF or ':' in it")


class Body:
    """An answer's head and the framing of its body. ``complete`` once the body was read to its
    end; ``reusable`` once complete and the server keeps the connection."""

    def __init__(self, conn: Conn, method: str) -> None:
        self.fp = conn.fp
        self.status, self.headers, keep = _read_head(conn.fp)
        self.length: Optional[int] = None  # Content-Length, when the answer gives one
        self._left: Optional[int] = 0  # bytes of the body (or of this chunk) left; None: to EOF
        self._chunked = False
        self._in_chunk = False  # a chunk's data was read: its CRLF comes before the next size
        self._done = False
        codings = self.get("transfer-encoding")
        if method == "HEAD" or self.status in (204, 304):
            self._done = True
        elif codings is not None and "chunked" in codings.lower():
            self._chunked = True
        elif self.get("content-length") is not None:
            value = str(self.get("content-length")).strip()
            if not value.isdigit():
                raise BadAnswer(f"Content-Length {value!r}")
            self.length = self._left = int(value)
            self._done = self.length == 0
        else:
            self._left, keep = None, False  # framed by the connection's end
        self.keep = keep

    def get(self, name: str) -> Optional[str]:
        """A header's value by its lower-case name (the last one, where it repeats)."""
        for n, v in reversed(self.headers):
            if n.lower() == name:
                return v
        return None

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def reusable(self) -> bool:
        return self._done and self.keep

    def readinto(self, buf: Buffer) -> int:
        """Up to ``len(buf)`` bytes of the body into ``buf`` (as many as there are: it returns
        less only at the body's end); 0 at its end."""
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view) and not self._done:
            if self._chunked and self._left == 0:
                self._next_chunk()
                continue
            want = len(view) - got if self._left is None else min(len(view) - got, self._left)
            k = self.fp.readinto(view[got : got + want])
            if not k:
                if self._left is None:  # framed by the end of the connection
                    self._done = True
                    break
                raise BadAnswer("the body ended before its length")
            got += k
            if self._left is not None:
                self._left -= k
                if self._left == 0 and not self._chunked:
                    self._done = True
        return got

    def read(self) -> bytes:
        """The rest of the body."""
        parts: List[bytes] = []
        buf = bytearray(64 << 10 if self.length is None else min(max(1, self.length), 1 << 20))
        while True:
            k = self.readinto(buf)
            if not k:
                return b"".join(parts)
            parts.append(bytes(buf[:k]))

    def _next_chunk(self) -> None:
        # The CRLF that ends the previous chunk's data.
        if self._in_chunk and self.fp.readline(MAX_LINE) not in (b"\r\n", b"\n"):
            raise BadAnswer("a chunk's data did not end with CRLF")
        line = self.fp.readline(MAX_LINE)
        if not line.endswith(b"\n"):
            raise BadAnswer("a chunk size line ended early")
        size = line.split(b";", 1)[0].strip()
        try:
            n = int(size, 16)
        except ValueError:
            raise BadAnswer(f"chunk size {size!r}") from None
        if n < 0:
            raise BadAnswer(f"chunk size {size!r}")
        if n == 0:  # the last chunk: trailers until an empty line
            while True:
                t = self.fp.readline(MAX_LINE)
                if not t.endswith(b"\n"):
                    raise BadAnswer("the trailers ended early")
                if t in (b"\r\n", b"\n"):
                    break
            self._done = True
            return
        self._left = n
        self._in_chunk = True


def _read_head(fp: io.BufferedReader) -> Tuple[int, List[Tuple[str, str]], bool]:
    """(status, headers in order, whether the server keeps the connection), interim 1xx
    answers skipped."""
    while True:
        first = fp.readline(MAX_LINE)
        if not first:
            raise Closed("the connection was closed before an answer")
        parts = first.decode("latin-1").rstrip("\r\n").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise BadAnswer(f"status line {first[:80]!r}")
        status = int(parts[1])
        headers: List[Tuple[str, str]] = []
        size = len(first)
        while True:
            line = fp.readline(MAX_LINE)
            size += len(line)
            if not line.endswith(b"\n") or size > MAX_HEAD:
                raise BadAnswer("the answer's head ended early or is too long")
            text = line.decode("latin-1").rstrip("\r\n")
            if not text:
                break
            if text[0] in " \t" and headers:  # obsolete line folding
                name, value = headers[-1]
                headers[-1] = (name, value + " " + text.strip())
                continue
            name, colon, value = text.partition(":")
            if not colon:
                raise BadAnswer(f"header line {text[:80]!r}")
            headers.append((name.strip(), value.strip()))
        if 100 <= status < 200:
            continue
        conn = ",".join(v.lower() for n, v in headers if n.lower() == "connection")
        keep = "close" not in conn and (parts[0] != "HTTP/1.0" or "keep-alive" in conn)
        return status, headers, keep
