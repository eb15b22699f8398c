"""Putting one sealed checkpoint's files into a target directory (restore.py chooses which
checkpoint; this module owns getting it there whole).

Every file of the MANIFEST is downloaded into a staging directory rgt makes under the target
(``.rgt-restore-*``, 0700, a hidden name the sealer skips; on the target's filesystem, so the
final move is a rename), each created there with O_EXCL under a flat name of its own. Several
files are in flight at once (FILES), and every request of them (a GET, the ranged GETs of a
large object) runs in one shared ``Lanes`` (LANES requests in flight for the whole restore,
whatever the checkpoint's shape). The store hashes each file while it writes it; each is
fsynced once, at its end, and its size and sha256 compared with the MANIFEST. Only when every
file matches are they renamed into place, at the same relative path under the target they were
sealed from, and their directories fsynced: nothing torn or unverified is ever under a final
name. The first file that fails stops the others (the lanes are stopped; each running request
gives up at its next chunk), and every worker is over before the staging directory is removed:
a failure leaves no litter. A restore holds a shared flock on the target while it runs; the
stages a killed restore left are cleared only by one that could take it alone, so two restores
into one directory never remove each other's live stage.

A file the store holds damaged (of the wrong size or sha256, missing while the store answers)
is StoreCorrupt: the caller quarantines the checkpoint. A store that does not answer raises its
StoreError after the retries; a target that is refused raises UnsafePath or HostError (the
target is walked one directory at a time without following symlinks, onbox.common.safepath).

While the files download, ``progress()`` says how far (`rgt-agent start` shows it): read from
the staging files' allocated blocks, so it needs nothing of each store's download.

A download that moves nothing for ``stall`` seconds (the job file's ``[store] stall``, or
`rgt-agent restore --stall`; RESTORE_STALL by default) ends as ``RestoreStalled``, a
TransientStoreError (exit 14) naming the store, how long, and that setting: a store that stops
answering mid-body (a black-holed network, a stopped server, a hung mount) would otherwise hold
the restore, and `start` waiting on it, for as long as its client's read timeout and retries
allow, or for ever. Movement is read from the stage as a
whole (every byte or file written under it, whichever store writes it), so a slow store that
still sends is never cut; the retries of each request go on inside the bound, and a stall is
then a transient failure like any other, with nothing under a final name.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import os
import queue
import shutil
import stat
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from onbox.common.durable import fsync_dir, make_dirs, sha256_fd
from onbox.common.errors import HostError, IntegrityError, RgtError
from onbox.common.faults import crash_point
from onbox.common.safepath import lstat_beneath, replace_beneath, symlink_error
from onbox.common.size import human
from onbox.common.storeurl import RESTORE_STALL
from onbox.sealing.stall import (
    STALL_SETTING,
    Daemons,
    RestoreStalled,
    Stall,
    stage_marks,
    took,
)
from onbox.sealing.stores.base import (
    Lanes,
    Store,
    StoreError,
    TransientStoreError,
    with_retries,
)

STAGE_PREFIX = ".rgt-restore-"
# Requests in flight for one restore, across all its files and parts: what s5cmd's transfer
# manager needs to fill a link too (per file 5 parts); more only adds contention on a small box.
LANES = 8
# Files in flight: more than LANES, so that while some files are being fsynced or hashed
# the lanes still have requests of others to run.
FILES = 16
# How long the restoring thread waits for a file before it runs the signal handlers a worker
# took for it (in_parallel).
SIGNAL_POLL = 0.2
# After a stall, how long the workers are waited for once stopped: one blocked where no stop
# reaches it (a read from a hung mount) is then left, its stage removed under it.
LET_GO = 10.0
T = TypeVar("T")


# The download under way in this process (one restore at a time in an agent): its stage and
# its files' sizes, for progress().
_downloading: Optional[Tuple[str, List[int]]] = None


def progress() -> Optional[Tuple[int, int]]:
    """(bytes downloaded, bytes in all) of the restore downloading now, None when none is.
    Each staging file counts its allocated blocks, up to its size: a download writes its
    ranged parts where they go (a sparse file's size says nothing), and a filesystem that
    compresses shows less than is done; it is for a person to see it move."""
    now = _downloading
    if now is None:
        return None
    stage, sizes = now
    done = 0
    for i, size in enumerate(sizes):
        try:
            done += min(size, os.stat(os.path.join(stage, str(i))).st_blocks * 512)
        except OSError:  # not begun, or the stage is gone (the restore ended)
            pass
    return done, sum(sizes)


class StoreCorrupt(IntegrityError):
    """A sealed checkpoint is unusable in the store (quarantined), not on this box."""


def _stalled(store: Store, bound: float, longer: str) -> RestoreStalled:
    """The error of a restore from ``store`` that moved nothing for ``bound`` seconds (the
    setting ``longer`` gives)."""
    done, total = progress() or (0, 0)
    return RestoreStalled(
        f"{store.url} sent nothing of the checkpoint for {took(bound)} ({human(done)} of "
        f"{human(total)} downloaded): it stopped answering mid-download; nothing was put in place",
        # No parentheses of its own: the CLI's line puts the whole remedy in a pair.
        "check the store and the way to it: the network, a stopped server, a hung mount; then "
        f"start again. A store that slow can be given longer: {longer}",
    )


def retried(fn: Callable[[], T]) -> T:
    """``fn`` retried with backoff while the store does not answer (TransientStoreError)."""
    return with_retries(fn)


def unwritable(dest_dir: str, e: OSError) -> HostError:
    return HostError(
        f"cannot restore into {dest_dir}: {e.strerror or e}"
        + (f" ({e.filename})" if e.filename and e.filename != dest_dir else ""),
        # No parentheses of its own: the CLI's line puts the whole remedy in a pair.
        "pass --to a directory this user can write, or fix the checkpoint dir's permissions",
    )


def check_target(doc: Dict[str, Any], dest_dir: str) -> None:
    """Refuse, before anything is downloaded, a target where a file of ``doc`` would land on or
    through a symlink (UnsafePath), or where a directory or a file is in the way (HostError)."""
    for f in doc["files"]:
        try:
            st = lstat_beneath(dest_dir, f["path"])
        except NotADirectoryError as e:
            raise HostError(
                f"cannot restore {f['path']!r} into {dest_dir}: {e.filename} is not a directory",
                "remove it, or restore into another directory with --to",
            ) from None
        except OSError as e:
            raise unwritable(dest_dir, e) from None
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise symlink_error(os.path.join(dest_dir, *f["path"].split("/")))
        if stat.S_ISDIR(st.st_mode):
            raise HostError(
                f"cannot restore {f['path']!r} into {dest_dir}: a directory is in its place",
                "remove it, or restore into another directory with --to",
            )


def failure(
    store: Store, key: str, size: Optional[int], e: StoreError, room: str, need: int = 0
) -> RgtError:
    """What a failed read of ``key`` (``size`` bytes by its MANIFEST, None for the MANIFEST
    itself) means, asked of the store itself: StoreCorrupt (the checkpoint is unusable) only
    when the store answers and shows the object missing, of another size, or there yet
    unreadable with room for it on this box; otherwise the error stands (the store does not
    answer, after the retries: nothing is known about the checkpoint), or a HostError (this
    box has no room: not the store's fault either). ``need``: the bytes the whole checkpoint
    takes, when more than this object (its files are in flight together: another one may
    have filled the disk, and its removal since freed the room this object lacked)."""
    if isinstance(e, TransientStoreError):
        return e
    try:
        info = retried(lambda: store.stat(key))
    except IntegrityError as ie:  # e.g. a symlink where the object should be
        return StoreCorrupt(ie.what)
    except StoreError:
        return e
    if info is None:
        return StoreCorrupt(f"{key} is missing from the store")
    if size is not None and info.size != size:
        return StoreCorrupt(f"{key}: {info.size} bytes in the store, the MANIFEST says {size}")
    return no_room(key, size, need, room, e.what) or StoreCorrupt(f"{key} cannot be read: {e.what}")


def no_room(key: str, size: Optional[int], need: int, room: str, what: str) -> Optional[HostError]:
    """The HostError saying how many bytes ``key``'s checkpoint needs where ``room``'s disk
    has fewer free (``what``: how its download failed); None where it has enough."""
    try:
        st = os.statvfs(room)
    except OSError:
        return None
    if size is None or st.f_bavail * st.f_frsize >= max(size, need):
        return None
    return HostError(
        f"no room on this box for {key} (its checkpoint: {max(size, need)} bytes) in {room}: "
        f"{what}",
        "free space on the checkpoint dir's disk, then start again",
    )


def _hold_target(dest_dir: str) -> Optional[int]:
    """A shared lock on ``dest_dir`` for the life of this restore (the fd, closed by the
    caller), taken after clearing the stages a killed restore left, only when no other live
    restore holds it: two restores into one directory (the agent's at start and a hand-run
    ``rgt-agent restore --to``) must not delete each other's live stage. None where the
    filesystem has no flock: the stages are cleared then, as before there was a lock."""
    try:
        fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise unwritable(dest_dir, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another restore is live here: its stage is not stale
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    except OSError:  # no flock on this filesystem (some FUSE mounts)
        os.close(fd)
        _clear_stale_stages(dest_dir)
        return None
    _clear_stale_stages(dest_dir)
    # Not atomic (flock(2)): in the gap another restore may take it exclusively and clear,
    # which is harmless, as this one makes its stage only once it holds the shared lock.
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _clear_stale_stages(dest_dir: str) -> None:
    """Remove the staging directories a killed restore left in ``dest_dir`` (the caller holds
    it exclusively: no live restore's stage is among them). They hold only copies of store
    objects under rgt's own hidden names (never the only copy of anything); a symlink or a
    file under such a name is not rgt's and is left alone."""
    try:
        names = os.listdir(dest_dir)
    except OSError:
        return
    for name in names:
        if not name.startswith(STAGE_PREFIX):
            continue
        path = os.path.join(dest_dir, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _fetch_one(
    store: Store, f: Dict[str, Any], tmp: str, dest_dir: str, lanes: Lanes, need: int
) -> None:
    """One file of the MANIFEST into ``tmp`` (a new name in the stage), verified: size, then
    the sha256 the store computed while writing it (or, where it computes none, read back).
    ``need``: the bytes of the whole checkpoint (failure())."""

    def attempt() -> Optional[str]:
        if lanes.stopped:  # another file failed: no retry, no new download
            raise concurrent.futures.CancelledError()
        return store.fetch_file(f["key"], tmp, size=f["size"], lanes=lanes)

    try:
        got = with_retries(attempt, sleep=lanes.pause)
    except IntegrityError as e:  # e.g. a symlink in a file:// store
        raise StoreCorrupt(e.what, e.remedy) from None
    except StoreError as e:
        raise failure(store, f["key"], f["size"], e, os.path.dirname(tmp), need) from None
    except HostError as e:  # this box's disk refused the download: never the store's fault
        room = no_room(f["key"], f["size"], need, os.path.dirname(tmp), e.what)
        raise room or e from None
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise unwritable(dest_dir, e) from None
    try:
        size = os.fstat(fd).st_size
        if size == f["size"] and got is None:
            got = sha256_fd(fd)[0]
    finally:
        os.close(fd)
    if size != f["size"] or got != f["sha256"]:
        raise StoreCorrupt(
            f"{f['key']}: {size} bytes sha256 {(got or 'not computed')[:12]} in the store, the "
            f"MANIFEST says {f['size']} bytes {f['sha256'][:12]}"
        )


def in_parallel(
    jobs: List[Callable[[Lanes], None]],
    after_each: Callable[[], None] = lambda: None,
    stall: Optional[Stall] = None,
) -> None:
    """Each job (the download of one file, given the shared lanes) run FILES at a time, every
    request of them in one ``Lanes`` of LANES; ``after_each`` in this thread as each job ends.
    The first failure stops the others (no new request; a running one gives up at its next
    chunk) and is raised once every job is over: nothing writes after this returns. ``stall``
    ends a download that moves nothing (its error raised); the workers are then waited for
    LET_GO seconds at most, and one still blocked is left (a daemon, stall.Daemons: it does not
    hold the process's exit; its writes go to the caller's stage, which the caller removes).
    The laptop's pull from a store runs its downloads here too (controller/results/transport.py)."""
    lanes = Lanes(LANES)
    pool = Daemons(max(1, min(FILES, len(jobs))), "rgt-fetch")  # one left must not hold the exit
    futures: List[concurrent.futures.Future[None]] = []
    try:
        ended: queue.SimpleQueue[concurrent.futures.Future[None]] = queue.SimpleQueue()
        futures = [pool.submit(functools.partial(job, lanes)) for job in jobs]
        for fut in futures:
            fut.add_done_callback(ended.put)
        for _ in futures:
            fut = _next_ended(ended, stall)
            fut.result()  # the first failure ends them all (the finally stops the rest)
            after_each()
    finally:
        lanes.stop()
        for fut in futures:
            fut.cancel()
        stalled = stall is not None and stall.fired
        over = not stalled or not concurrent.futures.wait(futures, LET_GO).not_done
        pool.shutdown(wait=over)  # no worker writes after this (but one a stop cannot reach)
        lanes.close(wait=over)


def _next_ended(
    ended: queue.SimpleQueue[concurrent.futures.Future[None]], stall: Optional[Stall] = None
) -> concurrent.futures.Future[None]:
    """The next job to end. The wait is cut every SIGNAL_POLL: Python runs a signal's handler
    in this thread only, once it runs, and the kernel may hand the process's SIGTERM to a
    worker, which does not cut a wait short (the agent's stop of its restore would wait for a
    whole file to end). ``stall`` is checked at each cut (its error raised), reset at an end."""
    while True:
        try:
            fut = ended.get(timeout=SIGNAL_POLL)
        except queue.Empty:
            if stall is not None:
                stall.check()
            continue
        if stall is not None:
            stall.reset()
        return fut


def _fetch_all(
    store: Store,
    files: List[Dict[str, Any]],
    stage: str,
    dest_dir: str,
    stall: float,
    longer: str,
) -> None:
    """Every file into ``stage`` (as ``stage/<index>``), FILES at a time; the first failure
    raised once every worker is over; RestoreStalled when nothing moved for ``stall`` s."""
    global _downloading
    need = sum(int(f["size"]) for f in files)
    store.plan_fetch({f["key"]: int(f["size"]) for f in files})

    def job(i: int, f: Dict[str, Any]) -> Callable[[Lanes], None]:
        tmp = os.path.join(stage, str(i))
        return lambda lanes: _fetch_one(store, f, tmp, dest_dir, lanes, need)

    _downloading = (stage, [int(f["size"]) for f in files])
    try:
        in_parallel(
            [job(i, f) for i, f in enumerate(files)],
            lambda: crash_point("restore.after_object"),
            Stall(stall, lambda: stage_marks(stage), lambda: _stalled(store, stall, longer)),
        )
    finally:
        _downloading = None


def fetch(
    store: Store,
    doc: Dict[str, Any],
    dest_dir: str,
    made: Optional[List[str]] = None,
    stall: float = RESTORE_STALL,
    longer: str = STALL_SETTING,
) -> None:
    """Every file of ``doc`` into ``dest_dir``: staged, verified, then renamed into place. The
    directories it makes are appended to ``made`` (for a caller that undoes a failed restore).
    StoreCorrupt for a file the store holds damaged; UnsafePath or HostError for the target;
    RestoreStalled when the download moved nothing for ``stall`` seconds, saying that
    ``longer`` (the setting that gave the bound) gives it longer."""
    for f in doc["files"]:
        if f["path"].startswith(STAGE_PREFIX):  # would land in the staging dir, then vanish
            raise StoreCorrupt(f"the MANIFEST lists {f['path']!r}, a name of rgt's own staging")
    check_target(doc, dest_dir)
    try:
        new = make_dirs(dest_dir)  # 0700: rgt's directories are the user's alone
        if made is not None:
            made.extend(new)
    except OSError as e:
        raise unwritable(dest_dir, e) from None
    held = _hold_target(dest_dir)
    try:
        try:
            stage = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=dest_dir)
        except OSError as e:
            raise unwritable(dest_dir, e) from None
        _fetch_into(store, doc, stage, dest_dir, made, stall, longer)
    finally:
        if held is not None:
            os.close(held)


def _fetch_into(
    store: Store,
    doc: Dict[str, Any],
    stage: str,
    dest_dir: str,
    made: Optional[List[str]],
    stall: float,
    longer: str,
) -> None:
    """fetch() once its stage is made: the files verified into ``stage``, then renamed into
    place; the stage removed whatever happens."""
    try:
        # A flat name per file: nothing the store supplies names anything under the stage.
        _fetch_all(store, doc["files"], stage, dest_dir, stall, longer)
        dirs = set()
        for i, f in enumerate(doc["files"]):
            try:
                replace_beneath(stage, str(i), dest_dir, f["path"], dir_mode=0o700, made=made)
            except OSError as e:
                raise unwritable(dest_dir, e) from None
            dirs.add(os.path.dirname(os.path.join(dest_dir, *f["path"].split("/"))))
        for d in sorted(dirs, key=len, reverse=True):
            fsync_dir(d)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
