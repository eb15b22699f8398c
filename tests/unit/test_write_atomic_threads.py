"""Two threads of one process replacing the same file each land whole.

What a user relies on: rgt's documents (the sweep's kept wheel, the agent's state and records)
are written by ``write_atomic``, and since ``rgt sweep`` deploys to its boxes side by side and the
agent seals in a thread beside its main loop, two threads of one process can replace the same
path at once. Each must write its own temporary file: one name per process let the second
thread truncate and write into the first's file after it was renamed into place (a torn
document under the final name), or find it gone at its own rename (an error for a write that
should have succeeded).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import List

from onbox.common.durable import write_atomic


def test_two_threads_replacing_one_file_each_land_whole_and_never_fail(tmp_path: Path) -> None:
    path = str(tmp_path / "doc.json")
    payloads = [bytes([ord("a") + i]) * (256 * 1024) for i in range(2)]
    errors: List[BaseException] = []
    torn: List[int] = []
    start = threading.Barrier(2)

    def writer(i: int) -> None:
        start.wait()
        for _ in range(150):
            try:
                write_atomic(path, payloads[i])
            except BaseException as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)
                return
            with open(path, "rb") as f:
                got = f.read()
            if got not in payloads:
                torn.append(len(got))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert torn == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]  # no temporary left
