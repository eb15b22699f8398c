"""Putting the newest verified checkpoint back on a box that lacks it (a fresh box).

LATEST names a MANIFEST; its files are put in place by onbox.sealing.fetch (downloaded in
parallel into a staging directory under the target, each hashed while written and verified;
only when all of them match are they renamed into place, at the same relative path under
RGT_CKPT_DIR they were sealed from, so the script's own resume logic finds them). Then the
symlinks of the dir that led to it when it was sealed (Lightning's ``last.ckpt``: the MANIFEST's
``links``) are made again where their name is free (onbox/sealing/dirlinks.py).

Any unusable checkpoint is quarantined (kept as it is, flagged in ``quarantine/<step>.json`` with
the reason, reported) and the previous verified one is tried: a MANIFEST missing, unreadable or
malformed (a path rgt could not have written, another step's), an object missing while the store
answers, unreadable, of the wrong size or sha256, a symlink in a ``file://`` store. Only when no
verified checkpoint is left does the restore fail (``NoVerifiedCheckpoint``, exit 6), listing
every step tried and why. A store that does not answer is a different thing (restic keeps "the
download failed" apart from "the data is corrupt"): it is retried with backoff and then raised
as the StoreError it is, and nothing is quarantined, so a network blip never flags good
checkpoints. A download that moves nothing for the job file's ``[store] stall`` (a store gone
silent mid-body) ends the same way, as RestoreStalled (onbox/sealing/stall.py). A quarantined
step is never offered again: not by restore, ``rgt-agent checkpoints``, ``rgt pull`` or status.

A restore killed midway (``restore.after_object``, onbox/common/faults.py) leaves only its staging
directory and perhaps some files already renamed into place; the next restore into the same
target removes the staging directories left there and downloads again what does not match.

The target is the caller's, and is not trusted either (fetch.check_target): a symlink there,
on the way or under a final name, is refused (UnsafePath, exit 6) before anything is
downloaded. That is a fault of the box, not of the store, so it is raised, not quarantined.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from onbox.common.durable import sha256_fd
from onbox.common.errors import IntegrityError
from onbox.common.safepath import (
    lstat_beneath,
    open_beneath,
    open_regular,
    safe_join,
)
from onbox.common.storeurl import RESTORE_STALL
from onbox.sealing import dirlinks
from onbox.sealing import manifest as mf
from onbox.sealing.fetch import StoreCorrupt, check_target, failure, fetch
from onbox.sealing.fetch import retried as _retried
from onbox.sealing.quarantine import flag_quarantined, quarantine_reasons
from onbox.sealing.stall import STALL_SETTING
from onbox.sealing.stores.base import Store, StoreError


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


def local_matches(doc: Dict[str, Any], ckpt_dir: str, verify: bool = False) -> bool:
    """Whether every file of the manifest is present locally as a regular file (with its size;
    and sha256 when ``verify``). A symlink under a file's name (the directories on the way are
    never followed) matches when the regular file it leads to does: the job made it in its
    checkpoint, and the sealer sealed what it leads to (onbox/sealing/discovery.py), so on the
    box that sealed it the checkpoint is there as it is. Nothing is written through it: when
    it does not match, the download refuses it (check_target)."""
    for f in doc["files"]:
        try:
            st = lstat_beneath(ckpt_dir, f["path"])
            real = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(safe_join(ckpt_dir, f["path"]))
                st = os.stat(real)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f["size"]:
                return False
            if verify:
                if real is None:
                    fd = open_beneath(ckpt_dir, f["path"], os.O_RDONLY | os.O_NONBLOCK)
                else:
                    fd = open_regular(real)
                try:
                    if sha256_fd(fd)[0] != f["sha256"]:
                        return False
                finally:
                    os.close(fd)
        except (IntegrityError, OSError):  # UnsafePath, NotRegularFile: no match
            return False
    return True


def sealed_steps(store: Store, run: str) -> List[int]:
    """The steps whose MANIFEST is in the store (``RUN/checkpoints/<step>/MANIFEST.json``
    exactly: a checkpoint's own file of that name lies deeper and names no step)."""
    found = (mf.manifest_step(run, info.key) for info in store.list(mf.checkpoints_prefix(run)))
    return sorted(step for step in found if step is not None)


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
        raise failure(store, key, None, e, ".") from None
    if data is None:
        raise StoreCorrupt(f"{key} is missing")
    try:
        doc = mf.parse_manifest(data, key)
    except IntegrityError as e:
        raise StoreCorrupt(e.what) from None
    if doc["step"] != step:
        raise StoreCorrupt(f"{key} is the MANIFEST of step {doc['step']}, not of step {step}")
    return doc


def _candidates(store: Store, run: str, latest: Optional[int]) -> Iterator[int]:
    """The steps to try, newest first: LATEST's own (tried even when its MANIFEST is not
    listed), then the sealed steps below it. The store is listed only when LATEST's step is
    unusable or there is no LATEST: a listing is every object of every kept checkpoint, pages
    of them for a checkpoint of many files, and the common case never needs it."""
    if latest is not None:
        yield latest
    steps = _retried(lambda: sealed_steps(store, run))
    for step in sorted(steps, reverse=True):
        if latest is None or step < latest:
            yield step


def restore_latest(
    store: Store,
    run: str,
    ckpt_dir: str,
    event: Callable[..., None],
    made: Optional[List[str]] = None,
    stall: float = RESTORE_STALL,
    longer: str = STALL_SETTING,
) -> Optional[Dict[str, Any]]:
    """Make sure the newest verified sealed checkpoint is in ``ckpt_dir``; return its MANIFEST
    (with ``"local"``: abs path of its root, and ``"skipped"``: the newer steps found unusable,
    each {step, reason}, when there were any), or None when nothing was ever sealed.

    Each unusable checkpoint on the way is quarantined and the previous one tried; when
    checkpoints were sealed but none is usable, NoVerifiedCheckpoint lists what was tried. A
    store that does not answer raises its StoreError (nothing quarantined); a target that is
    refused raises UnsafePath or HostError; a download that moves nothing for ``stall``
    seconds raises RestoreStalled (a TransientStoreError: nothing quarantined, nothing put in
    place), saying that ``longer`` (the setting that gave the bound) gives it longer.
    Directories it makes are appended to ``made``; nothing is made before a checkpoint to
    download is found."""
    # LATEST and the quarantine records are read side by side: every round trip to a remote
    # store is paid before the first byte of the checkpoint comes.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rgt-restore-q") as pool:
        bad_f = pool.submit(quarantine_reasons, store, run)
        latest = _read_latest(store, run, event)
        bad = bad_f.result()
    tried: List[Tuple[int, str]] = []
    for step in _candidates(store, run, latest):
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
                fetch(store, doc, ckpt_dir, made, stall, longer)
                how = f"downloaded and verified in {time.monotonic() - t0:.1f}s"
        except StoreCorrupt as e:
            _quarantine(store, run, step, e, event)
            tried.append((step, e.what))
            continue
        # Only now, its files verified in place: the dir's links to it (Lightning's last.ckpt).
        # A filesystem that refuses a symlink (some FUSE mounts) keeps the restore: the files
        # are in place; the event says the links are missing, so a resume through them looks.
        try:
            links = dirlinks.said(*dirlinks.make(doc.get("links", []), ckpt_dir))
        except OSError as e:
            links = f"its links could not be made again ({e}): a resume through them starts over"
        if links:
            how += f"; {links}"
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
