"""The agent's wheel (controller/deploy/wheel.py) kept between deploys in the controller's home,
so that a deploy does not compress rgt's own package again: the deflate is most of what building
the wheel costs, and every deploy needs the wheel's sha256 (it names the agent's install).

Kept by content, not by timestamps: the key is a sha256 over rgt's version, the Python and zlib
that compress it (the wheel's bytes are theirs), the builder's own source (wheel.py: the metadata
and requirements it writes) and every file that goes into the wheel, its path and its bytes.
Reading and hashing those (about 1.3 MB) takes a few milliseconds. A change of any byte that
goes in gives another key, whatever a file's size or times say, and the wheel is built again,
from the very bytes that were hashed for the key; so no entry ever stands for other code.

One entry (the last wheel built) in ``agent-wheel``: a JSON line (the key, the wheel's sha256
and size), then the wheel. It is used only when it is a regular file of this user's, readable by
nobody else, whose key matches and whose bytes match their sha256; else (missing, foreign,
damaged, torn) the wheel is built and the entry replaced atomically (mode 0600). A home that
cannot be written to only means that the next deploy builds it again.

Built once for deploys at once (``_one_build``): a sweep deploys to its boxes from as many
threads, and two rgt commands may deploy side by side; on a cold cache each built the same
wheel, a second or more of CPU apiece. The look at the entry, the build and the write are held
under a lock of the process's per entry and an flock of ``agent-wheel.lock`` beside it, so the
deploys after the first wait for its wheel and take the kept one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import sys
import threading
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from controller.deploy import wheel as wheelmod
from controller.deploy.wheel import AgentWheel
from onbox.common import jsondoc
from onbox.common.durable import write_atomic

FILE = "agent-wheel"
MAX_BYTES = 64 << 20  # far more than rgt's wheel (about 0.5 MB): a larger file is not ours
MAX_HEADER = 4096


def content_key(ver: str, contents: List[Tuple[str, bytes]]) -> str:
    """The sha256 naming the wheel built from ``contents`` as rgt ``ver`` (module docstring)."""
    h = hashlib.sha256(b"rgt-agent-wheel-1\0")
    with open(wheelmod.__file__, "rb") as f:
        builder = f.read()
    head = [ver, sys.version, zlib.ZLIB_RUNTIME_VERSION, hashlib.sha256(builder).hexdigest()]
    for part in head:
        h.update(part.encode() + b"\0")
    for rel, data in contents:
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _read(path: str, key: str) -> Optional[bytes]:
    """The kept wheel's bytes, where the entry at ``path`` is sound and is for ``key``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o077
            or st.st_size > MAX_BYTES
        ):
            return None
        try:
            doc = jsondoc.loads(f.readline(MAX_HEADER))
            data = f.read(MAX_BYTES)
        except (OSError, ValueError):
            return None
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    if doc.get("size") != len(data) or doc.get("sha256") != hashlib.sha256(data).hexdigest():
        return None  # torn or damaged: built again
    return data


Build = Callable[[str, List[Tuple[str, bytes]]], bytes]

_locks_lock = threading.Lock()
_locks: Dict[str, threading.Lock] = {}  # per entry path: one build at a time in the process


@contextlib.contextmanager
def _one_build(home: str, path: str) -> Iterator[None]:
    """Held around the look at the entry at ``path``, its build and its write (module
    docstring): this process's lock for it, then an flock on ``path``.lock (other processes),
    blocking as the registry's does (its holder builds for a second or so). A lock file that
    cannot be made or locked (a home not writable: no entry can be kept either) only lets the
    builds run side by side, as before."""
    with _locks_lock:
        mine = _locks.setdefault(path, threading.Lock())
    with mine:
        fd = -1
        try:
            os.makedirs(home, mode=0o700, exist_ok=True)
            fd = os.open(
                path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        try:
            yield
        finally:
            if fd >= 0:
                os.close(fd)  # (the flock goes with it)


def kept_agent_wheel(home: str, build: Build = wheelmod.wheel_bytes) -> AgentWheel:
    """This controller's wheel (``wheel.agent_wheel``'s bytes exactly): the one kept in ``home``
    when it was built from the same content, else built now (``build``) and kept."""
    ver = wheelmod.version()
    contents = wheelmod.package_contents()
    key = content_key(ver, contents)
    path = os.path.join(home, FILE)
    with _one_build(home, path):
        data = _read(path, key)
        if data is not None:
            return AgentWheel(ver, data, hashlib.sha256(data).hexdigest())
        data = build(ver, contents)
        sha = hashlib.sha256(data).hexdigest()
        header = json.dumps({"key": key, "sha256": sha, "size": len(data)}, sort_keys=True)
        try:
            os.makedirs(home, mode=0o700, exist_ok=True)
            write_atomic(path, header.encode() + b"\n" + data, mode=0o600)
        except OSError:
            pass  # kept next time, perhaps; this deploy has its wheel
        return AgentWheel(ver, data, sha)
