"""How an ``hf://`` store (onbox/sealing/stores/hf.py) sees its uploads move: huggingface_hub
reports nothing a store could count, and sets no timeout on its requests, so a Hub that stopped
answering mid-upload held the upload, and the sealing thread waiting on it, for ever.

The store hands huggingface_hub a file object (``Counted``) rather than a path or bytes: the
library reads it as it sends (64 KiB a read, as the socket takes them: a request the Hub stopped
reading stops reading the file once the socket's buffers are full), and each read that returns
bytes is a piece taken (HangBound.moved), so an upload that moves nothing for ``[store] stall``
is cut (hangbound.py ``watched``) and one that still moves, however slowly, is not. A file
object takes huggingface_hub's HTTP transfer (the LFS protocol, which the Hub takes for any
repo, a Xet-backed one too): its Xet transfer runs in hf_xet's own threads and reads the file
there, where nothing could be counted. huggingface_hub warns of that fallback at each upload;
the warning is left out (``quiet_xet_fallback``): it is the store's choice, not a problem.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Callable, Optional, Union

# The warning huggingface_hub logs when it is given a file object while hf_xet is installed.
_FALLBACK = "binary IO buffer is not supported by Xet"


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
