"""The disk probe: bytes and inodes on every filesystem the run writes to, and what to do as
they fill up.

Each watched path (by label: run, workdir, ckpt, store, cache, pathN) is read once per
filesystem (paths on the same device share one reading). The worse of bytes used and inodes
used is held against three watermarks: ``prune_at`` asks the sealer to delete local copies
already verified in the store (``free_room``); ``warn_at`` is a warning naming the path, the
labels on it, which of the two ran out and a remedy; ``hold_at`` is an alert and the hold file
(``checkpoint.hold`` in the run dir), while which the training API writes no new local
checkpoint. The verdict names every watched filesystem past ``warn_at``, the fullest first (its
level and code are the fullest's), each with what it is short of, what is left and its own
remedy: the fullest by bytes never hides another out of inodes, and a second one running short is
an event of its own. The prune and the hold speak only of the filesystems a checkpoint takes
room on (``CKPT_LABELS``), and the hold goes once they are back under ``warn_at``. The probe
never deletes anything itself.

The budget: the checkpoint filesystem must keep room for one checkpoint being written, one
kept, and the job's scratch (``ckpt_bytes * 2 + scratch``, from the first sealed checkpoint on;
before it, ``scratch`` alone).

The hold file must be creatable when the disk is out of inodes (the run dir often shares the
checkpoint filesystem): a spare file is made next to it while there is room, and holding renames
it into place (a rename needs no new inode).

Both names are in the run dir, which the job knows and can write: each is opened ``O_NOFOLLOW |
O_NONBLOCK`` and used only when it is a regular file of one link (``_open_own``). A FIFO put there
never blocks the watcher's thread on the open, and a symlink or a hard link never makes the probe
write or truncate a file elsewhere (the agent's own state included): such a name is removed (the
name only, never what it points to) and a fresh file made in its place; the disk verdict's reason
says so, and the ``health`` event of the hold carries it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from typing import Any, Dict, List, Mapping, Optional, Tuple

import psutil

from onbox.common.safepath import file_kind
from onbox.common.size import human
from onbox.health.config import DiskConfig
from onbox.health.verdict import Action, Context, Reading, Verdict, ok, unknown

PRUNE_EVERY = 60.0  # seconds between free_room requests while above prune_at
GROWS_INTO = ("run", "ckpt")  # labels whose directory may not exist yet: read where it will be
# Where a new checkpoint takes room: the checkpoints, and the run dir (the sealer's staging). Only
# their filesystems hold the saves back or ask the sealer for room: a full cache on another disk
# must not leave the run without checkpoints, and pruning the checkpoints frees nothing there.
CKPT_LABELS = frozenset(GROWS_INTO)
# A name opened this way is never followed (a symlink: ELOOP) and never waited on (a FIFO with no
# reader: ENXIO, as a socket gives; with one, fstat tells). O_TRUNC is not used: a file is cut
# only once fstat has shown it is the probe's own.
_OWN = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_OWN_ERRNOS = (errno.ELOOP, errno.ENXIO, errno.EISDIR)


def _regular(path: str) -> bool:
    """Whether ``path`` itself (never what a symlink there names) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _open_own(path: str) -> Tuple[int, Optional[str]]:
    """A write descriptor of the probe's own file ``path`` (made when missing), and what was found
    under the name instead and replaced (None when nothing was). Raises OSError when the name
    cannot be made a regular file of the probe's (a directory there, a name planted again)."""
    try:
        fd = os.open(path, _OWN, 0o600)
    except OSError as e:
        if e.errno not in _NOT_OWN_ERRNOS:
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return fd, None
        os.close(fd)
    st = os.lstat(path)
    kind = file_kind(st.st_mode) or f"a hard link ({st.st_nlink} names of one file)"
    os.unlink(path)  # the name only: a symlink's target and a hard link's other names stay
    return os.open(path, _OWN | os.O_EXCL, 0o600), f"{path} was {kind}: replaced by a fresh file"


class Fs:
    """One filesystem's reading: the labels on it, and bytes and inodes used."""

    def __init__(self, path: str, labels: List[str]) -> None:
        self.path = path
        self.labels = labels
        self.total = self.used = self.free = 0
        self.inodes = self.inodes_free = 0

    def read(self) -> None:
        du = psutil.disk_usage(self.path)
        self.total, self.used, self.free = du.total, du.used, du.free
        st = os.statvfs(self.path)
        self.inodes, self.inodes_free = st.f_files, st.f_ffree

    @property
    def bytes_used(self) -> float:
        room = self.used + self.free  # as df counts: root's reserved blocks are not room
        return self.used / room if room else 0.0

    @property
    def inodes_used(self) -> Optional[float]:
        """None on filesystems without an inode limit (f_files 0: btrfs, some overlays)."""
        if self.inodes <= 0:
            return None
        return (self.inodes - self.inodes_free) / self.inodes

    @property
    def worst(self) -> float:
        return max(self.bytes_used, self.inodes_used or 0.0)

    @property
    def short_of_inodes(self) -> bool:
        return (self.inodes_used or 0.0) > self.bytes_used

    def doc(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "labels": list(self.labels),
            "bytes_used": round(self.bytes_used, 4),
            "inodes_used": None if self.inodes_used is None else round(self.inodes_used, 4),
            "free_bytes": self.free,
            "total_bytes": self.total,
        }


