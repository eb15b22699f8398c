"""Pushing the project's code to the box as an immutable release, and switching a run to it.

Box layout (under RGT_HOME on the box)::

    releases/<id>/                 one release: the pushed files and, written last, .rgt-release
    releases/.tmp-<id>-<random>/   a push in progress (or one cut off: removed by a later push)
    deploys/<name>/current -> ../../releases/<id>
    deploys/<name>/pending -> ../../releases/<id>   the release a deploy of <name> is starting
                                   in, held from its push on (controller/shell/release_use.sh)
    deploys/.lock                  flock'd while a release is held, or checked and removed

Every directory rgt makes there is 0700 (the scripts run under umask 077, and a release's own
directory is set to 0700 whatever mode rsync copied from the project's): on a shared box no
other user reads the code or what the job writes next to it.

``<id>`` is a content hash of the pushed files (controller/deploy/project.py: which files, and
their path, executable bit, content or link target), so the same code always lands in the same
directory and a second deploy of unchanged code finds its release complete and moves nothing.
A release is uploaded into a temporary directory (with rsync
when both ends have it, copying unchanged files on the box from the previous release with
``--copy-dest``; else as a tar stream over ssh), marked complete, then renamed into place; the
``current`` link is replaced by renaming a new link over it. A push cut off anywhere therefore
leaves ``current`` on the old release or the new one, and never a half release under
``releases/<id>``. Once the run's spec has moved to the new release too (its start), the switch
drops the release the link named before where nothing else names it and the job wrote nothing
in it (controller/shell/release_switch.sh).

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
import json
import os
import posixpath
import re
import shutil
import subprocess
import tarfile
import threading
import time
import weakref
from typing import Optional, Sequence, Tuple

from controller import shell
from controller.capture import ERR_HEAD, ERR_TAIL, Kept, capture, drain
from controller.children import Child
from controller.deploy.project import project_files, release_id
from controller.remote import Remote, rsync_e
from onbox.common import jobenv
from onbox.common.errors import HostError, RemoteUnreachable, UsageError
from onbox.common.rundir import check_name

MARKER = ".rgt-release"  # written last into a complete release
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


# --- the box side: scripts run with their arguments as $1, $2, ... -----------------------------

# The box's side, as scripts of their own (their arguments are described in each file).
# SEEN_SH defines rgt_release_seen, for a script that must change nothing (the audit's).
SEEN_SH = shell.script("release_seen.sh")
# clear stale pushes, hold the release for the deploy, make the temporary directory
_PREPARE = shell.script("release_use.sh") + shell.script("release_prepare.sh")
_FINISH = shell.script("release_finish.sh")  # mark the release complete, rename it into place
_ABANDON = r"""rm -rf -- "$1" """  # $1: a push's temporary directory, removed when it failed
# Point deploys/<name>/current at a release, and drop the one it named before where nothing
# names that any longer.
_SWITCH = shell.script("release_use.sh") + shell.script("release_switch.sh")


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
    final = release_path(box_home, rid)
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
    tmp = release_path(box_home, f".tmp-{rid}-{suffix}")
    use_rsync = method == "rsync" or (
        method == "auto" and box_rsync and shutil.which("rsync") is not None
    )
    ok = False
    try:
        if use_rsync:
            link_dest = release_path(box_home, prev) if _ID.match(prev) else None
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
    try:  # its --stats (and the box's rsync's messages): a bounded tail of them is all kept
        p = capture(
            argv, timeout=None, limit=1 << 20, over="tail", input=listing, cwd=root, env=env
        )
    except FileNotFoundError:
        raise HostError("rsync is not installed on this machine", "install rsync") from None
    if p.rc < 0:
        raise RemoteUnreachable(
            f"the push to {remote.target.label} was cut off (rsync killed by signal {-p.rc})",
            "deploy again: the box keeps its previous release",
        )
    remote.check_transport(p.rc, p.stderr)
    if p.rc in (10, 12, 30, 35):  # socket I/O, protocol stream, timeouts: the link
        lines = p.stderr.decode("utf-8", "replace").strip().splitlines() or [""]
        raise RemoteUnreachable(
            f"the push to {remote.target.label} was cut off (rsync exit {p.rc}: "
            f"{lines[-1][-200:]})",
            "deploy again: the box keeps its previous release",
        )
    if p.rc != 0:
        raise _fail(remote, "rsync", p.rc, p.stderr)
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
    proc = Child(
        remote.argv(["tar", "-x", "-f", "-", "-C", tmp]),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stderr is not None
    # Drained as the stream goes (a box talking on stderr must not block the stream), and
    # bounded: the box's words, a head and a tail of them.
    errors = Kept(ERR_HEAD, ERR_TAIL)
    drainer = threading.Thread(target=drain, args=(proc.stderr, errors), daemon=True)
    drainer.start()
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
    except BaseException:  # (a Ctrl-C: the ssh is out of the terminal's reach, children.py)
        proc.kill()  # by its PID: the stream is cut off, whatever ssh would make of its end
        raise
    finally:
        # Whatever happened here, end the stream and reap the client (an early end of the stream
        # makes tar on the box fail, so nothing half-written is ever marked complete).
        try:
            proc.stdin.close()
        except BrokenPipeError:
            broken = True
        rc = proc.wait()
        drainer.join()
        proc.stderr.close()
        err = errors.value()
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


def release_path(box_home: str, rid: str) -> str:
    """``box_home/releases/<id>``: where a release lives on the box (this module owns the
    layout of releases/ and deploys/)."""
    return posixpath.join(box_home, "releases", rid)


def deploy_path(box_home: str, name: str) -> str:
    """``box_home/deploys/<name>``: the run's deploy, whose ``current`` names its release."""
    return posixpath.join(box_home, "deploys", name)


def current_release(remote: Remote, box_home: str, name: str) -> Optional[str]:
    """The release id ``deploys/<name>/current`` points at, or None."""
    _check_home(box_home)
    check_name(name)
    current = posixpath.join(deploy_path(box_home, name), "current")
    r = remote.run(["readlink", current], timeout=60)
    rid = posixpath.basename(r.text.strip()) if r.rc == 0 else ""
    return rid if _ID.match(rid) else None
