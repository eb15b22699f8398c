"""``rgt pull``: bring a run's newest sealed state to the laptop, verified, resumable.

What is pulled is the run's newest *sealed* state, never a file that is still being written:

- with a store: LATEST.json names a MANIFEST (files with path, size, sha256, key); when the run
  is done, DONE.json adds its outputs and logs. ``--from store`` reads documents and files from
  the store with the laptop's credentials. ``--from box`` reads them from the box over ssh: for
  a ``file://`` store (a mount on the box) the documents and files are the store's, on the box;
  for ``s3://``/``hf://`` the documents come from the store (the source of truth for what is
  sealed) and the bytes from the box's own copies (its checkpoint dir, the job's workdir, the
  run's logs), each checked against the store's sha256; but a log DONE.json marks ``redacted``
  (the box's own log holds a secret, the store has a copy with it masked) comes from the store
  whatever ``--from`` says, verified the same way, and when the store cannot give it the pull
  stops and says so: the box's raw log is never taken in its place. ``auto`` is the store when
  the laptop can read it (``s3://``, ``hf://``, or ``file://`` with a ``local`` target), else
  the box.
- without a store (``--from box`` only): when the run is no longer live (its agent reports a
  terminal state, so no file is being written), every file in its checkpoint dir (hidden and
  temporary names skipped, as the sealer skips them), its outputs and its job logs, with
  sha256 computed on the box at pull time. A live run without a store is refused: stop it
  first; a run that has ended is pulled once its agent has let go of it. A job's log that holds
  a secret is taken as the redacted copy the agent wrote next to it when it let go
  (``attempts/NNNN/output.redacted.log``, onbox/agent/sealservice.py ``redact_box_logs``), never as
  is;
  the receipt marks it ``redacted``.

Layout under DEST: ``checkpoints/<path as sealed, relative to RGT_CKPT_DIR>``,
``outputs/<path>``, ``logs/attempt-NNNN.log``, and ``.rgt-receipt.json``
(controller/results/receipt.py).

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
byte ranges, so an unfinished file is downloaded again whole).

Verification, before any file gets its final name: each file's size and sha256 against the
manifest (a mismatch is fetched fresh once more, then it is an IntegrityError naming the file);
then each file of a known format is opened as its framework would: ``.safetensors`` (the
header parsed, every tensor's offsets inside the file, contiguous, sized by dtype and shape),
torch files ``.pt``/``.pth``/``.bin``/``.ckpt`` (``torch.load(weights_only=True,
map_location="cpu", mmap=True)``, torch imported only then; without torch on the laptop they
are "checked by sha256 only", said so in the receipt). Then the old receipt is removed, every
file is renamed into place (fsynced, directories fsynced), and the receipt is written last.

The hashing and the fsync of each file overlap the transfer of the next ones: a file is hashed
and fsynced as soon as its transport is done with it (rsync: once it has logged a later file,
or exited), and that hash is used only if the file cannot have changed since (the transport did
not write it again, and its size, mtime, ctime and inode are unchanged); otherwise it is hashed
again after the transfer. A pull thus ends shortly after its last byte arrives (the hashes of
the last files), instead of after a hash and an fsync of everything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import (
    IO,
    AbstractSet,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Set,
    Tuple,
)

from controller.registry import RunRecord
from controller.remote import Remote, open_remote, rsync_e
from controller.results.receipt import (
    Coverage,
    FileRecord,
    Receipt,
    SealedId,
    compare,
    remove_receipts,
    write_receipt,
)
from onbox.agent.states import TERMINAL
from onbox.common.durable import fsync_dir, fsync_file
from onbox.common.errors import HostError, IntegrityError, NotFound, RemoteUnreachable, UsageError
from onbox.common.safepath import (
    UnsafePath,
    conflicts,
    lstat_beneath,
    open_beneath,
    open_dir,
    replace_beneath,
    safe_abs,
    safe_join,
    safe_rel,
    symlink_error,
    unlink_beneath,
)
from onbox.sealing import manifest as mf
from onbox.sealing.restore import in_effect, quarantine_reason, quarantine_reasons, sealed_steps
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store, StoreError, with_retries
from onbox.sealing.stores.local import LocalStore

SOURCES = ("box", "store", "auto")
STAGE = ".rgt-part"
# rgt's own files in the staging directory: no staged file may take one of their names.
_LOCK, _FILES_FROM, _COPY = ".lock", ".rgt-files-from", ".rgt-copy-"
_KINDS = {"checkpoints": "checkpoint", "outputs": "output", "logs": "log"}
CHUNK = 8 << 20
HASH_BUFFER = 1 << 20
PARALLEL_FSYNC = 4 << 20  # a file this large is fsynced in a thread of its own while hashed
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
HASHERS = max(1, min(8, os.cpu_count() or 1))
TERMINAL_NAMES = frozenset(s.value for s in TERMINAL)
_SHA = re.compile(r"[0-9a-f]{64}\Z")
_LOG = re.compile(r"attempt-(\d{4,})\.log\Z")


# ---- what is pulled


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of the sealed state."""

    path: str  # final path, relative to DEST
    kind: str  # checkpoint | output | log
    size: int
    sha256: str
    key: Optional[str]  # store key, when the bytes come from the store
    src: Optional[str] = None  # path on the box relative to Sealed.box_root, when from the box
    origin: str = ""  # where the bytes are, for people: the store key or the path on the box
    redacted: bool = False  # a job's log with each secret masked (the box's own holds one)

    @property
    def stage(self) -> str:
        """Its temporary name under DEST/.rgt-part/ (unique per source file)."""
        return self.src if self.src is not None else (self.key or self.path)


@dataclasses.dataclass
class Sealed:
    """The newest sealed state of a run, and where its bytes are."""

    ident: SealedId
    entries: List[Entry]
    source: str  # "store" | "box"
    box_root: Optional[str] = None  # the box directory Entry.src is relative to
    store: Optional[Store] = None  # for the entries without ``src``: the store's bytes


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress report. ``phase`` is "fetch", "verify" or "done"; ``path`` the file
    concerned (relative to DEST, "" for a total). Reported from a background thread while
    fetching, from the caller's thread otherwise."""

    phase: str
    path: str
    done: int
    size: int
    total_done: int
    total: int


ProgressFn = Callable[[Progress], None]


def resolve_source(rec: RunRecord, source: str) -> str:
    """Where to pull from, "box" or "store", for ``source`` "box", "store" or "auto" (see the
    module docstring)."""
    if source not in SOURCES:
        raise UsageError("--from", f"{source!r} is not box or store")
    if source != "auto":
        if source == "store" and not rec.store:
            raise UsageError("--from", f"run {rec.name!r} has no store", "pull it with --from box")
        return source
    if not rec.store:
        return "box"
    if _file_root(rec.store) is not None and rec.target.kind != "local":
        return "box"  # a file:// store is a mount on the box
    return "store"


def _file_root(url: str) -> Optional[str]:
    if not url.lower().startswith("file:"):
        return None
    store = open_store(url)
    assert isinstance(store, LocalStore)
    return store.root


def read_sealed(rec: RunRecord, source: str, remote: Optional[Remote] = None) -> Sealed:
    """The newest sealed state of ``rec`` as ``source`` ("box" or "store") sees it, every final
    and staging name checked (``_checked``) before anything is created on the laptop."""
    return _checked(_read_sealed(rec, source, remote), f"pull of {rec.name}")


