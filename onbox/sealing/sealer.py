"""The sealer: finds complete checkpoints in the job's checkpoint dir and makes them durable.

For each new complete checkpoint, oldest first: stage what may change under us, hash while
reading, upload every file (or point at an identical file an earlier checkpoint of this epoch
already holds), let the store verify it, write its MANIFEST, then advance LATEST (by step, never
backwards, only while this agent's epoch is the newest) and prune. A checkpoint is complete when:

- a directory holds a completeness marker (rgt's ``.rgt-complete``, Transformers'
  ``trainer_state.json``, DCP's ``.metadata``);
- a file is closed and open for writing by no process (checked in /proc, so a file rewritten
  every few hundred milliseconds is still caught between two writes).

A checkpoint with a name that restore and ``rgt pull`` refuse (onbox/common/safepath.py: a CR, a
backslash, another control character, an over-long component) is never sealed: it could not come
back. One ``unsafe_name`` event (class usage) names it, and it is skipped at each scan after that
until it changes, while the other checkpoints are sealed as usual.

Its step comes from rgt's marker or the name (``step_120``, ``checkpoint-120``, ``ckpt_120.pt``).
A file with no step in its name that the job rewrites in place (``ckpt.pt``) is a sequence: each
completed rewrite is the next step. Such a file is staged (copied while hashed, and checked not
to have changed meanwhile) before upload, so the upload never reads a half-rewritten file.

One writer per run, fenced at every write. Each agent start takes a new epoch (``epochs/<n>``,
created if absent); the newest epoch owns the run. An agent that lost it (a preempted box come
back, an agent frozen mid-upload while a new box took over) is kept from doing harm this way:

- objects: the files of checkpoint S sealed by epoch E go under ``checkpoints/S/eE/``, a prefix
  no other epoch writes, and dedupe only against objects of E; so no writer ever overwrites
  another's object, and an old agent's late upload lands beside the newer agent's, never on it;
- MANIFEST and LATEST: written only by compare-and-swap (``Store.get_versioned``, then
  ``put_bytes(if_absent=True)`` or ``put_bytes(if_match=VERSION)``: S3 If-None-Match/If-Match,
  a Hub commit on the head that was checked, a ``file://`` check and rename under the run's
  lock), and only after ``epochs/`` shows no newer epoch. A MANIFEST or LATEST that a newer
  epoch wrote is never replaced (LATEST carries its writer's epoch, ``writer``); each write is
  read back, and ``epochs/`` listed again, afterwards;
- a new agent claims LATEST when it loads (rewrites it with its own epoch as ``writer``), so
  from then on an older agent's conditional LATEST write fails even where the newer one has not
  sealed anything yet; a MANIFEST above LATEST whose epoch is older than LATEST's writer (an old
  agent's, written late) is never promoted; one that is newer is promoted only when every file
  it lists is in the store with its size (and sha256, where the store keeps one);
- the first time an agent finds a newer epoch it says so once (``stale_epoch``, class
  permanent, naming both epochs) and never writes an object, a MANIFEST or LATEST again, nor
  prunes.

LATEST moves down in one case only: from a checkpoint restore quarantined (corrupt in the store)
to a newer verified one of this epoch, after restore fell back below it
(``latest_after_quarantine``). A quarantined step may be sealed again by a newer epoch: its
record moves to ``quarantine/<step>.e<epoch>.json`` with the MANIFEST it judged (kept, no longer
in the way), then the new MANIFEST replaces the old. Pruning keeps what LATEST names, the newest
checkpoint before it, the newest ``keep``, every pinned one, and every object a kept (or
quarantined, or not promoted) MANIFEST references.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from onbox.common.durable import sha256_file, write_json
from onbox.common.errors import IntegrityError
from onbox.common.faults import crash_point
from onbox.common.safepath import UnsafePath, safe_rel
from onbox.sealing import manifest as mf
from onbox.sealing.room import Room
from onbox.sealing.stores.base import (
    PreconditionFailed,
    Store,
    StoreError,
    TransientStoreError,
    with_retries,
)

MARKERS = (".rgt-complete", "trainer_state.json", ".metadata")
_STEP = re.compile(r"(?i)(?:global_step|checkpoint|ckpt|step|iter(?:ation)?)[_\-=]?(\d+)")
CHUNK = 1 << 20
# A loose file in the checkpoint dir is a checkpoint only in a checkpoint format: scripts often
# checkpoint into their working directory, next to logs, configs and code.
CKPT_SUFFIXES = (
    ".pt",
    ".pth",
    ".ckpt",
    ".bin",
    ".safetensors",
    ".pkl",
    ".pickle",
    ".npz",
    ".npy",
    ".h5",
    ".hdf5",
    ".msgpack",
    ".gguf",
    ".tar",
    ".zip",
    ".distcp",
)
MAX_BACKLOG = 8  # pending checkpoints sealed per pass at most (the newest ones)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR
CAS_ATTEMPTS = 8  # conditional writes of one document before giving up (another writer races)


def step_from_name(name: str) -> Optional[int]:
    found = _STEP.findall(name)
    return int(found[-1]) if found else None


def _skip(name: str) -> bool:
    """Temporary and hidden names are never checkpoints (torn writes live there)."""
    low = name.lower()
    return (
        name.startswith(".")
        or low.endswith((".tmp", ".partial", ".part", ".lock", "~"))
        or ".tmp." in low
        or ".rgt-" in low
    )


def looks_whole(path: str) -> bool:
    """Cheap checks that a file of a known format is not torn (its writer died mid-write and the
    kernel closed it): a zip (torch.save's format) must end with its central directory; a
    safetensors file must hold as many bytes as its header says. Other formats pass."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:4] == b"PK\x03\x04":
                import zipfile

                return zipfile.is_zipfile(path)
            if path.endswith(".safetensors") and len(head) == 8:
                n = int.from_bytes(head, "little")
                header = json.loads(f.read(n))
                end = max(
                    [
                        0,
                        *(
                            int(v["data_offsets"][1])
                            for k, v in header.items()
                            if k != "__metadata__"
                        ),
                    ]
                )
                return bool(os.fstat(f.fileno()).st_size == 8 + n + end)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    return True


def open_for_writing(paths: List[str]) -> Set[str]:
    """Which of ``paths`` some process holds open for writing (from /proc/*/fd and fdinfo)."""
    wanted = {os.path.realpath(p) for p in paths}
    busy: Set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target not in wanted:
                continue
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    for line in f:
                        if line.startswith("flags:"):
                            if int(line.split()[1], 8) & _WRITE_FLAGS:
                                busy.add(target)
                            break
            except (OSError, ValueError):
                busy.add(target)  # cannot tell: assume it is being written
    return busy


class Candidate:
    """A complete checkpoint found on disk, not sealed yet."""

    def __init__(
        self,
        root: str,
        kind: str,
        step: Optional[int],
        files: List[str],
        signature: Tuple[int, int, int],
    ) -> None:
        self.root = root  # relative to the checkpoint dir
        self.kind = kind  # "file" | "dir"
        self.step = step
        self.files = files  # relative to the checkpoint dir
        self.signature = signature  # (size, mtime_ns, inode) of a file; of the marker for a dir


def _sig(st: os.stat_result) -> Tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class Vanished(Exception):
    """The job deleted or replaced a checkpoint while it was being sealed (rotation): normal."""


class Sealer:
    """Seals one run's checkpoints into a store. Thread-safe: one seal at a time."""

    def __init__(
        self,
        run: str,
        ckpt_dir: str,
        store: Store,
        staging: str,
        *,
        epoch: int,
        keep: int = 3,
        event: Callable[..., None],
        state_path: str,
    ) -> None:
        self.run = run
        self.ckpt_dir = ckpt_dir
        self.store = store
        self.staging = staging
        self.epoch = epoch
        self.keep = max(1, keep)
        self.event = event
        self.state_path = state_path  # local memory of in-place sequences
        self.lock = threading.Lock()
        self.manifests: Dict[int, Dict[str, Any]] = {}  # sealed, verified, not quarantined
        # MANIFESTs in the store that are not sealed checkpoints of this run's line: quarantined
        # ones, an old agent's late ones, unverified ones. Their objects are never pruned.
        self.others: Dict[int, Dict[str, Any]] = {}
        self.quarantined: Set[int] = set()
        self.latest: Optional[int] = None
        self.stale = False
        self.pruned: Set[int] = set()
        self.torn: Dict[str, Tuple[int, int, int]] = {}
        self.refused: Dict[str, Tuple[int, int, int]] = {}  # unsafe names, reported once each
        self.bytes_per_s = 50e6  # until measured: a cautious guess for the preemption estimate
        self.seq: Dict[str, Dict[str, Any]] = self._load_seq()

    # ---- what the store holds
    def load(self) -> None:
        """Read the sealed manifests and LATEST from the store; promote a verified MANIFEST
        newer than LATEST (an agent that died between the two), and claim LATEST for this
        epoch (see the module docstring)."""
        self.manifests, self.others = {}, {}
        self.quarantined = self._quarantined_steps()
        latest = self._read_latest()
        found: Dict[int, Dict[str, Any]] = {}
        for info in self.store.list(mf.checkpoints_prefix(self.run)):
            step = mf.manifest_step(self.run, info.key)
            if step is None:
                continue  # an object, or a file of a checkpoint named MANIFEST.json
            data = with_retries(functools.partial(self.store.get_bytes, info.key))
            if data is None:
                continue
            try:
                doc = mf.parse_manifest(data, info.key)
                if doc["step"] != step:
                    raise IntegrityError(f"{info.key} is for step {doc['step']}")
            except IntegrityError as e:
                self.event(
                    "manifest_unreadable",
                    e.what,
                    klass="integrity",
                    remedy="it is ignored; the previous checkpoint is used",
                )
                continue
            found[step] = doc
        at = latest["step"] if latest else None
        writer = mf.latest_writer(latest) if latest else 0
        newer: List[int] = []
        for step, doc in found.items():
            if step in self.quarantined:
                self.others[step] = doc  # not sealed: the step may be sealed again
            elif at is None or step <= at:
                self.manifests[step] = doc
            else:
                newer.append(step)
        promote = None
        for step in sorted(newer, reverse=True):
            doc = found[step]
            epoch = mf.manifest_epoch(doc)
            if epoch < writer:
                problem: Optional[str] = (
                    f"it was written by epoch {epoch} after epoch {writer} had taken the run "
                    f"over (LATEST is step {at}): an old agent's, written late"
                )
            else:
                problem = self._unverified(doc)
            if problem is not None:
                self.others[step] = doc
                self.event(
                    "manifest_not_promoted",
                    f"the MANIFEST of step {step} is newer than LATEST but is not promoted: "
                    f"{problem}",
                    klass="integrity",
                    remedy="nothing to do: it is left in the store, and LATEST stays",
                    step=step,
                )
                continue
            self.manifests[step] = doc
            promote = step if promote is None else promote
        self.latest = at
        if promote is not None:
            # A MANIFEST is written only after its files verified: an agent that died before
            # moving LATEST left a good checkpoint behind. Finish its job.
            self._advance_latest(promote)
        elif latest is not None:  # the claim: LATEST as it is, with this epoch as its writer
            self._advance_latest(latest["step"], epoch=mf.manifest_epoch(latest))
        for step, doc in self.manifests.items():  # sequences continue after a restore
            if doc.get("kind") == "file" and step_from_name(os.path.basename(doc["root"])) is None:
                entry = self.seq.setdefault(doc["root"], {"step": -1, "sig": None})
                entry["step"] = max(entry["step"], step)

    def _read_latest(self) -> Optional[Dict[str, Any]]:
        data = with_retries(functools.partial(self.store.get_bytes, mf.latest_key(self.run)))
        return mf.parse_latest(data)

    def _quarantined_steps(self) -> Set[int]:
        out = set()
        for info in self.store.list(mf.quarantine_prefix(self.run)):
            name = info.key.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                out.add(int(name[:-5]))
        return out

    def _unverified(self, doc: Dict[str, Any]) -> Optional[str]:
        """Why the store does not hold every file of ``doc`` as listed (present, its size, its
        sha256 where the store keeps one), or None when it does. From the store's own stat:
        nothing is downloaded."""
        for f in doc["files"]:
            key = mf.object_key(self.run, doc["step"], f)
            info = with_retries(functools.partial(self.store.stat, key))
            if info is None:
                return f"{key} is missing"
            if info.size != f["size"]:
                return f"{key} is {info.size} bytes, the MANIFEST says {f['size']}"
            if info.sha256 is not None and info.sha256 != f["sha256"]:
                return f"{key} has sha256 {info.sha256[:12]}, the MANIFEST says {f['sha256'][:12]}"
        return None

    def _load_seq(self) -> Dict[str, Dict[str, Any]]:
        try:
            with open(self.state_path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_seq(self) -> None:
        write_json(self.state_path, self.seq)

    # ---- finding checkpoints
    def scan(self) -> List[Candidate]:
        """Complete checkpoints not sealed yet, oldest step first."""
        try:
            names = sorted(os.listdir(self.ckpt_dir))
        except FileNotFoundError:
            return []
        dirs: List[Candidate] = []
        files: List[Tuple[str, os.stat_result]] = []
        for name in names:
            if _skip(name):
                continue
            path = os.path.join(self.ckpt_dir, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if os.path.isdir(path):
                cand = self._dir_candidate(name, path)
                if cand is not None:
                    dirs.append(cand)
            elif os.path.isfile(path) and name.lower().endswith(CKPT_SUFFIXES):
                files.append((name, st))
        dirs = [c for c in dirs if self._safe_names(c.root, c.files, c.signature)]
        files = [(n, st) for n, st in files if self._safe_names(n, [n], _sig(st))]
        in_dirs = [os.path.join(self.ckpt_dir, f) for c in dirs for f in c.files]
        busy = open_for_writing([os.path.join(self.ckpt_dir, n) for n, _ in files] + in_dirs)
        # A directory whose marker appeared while a file of it (the marker itself: Transformers
        # writes trainer_state.json in place) is still open for writing is not complete yet.
        out = [
            c
            for c in dirs
            if not any(os.path.realpath(os.path.join(self.ckpt_dir, f)) in busy for f in c.files)
        ]
        for name, st in files:
            path = os.path.join(self.ckpt_dir, name)
            if os.path.realpath(path) in busy:
                continue
            if not looks_whole(path):
                if self.torn.get(name) != _sig(st):
                    self.torn[name] = _sig(st)
                    self.event(
                        "torn_checkpoint",
                        f"{name} is incomplete (its writer stopped mid-write): not sealed",
                        klass="integrity",
                        remedy="write checkpoints to a temporary name, then rename",
                    )
                continue
            step = step_from_name(name)
            if step is None:
                entry = self.seq.get(name)
                if entry is not None and entry.get("sig") == list(_sig(st)):
                    continue  # this rewrite is sealed already
                step = self._next_seq_step(entry["step"] if entry else -1)
            out.append(Candidate(name, "file", step, [name], _sig(st)))
        todo = [
            c
            for c in out
            if c.step is not None
            and c.step not in self.manifests
            and c.step not in self.pruned
            and (self.latest is None or c.step > self.latest)
        ]
        return sorted(todo, key=lambda c: c.step or 0)

    def _safe_names(self, root: str, files: List[str], sig: Tuple[int, int, int]) -> bool:
        """Whether every name of the checkpoint ``root`` is one restore and pull accept
        (safepath.safe_rel). A refused one is reported once (again only when the checkpoint
        changes) and never uploaded: a MANIFEST naming it could never be restored or pulled,
        and retrying could not help."""
        for rel in [root, *files]:
            try:
                safe_rel(rel, "the name")
            except UnsafePath as e:
                if self.refused.get(root) != sig:
                    self.refused[root] = sig
                    self.event(
                        "unsafe_name",
                        f"checkpoint {root!r} is not sealed: {e.what}; restore and `rgt pull` "
                        "would refuse it, so it could never come back",
                        klass="usage",
                        remedy="rename it (letters, digits, '.', '_', '-'); the other "
                        "checkpoints are sealed as usual",
                        path=rel,
                    )
                return False
        self.refused.pop(root, None)
        return True

    def _next_seq_step(self, last: int) -> int:
        """The next step of an in-place sequence: after everything sealed, so LATEST moves."""
        known = [last, -1, *self.manifests, *self.pruned]
        if self.latest is not None:
            known.append(self.latest)
        return max(known) + 1

    def _dir_candidate(self, name: str, path: str) -> Optional[Candidate]:
        marker = next((m for m in MARKERS if os.path.isfile(os.path.join(path, m))), None)
        if marker is None:
            return None
        step = None
        if marker != ".metadata":  # a JSON marker cut off mid-write is no marker at all
            try:
                with open(os.path.join(path, marker)) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                return None
            if marker == ".rgt-complete":
                try:
                    step = int(doc["step"])
                except (KeyError, TypeError, ValueError):
                    step = None
        if step is None:
            step = step_from_name(name)
        if step is None:
            return None
        rel_files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for fn in sorted(filenames):
                if _skip(fn) and fn != ".rgt-complete" and fn != ".metadata":
                    continue
                full = os.path.join(dirpath, fn)
                rel_files.append(os.path.relpath(full, self.ckpt_dir).replace(os.sep, "/"))
        st = os.stat(os.path.join(path, marker))
        return Candidate(name, "dir", step, rel_files, _sig(st))

    # ---- sealing
    def seal(self, cand: Candidate, deadline: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """Upload, verify, MANIFEST, LATEST. None when the job took the checkpoint away, or
        when a newer agent owns the run (this one then writes nothing more)."""
        assert cand.step is not None
        step = cand.step
        with self.lock:
            if step in self.manifests:
                return self.manifests[step]
            if self._is_stale(f"checkpoint {cand.root} (step {step})"):
                return None  # one writer per run: a newer agent owns it now
            t0 = time.monotonic()
            try:
                entries, uploaded = self._upload(cand)
            except Vanished as e:
                self.event(
                    "seal_skipped",
                    f"checkpoint {cand.root} changed or was deleted while "
                    f"it was sealed ({e}); a newer one will be sealed",
                    klass="transient",
                    remedy="",
                )
                return None
            crash_point("seal.before_manifest")
            doc = mf.new_manifest(self.run, step, self.epoch, cand.root, cand.kind, entries)
            if not self._put_manifest(step, doc):
                return None  # stale: the objects stay where no MANIFEST names them
            crash_point("seal.after_manifest")
            self.manifests[step] = doc
            took = time.monotonic() - t0
            if uploaded and took > 0:
                self.bytes_per_s = 0.5 * self.bytes_per_s + 0.5 * (uploaded / took)
            if cand.kind == "file" and step_from_name(cand.root) is None:
                self.seq[cand.root] = {"step": cand.step, "sig": list(cand.signature)}
                self._save_seq()
            self.event(
                "sealed",
                f"checkpoint {cand.root} sealed as step {cand.step}: "
                f"{len(entries)} files, {uploaded} bytes uploaded in {took:.1f}s",
                step=cand.step,
                files=len(entries),
                uploaded=uploaded,
                seconds=took,
            )
            if self._advance_latest(step):
                crash_point("seal.after_latest")
            self._prune()
            return doc

    def _upload(self, cand: Candidate) -> Tuple[List[Dict[str, Any]], int]:
        # Dedupe only against this epoch's own objects: an older agent that lost the run may
        # still prune its checkpoints (it was frozen past its last check), never ours.
        known: Dict[Tuple[str, int], str] = {}
        for doc in self.manifests.values():
            if mf.manifest_epoch(doc) == self.epoch:
                for f in doc["files"]:
                    known[(f["sha256"], f["size"])] = f["key"]
        entries = []
        uploaded = 0
        prefix = mf.epoch_prefix(self.run, cand.step or 0, self.epoch)
        stage_dir = os.path.join(self.staging, f"step-{cand.step}")
        os.makedirs(stage_dir, exist_ok=True)
        # Only a file with no step in its name is rewritten in place: stage it. A step-named
        # file or a directory is new each time; hash it while reading, no copy.
        in_place = cand.kind == "file" and step_from_name(cand.root) is None
        try:
            for rel in cand.files:
                src = os.path.join(self.ckpt_dir, *rel.split("/"))
                if not in_place and self.store.hashes_while_uploading:
                    done = self._upload_hashing(src, rel, prefix + rel, known)
                    if done is not None:  # no sealed file of that size: nothing to dedupe
                        entries.append(done)
                        uploaded += done["size"]
                        crash_point("seal.after_object")
                        continue
                path, sha, size = self._stage(src, stage_dir, rel, in_place=in_place)
                key = known.get((sha, size))
                if key is None:
                    key = prefix + rel
                    self._put_checked(key, path, sha, size, rel, staged=path != src)
                    uploaded += size
                    known[(sha, size)] = key
                    crash_point("seal.after_object")
                entries.append({"path": rel, "size": size, "sha256": sha, "key": key})
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)
        return entries, uploaded

    def _put_checked(
        self, key: str, path: str, sha: str, size: int, rel: str, staged: bool
    ) -> None:
        """Upload a hashed file. One the job deleted or rewrote since it was hashed (rotation,
        not a store fault) is Vanished; a staged copy is ours and cannot change."""
        try:
            with_retries(functools.partial(self.store.put_file, key, path, sha256=sha, size=size))
        except (StoreError, IntegrityError):
            if staged:
                raise
            try:
                st = os.stat(path)
                gone = st.st_size != size or sha256_file(path)[0] != sha
            except FileNotFoundError:
                gone = True
            if gone:
                raise Vanished(f"{rel} changed or was deleted while uploading") from None
            raise

    def _upload_hashing(
        self, src: str, rel: str, key: str, known: Dict[Tuple[str, int], str]
    ) -> Optional[Dict[str, Any]]:
        """Upload without a sha256 pass of our own first, when no sealed file has this size (so
        it cannot be a duplicate): the store hashes while it sends, and the server verifies.
        None when a sealed file has the same size (hash first, maybe skip the upload)."""
        try:
            before = os.stat(src)
        except FileNotFoundError:
            raise Vanished(f"{rel} was deleted") from None
        if any(size == before.st_size for _, size in known):
            return None
        put = functools.partial(self.store.put_file, key, src, sha256=None, size=before.st_size)
        try:
            info = with_retries(put)
        except StoreError:
            try:
                changed = _sig(os.stat(src)) != _sig(before)
            except FileNotFoundError:
                changed = True
            if changed:  # the job rotated it away or rewrote it: normal, not a store fault
                raise Vanished(f"{rel} changed or was deleted while uploading") from None
            raise
        try:
            unchanged = _sig(os.stat(src)) == _sig(before)
        except FileNotFoundError:
            unchanged = False
        if not unchanged or info.sha256 is None:
            self.store.delete(key)
            raise Vanished(f"{rel} changed while uploading")
        known[(info.sha256, before.st_size)] = key
        return {"path": rel, "size": before.st_size, "sha256": info.sha256, "key": key}

    def _stage(self, src: str, stage_dir: str, rel: str, in_place: bool) -> Tuple[str, str, int]:
        """(path to upload from, sha256, size). A file the job may rewrite in place is copied
        first while hashed, and must not have changed during the copy."""
        try:
            before = os.stat(src)
            if not in_place:
                sha, size = sha256_file(src)
                if _sig(os.stat(src)) != _sig(before):
                    raise Vanished(f"{rel} changed while hashed")
                return src, sha, size
            dest = os.path.join(stage_dir, rel.replace("/", "__"))
            h = hashlib.sha256()
            size = 0
            with open(src, "rb") as fin, open(dest, "wb") as fout:
                while True:
                    b = fin.read(CHUNK)
                    if not b:
                        break
                    h.update(b)
                    fout.write(b)
                    size += len(b)
            if _sig(os.stat(src)) != _sig(before) or size != before.st_size:
                raise Vanished(f"{rel} was rewritten during the copy")
            return dest, h.hexdigest(), size
        except FileNotFoundError:
            raise Vanished(f"{rel} was deleted") from None

    # ---- fencing: one writer per run
    def _newest_epoch(self) -> int:
        newest = self.epoch
        for info in self.store.list(mf.epochs_prefix(self.run)):
            tail = info.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                newest = max(newest, int(tail))
        return newest

    def _go_stale(self, newest: int, what: str) -> None:
        """From now on this agent writes nothing to the store; said once."""
        if self.stale:
            return
        self.stale = True
        self.event(
            "stale_epoch",
            f"a newer agent (epoch {newest}) has taken run {self.run} over in {self.store.url}; "
            f"this one (epoch {self.epoch}) stops writing to the store: {what} is not sealed, "
            "and it writes no checkpoint, MANIFEST or LATEST of this run again",
            klass="permanent",
            remedy="stop this old agent (`rgt-agent stop` on this box): the run goes on with "
            "the newer one; this box's checkpoints stay on its disk",
            epoch=self.epoch,
            newer_epoch=newest,
        )

    def _is_stale(self, what: str = "the next checkpoint") -> bool:
        """Whether a newer epoch owns the run (listed afresh until it does: then for good)."""
        if not self.stale:
            newest = with_retries(self._newest_epoch)
            if newest > self.epoch:
                self._go_stale(newest, what)
        return self.stale

    def is_writer(self) -> bool:
        """Whether this agent still owns the run's store prefix (no newer epoch): callers
        that write other documents of the run (DONE.json, outputs) ask first."""
        return not self._is_stale("the run's documents")

    def _cas(
        self, key: str, decide: Callable[[Optional[bytes]], Union[bytes, bool]], what: str
    ) -> bool:
        """Compare-and-swap ``key``: ``decide`` sees the current bytes (None: absent) and
        answers the bytes to write, True (it is as wanted already) or False (write nothing);
        the write happens only if ``key`` is still what was read, else it is read again. After
        the write ``epochs/`` is listed and the document read back: a newer epoch means this
        agent is stale (False), another writer's bytes there mean read and decide again."""
        for _ in range(CAS_ATTEMPTS):
            if self._is_stale(what):
                return False
            cur = with_retries(functools.partial(self.store.get_versioned, key))
            data = decide(None if cur is None else cur[0])
            if data is True or data is False:
                return data and not self.stale
            try:
                if cur is None:
                    put = functools.partial(self.store.put_bytes, key, data, if_absent=True)
                else:
                    put = functools.partial(self.store.put_bytes, key, data, if_match=cur[1])
                with_retries(put)
            except PreconditionFailed:
                continue  # another writer got there first: look again
            if self._is_stale(what):
                return False
            if with_retries(functools.partial(self.store.get_bytes, key)) == data:
                return True
        raise TransientStoreError(
            f"{what}: {key} in {self.store.url} changed under each of {CAS_ATTEMPTS} "
            "conditional writes",
            "another writer races this agent; it is tried again at the next seal",
        )

    def _put_manifest(self, step: int, doc: Dict[str, Any]) -> bool:
        """Write checkpoint ``step``'s MANIFEST: created, or replacing one of an older epoch
        (an old agent's, or a quarantined one), never one a newer epoch wrote."""
        key = mf.manifest_key(self.run, step)
        data = mf.dump(doc)
        what = f"the MANIFEST of step {step}"
        if step in self.quarantined and not self._unquarantine(step, what):
            return False

        def decide(cur: Optional[bytes]) -> Union[bytes, bool]:
            if cur is None:
                return data
            if cur == data:
                return True
            try:
                epoch = mf.manifest_epoch(mf.parse_manifest(cur, key))
            except IntegrityError:
                epoch = -1  # a malformed MANIFEST is no checkpoint: replaced
            if epoch > self.epoch:
                self._go_stale(epoch, what)
                return False
            return data

        return self._cas(key, decide, what)

    def _unquarantine(self, step: int, what: str) -> bool:
        """Before a newer epoch seals ``step`` again: its quarantine record moves to
        ``quarantine/<step>.e<epoch>.json`` together with the MANIFEST it judged, so both are
        kept and the new checkpoint is not hidden by them. A crash in between leaves the old
        MANIFEST unflagged; a restore finds it corrupt again and flags it again."""
        if self._is_stale(what):
            return False
        old = self.others.get(step)
        qkey = mf.quarantine_key(self.run, step)
        record = with_retries(functools.partial(self.store.get_bytes, qkey))
        epoch = mf.manifest_epoch(old) if old is not None else 0
        archive = json.dumps(
            {
                "step": step,
                "record": (record or b"").decode("utf-8", "replace"),
                "manifest": old,
                "sealed_again_by": self.epoch,
                "at": time.time(),
            },
            indent=1,
        ).encode()
        akey = mf.quarantine_attempt_key(self.run, step, epoch)
        with_retries(functools.partial(self.store.put_bytes, akey, archive))
        with_retries(functools.partial(self.store.delete, qkey))
        self.quarantined.discard(step)
        self.event(
            "quarantine_superseded",
            f"step {step} was quarantined (its record and MANIFEST are kept as {akey}); "
            f"epoch {self.epoch} seals a new checkpoint of that step",
            step=step,
        )
        return True

    def _advance_latest(self, step: int, epoch: Optional[int] = None) -> bool:
        """Point LATEST at ``step`` (whose MANIFEST ``epoch`` sealed: by default this agent's,
        or the one in ``self.manifests``), written by this epoch. Never backwards, except away
        from a quarantined checkpoint; never over a LATEST a newer epoch wrote. True when
        LATEST names it now."""
        if epoch is None:
            doc = self.manifests.get(step)
            epoch = mf.manifest_epoch(doc) if doc is not None else self.epoch
        key = mf.latest_key(self.run)
        what = f"LATEST -> step {step}"
        down_from: List[int] = []

        def decide(cur: Optional[bytes]) -> Union[bytes, bool]:
            down_from.clear()
            try:
                doc = mf.parse_latest(cur)
            except IntegrityError:
                doc = None  # an unreadable LATEST names nothing: replaced
            if doc is not None:
                writer = mf.latest_writer(doc)
                if writer > self.epoch:
                    self._go_stale(writer, what)
                    return False
                at = doc["step"]
                if at == step and writer == self.epoch and mf.manifest_epoch(doc) == epoch:
                    return True
                if step < at:
                    if at not in self._quarantined_steps():
                        return False  # never backwards
                    down_from.append(at)
            return mf.dump(mf.new_latest(self.run, step, epoch, writer=self.epoch))

        if not self._cas(key, decide, what):
            return False
        moved = self.latest != step
        self.latest = step
        if down_from:
            self.event(
                "latest_after_quarantine",
                f"LATEST -> step {step}, down from step {down_from[0]}, which is quarantined "
                "(unusable in the store): the run went on from an earlier checkpoint",
                klass="integrity",
                remedy=f"see {mf.quarantine_key(self.run, down_from[0])} in the store",
                step=step,
                quarantined=down_from[0],
            )
        elif moved:
            self.event("latest", f"LATEST -> step {step}", step=step)
        return True

    def _prune(self) -> None:
        if self.stale or self.latest is None:
            return
        steps = sorted(self.manifests)
        pinned = set()
        for info in self.store.list(mf.pins_prefix(self.run)):
            tail = info.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                pinned.add(int(tail))
        before = [s for s in steps if s < self.latest]
        keep = (
            set(steps[-self.keep :])
            | {self.latest}
            | set(before[-1:])  # the newest verified one before LATEST: the fallback
            | {s for s in steps if s > self.latest}  # sealed, LATEST not there yet
            | (pinned & set(steps))
        )
        drop = [s for s in steps if s not in keep]
        if not drop:
            return
        referenced = {
            f["key"]
            for docs in (self.others, {s: self.manifests[s] for s in keep})
            for doc in docs.values()
            for f in doc["files"]
        }
        for s in drop:
            # Listed afresh before each checkpoint goes: an agent that lost the run between
            # two deletes stops there.
            if self._is_stale(f"pruning step {s}"):
                return
            doc = self.manifests.pop(s)
            self.pruned.add(s)
            # The MANIFEST goes first: a checkpoint without one does not exist.
            with_retries(functools.partial(self.store.delete, mf.manifest_key(self.run, s)))
            for f in doc["files"]:
                if f["key"] not in referenced:
                    with_retries(functools.partial(self.store.delete, f["key"]))
                    crash_point("prune.after_delete")
            self.event("pruned", f"step {s} pruned (keeping {sorted(keep)})", step=s)

    def remember_restored(self, doc: Dict[str, Any]) -> None:
        """A checkpoint restore put back is sealed already, and it is where this agent goes on
        from: the newest sealed step is the restored one (lower than LATEST's when restore fell
        back from a quarantined checkpoint, so the job's next checkpoints are sealed and LATEST
        re-pointed to them). An in-place file restored at step S continues its sequence from S
        instead of being sealed again as new."""
        with self.lock:
            self.quarantined = self._quarantined_steps()  # restore may have added some
            for step in self.quarantined:
                if step in self.manifests:
                    self.others[step] = self.manifests.pop(step)
            self.latest = doc["step"]
        root = doc["root"]
        if doc.get("kind") == "file" and step_from_name(os.path.basename(root)) is None:
            try:
                st = os.stat(os.path.join(self.ckpt_dir, *root.split("/")))
            except OSError:
                return
            self.seq[root] = {"step": doc["step"], "sig": list(_sig(st))}
            self._save_seq()

    _room: Optional[Room] = None

    def free_room(self) -> int:
        """When the checkpoint disk runs low, delete local copies whose exact bytes are sealed
        and reached in the store, oldest first (onbox/sealing/room.py says what may go); bytes
        freed."""
        if self._room is None:
            self._room = Room(
                self.run, self.ckpt_dir, self.store, event=self.event, busy=open_for_writing
            )
        return self._room.free(self.manifests, self.latest)

    def seal_pending(self, deadline: Optional[float] = None) -> int:
        """Seal every pending checkpoint, oldest first; stop at ``deadline`` (monotonic).
        Returns how many were sealed. The backlog is bounded: when the store was away long
        enough for more than MAX_BACKLOG to pile up, the oldest of them are left out."""
        n = 0
        pending = self.scan()
        if len(pending) > MAX_BACKLOG:
            skipped = [c.step for c in pending[:-MAX_BACKLOG]]
            pending = pending[-MAX_BACKLOG:]
            self.event(
                "backlog_bounded",
                f"{len(skipped)} older pending checkpoints left out "
                f"(steps {skipped[0]}..{skipped[-1]}); sealing the newest {MAX_BACKLOG}",
                klass="transient",
                remedy="the store was slow or away",
            )
        for cand in pending:
            if deadline is not None and time.monotonic() >= deadline:
                break
            if self.seal(cand, deadline) is not None:
                n += 1
        if n:
            self.free_room()
        return n


def take_epoch(store: Store, run: str) -> int:
    """A new epoch for this agent start: the first to create ``epochs/<n>`` owns ``n``."""
    newest = 0
    for info in store.list(mf.epochs_prefix(run)):
        tail = info.key.rsplit("/", 1)[-1]
        if tail.isdigit():
            newest = max(newest, int(tail))
    n = newest + 1
    while True:
        try:
            store.put_bytes(
                mf.epoch_key(run, n),
                json.dumps(
                    {"epoch": n, "pid": os.getpid(), "host": os.uname().nodename, "at": time.time()}
                ).encode(),
                if_absent=True,
            )
            return n
        except PreconditionFailed:
            n += 1


__all__ = ["Sealer", "StoreError", "take_epoch", "open_for_writing", "step_from_name"]
