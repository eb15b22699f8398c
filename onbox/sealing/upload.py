"""The upload of one checkpoint's files: many objects in flight, one result.

The sealer (onbox/sealing/sealer.py) hands over a checkpoint's files; this module puts them
from a bounded pool of threads (``Store.parallel_puts`` of them: a checkpoint of 10,000 small
files is as many round trips, and one after another they wait on the network or on fsync, not
on the CPU), hashing in the same threads, so one file's hash overlaps another's upload. It
returns the MANIFEST's entries, in the checkpoint's order, only once every object is verified
by the store; the MANIFEST itself is the sealer's, written after.

Per file, as before the pool: a file that may be a duplicate (a file this epoch sealed, or
another file of this checkpoint, has its size) is hashed first and points at the object that
holds those bytes when there is one; two files of this checkpoint with the same bytes are put
once (the second waits for the first's put); a file of a size seen nowhere else is put with no
sha256 pass of our own first where the store hashes while it sends; a file the job rewrites in
place is staged (copied while hashed) so the upload never reads a half-rewritten file. A file
the job deleted or rewrote meanwhile is ``Vanished`` (rotation, normal).

A failure of one object (a store error after its retries, Vanished) stops the rest: files not
started are not started, puts in flight are awaited (never abandoned mid-request), and the error
is raised, so no MANIFEST is written and the next pass retries the whole checkpoint (objects put
already are put again, or found by the dedupe of a later epoch; a put is idempotent). The crash
point ``seal.after_object`` is reached once per object put, in the calling thread.

A seal with a deadline (the final seal at SIGTERM has a grace to fit in) starts no file and no
retry once it would end past it: ``OutOfTime``, so the checkpoint gets no MANIFEST (a put in
flight is awaited, as above, not abandoned mid-request).

One exception to awaiting: an upload the store took nothing of for its bound (``[store] stall``,
where the store says how its uploads move: onbox/sealing/stores/hangbound.py ``watched``), a
hung mount or a store that stopped answering mid-PUT, is cut: its error (a StoreHung) is raised
at once and its threads (daemons) left where they hang, so the sealing thread, and the agent
letting go of the run, wait the bound and no longer. A slow upload that still moves is never
cut. Nothing of a cut checkpoint is named by a MANIFEST: LATEST stays where it was.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import queue
import shutil
import threading
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Set, Tuple, Union

from onbox.common.errors import IntegrityError, StoreError
from onbox.common.faults import crash_point
from onbox.common.safepath import NotRegularFile, open_regular, sha256_regular
from onbox.sealing.discovery import read_signature, signature
from onbox.sealing.stall import Stall
from onbox.sealing.stores.base import Store, with_retries
from onbox.sealing.stores.hangbound import SIGNAL_POLL, StoreHung, refuse_upload, upload_bound

CHUNK = 1 << 20
# A file up to this size that may be a duplicate is read into memory once, hashed there, and
# put from the same bytes (Store.put_data): a checkpoint of thousands of small equal-sized files
# (shards, tokenizer files) is otherwise read and hashed twice per file. Small, because as many
# files as the store's parallel_puts (S3: 64) may be read ahead at once.
SMALL = 1 << 20
# Seconds between two looks at the checkpoint dir's links while a checkpoint is put (a listing
# of the dir: cheap beside a put; a job's checkpoint interval is far longer).
LOOK_EVERY = 1.0
Entry = Dict[str, Any]
Known = Dict[Tuple[str, int], str]  # (sha256, size) -> key of an object that holds those bytes
# What a put thread hands back: (the file's index, (entry, whether put) or None, the error).
_Done = Tuple[int, Optional[Tuple[Entry, bool]], Optional[BaseException]]


class Vanished(Exception):
    """The job deleted or replaced a checkpoint while it was being sealed (rotation): normal."""


class OutOfTime(Exception):
    """The seal's deadline came before every file of the checkpoint was put."""


class _Stopped(Exception):
    """A file not started because another one failed."""