def _checked(sealed: Sealed, what: str) -> Sealed:
    """``sealed`` when every final name (``Entry.path``) and staging name (``Entry.stage``)
    is a plain relative path (onbox.common.safepath.safe_rel) that cannot collide with rgt's own
    files, a final one lies under checkpoints/, outputs/ or logs/, and no name is a directory
    on the way to another; else UnsafePath (exit 6) naming the path."""
    for e in sealed.entries:
        safe_rel(e.path, f"{what}: the file")
        safe_rel(e.stage, f"{what}: the staging name of {e.path!r}")
        if e.path.split("/", 1)[0] not in _KINDS:
            raise UnsafePath(
                f"{what}: {e.path!r} is not under checkpoints/, outputs/, logs/", e.path
            )
        first = e.stage.split("/", 1)[0]
        if first in (_LOCK, _FILES_FROM) or first.startswith(_COPY):
            raise UnsafePath(f"{what}: the staging name {e.stage!r} is one of rgt's own", e.stage)
    for kind, names in (
        ("file", [e.path for e in sealed.entries]),
        ("source", [e.stage for e in sealed.entries]),
    ):
        both = conflicts(names)
        if both is not None:
            raise UnsafePath(
                f"{what}: the {kind} {both[0]!r} is listed, and so is {both[1]!r} under it", both[1]
            )
    return sealed


def _read_sealed(rec: RunRecord, source: str, remote: Optional[Remote]) -> Sealed:
    run = rec.name
    if source == "store":
        assert rec.store
        root = _file_root(rec.store)
        if root is not None and not os.path.isdir(root):
            raise UsageError(
                "--from",
                f"the store {rec.store} is not a directory on this laptop",
                "a file:// store is a path on the box: pull with --from box",
            )
        store = open_store(rec.store)
        ident, entries = _from_documents(
            run, functools.partial(_store_get, store), functools.partial(_store_listing, store, run)
        )
        entries = [dataclasses.replace(e, origin=e.key or "") for e in entries]
        return Sealed(ident, entries, "store", store=store)
    assert remote is not None
    if not rec.store:
        return _box_files(rec, remote)
    root = _file_root(rec.store)
    if root is not None:
        docs = _BoxDocs(remote, root)
        docs.prefetch([mf.latest_key(run), mf.done_key(run)], run=run)  # one round trip
        ident, entries = _from_documents(run, docs.get, functools.partial(docs.listing, run))
        entries = [
            dataclasses.replace(e, src=e.key, origin=_join(root, e.key or "")) for e in entries
        ]
        return Sealed(ident, entries, "box", box_root=root)
    # s3://, hf://: the store says what is sealed; the box holds copies of the bytes.
    store = open_store(rec.store)
    ident, entries = _from_documents(
        run, functools.partial(_store_get, store), functools.partial(_store_listing, store, run)
    )
    spec = box_spec(rec, remote)
    run_dir = box_run_dir(rec)
    ckpt, workdir = _spec_dirs(rec, spec, remote)
    placed = []
    for e in entries:
        if e.redacted:  # the box's own log holds the secret: the store's masked copy, verified
            placed.append(dataclasses.replace(e, origin=e.key or ""))
            continue
        if e.kind == "checkpoint":
            path = _join(ckpt, e.path[len("checkpoints/") :])
        elif e.kind == "output":
            path = _join(workdir, e.path[len("outputs/") :])
        else:
            m = _LOG.match(e.path[len("logs/") :])
            if not m:
                raise IntegrityError(f"DONE.json lists a log {e.path!r} rgt did not write")
            path = _join(run_dir, "attempts", m.group(1), "output.log")
        placed.append(dataclasses.replace(e, src=path[1:], origin=path))
    return Sealed(ident, placed, "box", box_root="/", store=store)


def _spec_dirs(rec: RunRecord, spec: Dict[str, Any], remote: Remote) -> Tuple[str, str]:
    """``ckpt_dir`` and ``workdir`` of the box's spec.json, refused (exit 6) unless absolute
    and normalised as the agent writes them: they become staging names on the laptop."""
    where = f"spec.json of {rec.name!r} on {remote.target.label}"
    remedy = "the agent writes them absolute and normalised: the box's spec.json was altered"
    return (
        safe_abs(spec.get("ckpt_dir"), f"{where}: ckpt_dir", remedy),
        safe_abs(spec.get("workdir"), f"{where}: workdir", remedy),
    )


def _join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def _store_get(store: Store, key: str) -> Optional[bytes]:
    return with_retries(lambda: store.get_bytes(key))


# (sealed steps, {quarantined step: reason}) of a run, as the store lists them.
Listing = Callable[[], Tuple[List[int], Dict[int, str]]]


def _store_listing(store: Store, run: str) -> Tuple[List[int], Dict[int, str]]:
    bad = quarantine_reasons(store, run)
    return (with_retries(lambda: sealed_steps(store, run)) if bad else []), bad


class _BoxDocs:
    """Documents of a file:// store on the box, read over ssh, several per round trip.

    ``prefetch(..., run=RUN)`` also reads, in the same round trip, the MANIFEST of the step that
    RUN's LATEST.json names as the box reads it (the step found with sed in rgt's own format of
    that document): the caller parses LATEST itself and asks for its MANIFEST by key, which is
    then served from what was read, or read in a round trip of its own when the two differ."""

    _SCRIPT = r"""doc() {
  if [ -f "$1" ]; then s=$(wc -c < "$1") || exit 45; echo "F" $s; cat -- "$1" || exit 45
  else echo N; fi
}
latest=$1; checkpoints=$2; shift 2
for f do doc "$f"; done
if [ -n "$latest" ] && [ -f "$latest" ]; then
  step=$(sed -n 's/^ *"step": *\([0-9][0-9]*\),\{0,1\}$/\1/p' "$latest" | head -n 1)
  if [ -n "$step" ]; then echo "S $step"; doc "$checkpoints/$step/MANIFEST.json"; fi
fi"""

    def __init__(self, remote: Remote, root: str) -> None:
        self.remote = remote
        self.root = root
        self.cache: Dict[str, Optional[bytes]] = {}

    def prefetch(self, keys: List[str], run: Optional[str] = None) -> None:
        along = ("", "")
        if run is not None:
            along = (_join(self.root, mf.latest_key(run)), _join(self.root, run, "checkpoints"))
        for _ in range(3):  # a document replaced between its size and its bytes: read again
            r = self.remote.sh(self._SCRIPT, *along, *[_join(self.root, k) for k in keys])
            if r.rc != 0:
                raise HostError(
                    f"cannot read the store's documents under {self.root} on "
                    f"{self.remote.target.label}: {r.err.strip()[-300:]}"
                )
            got = _split_docs(r.stdout, len(keys))
            if got is not None:
                docs, step, manifest = got
                self.cache.update(zip(keys, docs))
                if run is not None and step is not None:
                    self.cache[mf.manifest_key(run, step)] = manifest
                return
        raise HostError(f"the store's documents under {self.root} keep changing while read")

    def get(self, key: str) -> Optional[bytes]:
        if key not in self.cache:
            self.prefetch([key])
        return self.cache[key]

    # The steps with a MANIFEST ("S STEP") and each quarantine record ("Q STEP", then the
    # record as ``doc`` prints it), in one round trip.
    _LISTING = r"""doc() {
  if [ -f "$1" ]; then s=$(wc -c < "$1") || exit 45; echo "F" $s; cat -- "$1" || exit 45
  else echo N; fi
}
for m in "$1"/checkpoints/*/MANIFEST.json; do
  [ -f "$m" ] || continue; s=${m%/MANIFEST.json}; echo "S ${s##*/}"
done
for q in "$1"/quarantine/*.json; do
  [ -f "$q" ] || continue; n=${q##*/}; echo "Q ${n%.json}"; doc "$q"
done"""

    def listing(self, run: str) -> Tuple[List[int], Dict[int, str]]:
        """The run's sealed steps and quarantined steps (with reasons), as the box sees the
        store. Names that are not steps rgt writes are left out."""
        r = self.remote.sh(self._LISTING, _join(self.root, run))
        if r.rc != 0:
            raise HostError(
                f"cannot list the store under {self.root} on {self.remote.target.label}: "
                f"{r.err.strip()[-300:]}"
            )
        return _split_listing(r.stdout)


