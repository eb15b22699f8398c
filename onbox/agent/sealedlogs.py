"""Which of the job's logs in a run directory are in the store already: ``logs-sealed.json``.

A run stopped (or failed) and started again on the same box keeps its run directory: a new
agent, a new epoch, and attempts/ still holding the older attempts' logs (attempts are numbered
on from the last). Each agent seals the logs as it lets go of the run (onbox/agent/endlogs.py,
or DONE.json's, onbox/agent/completion.py), and sealing every attempt's log put the older ones
in the store twice, under each epoch, and `rgt pull` brought them twice. So once a document
that lists some logs is in the store (``logs/e<epoch>.json``, DONE.json), the agent records
here which attempts' logs it sealed, into which store, under which epoch and at what size; the
next agent seals only the others.

"Its own attempts" is what no agent sealed yet, not the epoch an attempt began under: an
attempt the agent adopted (its agent killed, the shim's respawned one going on with it) is the
adopter's to seal, and an older attempt whose own agent never got its log document into the
store (killed with SIGKILL mid-seal, a store call that failed, a preemption's grace that ran
out) is sealed by the next agent that lets go of the run, once, under that agent's epoch
(``e<epoch>/attempt-NNNN.log``, the attempt's own number). Not under the older epoch's name:
that agent's log document is the one that names ``e<old>/``, a pull refuses a document naming
another epoch's logs, and writing the older agent's document for it would be a check-then-put
that no store makes atomic.

A log is sealed again when it is not recorded for this store (a run started again with
another store), or its size on the box changed since (a preempted job that wrote on after its
logs were sealed in the grace): the newer copy, under the newer epoch, beside the older one;
nothing is lost.

The record is written twice: before the document, each entry naming the document that will
list it (``doc``: not yet known to be in the store), and once the document is written, without
it. An agent killed between the two leaves entries the next agent checks against that document
(read from the store: it must list the log under the recorded name, size and sha256). A record
that cannot be read (damaged, not ours) is learnt again from the store's own log documents
(``logs/e<epoch>.json``): a log is taken as sealed only where one of them lists a copy of its
present bytes (size and sha256, hashed now; a redacted copy never matches, and is sealed again).
Anything the store does not show (a document missing, damaged or unreadable, a store error)
counts as not sealed: the log is sealed again, a duplicate beside the older copy, never lost.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common import jsondoc
from onbox.common.durable import read_json, write_json
from onbox.common.errors import IntegrityError, StoreError
from onbox.common.rundir import RunDir
from onbox.common.safepath import sha256_regular
from onbox.sealing import manifest as mf
from onbox.sealing.stores.base import Store

Put = Callable[[int], List[Dict[str, Any]]]
# {attempt: its record entry}: what ``record`` writes for each log sealed (or found sealed).
Sealed = Dict[int, Dict[str, Any]]


def _records(rd: RunDir) -> Optional[Dict[str, Any]]:
    """The recorded entries by attempt; None when a record is there but cannot be read."""
    try:
        doc = read_json(rd.sealed_logs)
    except (OSError, ValueError, RecursionError):  # json's error for nesting past its depth
        return None
    if doc is None:
        return {}
    attempts = doc.get("attempts") if isinstance(doc, dict) else None
    return attempts if isinstance(attempts, dict) else None


def _size(rd: RunDir, attempt: int) -> Optional[int]:
    try:
        return os.stat(rd.output_log(attempt)).st_size
    except OSError:
        return None


def _doc_files(store: Store, key: str) -> List[Dict[str, Any]]:
    """The file entries of the store's document ``key`` (untrusted: only entries of the shape
    rgt writes); none where it is missing, damaged or cannot be read (then: seal again)."""
    try:
        raw = store.get_bytes(key)
        doc = jsondoc.loads(raw) if raw is not None else None
    except (StoreError, ValueError):
        return []
    files = doc.get("files") if isinstance(doc, dict) else None
    return [
        f
        for f in (files if isinstance(files, list) else [])
        if isinstance(f, dict)
        and isinstance(f.get("path"), str)
        and isinstance(f.get("size"), int)
        and isinstance(f.get("sha256"), str)
    ]


def _in_doc(store: Store, run: str, was: Dict[str, Any]) -> bool:
    """Whether the document a pending entry ``was`` names lists the very copy it recorded."""
    doc = was.get("doc")
    if not isinstance(doc, str) or not doc.startswith(run + "/"):
        return False
    return any(
        f["path"] == was.get("path")
        and f["size"] == was.get("size")
        and f["sha256"] == was.get("sha256")
        for f in _doc_files(store, doc)
    )


def _from_store(rd: RunDir, store: Store, run: str) -> Sealed:
    """What the store's log documents show sealed of this box's logs, for a record that cannot
    be read: each attempt whose log's present bytes one of them lists (not redacted)."""
    try:
        keys = [o.key for o in store.list(mf.logs_prefix(run))]
    except StoreError:
        return {}
    listed: Dict[Tuple[int, str], Tuple[int, str]] = {}  # (size, sha256): (epoch, path)
    for key in keys:
        epoch = mf.logs_doc_epoch(run, key)
        if epoch is None:  # a log itself, or a name not rgt's
            continue
        for f in _doc_files(store, key):
            if f["path"].startswith(f"e{epoch}/") and not f.get("redacted"):
                listed[(f["size"], f["sha256"])] = (epoch, f["path"])
    found: Sealed = {}
    for attempt in rd.attempt_numbers():
        size = _size(rd, attempt)
        if size is None or not any(k[0] == size for k in listed):
            continue  # no document lists a copy of this size: hashing it could find none
        try:
            sha, size = sha256_regular(rd.output_log(attempt))
        except (OSError, IntegrityError):
            continue
        hit = listed.get((size, sha))
        if hit is not None:
            found[attempt] = _entry(hit[0], store.url, size, sha, hit[1])
    return found


