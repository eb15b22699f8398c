"""Plain HTTP/1.1 to one S3 endpoint, for the lean requests (lean.py): keep-alive connections
from the standard library's ``http.client``, a request's headers and body in one send, and a
response body read straight into the caller's buffer.

Why not botocore's transport (urllib3): per request it looks up proxies in the environment,
builds its pool key, wraps the answer twice and, for a streamed body, copies every chunk two or
three times on its way up (``http.client`` into a new bytes, urllib3's buffer, botocore's
stream). A restore of 1 GiB is that many extra copies on a box whose cores the store's server or
the training job share; a seal of 10,000 small files is that many requests. Here a GET's body
is received into one reused buffer (one copy, the kernel's), and a PUT is one ``sendall``.

Where it applies (``Wire.for_client``): an ``http://`` or ``https://`` endpoint reached without
a proxy and without a client certificate, as the client itself is configured (its CA bundle
or ``verify=False``, its connect and read timeouts). Anything else keeps botocore's transport.
Failures are raised as the botocore exceptions urllib3's would become (EndpointConnectionError,
ReadTimeoutError, ConnectionClosedError, SSLError...), so errors.py maps them the same.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import weakref
from typing import Any, List, Mapping, Optional, Tuple, Union
from urllib.parse import urlsplit

import botocore.exceptions as bex
from botocore.awsrequest import HeadersDict
from botocore.httpsession import get_cert_path

Buffer = Union[bytearray, memoryview]
# Connections kept open between requests: the store's request slots and the threads waiting
# for one (client.config's pool) each keep theirs.
KEEP = 32


class Answer:
    """One response: its status and headers; its body read with ``readinto`` or ``read``.
    ``close()`` hands the connection back for the next request when the body was read whole,
    else closes it (a body left unread would be the next request's answer)."""

    def __init__(self, wire: Wire, conn: http.client.HTTPConnection, resp: Any, url: str):
        self._wire = wire
        self._conn: Optional[http.client.HTTPConnection] = conn
        self._resp = resp
        self.url = url
        self.status = int(resp.status)
        self.headers = HeadersDict(resp.getheaders())

    @property
    def length(self) -> Optional[int]:
        """The body's length by Content-Length (None when the answer does not say)."""
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    def readinto(self, buf: Buffer) -> int:
        """Up to ``len(buf)`` bytes of the body into ``buf``; 0 at its end."""
        try:
            return int(self._resp.readinto(buf))
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise _failure(e, self.url, connecting=False) from None

    def read(self) -> bytes:
        """The rest of the body."""
        try:
            data: bytes = self._resp.read()
            return data
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise _failure(e, self.url, connecting=False) from None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._resp.isclosed() and not self._resp.will_close:
            self._wire.give_back(conn)
        else:
            conn.close()

    def __enter__(self) -> Answer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Wire:
    """Keep-alive connections to one endpoint (see the module docstring)."""

    def __init__(
        self, scheme: str, host: str, port: int, context: Optional[ssl.SSLContext],
        connect_timeout: float, read_timeout: float,
    ) -> None:  # fmt: skip
        self.scheme = scheme
        self.host = host
        self.port = port
        self.context = context
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        # The kept connections are closed when this Wire goes (with its store), not left to
        # the garbage collector's warnings.
        weakref.finalize(self, _close_all, self._idle)

    @classmethod
    def for_client(cls, client: Any) -> Optional[Wire]:
        """A Wire to the endpoint of boto3's ``client``, configured as its transport is; None
        where this transport would not send what botocore's sends (a proxy, a client
        certificate, another scheme)."""
        http_session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        endpoint = str(client.meta.endpoint_url)
        try:
            parts = _split(endpoint)
        except ValueError:
            return None
        if parts is None or http_session is None:
            return None
        proxies = getattr(http_session, "_proxy_config", None)
        if proxies is None or proxies.proxy_url_for(endpoint) is not None:
            return None
        if getattr(http_session, "_cert_file", None) is not None:
            return None
        scheme, host, port = parts
        context = None
        if scheme == "https":
            verify = getattr(http_session, "_verify", True)
            context = ssl.create_default_context(
                cafile=None if verify is False else get_cert_path(verify)
            )
            if verify is False:  # the client was made with verify=False: so is this
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
        config = client.meta.config
        return cls(
            scheme,
            host,
            port,
            context,
            float(config.connect_timeout or 60),
            float(config.read_timeout or 60),
        )

    def request(
        self, method: str, url: str, headers: Mapping[str, str], body: Optional[bytes] = None
    ) -> Answer:
        """Send one request (``url``: the full URL it was signed for) and return its answer,
        whose body the caller reads and then closes. A kept connection the server had closed
        meanwhile is replaced once (the requests sent here are idempotent)."""
        split = url.split("/", 3)
        target = "/" + (split[3] if len(split) > 3 else "")
        for fresh in (False, True):
            conn = None if fresh else self._take()
            reused = conn is not None
            if conn is None:
                conn = self._connect(url)
            try:
                conn.request(method, target, body=body, headers=dict(headers))
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and _stale(e):
                    continue
                raise _failure(e, url, connecting=False) from None
            return Answer(self, conn, resp, url)
        raise AssertionError("unreachable")  # pragma: no cover

    def _connect(self, url: str) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self.context is not None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.connect_timeout, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.read_timeout)
            # Small requests go out at once (urllib3 sets the same).
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            conn.close()
            raise _failure(e, url, connecting=True) from None
        return conn

    def _take(self) -> Optional[http.client.HTTPConnection]:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle = list(self._idle)
            del self._idle[:]
        _close_all(idle)


def _close_all(conns: List[http.client.HTTPConnection]) -> None:
    for conn in conns:
        conn.close()


def _split(endpoint: str) -> Optional[Tuple[str, str, int]]:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.path not in ("", "/") or parts.query or parts.username or parts.password:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port


def _stale(e: BaseException) -> bool:
    """A kept connection the server closed while it was idle: nothing of this request was
    answered."""
    return isinstance(
        e,
        (
            http.client.RemoteDisconnected,
            http.client.BadStatusLine,
            ConnectionResetError,
            BrokenPipeError,
        ),
    )


def _failure(e: BaseException, url: str, *, connecting: bool) -> Exception:
    """The botocore exception urllib3's transport would have raised for ``e``."""
    cls: Any
    if isinstance(e, ssl.SSLError):
        cls = bex.SSLError
    elif connecting:
        timeout = isinstance(e, socket.timeout)
        cls = bex.ConnectTimeoutError if timeout else bex.EndpointConnectionError
    elif isinstance(e, socket.timeout):
        cls = bex.ReadTimeoutError
    else:
        return bex.ConnectionClosedError(endpoint_url=url)  # type: ignore[no-any-return]
    failure: Exception = cls(endpoint_url=url, error=e)
    return failure
