"""The lean path's HTTP/1.1 (onbox/sealing/stores/s3/wire.py, http11.py) against real peers on
loopback: a scripted server that writes the answers byte for byte (what S3-compatible servers
and the proxies in front of them send: chunked bodies with trailers, folded headers, closed
keep-alive connections, bodies cut short, answers that are not HTTP), and a real SeaweedFS for
what a download does when the object is replaced under it or is not there.

The promises: an answer is read whole however it is framed, and its connection is used again
only when the server keeps it; a kept connection the server closed while idle is replaced
once, transparently; an answer cut short or not HTTP is the same transient connection error
urllib3's transport gives (never a short body taken for a whole one); a ranged download of an
object replaced meanwhile fails as transient (retry: the new object whole), leaving no file;
a download whose O_DIRECT writes the filesystem refuses partway is written whole through the
page cache.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import threading
import uuid
from typing import Any, Callable, Iterator, List

import botocore.exceptions as bex
import pytest

from onbox.common.errors import PermanentStoreError, TransientStoreError
from onbox.common.writeback import Direct, open_direct
from onbox.sealing.stores.s3 import download
from onbox.sealing.stores.s3.wire import Wire
from tests.seaweed import SeaweedServer

Script = Callable[[socket.socket, int], None]  # (accepted connection, its number)


class Peer:
    """A loopback HTTP peer running ``script`` on each connection it accepts (in a thread the
    test stops), and what it received."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: List[bytes] = []
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(5)
                try:
                    self.script(conn, self.connections)
                except OSError:
                    pass

    def read_request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            got = conn.recv(65536)
            if not got:
                raise ConnectionError("client went away")
            data += got
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += conn.recv(65536)
        self.requests.append(head)
        return head

    def wire(self) -> Wire:
        return Wire("http", "127.0.0.1", self.port, None, 5.0, 5.0)

    def url(self, path: str = "/b/k") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def peers() -> Iterator[Callable[[Script], Peer]]:
    made: List[Peer] = []

    def make(script: Script) -> Peer:
        made.append(Peer(script))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def _get(wire: Wire, url: str) -> Any:
    return wire.request("GET", url, {"Host": url.split("/")[2]})


def test_a_chunked_answer_with_trailers_and_folded_headers_is_read_whole(
    peers: Callable[[Script], Peer],
) -> None:
    body = os.urandom(70_000)

    def script(conn: socket.socket, n: int) -> None:
        for _ in range(2):  # two requests on one kept connection
            peer.read_request(conn)
            conn.sendall(
                b"HTTP/1.1 100 Continue\r\n\r\n"
                b"HTTP/1.1 200 OK\r\nX-Folded: one\r\n  two\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x;ext=1\r\n" % 65536 + body[:65536] + b"\r\n"
                + b"%x\r\n" % (len(body) - 65536) + body[65536:] + b"\r\n"
                + b"0\r\nX-Trailer: t\r\n\r\n"
            )  # fmt: skip

    peer = peers(script)
    wire = peer.wire()
    for _ in range(2):
        with _get(wire, peer.url()) as answer:
            assert answer.status == 200
            assert answer.plain_headers()["x-folded"] == "one two"
            assert answer.read() == body
    assert peer.connections == 1  # the connection was kept and used again
    wire.close()


def test_a_kept_connection_the_server_closed_is_replaced_once(
    peers: Callable[[Script], Peer],
) -> None:
    def script(conn: socket.socket, n: int) -> None:
        peer.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        # then the server closes the connection without saying so (an idle timeout)

    peer = peers(script)
    wire = peer.wire()
    for _ in range(3):
        with _get(wire, peer.url()) as answer:
            assert answer.read() == b"ok"
    assert peer.connections == 3 and len(peer.requests) == 3
    wire.close()


def test_connection_close_is_honoured(peers: Callable[[Script], Peer]) -> None:
    def script(conn: socket.socket, n: int) -> None:
        peer.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        conn.shutdown(socket.SHUT_WR)

    peer = peers(script)
    wire = peer.wire()
    for _ in range(2):
        with _get(wire, peer.url()) as answer:
            assert answer.read() == b"until the end"
    assert peer.connections == 2
    wire.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",  # cut short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx",  # bad chunk size
        b"SSH-2.0-OpenSSH_9.2\r\n",  # not HTTP at all
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",  # a broken header line
    ],
)
def test_a_broken_answer_is_a_connection_error_never_a_short_body(
    peers: Callable[[Script], Peer], answer: bytes
) -> None:
    def script(conn: socket.socket, n: int) -> None:
        peer.read_request(conn)
        conn.sendall(answer)

    peer = peers(script)
    wire = peer.wire()
    with pytest.raises(bex.ConnectionClosedError), _get(wire, peer.url()) as got:
        got.read()
    wire.close()


