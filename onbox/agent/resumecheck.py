"""The resume contract check: a job restarted after a checkpoint at step S must report S or more.

rgt restores checkpoints and restarts the job, but only the job can load one. A script that
ignores RGT_RESUME_FROM (or its own newest checkpoint) starts again from step 0 and nothing
fails: it silently trains the same steps twice. The job reports its step through the progress
file (``onbox.common.progress``, which the training API writes) or its output (``progress.pattern``
in
the job file). For each attempt that should resume, the first step it reports is compared with
S, once: below S is a ``resume_mismatch`` event (class usage), else a quiet ``resumed`` event.

S is taken when the attempt starts: the largest of the step of the checkpoint restored into
RGT_RESUME_FROM, LATEST in the store, and the newest complete checkpoint on the local disk (which
also covers one the last attempt wrote just before it died, not sealed yet; complete as the
sealer sees it: ``onbox.sealing.discovery.newest_local_step``). The first attempt of
a run is checked only when a checkpoint was restored for it; S unknown or 0 means no check.

The agent calls ``poll`` from its loop: each call reads the progress file and at most
``READ_BYTES`` more of the attempt's output, so the check never holds supervision up.
``advance`` is that wiring: it takes S's inputs from the agent's sealing and keeps the check's
document in the supervisor's state, so an agent that takes over goes on from there.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from onbox.common import progress
from onbox.common.logscan import LogScanner
from onbox.common.progress import compile_progress_pattern
from onbox.common.rundir import RunDir
from onbox.sealing.discovery import newest_local_step

if TYPE_CHECKING:
    from onbox.agent.sealservice import SealService
    from onbox.agent.supervisor import Supervisor

READ_BYTES = 256 << 10  # of the job's output per poll
FINAL_BYTES = 4 << 20  # read at once when the attempt is over
POLL_FAST = 0.5  # seconds between polls early in an attempt, when the first report comes
POLL_SLOW = 2.0
FAST_FOR = 120.0


class ResumeCheck:
    """The check for the current attempt; ``to_doc`` and ``doc`` carry it across agents."""

    def __init__(
        self,
        rd: RunDir,
        ckpt_dir: str,
        pattern: Optional[str],
        event: Callable[..., None],
        doc: Optional[Dict[str, Any]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rd = rd
        self.ckpt_dir = ckpt_dir
        self.rx = compile_progress_pattern(pattern) if pattern else None
        self.event = event
        self.clock = clock
        d = doc or {}
        self.attempt: int = int(d.get("attempt", 0))
        self.resume_step: Optional[int] = d.get("resume_step")
        self.resume_from: str = d.get("resume_from", "")
        self.restored_step: Optional[int] = d.get("restored_step")
        self.pending: bool = bool(d.get("pending", False))
        self.verdict: Optional[str] = d.get("verdict")
        self.reported_step: Optional[int] = d.get("reported_step")
        self._began = clock()  # an adopted check polls fast again: its attempt may be young
        self._scanner = LogScanner(self.rx) if self.rx is not None else None

    def to_doc(self) -> Dict[str, Any]:
        return {
            "attempt": self.attempt,
            "resume_step": self.resume_step,
            "resume_from": self.resume_from,
            "restored_step": self.restored_step,
            "pending": self.pending,
            "verdict": self.verdict,
            "reported_step": self.reported_step,
        }

    # ---- attempts
    def begin(
        self,
        attempt: int,
        *,
        resume_from: str = "",
        restored_step: Optional[int] = None,
        latest_step: Optional[int] = None,
    ) -> None:
        """Attempt ``attempt`` has just started with RGT_RESUME_FROM = ``resume_from`` (the
        checkpoint of ``restored_step``); ``latest_step`` is LATEST in the store, if any."""
        if self.pending:
            self.finish()  # the previous attempt's output is complete now
        restored = restored_step if resume_from else None
        known: List[int] = []
        if attempt > 1 or restored is not None:  # a run's first attempt resumes only a restore
            local = newest_local_step(self.ckpt_dir)
            known = [s for s in (restored, latest_step, local) if s is not None]
        self.attempt = attempt
        self.resume_from = resume_from if restored is not None else ""
        self.restored_step = restored
        self.resume_step = max(known) if known else None
        self.pending = bool(self.resume_step)  # S unknown or 0: nothing to check
        self.verdict = self.reported_step = None
        self._began = self.clock()
        self._scanner = LogScanner(self.rx) if self.rx is not None else None

    def skip(self, attempt: int) -> None:
        """Attempt ``attempt`` began under an agent that left no record of S: not checked."""
        if self.attempt != attempt:
            self.attempt, self.pending, self.resume_step = attempt, False, None

    def next_wakeup(self) -> Optional[float]:
        """Seconds until the next poll; None when there is nothing to check."""
        if not self.pending:
            return None
        return POLL_FAST if self.clock() - self._began < FAST_FOR else POLL_SLOW

    def poll(self, final: bool = False) -> bool:
        """Look for the attempt's first report; True when the check concluded now."""
        if not self.pending:
            return False
        found: Optional[Tuple[int, str]] = None
        if self._scanner is not None:
            budget = FINAL_BYTES if final else READ_BYTES
            step = self._scanner.scan(self.rd.output_log(self.attempt), budget, final)
            if step is not None:
                found = (step, "log")
        if found is None:
            rep = progress.read(self.rd.path)
            if rep is not None and rep.get("attempt") == self.attempt:
                found = (int(rep["step"]), "progress")
        if found is None:
            if final:
                self.pending = False  # the attempt ended without reporting a step
            return False
        self._conclude(*found)
        return True

    def finish(self) -> bool:
        """The attempt is over: one last, larger read; the check ends either way."""
        return self.poll(final=True)

    def _conclude(self, step: int, source: str) -> None:
        s = self.resume_step
        assert s is not None
        self.pending = False
        self.reported_step = step
        how = "its progress file" if source == "progress" else "its output (progress.pattern)"
        data: Dict[str, Any] = {
            "attempt": self.attempt,
            "resume_step": s,
            "reported_step": step,
            "source": source,
            "resume_from": self.resume_from,
        }
        if step >= s:
            self.verdict = "resumed"
            self.event(
                "resumed",
                f"attempt {self.attempt} resumed: the job reports step {step} in {how}, "
                f"the checkpoint was at step {s}",
                **data,
            )
            return
        self.verdict = "mismatch"
        if self.resume_from and self.restored_step == s:
            reason = (
                f"attempt {self.attempt} resumed from step {s} but the job reports step "
                f"{step} in {how}: is it loading RGT_RESUME_FROM?"
            )
            remedy = (
                f"load the checkpoint RGT_RESUME_FROM names ({self.resume_from}) before "
                "training, or use the training API (onbox.train), which does; otherwise the "
                "steps already trained are trained again"
            )
        else:
            reason = (
                f"attempt {self.attempt} restarted after a checkpoint at step {s} but the job "
                f"reports step {step} in {how}: is it loading its newest checkpoint?"
            )
            remedy = (
                "on a restart, load the newest checkpoint in RGT_CKPT_DIR (RGT_RESUME_FROM "
                "names one only after a restore from the store), or use the training API "
                "(onbox.train), which does; otherwise the steps already trained are trained again"
            )
        self.event("resume_mismatch", reason, klass="usage", remedy=remedy, **data)


