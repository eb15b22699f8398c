"""The sealed state of a run from its documents (LATEST -> MANIFEST, DONE or ENDED, and each
epoch's log document ``logs/e<epoch>.json``), wherever they are read (a store, or a file://
store on the box): every file entry checked as untrusted input."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from controller.results.entries import SHA256_HEX, Entry, sha_hex
from controller.results.receipt import SealedId
from onbox.common import jsondoc
from onbox.common.errors import IntegrityError
from onbox.common.safepath import safe_rel
from onbox.common.terminal import printable
from onbox.sealing import manifest as mf
from onbox.sealing.quarantine import quarantine_reasons
from onbox.sealing.restore import in_effect, sealed_steps
from onbox.sealing.stores.base import Store, with_retries


def store_get(store: Store, key: str) -> Optional[bytes]:
    """A document of the store (None when it has none), retried as the store retries."""
    return with_retries(lambda: store.get_bytes(key))


# (sealed steps, {quarantined step: reason}) of a run, as the store lists them.
Listing = Callable[[], Tuple[List[int], Dict[int, str]]]
# {epoch: the bytes of its log document} of a run (``RUN/logs/e<epoch>.json``).
LogDocs = Callable[[], Dict[int, bytes]]


def store_log_docs(store: Store, run: str) -> Dict[int, bytes]:
    """The run's log documents, one per epoch whose agent sealed the job's logs
    (onbox/agent/endlogs.py), as the store lists them; keys of any other form are skipped."""
    keys = with_retries(lambda: [o.key for o in store.list(mf.logs_prefix(run))])
    out: Dict[int, bytes] = {}
    for key in keys:
        epoch = mf.logs_doc_epoch(run, key)
        data = store_get(store, key) if epoch is not None else None
        if epoch is not None and data is not None:  # None: gone since it was listed
            out[epoch] = data
    return out


def store_listing(store: Store, run: str) -> Tuple[List[int], Dict[int, str]]:
    """The run's sealed steps (only when some step is quarantined) and quarantined steps."""
    bad = quarantine_reasons(store, run)
    return (with_retries(lambda: sealed_steps(store, run)) if bad else []), bad


def _check_doc_file(f: Any, what: str, run: str) -> None:
    if not isinstance(f, dict):
        raise IntegrityError(f"{what}: a malformed file entry {f!r}")
    safe_rel(f.get("path"), f"{what}: path")
    safe_rel(f.get("key"), f"{what}: key")
    ok = (
        isinstance(f.get("size"), int)
        and f["size"] >= 0
        and isinstance(f.get("sha256"), str)
        and SHA256_HEX.match(f["sha256"]) is not None
        and f["key"].startswith(run + "/")
    )
    if not ok:
        raise IntegrityError(f"{what}: a malformed file entry {f!r}")


