"""The copies of a ``file://`` store (onbox/sealing/stores/local.py), hashed as they go: a
kernel copy while a second thread hashes the source, or, for a small file, one read into
memory hashed there. Used by its puts and its downloads alike.

The kernel copy is made COPY_CHUNK bytes per call: one call for a whole multi-GiB file cannot
be cut short, so a restore stopped by a SIGTERM (a preemption's short grace) would go on to the
last byte. Between two calls a stopped download (``stopped``) gives up, CancelledError, and its
hashing thread stops too. The same calls copy the same bytes, only in bounded lengths. Each call
is also an upload's movement (``moved``, hangbound.py), as is each COPY_CHUNK of a small file's
write and each stretch the disk wrote after it (onbox/common/writeback.py ``settle``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import os
import threading
from typing import Any, BinaryIO, Callable, List, Tuple

from onbox.common import writeback
from onbox.common.faults import hold_point

CHUNK = 1 << 20
HASH_CHUNK = 8 << 20  # large reads keep the hashing thread in OpenSSL, off the GIL
SMALL_FILE = 4 << 20  # a file up to this size is read into memory and hashed there (copy_small)
# Bytes per kernel copy call: a stop waits for at most one, and an upload's movement is counted
# per call (``moved``), so a store is cut as stalled only once it took less than this in its
# whole bound ([store] stall: 1 MiB in 5 min is 3.5 KB/s; a copy of 64 MiB a call was cut on a
# mount slower than 220 KB/s though it moved). A call moves 1 MiB in well under a ms from the
# page cache: a 1 GiB copy in 1 MiB calls took as long as in 64 MiB ones, measured.
COPY_CHUNK = 1 << 20

Stopped = Callable[[], bool]  # True once the download is to give up (base.Lanes.stopped)
Moved = Callable[[], None]  # called as each piece is written


def never() -> bool:
    return False


def nothing() -> None:
    pass


def copy_from(
    f: BinaryIO, dst_fd: int, size: int, stopped: Stopped = never, moved: Moved = nothing
) -> None:
    """Copy ``size`` bytes of the open file ``f`` into ``dst_fd``, in the kernel where it can,
    COPY_CHUNK bytes at a time; CancelledError once ``stopped()`` between two; ``moved()``
    after each (an upload's movement: hangbound.py)."""
    done = 0
    cfr = getattr(os, "copy_file_range", None)
    try:
        while done < size:
            if stopped():
                raise concurrent.futures.CancelledError()
            want = min(COPY_CHUNK, size - done)
            if cfr is not None:
                n = cfr(f.fileno(), dst_fd, want, done)
            else:
                n = os.sendfile(dst_fd, f.fileno(), done, want)
            if n == 0:
                break
            done += n
            moved()
            hold_point("copy.after_piece", stopped)  # a test's signal lands mid-copy
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # Positional reads: the hashing thread shares this descriptor's file offset.
        os.lseek(dst_fd, done, os.SEEK_SET)
        while True:
            if stopped():
                raise concurrent.futures.CancelledError() from None
            b = os.pread(f.fileno(), CHUNK, done)
            if not b:
                break
            done += len(b)
            view = memoryview(b)
            while view:
                view = view[os.write(dst_fd, view) :]
            moved()
            hold_point("copy.after_piece", stopped)


def copy_hashing(
    f: BinaryIO, dst_fd: int, stopped: Stopped = never, moved: Moved = nothing
) -> Tuple[str, int, os.stat_result]:
    """Copy the open file ``f`` into ``dst_fd`` while another thread hashes it: (sha256, bytes
    hashed, the source's stat before). Both threads spend their time in the kernel or in
    OpenSSL with the GIL released, so on two cores the hash costs almost no wall time. A copy
    that stops (``stopped``, or an error) ends the hash too: nothing waits on it."""
    fd = f.fileno()
    before = os.fstat(fd)
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    out: List[Any] = []
    halt = threading.Event()

    def hash_all() -> None:
        try:
            h, off = hashlib.sha256(), 0
            while not halt.is_set():
                b = os.pread(fd, HASH_CHUNK, off)
                if not b:
                    break
                h.update(b)
                off += len(b)
            out.append((h.hexdigest(), off))
        except BaseException as e:  # handed to the copying thread, raised there
            out.append(e)

    hasher = threading.Thread(target=hash_all, name="rgt-hash", daemon=True)
    hasher.start()
    try:
        copy_from(f, dst_fd, before.st_size, stopped, moved)
        # The copy is done before the hash (the kernel copies faster than sha256 runs): the
        # disk writes the copy while the hash catches up, so the caller's fsync after it
        # waits for little (not during the copy: writes then slow the reads of the source,
        # often on the same disk). In stretches: on a slow disk handing them over waits for
        # room, and each handed over is movement.
        writeback.start_all(dst_fd, before.st_size, moved)
    except BaseException:
        halt.set()  # the copy failed or was stopped: its hash is not wanted
        raise
    finally:
        hasher.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    sha, n = out[0]
    return sha, n, before


def copy_file(
    f: BinaryIO, dst_fd: int, stopped: Stopped = never, moved: Moved = nothing
) -> Tuple[str, int, os.stat_result]:
    """``copy_small`` for a file of up to SMALL_FILE bytes, else ``copy_hashing``."""
    if os.fstat(f.fileno()).st_size <= SMALL_FILE:
        return copy_small(f, dst_fd, moved)
    return copy_hashing(f, dst_fd, stopped, moved)


def write_all(fd: int, data: bytes, moved: Moved = nothing) -> None:
    """Write ``data`` to ``fd`` whole, COPY_CHUNK bytes a write, ``moved()`` after each (on a
    slow mount a write returns once its bytes are taken: one of 4 MiB could take minutes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view[:COPY_CHUNK])
        view = view[n:]
        moved()


def copy_small(f: BinaryIO, dst_fd: int, moved: Moved = nothing) -> Tuple[str, int, os.stat_result]:
    """``copy_hashing`` for a file of up to SMALL_FILE bytes: read once into memory, hashed
    there and written out, in this thread. A checkpoint of thousands of small files is put
    many at a time (onbox/sealing/upload.py); a hashing thread of its own per file would cost
    more than its hash."""
    fd = f.fileno()
    before = os.fstat(fd)
    chunks: List[bytes] = []
    off = 0
    while True:
        b = os.pread(fd, SMALL_FILE + 1 - off, off)
        if not b:
            break
        chunks.append(b)
        off += len(b)
        if off > SMALL_FILE:  # it grew since the fstat: hashed as far as read, then refused
            break
    data = b"".join(chunks)
    write_all(dst_fd, data, moved)
    return hashlib.sha256(data).hexdigest(), len(data), before
