"""Slurm's side of a run as the login node reports it: ``scontrol show job -o`` read over ssh
and parsed, the run's live jobs found by name (``squeue``), and ``scancel``; plus the two time
formats Slurm speaks (``--time``'s, checked as a flag, and ``[D-]HH:MM:SS`` in its reports).

Everything Slurm prints is untrusted input on the laptop: the output is read to at most
MAX_OUTPUT bytes, a line is split into ``Key=value`` words defensively (a value with spaces, as
a path may have, continues over the words that hold no ``=``), each value is capped and its
control characters replaced, a state that is not an upper-case word reads as UNKNOWN, and a
number or duration that does not parse is None, never a guess.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional

from controller.remote import Remote
from onbox.common.errors import HostError, UsageError

MAX_OUTPUT = 256 * 1024
MAX_VALUE = 512
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_:/]{0,40}\Z")
_STATE = re.compile(r"[A-Z][A-Z_]{0,31}\Z")
_JOB_ID = re.compile(r"[0-9]{1,12}\Z")
_TASK = re.compile(r"[0-9]{1,9}\Z")
# A job in one of these states still holds (or waits for) an allocation: a second submission
# of the same run would be a second writer.
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
        "SPECIAL_EXIT",
        "UNKNOWN",  # unreadable: counted live, so that nothing submits a second job on a guess
    }
)

# ``scontrol show job -o JOB``, its status kept, its output bounded ($1: the job id).
_SHOW = (
    'out=$(scontrol show job -o "$1" 2>&1); rc=$?; '
    'printf "%s\\n" "$out" | head -c ' + str(MAX_OUTPUT) + "; exit $rc"
)
# The user's live jobs named $1 (``squeue -h -n NAME -o '%i %T'``).
_LIVE = (
    'out=$(squeue -h -u "$(id -un)" -n "$1" -o "%i %T" 2>&1); rc=$?; '
    'printf "%s\\n" "$out" | head -c ' + str(MAX_OUTPUT) + "; exit $rc"
)


def clean(value: str) -> str:
    """``value`` capped at MAX_VALUE, its control characters as ``?``."""
    value = value[:MAX_VALUE]
    return "".join(c if c.isprintable() else "?" for c in value)


def parse_fields(line: str) -> Dict[str, str]:
    """``Key=value`` words of one line of ``scontrol show job -o`` (a word without ``=`` or
    with a key Slurm would not print belongs to the value before it)."""
    out: Dict[str, str] = {}
    last: Optional[str] = None
    for word in line.split(" "):
        key, eq, value = word.partition("=")
        if eq and _KEY.match(key) and key not in out:
            out[key] = value
            last = key
        elif last is not None and word:
            out[last] = f"{out[last]} {word}"
    return {k: clean(v) for k, v in out.items()}


def parse_clock(value: Optional[str]) -> Optional[int]:
    """Seconds of Slurm's ``[D-]HH:MM:SS`` (also ``MM:SS``, ``D-HH``); None for UNLIMITED,
    N/A or anything else."""
    if not value:
        return None
    m = re.fullmatch(r"(?:(\d{1,5})-)?(\d{1,6})(?::(\d{1,2}))?(?::(\d{1,2}))?", value.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        nums += [0] * (3 - len(nums))  # D-HH, D-HH:MM, D-HH:MM:SS
    elif len(nums) == 2:
        nums = [0, *nums]  # MM:SS
    elif len(nums) == 1:
        return None
    h, mi, s = nums
    if mi >= 60 or s >= 60:
        return None
    return (int(days or 0) * 24 + h) * 3600 + mi * 60 + s


def parse_walltime(value: str, field: str = "--time") -> int:
    """Seconds of an sbatch ``--time`` (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``); UsageError for anything else, 0, or UNLIMITED (rgt plans its warning
    against the limit, so there must be one)."""
    v = str(value).strip()
    m = re.fullmatch(r"(?:(\d{1,4})-)?(\d{1,6})(?::(\d{1,2}))?(?::(\d{1,2}))?", v)
    seconds = None
    if m:
        days, a, b, c = m.groups()
        nums = [int(x) for x in (a, b, c) if x is not None]
        if days is not None:
            h, mi, s = (nums + [0, 0])[:3]
            seconds = (int(days) * 24 + h) * 3600 + mi * 60 + s if mi < 60 and s < 60 else None
        elif len(nums) == 1:
            seconds = nums[0] * 60  # plain minutes
        elif len(nums) == 2:
            seconds = nums[0] * 60 + nums[1] if nums[1] < 60 else None
        else:
            h, mi, s = nums
            seconds = h * 3600 + mi * 60 + s if mi < 60 and s < 60 else None
    if not seconds:
        raise UsageError(
            field,
            f"{value!r} is not a Slurm time limit",
            "give minutes (90), MM:SS, HH:MM:SS or D-HH:MM:SS, as sbatch --time takes it",
        )
    return seconds


def _int(value: Optional[str]) -> Optional[int]:
    return int(value) if value is not None and re.fullmatch(r"\d{1,9}", value) else None


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """One job (or array task) as ``scontrol show job`` reports it, checked."""

    job: str  # JobId
    state: str  # JobState, UNKNOWN when unreadable
    reason: str
    restarts: Optional[int]
    time_limit: Optional[int]  # seconds; None: UNLIMITED or unreadable
    run_time: Optional[int]
    node: str  # NodeList ("" while pending)
    stdout: Optional[str]  # StdOut: the batch output file on the cluster's filesystem
    exit_code: str
    array_job: Optional[str] = None
    array_task: Optional[str] = None  # a number, or a range while tasks are pending

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def time_left(self) -> Optional[int]:
        if self.time_limit is None or self.run_time is None:
            return None
        return max(0, self.time_limit - self.run_time)

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["live"] = self.live
        d["time_left"] = self.time_left
        return d


def job_from_fields(f: Dict[str, str]) -> Optional[SlurmJob]:
    """The job of one parsed line; None when it names no job id."""
    job = f.get("JobId", "")
    if not _JOB_ID.match(job):
        return None
    state = f.get("JobState", "")
    array_job = f.get("ArrayJobId")
    task = f.get("ArrayTaskId")
    return SlurmJob(
        job=job,
        state=state if _STATE.match(state) else "UNKNOWN",
        reason=f.get("Reason", ""),
        restarts=_int(f.get("Restarts")),
        time_limit=parse_clock(f.get("TimeLimit")),
        run_time=parse_clock(f.get("RunTime")),
        node="" if f.get("NodeList") in (None, "(null)") else f["NodeList"],
        stdout=f.get("StdOut") or None,
        exit_code=f.get("ExitCode", ""),
        array_job=array_job if array_job and _JOB_ID.match(array_job) else None,
        array_task=task if task and re.fullmatch(r"[0-9,%\[\]-]{1,64}", task) else None,
    )


def parse_jobs(text: str) -> List[SlurmJob]:
    """Every job ``scontrol show job -o`` printed (lines that name none are skipped)."""
    out = []
    for line in text[:MAX_OUTPUT].splitlines():
        job = job_from_fields(parse_fields(line))
        if job is not None:
            out.append(job)
    return out


def job_ref(scheduler: Dict[str, Any]) -> Optional[str]:
    """Slurm's id of a run's job from its record (``ARRAY_TASK`` for an array cell)."""
    job = str(scheduler.get("job", ""))
    if not _JOB_ID.match(job):
        return None
    task = scheduler.get("array_task")
    if task is None:
        return job
    return f"{job}_{task}" if _TASK.match(str(task)) else None


def show(remote: Remote, ref: str) -> List[SlurmJob]:
    """The job ``ref`` as Slurm knows it now; [] when it no longer does (finished longer ago
    than MinJobAge, or never was). HostError when scontrol cannot be asked."""
    r = remote.sh(_SHOW, ref, timeout=60)
    text = r.text
    if r.rc != 0:
        if "Invalid job id" in text or re.search(r"\bnot found\b", text):
            return []
        raise HostError(
            f"{remote.target.label}: scontrol show job {ref} failed (exit {r.rc}): "
            f"{clean(text.strip()[-300:])}",
            "is Slurm's scontrol on the login node's PATH, and SLURM_CONF set for ssh sessions?",
        )
    return parse_jobs(text)


def live_jobs(remote: Remote, job_name: str) -> List[str]:
    """Ids of this user's live jobs named ``job_name`` (HostError when squeue fails)."""
    r = remote.sh(_LIVE, job_name, timeout=60)
    if r.rc != 0:
        raise HostError(
            f"{remote.target.label}: squeue failed (exit {r.rc}): {clean(r.text.strip()[-300:])}"
        )
    return parse_live(r.text)


