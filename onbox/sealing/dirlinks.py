"""The symlinks of the checkpoint dir itself: recorded with the checkpoint they lead to, made
again by a restore.

Lightning's ``ModelCheckpoint(save_last="link")`` keeps ``last.ckpt`` as a symlink to the newest
checkpoint, and ``trainer.fit(ckpt_path="last")`` resumes only through it: on a new box without
it, Lightning warns and trains from step 0. A user's ``latest -> step_N`` is the same. Such a
link holds no bytes (its target is sealed under its own name: onbox/common/links.py), so the
seal records it in the MANIFEST of the checkpoint it leads to (``links``: name, target relative
to the dir; onbox/sealing/manifest.py ``check_link`` says what a store may name), and the
restore makes it again, relative, once that checkpoint's files are verified in place.

A link is recorded only with a checkpoint it led to (its root, or a path under it) at a moment
the seal observed (``Seen``: when the checkpoint was picked, during its upload, before its
MANIFEST; the job may have moved it on by the MANIFEST), so a restore never makes one to a
checkpoint it did not put there. It is made only where
the name is free: a name the box already holds (a link the job moved on to a newer checkpoint,
a file) is the box's own and left as it is. A link out of the dir is never recorded (what it
leads to is not sealed). The link is made through a descriptor of the checkpoint dir opened
without following a symlink on the way (onbox/common/safepath.py), and ``symlink`` never
follows or replaces an existing name.

Standard library only.
"""

from __future__ import annotations

import os
import posixpath
import stat
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from onbox.common import links
from onbox.common.durable import read_json, write_json
from onbox.common.errors import IntegrityError
from onbox.common.safepath import lstat_beneath, open_dir
from onbox.sealing.discovery import skip
from onbox.sealing.manifest import check_link


def observe(ckpt_dir: str) -> List[Tuple[str, str]]:
    """(name, target relative to the dir) of each link in ``ckpt_dir`` itself that leads to a
    path in it, as a MANIFEST would record it; a hidden or temporary name (never a
    checkpoint's either) is left out."""
    home = os.path.realpath(ckpt_dir)
    out: List[Tuple[str, str]] = []
    for path, real in sorted(links.inbound(ckpt_dir)):
        name = os.path.basename(path)
        if not skip(name):
            out.append((name, os.path.relpath(real, home).replace(os.sep, "/")))
    return out


class Seen:
    """The dir's links as the sealer saw them: each (name, target) it observed, when it
    observed it last; kept at ``path`` too, so an agent restarted (a crash, an upgrade, an
    adoption) before a checkpoint's MANIFEST still records the links seen leading to it. A
    link is recorded with a checkpoint it led to at any moment the seal observed (when it
    was picked, during its upload, before its MANIFEST):
    that is true of the dir's history. Observed only at the MANIFEST, a ``last.ckpt`` the job
    moves on faster than a seal takes was recorded by no MANIFEST at all. A link never seen
    leading to a checkpoint is never recorded with it (a ``best`` link stays with its own).
    Thread-safe (scan may run beside a seal)."""

    def __init__(self, ckpt_dir: str, path: Optional[str] = None) -> None:
        self.ckpt_dir = ckpt_dir
        self.path = path  # where the memory outlives this agent (RunDir.sealer_links)
        self.pairs: Dict[Tuple[str, str], int] = {}  # (name, target) -> when seen last
        self.n = 0
        self.last: Set[Tuple[str, str]] = set()  # the pairs the last look saw
        self.lock = threading.Lock()
        if path is not None:
            self.pairs = _load(path)
            self.n = max(self.pairs.values(), default=0)

    def look(self) -> None:
        """Observe the dir's links now. A pair whose target is gone (rotation deleted it) is
        forgotten: no seal records it, and the memory stays as small as the dir."""
        now = observe(self.ckpt_dir)
        with self.lock:
            before = set(self.pairs)
            self.n += 1
            for pair in now:
                self.pairs[pair] = self.n
            for pair in list(self.pairs):
                if not os.path.lexists(os.path.join(self.ckpt_dir, *pair[1].split("/"))):
                    del self.pairs[pair]
            # Written only when it changed: the same links as the last look keep their order
            # (which of a name's targets was seen last), so a pass over a still dir writes none.
            if set(now) != self.last or set(self.pairs) != before:
                self._save()
            self.last = set(now)

    def leading_to(self, doc: Dict[str, Any]) -> List[Dict[str, str]]:
        """Observe once more, then the links seen leading to the checkpoint of ``doc`` (a
        MANIFEST about to be written: its root and files), as the MANIFEST records them, one
        per name (the target seen last), by name. A link the MANIFEST could not hold
        (``check_link``: an odd name) is left out."""
        self.look()
        with self.lock:
            pairs = sorted(self.pairs.items(), key=lambda kv: kv[1])
        out: Dict[str, Dict[str, str]] = {}
        for (name, target), _ in pairs:
            try:
                out[name] = check_link({"name": name, "target": target}, doc)
            except IntegrityError:
                continue  # another checkpoint's link, or one no MANIFEST may hold
        return [out[name] for name in sorted(out)]

    def sealed(self, root: str) -> None:
        """The checkpoint ``root`` has its MANIFEST: its links are recorded, forget them."""
        with self.lock:
            gone = [p for p in self.pairs if p[1] == root or p[1].startswith(root + "/")]
            for pair in gone:
                del self.pairs[pair]
            if gone:
                self._save()

    def _save(self) -> None:
        """The memory, durably (under the lock): a sealer restarted before a checkpoint's
        MANIFEST still records the links seen leading to it. Not written (disk full, a
        read-only run dir): it stays in this process, as before it was kept on disk; sealing
        goes on."""
        if self.path is None:
            return
        doc = {"version": 1, "pairs": [[n, t, k] for (n, t), k in sorted(self.pairs.items())]}
        try:
            write_json(self.path, doc)
        except OSError:
            pass


