"""The run's samples over time, for `rgt report`: bounded, rotated JSON lines in the run's
``health/`` directory, mirrored to the store with the state.

Two series, each a few files of at most ``MAX_BYTES``: ``samples.jsonl`` holds every tick (the
last day or so at the default interval), ``coarse.jsonl`` one tick in ``COARSE_EVERY`` (a month).
When the current file is full it becomes ``NAME.1.jsonl`` (the older ones move up, the oldest
goes). A row is one JSON object: ``t`` (epoch seconds), ``attempt``, ``state``, then the probes'
samples (``disk.ckpt.bytes_used``, ``gpu.util``, ``progress.step``...). Rows are written without
fsync: they are advisory, and a torn last line is skipped when read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Mapping

MAX_BYTES = 2 << 20
KEEP = 4  # files per series, the current one included
COARSE_EVERY = 10
SERIES = ("coarse", "samples")  # oldest resolution first: what `read` merges


def files(directory: str, series: str) -> List[str]:
    """The series' files, oldest first (those that exist)."""
    names = [f"{series}.{i}.jsonl" for i in range(KEEP - 1, 0, -1)] + [f"{series}.jsonl"]
    return [p for p in (os.path.join(directory, n) for n in names) if os.path.exists(p)]


class Series:
    """The writer (the health watcher's thread is its only caller)."""

    def __init__(self, directory: str, max_bytes: int = MAX_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._ticks = 0
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def append(self, row: Mapping[str, Any]) -> None:
        line = (json.dumps(row, sort_keys=True, allow_nan=False) + "\n").encode()
        self._write("samples", line)
        if self._ticks % COARSE_EVERY == 0:
            self._write("coarse", line)
        self._ticks += 1

    def _write(self, series: str, line: bytes) -> None:
        path = os.path.join(self.directory, f"{series}.jsonl")
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        if size and size + len(line) > self.max_bytes:
            self._rotate(series)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _rotate(self, series: str) -> None:
        d = self.directory
        for i in range(KEEP - 1, 0, -1):
            older = os.path.join(d, f"{series}.{i}.jsonl")
            newer = os.path.join(d, f"{series}.{i - 1}.jsonl" if i > 1 else f"{series}.jsonl")
            if os.path.exists(newer):
                os.replace(newer, older)


def rows(path: str) -> Iterator[Dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue  # a torn last line
                if isinstance(row, dict) and isinstance(row.get("t"), (int, float)):
                    yield row
    except OSError:
        return


def read(directory: str) -> List[Dict[str, Any]]:
    """Every row, oldest first: the coarse series where the fine one no longer reaches, then
    the fine one."""
    fine = [r for p in files(directory, "samples") for r in rows(p)]
    start = fine[0]["t"] if fine else float("inf")
    coarse = [r for p in files(directory, "coarse") for r in rows(p) if r["t"] < start]
    return coarse + fine


def read_lines(lines: List[bytes]) -> List[Dict[str, Any]]:
    """Rows from raw lines (a copy that came from the box or the store); bad lines skipped."""
    out = []
    for raw in lines:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("t"), (int, float)):
            out.append(row)
    return out
