"""Turn how a job ended into a reason a person can act on, and into which budget it costs.

Inputs are facts: the exit status the shim recorded, the tail of the attempt's output, whether
the cgroup's OOM-kill count rose during the attempt, and whether the filesystem ran out of
inodes. Pure functions; the supervisor decides what to do with the verdict.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import signal
from typing import Any, Callable, Dict, Optional, Tuple

from onbox.agent import launchers


@dataclasses.dataclass(frozen=True)
class ExitStatus:
    """How the job's process ended; both None when nobody saw it end (the shim was killed)."""

    code: Optional[int] = None
    signal: Optional[int] = None
    note: str = ""  # e.g. the shim's "exec failed: ..." message

    @property
    def known(self) -> bool:
        return self.code is not None or self.signal is not None


class Kind(str, enum.Enum):
    SUCCESS = "success"
    OOM_KILLED = "oom_killed"
    CUDA_OOM = "cuda_oom"
    NAN_LOSS = "nan_loss"
    DISK_FULL = "disk_full"
    INODES_EXHAUSTED = "inodes_exhausted"
    SYNTAX_ERROR = "syntax_error"
    IMPORT_ERROR = "import_error"
    PYTHON_EXCEPTION = "python_exception"
    COMMAND_NOT_FOUND = "command_not_found"
    SIGNAL = "signal"
    CRASHED = "crashed"  # ended by a signal of its own fault: SIGSEGV, SIGABRT, ...
    EXIT_CODE = "exit_code"
    UNKNOWN = "unknown"
    # Ended by the agent on a probe's word (onbox/health/): a hang, or a training signal whose
    # policy is to stop (a NaN loss).
    STALLED = "stalled"
    HEALTH = "health"
    # A collective failed because another rank stopped taking part (onbox/agent/launchers.py).
    PEER_LOST = "peer_lost"