def parse_live(text: str) -> List[str]:
    """The ids of ``squeue -o '%i %T'`` lines in a live state (``123``, ``123_4``)."""
    out = []
    for line in text[:MAX_OUTPUT].splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"[0-9]{1,12}(_[0-9\[\],%-]{1,64})?", parts[0]):
            state = parts[1] if _STATE.match(parts[1]) else "UNKNOWN"
            if state in LIVE_STATES:
                out.append(parts[0])
    return out


def cancel(remote: Remote, ref: str) -> None:
    """``scancel REF`` (HostError when it fails for another reason than the job being gone)."""
    r = remote.sh('scancel "$1" 2>&1', ref, timeout=60)
    if r.rc != 0 and "Invalid job id" not in r.text and "already completing" not in r.text:
        raise HostError(
            f"{remote.target.label}: scancel {ref} failed (exit {r.rc}): "
            f"{clean(r.text.strip()[-300:])}"
        )


def clock(seconds: Optional[int]) -> str:
    """``H:MM:SS`` (``D-HH:MM:SS`` past a day), ``?`` for None."""
    if seconds is None:
        return "?"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    text = f"{h}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{d}-{h:02d}:{rest // 60:02d}:{rest % 60:02d}" if d else text


def describe(job: Optional[SlurmJob], ref: str) -> str:
    """One line of a run's Slurm side, for status and watch."""
    if job is None:
        return f"slurm: job {ref} is no longer known to Slurm (it ended more than MinJobAge ago)"
    where = f" on {job.node}" if job.node else ""
    reason = f" ({job.reason})" if job.reason and job.reason != "None" else ""
    limit = (
        f", time left {clock(job.time_left)} of {clock(job.time_limit)}"
        if job.time_limit is not None
        else ", no time limit"
    )
    return f"slurm: job {ref} {job.state}{reason}{where}, restarts {job.restarts}{limit}"
