"""What may be deleted locally to make room: only local bytes the store holds exactly.

When the checkpoint disk runs low (free bytes or inodes under ``LOW_WATER``), the sealer asks
``Room.free`` to delete local copies of sealed checkpoints, oldest first, until it is not low.
A local checkpoint (a file or a directory under RGT_CKPT_DIR) is deleted only when all hold:

- its current bytes are a sealed checkpoint's: every file on disk under it is listed by one
  MANIFEST with the same size and sha256 (hashed now, not assumed from its name or step: an
  in-place ``ckpt.pt`` is one root for many steps, and holds only the newest of them), and
  no other file is there. A symlink to a regular file in a checkpoint directory
  (``step_N/tokenizer.json`` into the Hugging Face cache) is judged as the sealer sealed it
  (onbox/sealing/discovery.py, only where it follows links): under the link's name, by its
  target's size and sha256. Deleting the checkpoint deletes the link, never the target, and
  frees none of the target's bytes (the ``freed`` count leaves them out, as it leaves out a
  file hard-linked from outside the checkpoint: its bytes stay under the other name). Any
  other symlink (to a directory, dangling, to a FIFO or a device, or any where links are not
  followed), or anything but files, makes the checkpoint not ours to judge: it stays;
- that MANIFEST is reached: the store still holds it, unchanged, with every object it names,
  and LATEST (or a pin) reaches it (its step is LATEST's or an older kept one, or pinned), and
  it is not quarantined;
- it is not the newest local state: never the checkpoint LATEST names, never the newest sealed
  checkpoint still on this disk, never a file whose bytes are not sealed (the job's newest);
- no symlink elsewhere in the checkpoint dir leads to it or into it (a user's ``best`` link, a
  newer checkpoint's ``tokenizer.json`` linked to this one's): the link would dangle, and the
  job resumes through it. Rotation's rule (onbox/train/ckptdir.py ``prune``, links.inbound);
  a link inside the checkpoint itself goes with it;
- no process holds one of its files open for writing, and none changed between the hash and
  the delete (the checkpoint is first renamed to a temporary name the sealer skips, then its
  (size, mtime_ns, inode) compared again, so a rewrite that begins meanwhile is put back).

Each deletion is one ``freed_local`` event saying what went and how many bytes it made. When
the disk is low and nothing may go, one ``room_exhausted`` event says so, once until the disk
recovers or something could be deleted again (not one per pass).
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from onbox.common import links
from onbox.common.errors import IntegrityError
from onbox.common.safepath import NotRegularFile, sha256_regular
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import link_kind
from onbox.sealing.ledger import pinned_steps
from onbox.sealing.quarantine import quarantined
from onbox.sealing.stores.base import Store

LOW_WATER = 0.05  # free fraction (bytes or inodes) under which sealed local copies go
_FREEING = ".rgt-free"  # suffix of a checkpoint being deleted: the sealer skips ".rgt-" names

Sig = Tuple[int, int, int]
# A symlink to a regular file in a checkpoint: (its target's real path, the link's own Sig)
Links = Dict[str, Tuple[str, Sig]]


def free_fraction(path: str) -> Optional[Tuple[float, float]]:
    """(free bytes, free inodes) of the filesystem holding ``path``, as fractions of its
    total; None when it cannot be asked. A filesystem with no inode count reports 1.0."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    b = st.f_bavail / st.f_blocks if st.f_blocks else 1.0
    i = st.f_favail / st.f_files if st.f_files else 1.0
    return b, i


def is_low(path: str) -> bool:
    """Whether free bytes or free inodes of ``path``'s filesystem are under LOW_WATER."""
    free = free_fraction(path)
    return free is not None and min(free) < LOW_WATER