def _existing(path: str, grows: bool) -> Optional[str]:
    """``path`` when it exists; for a directory the job makes later (``grows``) the nearest
    existing parent, where its files will land; else None (skipped)."""
    path = os.path.abspath(path)
    while True:
        if os.path.exists(path):
            return path
        parent = os.path.dirname(path)
        if not grows or parent == path:
            return None
        path = parent


class DiskProbe:
    name = "disk"

    def __init__(
        self, cfg: DiskConfig, paths: Mapping[str, str], hold_file: str, has_store: bool
    ) -> None:
        self.cfg = cfg
        self.paths = dict(paths)
        self.hold_file = hold_file
        self.spare = hold_file + ".spare"
        self.has_store = has_store
        self._pruned_at: Optional[float] = None  # when free_room was last asked, while above
        self._hold_error: Optional[str] = None
        self._replaced: Optional[str] = None  # a name found not to be the probe's own file
        self._make_spare()

    # ---- the hold file
    def _make_spare(self) -> None:
        try:
            if not os.path.lexists(self.hold_file):
                os.close(self._own(self.spare))
        except OSError:  # no room even now: holding tries a fresh file instead
            pass

    def _own(self, path: str) -> int:
        """``_open_own``, with what it replaced kept for the next verdict's reason."""
        fd, replaced = _open_own(path)
        if replaced is not None:
            self._replaced = replaced
        return fd

    def _write_own(self, path: str, doc: str) -> None:
        fd = self._own(path)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, doc.encode())
        finally:
            os.close(fd)

    def held(self) -> bool:
        return os.path.exists(self.hold_file)

    def _hold(self, why: str, wall: float) -> None:
        """Create the hold file (a small JSON saying why and when); the spare is renamed into
        place, so that a disk out of inodes can still be told to hold."""
        doc = json.dumps({"reason": why, "since": wall}) + "\n"
        self._hold_error = None
        try:
            if os.path.lexists(self.spare):
                try:
                    self._write_own(self.spare, doc)
                except OSError:  # no byte left: an empty hold file still holds
                    pass
            if _regular(self.spare):  # (not one replaced and then lost for want of an inode)
                os.replace(self.spare, self.hold_file)
            else:
                self._write_own(self.hold_file, doc)
        except OSError as e:
            self._hold_error = f"the hold file {self.hold_file} could not be made: {e}"

    def _release(self) -> None:
        try:
            os.replace(self.hold_file, self.spare)  # kept as the next hold's inode
        except FileNotFoundError:
            pass
        except OSError:
            try:
                os.unlink(self.hold_file)
            except OSError:
                pass

    # ---- one tick
    def _read(self) -> Tuple[List[Fs], List[str]]:
        """The watched filesystems (deduplicated by device), and the errors of those unread."""
        by_dev: Dict[int, Fs] = {}
        errors: List[str] = []
        for label, path in self.paths.items():
            where = _existing(path, label in GROWS_INTO)
            if where is None:
                continue
            try:
                dev = os.stat(where).st_dev
                fs = by_dev.get(dev)
                if fs is None:
                    fs = Fs(where, [])
                    fs.read()
                    by_dev[dev] = fs
                fs.labels.append(label)
            except OSError as e:
                errors.append(f"{label} ({path}): {e}")
        return list(by_dev.values()), errors

    def check(self, ctx: Context) -> Reading:
        filesystems, errors = self._read()
        if not filesystems:
            why = "; ".join(errors) or "none of the watched paths exists"
            return Reading(unknown(self.name, f"no watched filesystem could be read: {why}"))
        sample: Dict[str, Any] = {}
        for fs in filesystems:
            for label in fs.labels:
                sample[f"{label}.bytes_used"] = round(fs.bytes_used, 4)
                sample[f"{label}.inodes_used"] = (
                    None if fs.inodes_used is None else round(fs.inodes_used, 4)
                )
                sample[f"{label}.free_bytes"] = fs.free
        worst = max(filesystems, key=lambda fs: fs.worst)
        ours = [fs for fs in filesystems if CKPT_LABELS.intersection(fs.labels)] or filesystems
        fullest_ours = max(ours, key=lambda fs: fs.worst)
        actions = self._prune(fullest_ours, ctx.now)
        self._watermarks(fullest_ours, ctx.wall)
        verdict = self._verdict(worst, filesystems, ctx)
        return Reading(verdict, sample, actions)

    def _prune(self, worst: Fs, now: float) -> List[Action]:
        """free_room once per crossing of prune_at, then at most every PRUNE_EVERY."""
        if worst.worst < self.cfg.prune_at or not self.has_store:
            self._pruned_at = None
            return []
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY:
            return []
        self._pruned_at = now
        return [Action("free_room", f"{worst.path} is {_pct(worst.worst)} used")]

    def _watermarks(self, worst: Fs, wall: float) -> None:
        if worst.worst >= self.cfg.hold_at:
            if not self.held():
                self._hold(_what(worst, self.cfg.warn_at), wall)
        elif worst.worst < self.cfg.warn_at and self.held():
            self._release()

    def _verdict(self, worst: Fs, filesystems: List[Fs], ctx: Context) -> Verdict:
        v = self._verdict_of(worst, filesystems, ctx)
        if self._replaced is not None:  # said in this tick's verdict (the hold's event), once
            v = dataclasses.replace(v, reason=f"{v.reason}; {self._replaced}")
            self._replaced = None
        return v

    def _verdict_of(self, worst: Fs, filesystems: List[Fs], ctx: Context) -> Verdict:
        data = {"filesystems": [fs.doc() for fs in filesystems], "hold": self.held()}
        short = sorted(
            (fs for fs in filesystems if fs.worst >= self.cfg.warn_at), key=lambda fs: -fs.worst
        )
        if short:  # short[0] is ``worst``
            full = worst.worst >= self.cfg.hold_at
            reason = "; ".join(_what(fs, self.cfg.warn_at) for fs in short)
            if self.held():
                reason += "; new local checkpoints are held back"
            elif self._hold_error:
                reason += "; " + self._hold_error
            return Verdict(
                self.name,
                "alert" if full else "warn",
                f"{_short_of(worst)}_{'full' if full else 'high'}",
                reason,
                remedy="; ".join(_remedy(fs, self.cfg.warn_at) for fs in short),
                klass="permanent" if full else "transient",
                data=data,
                about=tuple(f"{fs.path}: {_short_of(fs)}" for fs in short),
            )
        budget = self._budget(filesystems, ctx)
        if budget is not None:
            need, fs = budget
            return Verdict(
                self.name,
                "warn",
                "budget",
                f"{fs.path} ({', '.join(fs.labels)}) has {human(fs.free)} free; the "
                f"checkpoints need {human(need)}",
                remedy=_remedy(fs, self.cfg.warn_at),
                klass="transient",
                data=data,
            )
        return ok(
            self.name,
            f"fullest: {worst.path} ({', '.join(worst.labels)}) {_pct(worst.bytes_used)} of "
            f"bytes, {_pct(worst.inodes_used)} of inodes used",
            **data,
        )

    def _budget(self, filesystems: List[Fs], ctx: Context) -> Optional[Tuple[int, Fs]]:
        """(bytes needed, the checkpoint filesystem) when it has less free than the budget."""
        fs = next((f for f in filesystems if "ckpt" in f.labels), None)
        if fs is None:
            return None
        ckpt = ctx.sealing.ckpt_bytes if ctx.sealing is not None else None
        need = self.cfg.scratch + (2 * ckpt if ckpt else 0)
        return (need, fs) if fs.free < need else None

    def close(self) -> None:
        pass


