"""Plain HTTP/1.1 to one S3 endpoint, for the lean requests (lean.py): keep-alive connections,
a request's headers and body in one send, and a response body read straight into the caller's
buffer (the messages themselves: http11.py).

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

import socket
import ssl
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union
from urllib.parse import urlsplit

import botocore.exceptions as bex
from botocore.awsrequest import HeadersDict
from botocore.httpsession import get_cert_path

from onbox.sealing.stores.s3.http11 import BadAnswer, Body, Closed, Conn, check_headers

Buffer = Union[bytearray, memoryview]
# Connections kept open between requests: the store's request slots and the threads waiting
# for one each keep theirs.
KEEP = 48


class Cut:
    """Ends one request's wait from another thread (a restore or pull being stopped): ``cut()``
    shuts down the socket the request is on, whether it is still waiting for the answer's
    headers or receiving its body, so the blocked receive fails now, not at the read timeout;
    a request cut before it was sent is not sent, and one cut while it waits is not sent again
    on a fresh connection. The socket is only shut down: the request's own thread closes it.
    The connection is held only while its request is under way (``hold`` to ``let_go``, under
    one lock), so a cut never reaches a connection handed back for another request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Optional[Conn] = None
        self.done = False

    def cut(self) -> None:
        with self._lock:
            self.done = True
            if self._conn is not None:
                try:
                    self._conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the peer closed it already: nothing is waiting on it

    def hold(self, conn: Conn) -> bool:
        """``conn`` is this request's until ``let_go``; False where the request was cut."""
        with self._lock:
            if self.done:
                return False
            self._conn = conn
            return True

    def let_go(self, conn: Conn) -> bool:
        """``conn``'s request is over; False where it was cut (its socket may be shut down)."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
            return not self.done


class Answer:
    """One response: its status and headers; its body read with ``readinto`` or ``read``.
    ``close()`` hands the connection back for the next request when the body was read whole,
    else closes it (a body left unread would be the next request's answer)."""

    def __init__(self, wire: Wire, conn: Conn, body: Body, url: str, cut: Optional[Cut]):
        self._wire = wire
        self._conn: Optional[Conn] = conn
        self._body = body
        self._cut = cut
        self.url = url
        self.status = body.status
        self.length = body.length  # by Content-Length; None when the answer does not say

    @property
    def headers(self) -> HeadersDict:
        """The answer's headers, case-insensitive (botocore's parsers take these)."""
        return HeadersDict(self._body.headers)

    def plain_headers(self) -> Dict[str, str]:
        """The answer's headers by lower-case name (cheaper, for a caller that looks up a few)."""
        return {k.lower(): v for k, v in self._body.headers}

    def readinto(self, buf: Buffer) -> int:
        """Up to ``len(buf)`` bytes of the body into ``buf``; 0 at its end."""
        try:
            return self._body.readinto(buf)
        except (OSError, BadAnswer) as e:
            self.close()
            raise _failure(e, self.url, connecting=False) from None

    def read(self) -> bytes:
        """The rest of the body."""
        try:
            return self._body.read()
        except (OSError, BadAnswer) as e:
            self.close()
            raise _failure(e, self.url, connecting=False) from None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._cut is not None and not self._cut.let_go(conn):
            conn.close()  # cut meanwhile: its socket is shut down, of no use to the next request
        elif self._body.reusable:
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
        # The Host header as botocore signs it: the port only where it is not the scheme's.
        name = f"[{host}]" if ":" in host else host
        default = 443 if scheme == "https" else 80
        self.host_header = name if port == default else f"{name}:{port}"
        self.context = context
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: List[Conn] = []
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
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: Optional[bytes] = None,
        cut: Optional[Cut] = None,
    ) -> Answer:
        """Send one request (``url``: the full URL it was signed for; ``headers`` with the Host
        it was signed with) and return its answer, whose body the caller reads and then closes.
        A kept connection the server had closed meanwhile is replaced once (the requests sent
        here are idempotent). ``cut``, where given, can end the request from another thread
        (Cut) until the answer is closed."""
        split = url.split("/", 3)
        target = "/" + (split[3] if len(split) > 3 else "")
        items = list(headers.items())
        check_headers(items)
        for fresh in (False, True):
            conn = None if fresh else self._take()
            reused = conn is not None
            if conn is None:
                conn = self._connect(url)
            if cut is not None and not cut.hold(conn):
                self.give_back(conn)  # nothing was sent on it
                raise _failure(Closed("the request was cut"), url, connecting=False)
            try:
                conn.send(method, target, items, body or b"")
                return Answer(self, conn, Body(conn, method), url, cut)
            except (OSError, BadAnswer) as e:
                live = cut is None or cut.let_go(conn)
                conn.close()
                if reused and live and _stale(e):
                    continue
                raise _failure(e, url, connecting=False) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _connect(self, url: str) -> Conn:
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        except OSError as e:
            raise _failure(e, url, connecting=True) from None
        try:
            # Small requests go out at once (urllib3 sets the same).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self.read_timeout)
        except OSError as e:
            sock.close()
            raise _failure(e, url, connecting=True) from None
        return Conn(sock)

    def _take(self) -> Optional[Conn]:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, conn: Conn) -> None:
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


def _close_all(conns: List[Conn]) -> None:
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
    return isinstance(e, (Closed, ConnectionResetError, BrokenPipeError))


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
