"""Putting the newest verified checkpoint back on a box that lacks it (a fresh box).

LATEST names a MANIFEST; every file it lists is downloaded into a staging directory rgt makes
under the target (``.rgt-restore-*``, 0700, a hidden name the sealer skips), each created there
with O_EXCL and its sha256 checked; only when all of them match are they renamed into place, at
the same relative path under RGT_CKPT_DIR they were sealed from, so the script's own resume logic
finds them. A checkpoint whose MANIFEST or files are missing or corrupt in the store (a path rgt
could not have written, a symlink in a ``file://`` store, a wrong sha256) is quarantined (kept,
flagged, reported) and the previous one is tried.

The target is the caller's, and is not trusted either: every name is walked under it one
directory at a time without following symlinks (onbox.safepath), and a symlink there, on the
way or under a final name, is refused (UnsafePath, exit 6) before anything is downloaded. That
is a fault of the box, not of the store, so it is raised, not quarantined.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from onbox import manifest as mf
from onbox.durable import fsync_dir
from onbox.errors import HostError, IntegrityError
from onbox.safepath import (
    UnsafePath,
    lstat_beneath,
    open_beneath,
    replace_beneath,
    symlink_error,
)
from onbox.stores.base import Store, StoreError, with_retries

STAGE_PREFIX = ".rgt-restore-"


class StoreCorrupt(IntegrityError):
    """A sealed checkpoint is damaged in the store (quarantined), not on this box."""


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
    for info in store.list(f"{run}/checkpoints/"):
        if info.key.endswith("/MANIFEST.json"):
            try:
                steps.append(int(info.key.split("/")[-2]))
            except ValueError:
                continue
    return sorted(steps)


def quarantined(store: Store, run: str) -> List[int]:
    out = []
    for info in store.list(f"{run}/quarantine/"):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(int(name[:-5]))
    return out


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
    store.put_bytes(
        mf.quarantine_key(run, step),
        json.dumps({"step": step, "reason": e.what, "at": time.time()}).encode(),
    )
    event(
        "quarantined",
        f"sealed step {step} is corrupt in the store: {e.what}; it is kept, flagged and "
        "skipped for the previous verified checkpoint",
        klass="integrity",
        remedy="look at the store; the files are left as they are",
        step=step,
    )


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
                with_retries(functools.partial(store.get_file, f["key"], tmp))
            except IntegrityError as e:  # e.g. a symlink in a file:// store
                raise StoreCorrupt(e.what, e.remedy) from None
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


def restore_latest(
    store: Store,
    run: str,
    ckpt_dir: str,
    event: Callable[..., None],
    made: Optional[List[str]] = None,
) -> Optional[Dict[str, Any]]:
    """Make sure the newest good sealed checkpoint is in ``ckpt_dir``; return its MANIFEST
    (with ``"local": abs path of its root``), or None when nothing (intact) was ever sealed.
    Directories it makes are appended to ``made``; nothing is made before a checkpoint to
    download is found."""
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(run)))
    bad = set(quarantined(store, run))
    steps = [s for s in sealed_steps(store, run) if s not in bad]
    if latest is not None:
        steps = [s for s in steps if s <= latest["step"]]
    for step in reversed(steps):
        key = mf.manifest_key(run, step)
        try:  # a symlinked or malformed MANIFEST (a NUL, '..' in a path) is the store's fault
            data = store.get_bytes(key)
            if data is None:
                raise IntegrityError(f"{key} is missing")
            doc = mf.parse_manifest(data, key)
        except IntegrityError as e:
            _quarantine(store, run, step, e, event)
            continue
        if local_matches(doc, ckpt_dir, verify=True):
            how = "already on this box"
        else:
            t0 = time.monotonic()
            try:  # an UnsafePath or HostError about the target is raised: not the store's fault
                _download(store, doc, ckpt_dir, made)
            except StoreCorrupt as e:
                _quarantine(store, run, step, e, event)
                continue
            how = f"downloaded and verified in {time.monotonic() - t0:.1f}s"
        doc["local"] = os.path.join(ckpt_dir, *doc["root"].split("/"))
        event("restored", f"checkpoint step {step} ({doc['root']}) {how}", step=step)
        return doc
    return None


__all__ = [
    "restore_latest",
    "local_matches",
    "sealed_steps",
    "check_target",
    "StoreCorrupt",
    "StoreError",
]
