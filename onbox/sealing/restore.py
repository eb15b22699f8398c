"""Putting the newest verified checkpoint back on a box that lacks it (a fresh box).

LATEST names a MANIFEST; every file it lists is downloaded into a staging directory rgt makes
under the target (``.rgt-restore-*``, 0700, a hidden name the sealer skips), each created there
with O_EXCL and its sha256 checked; only when all of them match are they renamed into place, at
the same relative path under RGT_CKPT_DIR they were sealed from, so the script's own resume logic
finds them.

Any unusable checkpoint is quarantined (kept as it is, flagged in ``quarantine/<step>.json`` with
the reason, reported) and the previous verified one is tried: a MANIFEST missing, unreadable or
malformed (a path rgt could not have written, another step's), an object missing while the store
answers, unreadable, of the wrong size or sha256, a symlink in a ``file://`` store. Only when no
verified checkpoint is left does the restore fail (``NoVerifiedCheckpoint``, exit 6), listing
every step tried and why. A store that does not answer is a different thing (restic keeps "the
download failed" apart from "the data is corrupt"): it is retried with backoff and then raised
as the StoreError it is, and nothing is quarantined, so a network blip never flags good
checkpoints. A quarantined step is never offered again: not by restore, ``rgt-agent
checkpoints``, ``rgt pull`` or status.

A restore killed midway (``restore.after_object``, onbox/common/faults.py) leaves only its staging
directory and perhaps some files already renamed into place; the next restore into the same
target removes the staging directories left there and downloads again what does not match.

The target is the caller's, and is not trusted either: every name is walked under it one
directory at a time without following symlinks (onbox.common.safepath), and a symlink there, on the
way or under a final name, is refused (UnsafePath, exit 6) before anything is downloaded. That
is a fault of the box, not of the store, so it is raised, not quarantined.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from onbox.common.durable import fsync_dir
from onbox.common.errors import HostError, IntegrityError, RgtError
from onbox.common.faults import crash_point
from onbox.common.safepath import (
    UnsafePath,
    lstat_beneath,
    open_beneath,
    replace_beneath,
    symlink_error,
)
from onbox.sealing import manifest as mf
from onbox.sealing.ledger import flag_quarantined, quarantine_reasons
from onbox.sealing.stores.base import Store, StoreError, TransientStoreError, with_retries

STAGE_PREFIX = ".rgt-restore-"
T = TypeVar("T")


class StoreCorrupt(IntegrityError):
    """A sealed checkpoint is unusable in the store (quarantined), not on this box."""


class NoVerifiedCheckpoint(IntegrityError):
    """Checkpoints were sealed, but none of them is usable. ``tried`` lists (step, reason),
    newest first, each quarantined now or before."""

    def __init__(self, run: str, url: str, tried: List[Tuple[int, str]]) -> None:
        listed = "; ".join(f"step {step}: {why}" for step, why in tried)
        super().__init__(
            f"run {run!r} has no verified checkpoint left in {url} (tried {listed})",
            "nothing was restored and nothing was trained; repair the store and remove its "
            "quarantine/<step>.json, or start under a new --name to train from scratch",
        )
        self.tried = tried


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return h.hexdigest()
        h.update(b)


def local_matches(doc: Dict[str, Any], ckpt_dir: str, verify: bool = False) -> bool:
    """Whether every file of the manifest is present locally as a regular file (with its size;
    and sha256 when ``verify``). A symlink there is no match: the download then refuses it."""
    for f in doc["files"]:
        try:
            st = lstat_beneath(ckpt_dir, f["path"])
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f["size"]:
                return False
            if verify:
                fd = open_beneath(ckpt_dir, f["path"], os.O_RDONLY | os.O_NONBLOCK)
                try:
                    if _sha256_fd(fd) != f["sha256"]:
                        return False
                finally:
                    os.close(fd)
        except (UnsafePath, OSError):
            return False
    return True


def sealed_steps(store: Store, run: str) -> List[int]:
    steps = []
    for info in store.list(mf.checkpoints_prefix(run)):
        if info.key.endswith("/MANIFEST.json"):
            try:
                steps.append(int(info.key.split("/")[-2]))
            except ValueError:
                continue
    return sorted(steps)


def in_effect(
    latest_step: Optional[int], sealed: List[int], bad: Dict[int, str]
) -> Tuple[Optional[int], Optional[str]]:
    """The step a run resumes from and ``rgt pull`` takes: the newest sealed step at or below
    LATEST's that is not quarantined; and, when that is not LATEST's own step, a sentence that
    says why (for status, checkpoints and pull to print)."""
    if latest_step is None:
        return None, None
    ok = [s for s in sealed if s <= latest_step and s not in bad]
    step = max(ok) if ok else None
    if step == latest_step:
        return step, None
    why = bad.get(latest_step, "its MANIFEST is missing")
    return step, (
        f"LATEST names step {latest_step}, which is quarantined ({why}); "
        + (
            f"step {step} is the newest verified checkpoint"
            if step is not None
            else "no verified checkpoint is left"
        )
    )


def _retried(fn: Callable[[], T]) -> T:
    """``fn`` retried with backoff while the store does not answer (TransientStoreError)."""
    return with_retries(fn)


def _unwritable(dest_dir: str, e: OSError) -> HostError:
    return HostError(
        f"cannot restore into {dest_dir}: {e.strerror or e}"
        + (f" ({e.filename})" if e.filename and e.filename != dest_dir else ""),
        "pass --to a directory this user can write (or fix the checkpoint dir's permissions)",
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
                "remove it, or restore into another directory (--to)",
            ) from None
        except OSError as e:
            raise _unwritable(dest_dir, e) from None
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise symlink_error(os.path.join(dest_dir, *f["path"].split("/")))
        if stat.S_ISDIR(st.st_mode):
            raise HostError(
                f"cannot restore {f['path']!r} into {dest_dir}: a directory is in its place",
                "remove it, or restore into another directory (--to)",
            )


def _make_dir(path: str, made: Optional[List[str]]) -> None:
    """``path`` and its missing parents, 0700 (rgt's directories are the user's alone), each
    appended to ``made``."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        if os.path.dirname(p) == p:
            break
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        if made is not None:
            made.append(d)


