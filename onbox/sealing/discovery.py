"""What a complete checkpoint is: the one rule the sealer, the resume check and completion use.

A checkpoint in the job's checkpoint dir is complete when:

- a directory holds a completeness marker (rgt's ``.rgt-complete``, Transformers'
  ``trainer_state.json``, DCP's ``.metadata``) that parses: a JSON marker cut off mid-write is
  no marker at all, so that directory is not a complete checkpoint (yet);
- a file in a checkpoint format is closed and open for writing by no process (checked in /proc,
  so a file rewritten every few hundred milliseconds is still caught between two writes), and
  not torn (``looks_whole``).

Its step comes from rgt's marker or the name (``step_120``, ``checkpoint-120``, ``ckpt_120.pt``).
Hidden and temporary names (``skip``) are never checkpoints: torn writes live there.

Only regular files are sealed. A symlink in the checkpoint dir itself is never followed (a
``latest`` link names a checkpoint sealed under its own name anyway; onbox/common/links.py). A
symlink to a regular file *inside* a checkpoint directory (``step_1/tokenizer.json`` linked
from the Hugging Face cache, a checkpoint assembled with ``ln -s``) is sealed as that file's
content under the link's name, as ``rsync -L`` and s5cmd copy it: left out, the checkpoint a
restore brings back is incomplete, and the resume fails or silently uses another tokenizer.
Its size, mtime and sha256 are the target's, checked like any file's (the stability checks,
the writers in /proc, on the target). This grants nothing new: the job runs as the agent's
user and could copy those bytes into the checkpoint itself; rgt's own verification
(onbox/train/ckptdir.py ``verify``) hashes through links too, so the two agree. Where the
job's files are in another container's filesystem (a pod: ``follow=False``), an absolute
target would be resolved in the *agent's* filesystem (its store credentials, another file of
the same name), so there no link is followed (onbox/agent/jobroot.py says the same of
outputs). Never followed, anywhere: a link to a directory (loops, unbounded trees), a
dangling link, a link to a FIFO, socket or device or into /proc or /sys (no stable bytes to
keep; a FIFO would block the read). Those, and a FIFO, a socket or a device itself, are left
out, and listed in ``left_out`` so the sealer reports it once.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Dict, List, Optional, Set, Tuple

from onbox.common import jobenv
from onbox.common.safepath import NotRegularFile, file_kind, open_regular
from onbox.common.wholefile import looks_whole

MARKERS = (jobenv.COMPLETE_MARKER, "trainer_state.json", ".metadata")
_STEP = re.compile(r"(?i)(?:global_step|checkpoint|ckpt|step|iter(?:ation)?)[_\-=]?(\d+)")
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
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR

Sig = Tuple[int, int, int]


def step_from_name(name: str) -> Optional[int]:
    found = _STEP.findall(name)
    return int(found[-1]) if found else None


def skip(name: str) -> bool:
    """Temporary and hidden names are never checkpoints (torn writes live there)."""
    low = name.lower()
    return (
        name.startswith(".")
        or low.endswith((".tmp", ".partial", ".part", ".lock", "~"))
        or ".tmp." in low
        or ".rgt-" in low
    )


def is_ckpt_file(name: str) -> bool:
    """Whether a loose file's name is in a checkpoint format."""
    return name.lower().endswith(CKPT_SUFFIXES)


def step_named(name: str) -> bool:
    """A loose file sealed as a step of its own (``step_120.pt``), not rewritten in place."""
    return is_ckpt_file(name) and step_from_name(name) is not None


def in_place(root: str, kind: str) -> bool:
    """A file with no step in its name (``ckpt.pt``) is rewritten in place: a sequence, each
    completed rewrite the next step."""
    return kind == "file" and step_from_name(os.path.basename(root)) is None


def signature(st: os.stat_result) -> Sig:
    """(size, mtime_ns, inode): what changes when a file is rewritten or replaced. A
    checkpoint's identity, remembered across passes (sealed in-place rewrites, refused and
    failed checkpoints, in RunDir.sealer_state too): no ctime, which a chmod, a hard link or a
    restore's own bookkeeping moves without changing a byte (that would seal it again)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def read_signature(st: os.stat_result) -> Tuple[int, int, int, int]:
    """``signature`` and ctime_ns: what must be the same before and after a file is read for
    the bytes read to be one version. A rewrite in place that restores mtime (``cp -p``,
    ``rsync -t``, ``os.utime``) keeps the signature, but the kernel moves ctime at every write
    and no caller can set it back; a chmod meanwhile only costs a retry."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _real_paths(paths: List[str]) -> Dict[str, List[str]]:
    """Each real path (symlinks resolved, as /proc names open files) -> the ``paths`` that are
    it. A directory's real path is resolved once, not once per file in it (a checkpoint of
    10,000 files would be 10,000 walks of the same directories); a file that is itself a
    symlink is resolved whole."""
    dirs: Dict[str, str] = {}
    out: Dict[str, List[str]] = {}
    for p in paths:
        d, name = os.path.split(p)
        real_dir = dirs.get(d)
        if real_dir is None:
            real_dir = dirs[d] = os.path.realpath(d)
        real = os.path.join(real_dir, name)
        if os.path.islink(real):
            real = os.path.realpath(real)
        out.setdefault(real, []).append(p)
    return out


