"""The preflight of a ``file://`` store: before training starts, prove that the root is the one
the user meant and that its filesystem writes, fsyncs and renames atomically. Its own module, as
an S3 store's and a Hub store's are: it runs once per start, and imports nothing from local.py.

The root is made only where making it is plainly what the user asked for: the nearest directory
above it that exists is on a filesystem other than the box's ``/`` (a mount of its own). A root
that would be made on the box's own disk is refused instead (NotFound, exit 8):
``file:///mnt/durabel/rgt``, a typo of the mount, would otherwise be made there, every seal would
succeed onto the disk that dies with the box, and only a warning would hint at it. rgt's own
default on the `local` target is made by the agent (onbox/agent/claim.py).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, List

from onbox.common.durable import make_dirs
from onbox.common.errors import NotFound
from onbox.common.safepath import open_dir
from onbox.sealing.stores.base import Finding, check_key, os_error

if TYPE_CHECKING:
    from onbox.sealing.stores.local import LocalStore


def fs_type(root: str) -> str:
    """The filesystem type of the mount ``root`` is on, from /proc/self/mountinfo."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                if (root + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                    best, kind = mount, right.split()[0]
    except (OSError, IndexError):
        pass
    return kind


def check_root(root: str) -> None:
    """Refuse a missing ``root`` unless the nearest directory above it that exists is on another
    filesystem than ``/``: what would be made is then on a mount of its own."""
    if os.path.lexists(root):
        return  # a directory, or what the preflight's walk refuses with its own error
    above = os.path.dirname(root)
    try:
        while not os.path.lexists(above):
            above = os.path.dirname(above)
        if os.stat(above).st_dev != os.stat("/").st_dev:
            return
        why = f"it would be made on the box's root filesystem (under {above}, not a mount)"
    except OSError as e:
        why = f"{above} cannot be looked at ({e.strerror or e})"
    raise NotFound(
        f"the store root {root} does not exist on this box, and {why}: rgt does not make it "
        "there, because a mistyped durable path would put every checkpoint on the box's own "
        "disk, lost with the box",
        f"if {root} is the right path, create it with mkdir -p {root} and start again; else fix "
        "the path in --store",
    )


def preflight(store: LocalStore, run: str) -> List[Finding]:
    """Prove ``store`` works for ``run`` (Store.preflight); a StoreError names the failed step."""
    found: List[Finding] = []
    kind = fs_type(store.root)
    check_root(store.root)
    step = "create the run directory"
    d = os.path.join(store.root, run, ".rgt-preflight")
    dfd = -1
    try:
        make_dirs(store.root, 0o777)  # missing here only under a mount of its own (check_root)
        dfd = open_dir(store.root, [check_key(run), ".rgt-preflight"], create=True)
        step = "write and fsync a probe file"
        payload = os.urandom(4096)
        for p in ("a", "b"):
            fd = os.open(
                p,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dfd,
            )
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
        step = "rename a file over another (atomic replace)"
        os.replace("a", "b", src_dir_fd=dfd, dst_dir_fd=dfd)
        if os.path.lexists(os.path.join(d, "a")):
            raise OSError(errno.EIO, "the source of the rename still exists")
        step = "fsync the directory"
        os.fsync(dfd)
        step = "read the probe back and compare"
        fd = os.open("b", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with open(fd, "rb") as f:
            if f.read() != payload:
                raise OSError(errno.EIO, "read back different bytes")
        step = "delete the probe"
        os.unlink("b", dir_fd=dfd)
        os.rmdir(d)
    except OSError as e:
        raise os_error(e, f"store preflight failed at '{step}' in {store.root}") from None
    finally:
        if dfd >= 0:
            os.close(dfd)
    found.append(Finding(True, f"{store.url} ({kind}): writes, fsyncs, renames atomically"))
    if kind.startswith("fuse"):
        found.append(
            Finding(
                False,
                f"{store.url} is a FUSE mount ({kind}): renames and fsync "
                "may not be atomic or durable there; prefer s3:// directly",
            )
        )
    return found
