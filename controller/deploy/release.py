"""Pushing the project's code to the box as an immutable release, and switching a run to it.

Box layout (under RGT_HOME on the box)::

    releases/<id>/                 one release: the pushed files and, written last, .rgt-release
    releases/.tmp-<id>-<random>/   a push in progress (or one cut off: removed by a later push)
    deploys/<name>/current -> ../../releases/<id>

Every directory rgt makes there is 0700 (the scripts run under umask 077, and a release's own
directory is set to 0700 whatever mode rsync copied from the project's): on a shared box no
other user reads the code or what the job writes next to it.

``<id>`` is a content hash of the pushed files (path, executable bit, content or link target), so
the same code always lands in the same directory and a second deploy of unchanged code finds its
release complete and moves nothing. A release is uploaded into a temporary directory (with rsync
when both ends have it, copying unchanged files on the box from the previous release with
``--copy-dest``; else as a tar stream over ssh), marked complete, then renamed into place; the
``current`` link is replaced by renaming a new link over it. A push cut off anywhere therefore
leaves ``current`` on the old release or the new one, and never a half release under
``releases/<id>``.

`rgt deploy` looks for the release in its audit's round trip (``SEEN_SH``, read by
``parse_seen``): ``push_release`` given that look (``seen``) runs no command of its own when the
release is complete, so a deploy of unchanged code spends no round trip on its code.

Every name travels as data: paths on the box as quoted argv or as sh positional parameters
(``Remote.sh``), file lists NUL-separated on rsync's stdin (``--from0``) with rsync's
``--protect-args``, tar member names inside the stream. Any byte a file system allows in a name
arrives as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import shutil
import stat
import subprocess
import tarfile
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from controller.remote import Remote, rsync_e
from onbox.common import jobenv
from onbox.common.errors import HostError, RemoteUnreachable, UsageError
from onbox.common.rundir import check_name

MARKER = ".rgt-release"  # written last into a complete release
# rgt's own state, wherever it sits in a project: never pushed, git-ignored or not. `.rgt` is
# RGT_HOME's default name (a project that is $HOME holds the `local` box's), `.rgt-demo`
# scripts/demo's home. The directories RGT_HOME, RGT_BOX_HOME and RGT_CONTROLLER_HOME name are
# left out too when they lie inside the project (see _state_paths).
STATE_DIRS = (".rgt", ".rgt-demo")
STATE_VARS = (jobenv.HOME, "RGT_BOX_HOME", "RGT_CONTROLLER_HOME")
STALE_AFTER_MIN = 5  # a .tmp- release untouched this long belongs to a push that died
_ID = re.compile(r"[0-9a-f]{16}\Z")
_SUFFIX = re.compile(r"[A-Za-z0-9]{6,}\Z")


@dataclasses.dataclass(frozen=True)
class BoxRelease:
    """What a look at the box found of release ``id``: ``complete`` there, and ``current``: the
    deploy's ``current`` link already points at it."""

    id: str
    complete: bool
    current: bool


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What a push did. ``method`` is "existing" (the release was already complete on the box:
    nothing moved), "rsync" or "tar". ``transferred_files`` counts regular files whose content
    was sent (hard-linked ones are not); ``transferred_bytes`` is their total size."""

    id: str
    path: str
    transferred_files: int
    transferred_bytes: int
    method: str


# --- the files of a project --------------------------------------------------------------------


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


def _walk(root: str, rel: str, out: Dict[str, None]) -> None:
    """Every file and link under ``root/rel``, except VCS metadata, caches, venvs, rgt's state."""
    top = os.path.join(root, rel) if rel else root
    for here, dirs, files in os.walk(top):
        keep = []
        for d in dirs:
            if d in (".git", "__pycache__") or d.startswith(".venv") or d in STATE_DIRS:
                continue
            if os.path.islink(os.path.join(here, d)):
                files.append(d)  # a link to a directory is pushed as the link
            else:
                keep.append(d)
        dirs[:] = keep
        for f in files:
            out[os.path.relpath(os.path.join(here, f), root)] = None


