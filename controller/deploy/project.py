"""The files of a project that a release holds, and the content hash that names the release.

What is pushed is what the project's git work tree holds (tracked, and untracked but not ignored)
or, outside git, every file under it but a directory that ignores itself (a ``.gitignore`` of
``*``, as `rgt pull`'s rgt-results, a virtualenv, .pytest_cache have), as git would; never VCS
metadata, caches, venvs or rgt's own state. The release's id hashes each file's path, kind and
content, so the same code always has the same id (controller/deploy/release.py pushes it under
that name).
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Dict, List, Optional, Sequence, Tuple

from controller import children, envnames
from onbox.common import jobenv
from onbox.common.errors import UsageError

# rgt's own state, wherever it sits in a project: never pushed, git-ignored or not. `.rgt` is
# RGT_HOME's default name (a project that is $HOME holds the `local` box's), `.rgt-demo`
# scripts/demo's home. The directories RGT_HOME, RGT_BOX_HOME and RGT_CONTROLLER_HOME name are
# left out too when they lie inside the project (see _state_paths).
STATE_DIRS = (".rgt", ".rgt-demo")
STATE_VARS = (jobenv.HOME, envnames.BOX_HOME, envnames.CONTROLLER_HOME)


def _git_root(root: str) -> Optional[str]:
    d = os.path.abspath(root)
    while True:
        if os.path.lexists(os.path.join(d, ".git")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _state_paths(root: str) -> List[str]:
    """The directories of rgt's state that ``$RGT_HOME``, ``$RGT_BOX_HOME`` and
    ``$RGT_CONTROLLER_HOME`` name inside the project ``root``, relative to it (the registry,
    receipts, a `local` box's runs and secrets)."""
    real_root = os.path.realpath(root)
    out = []
    for var in STATE_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        real = os.path.realpath(os.path.expanduser(value))
        if real != real_root and _inside(real, real_root):
            out.append(os.path.relpath(real, real_root))
    return out


def _is_state(rel: str, state: Sequence[str]) -> bool:
    """Whether the project path ``rel`` is (or is inside) rgt's own state."""
    parts = rel.split(os.sep)
    if any(p in STATE_DIRS for p in parts[:-1]) or parts[-1] in STATE_DIRS:
        return True
    return any(rel == s or rel.startswith(s + os.sep) for s in state)


def _ignores_itself(d: str) -> bool:
    """Whether directory ``d`` holds a ``.gitignore`` whose one rule is ``*`` (blank lines and
    comments aside): a tool's own directory saying "none of me is the project's" (`rgt pull`'s
    rgt-results, controller/results/destination.py ``ignore_all``; a virtualenv, .pytest_cache,
    .ruff_cache, .mypy_cache). Git leaves it out; so does the walk outside git."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        with open(os.open(os.path.join(d, ".gitignore"), flags), "rb") as f:
            data = f.read(4096)
    except OSError:  # none, a link, a directory: not a rule of its own
        return False
    rules = [ln.strip() for ln in data.splitlines()]
    return [r for r in rules if r and not r.startswith(b"#")] == [b"*"]


def _walk(root: str, rel: str, out: Dict[str, None]) -> None:
    """Every file and link under ``root/rel``, except VCS metadata, caches, venvs, rgt's state
    and the directories that ignore themselves."""
    top = os.path.join(root, rel) if rel else root
    for here, dirs, files in os.walk(top):
        keep = []
        for d in dirs:
            if d in (".git", "__pycache__") or d.startswith(".venv") or d in STATE_DIRS:
                continue
            path = os.path.join(here, d)
            if os.path.islink(path):
                files.append(d)  # a link to a directory is pushed as the link
            elif not _ignores_itself(path):
                keep.append(d)
        dirs[:] = keep
        for f in files:
            out[os.path.relpath(os.path.join(here, f), root)] = None


def project_files(root: str) -> List[str]:
    """The files to push from ``root``, relative to it, sorted.

    In a git work tree: the tracked and the untracked-but-not-ignored files (a tracked file deleted
    from the tree is skipped). Elsewhere: every file under ``root`` except .git/, __pycache__/,
    .venv*/ and each directory that ignores itself (``_ignores_itself``: `rgt pull`'s
    rgt-results), as git would leave them out. Either way never rgt's own state (STATE_DIRS at
    any depth, and the state directories STATE_VARS name inside ``root``), tracked or not.
    Symbolic links stay links; one that leads outside ``root`` is refused (the box would not
    have what it points to). Sockets, FIFOs and devices are skipped.
    """
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise UsageError("project", f"{root!r} is not a directory")
    found: Dict[str, None] = {}
    if _git_root(root) is not None:
        try:
            p = children.run(
                ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                timeout=300,
            )
        except FileNotFoundError:
            raise UsageError(
                "project",
                f"{root} is in a git work tree but git is not installed",
                "install git, so that ignored files stay on this machine",
            ) from None
        if p.returncode != 0:
            raise UsageError(
                "project",
                f"git cannot list the files of {root}: "
                + p.stderr.decode("utf-8", "replace").strip(),
                "fix the repository (or `git config --global --add safe.directory ...`)",
            )
        for raw in p.stdout.split(b"\0"):
            if not raw:
                continue
            rel = os.fsdecode(raw.rstrip(b"/"))
            path = os.path.join(root, rel)
            if os.path.isdir(path) and not os.path.islink(path):
                _walk(root, rel, found)  # a submodule or a nested repository: its files
            elif os.path.lexists(path):
                found[rel] = None
    else:
        _walk(root, "", found)
    state = _state_paths(root)
    real_root = os.path.realpath(root)
    out = []
    for rel in found:
        if _is_state(rel, state):
            continue  # git lists an un-ignored .rgt/ as untracked: never push it
        path = os.path.join(root, rel)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            dest = os.path.realpath(os.path.join(os.path.dirname(path), target))
            if os.path.isabs(target) or not _inside(dest, real_root):
                raise UsageError(
                    "project",
                    f"the link {rel!r} points outside the project (to {target!r})",
                    "replace it with a relative link inside the project, or with the file itself",
                )
        elif not stat.S_ISREG(st.st_mode):
            continue
        out.append(rel)
    return sorted(out, key=os.fsencode)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _sha256_file(path: str) -> Tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def release_id(root: str, files: Sequence[str]) -> str:
    """The content hash naming a release: over each file's path, kind (file, executable file or
    link) and the sha256 of its content or link target. 16 hex digits."""
    outer = hashlib.sha256(b"rgt-release-1\0")
    for rel in sorted(files, key=os.fsencode):
        path = os.path.join(root, rel)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            kind, digest = b"L", hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest()
        else:
            kind = b"X" if st.st_mode & 0o100 else b"F"
            digest = _sha256_file(path)[0]
        outer.update(kind + b"\0" + os.fsencode(rel) + b"\0" + digest.encode() + b"\0")
    return outer.hexdigest()[:16]
