"""How an ``hf://`` store (onbox/sealing/stores/hf.py) sees its uploads move, and how a cut
one's thread ends: huggingface_hub reports nothing a store could count, and sets no timeout on
its requests, so a Hub that stopped answering mid-upload held the upload, and the sealing
thread waiting on it, for ever.

The store hands huggingface_hub a file object (``Counted``) rather than a path or bytes: the
library reads it as it sends (64 KiB a read, as the socket takes them: a request the Hub stopped
reading stops reading the file once the socket's buffers are full), and each read that returns
bytes is a piece taken (HangBound.moved), so an upload that moves nothing for ``[store] stall``
is cut (hangbound.py ``watched``) and one that still moves, however slowly, is not. A file
object takes huggingface_hub's HTTP transfer (the LFS protocol, which the Hub takes for any
repo, a Xet-backed one too): its Xet transfer runs in hf_xet's own threads and reads the file
there, where nothing could be counted. huggingface_hub warns of that fallback at each upload;
the warning is left out (``quiet_xet_fallback``): it is the store's choice, not a problem.

A cut upload's thread is left (hangbound.py), and while it lives every later upload is refused
(``refuse_upload``). huggingface_hub's HTTP client waits for ever on a socket the Hub keeps open
and never reads, or never answers on, so that thread could outlive the Hub's recovery and keep
sealing off until the agent restarts. ``bound_idle_requests`` gives that client a connect, read
and write timeout of IDLE_FACTOR times the store's bound. It bounds each send and receive on
the socket, not the request: httpcore sets it before each, and an upload is sent a piece of the
file (64 KiB, the watch's own grain) at a time, so an upload that still moves is never cut by
it. A cut upload's request then fails soon after the cut, its connection dropped; huggingface_hub
tries it again (up to five times) on a new connection, which a Hub that answers again takes, so
the thread ends then, or after its last try. Twice the bound, so the watch cuts first: it says
what hung, and a retry's reads would count as movement and keep it from ever cutting. Downloads
are not affected: huggingface_hub gives their requests a timeout of their own
(HF_HUB_DOWNLOAD_TIMEOUT), and Xet has its own client. The client is one per process: its
timeout is the largest bound given in the process, so no store's requests are cut before its
own bound. Where huggingface_hub has no client factory (before 1.0: requests) nothing changes.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from typing import Any, Callable, Optional, Union

# The warning huggingface_hub logs when it is given a file object while hf_xet is installed.
_FALLBACK = "binary IO buffer is not supported by Xet"
# The client's timeout, in the store's bound (the module docstring).
IDLE_FACTOR = 2.0
_idle: Optional[float] = None  # the timeout given to huggingface_hub's client; None: none yet
_idle_lock = threading.Lock()


class Counted(io.BufferedIOBase):
    """``src`` (a file's descriptor, closed with this, or bytes) as a file for huggingface_hub
    to read (seekable, as CommitOperationAdd requires), calling ``moved()`` after each read
    that returns bytes."""

    def __init__(self, src: Union[int, bytes], moved: Callable[[], None]) -> None:
        super().__init__()
        self._f: Union[io.FileIO, io.BytesIO] = (
            io.BytesIO(src) if isinstance(src, bytes) else io.FileIO(src, "r")
        )
        self._moved = moved

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: Optional[int] = -1) -> bytes:
        b = self._f.read(-1 if size is None else size)
        if b:
            self._moved()
        return b

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        b = self.read(len(buffer))
        buffer[: len(b)] = b
        return len(b)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()


class _NoXetFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK not in record.getMessage()


def quiet_xet_fallback() -> None:
    """Leave out huggingface_hub's warning that a file object is not sent by Xet (the module
    docstring); once per process."""
    log = logging.getLogger("huggingface_hub._commit_api")
    if not any(isinstance(f, _NoXetFallback) for f in log.filters):
        log.addFilter(_NoXetFallback())


def bound_idle_requests(bound: float) -> None:
    """Give huggingface_hub's HTTP client a timeout of IDLE_FACTOR x ``bound`` (the module
    docstring), unless it has one as long already; nothing where it has no client factory."""
    global _idle
    try:
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # before 1.0 (requests): left as it was
        return
    idle = IDLE_FACTOR * bound
    with _idle_lock:
        if _idle is not None and _idle >= idle:
            return
        _idle = idle

        def client() -> Any:
            c = default_client_factory()
            try:  # connect, read and write; a wait for a pooled connection is not the network's
                c.timeout = type(c.timeout)(idle, pool=None)
            except (AttributeError, TypeError):  # a client of another kind: left as it was
                pass
            return c

        # Closes the client made so far: the next request makes one with the timeout.
        set_client_factory(client)
