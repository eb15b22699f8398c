"""The in-order hash of a ranged download (onbox/sealing/stores/s3/download.py ``_InOrder``):
parts arrive at once, each in order, and the file's sha256 is still the sha256 of the file;
what arrives ahead of the hashed prefix is kept only up to its bound (a part beyond it waits,
never the part at the prefix, so no download deadlocks on it); a stopped download's waiting
parts give up."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import threading
import time

import pytest

from onbox.sealing.stores.s3 import download

PART, CHUNK = 64 << 10, 16 << 10


def _parts(data: bytes):  # type: ignore[no-untyped-def]
    return [(o, data[o : o + PART]) for o in range(0, len(data), PART)]


def test_parts_arriving_at_once_hash_to_the_files_sha256() -> None:
    data = os.urandom(40 * PART + 123)
    hasher = download._InOrder(lambda: False)
    rnd = random.Random(7)

    def part(offset: int, body: bytes) -> None:
        feed = hasher.feeder(offset)
        for i in range(0, len(body), CHUNK):
            time.sleep(rnd.random() / 1000)
            feed(memoryview(body[i : i + CHUNK]))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # in file order, as the lanes start them
        list(pool.map(lambda p: part(*p), _parts(data)))
    assert hasher.offset == len(data) and not hasher.kept and hasher.held == 0
    assert hasher.h.hexdigest() == hashlib.sha256(data).hexdigest()


def test_what_is_kept_ahead_of_the_prefix_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(download, "KEEP_MAX", 2 * PART)
    data = os.urandom(6 * PART)
    hasher = download._InOrder(lambda: False)
    late = [hasher.feeder(o) for o, _ in _parts(data)]
    for n in (1, 2):  # parts 1 and 2 arrive whole while part 0 has not begun: kept
        late[n](memoryview(data[n * PART : (n + 1) * PART]))
    assert hasher.held == 2 * PART
    blocked = threading.Thread(target=late[3], args=(memoryview(data[3 * PART : 4 * PART]),))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive() and hasher.held == 2 * PART  # part 3 waits for the prefix
    late[0](memoryview(data[:PART]))  # the prefix's part never waits; it hashes 0, 1, 2
    blocked.join(5)
    assert not blocked.is_alive()
    for n in (4, 5):
        late[n](memoryview(data[n * PART : (n + 1) * PART]))
    assert hasher.h.hexdigest() == hashlib.sha256(data).hexdigest() and hasher.held == 0


def test_a_stopped_download_releases_the_parts_waiting_on_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(download, "KEEP_MAX", PART)
    stopped = threading.Event()
    hasher = download._InOrder(stopped.is_set)
    hasher.feeder(PART)(memoryview(bytes(PART)))
    errors = []

    def waits() -> None:
        try:
            hasher.feeder(2 * PART)(memoryview(bytes(PART)))
        except concurrent.futures.CancelledError as e:
            errors.append(e)

    t = threading.Thread(target=waits)
    t.start()
    stopped.set()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
