"""What is sealed: a run's newest sealed state and where its bytes are (``read_sealed``), as
the store or the box sees it, and whether a receipt covers it (``covers_newest``, for ``rgt
down``). The sources are described in controller/results/pull.py's docstring."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import List, Optional, Tuple

from controller import boxrun
from controller.registry import RunRecord
from controller.remote import Remote, open_remote
from controller.results.boxdocs import BoxDocs
from controller.results.boxfiles import box_files
from controller.results.documents import (
    from_documents,
    store_get,
    store_listing,
    store_log_docs,
)
from controller.results.entries import Entry, Sealed, box_join, checked
from controller.results.receipt import Coverage, Receipt, SealedId, compare
from controller.runstore import open_run_store
from onbox.common.errors import IntegrityError, NotFound, UsageError
from onbox.sealing import manifest as mf
from onbox.sealing.ledger import newest_epoch
from onbox.sealing.stores.base import Store, with_retries
from onbox.sealing.stores.local import LocalStore

SOURCES = ("box", "store", "auto")
_LOG = re.compile(r"attempt-(\d{4,})\.log\Z")


def resolve_source(rec: RunRecord, source: str) -> str:
    """Where to pull from, "box" or "store", for ``source`` "box", "store" or "auto" (see
    controller/results/pull.py's docstring)."""
    if source not in SOURCES:
        raise UsageError("--from", f"{source!r} is not box or store")
    if rec.down_at is not None and rec.store:  # rgt down kept the record for the store alone
        if source == "box":
            rec.check_on_box("rgt pull --from box")
        return "store"
    if source != "auto":
        if source == "store" and not rec.store:
            raise UsageError("--from", f"run {rec.name!r} has no store", "pull it with --from box")
        return source
    if not rec.store:
        return "box"
    if _file_root(rec) is not None and rec.target.kind != "local":
        return "box"  # a file:// store is a mount on the box
    return "store"


def _file_root(rec: RunRecord) -> Optional[str]:
    if not rec.store or not rec.store.lower().startswith("file:"):
        return None
    store = open_run_store(rec)
    assert isinstance(store, LocalStore)
    return store.root


def read_sealed(
    rec: RunRecord, source: str, remote: Optional[Remote] = None, stall: Optional[float] = None
) -> Sealed:
    """The newest sealed state of ``rec`` as ``source`` ("box" or "store") sees it, every final
    and staging name checked (``checked``) before anything is created on the laptop; each read
    of the store bounded by ``stall`` (`rgt pull --stall`), else the run's (open_run_store)."""
    try:
        return checked(_read_sealed(rec, source, remote, stall), f"pull of {rec.name}")
    except IntegrityError as e:
        raise unreadable(rec, e, "pull", "down", "pull creates nothing") from None


def _read_sealed(
    rec: RunRecord, source: str, remote: Optional[Remote], stall: Optional[float]
) -> Sealed:
    run = rec.name
    if source == "store":
        assert rec.store
        root = _file_root(rec)
        if root is not None and not os.path.isdir(root) and rec.down_at is not None:
            raise NotFound(
                f"run {run} was {rec.taken_down()} (rgt down), and its store {rec.store} is a "
                "mount of the box's, not a directory on this laptop",
                f"mount it here at {root}, or deploy a box that mounts it "
                f"(rgt deploy TARGET --name {run} --store {rec.store} ...) and pull from there",
            )
        if root is not None and not os.path.isdir(root):
            raise UsageError(
                "--from",
                f"the store {rec.store} is not a directory on this laptop",
                "a file:// store is a path on the box: pull with --from box",
            )
        store = open_run_store(rec, stall)
        ident, entries = _from_store(store, rec)
        entries = [dataclasses.replace(e, origin=e.key or "") for e in entries]
        return Sealed(ident, entries, "store", store=store)
    assert remote is not None
    if not rec.store:
        return box_files(rec, remote)
    root = _file_root(rec)
    if root is not None:
        ident, entries = _from_box_docs(remote, root, rec)
        entries = [
            dataclasses.replace(e, src=e.key, origin=box_join(root, e.key or "")) for e in entries
        ]
        return Sealed(ident, entries, "box", box_root=root)
    # s3://, hf://: the store says what is sealed; the box holds copies of the bytes.
    store = open_run_store(rec, stall)
    ident, entries = _from_store(store, rec)
    spec = boxrun.spec(rec, remote)
    attempts = boxrun.run_dir(rec).attempts
    ckpt, workdir = boxrun.spec_dirs(rec, spec, remote)
    placed = []
    for e in entries:
        # A log the box's own copy holds a secret in: the store's masked copy, verified. A log
        # named by its epoch (or one ENDED.json lists) comes from the store too: it may be an
        # earlier box's, whose attempt number this box's own log of another attempt bears.
        m = _LOG.match(e.path[len("logs/") :]) if e.kind == "log" else None
        if e.redacted or (e.kind == "log" and (ident.ended_sha256 is not None or m is None)):
            placed.append(dataclasses.replace(e, origin=e.key or ""))
            continue
        if e.kind == "checkpoint":
            path = box_join(ckpt, e.path[len("checkpoints/") :])
        elif e.kind == "output":
            path = box_join(workdir, e.path[len("outputs/") :])
        else:
            assert m is not None
            path = box_join(attempts, m.group(1), "output.log")
        placed.append(dataclasses.replace(e, src=path[1:], origin=path))
    return Sealed(ident, placed, "box", box_root="/", store=store)


def _from_store(store: Store, rec: RunRecord) -> Tuple[SealedId, List[Entry]]:
    """The sealed state as the store's documents say, read with the laptop's credentials.
    Nothing sealed is said only of a store that holds the run's epoch (``_no_trace``)."""
    run = rec.name
    ident, entries = from_documents(
        run,
        functools.partial(store_get, store),
        functools.partial(store_listing, store, run),
        functools.partial(store_log_docs, store, run),
    )
    if ident.nothing and not has_trace(store, run):
        raise _no_trace(rec)
    return ident, entries


def has_trace(store: Store, run: str) -> bool:
    """Whether ``store`` holds the run's epoch (``RUN/epochs/``), which every agent of a run
    with a store takes there before its job starts (onbox/sealing/epochs.py); listed as every
    document is read (retried past a blip). A store without it holds nothing of the run: most
    likely not the store the box writes to (``no_trace_what``)."""
    return with_retries(lambda: newest_epoch(store, run)) > 0


def no_trace_what(store: str, run: str) -> str:
    """What a store (``store``: its URL, and endpoint) with no trace of ``run`` holds."""
    return (
        f"the store {store} holds nothing of run {run}: no sealed checkpoint, no DONE.json, "
        f"not even the epoch its agent takes there when it starts ({run}/epochs/)"
    )


def wrong_store(file_store: bool) -> str:
    """What a store the box does not write to may have been given wrong."""
    return "a wrong " + ("directory" if file_store else "bucket, prefix or endpoint")


# The box's answer: "dir" when the store's directory is there, then "epoch" when the run's
# epochs/ holds a file (the mark its agent makes there when it starts). Nothing else is read.
_TRACE = (
    'if [ -d "$1" ]; then echo dir\n'
    '  for f in "$2"/[0-9]*; do [ -f "$f" ] && { echo epoch; break; }; done\nfi\n'
)


def _from_box_docs(remote: Remote, root: str, rec: RunRecord) -> Tuple[SealedId, List[Entry]]:
    """The sealed state as the documents of a file:// store on the box say."""
    run = rec.name
    docs = BoxDocs(remote, root)
    docs.prefetch([mf.latest_key(run), mf.done_key(run), mf.ended_key(run)], run=run)  # one trip
    ident, entries = from_documents(
        run, docs.get, functools.partial(docs.listing, run), functools.partial(docs.log_docs, run)
    )
    if not ident.nothing:
        return ident, entries
    # No document may mean a store whose mount is not there, or a directory that is not the
    # run's store: nothing sealed is said (in a receipt `rgt down` takes) only of a store that
    # is there and holds the run's epoch. The box's answer is fixed words (``_TRACE``).
    epochs = box_join(root, mf.epochs_prefix(run).rstrip("/"))
    seen = remote.sh(_TRACE, root, epochs).text.split()
    if seen[:1] != ["dir"]:
        raise _no_store_dir(root, run, remote.target.label)
    if seen[1:] != ["epoch"]:
        raise _no_trace(rec)
    return ident, entries


def _no_store_dir(root: str, run: str, where: str) -> NotFound:
    """A file:// store whose directory is not there: not a store with nothing sealed."""
    return NotFound(
        f"the store {root} of run {run} is not a directory on {where}: whether anything "
        "of the run is sealed cannot be read (its mount gone?)",
        f"mount the store there again, then rgt pull {run}",
    )


def _no_trace(rec: RunRecord) -> NotFound:
    """A store that holds nothing of the run, not even the epoch every agent of a run with a
    store takes there before its job starts (onbox/sealing/epochs.py): most likely not the
    store the box writes to, so not a store with nothing sealed (whose receipt would let
    `rgt down` take the box and checkpoints it may have sealed elsewhere)."""
    run = rec.name
    at = f" at {rec.store_endpoint_url}" if rec.store_endpoint_url else ""
    events = box_join(boxrun.run_dir(rec).path, "events.jsonl")
    return NotFound(
        f"{no_trace_what(f'{rec.store}{at}', run)}: most likely not the store the box writes "
        f"to ({wrong_store(_file_root(rec) is not None)})",
        f"check this laptop's store for {run} (rgt runs shows it) against the one the box's "
        f"agent writes to (its 'epoch' event names it: {events} on the box). If that agent "
        "never reached its store, nothing of the run is sealed anywhere and what the box "
        "holds is on the box alone",
    )


# ---- does a receipt cover the newest sealed state?


def newest_sealed(rec: RunRecord, remote: Optional[Remote] = None) -> SealedId:
    """The run's newest sealed state, from wherever its documents are (the same whichever
    source the files came from): a file:// store of an ssh target on the box, any other store
    from the laptop, the box's files for a run without a store."""
    if rec.store:
        root = _file_root(rec)
        if root is None or rec.target.kind == "local":
            if root is not None and not os.path.isdir(root):
                raise _no_store_dir(root, rec.name, "this machine")
            return _from_store(open_run_store(rec), rec)[0]
    own = remote is None
    box = remote or open_remote(rec.target)
    try:
        if not rec.store:
            return box_files(rec, box).ident
        assert root is not None
        return _from_box_docs(box, root, rec)[0]
    finally:
        if own:
            box.close()


def covers_newest(rec: RunRecord, receipt: Receipt, remote: Optional[Remote] = None) -> Coverage:
    """Whether ``receipt`` covers ``rec``'s newest sealed state (read again now, see
    ``newest_sealed``) and its files are still in its dest with their sizes. Falsy, with the
    reason, when not."""
    if receipt.run != rec.name:
        return Coverage(False, f"the receipt is for run {receipt.run!r}, not {rec.name!r}")
    try:
        newest = newest_sealed(rec, remote)
    except (UsageError, NotFound) as e:
        return Coverage(False, f"the newest sealed state cannot be read: {e.what}")
    except IntegrityError as e:
        # A document that cannot be read may list what down would remove: down refuses, and
        # says so (the document's own error named neither down nor the store).
        raise unreadable(rec, e, "down", "pull", "down removes nothing") from None
    return compare(receipt, newest)


def unreadable(
    rec: RunRecord, e: IntegrityError, command: str, other: str, so: str
) -> IntegrityError:
    """``e`` (exit 6), a document of the run's sealed state that cannot be read (damaged, or
    not rgt's: documents.py says which and why), as `rgt COMMAND` says it: that it did
    nothing, where the document is, and what to do: the document's own remedy where it has
    one (``so``: what the command leaves be)."""
    where = f"the store {rec.store}" if rec.store else "the box's run directory"
    what, look = cannot_read(where, e)
    return IntegrityError(
        f"run {rec.name}: rgt {command} did nothing: {what}",
        f"{look} (`rgt {other} {rec.name}` refuses it too); {so} while it cannot be read",
    )


def cannot_read(where: str, e: IntegrityError) -> Tuple[str, str]:
    """(what, what to do) of ``e``, a document of the run's sealed state in ``where`` (the
    store URL, the box's run directory) that cannot be read, as pull, down and reconcile say
    it: what is wrong with it, and the document's own remedy where it has one."""
    look = e.remedy or f"look at the document it names in {where}: damaged, or not rgt's"
    return f"the run's sealed state in {where} cannot be read: {e.what}", look