def _sig(st: os.stat_result) -> Sig:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class Room:
    """Makes room on the checkpoint disk from sealed local copies (see the module docstring).

    ``busy(paths)`` says which of ``paths`` a process holds open for writing (the sealer's
    ``open_for_writing``); ``event`` is the journal's; ``follow()`` whether the sealer seals a
    symlink to a regular file in a checkpoint as that file (its ``follow_links``)."""

    def __init__(
        self,
        run: str,
        ckpt_dir: str,
        store: Store,
        *,
        event: Callable[..., None],
        busy: Callable[[List[str]], Set[str]],
        follow: Callable[[], bool] = lambda: False,
    ) -> None:
        self.run = run
        self.ckpt_dir = ckpt_dir
        self.store = store
        self.event = event
        self.busy = busy
        self.follow = follow
        self.stuck_reported = False

    def free(self, manifests: Mapping[int, Dict[str, Any]], latest: Optional[int]) -> int:
        """Delete sealed local copies, oldest first, while the disk is low; bytes freed."""
        if not is_low(self.ckpt_dir):
            self.stuck_reported = False
            return 0
        reach = self._reach()
        by_root: Dict[str, List[Dict[str, Any]]] = {}
        for step in sorted(manifests):
            doc = manifests[step]
            by_root.setdefault(doc["root"], []).append(doc)
        present = [r for r in by_root if os.path.lexists(self._path(r))]
        # The newest local state stays, whatever the disk: LATEST's checkpoint, and the root
        # of the newest step sealed from a root still on this disk (an in-place root holds, at
        # best, the newest step sealed from it; if it holds newer unsealed bytes, still more so).
        keep: Set[str] = set()
        if latest is not None and latest in manifests:
            keep.add(manifests[latest]["root"])
        if present:
            keep.add(max(present, key=lambda r: by_root[r][-1]["step"]))
        keep |= self._linked(present)
        freed = 0
        deleted = 0
        for root in sorted(present, key=lambda r: by_root[r][-1]["step"]):
            if root in keep:
                continue
            got = self._free_one(root, by_root[root], reach)
            if got is None:
                continue
            freed += got
            deleted += 1
            if not is_low(self.ckpt_dir):
                break
        if deleted:
            self.stuck_reported = False
        elif not self.stuck_reported:
            self.stuck_reported = True
            self.event(
                "room_exhausted",
                f"the disk of {self.ckpt_dir} is low and no local checkpoint may be deleted: "
                "each one left is the newest state, not sealed in the store as it is now, "
                "open for writing, led to by a symlink in the checkpoint dir, or holds a symlink "
                "the sealer left out: one to a directory, a dangling one, or any where the "
                "sealer follows no link, as in a pod",
                klass="permanent",
                # No parentheses of its own: a remedy is printed inside a pair.
                remedy="free disk space or inodes, df -h and df -i show which ran short; "
                "or let the job keep fewer checkpoints",
            )
        return freed

    def _linked(self, roots: List[str]) -> Set[str]:
        """The ``roots`` that a symlink in the checkpoint dir, not inside the root itself,
        leads to or into (a deep walk: paid only when the disk is low)."""
        found = links.inbound(self.ckpt_dir, deep=True)
        out: Set[str] = set()
        for root in roots:
            path = self._path(root)
            real = os.path.realpath(path)
            for link, target in found:
                inside = link == path or link.startswith(path + os.sep)
                if not inside and (target == real or target.startswith(real + os.sep)):
                    out.add(root)
                    break
        return out

    # ---- what the store says
    def _reach(self) -> Tuple[Optional[int], Set[int], Set[int]]:
        """(LATEST's step, pinned steps, quarantined steps), read from the store now: what
        this agent remembers may be older than what another agent or a restore did since."""
        latest = mf.parse_latest(self.store.get_bytes(mf.latest_key(self.run)))
        return (
            latest["step"] if latest else None,
            pinned_steps(self.store, self.run),
            set(quarantined(self.store, self.run)),
        )

    def _reached(
        self, doc: Dict[str, Any], reach: Tuple[Optional[int], Set[int], Set[int]]
    ) -> bool:
        """Whether the store still holds ``doc`` as it is, with each of its objects, and
        LATEST or a pin reaches it."""
        latest, pinned, quarantined = reach
        step = doc["step"]
        if step in quarantined or not (step in pinned or (latest is not None and step <= latest)):
            return False
        key = mf.manifest_key(self.run, step)
        try:
            stored = mf.parse_manifest(self.store.get_bytes(key) or b"", key)
        except IntegrityError:
            return False
        if _files(stored) != _files(doc):
            return False
        for f in stored["files"]:
            info = self.store.stat(f["key"])
            if info is None or info.size != f["size"]:
                return False
        return True

    # ---- one local checkpoint
    def _path(self, rel: str) -> str:
        return os.path.join(self.ckpt_dir, *rel.split("/"))

    def _on_disk(self, root: str) -> Optional[Tuple[Dict[str, Sig], Links]]:
        """Every file under ``root`` (a file or a directory), by its path relative to the
        checkpoint dir, with its signature (a link's: its target's), and the links among them;
        None when anything but plain files and links the sealer seals is there (not ours to
        judge: the module docstring)."""
        path = self._path(root)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISREG(st.st_mode):
            return {root: _sig(st)}, {}
        if not stat.S_ISDIR(st.st_mode):
            return None
        follow = self.follow()
        out: Dict[str, Sig] = {}
        linked: Links = {}
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames:
                if os.path.islink(os.path.join(dirpath, name)):
                    return None
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.ckpt_dir).replace(os.sep, "/")
                try:
                    st = os.lstat(full)
                    if stat.S_ISLNK(st.st_mode) and link_kind(full, follow) is None:
                        # judged as sealed: the target's bytes under the link's name
                        real = os.path.realpath(full)
                        linked[rel] = (real, _sig(st))
                        st = os.lstat(real)
                except OSError:  # gone since it was listed: the job is changing it
                    return None
                if not stat.S_ISREG(st.st_mode):
                    return None
                out[rel] = _sig(st)
        return out, linked

    def _free_one(
        self,
        root: str,
        docs: List[Dict[str, Any]],
        reach: Tuple[Optional[int], Set[int], Set[int]],
    ) -> Optional[int]:
        """Delete the local copy of ``root`` if its bytes are a reached MANIFEST's; bytes
        freed, or None when it must stay."""
        found = self._on_disk(root)
        if not found or not found[0]:
            return None
        files, linked = found
        full = [self._path(r) for r in files]
        if self.busy(full):  # resolves links: a writer of a link's target counts
            return None
        doc = self._sealed_as(files, linked, docs)
        if doc is None or not self._reached(doc, reach):
            return None
        path = self._path(root)
        aside = path + _FREEING
        if os.path.lexists(aside):
            return None  # a deletion cut off earlier: leave it for a person to look at
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None  # the job rotated it away meanwhile
        # A rewrite that began between the hash and the rename went into what is now aside:
        # the same files, unchanged and unopened, or it all goes back.
        if root in files:
            moved = {root: aside}
        else:
            moved = {r: os.path.join(aside, os.path.relpath(self._path(r), path)) for r in files}
        unchanged = all(_stat_sig(moved[r]) == _own_sig(r, files, linked) for r in files)
        if not unchanged or not self._targets_unchanged(path, files, linked):
            unchanged = False
        if not unchanged or self.busy(list(moved.values())):
            if not os.path.lexists(path):
                os.rename(aside, path)
            return None
        size = _freed_by(moved, linked)
        if os.path.isdir(aside):
            shutil.rmtree(aside)
        else:
            os.unlink(aside)
        free = free_fraction(self.ckpt_dir) or (0.0, 0.0)
        self.event(
            "freed_local",
            f"the disk is low: deleted the local copy of step {doc['step']} ({root}, "
            f"{len(files)} file(s){_links_said(linked)}, {size} bytes freed; "
            f"{100 * free[0]:.1f}% of the disk free "
            "now): its bytes are sealed and verified in the store",
            step=doc["step"],
            root=root,
            freed=size,
            klass="transient",
            remedy="free disk space or keep fewer checkpoints",
        )
        return size

    def _targets_unchanged(self, path: str, files: Dict[str, Sig], linked: Links) -> bool:
        """Whether each link's target out of the checkpoint ``path`` (renamed aside now) is as
        it was hashed; one inside it is one of ``files``, compared as that."""
        home = os.path.realpath(path) + os.sep
        return all(
            real.startswith(home) or _stat_sig(real) == files[r] for r, (real, _) in linked.items()
        )

    def _sealed_as(
        self, files: Dict[str, Sig], linked: Links, docs: List[Dict[str, Any]]
    ) -> Optional[Dict[str, Any]]:
        """The MANIFEST (newest first) whose files are exactly these, by size and sha256 (a
        link's: its target's, read through its real path)."""
        hashed: Dict[str, str] = {}
        for doc in docs[::-1]:
            want = {f["path"]: (f["size"], f["sha256"]) for f in doc["files"]}
            if set(want) != set(files) or any(want[r][0] != files[r][0] for r in files):
                continue
            ok = True
            for rel in files:
                if rel not in hashed:
                    src = linked[rel][0] if rel in linked else self._path(rel)
                    try:
                        sha, _ = sha256_regular(src)
                    except (OSError, NotRegularFile):  # replaced since it was listed
                        return None
                    if _stat_sig(src) != files[rel]:
                        return None  # changed while hashed: the job is writing it
                    hashed[rel] = sha
                if hashed[rel] != want[rel][1]:
                    ok = False
                    break
            if ok:
                return doc
        return None