def links_state(state_path: str) -> str:
    """Where the links' memory is kept beside the sealer's state file ``state_path``:
    ``sealer.json`` has ``sealer-links.json`` (RunDir.sealer_links)."""
    return os.path.splitext(state_path)[0] + "-links.json"


def _load(path: str) -> Dict[Tuple[str, str], int]:
    """The memory a sealer of this run left on the box. Local state an earlier agent wrote,
    read as untrusted all the same: a file torn or changed by hand loses what does not parse
    (a pair is dropped, never guessed), and never stops sealing. A pair kept is still checked
    against the MANIFEST it would join (``check_link``) before it is recorded."""
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return {}
    pairs = doc.get("pairs") if isinstance(doc, dict) else None
    out: Dict[Tuple[str, str], int] = {}
    for item in pairs if isinstance(pairs, list) else []:
        if not (isinstance(item, list) and len(item) == 3):
            continue
        name, target, n = item
        if not (isinstance(name, str) and isinstance(target, str)):
            continue
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            continue
        parts = target.split("/")
        if not name or "/" in name or any(p in ("", ".", "..") for p in parts):
            continue  # not a name in the dir, nor a path under it, as observe gives
        out[(name, target)] = n
    return out


def make(
    recorded: List[Dict[str, str]], base: str, sub: str = "", replace: bool = False
) -> Tuple[List[str], List[str]]:
    """Make the ``recorded`` links (a checked MANIFEST's, its files verified in place) in the
    checkpoint dir ``base/sub`` (``sub``, rgt's own path, each of its directories opened
    without following a link; a pull's may lie below the top of DEST/checkpoints):
    (the names made, the names left as they are). A name taken is left, unless ``replace``
    and it is a symlink (a pull's DEST mirrors the sealed state: its link from an older pull
    is replaced, in one rename, never followed); a link whose target is not there (a
    hand-made document) is not made, and counted as left."""
    made: List[str] = []
    left: List[str] = []
    if not recorded:
        return made, left
    fd = open_dir(base, sub.split("/") if sub else [])
    try:
        for link in recorded:
            name, target = link["name"], link["target"]
            # A pull's link below the top of the dir names its target from its own directory
            # ('../step-100/x'): looked for by the path that leads to, never followed there.
            if not _there(base, posixpath.normpath(f"{sub}/{target}") if sub else target):
                left.append(name)
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                os.symlink(target, name, dir_fd=fd)
                made.append(name)
                continue
            if stat.S_ISLNK(st.st_mode) and _leads(fd, os.path.join(base, sub), name, target):
                continue  # there already (the box that sealed it): nothing to say
            if not (replace and stat.S_ISLNK(st.st_mode)):
                left.append(name)  # the box's own (the job moved it on), or a file: kept
                continue
            _unlink(fd, _SPARE)
            os.symlink(target, _SPARE, dir_fd=fd)
            os.replace(_SPARE, name, src_dir_fd=fd, dst_dir_fd=fd)
            made.append(name)
        if made:
            os.fsync(fd)  # the links outlive a crash, as the files renamed in place do
    finally:
        os.close(fd)
    return made, left


# The new link before it is renamed over an older one (a name the sealer never records).
_SPARE = ".rgt-link.tmp"


def _there(base: str, rel: str) -> bool:
    try:
        return lstat_beneath(base, rel) is not None
    except IntegrityError:  # a symlink on the way: not the checkpoint restored
        return False


def _leads(fd: int, here: str, name: str, target: str) -> bool:
    """Whether the link ``name`` leads to ``target`` (both in ``here``, the dir of ``fd``), as
    the seal judged it: the job's ``./step_2``, or an absolute path to the same file, does
    too. Only read: nothing is written through it."""
    now = os.readlink(name, dir_fd=fd)
    if now == target:
        return True
    return os.path.realpath(os.path.join(here, now)) == os.path.realpath(os.path.join(here, target))


def _unlink(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def said(made: List[str], left: List[str]) -> str:
    """The restore's words for what ``make`` did ('' when the checkpoint has no link)."""
    parts = []
    if made:
        parts.append("links made again: " + ", ".join(made))
    if left:
        parts.append("links left as the box holds them: " + ", ".join(left))
    return "; ".join(parts)
