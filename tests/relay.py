"""A TCP relay: listens on an address of the test's choosing and relays each connection to a
server elsewhere, byte for byte, in two threads. For a server that binds loopback only (the
test S3 server) reached from a network namespace, whose link a test then cuts for real
(``Netns.link_down``). ``close()`` stops it and every connection it relays.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import List, Tuple


class Relay:
    """Relays connections made to ``(host, port)`` (the port picked by the system) to
    ``target``."""

    def __init__(self, host: str, target: Tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
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
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
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
