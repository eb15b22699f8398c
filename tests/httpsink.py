"""Local HTTP sinks for the notification tests: a real server on 127.0.0.1 that records each
request (method, path, headers, body) and answers 200 (``ok``) or reads it and never answers
(``hang``: a sink that is up but slow forever); and a closed port (a sink that is down).

Started by a test or fixture and stopped at its end (``close``): the hanging handlers are let go
then, so no thread outlives the test.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from typing import Any, Dict, List, Optional


class Request:
    def __init__(self, method: str, path: str, headers: Dict[str, str], body: bytes) -> None:
        self.method, self.path, self.headers, self.body = method, path, headers, body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path} {self.body[:200]!r})"


class HttpSink:
    """``HttpSink("ok")`` or ``HttpSink("hang")``; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, mode: str = "ok") -> None:
        assert mode in ("ok", "hang"), mode
        self.mode = mode
        self.requests: List[Request] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # lets the hanging handlers go, at close
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with sink.lock:
                    sink.requests.append(
                        Request(self.command, self.path, dict(self.headers.items()), body)
                    )
                if sink.mode == "hang":
                    sink.release.wait(120)  # bounded even if close is never called
                    return
                data = b'{"id": 1}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        # Polled for shutdown every 0.05 s, not the default 0.5 that close() would wait out.
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def seen(self, path: Optional[str] = None) -> List[Request]:
        with self.lock:
            return [r for r in self.requests if path is None or r.path == path]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then let go: connections refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port