def _quarantine(
    store: Store, run: str, step: int, e: IntegrityError, event: Callable[..., None]
) -> None:
    """Flag ``step`` as unusable, with the reason. A store this restore may only read (the
    laptop's read-only credentials) cannot take the record: the step is still skipped here,
    and an event says it is not flagged for the next reader."""
    try:
        flag_quarantined(store, run, step, e.what)
        flagged = "it is kept, flagged in quarantine/"
    except StoreError as w:
        flagged = f"it is kept but not flagged (writing its quarantine record failed: {w.what})"
    event(
        "quarantined",
        f"sealed step {step} is unusable in the store: {e.what}; {flagged} and skipped for the "
        "previous verified checkpoint",
        klass="integrity",
        remedy="look at the store; the files are left as they are",
        step=step,
    )


def _failure(store: Store, key: str, size: Optional[int], e: StoreError, room: str) -> RgtError:
    """What a failed read of ``key`` (``size`` bytes by its MANIFEST, None for the MANIFEST
    itself) means, asked of the store itself: StoreCorrupt (the checkpoint is unusable) only
    when the store answers and shows the object missing, of another size, or there yet
    unreadable with room for it on this box; otherwise the error stands (the store does not
    answer, after the retries: nothing is known about the checkpoint), or a HostError (this
    box has no room: not the store's fault either)."""
    if isinstance(e, TransientStoreError):
        return e
    try:
        info = _retried(lambda: store.stat(key))
    except IntegrityError as ie:  # e.g. a symlink where the object should be
        return StoreCorrupt(ie.what)
    except StoreError:
        return e
    if info is None:
        return StoreCorrupt(f"{key} is missing from the store")
    if size is not None and info.size != size:
        return StoreCorrupt(f"{key}: {info.size} bytes in the store, the MANIFEST says {size}")
    try:
        st = os.statvfs(room)
        if size is not None and st.f_bavail * st.f_frsize < size:
            return HostError(
                f"no room on this box for {key} ({size} bytes) in {room}: {e.what}",
                "free space on the checkpoint dir's disk, then start again",
            )
    except OSError:
        pass
    return StoreCorrupt(f"{key} cannot be read: {e.what}")


def _clear_stale_stages(dest_dir: str) -> None:
    """Remove the staging directories a killed restore left in ``dest_dir``. They hold only
    copies of store objects under rgt's own hidden names (never the only copy of anything); a
    symlink or a file under such a name is not rgt's and is left alone."""
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


