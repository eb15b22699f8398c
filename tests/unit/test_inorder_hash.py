"""The in-order hash of a ranged download (onbox/sealing/stores/s3/download.py ``_InOrder``):
parts arrive at once, each in order, into the hasher's own buffers, and the file's sha256 is
still the sha256 of the file; what arrives ahead of the hashed prefix is bounded by the number
of buffers (a part ahead waits for one, never the part at the prefix, so the bound cannot stall
a download); a stopped download releases its waiting parts and its hashing thread."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import threading
import time
from typing import Any, List, Optional

import pytest

# The S3 extra (boto3) is not in every environment the unit tests run in (the Python 3.9 stage).
pytest.importorskip("botocore")

from onbox.common.writeback import Direct  # noqa: E402
from onbox.sealing.stores.s3 import download  # noqa: E402

PART, CHUNK = 64 << 10, 16 << 10


def _hasher(size: int, limit: int, stop: threading.Event) -> download._InOrder:
    return download._InOrder(size, lambda: memoryview(bytearray(CHUNK)), limit, stop.is_set)


def _send(hasher: download._InOrder, data: bytes, at: int, pause: float = 0.0) -> None:
    """What a part does with one chunk: a buffer, the bytes received into it, handed over."""
    buf = hasher.take(at)
    n = min(CHUNK, len(data) - at)
    buf[:n] = data[at : at + n]
    time.sleep(pause)
    hasher.give(at, buf, n)


def test_parts_arriving_at_once_hash_to_the_files_sha256() -> None:
    data = os.urandom(40 * PART + 123)
    hasher = _hasher(len(data), 8, threading.Event())
    rnd = random.Random(7)

    def part(start: int) -> None:
        for at in range(start, min(start + PART, len(data)), CHUNK):
            _send(hasher, data, at, rnd.random() / 1000)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # in file order, as the lanes start them
        futures = [pool.submit(part, start) for start in range(0, len(data), PART)]
        assert hasher.run() == hashlib.sha256(data).hexdigest()
        for f in futures:
            f.result()
    assert hasher.made <= 8 and not hasher.ready  # a buffer made beyond the bound is dropped


def test_what_waits_ahead_of_the_prefix_is_bounded_and_the_prefix_never_waits() -> None:
    data = os.urandom(6 * CHUNK)
    hasher = _hasher(len(data), 2, threading.Event())
    digest: List[Optional[str]] = []
    runner = threading.Thread(target=lambda: digest.append(hasher.run()))
    runner.start()
    for at in (CHUNK, 2 * CHUNK):  # two chunks ahead of the prefix: both buffers out
        _send(hasher, data, at)
    ahead = threading.Thread(target=_send, args=(hasher, data, 3 * CHUNK))
    ahead.start()
    ahead.join(0.5)
    assert ahead.is_alive() and hasher.made == 2 and hasher.offset == 0  # waits for a buffer
    _send(hasher, data, 0)  # the prefix's chunk gets one at once, and frees the others
    ahead.join(5)
    assert not ahead.is_alive()
    for at in (4 * CHUNK, 5 * CHUNK):
        _send(hasher, data, at)
    runner.join(5)
    assert digest == [hashlib.sha256(data).hexdigest()] and hasher.made == 2


def test_a_stopped_download_releases_its_waiting_parts_and_its_hash() -> None:
    stopped = threading.Event()
    data = os.urandom(4 * CHUNK)
    hasher = _hasher(len(data), 1, stopped)
    _send(hasher, data, CHUNK)  # ahead: the only buffer is out
    errors: List[BaseException] = []
    digest: List[Optional[str]] = []

    def waits() -> None:
        try:
            _send(hasher, data, 2 * CHUNK)
        except concurrent.futures.CancelledError as e:
            errors.append(e)

    parts = threading.Thread(target=waits)
    runner = threading.Thread(target=lambda: digest.append(hasher.run()))
    parts.start()
    runner.start()
    time.sleep(0.2)
    stopped.set()
    hasher.wake()
    parts.join(5)
    runner.join(5)
    assert not parts.is_alive() and not runner.is_alive()
    assert len(errors) == 1 and digest == [None]


def test_buffers_made_for_the_prefix_beyond_the_bound_are_unmapped_as_they_are_dropped(
    tmp_path: Any,
) -> None:
    # A ranged download written with O_DIRECT maps its buffers (writeback.Direct); while the
    # part at the prefix is the slow one, the parts ahead hold every buffer of the bound and
    # each of the prefix's chunks gets one made beyond it. Dropped once hashed, it must be
    # unmapped then: kept until the file ends, the mapped memory grew with the file.
    fd = os.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT, 0o600)
    direct = Direct(fd)
    data = os.urandom(8 * CHUNK)
    stop = threading.Event()
    hasher = download._InOrder(len(data), lambda: direct.buffer(CHUNK), 2, stop.is_set, direct.free)
    _send(hasher, data, 6 * CHUNK)  # the two chunks ahead take the bound's two buffers
    _send(hasher, data, 7 * CHUNK)
    made: List[Any] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        digest = pool.submit(hasher.run)
        for at in range(0, 6 * CHUNK, CHUNK):  # the prefix's chunks, each beyond the bound
            buf = hasher.take(at)
            made.append(buf.obj)
            n = min(CHUNK, len(data) - at)
            buf[:n] = data[at : at + n]
            hasher.give(at, buf, n)
            del buf
            while hasher.offset <= at:  # hashed (and dropped) before the next is taken
                time.sleep(0.001)
        assert digest.result() == hashlib.sha256(data).hexdigest()
    assert len(made) == 6 and all(m.closed for m in made)
    assert len(direct._bufs) == 2  # the bound's two, freed with the writer
    direct.close()
