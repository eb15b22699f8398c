"""Checking a checkpoint's files against its marker, hashed once for all the ranks on a box.

At resume every rank of a multi-process job (torchrun's 8 on one box) verifies the same
checkpoint directory (ckptdir.verify): 8 reads of every byte, competing for the disk and the
memory bandwidth. Here the first rank to take an exclusive flock on the checkpoint's lock file
hashes it and records a memo of what it verified; the others wait on the lock, stat every file
again, and skip hashing only when all of it matches exactly:

- the marker's bytes (their sha256) are the ones the memo was made from;
- every file's (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) is what it was while it was
  hashed (the same before and after the read). A write, a chmod or a rename moves ctime, which
  nobody but root can set back: a file altered in place, to the same size and with its mtime
  put back by os.utime, no longer matches;
- the memo was made in this boot of this machine, for this attempt (RGT_ATTEMPT and torchrun's
  TORCHELASTIC_RESTART_COUNT): each resume still reads the checkpoint once.

A file whose ctime is less than RACY seconds older than the check began is not recorded: a
filesystem's timestamps have a granularity (a second on some), and a write within the same tick
would not move ctime (git's "racily clean" entries). The next rank hashes it, the tick past, and
records it. Where the first rank found a file altered, the memo says so (that file's key and the
error), so the other ranks refuse the checkpoint as fast instead of hashing it one after another
under the lock.

Any doubt means hash again: no memo, one that does not parse, another marker, another boot or
attempt, a key that differs. The memos live in ``$RGT_RUN_DIR/verified/`` (rundir.VERIFIED), a
directory of this user's with mode 0700 (checked on the open directory, which is then used
through its descriptor: nobody else can write a memo into it or swap it), never in a shared
/tmp and never in the checkpoint directory, which the sealer seals as it is. A memo is written
under a temporary name and renamed: a process killed mid-write leaves nothing under the memo's
name, and the next writer of that memo removes what it left.

Only where the job is one of several processes on this box (LOCAL_WORLD_SIZE, else WORLD_SIZE,
above 1: torchrun, accelerate launch, Lightning's launcher) under rgt (RGT_RUN_DIR set); a single
process, or a job outside rgt, hashes as it always did and writes nothing.

Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from onbox.common import jobenv
from onbox.common.durable import sha256_fd
from onbox.common.errors import CheckpointError
from onbox.common.faults import hold_point
from onbox.common.rundir import VERIFIED

VERSION = 1
RACY = 2.0  # seconds: the coarsest timestamp tick of a filesystem a box may have (FAT's 2 s)
# torchrun and accelerate set LOCAL_WORLD_SIZE; Lightning's launcher WORLD_SIZE (one box).
_RANKS = ("LOCAL_WORLD_SIZE", "WORLD_SIZE")
_SCOPE = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
_OLD = "use an older checkpoint"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC

Key = Tuple[int, int, int, int, int]


def key(st: os.stat_result) -> Key:
    """What changes whenever a file's bytes may have: its identity, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stat_files(path: str, files: Dict[str, Any]) -> Dict[str, os.stat_result]:
    """Each file of the marker's ``files`` in the checkpoint at ``path``, stat'ed; raises
    CheckpointError naming the first that is missing or not of its marker's size (a stat each,
    before anything is read)."""
    out = {}
    for fname, want in sorted(files.items()):
        fpath = os.path.join(path, *fname.split("/"))
        try:
            st = os.stat(fpath)
        except FileNotFoundError:
            raise CheckpointError(f"{fpath} is missing", "use an older checkpoint") from None
        if st.st_size != want["size"]:
            raise CheckpointError(
                f"{fpath} is {st.st_size} bytes, its marker says {want['size']}: truncated or "
                "altered",
                _OLD,
            )
        out[fname] = st
    return out


def check(path: str, raw: bytes, files: Dict[str, Any]) -> None:
    """Check every file of the checkpoint at ``path`` (its marker's bytes ``raw``, its parsed
    ``files``) for presence, size and sha256; raises CheckpointError naming the first that
    fails. Hashed by one rank of the box for all of them where they share a memo."""
    with _turn(path) as turn:
        # After the wait for the lock: a rank that waited while a racy file's tick passed
        # records it.
        began = time.time_ns()
        stats = stat_files(path, files)
        marker = hashlib.sha256(raw).hexdigest()
        keys = {n: key(st) for n, st in stats.items()}
        if turn is not None and turn.passed(marker, keys):
            return
        settled = {n: k for n, k in keys.items() if began - k[4] >= RACY * 1e9}
        for fname, want in sorted(files.items()):
            fpath = os.path.join(path, *fname.split("/"))
            sha, stable = _hash(fpath, keys[fname])
            if not stable:
                settled.pop(fname, None)
            if sha != want["sha256"]:
                err = CheckpointError(
                    f"{fpath} does not match the sha256 in its marker ({sha[:12]}... vs "
                    f"{want['sha256'][:12]}...): the file was altered or corrupted",
                    _OLD,
                )
                if turn is not None and fname in settled:
                    turn.record(marker, {fname: settled[fname]}, err)
                raise err
        if turn is not None and len(settled) == len(keys):
            turn.record(marker, settled)