def project_files(root: str) -> List[str]:
    """The files to push from ``root``, relative to it, sorted.

    In a git work tree: the tracked and the untracked-but-not-ignored files (a tracked file deleted
    from the tree is skipped). Elsewhere: every file under ``root`` except .git/, __pycache__/,
    .venv*/. Either way never rgt's own state (STATE_DIRS at any depth, and the state
    directories STATE_VARS name inside ``root``), tracked or not. Symbolic links stay links; one
    that leads outside ``root`` is refused (the box would not have what it points to). Sockets,
    FIFOs and devices are skipped.
    """
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise UsageError("project", f"{root!r} is not a directory")
    found: Dict[str, None] = {}
    if _git_root(root) is not None:
        try:
            p = subprocess.run(
                ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
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


# --- the box side: scripts run with their arguments as $1, $2, ... -----------------------------

# A shell function for a script that must change nothing (the audit's): `rgt_release_seen HOME ID
# NAME` prints "have 1" (release ID complete, deploys/NAME/current on it), "have 0" (complete, the
# link elsewhere or absent; NAME may be "") or "none" (not complete: push_release prepares it).
SEEN_SH = r"""
rgt_release_seen() {
  if [ ! -f "$1/releases/$2/.rgt-release" ]; then echo none; return 0; fi
  if [ -n "$3" ] && [ "$(readlink "$1/deploys/$3/current" 2>/dev/null)" = "../../releases/$2" ]
  then echo "have 1"; else echo "have 0"; fi
}
"""

# $1 box home, $2 id, $3 minutes after which a .tmp- release is stale, $4 deploy name (or "").
# Prints "have <1|0>" when the release is complete (1: the deploy's current link already points
# at it), else "new <tmp suffix> <rsync 0|1> <link-dest id>".
_PREPARE = r"""
set -eu
umask 077
rel="$1/releases"; id="$2"
mkdir -p "$rel"
have() {
  cur=0
  if [ -n "$4" ] && [ "$(readlink "$1/deploys/$4/current" 2>/dev/null)" = "../../releases/$id" ]
  then cur=1; fi
  echo "have $cur"; exit 0
}
if [ -f "$rel/$id/.rgt-release" ]; then have "$@"; fi
for t in "$rel"/.tmp-*; do
  [ -d "$t" ] || continue
  # A push in progress changes some inode in its directory at least every few seconds (ctime: rsync
  # and tar set mtimes back to the laptop's, never ctimes). If find cannot tell, keep it.
  if recent=$(find "$t" -cmin "-$3" -print 2>/dev/null); then
    [ -n "$recent" ] || rm -rf -- "$t"
  fi
done
if [ -e "$rel/$id" ] || [ -L "$rel/$id" ]; then
  # no marker: not made by a finished push (those rename a marked directory into place)
  [ -f "$rel/$id/.rgt-release" ] && have "$@"
  rm -rf -- "$rel/$id"
fi
tmp=$(mktemp -d "$rel/.tmp-$id-XXXXXXXX")
chmod 700 "$tmp"
has_rsync=0; command -v rsync >/dev/null 2>&1 && has_rsync=1
prev=""
if [ -n "$4" ] && [ -f "$1/deploys/$4/current/.rgt-release" ]; then
  prev=$(readlink "$1/deploys/$4/current"); prev=${prev##*/}
fi
if [ -z "$prev" ]; then
  newest=""
  for m in "$rel"/*/.rgt-release; do
    [ -f "$m" ] || continue
    if [ -z "$newest" ] || [ "$m" -nt "$newest" ]; then newest=$m; fi
  done
  prev=${newest%/.rgt-release}; prev=${prev##*/}
fi
echo "new ${tmp##*/.tmp-$id-} $has_rsync ${prev:--}"
"""

# $1 box home, $2 id, $3 tmp suffix, $4 marker content. Prints "done" or "raced" (another push
# of the same code finished first: its release stands, ours is removed).
_FINISH = r"""
set -eu
umask 077
rel="$1/releases"; tmp="$rel/.tmp-$2-$3"; dst="$rel/$2"
chmod 700 "$tmp"   # rsync -a gave it the mode of the project's directory
printf '%s\n' "$4" > "$tmp/.rgt-release"
if [ -f "$dst/.rgt-release" ]; then rm -rf -- "$tmp"; echo raced; exit 0; fi
if mv -T -- "$tmp" "$dst" 2>/dev/null; then echo done; exit 0; fi
if [ -f "$dst/.rgt-release" ]; then rm -rf -- "$tmp"; echo raced; exit 0; fi
if [ ! -e "$dst" ] && mv -- "$tmp" "$dst"; then echo done; exit 0; fi
echo "cannot rename $tmp to $dst" >&2; exit 1
"""

# $1: a push's temporary directory, removed when the push failed.
_ABANDON = r"""rm -rf -- "$1" """

# $1 box home, $2 name, $3 id: point deploys/<name>/current at releases/<id> by renaming a new
# link over the old one (rename(2) is atomic: readers see the old link or the new one).
_SWITCH = r"""
set -eu
umask 077
d="$1/deploys/$2"
[ -f "$1/releases/$3/.rgt-release" ] || { echo "no complete release $3 on the box" >&2; exit 3; }
mkdir -p "$d"
tmp="$d/.current-$$"
rm -f -- "$tmp"
ln -s "../../releases/$3" "$tmp"
if mv -T -- "$tmp" "$d/current" 2>/dev/null; then exit 0; fi
for py in python3 python; do   # an mv without -T (busybox) would move the link into the old target
  if command -v "$py" >/dev/null 2>&1 &&
     "$py" -c 'import os, sys; os.replace(sys.argv[1], sys.argv[2])' "$tmp" "$d/current"; then
    exit 0
  fi
done
rm -f -- "$tmp"
echo "no way to replace a link atomically here (no mv -T, no python)" >&2; exit 4
"""


# What the last push_release over a connection saw: ``deploys/<name>/current`` already
# pointing at the release it found complete. The next switch_current to that very release over
# the same connection is then a no-op, and skips its round trip (a second deploy of unchanged
# code otherwise pays one to re-make the same link); any other switch_current forgets it.
_current_seen: weakref.WeakKeyDictionary[Remote, Tuple[str, str, str]] = weakref.WeakKeyDictionary()


def _check_home(box_home: str) -> None:
    if not posixpath.isabs(box_home) or "\0" in box_home:
        raise UsageError(jobenv.HOME, f"{box_home!r} is not an absolute path on the box")


def parse_seen(rid: str, lines: Sequence[str]) -> Optional[BoxRelease]:
    """What ``rgt_release_seen`` printed about release ``rid``; None when that is not understood
    (push_release then looks itself)."""
    words = " ".join(lines).split()
    if words == ["none"]:
        return BoxRelease(rid, False, False)
    if len(words) == 2 and words[0] == "have" and words[1] in ("0", "1"):
        return BoxRelease(rid, True, words[1] == "1")
    return None


def _fail(remote: Remote, what: str, rc: int, stderr: bytes) -> HostError:
    text = stderr.decode("utf-8", "replace").strip()
    return HostError(f"{remote.target.label}: {what} failed (exit {rc}): {text[-2000:]}")


# --- pushing -----------------------------------------------------------------------------------


def push_release(
    remote: Remote,
    root: str,
    box_home: str,
    *,
    name: Optional[str] = None,
    method: str = "auto",
    files: Optional[Sequence[str]] = None,
    stale_after_min: int = STALE_AFTER_MIN,
    rsync_options: Sequence[str] = (),
    seen: Optional[BoxRelease] = None,
) -> PushResult:
    """Put the project at ``root`` on the box as ``box_home/releases/<id>``; a no-op when that
    release is already complete there.

    ``method``: "auto" (rsync when both ends have it, else tar), "rsync" or "tar". ``name``: the
    deploy whose current release rsync hard-links unchanged files from (else the newest release).
    ``rsync_options`` are added to rsync's command line (e.g. ``--bwlimit=KBPS``). ``seen``: what
    a look at the box (the audit's, ``SEEN_SH``) found of the release of these very ``files``,
    which must then be given: its id is theirs, and they are not hashed again. A release it found
    complete is the result at once, with no command run.
    """
    _check_home(box_home)
    if method not in ("auto", "rsync", "tar"):
        raise UsageError("method", f"{method!r} is not auto, rsync or tar")
    if name is not None:
        check_name(name)
    root = os.path.abspath(root)
    if seen is not None and (files is None or not _ID.match(seen.id)):
        raise UsageError("release", "a release seen on the box needs its files and a valid id")
    files = list(project_files(root) if files is None else files)
    rid = seen.id if seen is not None else release_id(root, files)
    final = posixpath.join(box_home, "releases", rid)
    if seen is not None and seen.complete:
        if name is not None and seen.current:
            _current_seen[remote] = (box_home, name, rid)
        return PushResult(rid, final, 0, 0, "existing")
    r = remote.sh(_PREPARE, box_home, rid, str(int(stale_after_min)), name or "", timeout=300)
    words = r.text.split()
    if r.rc != 0 or not words:
        raise _fail(remote, "preparing the release directory", r.rc, r.stderr)
    if words[0] == "have":
        if name is not None and words[1:] == ["1"]:
            _current_seen[remote] = (box_home, name, rid)
        return PushResult(rid, final, 0, 0, "existing")
    if len(words) != 4 or words[0] != "new" or not _SUFFIX.match(words[1]):
        raise HostError(f"{remote.target.label}: unexpected answer {r.text!r} preparing a release")
    suffix, box_rsync, prev = words[1], words[2] == "1", words[3]
    tmp = posixpath.join(box_home, "releases", f".tmp-{rid}-{suffix}")
    use_rsync = method == "rsync" or (
        method == "auto" and box_rsync and shutil.which("rsync") is not None
    )
    ok = False
    try:
        if use_rsync:
            link_dest = posixpath.join(box_home, "releases", prev) if _ID.match(prev) else None
            n, size = _rsync(remote, root, files, tmp, link_dest, rsync_options)
        else:
            n, size = _tar(remote, root, files, tmp)
        if release_id(root, files) != rid:
            raise UsageError(
                "project",
                "files changed while they were being pushed",
                "deploy again once they stop changing",
            )
        marker = json.dumps({"id": rid, "files": len(files), "pushed": time.time()})
        f = remote.sh(_FINISH, box_home, rid, suffix, marker, timeout=300)
        if f.rc != 0:
            raise _fail(remote, "completing the release", f.rc, f.stderr)
        ok = True
    finally:
        if not ok:
            _abandon(remote, tmp)
    return PushResult(rid, final, n, size, "rsync" if use_rsync else "tar")


def _abandon(remote: Remote, tmp: str) -> None:
    """Remove a push's temporary directory if the box still answers; a later push removes it
    otherwise (it goes stale)."""
    try:
        remote.sh(_ABANDON, tmp, timeout=60)
    except RemoteUnreachable:
        pass


def _rsync(
    remote: Remote,
    root: str,
    files: Sequence[str],
    tmp: str,
    link_dest: Optional[str],
    extra: Sequence[str],
) -> Tuple[int, int]:
    # -a without owner and group: files belong to the box's user, as with tar.
    argv = [
        "rsync", "-a", "--no-owner", "--no-group", "--protect-args", "--files-from=-", "--from0",
        "--stats", "--timeout=300", *extra,
    ]  # fmt: skip
    if link_dest:
        # Copies on the box, not hard links (--link-dest): a job that rewrites a file of its
        # release in place (open(path, "w") truncates the inode) must not change another
        # release, which a running job may be using. The network carries the same either way.
        argv.append(f"--copy-dest={link_dest}")
    shell = remote.rsync_shell()
    if shell is not None:
        argv += ["-e", rsync_e(shell)]
    argv += ["./", remote.path_arg(tmp) + "/"]
    listing = b"".join(os.fsencode(f) + b"\0" for f in files)
    env = dict(os.environ, LC_ALL="C")
    try:
        p = subprocess.run(argv, cwd=root, input=listing, capture_output=True, env=env)
    except FileNotFoundError:
        raise HostError("rsync is not installed on this machine", "install rsync") from None
    if p.returncode < 0:
        raise RemoteUnreachable(
            f"the push to {remote.target.label} was cut off (rsync killed by signal "
            f"{-p.returncode})",
            "deploy again: the box keeps its previous release",
        )
    remote.check_transport(p.returncode, p.stderr)
    if p.returncode in (10, 12, 30, 35):  # socket I/O, protocol stream, timeouts: the link
        lines = p.stderr.decode("utf-8", "replace").strip().splitlines() or [""]
        raise RemoteUnreachable(
            f"the push to {remote.target.label} was cut off (rsync exit {p.returncode}: "
            f"{lines[-1][-200:]})",
            "deploy again: the box keeps its previous release",
        )
    if p.returncode != 0:
        raise _fail(remote, "rsync", p.returncode, p.stderr)
    out = p.stdout.decode("utf-8", "replace")
    return _stat(out, "Number of regular files transferred"), _stat(
        out, "Total transferred file size"
    )


def _stat(out: str, label: str) -> int:
    m = re.search(rf"^{re.escape(label)}: ([0-9,.]+)", out, re.M)
    if m is None:
        raise HostError(f"rsync printed no {label!r} in its --stats: {out[-1000:]!r}")
    return int(re.sub(r"[,.]", "", m.group(1)))


def _tar(remote: Remote, root: str, files: Sequence[str], tmp: str) -> Tuple[int, int]:
    """Stream the files as a tar archive into ``tar -x`` on the box."""
    proc = subprocess.Popen(
        remote.argv(["tar", "-x", "-f", "-", "-C", tmp]),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stderr is not None
    n = size = 0
    broken = False
    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.GNU_FORMAT) as tf:
            for rel in files:
                path = os.path.join(root, rel)
                info = tf.gettarinfo(path, arcname=rel)
                # Owned by whoever unpacks it: a root tar on the box would otherwise take the
                # laptop's uid.
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if info.isreg():
                    with open(path, "rb") as f:
                        tf.addfile(info, f)
                    n += 1
                    size += info.size
                else:
                    tf.addfile(info)
    except BrokenPipeError:
        broken = True  # the box's side ended first: its status says why
    finally:
        # Whatever happened here, end the stream and reap the client (an early end of the stream
        # makes tar on the box fail, so nothing half-written is ever marked complete).
        try:
            proc.stdin.close()
        except BrokenPipeError:
            broken = True
        err = proc.stderr.read()
        proc.stderr.close()
        rc = proc.wait()
    if rc < 0:
        raise RemoteUnreachable(
            f"the push to {remote.target.label} was cut off (killed by signal {-rc})",
            "deploy again: the box keeps its previous release",
        )
    remote.check_transport(rc, err)
    if rc != 0 or broken:
        raise _fail(remote, "unpacking the release with tar", rc, err)
    return n, size


def switch_current(remote: Remote, box_home: str, name: str, rid: str) -> None:
    """Point ``deploys/<name>/current`` at the complete release ``rid``, atomically."""
    _check_home(box_home)
    check_name(name)
    if not _ID.match(rid):
        raise UsageError("release", f"{rid!r} is not a release id (16 hex digits)")
    if _current_seen.pop(remote, None) == (box_home, name, rid):
        return  # push_release has just seen the link there: the switch would change nothing
    r = remote.sh(_SWITCH, box_home, name, rid, timeout=120)
    if r.rc != 0:
        raise _fail(remote, f"switching {name} to release {rid}", r.rc, r.stderr)


def current_release(remote: Remote, box_home: str, name: str) -> Optional[str]:
    """The release id ``deploys/<name>/current`` points at, or None."""
    _check_home(box_home)
    check_name(name)
    r = remote.run(["readlink", posixpath.join(box_home, "deploys", name, "current")], timeout=60)
    rid = posixpath.basename(r.text.strip()) if r.rc == 0 else ""
    return rid if _ID.match(rid) else None
