"""Whether an attempt that ended (other than by success) restarts: the reasons it does not.

The state machine (onbox/agent/supervisor.py) asks here when an attempt ended, then changes the
state itself from the answer: ``Supervisor._change`` stays the one place the state changes.
These are pure functions of the exit's verdict, the restart policy and the counts the
supervisor keeps; they write nothing (no state.json, no event), so the restart rules read in
one place, apart from the machine's edges and deadlines.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from onbox.agent.classify import Budget, Kind, Verdict
from onbox.agent.spec import RestartPolicy

TAIL_LINES = 8  # lines of the job's last output that end the reason of a failure


def not_restarted(
    verdict: Verdict,
    policy: RestartPolicy,
    *,
    last_cuda_oom_step: Optional[int],
    error_used: int,
    preempt_used: int,
) -> Optional[str]:
    """Why the end is not restarted, whatever the checkpoints did: a health stop, a
    deterministic failure, a CUDA OOM at the step of the last one, a restart budget spent.
    None when it may restart (the crash-loop rule, ``crash_loop``, is asked after)."""
    if verdict.kind == Kind.HEALTH:
        return verdict.reason
    if verdict.deterministic:
        return f"{verdict.reason} (deterministic: not retried)"
    if verdict.kind == Kind.CUDA_OOM and verdict.step == last_cuda_oom_step:
        at = f" at step {verdict.step}" if verdict.step is not None else ""
        return f"CUDA out of memory again{at} (deterministic: not retried)"
    if verdict.budget == Budget.ERROR and error_used >= policy.max_error_restarts:
        return (
            f"{verdict.reason}; error restart budget spent "
            f"({error_used}/{policy.max_error_restarts})"
        )
    if verdict.budget == Budget.PREEMPT and preempt_used >= policy.max_preempt_restarts:
        return (
            f"{verdict.reason}; preemption restart budget spent "
            f"({preempt_used}/{policy.max_preempt_restarts})"
        )
    return None


def crash_loop(
    verdict: Verdict,
    limit: int,
    sealed_step: Callable[[], Optional[int]],
    sealed_at_start: Optional[int],
    stuck: int,
) -> Tuple[int, Optional[str]]:
    """The crash-loop rule for an error end of a run with a store (``limit`` 0: no rule).

    ``stuck`` counts the error ends in a row after which the sealed checkpoint (``sealed_step``
    now, ``sealed_at_start`` when the attempt started) did not advance. Returns that count
    after this end, and None to restart, else why the run stops."""
    if not limit:
        return stuck, None
    now = sealed_step()
    if now is not None and (sealed_at_start is None or now > sealed_at_start):
        return 0, None
    stuck += 1
    if stuck <= limit:
        return stuck, None
    at = f"step {now}" if now is not None else "nothing sealed"
    return stuck, (
        f"crash loop: {stuck - 1} restarts in a row and the sealed checkpoint "
        f"did not advance ({at}); last end: {verdict.reason}"
    )


def with_tail(failure: str, tail: str) -> str:
    """A failure's reason with the last TAIL_LINES non-blank lines of the job's output."""
    lines = [ln for ln in tail.splitlines() if ln.strip()][-TAIL_LINES:]
    if lines:
        failure += " | last output: " + " / ".join(ln.strip() for ln in lines)
    return failure
