"""The memory probe: the job's cgroup limit and usage (v1 and v2), swap, the OOM-kill counter,
and the attempt's biggest processes, so that a warning says who holds the memory and an OOM
kill names its likely cause.

The cgroup is the job's (/proc/JOB/cgroup, else the agent's own). The limit that binds is the
innermost one set on the path from that cgroup up to the mount root (containers often show only
their own cgroup at the mount root, so missing directories are skipped). Usage is the working
set: usage minus inactive file cache, which the kernel reclaims before it kills (what kubelet
and docker stats count). Without a readable limit the host's memory is the limit, said so.

The attempt's processes are those whose RGT_ATTEMPT_TAG is the current attempt's. Reading
every process's environment is the costly part, so the set is cached: a full scan when the tag
changes or every RESCAN_TICKS ticks, and in between the children of the known processes.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import psutil

from onbox.common.size import human
from onbox.health.config import MemoryConfig
from onbox.health.verdict import Context, Reading, Verdict, ok, unknown

ROOT = "/sys/fs/cgroup"
TAG_VAR = "RGT_ATTEMPT_TAG"
RESCAN_TICKS = 6  # full environment scans: on a new tag, and every this many ticks
NO_LIMIT = 1 << 60  # v1 says "no limit" as a huge page-aligned number
OOM_HOLD = 300.0  # seconds the oom_kill alert stays up after the counter rose
TOP = 3

Owner = Callable[[Optional[str], Optional[str]], Optional[str]]


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(path: str) -> Optional[int]:
    text = _read(path)
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _key(path: str, *keys: str) -> Optional[int]:
    """The value of the first of ``keys`` found in a "key value" file (memory.stat, .events)."""
    text = _read(path)
    if text is None:
        return None
    found = dict(line.partition(" ")[::2] for line in text.splitlines())
    for k in keys:
        try:
            return int(found[k])
        except (KeyError, ValueError):
            continue
    return None


class Cgroup:
    """One memory cgroup directory, v1 or v2: what it reads, None for what it cannot."""

    def __init__(self, path: str, v2: bool) -> None:
        self.path, self.v2 = path, v2

    def _f(self, name: str) -> str:
        return os.path.join(self.path, name)

    def limit(self) -> Optional[int]:
        n = _int(self._f("memory.max" if self.v2 else "memory.limit_in_bytes"))
        return n if n is not None and 0 < n < NO_LIMIT else None

    def usage(self) -> Optional[int]:
        n = _int(self._f("memory.current" if self.v2 else "memory.usage_in_bytes"))
        if n is None:
            return None
        keys = ("inactive_file",) if self.v2 else ("total_inactive_file", "inactive_file")
        cache = _key(self._f("memory.stat"), *keys) or 0
        return max(n - cache, 0)

    def swap(self) -> Optional[int]:
        if self.v2:
            return _int(self._f("memory.swap.current"))
        both = _int(self._f("memory.memsw.usage_in_bytes"))
        mem = _int(self._f("memory.usage_in_bytes"))
        return None if both is None or mem is None else max(both - mem, 0)

    def oom_kills(self) -> Optional[int]:
        return _key(self._f("memory.events" if self.v2 else "memory.oom_control"), "oom_kill")


def cgroup_chain(pid: Optional[int]) -> List[Cgroup]:
    """The memory cgroups of ``pid`` (else this process), innermost first, up to the mount
    root; v1's memory controller where it is mounted, else v2's."""
    text = _read(f"/proc/{pid}/cgroup") if pid else None
    text = text if text is not None else _read("/proc/self/cgroup")
    v1: List[Tuple[str, str, bool]] = []
    v2: List[Tuple[str, str, bool]] = []
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].strip("/")
        if parts[0] == "0" and parts[1] == "":
            v2 += [(m, rel, True) for m in (ROOT, os.path.join(ROOT, "unified"))]
        elif "memory" in parts[1].split(","):
            v1.append((os.path.join(ROOT, "memory"), rel, False))
    for mount, rel, is_v2 in v1 + v2:
        probe = "memory.current" if is_v2 else "memory.usage_in_bytes"
        chain: List[Cgroup] = []
        path = os.path.join(mount, rel) if rel else mount
        while True:
            if os.path.exists(os.path.join(path, probe)):
                chain.append(Cgroup(path, is_v2))
            if len(path) <= len(mount):
                break
            path = os.path.dirname(path)
        if chain:
            return chain
    return []


class Proc:
    """One process of the attempt as the verdict shows it."""

    def __init__(self, pid: int, name: str, rss: int) -> None:
        self.pid, self.name, self.rss = pid, name, rss

    def doc(self) -> Dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "rss": self.rss}

    def __str__(self) -> str:
        return f"pid {self.pid} {self.name} ({human(self.rss)})"


def _name(p: psutil.Process) -> str:
    """A short name: the command line's first words, else the process name."""
    try:
        words = p.cmdline()
    except (psutil.Error, OSError):
        words = []
    if words:
        words = [os.path.basename(words[0]), *words[1:3]]
        text = " ".join(words)
        return text if len(text) <= 60 else text[:57] + "..."
    try:
        return str(p.name())
    except (psutil.Error, OSError):
        return "?"


