"""How the meter-stop tells a call that never left from one whose outcome is unknown, against
real sockets on 127.0.0.1 (a fake of a provider's API at the socket seam: no provider runs here).

What a user relies on: a stop call whose request may have reached the provider, even in part,
is never sent again (``NoAnswer``): a connection cut while the request was being written, or
after it was read, or an answer that never came. Only a request that provably never left
(nothing listens: the connection is refused) is ``NotSent``, and may be sent again.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any, Dict, Iterator, List, Optional

import pytest

from controller.meter import journal
from controller.meter.api import NoAnswer, NotSent, call
from controller.meter.stop import Step, stop_meter
from onbox.common import errors
from onbox.profiles.load import load as load_profile
from tests.httpsink import closed_port

# A request larger than loopback's socket buffers: the client is still writing it when the
# server cuts the connection, so the cut comes while it is being sent, not after.
BIG = {"instance_ids": ["x" * (32 << 20)]}
HOLD = b"hold"


class FakeSocketApi:
    """A fake provider API at the socket level: it accepts ``answers`` connections one after
    another; for each, ``read`` bytes of the request are read (None: up to the end of its
    headers and body), then it answers with the given raw HTTP bytes, or, for None, resets the
    connection (RST), or, for ``HOLD``, reads no more and never answers (until ``close``). Once
    it has accepted the last it stops listening: later connections are refused."""

    def __init__(self, answers: List[Optional[bytes]], read: Optional[int] = None) -> None:
        self.answers, self.read = answers, read
        self.received: List[bytes] = []
        self.closing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)  # bounded, whatever the client does
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            for i, answer in enumerate(self.answers):
                conn, _ = self.listener.accept()
                if i == len(self.answers) - 1:
                    self.listener.close()  # before it answers: the next connection is refused
                with conn:
                    conn.settimeout(30)
                    self.received.append(self._request(conn))
                    if answer == HOLD:
                        self.closing.wait(30)
                    elif answer is None:  # a reset: SO_LINGER 0 makes close send RST
                        conn.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    else:
                        conn.sendall(answer)
        except OSError:
            pass
        finally:
            self.listener.close()

    def _request(self, conn: socket.socket) -> bytes:
        data = b""
        while True:
            if self.read is not None and len(data) >= self.read:
                return data
            head, sep, rest = data.partition(b"\r\n\r\n")
            if sep:
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if len(rest) >= length:
                    return data
            chunk = conn.recv(65536)
            if not chunk:
                return data
            data += chunk

    def close(self) -> None:
        self.closing.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept
        except OSError:
            pass
        self.listener.close()
        self.thread.join(35)


@pytest.fixture
def servers() -> Iterator[List[Any]]:
    out: List[Any] = []
    yield out
    for s in out:
        s.close()


def test_fake_socket_api_refused_connection_is_not_sent(servers: List[Any]) -> None:
    with pytest.raises(NotSent):
        call("DELETE", f"http://127.0.0.1:{closed_port()}/pods/p1", "k", 5)


def test_fake_socket_api_reset_after_the_request_was_read_is_no_answer(
    servers: List[Any],
) -> None:
    fake = FakeSocketApi([None])
    servers.append(fake)
    with pytest.raises(NoAnswer):
        call("DELETE", fake.url + "/pods/p1", "k", 5)
    assert fake.received and fake.received[0].startswith(b"DELETE /pods/p1 ")


def test_fake_socket_api_reset_while_the_request_is_being_sent_is_no_answer(
    servers: List[Any],
) -> None:
    """The provider read the start of the request (its method and path among it), then the
    connection was reset while the rest was still being written: some of it reached the
    provider, so its outcome is unknown, never "not sent"."""
    fake = FakeSocketApi([None], read=4096)
    servers.append(fake)
    with pytest.raises(NoAnswer):
        call("POST", fake.url + "/instance-operations/terminate", "k", 5, BIG)
    assert fake.received[0].startswith(b"POST /instance-operations/terminate ")


def test_fake_socket_api_timeout_while_the_request_is_being_sent_is_no_answer(
    servers: List[Any],
) -> None:
    """The provider read the start of the request and then read no more: the client's timeout
    ends the write. What it read may be acted on: the outcome is unknown."""
    fake = FakeSocketApi([HOLD], read=4096)
    servers.append(fake)
    with pytest.raises(NoAnswer):
        call("POST", fake.url + "/instance-operations/terminate", "k", 1, BIG)
    assert fake.received[0].startswith(b"POST /instance-operations/terminate ")


def test_fake_socket_api_timeout_while_waiting_for_the_answer_is_no_answer(
    servers: List[Any],
) -> None:
    fake = FakeSocketApi([HOLD])
    servers.append(fake)
    with pytest.raises(NoAnswer):
        call("DELETE", fake.url + "/pods/p1", "k", 1)
    assert fake.received[0].startswith(b"DELETE /pods/p1 ")


def _http(status: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def test_fake_socket_runpod_stop_refused_after_the_show_is_not_sent_and_exits_20(
    servers: List[Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RunPod's API answers the show (the pod is running), then stops listening: the DELETE's
    connection is refused, so it never left. down says nothing was sent (exit 20), journals it
    not-sent, and a later down may send it."""
    for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    fake = FakeSocketApi([_http("200 OK", b'{"id": "pod1", "desiredStatus": "RUNNING"}')])
    servers.append(fake)
    env: Dict[str, str] = {"RUNPOD_API_KEY": "k3y", "RGT_RUNPOD_API": fake.url}
    shown: List[str] = []
    step = Step("r9", load_profile("runpod", []), "pod1", shown.append, str(tmp_path), env)
    with pytest.raises(errors.MeterNotSent) as info:
        stop_meter(step)
    assert info.value.exit_code == 20
    assert "never reached RunPod" in info.value.what and "nothing changed" in info.value.what
    assert len(fake.received) == 1 and fake.received[0].startswith(b"GET /pods/pod1 ")
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "not-sent" and not j.call_sent


def test_fake_socket_runpod_api_that_refuses_the_show_sends_nothing_and_exits_20(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listens at RunPod's API: the show never got through, so nothing was sent: exit
    20 (the box was never asked, so not 3), and no journal says a call is out."""
    for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    env = {"RUNPOD_API_KEY": "k3y", "RGT_RUNPOD_API": f"http://127.0.0.1:{closed_port()}"}
    step = Step("r9", load_profile("runpod", []), "pod1", lambda line: None, str(tmp_path), env)
    with pytest.raises(errors.MeterNotSent) as info:
        stop_meter(step)
    assert info.value.exit_code == 20 and "did not answer" in info.value.what
    assert "nothing was sent" in info.value.what
    j = journal.load("r9", str(tmp_path))
    assert j is None or not j.call_sent
