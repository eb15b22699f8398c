"""Hashing a pull's staged copies: sha256 through one reused buffer, and the hashing (with the
fsync) of each copy overlapped with the transfer of the next ones (Checker; controller/results/
pull.py's docstring says when such a hash stands)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

from controller.results.entries import Entry, stage_path
from onbox.common.durable import fsync_file

HASH_BUFFER = 1 << 20
PARALLEL_FSYNC = 4 << 20  # a file this large is fsynced in a thread of its own while hashed
HASHERS = max(1, min(8, os.cpu_count() or 1))


def file_sha(path: str) -> Tuple[int, str]:
    # Into one reused buffer: about a tenth less CPU per byte than a new bytes object per read.
    h = hashlib.sha256()
    buf = bytearray(HASH_BUFFER)
    view = memoryview(buf)
    n = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n, h.hexdigest()
            h.update(view[:k])
            n += k


_Sig = Tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode


def _sig(path: str) -> _Sig:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class Checker:
    """Hashes each temporary copy, and fsyncs it, as soon as its transport has finished it,
    while the next files are still being fetched, so that verification and durability overlap
    the transfer instead of following it.

    A hash made here stands only when nothing can have changed the copy since: the transport
    did not announce the file again (a transport announces a file each time it has finished
    writing it; ``finished`` then queues a new hash and the old one is discarded), and the
    copy's size, mtime, ctime and inode are the same before the hash, after the fsync and when
    the verification asks (``result``). Otherwise the verification hashes the copy itself."""

    def __init__(self, stage_dir: str) -> None:
        self.stage_dir = stage_dir
        self._lock = threading.Lock()
        self._jobs: Dict[str, Future[Optional[Tuple[int, str, _Sig]]]] = {}
        self._pool = ThreadPoolExecutor(HASHERS, thread_name_prefix="rgt-pull-hash")

    def finished(self, e: Entry, sha256: Optional[str] = None) -> None:
        """The transport has written ``e``'s copy completely (not verified yet); ``sha256``:
        the hash of what it wrote, when it hashed while writing and fsynced the copy (a store's
        download), which then is not read back: a read-back would come from the page cache and
        prove no more."""
        job: Future[Optional[Tuple[int, str, _Sig]]]
        if sha256 is None:
            job = self._pool.submit(self._hash, stage_path(self.stage_dir, e))
        else:
            job = Future()
            try:
                sig = _sig(stage_path(self.stage_dir, e))
                job.set_result((sig[0], sha256, sig))
            except OSError:
                job.set_result(None)  # gone already: the verification finds it so
        with self._lock:
            old = self._jobs.get(e.stage)
            if old is not None:
                old.cancel()
            self._jobs[e.stage] = job

    @staticmethod
    def _hash(path: str) -> Optional[Tuple[int, str, _Sig]]:
        failed: List[BaseException] = []

        def fsync() -> None:
            try:
                fsync_file(path)
            except BaseException as e:
                failed.append(e)

        try:
            before = _sig(path)
            if before[0] < PARALLEL_FSYNC:
                size, sha = file_sha(path)
                fsync()
            else:  # the fsync (the disk) runs while the hash (a core) reads the cached pages
                writer = threading.Thread(target=fsync, name="rgt-pull-fsync", daemon=True)
                writer.start()
                try:
                    size, sha = file_sha(path)
                finally:
                    writer.join()
            after = _sig(path)
        except OSError:
            return None
        if failed or before != after or size != after[0]:
            return None
        return size, sha, after

    def result(self, e: Entry) -> Optional[Tuple[int, str]]:
        """(size, sha256) of ``e``'s copy as hashed (and fsynced) during the fetch, when that
        still describes the copy; None when the copy must be hashed now."""
        with self._lock:
            job = self._jobs.get(e.stage)
        if job is None:
            return None
        try:
            done = job.result()
        except Exception:  # cancelled, or the hash failed: the verification hashes it itself
            return None
        if done is None:
            return None
        size, sha, sig = done
        try:
            if _sig(stage_path(self.stage_dir, e)) != sig:
                return None
        except OSError:
            return None
        return size, sha

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