def _is_step(raw: bytes) -> bool:
    return 0 < len(raw) <= 18 and raw.isdigit() and raw == str(int(raw)).encode()


def _split_listing(out: bytes) -> Tuple[List[int], Dict[int, str]]:
    """What _BoxDocs._LISTING printed: (sealed steps, {quarantined step: reason})."""
    sealed: List[int] = []
    bad: Dict[int, str] = {}
    pos = 0
    while pos < len(out):
        end = out.find(b"\n", pos)
        if end < 0:
            raise HostError("the store's listing on the box was cut short")
        head = out[pos:end].split(b" ", 1)
        pos = end + 1
        if len(head) != 2 or head[0] not in (b"S", b"Q"):
            raise HostError(f"the store's listing on the box has a line rgt never writes: {head!r}")
        if head[0] == b"S":
            if _is_step(head[1]):
                sealed.append(int(head[1]))
            continue
        end = out.find(b"\n", pos)
        doc = out[pos:end].split() if end >= 0 else []
        if doc == [b"N"]:
            pos = end + 1
            continue
        if len(doc) != 2 or doc[0] != b"F" or not doc[1].isdigit():
            raise HostError("the store's listing on the box was cut short")
        size = int(doc[1])
        data = out[end + 1 : end + 1 + size]
        pos = end + 1 + size
        if _is_step(head[1]):
            bad[int(head[1])] = quarantine_reason(data)
    return sorted(sealed), bad


_STEP_LINE = re.compile(rb"S ([0-9]+)\n")


def _split_docs(
    out: bytes, n: int
) -> Optional[Tuple[List[Optional[bytes]], Optional[int], Optional[bytes]]]:
    """The ``n`` documents _BoxDocs._SCRIPT printed, and the step and MANIFEST it read along
    (None, None when it read none); None when the output does not add up."""

    def one(pos: int) -> Optional[Tuple[Optional[bytes], int]]:
        end = out.find(b"\n", pos)
        if end < 0:
            return None
        head = out[pos:end].split()
        if head == [b"N"]:
            return None, end + 1
        if len(head) != 2 or head[0] != b"F" or not head[1].isdigit():
            return None
        size = int(head[1])
        if end + 1 + size > len(out):
            return None
        return out[end + 1 : end + 1 + size], end + 1 + size

    docs: List[Optional[bytes]] = []
    pos = 0
    for _ in range(n):
        got = one(pos)
        if got is None:
            return None
        docs.append(got[0])
        pos = got[1]
    if pos == len(out):
        return docs, None, None
    m = _STEP_LINE.match(out, pos)
    got = one(m.end()) if m else None
    if m is None or got is None or got[1] != len(out):
        return None
    step = m.group(1)
    if len(step) > 18 or step != str(int(step)).encode():  # not a step rgt writes: unused
        return docs, None, None
    return docs, int(step), got[0]


def _box_read(remote: Remote, path: str) -> Optional[bytes]:
    r = remote.sh('[ -f "$1" ] || exit 44; exec cat -- "$1"', path)
    if r.rc == 44:
        return None
    if r.rc != 0:
        raise HostError(f"cannot read {path} on {remote.target.label}: {r.err.strip()}")
    return r.stdout


def box_run_dir(rec: RunRecord) -> str:
    """The run's directory on the box ($RGT_HOME/runs/NAME)."""
    if not rec.box_home.startswith("/"):
        raise UsageError(
            "run", f"the record of {rec.name!r} has no RGT_HOME on the box", "deploy it again"
        )
    # The box reported its RGT_HOME at deploy: it becomes part of staging names here.
    home = safe_abs(rec.box_home.rstrip("/") or "/", f"RGT_HOME of {rec.name!r} on the box")
    return _join(home, "runs", safe_rel(rec.name, "run name"))


