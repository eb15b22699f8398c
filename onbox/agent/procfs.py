"""Process identity and discovery from /proc. Standard library only (the shim imports it).

A pid alone names nothing: pids are reused. A process is identified by (pid, start time in
clock ticks since boot), field 22 of /proc/PID/stat, which the kernel never changes. A zombie
counts as dead: PID 1 on some boxes reaps orphans seconds late, and a zombie holds no memory.
"""

from __future__ import annotations

import os
import select

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Dict, Iterable, Iterator, List, Optional


class ProcStat:
    """The fields of /proc/PID/stat that rgt uses."""

    __slots__ = ("pid", "state", "ppid", "pgid", "sid", "start_ticks")

    def __init__(
        self, pid: int, state: str, ppid: int, pgid: int, sid: int, start_ticks: int
    ) -> None:
        self.pid, self.state, self.ppid = pid, state, ppid
        self.pgid, self.sid, self.start_ticks = pgid, sid, start_ticks


class Identity:
    """A process named so that pid reuse cannot fool us: its pid and its start time."""

    __slots__ = ("pid", "start_ticks")

    def __init__(self, pid: int, start_ticks: int) -> None:
        self.pid = pid
        self.start_ticks = start_ticks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and (self.pid, self.start_ticks) == (
            other.pid,
            other.start_ticks,
        )

    def __hash__(self) -> int:
        return hash((self.pid, self.start_ticks))

    def __repr__(self) -> str:
        return f"Identity(pid={self.pid}, start_ticks={self.start_ticks})"


def read_stat(pid: int) -> Optional[ProcStat]:
    """/proc/PID/stat parsed, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    return ProcStat(
        pid=pid,
        state=rest[0],
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        start_ticks=int(rest[19]),
    )


def identity(pid: int) -> Optional[Identity]:
    """The identity of a live process, or None."""
    st = read_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return Identity(pid, st.start_ticks)


def child_identity(pid: int) -> Optional[Identity]:
    """The identity of the caller's own child ``pid``, ended or not: an ended child stays a
    zombie, its pid not reusable, until the caller reaps it, so its start time still names
    it. (``identity`` answers None for a zombie: a child that ended at once would otherwise
    be watched as nothing at all.)"""
    st = read_stat(pid)
    return None if st is None else Identity(pid, st.start_ticks)


def is_alive(ident: Optional[Identity]) -> bool:
    """True when that very process (same start time) exists and is not a zombie."""
    if ident is None:
        return False
    st = read_stat(ident.pid)
    return st is not None and st.start_ticks == ident.start_ticks and st.state not in ("Z", "X")


def environ(pid: int) -> Optional[Dict[bytes, bytes]]:
    """The initial environment of a process, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out: Dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key] = value
    return out


def pids() -> Iterator[int]:
    """Every pid in /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def find_tagged(var: str, value: str) -> List[Identity]:
    """Live processes whose environment has ``var=value``."""
    return find_attempt(var, value)


def find_attempt(
    var: str,
    value: str,
    leader: Optional[Identity] = None,
    roots: Iterable[Optional[Identity]] = (),
) -> List[Identity]:
    """Every live process of one attempt, found four ways, so that none hides:

    the tag in its environment (kept by children that call setsid and leave the group),
    the session and process group of ``leader`` (the job, a session leader), and descent from
    ``leader`` or from one of ``roots`` (the shim, a child subreaper that adopts orphans;
    descent also finds a process that called setproctitle, which blanks /proc/PID/environ).
    The roots themselves are not included.

    The session and group are matched by the leader's pid, which is reused once the leader
    and every member are gone: see ``_own_group``.
    """
    want_key, want_value = var.encode(), value.encode()
    me = os.getpid()
    stats = {}
    for pid in pids():
        st = read_stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            stats[pid] = st
    anchors = {r.pid for r in (leader, *roots) if r is not None and is_alive(r)}
    group = _own_group(leader)
    excluded = {me} | {r.pid for r in roots if r is not None}
    found = []
    for pid, st in stats.items():
        if pid in excluded:
            continue
        hit = group is not None and (st.sid == group or st.pgid == group)
        if not hit and anchors:
            hops, cur = 0, st.ppid
            while cur > 1 and hops < 64 and not hit:
                hit = cur in anchors
                parent = stats.get(cur)
                cur, hops = (parent.ppid if parent else 0), hops + 1
        if not hit:
            env = environ(pid)
            hit = env is not None and env.get(want_key) == want_value
        if hit:
            found.append(Identity(pid, st.start_ticks))
    return found


def _own_group(leader: Optional[Identity]) -> Optional[int]:
    """The session and group id of ``leader``'s attempt, or None when that id may be another's.

    Called after every stat of the scan is read. While the group or session has a member, its
    id cannot be given to a new process, so a process whose sid/pgid is the leader's pid is
    ours while that pid is free or still the leader's (a zombie too). A live process holding
    the pid with another start time means the id was freed and reused: a session or group of
    that id is then the new process's, however alike it looks, and is never matched.
    """
    if leader is None:
        return None
    st = read_stat(leader.pid)
    if st is not None and st.start_ticks != leader.start_ticks:
        return None
    return leader.pid


def boot_id() -> str:
    """Changes at every boot: a pid record from an earlier boot names nothing."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def open_pidfd(ident: Identity) -> Optional[int]:
    """A pollable fd that becomes readable when the process exits, or None.

    None when pidfds are not supported (Linux < 5.3) or the process is already gone; the
    caller then polls. The identity is checked after opening, so a reused pid is never watched.
    """
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd = int(opener(ident.pid))
    except OSError:
        return None
    if not is_alive(ident):
        os.close(fd)
        return None
    return fd


def wait_readable(fds: List[int], timeout: Optional[float]) -> List[int]:
    """The subset of ``fds`` readable within ``timeout`` seconds."""
    if not fds:
        return []
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    try:
        return [fd for fd, _ in poller.poll(ms)]
    except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
        return []
