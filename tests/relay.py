"""A TCP relay: listens on an address of the test's choosing and relays each connection to a
server elsewhere, byte for byte, in two threads. For a server that binds loopback only (the
test S3 server) reached from a network namespace, whose link a test then cuts for real
(``Netns.link_down``); or, with ``rate``, a slow link that still moves: what a client sends is
taken from it at that many bytes a second, per connection, through a small receive buffer, so
the client's kernel sees its bytes acknowledged as slowly. ``close()`` stops it and every
connection it relays.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Callable, List, Optional, Tuple


class Relay:
    """Relays connections made to ``(host, port)`` (the port picked by the system) to
    ``target``. ``reset_on``: a connection whose client sends bytes it is true of (an HTTP
    request for one key) is reset (RST to the client, as a network that drops it), both ends
    closed and nothing of those bytes relayed."""

    def __init__(
        self,
        host: str,
        target: Tuple[str, int],
        reset_on: Optional[Callable[[bytes], bool]] = None,
        rate: Optional[int] = None,
    ) -> None:
        self.target = target
        self.reset_on = reset_on
        self.rate = rate
        self._listener = socket.create_server((host, 0))
        if rate is not None:  # inherited by each connection: the link, not the kernel, paces
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._socks: List[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._socks += [client, server]
            ways = ((client, server, self.reset_on, self.rate), (server, client, None, None))
            for a, b, check, rate in ways:
                threading.Thread(target=self._pipe, args=(a, b, check, rate), daemon=True).start()

    @staticmethod
    def _pipe(
        src: socket.socket,
        dst: socket.socket,
        reset_on: Optional[Callable[[bytes], bool]],
        rate: Optional[int],
    ) -> None:
        try:
            while True:
                data = src.recv(1 << 16 if rate is None else 16 << 10)
                if rate is not None:
                    time.sleep(len(data) / rate)
                if not data:
                    break
                if reset_on is not None and reset_on(data):
                    # SO_LINGER 0: close() sends RST, the client reads ECONNRESET
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    src.close()
                    dst.close()
                    return
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        self._listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