def box_spec(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """The run's spec.json on the box (NotFound when its directory is gone)."""
    path = _join(box_run_dir(rec), "spec.json")
    data = _box_read(remote, path)
    if data is None:
        raise NotFound(
            f"run {rec.name!r} has no run directory on {remote.target.label} ({path})",
            "was it taken down? pull --from store",
        )
    try:
        doc = json.loads(data)
    except ValueError:
        raise IntegrityError(f"{path} on {remote.target.label} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{path} on {remote.target.label} is not a JSON object")
    return doc


def box_state(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """``rgt-agent status N --json`` on the box."""
    r = remote.run(rec.agent_argv("status", rec.name, "--json"), env=None, timeout=60)
    if r.rc != 0:
        raise HostError(
            f"rgt-agent status {rec.name} failed on {remote.target.label} (exit {r.rc}): "
            f"{r.err.strip()[-300:]}"
        )
    try:
        doc: Dict[str, Any] = json.loads(r.stdout)
    except ValueError:
        raise HostError(f"rgt-agent status {rec.name} printed no JSON") from None
    return doc


def _check_doc_file(f: Any, what: str, run: str) -> None:
    if not isinstance(f, dict):
        raise IntegrityError(f"{what}: a malformed file entry {f!r}")
    safe_rel(f.get("path"), f"{what}: path")
    safe_rel(f.get("key"), f"{what}: key")
    ok = (
        isinstance(f.get("size"), int)
        and f["size"] >= 0
        and isinstance(f.get("sha256"), str)
        and _SHA.match(f["sha256"]) is not None
        and f["key"].startswith(run + "/")
    )
    if not ok:
        raise IntegrityError(f"{what}: a malformed file entry {f!r}")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _from_documents(
    run: str, get: Callable[[str], Optional[bytes]], listing: Optional[Listing] = None
) -> Tuple[SealedId, List[Entry]]:
    """LATEST -> MANIFEST, and DONE: the sealed state and its files. When LATEST names a
    quarantined step (``listing`` says which are), the newest sealed step before it that is
    not quarantined is the sealed state instead (onbox.sealing.restore.in_effect), and ``note`` says
    so; a run with none left is an IntegrityError."""
    latest = mf.parse_latest(get(mf.latest_key(run)))
    entries: List[Entry] = []
    step = epoch = None
    mkey = msha = note = None
    if latest is not None:
        step = latest["step"]
        epoch = latest.get("epoch") if isinstance(latest.get("epoch"), int) else None
        sealed, bad = listing() if listing is not None else ([], {})
        if step in bad:
            effective, note = in_effect(step, sealed, bad)
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
        msha = _sha(data)
        if note is not None and isinstance(doc.get("epoch"), int):
            epoch = doc["epoch"]
        for f in doc["files"]:
            _check_doc_file(f, mkey, run)
            entries.append(
                Entry("checkpoints/" + f["path"], "checkpoint", f["size"], f["sha256"], f["key"])
            )
    done_raw = get(mf.done_key(run))
    done_sha = None
    missing_outputs: Tuple[str, ...] = ()
    if done_raw is not None:
        done_sha = _sha(done_raw)
        try:
            done = json.loads(done_raw)
        except ValueError:
            raise IntegrityError(f"{mf.done_key(run)} is not valid JSON") from None
        files = done.get("files") if isinstance(done, dict) else None
        if not isinstance(files, list):
            raise IntegrityError(f"{mf.done_key(run)} lists no files")
        for f in files:
            _check_doc_file(f, mf.done_key(run), run)
            tail = f["key"][len(run) + 1 :]
            kind = tail.split("/", 1)[0]
            if kind == "results" and f.get("root") == "ckpt":
                # A file the job left in RGT_CKPT_DIR that no checkpoint holds (result.txt):
                # beside LATEST's files, at its path under the checkpoint dir, as a pull
                # without a store puts it (onbox/agent/sealservice.py _put_results).
                entries.append(
                    Entry(
                        "checkpoints/" + f["path"], "checkpoint", f["size"], f["sha256"], f["key"]
                    )
                )
                continue
            if kind not in ("outputs", "logs"):
                raise IntegrityError(f"{mf.done_key(run)} lists {f['key']}, not an output or log")
            redacted = f.get("redacted") is True
            entries.append(
                Entry(tail, kind[:-1], f["size"], f["sha256"], f["key"], redacted=redacted)
            )
        missing = done.get("missing_outputs")
        if isinstance(missing, list):
            missing_outputs = tuple(str(m) for m in missing)
    if latest is None and done_raw is None:
        raise NotFound(
            f"run {run!r} has nothing sealed yet (no LATEST.json, no DONE.json)",
            f"wait for its first sealed checkpoint (rgt status {run})",
        )
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
    )
    return ident, entries


# Hidden and temporary names are skipped, as the sealer skips them (torn writes live there).
# Each file comes out as four NUL-terminated fields: kind, sha256, size, path.
_LIST_SCRIPT = r"""
hash_files='for f do h=$(sha256sum < "$f") || exit 45; s=$(wc -c < "$f") || exit 45
  printf "%s\0%s\0%s\0%s\0" "$K" "${h%% *}" $s "$f"; done'
while [ $# -ge 2 ]; do
  K=$1; p=$2; shift 2; export K
  if [ -f "$p" ]; then sh -c "$hash_files" rgt "$p" || exit 45
  elif [ -d "$p" ]; then
    find "$p" -mindepth 1 \( -name '.*' -o -name '*.tmp' -o -name '*.tmp.*' -o -name '*.partial' \
      -o -name '*.part' -o -name '*.lock' -o -name '*~' -o -name '*.rgt-*' \) -prune \
      -o -type f -exec sh -c "$hash_files" rgt {} + || exit 45
  fi
done
"""


def _box_files(rec: RunRecord, remote: Remote) -> Sealed:
    """A run without a store: its files on the box, hashed there (see the module docstring).

    Every name the box prints must lie under the directory it was asked to list (absolute,
    normalised, as ``_spec_dirs`` requires of the roots); the staging name is that path on the
    box, the final name the part under the root, both checked by ``_checked``."""
    spec = box_spec(rec, remote)
    status = _let_go(rec, remote)
    run_dir = box_run_dir(rec)
    ckpt, workdir = _spec_dirs(rec, spec, remote)
    attempts = _join(run_dir, "attempts")
    # (kind, the path listed, the directory final names are relative to, their prefix)
    roots = [("checkpoint", ckpt, ckpt, "checkpoints/"), ("log", attempts, attempts, "logs/")]
    outputs = spec.get("outputs") or []
    if not isinstance(outputs, list):
        raise IntegrityError(f"spec.json of {rec.name!r}: outputs is not a list")
    for out in outputs:
        # The agent keeps outputs as the job file gave them ("out/", "./out"): normalised
        # here, then refused if anything but a plain path under the workdir is left.
        parts = [p for p in str(out).split("/") if p not in ("", ".")]
        rel = (
            safe_rel("/".join(parts), f"spec.json of {rec.name!r}: output {out!r}") if parts else ""
        )
        roots.append(("output", _join(workdir, rel) if rel else workdir, workdir, "outputs/"))
    args: List[str] = []
    for kind, listed, _, _ in roots:
        args += [kind, listed]
    r = remote.sh(_LIST_SCRIPT, *args, timeout=3600)
    if r.rc != 0:
        raise HostError(
            f"listing and hashing the files of {rec.name!r} on {remote.target.label} failed: "
            f"{r.err.strip()[-300:]}"
        )
    fields = r.stdout.split(b"\0")
    if len(fields) % 4 != 1 or fields[-1] != b"":
        raise IntegrityError(
            f"the listing of {rec.name!r}'s files on {remote.target.label} does not add up "
            f"({len(fields) - 1} fields, not four per file)"
        )
    entries: Dict[str, Entry] = {}
    logs: Dict[Tuple[str, bool], Entry] = {}  # (attempt, redacted copy?) -> its entry
    for i in range(0, len(fields) - 1, 4):
        kind, sha, size, raw = (x.decode("utf-8", "surrogateescape") for x in fields[i : i + 4])
        if not _SHA.match(sha) or not size.isdigit() or not size.isascii():
            raise IntegrityError(f"the box listed {raw!r} with a malformed hash or size")
        root = next(
            (x for x in roots if x[0] == kind and (raw == x[1] or raw.startswith(x[1] + "/"))),
            None,
        )
        if root is None:
            raise UnsafePath(
                f"the box listed {raw!r} as a {kind}, outside every directory it was asked to list",
                raw,
            )
        _, _, base, prefix = root
        rel = raw[len(base) + 1 :]
        if kind == "log":
            m = re.match(r"(\d{4,})/output(\.redacted)?\.log\Z", rel)
            if m:  # else the attempt's job.json/exit.json: rgt's records, not the job's log
                path = f"{prefix}attempt-{m.group(1)}.log"
                red = m.group(2) is not None
                logs[(m.group(1), red)] = Entry(path, kind, int(size), sha, None, raw[1:], raw, red)
            continue
        path = prefix + rel
        entries[path] = Entry(path, kind, int(size), sha, None, raw[1:], raw)
    entries.update(_job_logs(rec, remote, status, logs))
    if not entries:
        raise NotFound(f"run {rec.name!r} has no files on {remote.target.label} to pull")
    listing = "".join(
        f"{e.path}\0{e.size}\0{e.sha256}\n" for e in sorted(entries.values(), key=lambda e: e.path)
    )
    return _checked(
        Sealed(
            SealedId(listing_sha256=_sha(listing.encode("utf-8", "surrogateescape"))),
            list(entries.values()),
            "box",
            box_root="/",
        ),
        f"pull of {rec.name}",
    )


# Seconds a pull of a run without a store waits for the agent of a run that has ended to let go
# of it (it stops what is left of the attempt, then writes the redacted copies of the logs).
AGENT_EXIT_WAIT = 60.0


def _let_go(rec: RunRecord, remote: Remote, wait: float = AGENT_EXIT_WAIT) -> Dict[str, Any]:
    """The status of a run without a store, once it has ended and its agent has let go of it
    (then no file of it is being written, and each job log that holds a secret has its
    redacted copy). A run that has not ended is refused."""
    deadline = time.monotonic() + wait
    while True:
        status = box_state(rec, remote)
        state = status.get("state")
        if state not in TERMINAL_NAMES:
            raise UsageError(
                "run",
                f"{rec.name!r} is {state} and has no store: its files are still being written",
                f"stop it first (rgt stop {rec.name}), or deploy with --store",
            )
        agent = status.get("agent")
        if not (isinstance(agent, dict) and agent.get("alive")):
            return status
        if time.monotonic() >= deadline:
            raise HostError(
                f"run {rec.name!r} is {state}, but its agent on {remote.target.label} has not "
                f"let go of it after {wait:.0f}s",
                f"look at `rgt-agent logs {rec.name} --agent` on the box, then pull again",
            )
        time.sleep(0.2)


def _job_logs(
    rec: RunRecord, remote: Remote, status: Dict[str, Any], logs: Dict[Tuple[str, bool], Entry]
) -> Dict[str, Entry]:
    """The job's log of each attempt as a run without a store is pulled: the redacted copy
    where the agent wrote one (the log holds a secret), else the log. A log the agent found a
    secret in but could not copy (its warning has ``copy`` null) is refused (HostError): rgt
    does not bring the secret to the laptop."""
    no_copy = set()
    for w in status.get("warnings") or []:
        if isinstance(w, dict) and w.get("kind") == "secret_in_log" and w.get("copy", 0) is None:
            no_copy.add(w.get("attempt"))
    out = {}
    for attempt in sorted({a for a, _ in logs}):
        e = logs.get((attempt, True)) or logs[(attempt, False)]
        if not e.redacted and int(attempt) in no_copy:
            raise HostError(
                f"pull of {rec.name}: the job's log of attempt {int(attempt)} on "
                f"{remote.target.label} ({e.origin}) holds a secret and the agent could not "
                "write a redacted copy of it, so rgt does not bring it to the laptop; nothing "
                "was fetched",
                f"read it on the box (rgt logs {rec.name}); to pull the rest, move it out of "
                "the run's directory there and pull again",
            )
        out[e.path] = e
    return out


# ---- fetching


def _stage_path(stage_dir: str, e: Entry) -> str:
    return safe_join(stage_dir, e.stage, "staging name")


def _stage_dirs(stage_dir: str, e: Entry) -> None:
    """The directories of ``e``'s staging name, made (0700) where missing, none a symlink."""
    os.close(open_dir(stage_dir, e.stage.split("/")[:-1], create=True, mode=0o700))


def _file_sha(path: str) -> Tuple[int, str]:
    # Into one reused buffer: about a tenth less CPU per byte than a new bytes object per read.
    h = hashlib.sha256()
    buf = bytearray(HASH_BUFFER)
    view = memoryview(buf)
    n = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n, h.hexdigest()
            h.update(view[:k])
            n += k


class _Monitor:
    """Reports fetch progress by watching the temporary files grow (every transport), and
    each file the moment a transport says it is finished."""

    def __init__(self, stage_dir: str, items: List[Entry], fn: Optional[ProgressFn]) -> None:
        self.stage_dir = stage_dir
        self.items = items
        self.fn = fn
        self.total = sum(e.size for e in items)
        self.seen: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> _Monitor:
        if self.fn is not None:
            self._thread = threading.Thread(
                target=self._loop, name="rgt-pull-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if exc[0] is None:
                self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.poll()

    def _size(self, e: Entry) -> int:
        try:
            return min(os.path.getsize(_stage_path(self.stage_dir, e)), e.size)
        except OSError:
            return 0

    def poll(self) -> None:
        if self.fn is None:
            return
        with self._lock:
            sizes = {e.stage: self._size(e) for e in self.items}
            for e in self.items:
                self._report(e, sizes[e.stage], sizes)

    def finished(self, e: Entry) -> None:
        """A transport finished ``e`` (its copy is complete, not yet verified)."""
        if self.fn is None:
            return
        with self._lock:
            sizes = {x.stage: self.seen.get(x.stage, 0) for x in self.items}
            sizes[e.stage] = e.size
            self._report(e, e.size, sizes)

    def _report(self, e: Entry, size: int, sizes: Dict[str, int]) -> None:
        assert self.fn is not None
        if self.seen.get(e.stage) != size:
            self.seen[e.stage] = size
            done = sum(sizes.values())
            self.fn(Progress("fetch", e.path, size, e.size, done, self.total))


_Sig = Tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode


def _sig(path: str) -> _Sig:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class _Checker:
    """Hashes each temporary copy, and fsyncs it, as soon as its transport has finished it,
    while the next files are still being fetched, so that verification and durability overlap
    the transfer instead of following it.

    A hash made here stands only when nothing can have changed the copy since: the transport
    did not announce the file again (a transport announces a file each time it has finished
    writing it; ``finished`` then queues a new hash and the old one is discarded), and the
    copy's size, mtime, ctime and inode are the same before the hash, after the fsync and when
    the verification asks (``result``). Otherwise the verification hashes the copy itself."""

    def __init__(self, stage_dir: str) -> None:
        self.stage_dir = stage_dir
        self._lock = threading.Lock()
        self._jobs: Dict[str, Future[Optional[Tuple[int, str, _Sig]]]] = {}
        self._pool = ThreadPoolExecutor(HASHERS, thread_name_prefix="rgt-pull-hash")

    def finished(self, e: Entry) -> None:
        """The transport has written ``e``'s copy completely (not verified yet)."""
        with self._lock:
            old = self._jobs.get(e.stage)
            if old is not None:
                old.cancel()
            self._jobs[e.stage] = self._pool.submit(self._hash, _stage_path(self.stage_dir, e))

    @staticmethod
    def _hash(path: str) -> Optional[Tuple[int, str, _Sig]]:
        failed: List[BaseException] = []

        def fsync() -> None:
            try:
                fsync_file(path)
            except BaseException as e:
                failed.append(e)

        try:
            before = _sig(path)
            if before[0] < PARALLEL_FSYNC:
                size, sha = _file_sha(path)
                fsync()
            else:  # the fsync (the disk) runs while the hash (a core) reads the cached pages
                writer = threading.Thread(target=fsync, name="rgt-pull-fsync", daemon=True)
                writer.start()
                try:
                    size, sha = _file_sha(path)
                finally:
                    writer.join()
            after = _sig(path)
        except OSError:
            return None
        if failed or before != after or size != after[0]:
            return None
        return size, sha, after

    def result(self, e: Entry) -> Optional[Tuple[int, str]]:
        """(size, sha256) of ``e``'s copy as hashed (and fsynced) during the fetch, when that
        still describes the copy; None when the copy must be hashed now."""
        with self._lock:
            job = self._jobs.get(e.stage)
        if job is None:
            return None
        try:
            done = job.result()
        except Exception:  # cancelled, or the hash failed: the verification hashes it itself
            return None
        if done is None:
            return None
        size, sha, sig = done
        try:
            if _sig(_stage_path(self.stage_dir, e)) != sig:
                return None
        except OSError:
            return None
        return size, sha

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _fetch_store(
    store: Store, items: List[Entry], stage_dir: str, finished: Callable[[Entry], None]
) -> int:
    fetched = 0
    for e in items:
        assert e.key is not None
        tmp = _stage_path(stage_dir, e)
        _stage_dirs(stage_dir, e)
        with_retries(functools.partial(store.get_file, e.key, tmp))  # creates it, O_EXCL
        fetched += e.size
        finished(e)
    return fetched


class _NoRemoteRsync(Exception):
    """The box has no rsync: the caller falls back to streaming."""


_XFER = re.compile(rb"rgt-xfer (\d+) (.*)\Z")
_ESCAPE = re.compile(rb"\\#([0-7]{3})")


def _rsync_name(raw: bytes) -> bytes:
    """A file name as rsync logs it, unescaped: rsync writes each byte it will not print as it
    is (a control character; a byte outside ASCII, unless the locale prints it; the backslash of
    a ``\\#ddd`` in the name) as ``\\#`` and three octal digits."""
    return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), raw)