def _entry(epoch: int, store_url: str, size: int, sha: Optional[str], path: str) -> Dict[str, Any]:
    return {"epoch": epoch, "store": store_url, "size": size, "sha256": sha, "path": path}


def put_unsealed(
    rd: RunDir, store: Store, run: str, put: Put
) -> Tuple[List[Dict[str, Any]], Sealed]:
    """``put`` (the completion seal's ``put_log``) each attempt's log that is not recorded as
    sealed into ``store`` at its present size, oldest first: (the entries for the document,
    {attempt: its record entry} of each one sealed, or found sealed in the store, for
    ``record``). The size is taken before the upload: a log that grows meanwhile is sealed
    again next time, not lost."""
    done = _records(rd)
    found: Sealed = {}
    if done is None:  # a record that cannot be read: what the store's documents show
        found, done = _from_store(rd, store, run), {}
    logs: List[Dict[str, Any]] = []
    sealed: Sealed = dict(found)
    for attempt in rd.attempt_numbers():
        size = _size(rd, attempt)
        was = done.get(str(attempt))
        if attempt in found:
            continue
        if (
            isinstance(was, dict)
            and size is not None
            and was.get("store") == store.url
            and was.get("size") == size
        ):
            if "doc" not in was:
                continue
            if _in_doc(store, run, was):  # its document is in the store: no longer pending
                sealed[attempt] = {k: v for k, v in was.items() if k != "doc"}
                continue
        got = put(attempt)
        logs += got
        if got and size is not None:
            sha = got[0].get("sha256") if len(got) == 1 else None
            sealed[attempt] = _entry(0, store.url, size, sha, "")
    return logs, sealed


def record(
    rd: RunDir, store_url: str, epoch: int, sealed: Sealed, doc: Optional[str] = None
) -> None:
    """Record the logs ``sealed`` (``put_unsealed``'s) as in ``store_url`` under ``epoch``
    (those found sealed under their own): with ``doc``, the key of the document about to list
    them (before it is written: pending until that document is seen), without, once it is."""
    if not sealed:
        return
    done = _records(rd) or {}
    for attempt, entry in sealed.items():
        new = dict(entry)
        if not new["path"]:  # sealed by this agent: its epoch's name, listed by its document
            new.update(epoch=epoch, path=mf.log_name(epoch, attempt))
            if doc is not None:
                new["doc"] = doc
        done[str(attempt)] = new
    write_json(rd.sealed_logs, {"attempts": done})
