"""What a download hands to the disk early (onbox/common/writeback.py): the stretches written
through the page cache, and only those, also when a Direct writer took some of the file's
bytes before it (a file whose O_DIRECT writes the filesystem refused partway, or whose chunks
stopped being aligned). ``start`` (sync_file_range) is the seam recorded here; the file is a
real one, and the fsync at the end stays the guarantee either way."""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import pytest

from onbox.common import writeback

MiB = 1 << 20


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[int, int]]:
    got: List[Tuple[int, int]] = []
    real = writeback.start

    def record(fd: int, offset: int, length: int) -> None:
        got.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(writeback, "start", record)
    return got


def test_stretches_written_through_the_cache_are_handed_over_where_they_lie(
    tmp_path: Any, handed: List[Tuple[int, int]]
) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        wb = writeback.Writeback(fd, 4 * MiB)  # a range of a download, from 4 MiB on
        wb.passed(8 * MiB)  # written directly: [4, 12) MiB
        wb.wrote(3 * MiB)  # through the cache: [12, 15) MiB, not yet a stretch
        wb.passed(1 * MiB)  # directly again: what the cache holds goes now
        wb.wrote(writeback.STRETCH)  # through the cache: [16 MiB, 16 MiB + STRETCH)
        wb.wrote(1)
    finally:
        os.close(fd)
    assert handed == [(12 * MiB, 3 * MiB), (16 * MiB, writeback.STRETCH)]


def test_nothing_is_handed_over_while_every_byte_goes_directly(
    tmp_path: Any, handed: List[Tuple[int, int]]
) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        wb = writeback.Writeback(fd)
        for _ in range(10):
            wb.passed(4 * MiB)
    finally:
        os.close(fd)
    assert handed == []


@pytest.mark.skipif(writeback._sync_file_range is None, reason="no sync_file_range here")
def test_settle_waits_for_a_files_writes_a_slice_at_a_time_each_one_movement(
    tmp_path: Any,
) -> None:
    """``settle`` (a file:// upload's fsync) hands a written file to the disk and waits for it
    SLICE at a time, saying ``moved`` after each, before the fsync: an upload watched for
    movement sees a slow disk's writes go on. A file of one slice or less is one fsync."""
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    seen: List[int] = []
    try:
        os.write(fd, os.urandom(3 * writeback.SLICE + 1))
        writeback.settle(fd, 3 * writeback.SLICE + 1, lambda: seen.append(1))
        assert len(seen) == 2 * 4  # each of the 4 slices handed over, then waited for
        seen.clear()
        writeback.settle(fd, writeback.SLICE, lambda: seen.append(1))
        assert seen == []
    finally:
        os.close(fd)
