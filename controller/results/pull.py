"""``rgt pull``: bring a run's newest sealed state to the laptop, verified, resumable.

What is pulled is the run's newest *sealed* state, never a file that is still being written:

- with a store: LATEST.json names a MANIFEST (files with path, size, sha256, key); when the run
  is done, DONE.json adds its outputs and logs; when it ended FAILED or STOPPED (no DONE.json),
  ENDED.json adds its job's logs, which its agent sealed as it let go of the run (redacted
  where they hold a secret, onbox/agent/endlogs.py), so a failed job's log outlives its box;
  and each epoch's log document (``logs/e<epoch>.json``) adds the logs that agent sealed (a
  preempted box's too, in its grace), so every box of the run that sealed its logs is pulled.
  ``--from store`` reads documents and files from the store with the laptop's credentials.
  ``--from box`` reads them from the box over ssh: for a ``file://`` store (a mount on the
  box) the documents and files are the store's, on the box;
  for ``s3://``/``hf://`` the documents come from the store (the source of truth for what is
  sealed) and the bytes from the box's own copies (its checkpoint dir, the job's workdir, the
  run's logs), each checked against the store's sha256; but a log DONE.json marks ``redacted``
  (the box's own log holds a secret, the store has a copy with it masked) comes from the store
  whatever ``--from`` says, verified the same way, and when the store cannot give it the pull
  stops and says so: the box's raw log is never taken in its place. A log named by its epoch,
  or one ENDED.json lists, comes from the store as well (it may be an earlier box's attempt
  whose number this box's own log now bears). ``auto`` is the store when
  the laptop can read it (``s3://``, ``hf://``, or ``file://`` with a ``local`` target), else
  the box; for a run ``rgt down`` took off its box (its record kept for the store,
  controller/results/settle.py) it is the store, and ``--from box`` is refused (exit 8).
- without a store (``--from box`` only): when the run is no longer live (its agent reports a
  terminal state, so no file is being written), every file in its checkpoint dir (hidden and
  temporary names skipped, as the sealer skips them), every file of its outputs (hidden and
  temporary names too, as the completion seal takes them: ``out/.hydra/config.yaml``) and its
  job logs, with sha256 computed on the box at pull time. A declared output or the checkpoint
  dir that is itself a symlink to a directory (linked to a data disk) is followed, as the
  completion seal follows an output; nothing under it is (controller/shell/boxfiles.sh). A
  live run without a store is refused: stop it first; a run that has ended is pulled once its
  agent has let go of it. A job's log that holds a secret is taken as the redacted copy the
  agent wrote next to it when it let go (``attempts/NNNN/output.redacted.log``,
  onbox/agent/sealservice.py ``redact_box_logs``), never as is; the receipt marks it
  ``redacted``.

A run with a store that has nothing sealed (no LATEST.json, DONE.json, ENDED.json nor log
document: its job failed or was stopped before its first checkpoint, and its agent has not yet
let go) is pulled as that: no file, and a receipt that records that nothing was sealed
(controller/results/receipt.py), which ``rgt down`` takes only while the store still has
nothing sealed. Only a store that holds the run's epoch (taken by its agent
before the job starts) is said to have nothing sealed: one with no trace of the run is likely
not the box's store (a wrong bucket, prefix or directory), and stops the pull (NotFound).

Layout under DEST: ``checkpoints/<path as sealed, relative to RGT_CKPT_DIR>``,
``outputs/<path>``, ``logs/e<epoch>/attempt-NNNN.log`` (the epoch of the agent that sealed
it: two boxes' logs of attempt 1 are two files; ``logs/attempt-NNNN.log`` for a log sealed before
epochs named them, or pulled from a box without a store), and ``.rgt-receipt.json``
(controller/results/receipt.py). The checkpoint dir's links the MANIFEST records (Lightning's
``last.ckpt``) are made in ``checkpoints/`` after the files, relative, as the box's restore makes
them (onbox/sealing/dirlinks.py); one from an older pull is moved on, a file is never replaced.
Without a store, the links in the box's checkpoint dir, at its top or below it, whose target
(judged by name from the link's own directory, where it really is when the checkpoint dir is
a link) is a checkpoint file pulled or a directory of them are made the same way, each in its
own directory (made for it where no file pulled is in it); every other link the box holds (out
of the dir, to nothing pulled, in the outputs) is left out and named in the receipt's
``left_out`` (controller/results/boxlinks.py).

Every file lands first under ``DEST/.rgt-part/`` (named by its store key or its path on the
box), so nothing unverified ever has a final name.

The box is untrusted input (and so is a store): every name it supplies, a MANIFEST path, a key,
a line of ``find``, ``ckpt_dir``/``workdir``/``outputs`` in its ``spec.json``, becomes a staging
or a final name only through onbox.common.safepath (no absolute path, no '..', no NUL or backslash,
length caps), checked before anything is created on the laptop; a name that fails is an
IntegrityError (exit 6) naming it. Files are created with O_EXCL and opened with O_NOFOLLOW in
the staging directory rgt made (0700, its own), and renamed into place through directory
descriptors walked without following symlinks: a symlink in DEST, on the way to a final name or
under it, is refused (exit 6), never written through. A pull that is killed and started again
continues: from the box, rsync (``--inplace``, delta transfer against the partial copy) sends
only what is missing and skips finished files; from the store, a file whose partial copy
already has the right size and sha256 is not downloaded again (the store interface has no
byte ranges, so an unfinished file is downloaded again whole). A download from the store that
moves no byte for the run's ``[store] stall`` (5 min by default, as the box's restore: a store
that stopped answering mid-body, a hung mount), or for `rgt pull --stall S`, ends as a transient
store error (exit 14), nothing placed; so does a read of the store that does not answer as
long. The store is read where the box writes it (its recorded endpoint, controller/runstore.py).

Verification, before any file gets its final name: each file's size and sha256 against the
manifest (a mismatch is fetched fresh once more, then it is an IntegrityError naming the file);
then each file of a known format is opened as its framework would: ``.safetensors`` (the
header parsed, every tensor's offsets inside the file, contiguous, sized by dtype and shape),
torch files ``.pt``/``.pth``/``.bin``/``.ckpt`` (``torch.load(weights_only=True,
map_location="cpu", mmap=True)``, torch imported only then; without torch on the laptop they
are "checked by sha256 only", said so in the receipt). Then the old receipt is removed (DEST's,
and the laptop's copy when it is of this DEST: that of a pull into another --to stays), every
file is renamed into place (fsynced, directories fsynced), and the receipt is written last. A
DEST that holds an older pull of the run keeps that pull's files this one does not replace (a
checkpoint the job has since removed, or all of them where nothing is sealed now): the receipt
names them as ``not_covered`` (destination.not_covered), so none passes for this pull's.

The hashing and the fsync of each file overlap the transfer of the next ones. From the store,
several files are downloaded at once, each hashed while it is written and fsynced once (the
agent's restore does the same, onbox/sealing/fetch.py), and that hash is the one checked. From
the box, a file is hashed and fsynced as soon as its transport is done with it (rsync: once it
has logged a later file, or exited). Either hash is used only if the file cannot have changed
since (the transport did not write it again, and its size, mtime, ctime and inode are
unchanged); otherwise it is hashed again after the transfer. A pull thus ends shortly after its
last byte arrives (the hashes of the last files), instead of after a hash and an fsync of
everything.

This module is the orchestration: staging, verification, the receipt; destination.py owns DEST
(its checks, the lock, the staging directory, placing). What is sealed
is read by controller/results/sealed.py (documents.py, boxdocs.py, boxfiles.py; entries.py
checks every name), the bytes come by transport.py, hashing.py hashes them while they come,
loadcheck.py opens them as their frameworks would, progress.py reports.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Set, Tuple

from controller.registry import RunRecord
from controller.remote import Remote, open_remote
from controller.results import destination
from controller.results.entries import STAGE, Entry, Sealed, stage_path
from controller.results.hashing import HASHERS, Checker, file_sha
from controller.results.loadcheck import check_format
from controller.results.progress import Monitor, Progress, ProgressFn, terminal_progress
from controller.results.receipt import (
    FileRecord,
    Receipt,
    write_receipt,
)
from controller.results.sealed import covers_newest, newest_sealed, read_sealed, resolve_source
from controller.results.transport import fetcher
from controller.runstore import run_store_stall
from onbox.common.errors import IntegrityError
from onbox.common.safepath import open_dir, unlink_beneath
from onbox.sealing import dirlinks
from onbox.sealing.stores.base import target_error

# What callers of ``rgt pull`` import from here (the CLI, the tests), owned by the modules above.
__all__ = [
    "Progress",
    "ProgressFn",
    "Receipt",
    "covers_newest",
    "newest_sealed",
    "pull",
    "read_sealed",
    "terminal_progress",
]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("remote-gpu-trainer")
    except Exception:
        return ""


def _mismatch(stage_dir: str, e: Entry) -> Optional[str]:
    """None when the temporary copy of ``e`` has its size and sha256, else what it has."""
    path = stage_path(stage_dir, e)
    try:
        size, sha = file_sha(path)
    except FileNotFoundError:
        return "missing"
    if size == e.size and sha == e.sha256:
        return None
    return f"{size} bytes sha256 {sha[:12]}"


def _drop(stage_dir: str, e: Entry) -> None:
    unlink_beneath(stage_dir, e.stage, "staging name")


def pull(
    rec: RunRecord,
    dest: str,
    source: str = "auto",
    progress: Optional[ProgressFn] = None,
    *,
    bwlimit: Optional[int] = None,
    transport: Optional[str] = None,
    remote: Optional[Remote] = None,
    home: Optional[str] = None,
    stall: Optional[float] = None,
    results: Optional[str] = None,
) -> Receipt:
    """Pull ``rec``'s newest sealed state into ``dest``, verify it, write the receipt.

    ``source``: "box", "store" or "auto" (module docstring). ``bwlimit``: KiB/s for rsync from
    the box. ``transport`` (box only): "rsync" or "stream" (``tail -c +N`` over ssh, resumable
    too); by default rsync when both ends have it, else stream. ``remote``: an open Remote to
    the box (else one is opened and closed here). ``home``: the laptop's state dir (default
    controller_home()). ``stall`` (`rgt pull --stall`): a read of the store that does not
    answer this long ends as StoreHung, a download from it that moves no byte this long as
    RestoreStalled (both exit 14); by default the run's ``[store] stall`` as recorded.
    ``results``: rgt's results directory ``dest`` lies in (`rgt pull` without --to), which gets
    its ``.gitignore`` when ``dest`` is made (destination.make_dest).
    Raises IntegrityError (exit 6) naming the files that do not match; then nothing has a
    final name and no receipt is written."""
    where = resolve_source(rec, source)
    own = remote is None and where == "box"
    if own:
        remote = open_remote(rec.target)
    try:
        sealed = read_sealed(rec, where, remote, stall)
        dest = os.path.abspath(dest)
        bound = run_store_stall(rec) if stall is None else stall
        results = None if results is None else os.path.abspath(results)
        return _pull(rec, sealed, dest, results, progress, bwlimit, transport, remote, home, bound)
    finally:
        if own and remote is not None:
            remote.close()


def _pull(
    rec: RunRecord,
    sealed: Sealed,
    dest: str,
    results: Optional[str],
    progress: Optional[ProgressFn],
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    home: Optional[str],
    stall: float,
) -> Receipt:
    stage_dir = os.path.join(dest, STAGE)
    destination.check_dest(dest, sealed.entries, (n for n, _ in sealed.ident.links))
    destination.refuse_other_runs_pull(rec.name, dest)
    # One temporary file per source file: entries that share one (a deduplicated key) agree.
    unique: Dict[str, Entry] = {}
    for e in sealed.entries:
        other = unique.setdefault(e.stage, e)
        if (other.size, other.sha256) != (e.size, e.sha256):
            raise IntegrityError(f"{e.stage} is listed twice with different contents")
    items = list(unique.values())
    destination.make_dest(dest, results)
    with destination.dest_lock(dest):
        destination.refuse_folded_twins(dest, sealed.entries)
        try:
            if not destination.make_stage(stage_dir):  # a killed pull's: what it left
                destination.clear_in_the_way(stage_dir, items)
        except OSError as err:
            raise destination.cannot(dest, err) from None
        receipt = _staged_and_placed(
            rec, sealed, dest, stage_dir, items, progress, bwlimit, transport, remote, home, stall
        )
        shutil.rmtree(stage_dir, ignore_errors=True)
    if progress is not None:
        total = receipt.total_bytes()
        progress(Progress("done", "", total, total, total, total))
    return receipt


def _staged_and_placed(
    rec: RunRecord,
    sealed: Sealed,
    dest: str,
    stage_dir: str,
    items: List[Entry],
    progress: Optional[ProgressFn],
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    home: Optional[str],
    stall: float,
) -> Receipt:
    """Every file fetched into the stage, verified, opened, placed; the receipt written."""
    good = _reusable(sealed, items, stage_dir)
    monitor = Monitor(stage_dir, items, progress)
    checker = Checker(stage_dir)

    def finished(e: Entry, sha256: Optional[str] = None) -> None:
        monitor.finished(e)
        checker.finished(e, sha256)

    try:
        fetch = fetcher(sealed, stage_dir, bwlimit, transport, remote, finished, stall)
        with monitor:
            fetched = fetch([e for e in items if e.stage not in good])
        more, durable = _verify(rec.name, items, good, stage_dir, fetch, progress, checker)
    finally:
        checker.close()
    fetched += more
    how = _open_all(rec.name, items, stage_dir)
    destination.place(rec.name, dest, stage_dir, sealed.entries, home, durable)
    # The checkpoint dir's links to the checkpoint (Lightning's last.ckpt), as the box's
    # restore makes them: relative, in DEST/checkpoints, once what they lead to is in place.
    # parse_manifest checked each (a name there, a target in the checkpoint, never out of
    # DEST), or, from a box without a store, boxlinks.judged (a target pulled, in DEST).
    unmade = _make_links(sealed, dest)
    # A link not made (its name holds a file of an older pull, kept) covers nothing.
    covered = {e.path for e in sealed.entries} | {
        f"checkpoints/{n}" for n, _ in sealed.ident.links if n not in unmade
    }
    receipt = Receipt(
        run=rec.name,
        source=sealed.source,
        target=rec.target.label,
        store=rec.store,
        dest=dest,
        sealed=sealed.ident,
        files=[
            FileRecord(e.path, e.kind, e.size, e.sha256, e.origin, how[e.stage], e.redacted)
            for e in sorted(sealed.entries, key=lambda e: e.path)
        ],
        fetched_bytes=fetched,
        rgt_version=_version(),
        not_covered=destination.not_covered(dest, covered),
    )
    write_receipt(receipt, home)
    return receipt


def _make_links(sealed: Sealed, dest: str) -> Set[str]:
    """The links ``sealed`` names (a MANIFEST's, at the top of the checkpoint dir; or, from a
    box without a store, boxlinks.judged's, which may lie below it, each target relative to
    its own directory), made in the directory of DEST/checkpoints each is in. Returns the
    names (under DEST/checkpoints) not made: a file there already, kept."""
    unmade: Set[str] = set()
    by_dir: Dict[str, List[Dict[str, str]]] = {}
    for name, target in sealed.ident.links:
        here, _, base = name.rpartition("/")
        by_dir.setdefault(here, []).append({"name": base, "target": target})
    for here, recorded in sorted(by_dir.items()):
        sub = f"checkpoints/{here}" if here else "checkpoints"
        try:
            if here:  # a directory of links only (boxlinks.judged): made, never through a link
                os.close(open_dir(dest, sub.split("/"), create=True))
            _, left = dirlinks.make(recorded, dest, sub, replace=True)
        except OSError as err:
            raise target_error(err, f"making the checkpoint links in {dest}/{sub}") from None
        unmade.update(f"{here}/{n}" if here else n for n in left)
    return unmade


def _reusable(sealed: Sealed, items: List[Entry], stage_dir: str) -> Set[str]:
    """From the store, a finished copy an interrupted pull left is kept when it verifies (rsync
    decides that by itself for the box)."""
    good: Set[str] = set()
    for e in items:
        if e.src is None and os.path.exists(stage_path(stage_dir, e)):
            if _mismatch(stage_dir, e) is None:
                good.add(e.stage)
            else:
                _drop(stage_dir, e)
    return good


def _verify(
    run: str,
    items: List[Entry],
    good: Set[str],
    stage_dir: str,
    fetch: Callable[[List[Entry]], int],
    progress: Optional[ProgressFn],
    checker: Checker,
) -> Tuple[int, Set[str]]:
    """Every copy against its size and sha256 (as hashed while the fetch went on, when that
    hash still stands; else now); a mismatch (a stale partial copy, a glitch) is fetched fresh
    once more, then it is an IntegrityError naming the files. Returns the bytes refetched, and
    the copies the checker has fsynced since they were last written."""
    total = sum(e.size for e in items)
    checked = 0
    again: List[Entry] = []
    durable: Set[str] = set()

    def check(e: Entry) -> Optional[str]:
        if e.stage in good:
            return None
        hashed = checker.result(e)
        if hashed is None:
            return _mismatch(stage_dir, e)
        durable.add(e.stage)
        size, sha = hashed
        return None if (size, sha) == (e.size, e.sha256) else f"{size} bytes sha256 {sha[:12]}"

    with ThreadPoolExecutor(HASHERS) as pool:  # hashlib lets go of the GIL: one per core
        for e, why in zip(items, pool.map(check, items)):
            if why is not None:
                _drop(stage_dir, e)
                again.append(e)
            checked += e.size
            if progress is not None:
                progress(Progress("verify", e.path, e.size, e.size, checked, total))
    if not again:
        return 0, durable
    durable -= {e.stage for e in again}
    fetched = fetch(again)
    bad = []
    for e in again:
        why = _mismatch(stage_dir, e)
        if why is not None:
            bad.append(
                f"{e.path} ({e.origin}: {why}; sealed as {e.size} bytes sha256 {e.sha256[:12]})"
            )
            _drop(stage_dir, e)
    if bad:
        raise IntegrityError(
            f"pull of {run}: {len(bad)} file(s) do not match the manifest: "
            + "; ".join(bad[:5])
            + ("" if len(bad) <= 5 else f"; and {len(bad) - 5} more")
            + ". Nothing was put in place and no receipt was written",
            "the copy at the source is damaged: try the other source, --from box or --from store",
        )
    return fetched, durable


def _open_all(run: str, items: List[Entry], stage_dir: str) -> Dict[str, str]:
    """Open every copy of a known format as its framework would; how each was verified."""
    how: Dict[str, str] = {}
    for e in items:
        try:
            how[e.stage] = check_format(stage_path(stage_dir, e), e.path)
        except IntegrityError as err:
            _drop(stage_dir, e)
            raise IntegrityError(
                f"pull of {run}: {err.what}. Nothing was put in place and no receipt was written",
                err.remedy,
            ) from None
    return how