class MemoryProbe:
    name = "memory"

    def __init__(self, cfg: MemoryConfig, owner: Owner) -> None:
        self.cfg = cfg
        self.owner = owner
        self._procs: Dict[int, psutil.Process] = {}
        self._scan_tag: Optional[str] = None
        self._since_scan = 0
        self._oom: Optional[int] = None  # the counter at the last tick
        # (until, the attempt's tag, the alert): it stays up a while, for that attempt only
        self._oom_verdict: Optional[Tuple[float, Optional[str], Verdict]] = None
        self._biggest: Optional[Proc] = None  # on the previous tick

    # ---- the attempt's processes
    def _scan(self, tag: Optional[str]) -> None:
        found: Dict[int, psutil.Process] = {}
        if tag:
            for p in psutil.process_iter():
                try:
                    if self.owner(p.environ().get(TAG_VAR), tag) == "current":
                        found[p.pid] = p
                except (psutil.Error, OSError):  # gone, a zombie, another user's
                    continue
        self._procs = self._with_children(found)
        self._scan_tag, self._since_scan = tag, 0

    def _refresh(self, tag: Optional[str]) -> None:
        """The cached set of the attempt's processes: the dead dropped, new children added."""
        if tag != self._scan_tag or self._since_scan >= RESCAN_TICKS:
            self._scan(tag)
            return
        self._since_scan += 1
        self._procs = self._with_children(
            {pid: p for pid, p in self._procs.items() if p.is_running()}
        )

    @staticmethod
    def _with_children(procs: Dict[int, psutil.Process]) -> Dict[int, psutil.Process]:
        """``procs`` and their descendants (a launcher may scrub the tag from a worker's
        environment; a child is the attempt's all the same)."""
        out = dict(procs)
        for p in procs.values():
            try:
                for child in p.children(recursive=True):
                    out.setdefault(child.pid, child)
            except (psutil.Error, OSError):
                continue
        return out

    def top(self, tag: Optional[str]) -> List[Proc]:
        """The attempt's processes, biggest RSS first."""
        self._refresh(tag)
        out = []
        for pid, p in self._procs.items():
            try:
                out.append(Proc(pid, _name(p), int(p.memory_info().rss)))
            except (psutil.Error, OSError):
                continue
        return sorted(out, key=lambda x: -x.rss)

    # ---- one tick
    def _usage(self, pid: Optional[int]) -> Tuple[Optional[int], int, Optional[int], Any, str]:
        """(used, limit, swap, oom_kills, where): the binding cgroup's, else the host's."""
        chain = cgroup_chain(pid)
        bound = next((c for c in chain if c.limit() is not None), None)
        if bound is not None:
            limit = bound.limit()
            assert limit is not None
            return bound.usage(), limit, bound.swap(), bound.oom_kills(), f"cgroup {bound.path}"
        # No limit set: what the host has left is what counts (a global OOM), said so.
        vm = psutil.virtual_memory()
        inner = chain[0] if chain else None
        swap = inner.swap() if inner is not None else None
        kills = inner.oom_kills() if inner is not None else None
        return vm.total - vm.available, vm.total, swap, kills, "the host (no cgroup memory limit)"

    def check(self, ctx: Context) -> Reading:
        # The processes are read before the OOM counter: a kill the counter shows happened
        # after the previous tick's counter read, so after the previous tick's process list,
        # which therefore still holds the victim (read the other way round, a kill between
        # the two reads leaves the victim out of both ticks' lists).
        procs = self.top(ctx.tag) if ctx.tag else []
        used, limit, swap, kills, where = self._usage(ctx.job_pid)
        prev_kills, self._oom = self._oom, kills
        prev_biggest, self._biggest = self._biggest, (procs[0] if procs else None)
        sample = {
            "used": used,
            "limit": limit,
            "swap": swap,
            "oom_kills": kills,
            "top_rss": procs[0].rss if procs else None,
        }
        data: Dict[str, Any] = {"where": where, "limit": limit, "used": used, "swap": swap}
        data["top"] = [p.doc() for p in procs[:TOP]]
        if kills is not None and prev_kills is not None and kills > prev_kills:
            alert = _oom_alert(kills - prev_kills, prev_biggest, where, data)
            self._oom_verdict = (ctx.now + OOM_HOLD, ctx.tag, alert)
        if self._oom_verdict is not None:
            until, tag, alert = self._oom_verdict
            if ctx.now < until and ctx.tag == tag:
                return Reading(alert, sample)
            self._oom_verdict = None
        if used is None:
            return Reading(
                unknown(self.name, f"memory usage of {where} unreadable", **data), sample
            )
        return Reading(self._level(used, limit, where, procs, data), sample)

    def _level(
        self, used: int, limit: int, where: str, procs: List[Proc], data: Dict[str, Any]
    ) -> Verdict:
        share = used / limit
        text = f"{human(used)} of {human(limit)} used ({share * 100:.0f}%) in {where}"
        if share < self.cfg.warn_at:
            return ok(self.name, text, **data)
        if procs:
            held = sum(p.rss for p in procs)
            text += (
                f"; the attempt's {len(procs)} process{'es' if len(procs) > 1 else ''} hold "
                f"{human(held)}, the biggest: {', '.join(str(p) for p in procs[:TOP])}"
            )
        return Verdict(
            self.name,
            "warn",
            "memory_high",
            text,
            remedy="lower the batch size or the data loader's workers (num_workers), or rent "
            "a box with more RAM; the OOM killer takes a process once the limit is reached",
            klass="transient",
            data=data,
        )

    def close(self) -> None:
        self._procs = {}


def _oom_alert(n: int, biggest: Optional[Proc], where: str, data: Dict[str, Any]) -> Verdict:
    cause = (
        f"; the likely cause, the biggest process of the attempt on the last reading: {biggest}"
        if biggest is not None
        else ""
    )
    return Verdict(
        "memory",
        "alert",
        "oom_kill",
        f"the OOM killer killed {n} process{'es' if n > 1 else ''} in {where}{cause}",
        remedy="lower the batch size or the data loader's workers (num_workers), or rent a box "
        "with more RAM",
        klass="permanent",
        data={**data, "oom_kills_new": n, "cause": biggest.doc() if biggest else None},
    )