def _download(
    store: Store, doc: Dict[str, Any], dest_dir: str, made: Optional[List[str]] = None
) -> None:
    """Every file of ``doc`` into ``dest_dir``: staged, verified, then renamed into place. The
    directories it makes are appended to ``made`` (for a caller that undoes a failed restore).
    StoreCorrupt for a file the store holds damaged; UnsafePath or HostError for the target."""
    for f in doc["files"]:
        if f["path"].startswith(STAGE_PREFIX):  # would land in the staging dir, then vanish
            raise StoreCorrupt(f"the MANIFEST lists {f['path']!r}, a name of rgt's own staging")
    check_target(doc, dest_dir)
    _clear_stale_stages(dest_dir)
    try:
        _make_dir(dest_dir, made)
        stage = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=dest_dir)
    except OSError as e:
        raise _unwritable(dest_dir, e) from None
    try:
        for i, f in enumerate(doc["files"]):
            # A flat name per file: nothing the store supplies names anything under the stage.
            tmp = os.path.join(stage, str(i))
            try:
                _retried(functools.partial(store.get_file, f["key"], tmp))
            except IntegrityError as e:  # e.g. a symlink in a file:// store
                raise StoreCorrupt(e.what, e.remedy) from None
            except StoreError as e:
                raise _failure(store, f["key"], f["size"], e, stage) from None
            try:
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                raise _unwritable(dest_dir, e) from None
            try:
                size = os.fstat(fd).st_size
                got = _sha256_fd(fd)
            finally:
                os.close(fd)
            if size != f["size"] or got != f["sha256"]:
                raise StoreCorrupt(
                    f"{f['key']}: {size} bytes sha256 {got[:12]} in the store, the MANIFEST says "
                    f"{f['size']} bytes {f['sha256'][:12]}"
                )
            crash_point("restore.after_object")
        dirs = set()
        for i, f in enumerate(doc["files"]):
            try:
                replace_beneath(stage, str(i), dest_dir, f["path"], dir_mode=0o700, made=made)
            except OSError as e:
                raise _unwritable(dest_dir, e) from None
            dirs.add(os.path.dirname(os.path.join(dest_dir, *f["path"].split("/"))))
        for d in sorted(dirs, key=len, reverse=True):
            fsync_dir(d)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _read_latest(store: Store, run: str, event: Callable[..., None]) -> Optional[int]:
    """LATEST's step; None when there is none. A LATEST that is not rgt's JSON bounds nothing:
    every sealed step is a candidate, newest first, and an event says so."""
    try:
        latest = mf.parse_latest(_retried(lambda: store.get_bytes(mf.latest_key(run))))
    except IntegrityError as e:
        event(
            "latest_unreadable",
            f"{mf.latest_key(run)} is unusable ({e.what}); trying the sealed checkpoints newest "
            "first",
            klass="integrity",
            remedy="the sealer writes LATEST again at its next checkpoint",
        )
        return None
    return None if latest is None else int(latest["step"])


def _manifest(store: Store, run: str, step: int) -> Dict[str, Any]:
    """The checked MANIFEST of ``step``: StoreCorrupt when it is missing, unreadable, malformed
    or another step's; a StoreError when the store does not answer."""
    key = mf.manifest_key(run, step)
    try:  # a symlinked or malformed MANIFEST (a NUL, '..' in a path) is the store's fault
        data = _retried(lambda: store.get_bytes(key))
    except IntegrityError as e:
        raise StoreCorrupt(e.what) from None
    except StoreError as e:
        raise _failure(store, key, None, e, ".") from None
    if data is None:
        raise StoreCorrupt(f"{key} is missing")
    try:
        doc = mf.parse_manifest(data, key)
    except IntegrityError as e:
        raise StoreCorrupt(e.what) from None
    if doc["step"] != step:
        raise StoreCorrupt(f"{key} is the MANIFEST of step {doc['step']}, not of step {step}")
    return doc


def restore_latest(
    store: Store,
    run: str,
    ckpt_dir: str,
    event: Callable[..., None],
    made: Optional[List[str]] = None,
) -> Optional[Dict[str, Any]]:
    """Make sure the newest verified sealed checkpoint is in ``ckpt_dir``; return its MANIFEST
    (with ``"local"``: abs path of its root, and ``"skipped"``: the newer steps found unusable,
    each {step, reason}, when there were any), or None when nothing was ever sealed.

    Each unusable checkpoint on the way is quarantined and the previous one tried; when
    checkpoints were sealed but none is usable, NoVerifiedCheckpoint lists what was tried. A
    store that does not answer raises its StoreError (nothing quarantined); a target that is
    refused raises UnsafePath or HostError. Directories it makes are appended to ``made``;
    nothing is made before a checkpoint to download is found."""
    latest = _read_latest(store, run, event)
    bad = quarantine_reasons(store, run)
    steps = set(_retried(lambda: sealed_steps(store, run)))
    if latest is not None:  # LATEST's own step is tried even when its MANIFEST is not listed
        steps = {s for s in steps if s <= latest} | {latest}
    tried: List[Tuple[int, str]] = []
    for step in sorted(steps, reverse=True):
        if step in bad:
            tried.append((step, f"quarantined before: {bad[step]}"))
            continue
        try:
            doc = _manifest(store, run, step)
            if local_matches(doc, ckpt_dir, verify=True):
                how = "already on this box"
            else:
                t0 = time.monotonic()
                # An UnsafePath or HostError about the target is raised: not the store's fault.
                _download(store, doc, ckpt_dir, made)
                how = f"downloaded and verified in {time.monotonic() - t0:.1f}s"
        except StoreCorrupt as e:
            _quarantine(store, run, step, e, event)
            tried.append((step, e.what))
            continue
        doc["local"] = os.path.join(ckpt_dir, *doc["root"].split("/"))
        if tried:
            how += "; newer, unusable: " + ", ".join(f"step {s}" for s, _ in tried)
            doc["skipped"] = [{"step": s, "reason": why} for s, why in tried]
        event("restored", f"checkpoint step {step} ({doc['root']}) {how}", step=step)
        return doc
    if tried:
        raise NoVerifiedCheckpoint(run, store.url, tried)
    return None


__all__ = [
    "restore_latest",
    "NoVerifiedCheckpoint",
    "in_effect",
    "local_matches",
    "sealed_steps",
    "check_target",
    "StoreCorrupt",
    "StoreError",
]