def _files(doc: Dict[str, Any]) -> Set[Tuple[str, int, str, str]]:
    return {(f["path"], f["size"], f["sha256"], f["key"]) for f in doc["files"]}


def _freed_by(moved: Dict[str, str], linked: Links) -> int:
    """The bytes deleting ``moved`` (each file of the checkpoint, where it lies now) frees: a link's
    target stays (rmtree unlinks a link, never follows it), and so does a file with a hard
    link outside (a ``best.pt`` linked to it, a copy made with ``cp -l``): its bytes are freed
    only when every name of it goes, which for one linked within the checkpoint they do."""
    names: Dict[int, List[os.stat_result]] = {}
    for rel, where in moved.items():
        if rel in linked:
            continue
        try:
            st = os.lstat(where)
        except OSError:  # gone since it was compared: nothing of it to count
            continue
        names.setdefault(st.st_ino, []).append(st)
    return sum(sts[0].st_size for sts in names.values() if sts[0].st_nlink <= len(sts))


def _stat_sig(path: str) -> Optional[Sig]:
    try:
        return _sig(os.lstat(path))
    except OSError:
        return None


def _own_sig(rel: str, files: Dict[str, Sig], linked: Links) -> Sig:
    """The signature of the entry ``rel`` itself: a link's own, else the file's."""
    return linked[rel][1] if rel in linked else files[rel]


def _links_said(linked: Links) -> str:
    n = len(linked)
    return f", {n} of them link(s) to a file that stays where it is" if n else ""
