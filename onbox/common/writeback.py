"""Starting the disk writes of a file while it is still being filled, so that its fsync at the
end waits for the last few MiB, not for all of it.

A restore downloads a checkpoint and fsyncs every file before it is renamed into place
(nothing unverified or torn under a final name). Left alone, the kernel holds a freshly written
GiB in the page cache (the dirty limits are a share of RAM: on a box with tens of GiB, all of
it) and writes it only when the fsync asks, so the fsync costs a whole disk write of the file
after the last byte arrived (about 0.5 s per GiB on the NVMe-backed disk measured here). Asking
for each written stretch to go to the disk as soon as it is complete
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start the writes, do not wait for them) overlaps
that write with the download; the fsync stays the guarantee, this only moves the work earlier.

Linux only (through ctypes, as Python has no binding); elsewhere, or where the call is refused,
a no-op: the fsync at the end does it all, as before.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from typing import Any, Callable, List, Optional

from onbox.common.libc import linux_function

# A stretch of this many bytes is handed to the disk once written: large enough that the
# requests are big and few, small enough to start early.
STRETCH = 8 << 20
# A file's writes handed over and waited for (``start_all``, ``settle``) this many bytes at a
# time, each an upload's movement (onbox/sealing/stores/hangbound.py): as a copy's call
# (filecopy.COPY_CHUNK), 1 MiB, so a store is cut as stalled only once its disk wrote less than
# that in the whole bound.
SLICE = 1 << 20
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_*
# Refusals of sync_file_range that mean "not here" (a filesystem or kernel without it), not a
# failed write: the fsync then does it all.
_NOT_HERE = (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP)
ALIGN = 4096  # O_DIRECT: offsets, lengths and memory in whole blocks (4 KiB covers 512 and 4K)


def _load() -> Optional[Callable[..., int]]:
    fn = linux_function("sync_file_range")
    if fn is None:
        return None
    import ctypes

    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load()


class Writeback:
    """One writer's contiguous stretch of ``fd`` from ``offset`` on: ``wrote(n)`` after each
    write of ``n`` bytes there; every STRETCH bytes the written part is handed to the disk.
    Several writers of one file (the ranged parts of a download) each have their own."""

    def __init__(self, fd: int, offset: int = 0) -> None:
        self.fd = fd
        self.start = offset  # the first byte not yet handed to the disk
        self.end = offset

    def wrote(self, n: int) -> None:
        self.end += n
        if self.end - self.start >= STRETCH:
            start(self.fd, self.start, self.end - self.start)
            self.start = self.end

    def passed(self, n: int) -> None:
        """The next ``n`` bytes were written past the page cache (a Direct writer's): nothing
        of them to hand over. What was written through the cache before them is handed over
        now, and the stretch goes on after them (else the stretches handed to the disk would
        lag behind the bytes written by the ones written directly)."""
        if self.end > self.start:
            start(self.fd, self.start, self.end - self.start)
        self.end += n
        self.start = self.end


def start(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to the disk, without waiting.
    A hint: a refusal (a filesystem without it, an old kernel) is ignored; errors of the
    writes themselves are the fsync's to report."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _WRITE)


def start_all(fd: int, size: int, moved: Callable[[], None]) -> None:
    """``start`` for the whole of ``fd``'s ``size`` bytes, SLICE at a time, ``moved()`` after
    each: on a slow disk a handing over waits for room among the writes in flight, which is
    the disk moving."""
    if _sync_file_range is None:
        return
    for offset in range(0, size, SLICE):
        _sync_file_range(fd, offset, SLICE, _WRITE)
        moved()


def settle(fd: int, size: int, moved: Callable[[], None]) -> None:
    """``os.fsync(fd)``, a file of ``size`` bytes, its data first written and waited for SLICE
    at a time, ``moved()`` after each. An fsync alone is one wait for all of a file's data the
    disk has not written yet: on a slow mount minutes in which nothing says it moves, so an
    upload watched for movement was cut in it. The fsync stays the guarantee (metadata, the
    disk's cache); the waits before it only make the writes' progress seen. A wait's failure
    is raised here: it would take the error from the fsync after it (the kernel reports a
    failed writeback to one waiter of the file)."""
    if _sync_file_range is not None and size > SLICE:
        start_all(fd, size, moved)  # all handed over first: the waits do not take turns
        for offset in range(0, size, SLICE):
            if _sync_file_range(fd, offset, SLICE, _WAIT_BEFORE | _WRITE | _WAIT_AFTER):
                import ctypes  # loaded already: _load made the function through it

                err = ctypes.get_errno()
                if err in _NOT_HERE:
                    break
                raise OSError(err, os.strerror(err))
            moved()
    os.fsync(fd)


class Direct:
    """Writes of one file past the page cache (``O_DIRECT``) in whole blocks: the bytes go from
    the caller's buffer to the disk, with no page of cache to allocate, fill, write back and
    reclaim. What it does not take (a file's short tail; everything once the filesystem
    refused) the caller writes as usual. The file's fsync stays the caller's (it also flushes
    the disk's cache, the metadata and any tail written through the cache)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ok = True
        self._bufs: List[Any] = []

    def buffer(self, size: int) -> memoryview:
        """A page-aligned buffer of ``size`` bytes (O_DIRECT needs aligned memory), freed with
        this writer."""
        # Private: an anonymous shared mapping is shmem, dearer to fault in and to free.
        self._bufs.append(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
        return memoryview(self._bufs[-1])

    def free(self, buf: memoryview) -> None:
        """Unmap ``buf`` (of ``buffer``) now rather than with this writer: a download that
        drops buffers as it goes would otherwise keep every one it ever made."""
        m: Any = buf.obj
        buf.release()
        for i, b in enumerate(self._bufs):
            if b is m:
                del self._bufs[i]
                with contextlib.suppress(BufferError):  # a view still held: freed when it goes
                    b.close()
                return

    def write(self, chunk: memoryview, offset: int) -> int:
        """How many bytes of ``chunk`` went to ``offset`` directly (in whole blocks; the caller
        writes the rest as usual). 0 for a chunk it cannot take (short or unaligned), and for
        every chunk once the filesystem refused one (EINVAL)."""
        done = 0
        while self.ok and not offset % ALIGN and len(chunk) - done >= ALIGN:
            end = done + (len(chunk) - done) // ALIGN * ALIGN
            try:
                k = os.pwrite(self.fd, chunk[done:end], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.ok = False
                break
            if not k:
                break
            done, offset = done + k, offset + k
        return done

    def close(self) -> None:
        os.close(self.fd)
        for b in self._bufs:
            with contextlib.suppress(BufferError):  # a view still held: freed when it goes
                b.close()


def _open(path: str, fd: int, mode: int) -> Optional[int]:
    """``path`` opened again with O_DIRECT, checked to be the file open as ``fd``; None where
    O_DIRECT is not to be had (another system; a filesystem that refuses it: tmpfs, some FUSE
    and network filesystems)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        dfd = os.open(path, mode | flag | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    a, b = os.fstat(dfd), os.fstat(fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(dfd)
        return None
    return dfd


def open_direct(path: str, fd: int) -> Optional[Direct]:
    """A Direct writer of ``path``, the file open as ``fd``; None where there is none."""
    dfd = _open(path, fd, os.O_WRONLY)
    return None if dfd is None else Direct(dfd)
