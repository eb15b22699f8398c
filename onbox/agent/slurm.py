"""The agent inside a Slurm job: the warning before the time limit, the seal, and the requeue.

``rgt-agent run`` inside an allocation (``SLURM_JOB_ID`` in its environment) gets a
``SlurmWatch``; the loop (onbox/agent/loop.py) calls it at a few points and nothing else of Slurm
lives there:

- ``begin``: one ``slurm_job`` event and ``state.json``'s ``slurm`` (the job id, the array's ids,
  ``SLURM_RESTART_COUNT``: the allocation's attempt, what `rgt-agent status` shows), and the job's
  EndTime read once (``scontrol show job -o``, bounded).
- ``on_usr2``: a SIGUSR2 with no mailbox request (stop.request, sync.request) is Slurm's warning
  (``#SBATCH --signal=B:USR2@LEAD``, controller/slurm/batch.py). The run takes the preemption
  path with the LEAD as its budget (not the grace): the job is asked for a checkpoint through its
  stop signal and trigger, the checkpoint is sealed, and the run ends PREEMPTED.
- ``tick``/``wait``: its own timer. When fewer seconds are left before EndTime than its seal
  needs (twice its own measured seal time, onbox/common/sealtime.py, at least the lead; the grace
  when nothing was measured), it starts the warning path itself: a signal that came late (Slurm
  checks its timers only every 30 s or so) or a lead too short for today's checkpoint.
- ``on_term``: a SIGTERM with no warning before it (the time limit, a preemption, a scancel):
  the loop's preemption path as before, within the grace.
- ``after``: once the run is terminal and the agent let go of it, never in a signal handler:
  after a warning, ``scontrol requeue JOBID``; after a bare SIGTERM, the job's end as Slurm
  says it (TIMEOUT, PREEMPTED, NODE_FAIL: requeue; a user's scancel: not). A job whose
  ``Restarts`` is past this allocation's was requeued already (``scontrol requeue``, a node
  failure, a preemption in REQUEUE mode): said so, never requeued twice. Events
  ``slurm_requeued``, ``slurm_requeue_failed`` (the reason and the remedy) or
  ``slurm_not_requeued``. A stop the user asked for wins over the requeue, whichever came
  first: the run ends STOPPED (onbox/agent/supervisor.py ``request_stop``; one asked during the
  final seal is read before the terminal state) and is not requeued, nor is a PREEMPTED run
  when a stop came after its end, before the requeue. One that comes after the requeue cancels
  the requeued job from the login node (onbox/agent/slurmlogin.py, with ``wake_agent``). The
  requeued job's ``rgt-agent run`` is a new incarnation of the same run: it restores from the
  store and goes on (a DONE.json there stops a finished one).

While a job is ending, ``scontrol`` shows it COMPLETING whatever ended it; the cause is in
``Reason=TimeLimit`` (the time limit), ``PreemptTime`` (set only for a preempted job) and
``Reason=NodeDown``/``NodeFail``; none of them is a cancel. Commands are argv lists run with
timeouts, never through a shell. Lightning is detected (``uses_lightning``) only to say which side
requeues: rgt installs no handler on SIGUSR1 (Lightning's requeue signal, and NCCL's) and
refuses ``trigger = "signal:USR1"`` under Slurm (``check_trigger``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.agent.journal import read_events
from onbox.common.errors import UsageError
from onbox.common.sealtime import FACTOR, measure

JOB_ID = "SLURM_JOB_ID"
ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
RESTART_COUNT = "SLURM_RESTART_COUNT"
LEAD_VAR = "RGT_SLURM_LEAD"  # the lead the batch script asked Slurm for, in seconds
TIMEOUT = 60.0  # per scontrol call: a busy slurmctld answers in seconds; a dead one never
RECHECK = 60.0  # seconds between two looks at the run's own measured seal time
REQUEUE_ENDS = ("TIMEOUT", "PREEMPTED", "NODE_FAIL")
_LIGHTNING = re.compile(rb"^\s*(?:import|from)\s+(?:lightning|pytorch_lightning)\b", re.M)
MAX_SCRIPT = 4 << 20  # bytes of an entry script read to look for Lightning

Event = Callable[..., None]


def check_trigger(trigger: str, field: str = "checkpoint.trigger") -> None:
    """Refuse a trigger on SIGUSR1 under Slurm: it is Lightning's requeue signal and NCCL's."""
    if trigger == "signal:USR1":
        raise UsageError(
            field,
            '"signal:USR1" cannot be used under Slurm: SIGUSR1 is Lightning\'s auto-requeue '
            "signal and NCCL's, and a handler on it silently disables Lightning's",
            'use trigger = "signal:USR2" or "file" (rgt requeues the job itself)',
        )


def uses_lightning(command: Sequence[str], workdir: str) -> Optional[str]:
    """The entry script of ``command`` when it imports lightning or pytorch_lightning (or the
    command is Lightning's own CLI), else None."""
    for word in command:
        if os.path.basename(word) == "lightning" or word.startswith(
            ("lightning.", "pytorch_lightning.")
        ):
            return word
    for word in command[:4]:
        if not word.endswith(".py"):
            continue
        path = word if os.path.isabs(word) else os.path.join(workdir, word)
        try:
            with open(path, "rb") as f:
                head = f.read(MAX_SCRIPT)
        except OSError:
            continue
        if _LIGHTNING.search(head):
            return word
    return None


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """The allocation this agent runs in, from Slurm's environment."""

    job_id: str
    array_job_id: Optional[str]
    array_task_id: Optional[str]
    restart_count: int  # 0 for the first allocation, N after N requeues
    lead: Optional[int]  # what the batch script asked for (None: not submitted by rgt)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional[SlurmJob]:
        job = environ.get(JOB_ID, "").strip()
        if not job.isdigit():
            return None
        restarts = environ.get(RESTART_COUNT, "0").strip()
        lead = environ.get(LEAD_VAR, "").strip()
        return cls(
            job,
            environ.get(ARRAY_JOB_ID) or None,
            environ.get(ARRAY_TASK_ID) or None,
            int(restarts) if restarts.isdigit() else 0,
            int(lead) if lead.isdigit() and int(lead) > 0 else None,
        )

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def run_tool(argv: List[str], timeout: float = TIMEOUT) -> Tuple[Optional[int], str, str]:
    """(exit code, stdout, stderr) of a Slurm client; exit code None when it could not run or
    did not answer within ``timeout`` (stderr says which)."""
    try:
        p = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        return None, "", f"{argv[0]} is not on PATH"
    except subprocess.TimeoutExpired:
        return None, "", f"{argv[0]} did not answer within {timeout:.0f} s"
    except OSError as e:
        return None, "", f"{argv[0]} could not run: {e.strerror}"
    return p.returncode, p.stdout, p.stderr.strip()


def parse_show(text: str) -> Dict[str, str]:
    """The ``Key=value`` words of ``scontrol show job -o`` (a value with a blank in it, such
    as a Command, keeps only its first word: nothing read here has one)."""
    out: Dict[str, str] = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and key and key not in out:
            out[key] = value
    return out


def show_job(job_id: str, timeout: float = TIMEOUT) -> Tuple[Optional[Dict[str, str]], str]:
    """The job's record from ``scontrol show job -o`` and "", or None and why not."""
    rc, out, err = run_tool(["scontrol", "show", "job", "-o", job_id], timeout)
    if rc != 0:
        return None, err or f"scontrol exited {rc}"
    fields = parse_show(out)
    return (fields, "") if fields.get("JobId") == job_id else (None, "no such job")


def how_it_ended(fields: Mapping[str, str]) -> str:
    """What ended the job, in Slurm's state names: TIMEOUT, PREEMPTED, NODE_FAIL, CANCELLED,
    or its JobState as shown (RUNNING: the SIGTERM did not come from Slurm's end of it)."""
    state = fields.get("JobState", "")
    reason = fields.get("Reason", "")
    preempted = fields.get("PreemptTime", "None") not in ("", "None", "Unknown")
    if state in REQUEUE_ENDS or state == "CANCELLED":
        return state
    if state in ("COMPLETING", "RUNNING", "CONFIGURING"):
        if reason == "TimeLimit":
            return "TIMEOUT"
        if preempted:
            return "PREEMPTED"
        if reason in ("NodeDown", "NodeFail"):
            return "NODE_FAIL"
        if state == "COMPLETING":  # ending, and nothing but a cancel says nothing of why
            return "CANCELLED"
    return state or "UNKNOWN"


def requeue_decision(fields: Optional[Mapping[str, str]], warned: bool) -> Tuple[bool, str]:
    """Whether to requeue, and why, for a run that ended PREEMPTED: always after a warning (its
    time was running out); after a bare SIGTERM by how the job ended."""
    if warned:
        return True, "the time limit was near: sealed on the warning"
    if fields is None:
        return False, "Slurm did not say how the job ended"
    ended = how_it_ended(fields)
    if ended in REQUEUE_ENDS:
        return True, f"the job ended {ended}"
    if ended == "CANCELLED":
        return False, "the job was cancelled (scancel): a cancelled job is not requeued"
    return False, f"the job is {ended}: the SIGTERM did not come from Slurm's end of the job"


def restarts(fields: Mapping[str, str]) -> int:
    """The job's ``Restarts`` (how often it was requeued so far; 0 when not shown)."""
    value = fields.get("Restarts", "")
    return int(value) if value.isdigit() else 0


def parse_end(value: Optional[str]) -> Optional[float]:
    """EndTime (the cluster's local time, to the second) as epoch seconds; None when unknown."""
    if not value or value in ("Unknown", "None", "N/A"):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


class SlurmWatch:
    """The Slurm side of one ``rgt-agent run`` (see the module's docstring)."""

    def __init__(
        self,
        job: SlurmJob,
        grace: float,
        events_path: str,
        event: Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.grace = grace
        self.events_path = events_path
        self.event = event
        self.clock = clock
        self.end_at: Optional[float] = None  # EndTime on the monotonic clock
        self.end_wall: Optional[float] = None
        self.need = float(job.lead or grace)  # seconds the seal needs before the end
        self.need_at: Optional[float] = None
        self.warned = False
        self.termed = False
        self.requeued: Optional[bool] = None
        self.stuck = 0
        # With a store: the sealed step this allocation began from, and how many allocations
        # before it, in a row, sealed nothing newer than theirs (``stuck``).
        self.has_store = False
        self.sealed_at_begin: Optional[int] = None
        self.stuck_before = 0

    def state(self) -> Dict[str, Any]:
        return {
            **self.job.to_json(),
            "end_time": self.end_wall,
            "warned": self.warned,
            "requeued": self.requeued,
        }

    def begin(
        self, extra: Dict[str, Any], sealed: Tuple[bool, Optional[int]] = (False, None)
    ) -> None:
        """Record the allocation; read its EndTime once (its own timer needs it). ``sealed``:
        whether the run has a store, and its sealed step now (after the restore)."""
        self.has_store, self.sealed_at_begin = sealed
        self.stuck_before = stuck_so_far(read_events(self.events_path), self.job)
        fields, why = show_job(self.job.job_id)
        end = parse_end(fields.get("EndTime")) if fields else None
        if end is not None:
            self.end_wall = end
            self.end_at = self.clock() + (end - time.time())
        self._measure()
        extra["slurm"] = self.state()
        array = (
            f", array {self.job.array_job_id}_{self.job.array_task_id}"
            if self.job.array_job_id
            else ""
        )
        ends = (
            f"ends {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(end))}"
            if end is not None
            else f"its end is not known ({why or 'no EndTime'})"
        )
        self.event(
            "slurm_job",
            f"Slurm job {self.job.job_id}{array}, allocation attempt "
            f"{self.job.restart_count + 1} (SLURM_RESTART_COUNT {self.job.restart_count}); "
            f"{ends}; warning lead "
            + (f"{self.job.lead} s" if self.job.lead else "not set (no RGT_SLURM_LEAD)"),
            **self.state(),
        )

    def _measure(self) -> None:
        """What the seal needs before the end: twice its own longest recent seal, at least
        the lead; the grace when nothing was measured yet."""
        self.need_at = self.clock()
        seal = measure(read_events(self.events_path))
        base = math.ceil(FACTOR * seal.seconds) if seal.seconds is not None else self.grace
        self.need = float(max(base, self.job.lead or 0))

    def wait(self) -> Optional[float]:
        """Seconds until the loop must ``tick`` for the timer; None when it has nothing to do."""
        if self.warned or self.end_at is None:
            return None
        due = self.end_at - self.need - self.clock()
        return max(0.0, min(due, RECHECK))

    def tick(self, request_stop: Callable[[str, float], None], active: bool) -> None:
        """The timer: start the warning path when the end is nearer than the seal needs."""
        if self.warned or self.end_at is None or not active:
            return
        now = self.clock()
        if self.need_at is None or now - self.need_at >= RECHECK:
            self._measure()
        left = self.end_at - now
        if left <= self.need:
            self.warning(
                request_stop,
                f"rgt's own timer: {left:.0f} s before the time limit, and a seal needs "
                f"{self.need:.0f} s (no USR2 warning came in time)",
            )

    def on_usr2(self, request_stop: Callable[[str, float], None]) -> None:
        self.warning(request_stop, "Slurm's USR2 warning before the time limit")

    def warning(self, request_stop: Callable[[str, float], None], why: str) -> None:
        """Seal now and end PREEMPTED; ``after`` requeues. The budget is the lead, cut to the
        time left before EndTime."""
        if self.warned:
            return
        self.warned = True
        budget = float(self.job.lead or self.grace)
        if self.end_at is not None:
            budget = max(1.0, min(budget, self.end_at - self.clock()))
        self.event(
            "slurm_warning",
            f"{why}: asking the job for a checkpoint, sealing it within {budget:.0f} s, then "
            "requeueing the job",
            budget=budget,
            job_id=self.job.job_id,
        )
        request_stop("preempt", budget)

    def on_term(self) -> None:
        self.termed = True

    def after(
        self,
        final: str,
        extra: Dict[str, Any],
        save: Callable[[], None],
        sealed_now: Optional[int] = None,
        stuck_limit: int = 0,
        stop_asked: Callable[[], bool] = lambda: False,
    ) -> None:
        """Requeue, or say why not, once the run ended (never in a signal handler).
        ``sealed_now``: the run's sealed step now; ``stuck_limit`` ([restart]
        max_stuck_restarts, 0: no limit): that many allocations in a row that sealed nothing
        newer than they began from are not requeued again; ``stop_asked``: whether a stop
        (`rgt-agent stop`) came since the run ended: a stop wins over the requeue."""
        if final == "STOPPED":  # whatever Slurm said meanwhile (a warning during the seal)
            why = "the run was stopped by the user (or its cost cap): STOPPED, its job ends"
            self._not_requeued(why, extra, save)
            return
        if final != "PREEMPTED" or not (self.warned or self.termed):
            return
        self.stuck = self._stuck(sealed_now)
        fields, why = show_job(self.job.job_id)
        if fields is not None and restarts(fields) > self.job.restart_count:
            # Requeued already, before this agent could (`scontrol requeue` by someone, a node
            # failure, a preemption in REQUEUE mode): a second requeue would fail, and "not
            # requeued" would send the user to sbatch a second job for the same run.
            self._requeued(
                f"Slurm requeued job {self.job.job_id} itself (Restarts {restarts(fields)}: "
                "`scontrol requeue`, a node failure or a preemption)",
                extra,
                save,
            )
            return
        if not self.warned and fields is None:
            self.event(
                "slurm_not_requeued",
                f"the job's state could not be read ({why}); not requeued",
                klass="transient",
                remedy=f"requeue it yourself: scontrol requeue {self.job.job_id}",
            )
            return
        ok, why = requeue_decision(fields, self.warned)
        if ok and stop_asked():  # the last moment a stop can still keep the job out
            ok, why = False, "stopped by the user (`rgt-agent stop` came as the run ended)"
        if not ok:
            self._not_requeued(f"{why}; the run stays PREEMPTED", extra, save)
            return
        if stuck_limit and self.stuck >= stuck_limit:
            self._stuck_loop(extra, save)
            return
        self._requeue(why, extra, save)

    def _not_requeued(self, why: str, extra: Dict[str, Any], save: Callable[[], None]) -> None:
        self.requeued = False
        extra["slurm"] = self.state()
        save()
        self.event(
            "slurm_not_requeued",
            why,
            remedy="sbatch the batch script again (or `rgt-agent run` with the same --name) "
            "to continue from the sealed checkpoint",
            job_id=self.job.job_id,
        )

    def _stuck(self, sealed_now: Optional[int]) -> int:
        if not self.has_store:  # nothing to tell progress by
            return 0
        at = self.sealed_at_begin
        progressed = sealed_now is not None and (at is None or sealed_now > at)
        return 0 if progressed else self.stuck_before + 1

    def _stuck_loop(self, extra: Dict[str, Any], save: Callable[[], None]) -> None:
        """Not requeued: allocation after allocation was warned before anything was sealed."""
        self.requeued = False
        extra["slurm"] = self.state()
        save()
        at = self.sealed_at_begin
        self.event(
            "slurm_not_requeued",
            f"{self.stuck} allocation(s) of job {self.job.job_id} in a row sealed nothing newer "
            f"than {'step ' + str(at) if at is not None else 'nothing'}: each was warned before "
            f"its job could checkpoint (its restore and start take longer than the time limit "
            f"less the warning's lead, {self.job.lead or self.grace} s); the run stays PREEMPTED",
            klass="permanent",
            remedy="give the job more time (sbatch --time; rgt deploy --time) or make its "
            "checkpoints quicker to seal (a shorter lead), then sbatch the batch script again: "
            "it resumes from the newest sealed checkpoint ([restart] max_stuck_restarts sets "
            "how many such allocations are requeued)",
            job_id=self.job.job_id,
            stuck=self.stuck,
        )

    def _requeue(self, why: str, extra: Dict[str, Any], save: Callable[[], None]) -> None:
        rc, _, err = run_tool(["scontrol", "requeue", self.job.job_id])
        if rc == 0:
            self._requeued(f"{why}; `scontrol requeue {self.job.job_id}`", extra, save)
            return
        self.requeued = False
        extra["slurm"] = self.state()
        save()
        self.event(
            "slurm_requeue_failed",
            f"{why}, but `scontrol requeue {self.job.job_id}` failed: {err or f'exit {rc}'}",
            klass="transient",
            remedy="the checkpoint is sealed: submit the batch script again (sbatch), or ask "
            "the site whether requeue is allowed (JobRequeue, the partition's policy)",
            job_id=self.job.job_id,
        )

    def _requeued(self, why: str, extra: Dict[str, Any], save: Callable[[], None]) -> None:
        self.requeued = True
        extra["slurm"] = self.state()
        save()
        self.event(
            "slurm_requeued",
            f"{why}: the job goes back to the queue and resumes from the store (allocation "
            f"attempt {self.job.restart_count + 2})",
            job_id=self.job.job_id,
            restart_count=self.job.restart_count,
            stuck=self.stuck,
        )


def stuck_so_far(events: Sequence[Mapping[str, Any]], job: SlurmJob) -> int:
    """How many allocations of ``job`` before this one, in a row, sealed nothing newer than they
    began from: what the previous allocation's requeue said (0 when it said nothing)."""
    for ev in reversed(events):
        if ev.get("kind") == "slurm_requeued" and str(ev.get("job_id")) == job.job_id:
            same = ev.get("restart_count") == job.restart_count - 1
            return int(ev.get("stuck") or 0) if same else 0
    return 0


def watch_for(
    environ: Mapping[str, str], grace: float, events_path: str, event: Event
) -> Optional[SlurmWatch]:
    """A SlurmWatch when this process runs inside a Slurm job, else None."""
    job = SlurmJob.from_env(environ)
    return None if job is None else SlurmWatch(job, grace, events_path, event)
