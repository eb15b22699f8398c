"""status, logs and stop of a run that a Slurm job runs (its record's ``scheduler`` kind is
``slurm``), as controller/observe.py calls them.

The agent's run directory is on the cluster's shared filesystem, so the login node answers for
the agent as for any box (``rgt-agent status N --json``, its logs); Slurm's side is
``scontrol show job`` (controller/slurm/queue.py). Status joins the two: the job's state,
reason, restarts, time limit and time left and node, beside the agent's view; while the job
waits in the queue and no agent has made the run yet, Slurm's side alone. ``logs`` is the
agent's (every attempt, as elsewhere), or the batch job's own output file when no agent ever
started (and says so). ``stop`` asks the agent to stop (it seals, then exits STOPPED, which
ends the batch job without a requeue), then cancels the job if it is still there after the
wait, so that the allocation ends either way.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import IO, Any, Dict, List, Optional, Tuple

from controller import observe
from controller.registry import RunRecord
from controller.remote import Remote, open_remote
from controller.slurm import queue
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import NotFound, RemoteUnreachable, StopFailed, UsageError
from onbox.common.rundir import RunDir
from onbox.common.terminal import printable, printable_lines

MAX_SLURM_LOG = 1 << 20  # bytes of the batch output shown when no agent ever started
# After the agent stopped (or could not be asked), how long the job may take to leave the
# queue before it is cancelled: Slurm's own completion of a finished batch shell.
CANCEL_AFTER = 30.0


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def is_slurm(rec: RunRecord) -> bool:
    return isinstance(rec.scheduler, dict) and rec.scheduler.get("kind") == "slurm"


def _ref(rec: RunRecord) -> str:
    ref = queue.job_ref(rec.scheduler)
    if ref is None:
        raise UsageError(
            "run",
            f"the record of {rec.name!r} names no Slurm job id",
            "deploy it again (`rgt deploy --profile slurm ...`) to submit it",
        )
    return ref


def _job(jobs: List[queue.SlurmJob], ref: str) -> Optional[queue.SlurmJob]:
    """The record of ``ref`` among what scontrol printed (an array task's own line)."""
    job, _, task = ref.partition("_")
    for j in jobs:
        if task and j.array_job == job and j.array_task == task:
            return j
        if not task and j.job == job:
            return j
    return jobs[0] if len(jobs) == 1 else None


def slurm_side(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """The run's Slurm job now: ``{"kind", "ref", "job": {...} | None, "live", "line"}``."""
    ref = _ref(rec)
    job = _job(queue.show(remote, ref), ref)
    return {
        "kind": "slurm",
        "ref": ref,
        "job": job.to_json() if job is not None else None,
        "live": job is not None and job.live,
        "line": queue.describe(job, ref),
    }


def status(rec: RunRecord) -> Tuple[Dict[str, Any], Optional[str]]:
    """(status, why the box was not used): the agent's view joined with Slurm's; the store's
    mirror when the login node does not answer."""
    remote = open_remote(rec.target)
    try:
        side = slurm_side(rec, remote)
        try:
            doc = observe.snapshot(rec, remote)
        except NotFound:  # queued: no agent has made the run's directory yet
            doc = {
                "name": rec.name,
                "state": "PENDING",
                "source": "slurm",
                "agent_started": False,
                "read_at": _now_iso(),
            }
    except RemoteUnreachable as e:
        doc = observe.from_store(rec)
        doc["scheduler"] = {"kind": "slurm", "ref": queue.job_ref(rec.scheduler), "live": None}
        return doc, e.what
    doc["scheduler"] = side
    return doc, None


def first_line(doc: Dict[str, Any]) -> Optional[str]:
    """status's first line while no agent has started (None once one has)."""
    if doc.get("source") != "slurm":
        return None
    side = doc.get("scheduler") or {}
    job = side.get("job") or {}
    state = job.get("state") or "not known to Slurm"
    reason = job.get("reason")
    why = f": {reason}" if reason and reason != "None" else ""
    return (
        f"{doc.get('name')}: Slurm job {side.get('ref')} is {state}{why}; its agent has not "
        f"started yet (read from the login node at {doc.get('read_at')})"
    )


def done(doc: Dict[str, Any]) -> bool:
    """Whether the run has ended: the agent's state is terminal and no job of it is live (a
    PREEMPTED agent whose job Slurm requeued goes on)."""
    side = doc.get("scheduler") or {}
    return str(doc.get("state")) in TERMINAL_NAMES and side.get("live") is False


# $1: the batch output file ("" when Slurm no longer knows it): its last MAX_SLURM_LOG bytes.
_BATCH_LOG = '[ -n "$1" ] && [ -f "$1" ] && exec tail -c ' + str(MAX_SLURM_LOG) + ' -- "$1"\n'


def logs(rec: RunRecord, follow: bool, out: IO[bytes]) -> int:
    """The agent's logs of the run, or the batch job's output while no agent started: one round
    trip once the agent made the run (its spec.json on the shared filesystem), as on any box."""
    spec = RunDir(rec.name, rec.box_home or "/").spec
    if observe.agent_logs(rec, follow, out, made=spec):
        return 0
    remote = open_remote(rec.target)
    ref = _ref(rec)
    job = _job(queue.show(remote, ref), ref)
    stdout = job.stdout if job is not None and job.stdout else ""
    # Its last bytes as the login node cuts them; kept as a tail here too, whatever it sends.
    r = remote.sh(_BATCH_LOG, stdout, timeout=300, limit=MAX_SLURM_LOG, over="tail")
    where = f"its output file {stdout}" if stdout else "Slurm no longer knows its output file"
    sys.stderr.write(  # Slurm's words (the state, the file's name) made printable
        printable(
            f"rgt: no agent of {rec.name} has started yet (Slurm job {ref} "
            f"{job.state if job else 'unknown'}); the batch job's own output, {where}:"
        )
        + "\n"
    )
    sys.stderr.flush()
    out.write(r.stdout)  # the job's bytes, raw as `rgt logs` writes them
    out.flush()
    return 0


def _wait_gone(remote: Remote, ref: str, wait: float) -> Optional[queue.SlurmJob]:
    """The job once it is no longer live, or still live after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        job = _job(queue.show(remote, ref), ref)
        if job is None or not job.live or time.monotonic() > deadline:
            return job
        time.sleep(1.0)


def stop(rec: RunRecord, grace: Optional[str]) -> int:
    """Ask the agent to stop (it seals), then ``scancel`` the job if it is still live after
    CANCEL_AFTER, so that the allocation ends; a job still queued is cancelled at once."""
    remote = open_remote(rec.target)
    ref = _ref(rec)
    job = _job(queue.show(remote, ref), ref)
    rc = 0
    if job is not None and job.state == "RUNNING":
        res = remote.run(
            rec.agent_argv("stop", rec.name, *(["--grace", grace] if grace else [])),
            timeout=900,
            limit=observe.STOP_OUTPUT,
            over="tail",
        )
        sys.stdout.write(printable_lines(res.text))  # the login node's words
        sys.stderr.write(printable_lines(res.err))
        rc = res.rc
        job = _wait_gone(remote, ref, CANCEL_AFTER)
    if job is not None and job.live:
        queue.cancel(remote, ref)
        job = _wait_gone(remote, ref, CANCEL_AFTER)
        print(f"rgt: cancelled Slurm job {ref} (scancel)")
    if job is not None and job.live:
        raise StopFailed(
            f"Slurm job {ref} of {rec.name} is still {job.state} after scancel",
            f"check `scontrol show job {ref}` on {rec.target.label}",
        )
    print(f"rgt: Slurm job {ref} of {rec.name} has ended ({job.state if job else 'gone'})")
    return rc