class _Claims:
    """Which object holds which bytes: this epoch's sealed objects and, as the seal goes on,
    the ones it puts. A file whose bytes another thread is putting waits for that put."""

    def __init__(self, known: Known) -> None:
        self.done = dict(known)
        self.sizes = {size for _, size in known}
        # Bytes being put, and the Event a thread waiting for that put waits on; made by the
        # first waiter, not by every claim (nearly every put has no waiter).
        self.flight: Dict[Tuple[str, int], Optional[threading.Event]] = {}
        self.lock = threading.Lock()

    def claim(self, sha: str, size: int, stop: threading.Event) -> Optional[str]:
        """The key that holds these bytes already, or None: then they are the caller's to put
        and ``finish`` must follow."""
        while True:
            with self.lock:
                key = self.done.get((sha, size))
                if key is not None:
                    return key
                if (sha, size) not in self.flight:
                    self.flight[(sha, size)] = None
                    return None
                ev = self.flight[(sha, size)]
                if ev is None:
                    ev = self.flight[(sha, size)] = threading.Event()
            ev.wait()  # another thread is putting the same bytes: it is running, not queued
            if stop.is_set():
                raise _Stopped()

    def finish(self, sha: str, size: int, key: Optional[str]) -> None:
        """The put of a claim is over: ``key`` holds the bytes now (None: it failed)."""
        with self.lock:
            if key is not None:
                self.done[(sha, size)] = key
            ev = self.flight.pop((sha, size), None)
        if ev is not None:
            ev.set()