def from_documents(
    run: str,
    get: Callable[[str], Optional[bytes]],
    listing: Optional[Listing] = None,
    log_docs: Optional[LogDocs] = None,
) -> Tuple[SealedId, List[Entry]]:
    """LATEST -> MANIFEST, DONE (or, without one, ENDED), and the log document of each epoch
    (``log_docs``: every box of the run that sealed its job's logs, a preempted one too): the
    sealed state and its files. When LATEST names a quarantined step (``listing`` says which
    are), the newest sealed step before it that is not quarantined is the sealed state instead
    (onbox.sealing.restore.in_effect), and ``note`` says so; a run with none left is an
    IntegrityError. A run with none of these documents has nothing sealed: an empty SealedId
    and no files."""
    latest = mf.parse_latest(get(mf.latest_key(run)))
    entries: List[Entry] = []
    step = epoch = None
    mkey = msha = note = None
    links: Tuple[Tuple[str, str], ...] = ()
    if latest is not None:
        step, epoch, mkey, msha, note, links = _checkpoint(run, latest, get, listing, entries)
    done_raw = get(mf.done_key(run))
    done_sha = None
    missing_outputs: Tuple[str, ...] = ()
    left_out: Tuple[str, ...] = ()
    ended_raw = ended_sha = None
    if done_raw is not None:
        done_sha = sha_hex(done_raw)
        missing_outputs, left_out = _done(run, done_raw, entries)
    else:
        # A run that ended FAILED or STOPPED: its job's logs (onbox/agent/endlogs.py). DONE.json
        # lists a run's logs when it succeeds, and then this is not read.
        ended_raw = get(mf.ended_key(run))
    if ended_raw is not None:
        ended_sha = sha_hex(ended_raw)
        left_out = _ended(run, ended_raw, entries)
    logs_sha, more_left = _epoch_docs(run, log_docs() if log_docs is not None else {}, entries)
    left_out += tuple(x for x in more_left if x not in left_out)
    if latest is None and done_raw is None and ended_raw is None and logs_sha is None:
        # Nothing sealed (a job that failed or was stopped before its first checkpoint): a
        # state of its own, which a pull records in its receipt (SealedId.nothing) so that
        # `rgt down` can go while the store still has nothing sealed, and refuses once it has.
        return SealedId(), []
    paths = [e.path for e in entries]
    if len(set(paths)) != len(paths):
        raise IntegrityError(f"the sealed state of {run!r} lists a path twice")
    ident = SealedId(
        step=step,
        epoch=epoch,
        manifest=mkey,
        manifest_sha256=msha,
        done=done_raw is not None,
        done_sha256=done_sha,
        note=note,
        missing_outputs=missing_outputs,
        left_out=left_out,
        links=links,
        ended_sha256=ended_sha,
        logs_sha256=logs_sha,
    )
    return ident, entries