def _fetch_rsync(
    remote: Remote,
    root: str,
    items: List[Entry],
    stage_dir: str,
    bwlimit: Optional[int],
    finished: Callable[[Entry], None],
) -> int:
    """One rsync for every file: --inplace into its temporary name, so a killed transfer
    leaves its bytes there and the next one sends only the rest (delta against them).

    rsync's receiver takes one file at a time: once it has received a file, it logs it
    (``--out-format``), and only then closes it and sets its mtime; a file that fails rsync's
    own check is received again later, and logged again. So a file is handed to ``finished``
    once rsync has logged another file after it, or has exited: then rsync is done with it,
    unless it logs it again (then it is handed over again)."""
    listing = os.path.join(stage_dir, _FILES_FROM)
    fd = open_beneath(stage_dir, _FILES_FROM, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with open(fd, "wb") as f:
        f.write(b"\0".join(e.src.encode("utf-8", "surrogateescape") for e in items if e.src))
    by_name = {e.src.encode("utf-8", "surrogateescape"): e for e in items if e.src}
    argv = [
        "rsync", "-s", "-t", "--inplace", "--partial", "--no-whole-file",
        "--from0", f"--files-from={listing}", "--out-format=rgt-xfer %b %n",
    ]  # fmt: skip
    if bwlimit:
        argv.append(f"--bwlimit={int(bwlimit)}")
    shell = remote.rsync_shell()
    if shell:
        argv += ["-e", rsync_e(shell)]
    argv += [remote.path_arg(root.rstrip("/") + "/"), stage_dir + "/"]
    p = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdout is not None and p.stderr is not None
    errors: List[bytes] = []
    stderr = p.stderr
    drain = threading.Thread(target=lambda: errors.append(stderr.read()), daemon=True)
    drain.start()
    fetched = 0
    pending: Optional[Entry] = None
    try:
        for line in p.stdout:  # rsync flushes each line as it logs it
            m = _XFER.match(line.rstrip(b"\n"))
            if m is None:
                continue
            fetched += int(m.group(1))
            e = by_name.get(_rsync_name(m.group(2)))
            if e is None:
                continue
            if pending is not None and pending is not e:
                finished(pending)
            pending = e
    except BaseException:
        p.kill()
        raise
    finally:
        p.stdout.close()
        rc = p.wait()
        drain.join()
        stderr.close()
    err = b"".join(errors)
    if rc in (0, 23, 24):  # 23/24: some files missing; verification names them
        if pending is not None:
            finished(pending)
        return fetched
    if rc == 12 and re.search(rb"rsync: (command )?not found", err):
        raise _NoRemoteRsync()
    if shell:
        remote.check_transport(rc, err)
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    if rc in (10, 12, 30, 35):
        raise RemoteUnreachable(
            f"rsync from {remote.target.label} broke off (exit {rc}): {last[0]}",
            "run the pull again: it continues where it stopped",
        )
    raise HostError(f"rsync from {remote.target.label} failed (exit {rc}): {last[0]}")


def _fetch_stream(
    remote: Remote,
    root: str,
    items: List[Entry],
    stage_dir: str,
    finished: Callable[[Entry], None],
) -> int:
    """Without rsync on one end: ``tail -c +N`` over ssh appends what the partial copy lacks."""
    fetched = 0
    for e in items:
        assert e.src is not None
        _stage_dirs(stage_dir, e)
        # The partial copy a killed pull left is appended to; a new one is created O_EXCL. Both
        # O_NOFOLLOW, through directories walked without following symlinks.
        try:
            fd = open_beneath(stage_dir, e.stage, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            fd = open_beneath(
                stage_dir, e.stage, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
            )
        with open(fd, "ab") as out:
            have = os.fstat(fd).st_size
            if have > e.size:
                os.ftruncate(fd, 0)
                have = 0
            if have == e.size:
                continue
            p = remote.popen(["tail", "-c", f"+{have + 1}", "--", _join(root, e.src)])
            assert p.stdout is not None
            try:
                while True:
                    b = p.stdout.read(CHUNK)
                    if not b:
                        break
                    out.write(b)
                    fetched += len(b)
            finally:
                p.stdout.close()
                rc = p.wait()
        if rc != 0:
            remote.check_transport(rc, b"")
            raise HostError(f"reading {e.origin} on {remote.target.label} failed (exit {rc})")
        finished(e)
    return fetched


# ---- opening checkpoints as their frameworks would

_ST_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit
# torch.save's format before the zip one: a protocol-2 pickle of a 10-byte magic number first.
_TORCH_LEGACY = b"\x80\x02\x8a\x0a"


def check_safetensors(path: str, name: str) -> None:
    """Parse a safetensors file as the library does: the 8-byte header length, the JSON
    header, and every tensor's offsets inside the data, contiguous, sized by dtype and shape."""

    def bad(why: str) -> IntegrityError:
        return IntegrityError(
            f"{name}: not a valid safetensors file ({why})",
            "its sha256 matches the manifest: the job wrote it like this",
        )

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _ST_MAX_HEADER or 8 + n > size:
            raise bad(f"header length {n} does not fit in {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
                raise bad("__metadata__ is not a map of strings")
            continue
        try:
            dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in [*shape, b, e]):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has no valid dtype, shape and data_offsets") from None
        if not b <= e <= data_len:
            raise bad(f"tensor {key!r} spans bytes {b}..{e} of {data_len}")
        width = _ST_DTYPES.get(dtype)
        if width is not None:
            count = 1
            for d in shape:
                count *= d
            if count * width != e - b:
                raise bad(
                    f"tensor {key!r}: {dtype}{shape} needs {count * width} bytes, has {e - b}"
                )
        spans.append((b, e, key))
    pos = 0
    for b, e, key in sorted(spans):
        if b != pos:
            raise bad(f"tensor {key!r} starts at {b}, the previous one ends at {pos}")
        pos = e
    if pos != data_len:
        raise bad(f"the tensors end at byte {pos} of {data_len}")


def check_torch(path: str, name: str) -> str:
    """Open a torch file with ``torch.load(weights_only=True)``; how it was verified."""
    with open(path, "rb") as f:
        magic = f.read(4)
    is_zip = magic == b"PK\x03\x04"
    if is_zip:
        try:
            with zipfile.ZipFile(path) as z:
                is_torch = any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
        except zipfile.BadZipFile:
            is_torch = True  # torch's own reader will say what is wrong
        if not is_torch:
            return "sha256 (a zip file, not a torch checkpoint: not opened)"
    elif magic != _TORCH_LEGACY:
        return "sha256 (not a torch file: not opened)"
    try:
        import torch
    except ImportError:
        return "sha256 only (torch is not installed here: not opened)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, weights_only=True, map_location="cpu", mmap=is_zip)
        del obj
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            return "sha256 + torch.load(weights_only=True) refused a non-tensor object"
        raise _torch_error(name, e) from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ValueError, ...
        raise _torch_error(name, e) from None
    return "sha256 + torch.load(weights_only=True)"


def _torch_error(name: str, e: BaseException) -> IntegrityError:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return IntegrityError(
        f"{name}: torch.load cannot open it ({type(e).__name__}: {first})",
        "its sha256 matches the manifest: the job wrote a damaged checkpoint",
    )


def check_format(path: str, name: str) -> str:
    """Open ``path`` (a file named ``name``) as its framework would; how it was verified."""
    low = name.lower()
    if low.endswith(".safetensors"):
        check_safetensors(path, name)
        return "sha256 + safetensors header"
    if low.endswith(TORCH_SUFFIXES):
        return check_torch(path, name)
    return "sha256"


# ---- the pull


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("remote-gpu-trainer")
    except Exception:
        return ""


def _make_stage(stage_dir: str) -> None:
    """The staging directory: made here 0700, or left by an earlier pull of this user (then a
    real directory of this user's, not a symlink); nothing else is staged into."""
    try:
        os.mkdir(stage_dir, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(stage_dir)
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(stage_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafePath(
            f"{stage_dir} is not a staging directory this user made",
            stage_dir,
            "remove it, or pull into another --to",
        )


@contextlib.contextmanager
def _stage_lock(stage_dir: str) -> Iterator[None]:
    fd = open_beneath(stage_dir, _LOCK, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                "--to", f"another pull into {os.path.dirname(stage_dir)} is running"
            ) from None
        yield
    finally:
        os.close(fd)


def _mismatch(stage_dir: str, e: Entry) -> Optional[str]:
    """None when the temporary copy of ``e`` has its size and sha256, else what it has."""
    path = _stage_path(stage_dir, e)
    try:
        size, sha = _file_sha(path)
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
) -> Receipt:
    """Pull ``rec``'s newest sealed state into ``dest``, verify it, write the receipt.

    ``source``: "box", "store" or "auto" (module docstring). ``bwlimit``: KiB/s for rsync from
    the box. ``transport`` (box only): "rsync" or "stream" (``tail -c +N`` over ssh, resumable
    too); by default rsync when both ends have it, else stream. ``remote``: an open Remote to
    the box (else one is opened and closed here). ``home``: the laptop's state dir (default
    controller_home()).
    Raises IntegrityError (exit 6) naming the files that do not match; then nothing has a
    final name and no receipt is written."""
    where = resolve_source(rec, source)
    own = remote is None and where == "box"
    if own:
        remote = open_remote(rec.target)
    try:
        sealed = read_sealed(rec, where, remote)
        return _pull(rec, sealed, os.path.abspath(dest), progress, bwlimit, transport, remote, home)
    finally:
        if own and remote is not None:
            remote.close()


def _pull(
    rec: RunRecord,
    sealed: Sealed,
    dest: str,
    progress: Optional[ProgressFn],
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    home: Optional[str],
) -> Receipt:
    stage_dir = os.path.join(dest, STAGE)
    _check_dest(dest, sealed.entries)
    missing = []  # DEST and the parents it lacks, removed again if the pull cannot start
    d = dest
    while not os.path.lexists(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(dest, exist_ok=True)
        _make_stage(stage_dir)
    except OSError as err:
        for d in missing:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise HostError(
            f"cannot pull into {dest}: {err.strerror or err}"
            + (f" ({err.filename})" if err.filename else ""),
            "pull into a directory this user can write (--to DIR)",
        ) from None
    # One temporary file per source file: entries that share one (a deduplicated key) agree.
    unique: Dict[str, Entry] = {}
    for e in sealed.entries:
        other = unique.setdefault(e.stage, e)
        if (other.size, other.sha256) != (e.size, e.sha256):
            raise IntegrityError(f"{e.stage} is listed twice with different contents")
    items = list(unique.values())
    with _stage_lock(stage_dir):
        good = _reusable(sealed, items, stage_dir)
        monitor = _Monitor(stage_dir, items, progress)
        checker = _Checker(stage_dir)

        def finished(e: Entry) -> None:
            monitor.finished(e)
            checker.finished(e)

        try:
            fetch = _fetcher(sealed, stage_dir, bwlimit, transport, remote, finished)
            with monitor:
                fetched = fetch([e for e in items if e.stage not in good])
            more, durable = _verify(rec.name, items, good, stage_dir, fetch, progress, checker)
        finally:
            checker.close()
        fetched += more
        how = _open_all(rec.name, items, stage_dir)
        _place(rec.name, dest, stage_dir, sealed.entries, home, durable)
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
    )
    write_receipt(receipt, home)
    shutil.rmtree(stage_dir, ignore_errors=True)
    if progress is not None:
        total = receipt.total_bytes()
        progress(Progress("done", "", total, total, total, total))
    return receipt


def _check_dest(dest: str, entries: List[Entry]) -> None:
    """Before anything is fetched: no final name, nor a directory on the way to it, is a
    symlink (UnsafePath, exit 6), a directory or a file in the way (UsageError)."""
    for e in entries:
        try:
            st = lstat_beneath(dest, e.path, "file")
        except NotADirectoryError as err:
            raise UsageError(
                "--to", f"{err.filename} is a file; the pull would put a directory there"
            ) from None
        if st is None:
            continue
        final = os.path.join(dest, *e.path.split("/"))
        if stat.S_ISLNK(st.st_mode):
            raise symlink_error(final)
        if stat.S_ISDIR(st.st_mode):
            raise UsageError("--to", f"{final} is a directory; the pull would put a file there")


def _reusable(sealed: Sealed, items: List[Entry], stage_dir: str) -> Set[str]:
    """From the store, a finished copy an interrupted pull left is kept when it verifies (rsync
    decides that by itself for the box)."""
    good: Set[str] = set()
    for e in items:
        if e.src is None and os.path.exists(_stage_path(stage_dir, e)):
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
    checker: _Checker,
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
            "the copy at the source is damaged: try the other source (--from box or --from store)",
        )
    return fetched, durable


def _open_all(run: str, items: List[Entry], stage_dir: str) -> Dict[str, str]:
    """Open every copy of a known format as its framework would; how each was verified."""
    how: Dict[str, str] = {}
    for e in items:
        try:
            how[e.stage] = check_format(_stage_path(stage_dir, e), e.path)
        except IntegrityError as err:
            _drop(stage_dir, e)
            raise IntegrityError(
                f"pull of {run}: {err.what}. Nothing was put in place and no receipt was written",
                err.remedy,
            ) from None
    return how


def _fetcher(
    sealed: Sealed,
    stage_dir: str,
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    finished: Callable[[Entry], None],
) -> Callable[[List[Entry]], int]:
    if sealed.source == "store":
        assert sealed.store is not None
        store = sealed.store
        return lambda items: _fetch_store(store, items, stage_dir, finished) if items else 0
    box = _box_fetcher(sealed, stage_dir, bwlimit, transport, remote, finished)
    if sealed.store is None:
        return box
    store = sealed.store

    def mixed(items: List[Entry]) -> int:
        """From the box, but the entries without a box path (redacted logs) from the store."""
        n = box([e for e in items if e.src is not None])
        for e in items:
            if e.src is not None:
                continue
            try:
                n += _fetch_store(store, [e], stage_dir, finished)
            except StoreError as err:
                raise StoreError(
                    f"{e.path} is sealed as a redacted copy ({e.key} in {store.url}) because "
                    f"the job's log on the box holds a secret, and that copy cannot be read: "
                    f"{err.what}. Nothing was put in place and no receipt was written",
                    (err.remedy + "; " if err.remedy else "")
                    + "check the laptop's access to the store and pull again (rgt never "
                    "pulls the box's raw log in its place)",
                ) from None
        return n

    return mixed


def _box_fetcher(
    sealed: Sealed,
    stage_dir: str,
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    finished: Callable[[Entry], None],
) -> Callable[[List[Entry]], int]:
    assert remote is not None and sealed.box_root is not None
    root = sealed.box_root
    if transport is None:
        transport = "auto" if shutil.which("rsync") else "stream"
    if transport in ("rsync", "auto"):
        forced = transport == "rsync"
        mode = ["rsync"]

        def fetch(items: List[Entry]) -> int:
            if not items:
                return 0
            if mode[0] == "rsync":
                try:
                    return _fetch_rsync(remote, root, items, stage_dir, bwlimit, finished)
                except _NoRemoteRsync:
                    if forced:
                        raise HostError(
                            f"{remote.target.label} has no rsync", "install it, or pull without it"
                        ) from None
                    mode[0] = "stream"  # the box has no rsync: stream with tail over ssh
            return _fetch_stream(remote, root, items, stage_dir, finished)

        return fetch
    if transport == "stream":
        return lambda items: _fetch_stream(remote, root, items, stage_dir, finished) if items else 0
    raise UsageError("transport", f"{transport!r} is not rsync or stream")


def _place(
    run: str,
    dest: str,
    stage_dir: str,
    entries: List[Entry],
    home: Optional[str],
    durable: AbstractSet[str] = frozenset(),
) -> None:
    """Every verified temporary copy to its final name: fsynced (unless ``durable`` says it was
    already, after its last write), renamed, directories fsynced. The old receipt goes first,
    so no receipt ever describes a mix of two pulls."""
    remove_receipts(run, dest, home)
    last: Dict[str, Entry] = {}
    for e in entries:
        last[e.stage] = e
    todo = [safe_join(stage_dir, s) for s in last if s not in durable]
    with ThreadPoolExecutor(HASHERS) as pool:
        list(pool.map(fsync_file, todo))
    dirs = set()
    for i, e in enumerate(entries):
        final = os.path.join(dest, *e.path.split("/"))
        # Renamed through directory descriptors walked from DEST without following symlinks:
        # a symlink planted since _check_dest is refused, never written through.
        if last[e.stage] is e:
            replace_beneath(stage_dir, e.stage, dest, e.path)
        else:  # the same bytes under a second name: a copy, staged and put in place the same way
            tmp = f"{_COPY}{i}"
            unlink_beneath(stage_dir, tmp)  # a killed pull's
            src = open_beneath(stage_dir, e.stage, os.O_RDONLY)
            with open(src, "rb") as fin:
                out = open_beneath(stage_dir, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                with open(out, "wb") as fout:
                    shutil.copyfileobj(fin, fout, CHUNK)
                    fout.flush()
                    os.fsync(out)
            replace_beneath(stage_dir, tmp, dest, e.path)
        d = os.path.dirname(final)
        while d.startswith(dest) and d not in dirs:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=len, reverse=True):
        fsync_dir(d)


# ---- does a receipt cover the newest sealed state?


def newest_sealed(rec: RunRecord, remote: Optional[Remote] = None) -> SealedId:
    """The run's newest sealed state, from wherever its documents are (the same whichever
    source the files came from): a file:// store of an ssh target on the box, any other store
    from the laptop, the box's files for a run without a store."""
    if rec.store:
        root = _file_root(rec.store)
        if root is None or rec.target.kind == "local":
            store = open_store(rec.store)
            return _from_documents(
                rec.name,
                functools.partial(_store_get, store),
                functools.partial(_store_listing, store, rec.name),
            )[0]
    own = remote is None
    box = remote or open_remote(rec.target)
    try:
        if not rec.store:
            return _box_files(rec, box).ident
        assert root is not None
        docs = _BoxDocs(box, root)
        docs.prefetch([mf.latest_key(rec.name), mf.done_key(rec.name)], run=rec.name)
        return _from_documents(rec.name, docs.get, functools.partial(docs.listing, rec.name))[0]
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
    return compare(receipt, newest)


# ---- progress on a terminal


@contextlib.contextmanager
def terminal_progress(stream: Optional[IO[str]] = None) -> Iterator[ProgressFn]:
    """A progress callback for ``pull``: rich bars (a total and one per file being fetched)
    on a terminal, a plain line every few seconds otherwise."""
    out = stream or sys.stderr
    if not out.isatty():
        last = [0.0]

        def plain(p: Progress) -> None:
            now = time.monotonic()
            if p.phase == "done" or now - last[0] >= 5 or (p.phase == "fetch" and p.done == p.size):
                last[0] = now
                pct = 100 * p.total_done // max(p.total, 1)
                print(
                    f"rgt pull: {p.phase} {pct}% ({p.total_done >> 20}/{p.total >> 20} MiB)"
                    + (f" {p.path}" if p.path else ""),
                    file=out,
                    flush=True,
                )

        yield plain
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bars

    bars = Bars(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(file=out),
        transient=False,
    )
    lock = threading.Lock()
    tasks: Dict[str, Any] = {}

    def show(p: Progress) -> None:
        if p.phase == "done":
            return
        with lock:
            key = "total:" + p.phase
            if key not in tasks:
                tasks[key] = bars.add_task(p.phase, total=p.total)
            bars.update(tasks[key], completed=p.total_done, total=p.total)
            if p.phase == "fetch" and p.path:
                if p.path not in tasks:
                    tasks[p.path] = bars.add_task(f"  {p.path}", total=p.size)
                bars.update(tasks[p.path], completed=p.done, visible=p.done < p.size)

    with bars:
        yield show