def _hash(fpath: str, want: Key) -> Tuple[str, bool]:
    """(sha256, whether the file was ``want`` throughout the read) of the file at ``fpath``."""
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{fpath} is missing", "use an older checkpoint") from None
    try:
        before = key(os.fstat(fd))
        sha, _ = sha256_fd(fd)
        after = key(os.fstat(fd))
    finally:
        os.close(fd)
    return sha, before == after == want


class _Turn:
    """This process's turn at one checkpoint's memo: the lock on it is held."""

    def __init__(self, dir_fd: int, name: str, real: str) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.real = real
        self.scope = _scope()

    def passed(self, marker: str, keys: Dict[str, Key]) -> bool:
        """True when the memo says these very files passed; raises the CheckpointError it
        recorded when it says one of them was altered; False in any doubt."""
        doc = self._read()
        head = (VERSION, self.scope, self.real, marker)
        if not isinstance(doc, dict) or (doc.get("v"), doc.get("scope")) != head[:2]:
            return False
        if (doc.get("dir"), doc.get("marker")) != head[2:]:
            return False
        files, error = doc.get("files"), doc.get("error")
        if not isinstance(files, dict) or not files:
            return False
        if any(n not in keys or files[n] != list(keys[n]) for n in files):
            return False
        if error is not None:
            if (
                isinstance(error, list)
                and len(error) == 2
                and all(isinstance(e, str) for e in error)
            ):
                raise CheckpointError(error[0], error[1])
            return False
        return len(files) == len(keys)

    def _read(self) -> Any:
        try:
            fd = os.open(f"{self.name}.json", _READ, dir_fd=self.dir_fd)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    def record(
        self, marker: str, keys: Dict[str, Key], error: Optional[CheckpointError] = None
    ) -> None:
        """Replace the memo: ``keys`` passed (or, with ``error``, the one in it was altered).
        Not fsynced: a memo of an earlier boot is void anyway. A memo that cannot be written
        is left out (the other ranks hash)."""
        doc = {
            "v": VERSION,
            "scope": self.scope,
            "dir": self.real,
            "marker": marker,
            "files": {n: list(k) for n, k in keys.items()},
            "error": None if error is None else [error.what, error.remedy or _OLD],
        }
        data = json.dumps(doc, sort_keys=True).encode()
        final = f"{self.name}.json"
        prefix = f".{final}.tmp."
        tmp = f"{prefix}{os.getpid()}"
        try:
            # Under the lock nobody else writes this memo: a temporary of it is a killed one's.
            for n in os.listdir(self.dir_fd):
                if n.startswith(prefix):
                    os.unlink(n, dir_fd=self.dir_fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=self.dir_fd)
            try:
                _write(fd, data[: len(data) // 2])
                hold_point("memo.half_written")  # a test kills the process here
                _write(fd, data[len(data) // 2 :])
            finally:
                os.close(fd)
            os.replace(tmp, final, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _scope() -> List[str]:
    """This boot of this machine, this attempt, this torchrun restart: where a memo holds."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    env = [os.environ.get(n, "") for n in (jobenv.ATTEMPT, *_SCOPE)]
    return [boot, os.uname().nodename, *env]


def _ranks() -> int:
    """How many processes of the job run on this box (1 when nothing says)."""
    for name in _RANKS:
        raw = os.environ.get(name)
        if raw:
            try:
                return int(raw)
            except ValueError:
                return 1
    return 1


def _memo_dir(path: str) -> Optional[int]:
    """A descriptor of the memo directory for the checkpoint at ``path``, None when this process
    shares no memo: alone, outside rgt, or the directory not this user's alone (made 0700
    here when missing) or inside the checkpoint or the checkpoint dir."""
    run_dir = os.environ.get(jobenv.RUN_DIR)
    if not run_dir or _ranks() <= 1:
        return None
    where = os.path.join(run_dir, VERIFIED)
    # Never where the sealer would take the memos for part of a checkpoint.
    for ckpt in (path, os.environ.get(jobenv.CKPT_DIR)):
        if ckpt and _within(where, ckpt):
            return None
    with contextlib.suppress(OSError):  # exists already, or cannot be made: the open says
        os.mkdir(where, 0o700)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


def memo_name(path: str) -> str:
    """The name (without .json or .lock) of the memo of the checkpoint at ``path``."""
    real = os.path.realpath(path)
    return hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _within(path: str, top: str) -> bool:
    """Whether ``path`` is ``top`` or lies under it (symlinks resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(top)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _lock(dir_fd: int, name: str) -> Optional[int]:
    """The flock on ``name``'s lock file, taken (waiting for the rank that holds it); None
    where it cannot be (a filesystem without flock): then this rank hashes alone."""
    try:
        fd = os.open(
            f"{name}.lock",
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _turn(path: str) -> Iterator[Optional[_Turn]]:
    """This process's turn at the memo of the checkpoint at ``path`` (the lock held until the
    block ends), or None where it shares none."""
    dir_fd = _memo_dir(path)
    if dir_fd is None:
        yield None
        return
    lock = None
    try:
        real = os.path.realpath(path)
        name = memo_name(real)
        lock = _lock(dir_fd, name)
        yield None if lock is None else _Turn(dir_fd, name, real)
    finally:
        if lock is not None:
            os.close(lock)  # lets the next rank in
        os.close(dir_fd)