class _Busy:
    """Whether any thread is inside (``with``): ``token()`` is then new at each call."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1

    def token(self) -> float:
        return time.monotonic() if self._n else 0.0


class CheckpointUpload:
    """The upload of one checkpoint's files (``rels``, relative to ``ckpt_dir``) to keys under
    ``prefix``; ``run()`` returns (entries, bytes put)."""

    def __init__(
        self,
        store: Store,
        ckpt_dir: str,
        rels: List[str],
        prefix: str,
        known: Known,
        *,
        stage_dir: str,
        rewritten: bool,
        found: Optional[Tuple[int, int, int]] = None,
        deadline: Optional[float] = None,
        linked: Collection[str] = (),
        look: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.ckpt_dir = ckpt_dir
        self.rels = rels
        self.prefix = prefix
        self.claims = _Claims(known)
        self.stage_dir = stage_dir
        self.rewritten = rewritten
        # The in-place file's signature when scan found it: the sealer records the seal under
        # it, so a copy of a later rewrite must not be sealed in its name (that rewrite would
        # then look sealed, and the one found would be sealed twice).
        self.found = found
        self.deadline = deadline  # time.monotonic(): no file, no retry starts after it
        self.stop = threading.Event()
        self.shared_sizes: Set[int] = set()  # sizes two files of this checkpoint have
        # The ``rels`` that are symlinks to a regular file (onbox/sealing/discovery.py): read
        # from their target, resolved once per file, so every read, stat and put below is of
        # one symlink-free path (and the stores' O_NOFOLLOW open passes).
        self.linked = set(linked)
        # Called every LOOK_EVERY seconds while files are put: the sealer observes the dir's
        # links (onbox/sealing/dirlinks.py ``Seen``), which the job moves on meanwhile.
        self.look = look
        self._reading = _Busy()

    def src(self, rel: str) -> str:
        path = os.path.join(self.ckpt_dir, *rel.split("/"))
        return os.path.realpath(path) if rel in self.linked else path

    def run(self) -> Tuple[List[Entry], int]:
        self.shared_sizes = _shared_sizes([self.src(r) for r in self.rels])
        os.makedirs(self.stage_dir, exist_ok=True)
        n = len(self.rels)
        workers = max(1, min(int(self.store.parallel_puts), n))
        # Threads that take the next file from a queue and hand back (index, result, error),
        # not an executor's futures: at 10,000 small files a Future, its Condition and
        # as_completed's waiter (one lock every thread's completion takes) cost about as much
        # client CPU as a fifth of the puts themselves (measured: 0.56 against 0.23 s per
        # 10,000 tasks of 64 threads).
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            todo.put(i)
        done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        threads = [
            threading.Thread(
                target=self._work, args=(todo, done), name=f"rgt-seal-put_{w}", daemon=True
            )
            for w in range(workers)
        ]
        results: List[Optional[Tuple[Entry, bool]]] = [None] * n
        failed: Optional[BaseException] = None
        stall: Optional[Stall] = None
        try:
            stall = self._stall(threads, results)
            for t in threads:
                t.start()
            looked = time.monotonic()
            for _ in range(n):
                got: Optional[_Done] = None
                while got is None:
                    try:
                        got = done.get(timeout=LOOK_EVERY if stall is None else SIGNAL_POLL)
                    except queue.Empty:
                        pass
                    if time.monotonic() - looked >= LOOK_EVERY:
                        self.look()
                        looked = time.monotonic()
                    if got is None and stall is not None:
                        stall.check()  # nothing moved for the bound: raised, threads left
                i, out, err = got
                if err is not None:  # the first failure: the rest stop (see _work)
                    failed = err
                    break
                results[i] = out
                if out is not None and out[1]:
                    crash_point("seal.after_object")
        finally:
            self.stop.set()
            _end_puts(threads, stall)  # puts in flight end, none start; hung ones are left
            shutil.rmtree(self.stage_dir, ignore_errors=True)
        if failed is not None:
            raise failed
        done_all = [r for r in results if r is not None]
        if len(done_all) != n:  # every file taken is handed back unless the seal failed
            raise RuntimeError(f"{n - len(done_all)} files of {self.ckpt_dir} were not put")
        return [e for e, _ in done_all], sum(e["size"] for e, put in done_all if put)

    def _stall(self, threads: List[threading.Thread], results: List[Any]) -> Optional[Stall]:
        """The watch on the puts (the module docstring), or None: the store's are not watched.
        Movement is a piece the store took, a file done (deduplicated ones take nothing), or
        a thread hashing or staging a file: reading the box's disk, which may take long for a
        big file, is not the store's silence."""
        bound = upload_bound(self.store)
        if bound is None:
            return None
        what = f"uploading {self.prefix}"
        refuse_upload(self.store, what)  # one still hung: this one would hang as well
        store: Any = self.store
        return Stall(
            bound,
            lambda: (store.movement(), sum(r is not None for r in results), self._reading.token()),
            lambda: store.upload_stalled(what, bound, threads),
        )

    def _work(self, todo: queue.SimpleQueue[int], done: queue.SimpleQueue[_Done]) -> None:
        """Put files from ``todo`` until it is empty or the seal stopped; a failure is handed
        back and stops every thread (files not started are not started)."""
        while not self.stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                self._in_time(0.0)
                out = self._one(self.rels[i])
            except _Stopped:
                return
            except BaseException as e:  # handed to the caller, which raises it
                self.stop.set()
                done.put((i, None, e))
                return
            done.put((i, out, None))

    def _one(self, rel: str) -> Tuple[Entry, bool]:
        """One file: (its MANIFEST entry, whether it was put)."""
        if self.stop.is_set():
            raise _Stopped()
        src = self.src(rel)
        if not self.rewritten and self.store.hashes_while_uploading:
            done = self._put_hashing(src, rel)
            if done is not None:
                return done, True
        with self._reading:  # the store is not asked meanwhile: not watched (``_stall``)
            path, sha, size, data = self._stage(src, rel)
        key = self.claims.claim(sha, size, self.stop)
        if key is not None:
            return {"path": rel, "size": size, "sha256": sha, "key": key}, False
        key = self.prefix + rel
        try:
            if data is not None:  # the bytes hashed are the bytes put: nothing to re-check
                put = functools.partial(self.store.put_data, key, data, sha)
                with_retries(put, sleep=self._backoff(src, rel, None))
            else:
                self._put_checked(key, path, sha, size, rel, staged=path != src)
        except BaseException:
            self.claims.finish(sha, size, None)
            raise
        self.claims.finish(sha, size, key)
        return {"path": rel, "size": size, "sha256": sha, "key": key}, True

    def _put_checked(
        self, key: str, path: str, sha: str, size: int, rel: str, staged: bool
    ) -> None:
        """Upload a hashed file. One the job deleted or rewrote since it was hashed (rotation,
        not a store fault) is Vanished; a staged copy is ours and cannot change."""
        put = functools.partial(self.store.put_file, key, path, sha256=sha, size=size)
        try:
            with_retries(put, sleep=self._backoff(path, rel, None if staged else size))
        except (StoreError, IntegrityError):
            if staged:
                raise
            try:
                st = os.stat(path)
                gone = st.st_size != size or sha256_regular(path)[0] != sha
            except (FileNotFoundError, NotRegularFile):
                gone = True
            if gone:
                raise Vanished(f"{rel} changed or was deleted while uploading") from None
            raise

    def _put_hashing(self, src: str, rel: str) -> Optional[Entry]:
        """Upload without a sha256 pass of our own first, when no sealed file and no other
        file of this checkpoint has this size (so it cannot be a duplicate): the store hashes
        while it sends, and the server verifies. None when it may be a duplicate (hash first)."""
        try:
            before = os.stat(src)
        except FileNotFoundError:
            raise Vanished(f"{rel} was deleted") from None
        if before.st_size in self.claims.sizes or before.st_size in self.shared_sizes:
            return None
        key = self.prefix + rel
        put = functools.partial(self.store.put_file, key, src, sha256=None, size=before.st_size)
        try:
            info = with_retries(put, sleep=self._backoff(src, rel, before))
        except NotRegularFile:  # a regular file when it was listed: replaced since
            raise Vanished(f"{rel} was replaced by something not a regular file") from None
        except (StoreError, IntegrityError):  # a store reports a changed source as either
            if _changed(src, before):  # rotated away or rewritten: normal, not a store fault
                raise Vanished(f"{rel} changed or was deleted while uploading") from None
            raise
        if _changed(src, before) or info.sha256 is None:
            self.store.delete(key)
            raise Vanished(f"{rel} changed while uploading")
        self.claims.finish(info.sha256, before.st_size, key)
        return {"path": rel, "size": before.st_size, "sha256": info.sha256, "key": key}

    def _backoff(
        self, src: str, rel: str, before: Union[os.stat_result, int, None]
    ) -> Callable[[float], None]:
        """The wait before a put is retried: none once another file failed (the seal is over)
        or once the job deleted or rewrote the source (``before``: its stat, or its size; None
        for a staged copy, which is ours), so a rotated file is not retried for seconds."""

        def sleep(seconds: float) -> None:
            if before is not None:
                try:
                    st = os.stat(src)
                    gone = (
                        st.st_size != before
                        if isinstance(before, int)
                        else read_signature(st) != read_signature(before)
                    )
                except FileNotFoundError:
                    gone = True
                if gone:
                    raise Vanished(f"{rel} changed or was deleted while uploading")
            self._in_time(seconds)
            if self.stop.wait(seconds):
                raise _Stopped()

        return sleep

    def _in_time(self, wait: float) -> None:
        """OutOfTime when what would start after ``wait`` seconds would start past the
        deadline: no new file, no retry (one would only be cut off, or run past the grace)."""
        if self.deadline is not None and time.monotonic() + wait >= self.deadline:
            raise OutOfTime(f"the deadline came before every file of {self.prefix} was put")

    def _stage(self, src: str, rel: str) -> Tuple[str, str, int, Optional[bytes]]:
        """(path to upload from, sha256, size, the bytes where read into memory). A file up to
        SMALL is read once and put from memory; a file the job may rewrite in place is copied
        first while hashed; either must not have changed while it was read."""
        try:
            before = os.stat(src)
            if not self.rewritten and before.st_size <= SMALL and self.store.puts_data:
                data = _read_small(src, before.st_size)
                if (
                    read_signature(os.stat(src)) != read_signature(before)
                    or len(data) != before.st_size
                ):
                    raise Vanished(f"{rel} changed while it was read")
                return src, hashlib.sha256(data).hexdigest(), len(data), data
            if not self.rewritten:
                sha, size = sha256_regular(src)
                if read_signature(os.stat(src)) != read_signature(before):
                    raise Vanished(f"{rel} changed while hashed")
                return src, sha, size, None
            if self.found is not None and signature(before) != self.found:
                raise Vanished(f"{rel} was rewritten since it was found")
            dest = os.path.join(self.stage_dir, rel.replace("/", "__"))
            h = hashlib.sha256()
            size = 0
            with open(open_regular(src), "rb") as fin, open(dest, "wb") as fout:
                while True:
                    b = fin.read(CHUNK)
                    if not b:
                        break
                    h.update(b)
                    fout.write(b)
                    size += len(b)
            if read_signature(os.stat(src)) != read_signature(before) or size != before.st_size:
                raise Vanished(f"{rel} was rewritten during the copy")
            return dest, h.hexdigest(), size, None
        except FileNotFoundError:
            raise Vanished(f"{rel} was deleted") from None
        except NotRegularFile:  # a regular file when it was listed: replaced since
            raise Vanished(f"{rel} was replaced by something not a regular file") from None