def advance(
    check: ResumeCheck,
    sup: Supervisor,
    seal: Optional[SealService],
    event: Callable[..., None],
    final: bool = False,
    resume_from: Optional[str] = None,
) -> bool:
    """Move the agent's check on: begin it for an attempt being spawned (``resume_from``, its
    RGT_RESUME_FROM), else look a little further for the attempt's first reported step
    (``final``: the attempt is over). False when a bug in the check turned it off (one
    ``resume_check_bug`` event): the agent drops it and supervises on without it."""
    before = check.to_doc()
    at_spawn = resume_from is not None
    try:
        if at_spawn or sup.attempt > check.attempt:
            if resume_from is None:  # not begun at the spawn (cannot happen; be safe)
                resume_from = seal.resume_from() if seal is not None else ""
            restored = seal.restored if seal is not None else None
            check.begin(
                sup.attempt,
                resume_from=resume_from,
                restored_step=restored["step"] if restored else None,
                latest_step=seal.sealer.latest if seal and seal.sealer else None,
            )
        elif final:
            check.finish()
        else:
            check.poll()
    except Exception as e:  # advisory: a bug here must never stop the supervision
        event(
            "resume_check_bug",
            f"{type(e).__name__}: {e}; the resume check is off for this agent",
            klass="permanent",
            remedy="report this; supervision goes on",
        )
        return False
    doc = check.to_doc()
    if doc != before:  # begun or concluded: an agent that takes over goes on from here
        sup.extra["resume_check"] = doc
        if not at_spawn:  # at a spawn, the supervisor saves right after it
            sup.save()
    return True
