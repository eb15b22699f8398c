"""The login node's side of a run whose agent is in a Slurm job: what `rgt-agent stop`, `sync`
and `status` do to that job from any node of the cluster (onbox/agent/slurm.py is the agent's
side, inside the job).

- ``wake_agent``: SIGUSR2 to the agent through slurmctld (``scancel --batch --signal=USR2``),
  where a plain kill cannot reach another node.
- ``cancel_requeued``: a stop that came once the agent (or Slurm) had requeued the job already:
  the run ended PREEMPTED and the job waits in the queue to run it again. A stop that left it
  there would not stop the run, so the requeued job is cancelled (``scancel JOB``), and said.
  A stop that comes any earlier needs none of this: it wins over the requeue in the agent
  (onbox/agent/supervisor.py ``request_stop``, slurm.py ``SlurmWatch.after``).
- ``status_lines``: what `rgt-agent status` says of the job.

Commands are argv lists run with timeouts, never through a shell; a job id is digits only.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

from onbox.agent.slurm import restarts, run_tool, show_job
from onbox.common.errors import StopFailed

# JobState of a job that is over: nothing of it runs again unless someone requeues it.
ENDED = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
)


def _job_id(doc: Mapping[str, Any]) -> str:
    job = doc.get("slurm")
    job_id = str(job.get("job_id") or "") if isinstance(job, dict) else ""
    return job_id if job_id.isdigit() else ""


def wake_agent(doc: Mapping[str, Any]) -> bool:
    """SIGUSR2 to the run's agent from any node of the cluster: the agent is its Slurm job's
    batch shell, which slurmctld signals wherever it runs (``scancel --batch --signal=USR2``).
    For ``rgt-agent stop``/``sync`` on the login node when the agent holds the run from a compute
    node (the request file is on the shared filesystem already). False when the run's state
    (``doc``, state.json) names no Slurm job, or scancel refused."""
    job_id = _job_id(doc)
    if not job_id:
        return False
    rc, _, _ = run_tool(["scancel", "--batch", "--signal=USR2", job_id])
    return rc == 0


def cancel_requeued(doc: Mapping[str, Any]) -> Optional[str]:
    """For a stop of the run whose state is ``doc`` (state.json), over: when it ended PREEMPTED
    and its Slurm job was requeued and still waits (or has started again), ``scancel`` the job
    and return what to tell the user; None when there is no such job. StopFailed when Slurm
    cannot say or refuses: the remedy is the command to run."""
    job = doc.get("slurm")
    job_id = _job_id(doc)
    if doc.get("state") != "PREEMPTED" or not job_id or not isinstance(job, dict):
        return None
    if not job.get("requeued"):
        return None
    fields, why = show_job(job_id)
    if fields is None:
        if why == "no such job":  # gone from slurmctld's memory: ended long ago
            return None
        raise StopFailed(
            f"the run ended PREEMPTED and its Slurm job {job_id} was requeued, to run it again; "
            f"whether the job is still queued cannot be read ({why})",
            f"scancel {job_id} (on a node that reaches slurmctld), so that it does not run again",
        )
    allocation = int(job.get("restart_count") or 0)  # the allocation that ended PREEMPTED
    if fields.get("JobState") in ENDED or restarts(fields) <= allocation:
        return None  # over, or not the requeue this run's state speaks of
    rc, _, err = run_tool(["scancel", job_id])
    if rc != 0:
        raise StopFailed(
            f"the run ended PREEMPTED and its Slurm job {job_id} was requeued, to run it again; "
            f"`scancel {job_id}` failed: {err or f'exit {rc}'}",
            f"scancel {job_id}, so that it does not run again",
        )
    return (
        f"Slurm job {job_id} had been requeued (it was {fields.get('JobState')}) before this stop "
        f"came: cancelled it (scancel {job_id}), so that it does not run the run again; the run "
        "stays PREEMPTED with its newest checkpoint sealed: sbatch the batch script again (or "
        "`rgt-agent run` with the same --name) to continue"
    )


def status_lines(doc: Mapping[str, Any]) -> List[str]:
    """What `rgt-agent status` says of the run's Slurm job (state.json's ``slurm``)."""
    job = doc.get("slurm")
    if not isinstance(job, dict):
        return []
    array = f" (array {job.get('array_job_id')}_{job.get('array_task_id')})"
    requeued = job.get("requeued")
    return [
        f"job {job.get('job_id')}"
        + (array if job.get("array_job_id") else "")
        + f", allocation attempt {int(job.get('restart_count') or 0) + 1}"
        + (", warned before its time limit" if job.get("warned") else "")
        + ("" if requeued is None else ", requeued" if requeued else ", not requeued")
    ]