def _end_puts(threads: List[threading.Thread], stall: Optional[Stall]) -> None:
    """Wait for the puts in flight; with a watch, only while they move: those that moved
    nothing for its bound (a hung mount under a failure being raised) are left, and the store
    records them (its next upload is refused while they hang)."""
    for t in threads:
        while t.ident is not None and t.is_alive():
            if stall is None:
                t.join()
            elif stall.fired:
                return
            else:
                t.join(SIGNAL_POLL)
                with contextlib.suppress(StoreHung):
                    stall.check()


def _read_small(path: str, size: int) -> bytes:
    """The whole of a small file (``size`` by its stat; a file that grew is read one byte
    further, so the caller sees the change)."""
    fd = open_regular(path)
    try:
        chunks: List[bytes] = []
        got = 0
        while got <= size:
            b = os.read(fd, size + 1 - got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def _changed(src: str, before: os.stat_result) -> bool:
    try:
        return read_signature(os.stat(src)) != read_signature(before)
    except FileNotFoundError:
        return True


def _shared_sizes(paths: Collection[str]) -> Set[int]:
    """The sizes more than one of ``paths`` has (a missing file counts for nothing: its own
    put finds it gone)."""
    seen: Set[int] = set()
    shared: Set[int] = set()
    for p in paths:
        try:
            size = os.stat(p).st_size
        except OSError:
            continue
        (shared if size in seen else seen).add(size)
    return shared