def _pct(x: Optional[float]) -> str:
    return "no limit" if x is None else f"{x * 100:.0f}%"  # no inode limit: btrfs


def _short_of(fs: Fs) -> str:
    return "inodes" if fs.short_of_inodes else "bytes"


def _both(fs: Fs, warn_at: float) -> bool:
    """Whether bytes and inodes are both past ``warn_at``: neither is "to spare"."""
    return min(fs.bytes_used, fs.inodes_used or 0.0) >= warn_at


def _what(fs: Fs, warn_at: float) -> str:
    """Which path, which labels, what ran out: inodes with bytes to spare is said as such."""
    where = f"{fs.path} ({', '.join(fs.labels)})"
    inodes = f"inodes {_pct(fs.inodes_used)} used ({fs.inodes - fs.inodes_free} of {fs.inodes})"
    size = f"{_pct(fs.bytes_used)} of bytes used ({human(fs.free)} free)"
    if _both(fs, warn_at):
        return f"{where}: {inodes} and {size}"
    if fs.short_of_inodes:
        return (
            f"{where}: {inodes} with bytes to spare ({_pct(fs.bytes_used)} used, "
            f"{human(fs.free)} free): new files fail although df -h shows room"
        )
    return f"{where}: {size}"


def _remedy(fs: Fs, warn_at: float) -> str:
    inodes = (
        f"delete many small files on {fs.path} (caches, logs, extracted datasets; "
        f"`df -i {fs.path}`, then `du -x --inodes -d 2 {fs.path} | sort -n | tail`) or move "
        "them to a filesystem with inodes to spare"
    )
    size = (
        f"free space on {fs.path} (`du -xh -d 2 {fs.path} | sort -h | tail`), keep fewer local "
        "checkpoints ([checkpoint] keep), or put [checkpoint] dir on a bigger disk"
    )
    if _both(fs, warn_at):
        return f"{inodes}; {size}"
    return inodes if fs.short_of_inodes else size