def test_a_header_with_a_line_break_is_refused_before_sending(
    peers: Callable[[Script], Peer],
) -> None:
    def script(conn: socket.socket, n: int) -> None:
        peer.read_request(conn)

    peer = peers(script)
    wire = peer.wire()
    with pytest.raises(ValueError, match="CR, LF"):
        wire.request("GET", peer.url(), {"Host": "h", "X-Evil": "a\r\nInjected: yes"})
    assert peer.requests == []
    wire.close()


def test_a_ranged_download_of_an_object_replaced_meanwhile_fails_as_transient(
    s3_server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every range carries If-Match with the ETag its HEAD saw: a range of the new object is
    refused (412), the download fails as transient (a retry fetches the new object whole),
    and nothing of it is left on disk."""
    monkeypatch.setattr(download, "WHOLE_MAX", 5 << 20)
    monkeypatch.setattr(download, "RANGE", 4 << 20)
    bucket = s3_server.bucket()
    store = s3_server.store(bucket, f"wire/{uuid.uuid4().hex[:8]}", part_size=5 << 20)
    old, new = os.urandom(12 << 20), os.urandom(12 << 20)
    store.put_bytes("run/obj", old)
    lean = store.lean_reader()
    assert lean is not None  # the lean path is what is tested here
    real = lean.open_get
    calls: List[str] = []

    def replaced_after_the_first(full: str, headers: Any, cut: Any = None) -> Any:
        if calls == ["first"]:
            store.put_bytes("run/obj", new)
        calls.append("first" if not calls else "later")
        return real(full, headers, cut)

    monkeypatch.setattr(lean, "open_get", replaced_after_the_first)
    dest = str(tmp_path / "obj")
    with pytest.raises(TransientStoreError, match="replaced during the download"):
        store.fetch_file("run/obj", dest, size=len(old))
    assert not os.path.exists(dest)
    monkeypatch.setattr(lean, "open_get", real)
    assert store.fetch_file("run/obj", dest, size=len(new)) is not None
    with open(dest, "rb") as f:
        assert f.read() == new


@pytest.mark.parametrize("asked", ["GET", "HEAD"])
def test_a_missing_object_on_the_lean_path_is_permanent(
    s3_server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, asked: str
) -> None:
    """Missing, as the lean GET of a small object finds it or the lean HEAD that a ranged
    download asks first (its bare 404): permanent, naming it; no file left."""
    monkeypatch.setattr(download, "WHOLE_MAX", 5 << 20)
    store = s3_server.store(s3_server.bucket(), "wire/missing")
    assert store.lean_reader() is not None
    dest = str(tmp_path / "x")
    with pytest.raises(PermanentStoreError, match="not in"):
        store.fetch_file("run/none", dest, size=10 if asked == "GET" else 6 << 20)
    assert not os.path.exists(dest)


def _misaligned(chunk: memoryview) -> memoryview:
    """``chunk``'s bytes in memory that starts one byte past a page: ext4 refuses an O_DIRECT
    write from it (EINVAL), at the write, as a filesystem with stricter alignment than rgt's
    would."""
    out = memoryview(mmap.mmap(-1, len(chunk) + 4096))[1 : 1 + len(chunk)]
    out[:] = chunk
    return out


@pytest.mark.parametrize("shape", ["whole", "ranged"])
def test_a_download_whose_direct_writes_the_filesystem_refuses_is_written_whole_through_the_cache(
    s3_server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """O_DIRECT taken at open and refused at a write (EINVAL, for real, by this ext4: the
    write comes from unaligned memory): the download goes on through the page cache from that
    byte on, and the file and its sha256 are the object's. Whole: refused at the first write;
    ranged (four parts at once): at the second, so the file is part direct, part cached."""
    monkeypatch.setattr(download, "WHOLE_MAX", 5 << 20)
    monkeypatch.setattr(download, "RANGE", 4 << 20)
    store = s3_server.store(s3_server.bucket(), f"wire/{uuid.uuid4().hex[:8]}", part_size=5 << 20)
    data = os.urandom((3 << 20) + 5000 if shape == "whole" else (24 << 20) + 5000)
    store.put_bytes("run/obj", data)
    assert store.lean_reader() is not None
    writers: List[Direct] = []
    real_open, real_write = open_direct, Direct.write

    def spied(path: str, fd: int) -> Any:
        d = real_open(path, fd)
        assert d is not None, "this test needs a filesystem that takes O_DIRECT at open"
        writers.append(d)
        return d

    direct_bytes: List[int] = []
    refuse_from = 1 if shape == "whole" else 2
    lock = threading.Lock()

    def refused_later(self: Direct, chunk: memoryview, offset: int) -> int:
        with lock:  # the parts of a ranged download write at once
            n = len(direct_bytes) + 1
            k = real_write(self, chunk if n < refuse_from else _misaligned(chunk), offset)
            direct_bytes.append(k)
        return k

    monkeypatch.setattr(download, "open_direct", spied)
    monkeypatch.setattr(Direct, "write", refused_later)
    dest = str(tmp_path / "obj")
    digest = store.fetch_file("run/obj", dest, size=len(data))
    assert digest == hashlib.sha256(data).hexdigest()
    with open(dest, "rb") as f:
        assert f.read() == data
    assert [w.ok for w in writers] == [False]  # the filesystem did refuse, and it was taken
    if shape == "ranged":
        assert 0 < sum(direct_bytes) < len(data)  # part of the file went directly, the rest not


def test_a_head_answered_without_a_size_is_refused_naming_it_and_nothing_is_written(
    s3_server: SeaweedServer,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    peers: Callable[[Script], Peer],
) -> None:
    """A ranged download's HEAD answered 200 with no Content-Length (a broken store or a
    proxy in front of it): refused as permanent, naming what is wrong; no range is asked,
    no file is left (boto3's head_object would have handed the answer on without a size)."""
    monkeypatch.setattr(download, "WHOLE_MAX", 64 << 10)

    def sizeless(conn: socket.socket, _: int) -> None:
        peer.read_request(conn)
        conn.sendall(b'HTTP/1.1 200 OK\r\nETag: "e"\r\nConnection: close\r\n\r\n')

    peer = peers(sizeless)
    store = s3_server.store("b", "wire", endpoint_url=f"http://127.0.0.1:{peer.port}")
    assert store.lean_reader() is not None
    dest = str(tmp_path / "x")
    with pytest.raises(PermanentStoreError, match="HEAD without a size"):
        store.fetch_file("run/x", dest, size=100 << 10)
    assert not os.path.exists(dest)
    assert [r.split(b" ")[0] for r in peer.requests] == [b"HEAD"]


def test_a_store_that_ignores_range_fails_the_download_as_transient_never_as_corrupt_bytes(
    s3_server: SeaweedServer,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    peers: Callable[[Script], Peer],
) -> None:
    """A proxy in front of the store drops the Range header: every ranged GET is answered 200
    with the whole object. The download fails as transient (the store's answer is wrong, the
    object may be fine: a restore must not quarantine it), before any byte of the body is
    taken, naming the lengths, and leaves no file. Before, each part received and wrote the
    whole body over its neighbours' bytes, then failed on the count."""
    monkeypatch.setattr(download, "WHOLE_MAX", 64 << 10)
    monkeypatch.setattr(download, "RANGE", 32 << 10)
    data = os.urandom(100 << 10)

    def rangeless(conn: socket.socket, _: int) -> None:
        while True:
            head = peer.read_request(conn)
            answer = b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: %d\r\n\r\n' % len(data)
            conn.sendall(answer if head.startswith(b"HEAD") else answer + data)

    peer = peers(rangeless)
    store = s3_server.store("b", "wire", endpoint_url=f"http://127.0.0.1:{peer.port}")
    assert store.lean_reader() is not None
    dest = str(tmp_path / "x")
    with pytest.raises(TransientStoreError, match=r"asked for 32768 bytes at \d+, the store"):
        store.fetch_file("run/x", dest, size=len(data))
    assert not os.path.exists(dest)
    assert any(b"range: bytes=" in r.lower() for r in peer.requests)
