"""The laptop's ssh control sockets (controller/remote.py's multiplexing): their directory,
rgt's own, mode 0700, checked before each use (``control_dir``), and each socket's name
(``control_path``). Whoever can write there could put a socket of their own in ssh's way and see
every command and byte of the connection.

A socket is named for everything that decides who its connection logs in as and which way it
goes, so a command rides only a master its own target made: ssh's own ``%C`` hashes the local
host, host, port and user alone, and a target with another key (or none), another jump host or
another configuration then ran over a master opened with a different identity. It "worked", and
failed on its own ("Permission denied", exit 4) once that master was gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import threading
import time
import weakref
from typing import Dict, Optional, Sequence

from controller import envnames
from onbox.common.errors import UsageError

# A unix socket path must fit in 104 bytes with its NUL (macOS; Linux: 108). The socket's name
# (control_path) adds 41 ("/" and SOCKET_NAME hex digits), and a master first binds PATH plus a
# random 17-byte suffix, then renames it: 104 - 1 - 41 - 17.
SOCKET_NAME = 40
CONTROL_DIR_MAX = 45

# What ``ssh -G`` resolves that decides who a connection authenticates as and which way it goes
# (an alias's IdentityFile or ProxyCommand, say): a configuration changed between two commands
# gives the second its own connection.
IDENTITY_SETTINGS = frozenset(
    {
        "hostname", "port", "user", "identityfile", "identitiesonly", "certificatefile",
        "identityagent", "pkcs11provider", "securitykeyprovider", "proxyjump", "proxycommand",
        "hostkeyalias", "bindaddress", "bindinterface", "addressfamily",
        "pubkeyauthentication", "pubkeyacceptedalgorithms", "pubkeyacceptedkeytypes",
        "hostbasedauthentication", "gssapiauthentication", "kbdinteractiveauthentication",
        "passwordauthentication", "preferredauthentications",
    }
)  # fmt: skip


def control_path(directory: str, ssh_args: Sequence[str], settings: Optional[str]) -> str:
    """The control socket in ``directory`` for the connection ssh makes with ``ssh_args`` (the
    configuration file, the target's options as the user gave them and its host: -F, -p, -i, -l,
    -J), ``settings`` (``ssh -G``'s text for them, or None) and this environment's ssh agent.

    Two connections that could log in as someone else, or go another way, get two sockets; the
    same target gets the same one, so its commands share one connection. The name is hex (no
    ``%`` token for ssh to expand) and SOCKET_NAME long, whatever the target (CONTROL_DIR_MAX)."""
    resolved = sorted(
        line
        for line in (settings or "").splitlines()
        if line.split(" ", 1)[0].lower() in IDENTITY_SETTINGS
    )
    # Without -i the agent's keys are offered: another agent may hold other keys.
    agent = os.environ.get("SSH_AUTH_SOCK")
    key = json.dumps([list(ssh_args), resolved, agent], separators=(",", ":"))
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:SOCKET_NAME])


def control_dir(home: str) -> str:
    """The directory of this laptop's ssh control sockets: ``HOME/cm``, or, where that path is
    too long for a socket, a private directory under /tmp whose name is recorded in
    ``HOME/cm-dir``. Either is created 0700 by rgt and checked before each use.

    Under /tmp a fixed name (``/tmp/rgt-cm-UID``) would let any user of the machine create it
    first, readable or writable by them, or as a symlink to a directory of theirs: they could
    then hijack the connections, or block rgt. So the directory there is mkdtemp's (a random
    name nobody else can have made), and a recorded one that no longer checks (gone at a reboot,
    or replaced) is not used: a fresh one is made and recorded. ``HOME/cm`` is the user's own
    directory, inside rgt's 0700 home: one that fails the check was changed by hand, and is
    refused with a message rather than repaired, since a socket someone else placed in it
    could already be there."""
    d = os.path.join(home, "cm")
    if len(d) <= CONTROL_DIR_MAX:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        why = _unsafe_dir(d)
        if why:
            raise UsageError(
                envnames.CONTROLLER_HOME,
                f"the ssh control directory {d} {why}, so another user could take over rgt's "
                "ssh connections",
                f"remove {d} (rgt makes it again, private), or set RGT_CONTROLLER_HOME",
            )
        return d
    record = os.path.join(home, "cm-dir")
    try:
        with open(record) as f:
            d = f.read().strip()
        if d.startswith("/tmp/rgt-cm-") and len(d) <= CONTROL_DIR_MAX and not _unsafe_dir(d):
            return d
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    # 0700 and ours alone; /tmp's sticky bit keeps anyone else from renaming or removing it.
    d = tempfile.mkdtemp(prefix=f"rgt-cm-{os.getuid()}-", dir="/tmp")
    # Named for the thread too: a sweep opens its boxes' connections in threads of one process.
    tmp = f"{record}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(d + "\n")
    os.replace(tmp, record)  # two rgt at once: each uses its own; the last one is kept
    return d


# The remotes of this process using each control directory: one rgt may hold several at once
# (a sweep deploys to several boxes side by side), and a directory under /tmp removed by one as
# it closes made the next master of another fail ("cannot bind to path"). Weak: a remote that
# was never closed counts until it is collected.
_users: Dict[str, weakref.WeakSet[object]] = {}
_users_lock = threading.Lock()


def use_dir(d: str, user: object) -> None:
    """``user`` (a remote) uses the control directory ``d`` until ``let_go_dir``."""
    with _users_lock:
        _users.setdefault(d, weakref.WeakSet()).add(user)


def let_go_dir(home: str, d: str, user: object) -> None:
    """``user`` is done with ``d``. A directory of ours under /tmp (``control_dir``) is removed
    once no remote of this process uses it and it is empty (a master removes its socket as it
    exits): none is left behind; one still in use by another rgt stays, and a later rgt whose
    recorded directory is gone makes another."""
    with _users_lock:
        users = _users.get(d)
        if users is not None:
            users.discard(user)
        if d.startswith(home + os.sep) or users:
            return
        for _ in range(10):
            try:
                os.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


def _unsafe_dir(d: str) -> Optional[str]:
    """Why ``d`` is not a directory only this user can use (lstat: a symlink is not followed),
    or None."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symlink (to {os.readlink(d)})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (rgt needs 0700)"
    return None