def open_for_writing(paths: List[str]) -> Set[str]:
    """Which of ``paths`` some process holds open for writing (from /proc/*/fd and fdinfo): the
    busy ones both as given and as their real paths."""
    real = _real_paths(paths)
    wanted = set(real)
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
    return busy.union(*(real[t] for t in busy))


class Candidate:
    """A complete checkpoint found on disk, not sealed yet."""

    def __init__(
        self,
        root: str,
        kind: str,
        step: Optional[int],
        files: List[str],
        signature: Sig,
        left_out: Optional[List[Tuple[str, str]]] = None,
        linked: Optional[Set[str]] = None,
    ) -> None:
        self.root = root  # relative to the checkpoint dir
        self.kind = kind  # "file" | "dir"
        self.step = step
        self.files = files  # relative to the checkpoint dir
        self.signature = signature  # (size, mtime_ns, inode) of a file; of the marker for a dir
        # (name relative to the checkpoint dir, what it is) of each entry that is not sealed:
        # not a regular file (a symlink, a FIFO, a socket, a device)
        self.left_out = left_out or []
        # the ``files`` that are symlinks to a regular file: their target's bytes are sealed
        self.linked = linked or set()


def dir_marker(path: str) -> Optional[Tuple[str, Optional[int]]]:
    """The completeness marker of the directory ``path`` and the step it carries, or None when
    it has none, or its JSON marker does not parse (cut off mid-write: no marker at all). Only
    a regular file is a marker: a symlink is not sealed (so it would not come back with the
    checkpoint), and a FIFO would hang the read."""
    marker = next((m for m in MARKERS if _regular(os.path.join(path, m))), None)
    if marker is None:
        return None
    step = None
    if marker != ".metadata":
        try:
            with open(open_regular(os.path.join(path, marker))) as f:
                doc = json.load(f)
        except (OSError, ValueError, RecursionError, NotRegularFile):
            return None
        if marker == jobenv.COMPLETE_MARKER:
            try:
                step = int(doc["step"])
            except (KeyError, TypeError, ValueError):
                step = None
    return marker, step


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def dir_step(name: str, path: str) -> Optional[int]:
    """The step of the directory checkpoint ``name`` at ``path`` (its marker's, else its
    name's), or None when it is not a complete checkpoint with a step."""
    found = dir_marker(path)
    if found is None:
        return None
    return found[1] if found[1] is not None else step_from_name(name)


def dir_candidate(ckpt_dir: str, name: str, path: str, follow: bool = False) -> Optional[Candidate]:
    """The directory ``name`` (at ``path``, in ``ckpt_dir``) as a checkpoint with every file
    in it, or None when it is not a complete checkpoint with a step. ``follow``: a symlink to
    a regular file in it is one of its files (the module docstring says when)."""
    found = dir_marker(path)
    if found is None:
        return None
    marker, step = found
    if step is None:
        step = step_from_name(name)
    if step is None:
        return None
    rel_files, left_out, linked = _regular_files(ckpt_dir, path, follow)
    try:
        st = os.stat(os.path.join(path, marker))
    except FileNotFoundError:
        return None  # the job rotated it away while it was listed: normal, not an error
    return Candidate(name, "dir", step, rel_files, signature(st), left_out, linked)


# Pseudo-files: a size that is not what a read gives, so never a stable file to seal.
_PSEUDO = ("/proc/", "/sys/")


def link_kind(path: str, follow: bool) -> Optional[str]:
    """None when the symlink ``path`` is sealed as the regular file it leads to (``follow``);
    else what it is, in words, for ``left_out``."""
    if not follow:
        return "a symlink (not followed: the job's files are in another filesystem)"
    try:
        st = os.stat(path)
    except OSError:  # dangling, a loop, or a directory on the way denied
        return "a symlink that leads nowhere"
    kind = file_kind(st.st_mode)
    if kind is not None:
        return f"a symlink to {kind}"
    if os.path.realpath(path).startswith(_PSEUDO):
        return "a symlink to a pseudo-file (/proc, /sys)"
    return None


