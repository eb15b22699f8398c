"""The sealer: finds complete checkpoints in the job's checkpoint dir and makes them durable.

For each new complete checkpoint, oldest first: stage what may change under us, hash while
reading, upload every file (or point at an identical file an earlier checkpoint already holds),
let the store verify it, write its MANIFEST, then advance LATEST (by step, never backwards, only
while this agent's epoch is the newest) and prune. A checkpoint is complete when:

- a directory holds a completeness marker (rgt's ``.rgt-complete``, Transformers'
  ``trainer_state.json``, DCP's ``.metadata``);
- a file is closed and open for writing by no process (checked in /proc, so a file rewritten
  every few hundred milliseconds is still caught between two writes).

A checkpoint with a name that restore and ``rgt pull`` refuse (onbox/safepath.py: a CR, a
backslash, another control character, an over-long component) is never sealed: it could not come
back. One ``unsafe_name`` event (class usage) names it, and it is skipped at each scan after that
until it changes, while the other checkpoints are sealed as usual.

Its step comes from rgt's marker or the name (``step_120``, ``checkpoint-120``, ``ckpt_120.pt``).
A file with no step in its name that the job rewrites in place (``ckpt.pt``) is a sequence: each
completed rewrite is the next step. Such a file is staged (copied while hashed, and checked not
to have changed meanwhile) before upload, so the upload never reads a half-rewritten file.
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
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from onbox import manifest as mf
from onbox.durable import sha256_file, write_json
from onbox.errors import IntegrityError
from onbox.room import Room
from onbox.safepath import UnsafePath, safe_rel
from onbox.stores.base import PreconditionFailed, Store, StoreError, with_retries

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
        self.manifests: Dict[int, Dict[str, Any]] = {}
        self.latest: Optional[int] = None
        self.stale = False
        self.pruned: Set[int] = set()
        self.torn: Dict[str, Tuple[int, int, int]] = {}
        self.refused: Dict[str, Tuple[int, int, int]] = {}  # unsafe names, reported once each
        self.bytes_per_s = 50e6  # until measured: a cautious guess for the preemption estimate
        self.seq: Dict[str, Dict[str, Any]] = self._load_seq()

    # ---- what the store holds
    def load(self) -> None:
        """Read the sealed manifests and LATEST from the store."""
        self.manifests = {}
        for info in self.store.list(f"{self.run}/checkpoints/"):
            if not info.key.endswith("/MANIFEST.json"):
                continue
            data = self.store.get_bytes(info.key)
            if data is None:
                continue
            try:
                doc = mf.parse_manifest(data, info.key)
            except IntegrityError as e:
                self.event(
                    "manifest_unreadable",
                    e.what,
                    klass="integrity",
                    remedy="it is ignored; the previous checkpoint is used",
                )
                continue
            self.manifests[doc["step"]] = doc
        latest = mf.parse_latest(self.store.get_bytes(mf.latest_key(self.run)))
        self.latest = latest["step"] if latest else None
        newer = [s for s in self.manifests if self.latest is None or s > self.latest]
        if newer:
            # A MANIFEST is written only after its files verified: an agent that died before
            # moving LATEST left a good checkpoint behind. Finish its job.
            self._advance_latest(max(newer))
        for step, doc in self.manifests.items():  # sequences continue after a restore
            if doc.get("kind") == "file" and step_from_name(os.path.basename(doc["root"])) is None:
                entry = self.seq.setdefault(doc["root"], {"step": -1, "sig": None})
                entry["step"] = max(entry["step"], step)

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
        """Upload, verify, MANIFEST, LATEST. None when the job took the checkpoint away."""
        assert cand.step is not None
        step = cand.step
        with self.lock:
            if step in self.manifests:
                return self.manifests[step]
            if self._is_stale():
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
            doc = mf.new_manifest(self.run, step, self.epoch, cand.root, cand.kind, entries)
            with_retries(
                lambda: self.store.put_bytes(mf.manifest_key(self.run, step), mf.dump(doc))
            )
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
            self._advance_latest(cand.step)
            self._prune()
            return doc

    def _upload(self, cand: Candidate) -> Tuple[List[Dict[str, Any]], int]:
        known: Dict[Tuple[str, int], str] = {}
        for doc in self.manifests.values():
            for f in doc["files"]:
                known[(f["sha256"], f["size"])] = f["key"]
        entries = []
        uploaded = 0
        prefix = mf.checkpoint_prefix(self.run, cand.step or 0)
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
                        continue
                path, sha, size = self._stage(src, stage_dir, rel, in_place=in_place)
                key = known.get((sha, size))
                if key is None:
                    key = prefix + rel
                    self._put_checked(key, path, sha, size, rel, staged=path != src)
                    uploaded += size
                    known[(sha, size)] = key
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

    def _newest_epoch(self) -> int:
        newest = self.epoch
        for info in self.store.list(f"{self.run}/epochs/"):
            tail = info.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                newest = max(newest, int(tail))
        return newest

    def _is_stale(self) -> bool:
        if not self.stale:
            newest = self._newest_epoch()
            if newest > self.epoch:
                self.stale = True
                self.event(
                    "stale_epoch",
                    f"a newer agent (epoch {newest}) writes this run; this "
                    f"one (epoch {self.epoch}) no longer writes to the store",
                    klass="integrity",
                    remedy="stop this old agent: the run continues elsewhere",
                )
        return self.stale

    def _advance_latest(self, step: int) -> None:
        if self.latest is not None and step <= self.latest:
            return  # never backwards
        if self._is_stale():
            return
        with_retries(
            lambda: self.store.put_bytes(
                mf.latest_key(self.run), mf.dump(mf.new_latest(self.run, step, self.epoch))
            )
        )
        self.latest = step
        self.event("latest", f"LATEST -> step {step}", step=step)

    def _prune(self) -> None:
        if self.stale or self.latest is None:
            return
        steps = sorted(self.manifests)
        pinned = set()
        for info in self.store.list(f"{self.run}/pinned/"):
            tail = info.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                pinned.add(int(tail))
        keep = set(steps[-self.keep :]) | {self.latest} | (pinned & set(steps))
        drop = [s for s in steps if s not in keep]
        if not drop:
            return
        referenced = {f["key"] for s in keep for f in self.manifests[s]["files"]}
        for s in drop:
            doc = self.manifests.pop(s)
            self.pruned.add(s)
            # The MANIFEST goes first: a checkpoint without one does not exist.
            self.store.delete(mf.manifest_key(self.run, s))
            for f in doc["files"]:
                if f["key"] not in referenced:
                    self.store.delete(f["key"])
            self.event("pruned", f"step {s} pruned (keeping {sorted(keep)})", step=s)

    def remember_restored(self, doc: Dict[str, Any]) -> None:
        """A checkpoint restore put back is sealed already: an in-place file restored at step S
        continues its sequence from S instead of being sealed again as new."""
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
        and reached in the store, oldest first (onbox/room.py says what may go); bytes freed."""
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
    for info in store.list(f"{run}/epochs/"):
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