class Budget(str, enum.Enum):
    """Which restart budget an end spends."""

    NONE = "none"  # success
    PREEMPT = "preempt"  # the job was ended from outside; its code is fine
    ERROR = "error"  # the job's code or its resources failed


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A classified exit."""

    kind: Kind
    reason: str
    remedy: str
    klass: str  # transient | permanent | integrity | usage
    budget: Budget
    deterministic: bool = False  # retrying cannot help
    step: Optional[int] = None  # last step the job reported, when it did


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?:: (.*))?$")
_STEP = re.compile(r"(?i)\bstep[\s:=#]*(\d+)")
_NAN = re.compile(r"(?i)\b(loss\b[^\n]{0,40}\b(nan|inf)\b|non-finite loss|nan loss)")
_CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")
# What PyTorch's DataLoader raises in the main process when a worker was killed (the OOM
# killer takes the biggest process, a worker holding a prefetched batch as often as not).
_WORKER_KILLED = re.compile(
    r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) (?:is killed by signal: Killed|exited unexpectedly)"
)
_EDQUOT = re.compile(r"Disk quota exceeded|\[Errno 122\]|EDQUOT")
_ENOSPC = re.compile(r"No space left on device|\[Errno 28\]|ENOSPC")
_SYNTAX = {"SyntaxError", "IndentationError", "TabError"}
_IMPORT = {"ImportError", "ModuleNotFoundError"}
# Exit codes a shell uses for a child killed by these signals (`bash -c` wrappers).
_SHELL_SIGNALS = {
    128 + int(s) for s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
}
# Signals a process gets for its own fault: a bad memory access (a C extension's segfault), an
# abort() (a failed assertion in native code), a bad instruction, a trap or a forbidden system
# call. The job crashed: a restart runs the same code, so it spends the error budget. Any other
# signal came from outside (a stop, a preemption, a person, SIGKILL not by the OOM killer).
_CRASH_SIGNALS = frozenset(
    int(s)
    for s in (
        signal.SIGSEGV,
        signal.SIGABRT,
        signal.SIGBUS,
        signal.SIGFPE,
        signal.SIGILL,
        signal.SIGSYS,
        signal.SIGTRAP,
    )
)


# Signals the kernel sends a job that passed a resource limit it runs under (its own setrlimit,
# `ulimit` in its wrapper, the box's limits.conf): the next attempt meets the same limit, so
# like a crash it spends the error budget, never the preemption one.
_LIMIT_SIGNALS = {
    int(signal.SIGXCPU): ("CPU time", "RLIMIT_CPU, ulimit -t"),
    int(signal.SIGXFSZ): ("file size", "RLIMIT_FSIZE, ulimit -f"),
}


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def last_exception(tail: str) -> Optional[Tuple[str, str]]:
    """(type, message) of the last Python exception in a log tail, if any."""
    lines = tail.splitlines()
    headers = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    if headers:
        # The exception line is the first unindented line after the last traceback header.
        for line in lines[headers[-1] + 1 :]:
            if line and not line[0].isspace():
                m = _EXC_LINE.match(line.strip())
                return (m.group(1), (m.group(2) or "").strip()) if m else None
        return None
    # A SyntaxError in the main script is printed without a traceback header.
    for line in reversed(lines[-8:]):
        m = _EXC_LINE.match(line.strip())
        if m and m.group(1).split(".")[-1] in _SYNTAX | _IMPORT:
            return m.group(1), (m.group(2) or "").strip()
    return None


def last_step(tail: str) -> Optional[int]:
    """The last ``step N`` the job printed."""
    found = _STEP.findall(tail)
    return int(found[-1]) if found else None


def _resource_verdict(
    status: ExitStatus,
    tail: str,
    step: Optional[int],
    oom_kills_rose: bool,
    inodes_exhausted: Callable[[], bool],
) -> Optional[Verdict]:
    """The end's verdict when a resource ran out (host memory, GPU memory, disk, inodes) or
    the loss went non-finite; None otherwise."""
    code, sig = status.code, status.signal
    killed = sig == signal.SIGKILL or code == 128 + signal.SIGKILL
    if killed and oom_kills_rose:
        return Verdict(
            Kind.OOM_KILLED,
            "killed by the kernel's OOM killer (host memory)",
            "lower the batch size or workers, or rent a box with more RAM",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if oom_kills_rose and _WORKER_KILLED.search(tail):
        return Verdict(
            Kind.OOM_KILLED,
            "a DataLoader worker was killed by the kernel's OOM killer (host memory)",
            "lower the DataLoader's num_workers or prefetch_factor, or the batch size, or rent "
            "a box with more RAM",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if _CUDA_OOM.search(tail):
        return Verdict(
            Kind.CUDA_OOM,
            "CUDA out of memory" + (f" at step {step}" if step else ""),
            "lower the batch size, use gradient accumulation or checkpointing",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if _EDQUOT.search(tail):
        return Verdict(
            Kind.DISK_FULL,
            "disk quota exceeded (EDQUOT): the filesystem may have room, the quota on it has none",
            "free space within the quota (old checkpoints, caches) or have it raised (a network "
            "volume's size); `df` shows the filesystem's room, not the quota's",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if _ENOSPC.search(tail):
        if inodes_exhausted():
            return Verdict(
                Kind.INODES_EXHAUSTED,
                "the filesystem ran out of inodes",
                "delete many small files (caches, extracted datasets)",
                "permanent",
                Budget.ERROR,
                step=step,
            )
        return Verdict(
            Kind.DISK_FULL,
            "no space left on device (ENOSPC)",
            "free disk space or keep fewer local checkpoints",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if _NAN.search(tail):
        return Verdict(
            Kind.NAN_LOSS,
            "the loss became NaN/inf",
            "lower the learning rate, check the data, or enable gradient clipping",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    return None


def _peer_verdict(status: ExitStatus, tail: str, step: Optional[int]) -> Optional[Verdict]:
    """The end's verdict when the process failed because a peer rank stopped taking part in a
    collective: its last exception says so, or NCCL's watchdog aborted it (SIGABRT); None
    otherwise. A retry helps once the peer is back, but a job that hangs itself in a collective
    ends the same way every time, so it spends the error budget (bounded), not the preemption
    one."""
    exc = last_exception(tail)
    said = launchers.peer_lost(exc[1]) if exc is not None else None
    aborted = status.signal == signal.SIGABRT or status.code == 128 + signal.SIGABRT
    if said is None and aborted:
        said = launchers.peer_lost(tail)
    if said is None:
        return None
    return Verdict(
        Kind.PEER_LOST,
        f"a collective failed because another rank stopped taking part: {said}",
        "look in the other ranks' and nodes' logs for the first failure (a node preempted or "
        "crashed, a network fault, a rank that hung); rgt restarts from the newest sealed "
        "checkpoint on the error budget: on spot nodes raise [restart] max_error_restarts",
        "transient",
        Budget.ERROR,
        step=step,
    )


def _exception_verdict(tail: str, sig: Optional[int], step: Optional[int]) -> Optional[Verdict]:
    """The end's verdict from the last Python exception in the log; None when there is none
    (or it was a KeyboardInterrupt, or a signal ended the job after it)."""
    exc = last_exception(tail)
    if exc is not None:
        etype, msg = exc
        short = etype.split(".")[-1]
        text = f"{etype}: {msg}" if msg else etype
        if short in _SYNTAX:
            return Verdict(
                Kind.SYNTAX_ERROR,
                text,
                "fix the code; retrying cannot help",
                "usage",
                Budget.ERROR,
                deterministic=True,
                step=step,
            )
        if short in _IMPORT:
            return Verdict(
                Kind.IMPORT_ERROR,
                text,
                "install the package into the job's Python or fix the import",
                "usage",
                Budget.ERROR,
                deterministic=True,
                step=step,
            )
        if short != "KeyboardInterrupt" and sig is None:
            return Verdict(
                Kind.PYTHON_EXCEPTION,
                text,
                "fix the error shown in the log",
                "permanent",
                Budget.ERROR,
                step=step,
            )
    return None


def _signal_verdict(status: ExitStatus, step: Optional[int]) -> Optional[Verdict]:
    """The end's verdict when a signal ended the job (or the shell that ran it said so with
    128 + N); None otherwise. A signal of the job's own fault or of a resource limit it passed
    is a crash, any other an end from outside."""
    code, sig = status.code, status.signal
    if sig is not None:
        n, said = sig, ""
    elif code is not None and (
        code in _SHELL_SIGNALS or code - 128 in _CRASH_SIGNALS or code - 128 in _LIMIT_SIGNALS
    ):
        n, said = code - 128, f" (a shell's exit code {code})"
    else:
        return None
    if n in _LIMIT_SIGNALS:
        what, limit = _LIMIT_SIGNALS[n]
        return Verdict(
            Kind.CRASHED,
            f"passed its own {what} limit: signal {n} ({_signame(n)}, {limit}){said}",
            f"raise the {what} limit the job runs under ({limit}) or make it stay within it; "
            "a restart meets the same limit",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    if n in _CRASH_SIGNALS:
        return Verdict(
            Kind.CRASHED,
            f"crashed with signal {n} ({_signame(n)}){said}",
            "the job's own code failed (native code: a C extension, a library, an abort()): look "
            "at the end of the job's log for the fatal error and stack trace, or at a core dump",
            "permanent",
            Budget.ERROR,
            step=step,
        )
    return Verdict(
        Kind.SIGNAL,
        f"killed by signal {n} ({_signame(n)})",
        "something outside the job ended it; rgt restarts it with resume",
        "transient",
        Budget.PREEMPT,
        step=step,
    )


def classify(
    status: ExitStatus,
    tail: str,
    *,
    success_codes: Tuple[int, ...] = (0,),
    oom_kills_rose: bool = False,
    inodes_exhausted: Callable[[], bool] = lambda: False,
) -> Verdict:
    """Classify one ended attempt. Under torchrun the first rank that failed decides, under
    mp.spawn the child the parent names, and a rank's own lines are read without their rank
    prefix (onbox/agent/launchers.py)."""
    step = last_step(tail)
    code = status.code
    if code is not None and code in success_codes:
        return Verdict(Kind.SUCCESS, f"exited with code {code}", "", "", Budget.NONE, step=step)
    if not status.known:
        return Verdict(
            Kind.UNKNOWN,
            "exit status was not recorded (the shim was killed)",
            "look at the end of the job's log",
            "transient",
            Budget.PREEMPT,
            step=step,
        )
    if code == 127 and status.note:
        return Verdict(
            Kind.COMMAND_NOT_FOUND,
            status.note,
            "check the command and PATH",
            "usage",
            Budget.ERROR,
            deterministic=True,
            step=step,
        )
    # torchrun's own exit code and ChildFailedError, and mp.spawn's exception in the parent,
    # say only that a rank (a child) failed: its exit (a negative code is a signal) and its own
    # lines say how.
    cause = launchers.root_cause(tail)
    if cause is not None:
        who, code, own = f"rank {cause.rank}", cause.exitcode, launchers.rank_lines(tail, cause)
    else:
        tail = launchers.unprefixed(tail)
        # A Python exception the parent did not catch exits it with 1: any other status is
        # not mp.spawn's exception ending the job, whatever its text said earlier.
        child = launchers.spawned(tail) if status.code == 1 else None
        if child is None:
            return _verdict(status, tail, step, oom_kills_rose, inodes_exhausted)
        who, code, own = f"process {child.index}", child.exitcode, child.lines
    ranked = ExitStatus(signal=-code) if code < 0 else ExitStatus(code=code)
    v = _verdict(ranked, own, step, oom_kills_rose, inodes_exhausted)
    return dataclasses.replace(v, reason=f"{who}: {v.reason}")


def _verdict(
    status: ExitStatus,
    tail: str,
    step: Optional[int],
    oom_kills_rose: bool,
    inodes_exhausted: Callable[[], bool],
) -> Verdict:
    """The verdict of a failed end of a known status, from the output of the process (or the
    rank) that failed."""
    verdict = _resource_verdict(status, tail, step, oom_kills_rose, inodes_exhausted)
    if verdict is None:
        verdict = _peer_verdict(status, tail, step)
    if verdict is None:
        verdict = _exception_verdict(tail, status.signal, step)
    if verdict is not None:
        return verdict
    verdict = _signal_verdict(status, step)
    if verdict is not None:
        return verdict
    code = status.code
    return Verdict(
        Kind.EXIT_CODE,
        f"exited with code {code}",
        "look at the end of the job's log",
        "permanent",
        Budget.ERROR,
        step=step,
    )


def ended_by_agent(verdict: Verdict, kill: Dict[str, Any]) -> Verdict:
    """An end the agent asked for on a probe's word (``Supervisor.kill_attempt``): that is the
    reason, whatever the signal; "fail" ends the run, "restart" spends the error budget."""
    return Verdict(
        Kind(kill["kind"]),
        f"{kill['reason']} (ended by the agent: {verdict.reason})",
        kill.get("remedy", ""),
        kill.get("klass") or "transient",
        Budget.ERROR,
        deterministic=kill["then"] == "fail",
        step=verdict.step,
    )


def ended_by_stop(verdict: Verdict, status: ExitStatus, reason: str) -> Verdict:
    """An end during a stop or a preemption: we ended it, whatever the signal; no budget."""
    return Verdict(
        Kind.SIGNAL if status.signal else Kind.EXIT_CODE,
        f"ended by {reason} ({verdict.reason})",
        "",
        "",
        Budget.NONE,
        step=verdict.step,
    )