def _regular_files(
    ckpt_dir: str, path: str, follow: bool = False
) -> Tuple[List[str], List[Tuple[str, str]], Set[str]]:
    """The regular files under ``path`` (relative to ``ckpt_dir``, sorted; hidden and temporary
    names but the markers skipped), and (name, what it is) of every other entry, and which of
    the files are symlinks to a regular file (only with ``follow``). Each entry is lstat'ed: a
    symlink to a directory is left out, never followed (os.walk does not descend into it, which
    was a silent omission), so is any other link ``link_kind`` names."""
    files: List[str] = []
    left_out: List[Tuple[str, str]] = []
    linked: Set[str] = set()

    def rel(dirpath: str, name: str) -> str:
        return os.path.relpath(os.path.join(dirpath, name), ckpt_dir).replace(os.sep, "/")

    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for dn in dirnames:
            if os.path.islink(os.path.join(dirpath, dn)):
                left_out.append((rel(dirpath, dn), "a symlink to a directory"))
        for fn in sorted(filenames):
            if skip(fn) and fn != jobenv.COMPLETE_MARKER and fn != ".metadata":
                continue
            full = os.path.join(dirpath, fn)
            try:
                kind = file_kind(os.lstat(full).st_mode)
            except FileNotFoundError:
                continue  # deleted since the directory was read: the seal finds it vanished
            if kind == "a symlink":
                kind = link_kind(full, follow)
                if kind is None:
                    linked.add(rel(dirpath, fn))
            if kind is None:
                files.append(rel(dirpath, fn))
            else:
                left_out.append((rel(dirpath, fn), kind))
    return files, sorted(left_out), linked


Stats = List[Tuple[str, os.stat_result]]


def listing(ckpt_dir: str, follow: bool = False) -> Tuple[List[Candidate], Stats, Stats]:
    """What ``ckpt_dir`` holds that may be a checkpoint, by name: the complete directory
    checkpoints, the loose files in a checkpoint format (with their stat), whose completeness
    (closed, whole) the caller checks, and the symlinks that would otherwise be one of those
    (with their lstat): never followed, so never sealed (Lightning's ``last.ckpt`` link, a
    ``latest`` link name a checkpoint sealed under its own name). ``follow``: dir_candidate's."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return [], [], []
    dirs: List[Candidate] = []
    files: Stats = []
    links: Stats = []
    for name in names:
        if skip(name):
            continue
        path = os.path.join(ckpt_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            if os.path.isdir(path) or is_ckpt_file(name):
                links.append((name, st))
        elif stat.S_ISDIR(st.st_mode):
            cand = dir_candidate(ckpt_dir, name, path, follow)
            if cand is not None:
                dirs.append(cand)
        elif stat.S_ISREG(st.st_mode) and is_ckpt_file(name):
            files.append((name, st))
    return dirs, files, links


def newest_complete_step(ckpt_dir: str) -> Optional[int]:
    """The step of the newest complete checkpoint in ``ckpt_dir`` while a job may be writing
    there, as the sealer's scan takes them: ``listing``'s, less any with a file still open for
    writing, a loose file only when whole. A file rewritten in place (no step in its name) is
    not counted: its step is the one the sealer gives it (``rgt-agent sync``'s check)."""
    dirs, files, _ = listing(ckpt_dir)
    named = sorted(((s, n) for n, _ in files if (s := step_from_name(n)) is not None), reverse=True)
    paths = [os.path.join(ckpt_dir, f) for c in dirs for f in c.files]
    busy = open_for_writing(paths + [os.path.join(ckpt_dir, n) for _, n in named])
    steps = [
        c.step
        for c in dirs
        if c.step is not None and not any(os.path.join(ckpt_dir, f) in busy for f in c.files)
    ]
    best = max(steps, default=None)
    for step, name in named:
        if best is not None and step <= best:
            break
        path = os.path.join(ckpt_dir, name)
        if path not in busy and looks_whole(path):
            return step
    return best


def newest_local_step(ckpt_dir: str) -> Optional[int]:
    """The step of the newest complete checkpoint in ``ckpt_dir``, as the sealer would see it
    when nothing is writing there (between two attempts): a directory with a completeness
    marker, or a whole file in a checkpoint format, each with a step from its marker or name."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return None
    files: List[Tuple[int, str]] = []
    best: Optional[int] = None
    for name in names:
        if skip(name):
            continue
        path = os.path.join(ckpt_dir, name)
        if os.path.islink(path):
            continue  # never sealed (listing): not one the sealer would see
        if os.path.isdir(path):
            step = dir_step(name, path)
            if step is not None and (best is None or step > best):
                best = step
        elif is_ckpt_file(name):
            step = step_from_name(name)
            if step is not None:
                files.append((step, path))
    for step, path in sorted(files, reverse=True):
        if best is not None and step <= best:
            break
        if looks_whole(path):  # a torn file (its writer died mid-write) is no checkpoint
            return step
    return best