def _integer(value: Any) -> Optional[int]:
    """``value`` when it is an integer (not a bool: the receipt's reader refuses one), else
    None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _checkpoint(
    run: str,
    latest: Dict[str, Any],
    get: Callable[[str], Optional[bytes]],
    listing: Optional[Listing],
    entries: List[Entry],
) -> Tuple[int, Optional[int], str, str, Optional[str], Tuple[Tuple[str, str], ...]]:
    """The checkpoint LATEST names (or the one in effect), its files added to ``entries``:
    (step, epoch, MANIFEST key, its sha256, note, the dir's links to it: name, target, both
    checked by parse_manifest: a name in the dir, a target in the checkpoint)."""
    step = latest["step"]
    if isinstance(step, bool):  # an int to isinstance: "step": true would name step True
        raise IntegrityError(f"{mf.latest_key(run)} names no step")
    epoch = _integer(latest.get("epoch"))
    note = None
    sealed, bad = listing() if listing is not None else ([], {})
    if step in bad:
        effective, note = in_effect(step, sealed, bad)
        # The reason is the store's (its quarantine record): printed in the error below and
        # by `rgt pull`, it must not drive the terminal or forge a line of its own.
        note = printable(note) if note is not None else None
        if effective is None:
            raise IntegrityError(
                f"run {run!r} has no verified checkpoint to pull: {note}",
                "look at the store (quarantine/ says why)",
            )
        step, epoch = effective, None
    mkey = mf.manifest_key(run, step)
    data = get(mkey)
    if data is None:
        raise IntegrityError(f"LATEST names step {step}, but {mkey} is missing")
    doc = mf.parse_manifest(data, mkey)
    if doc["step"] != step:
        raise IntegrityError(f"{mkey} is for step {doc['step']}, LATEST says {step}")
    msha = sha_hex(data)
    if note is not None and _integer(doc.get("epoch")) is not None:
        epoch = doc["epoch"]
    for f in doc["files"]:
        _check_doc_file(f, mkey, run)
        entries.append(
            Entry("checkpoints/" + f["path"], "checkpoint", f["size"], f["sha256"], f["key"])
        )
    links = tuple((link["name"], link["target"]) for link in doc.get("links", []))
    return step, epoch, mkey, msha, note, links


# What DONE.json lists, by the prefix of its key (onbox/sealing/manifest.py), and the "root"
# that goes with it: results sealed from the checkpoint dir, declared outputs, job logs.
_DONE_KINDS = (
    (mf.results_prefix, "ckpt"),
    (mf.outputs_prefix, None),
    (mf.logs_prefix, None),
)


def _done_kind(run: str, f: Dict[str, Any]) -> str:
    """What the DONE.json entry ``f`` (checked) is: "results", "outputs" or "logs". The agent
    writes each key as that prefix and the file's ``path`` (onbox/agent/completion.py
    ``_put_files``); any other key (``RUN/logs`` itself, a key that is not the file's path)
    is no file rgt sealed, and taking its tail as a name would put a file where the pull's
    ``logs/`` or ``outputs/`` directory goes: an IntegrityError naming it."""
    for prefix, root in _DONE_KINDS:
        if f["key"] == prefix(run) + f["path"] and f.get("root") == root:
            return prefix(run)[len(run) + 1 : -1]
    raise IntegrityError(
        f"{mf.done_key(run)} lists the key {f['key']!r} for the path {f['path']!r}: not a "
        f"result, an output or a log as rgt seals them ({run}/results/PATH with root ckpt, "
        f"{run}/outputs/PATH or {run}/logs/PATH). Nothing was fetched",
        f"the store's {mf.done_key(run)} is damaged or not rgt's: look at it (the sealed "
        f"files themselves are in the store under {run}/)",
    )


def _done(
    run: str, done_raw: bytes, entries: List[Entry]
) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """DONE.json's outputs and logs added to ``entries``; the outputs it says are missing, and
    the files it says were left out ("PATH: why", PATH as the pull names it)."""
    try:
        done = jsondoc.loads(done_raw)
    except ValueError:
        raise IntegrityError(f"{mf.done_key(run)} is not valid JSON") from None
    files = done.get("files") if isinstance(done, dict) else None
    if not isinstance(files, list):
        raise IntegrityError(f"{mf.done_key(run)} lists no files")
    for f in files:
        _check_doc_file(f, mf.done_key(run), run)
        kind = _done_kind(run, f)
        if kind == "results":
            # A file the job left in RGT_CKPT_DIR that no checkpoint holds (result.txt):
            # beside LATEST's files, at its path under the checkpoint dir, as a pull
            # without a store puts it (onbox/agent/completion.py _results).
            entries.append(
                Entry("checkpoints/" + f["path"], "checkpoint", f["size"], f["sha256"], f["key"])
            )
            continue
        path, redacted = f"{kind}/{f['path']}", f.get("redacted") is True
        entries.append(Entry(path, kind[:-1], f["size"], f["sha256"], f["key"], redacted=redacted))
    missing = done.get("missing_outputs")
    return (
        tuple(str(m) for m in missing) if isinstance(missing, list) else (),
        _left_out(done.get("left_out")),
    )


def _left_out(left: Any) -> Tuple[str, ...]:
    """A document's ``left_out`` ("PATH: why" each); entries not of rgt's form are skipped."""
    return tuple(
        f"{x['path']}: {x['why']}"
        for x in (left if isinstance(left, list) else [])
        if isinstance(x, dict) and isinstance(x.get("path"), str) and isinstance(x.get("why"), str)
    )


def _ended(run: str, raw: bytes, entries: List[Entry]) -> Tuple[str, ...]:
    """ENDED.json's logs added to ``entries``; the files it says were left out. Each entry is
    checked as DONE.json's are, and must be a job's log as the agent seals it
    (``RUN/logs/attempt-NNNN.log``): anything else is an IntegrityError naming it."""
    key = mf.ended_key(run)
    try:
        doc = jsondoc.loads(raw)
    except ValueError:
        raise IntegrityError(f"{key} is not valid JSON") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        raise IntegrityError(f"{key} lists no files")
    epoch = _integer(doc.get("epoch"))
    for f in files:
        _check_doc_file(f, key, run)
        _job_log(run, key, f, epoch, old=True)
        _add_log(entries, f)
    return _left_out(doc.get("left_out"))


def _job_log(run: str, key: str, f: Dict[str, Any], epoch: Optional[int], old: bool) -> None:
    """Refuse the entry ``f`` (checked) of the document ``key`` unless it is a job's log as
    the agent of ``epoch`` seals it, ``RUN/logs/e<epoch>/attempt-NNNN.log``, or (``old``: an
    ENDED.json, which agents from before epochs named the logs in wrote) ``RUN/logs/
    attempt-NNNN.log``; with no ``root``."""
    m = _LOG_NAME.match(f["path"])
    if m is None:
        named = False
    elif m.group(1) is None:
        named = old
    else:
        named = epoch is not None and m.group(1) == f"e{epoch}/"
    if not named or f["key"] != mf.logs_prefix(run) + f["path"] or "root" in f:
        raise IntegrityError(
            f"{key} lists the key {f['key']!r} for the path {f['path']!r}: not a job's log "
            f"as rgt seals it ({run}/logs/e<epoch>/attempt-NNNN.log, the epoch the "
            "document's). Nothing was fetched",
            f"the store's {key} is damaged or not rgt's: look at it",
        )


def _add_log(entries: List[Entry], f: Dict[str, Any]) -> None:
    """The log ``f`` (checked) as an entry; one that is already there with the same key and
    bytes (ENDED.json's and its epoch's log document list the same logs) once."""
    new = Entry(
        "logs/" + f["path"],
        "log",
        f["size"],
        f["sha256"],
        f["key"],
        redacted=f.get("redacted") is True,
    )
    if new not in entries:
        entries.append(new)


def _epoch_docs(
    run: str, docs: Dict[int, bytes], entries: List[Entry]
) -> Tuple[Optional[str], Tuple[str, ...]]:
    """The logs of each epoch's log document (``docs``) added to ``entries``, each checked as
    ENDED.json's are and named by that very epoch: the hex of a sha256 over the documents (for
    the receipt; None without one), and the files they say were left out ("PATH: why")."""
    if not docs:
        return None, ()
    digest = hashlib.sha256()
    left: Tuple[str, ...] = ()
    for epoch in sorted(docs):
        key, raw = mf.logs_doc_key(run, epoch), docs[epoch]
        try:
            doc = jsondoc.loads(raw)
        except ValueError:
            raise IntegrityError(f"{key} is not valid JSON") from None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, list) or not isinstance(doc, dict):
            raise IntegrityError(f"{key} lists no files")
        if _integer(doc.get("epoch")) != epoch:
            raise IntegrityError(
                f"{key} says it is of another epoch than {epoch}. Nothing was fetched",
                f"the store's {key} is damaged or not rgt's: look at it",
            )
        for f in files:
            _check_doc_file(f, key, run)
            _job_log(run, key, f, epoch, old=False)
            _add_log(entries, f)
        left += _left_out(doc.get("left_out"))
        digest.update(f"{key} {sha_hex(raw)}\n".encode())
    return digest.hexdigest(), left


def sealed_logs(
    run: str, get: Callable[[str], Optional[bytes]], log_docs: Optional[LogDocs] = None
) -> Dict[str, Tuple[int, bool]]:
    """The job's logs the store holds (DONE.json's, or without one ENDED.json's, and each
    epoch's log document's), each by the name a pull gives it: (size, redacted). Checked as a
    pull checks them (IntegrityError)."""
    entries: List[Entry] = []
    done_raw = get(mf.done_key(run))
    if done_raw is not None:
        _done(run, done_raw, entries)
    else:
        ended_raw = get(mf.ended_key(run))
        if ended_raw is not None:
            _ended(run, ended_raw, entries)
    _epoch_docs(run, log_docs() if log_docs is not None else {}, entries)
    return {e.path: (e.size, e.redacted) for e in entries if e.kind == "log"}


# A job's log as the agent seals it: under its epoch (group 1), or as before epochs named them.
_LOG_NAME = re.compile(r"(e[1-9][0-9]*/)?attempt-\d{4,}\.log\Z")
