"""Sealing inside the agent: when it runs, at what priority, and what happens at the edges.

``SealService`` is the agent's ``Hooks``. At agent start it takes a new epoch in the store (an
agent that adopts a run takes none when another box took the run over: onbox/agent/ownership.py;
it then writes nothing to the store), aborts uploads a dead agent left half-done, and (for a new
incarnation) restores the newest verified checkpoint onto a box that lacks it. Then a
background thread, at lower CPU and IO priority than the job, seals new complete checkpoints as
they appear (a periodic scan), asks the job to checkpoint on its declared trigger every
``checkpoint.interval`` (``"auto"``: what onbox/agent/interval.py recomputes after each pass
from the run's history), and mirrors the run's state and events to the store while this agent
owns the run (onbox/agent/mirror.py). On preemption it asks the job for a final checkpoint and
seals it only if the measured throughput says it fits in the budget; on success it runs the
completion seal (onbox/agent/completion.py: the last checkpoints, results, outputs, logs, then
DONE.json); when a run ends FAILED or STOPPED, its job's logs, then its epoch's log document
and ENDED.json (onbox/agent/endlogs.py), as the agent lets go of it; when it is preempted, the
logs and the log document with what is left of the grace after the final checkpoint.

Nothing leaves the box with a secret in it unnoticed: the mirror of state and events goes
through the redactor (onbox/common/redact.py), and the completion seal seals a job's log that
holds a secret as a redacted copy. A run without a store gets the same for ``rgt pull --from
box`` when its agent lets go of it (``redact_box_logs``, onbox/agent/logredact.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from onbox.agent import freeze
from onbox.agent.budgetseal import seal_in_budget
from onbox.agent.ckptwatch import watch
from onbox.agent.completion import Completion
from onbox.agent.endlogs import checkpoint_not_asked, logs_at_end, logs_in_grace, seal_cut
from onbox.agent.interval import AutoInterval
from onbox.agent.journal import FileJournal
from onbox.agent.meter import final_seal
from onbox.agent.mirror import StateMirror
from onbox.agent.seams import Hooks
from onbox.agent.spec import JobSpec
from onbox.agent.takeup import take_up
from onbox.common.errors import StoreError, event_class
from onbox.common.libc import lower_thread_priority
from onbox.common.rundir import RunDir
from onbox.health.verdict import SealView
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import newest_local_step
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_box_store
from onbox.sealing.stores.base import Store

# Seconds kept in hand at the end of a preemption budget for the final records and the exit.
MARGIN = 1.0


HEALTH_MIRROR_EVERY = 60.0  # seconds between mirrors of the health samples
SKEW_EVERY = 600.0  # seconds between readings of the store's clock


class SealService(Hooks):
    """The agent's sealing: one per agent process, for a run with a store."""

    def __init__(
        self, spec: JobSpec, rd: RunDir, journal: FileJournal, signal_job: Callable[[int], None]
    ) -> None:
        assert spec.store is not None
        self.spec = spec
        self.rd = rd
        self.journal = journal
        self.signal_job = signal_job
        self.store: Store = open_box_store(spec.store, spec.name)
        self.sealer: Optional[Sealer] = None
        self.restored: Optional[Dict[str, Any]] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._asked_at = time.monotonic()
        self._ask_lock = threading.Lock()
        self._stopping = False  # a stop or preemption has begun (on_stop_requested)
        self.auto: Optional[AutoInterval] = None  # checkpoint.interval = "auto"
        self._mirror = StateMirror(spec.name, rd, self.store)
        self._observer: Any = None
        self._sync_request: Optional[str] = None
        # Warnings for status (state.json's ``warnings``): the agent puts this very list into
        # the supervisor's state document, so what is appended here is in the next save.
        self.warnings: List[Dict[str, Any]] = []
        # The meter cap (onbox/agent/meter.py) waits while a pass is ``sealing``; once it has
        # ``capped`` the run, the stop's final seal takes what it needs and is checked.
        self.sealing = False
        self.capped = False
        self.superseded = False  # found at start: another box took the run over (ownership.py)
        # A preemption sealed the job's logs within its grace (endlogs.py ``logs_in_grace``): the
        # warnings may have changed (a log held a secret), for close() to say.
        self.logs_sealed = False
        self.final_verified = False
        self._grace_end: Optional[float] = None  # a preemption's (monotonic): ``_within``
        self._mirror_said = False  # a mirror of the letting go gave up, and it was said
        # Where the job's workdir is seen (the runner's workdir_root; a pod's is the job
        # container's /proc/PID/root): the completion seal reads the outputs there.
        self.workdir_root: Callable[[], Optional[str]] = lambda: ""
        # What the health probes read (onbox/health/verdict.py SealView), set by the thread.
        self.last_ok_wall: Optional[float] = None
        self.last_error: Optional[str] = None
        self.last_error_wall: Optional[float] = None
        self.backlog: Optional[int] = None
        # The disk probe asks for room (delete local copies already verified in the store).
        self.room_wanted = False
        # A training signal stopped the run (a NaN loss): nothing newer than this step is
        # sealed from now on, so the last good checkpoint stays LATEST.
        self.frozen_above: Optional[int] = None
        self._health_mirrored = 0.0
        self.skew: Optional[float] = None  # the store's clock minus ours (SealView.skew)
        self._skew_at: Optional[float] = None
        # The step start() is at, for the reason of a beginning that fails (restore_failed).
        self.doing = ""
        self.phase = "stopping between two passes"  # where the thread is, for seal_cut

    def event(
        self, kind: str, reason: str, *, klass: Optional[str] = None, remedy: str = "", **data: Any
    ) -> None:
        self.journal.event(kind, reason, klass=klass, remedy=remedy, **data)

    # ---- start
    def start(self, begin: bool, adopting: bool = False) -> None:
        """Epoch, stale uploads, restore (``begin``: a new incarnation), then the thread. An
        ``adopting`` agent whose run another box took over starts none of it (``superseded``).
        A call to a ``file://`` store that does not return for ``[store] stall`` (a hung mount;
        S3's have their timeouts) fails the beginning as a transient store error, as a download
        that moves nothing does (onbox/sealing/stores/hangbound.py). A run frozen by a NaN loss
        stays frozen for an agent that takes it up again; a new incarnation lifts the freeze,
        setting aside what the job wrote after it (freeze.py)."""
        if begin:
            self.doing = freeze.LIFTING
            freeze.lift(self.rd, self.spec.ckpt_dir, self.event)
        else:
            frozen = freeze.read(self.rd)
            self.frozen_above = None if frozen is None else frozen["above"]
        with self.store.calls_bounded(self.spec.restore_stall):
            if not take_up(self, begin, adopting):
                return
        # For good: the thread's calls (a StoreHung is a seal_error, retried) and the letting
        # go's never wait on a hung store for ever (hangbound.py; its uploads, on movement).
        self.store.bound_calls(self.spec.restore_stall)
        self._thread = threading.Thread(target=self._loop, name="rgt-sealer", daemon=True)
        self._thread.start()
        self._observer = watch(self.spec.ckpt_dir, self._wake, self.spec.scan_interval, self.event)

    def resume_from(self) -> str:
        """RGT_RESUME_FROM for the next attempt: the restored checkpoint, or ''.

        Only while it is still the newest complete checkpoint on the box: after the job wrote
        a newer one, a restart must not send it back to the step this incarnation began at
        (with '' the job resumes from its own newest, as after any restart)."""
        if self.restored is None or not os.path.exists(self.restored["local"]):
            return ""
        newest = newest_local_step(self.spec.ckpt_dir)
        if newest is not None and newest > self.restored["step"]:
            return ""
        return str(self.restored["local"])

    def done(self) -> Optional[Dict[str, Any]]:
        data = self.store.get_bytes(mf.done_key(self.spec.name))
        return json.loads(data) if data else None

    # ---- the background thread
    def wake(self) -> None:
        self._wake.set()

    def sync_soon(self, request: str) -> None:
        """`rgt-agent sync`: seal now; ``request`` is removed once all is sealed."""
        self._sync_request = request
        self._wake.set()

    def _loop(self) -> None:
        lower_thread_priority()
        backoff = 0.0
        while not self._stop.is_set():
            self._wake.wait(max(self.spec.scan_interval, backoff))
            self._wake.clear()
            if self._stop.is_set():
                break
            # A sync asked before this pass began is answered once the pass is done.
            request = self._sync_request
            self.sealing = True
            self.phase = "still asking the job for a checkpoint"
            try:
                self._ask_on_timer()
                assert self.sealer is not None
                if self.frozen_above is None:
                    self.phase = "still sealing a checkpoint (listing, uploading or recording it)"
                    self.sealer.seal_pending()
                    self.backlog = self.sealer.backlog
                self.phase = "still reading the run's history or freeing room on the box"
                if self.auto is not None:  # after each seal and each restart: a new interval
                    self.auto.tick(time.time())
                if self.room_wanted:
                    self.room_wanted = False
                    self.sealer.free_room()
                due = time.monotonic() - self._health_mirrored >= HEALTH_MIRROR_EVERY
                self.phase = "still mirroring the run's state to the store"
                self.mirror(health=due)
                if due:
                    self._health_mirrored = time.monotonic()
                self.last_ok_wall, self.last_error = time.time(), None
                self.phase = "still reading the store's clock"
                self._measure_skew()
                backoff = 0.0
                if request is not None:
                    if self._sync_request == request:
                        self._sync_request = None
                    try:
                        os.unlink(request)
                    except FileNotFoundError:
                        pass
            except StoreError as e:
                backoff = min(300.0, max(2.0, backoff * 2))
                self.last_error, self.last_error_wall = e.what, time.time()
                self.event(
                    "seal_error",
                    f"{e.what}; retrying in {backoff:.0f}s",
                    klass=event_class(e),
                    remedy=e.remedy or "the checkpoints stay on the box meanwhile",
                )
            except Exception as e:  # a bug must not kill sealing for the rest of the run
                backoff = min(300.0, max(5.0, backoff * 2))
                self.event(
                    "seal_bug",
                    f"{type(e).__name__}: {e}",
                    klass="permanent",
                    remedy="report this; sealing retries",
                )
            finally:
                self.sealing, self.phase = False, "stopping between two passes"

    def interval(self) -> Optional[float]:
        """The checkpoint interval in force: auto's latest, the job file's, or None."""
        return self.auto.seconds if self.auto is not None else self.spec.ckpt_interval

    def _ask_on_timer(self) -> None:
        every = self.interval()
        if every is None:
            return
        # Under the stop hook's lock: all before a stop's ask, or not made (one after a
        # preemption's replaced the job's request and made its covered stop count as lost).
        with self._ask_lock:
            if self._stopping or time.monotonic() - self._asked_at < every:
                return
            self._asked_at = time.monotonic()
            self.ask_job("timer")

    # ---- for the health probes (onbox/health/)
    def sealed_step(self) -> Optional[int]:
        return self.sealer.latest if self.sealer is not None else None

    def view(self) -> SealView:
        """The pipeline as the sealing probe sees it: LATEST and when it was sealed, the
        last pass that reached the store, the last error."""
        sealer = self.sealer
        latest = sealer.latest if sealer is not None else None
        doc = sealer.manifests.get(latest) if sealer is not None and latest is not None else None
        return SealView(
            latest_step=latest,
            latest_wall=doc.get("created") if doc else None,
            backlog=self.backlog,
            last_ok_wall=self.last_ok_wall,
            last_error=self.last_error,
            last_error_wall=self.last_error_wall,
            skew=self.skew,
            ckpt_bytes=sum(int(f.get("size", 0)) for f in doc.get("files", [])) if doc else None,
            interval=self.interval(),
        )

    def _measure_skew(self) -> None:
        """The store's clock against the box's, every SKEW_EVERY (a clock minutes off makes
        a box's times lie: the sealing probe warns)."""
        now = time.monotonic()
        if self._skew_at is not None and now - self._skew_at < SKEW_EVERY:
            return
        self._skew_at = now
        self.skew = self.store.clock_skew()

    def want_room(self) -> None:
        self.room_wanted = True
        self._wake.set()

    def freeze(self, keep_step: Optional[int], reason: str = "", remedy: str = "") -> None:
        """Seal nothing newer from now on (a NaN loss stopped the run at ``keep_step``): on
        disk too, for an agent respawned meanwhile and for `rgt-agent sync` (freeze.py)."""
        self.frozen_above = -1 if keep_step is None else keep_step
        freeze.write(self.rd, self.frozen_above, reason, remedy)

    def ask_job(self, why: str) -> None:
        """Ask the job for a checkpoint the way it declared."""
        trigger = self.spec.trigger
        if trigger == "file":
            with open(self.rd.checkpoint_request, "w") as f:
                f.write(json.dumps({"why": why, "at": time.time()}))
        elif trigger.startswith("signal:"):
            self.signal_job(int(getattr(signal, "SIG" + trigger.split(":", 1)[1])))
        else:
            return
        self.event(
            "checkpoint_asked", f"asked the job for a checkpoint ({why}, {trigger})", why=why
        )

    def mirror(self, health: bool = False) -> None:
        """The run's state and events in the store, so status is readable without the box;
        with ``health``, the health samples too (megabytes: once a minute, and when the agent
        leaves, never inside a preemption's budget). Only while this agent owns the run: the
        store's epochs are listed afresh before anything is put."""
        events = self.auto is None or self.auto.settled  # else the store's copy is the history
        self._mirror.write(self.sealer, events=events, health=health)

    def _stop_thread(self, deadline: Optional[float]) -> bool:
        """Stop the thread; True when it finished its current seal before ``deadline``."""
        if self._observer is not None:
            self._observer.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left)
        return not self._thread.is_alive()

    @property
    def elsewhere(self) -> bool:
        """Another box's agent owns the run in the store: nothing of this one is sealed again."""
        return self.superseded or (self.sealer is not None and self.sealer.stale)

    # ---- hooks
    def on_stop_requested(self, reason: str, deadline: float) -> None:
        with self._ask_lock:
            self._stopping = True  # no timer ask from here on: the job is being stopped
        if reason != "preempt":
            return
        if deadline - MARGIN <= time.monotonic():
            return checkpoint_not_asked(self)  # no budget to seal anything (grace 0)
        self.ask_job("preemption")

    def before_terminal(self, reason: str, deadline: float) -> None:
        sealer = self.sealer
        if sealer is None:
            return
        if reason == "success":
            self._stop_thread(None)
            Completion(
                self.spec,
                self.rd,
                self.store,
                sealer,
                event=self.event,
                warnings=self.warnings,
                mirror=self.mirror,
                root=self.workdir_root(),
            ).run_said(self._said)
            return
        if reason == "superseded":  # nothing of this agent may be sealed now (loop.py)
            self._stop_thread(deadline - MARGIN)
            return
        frozen = self.frozen_above is not None  # a NaN loss: no final seal either (below)
        if reason == "stop" and self.capped and not frozen:  # the cap: no budget, checked
            self._stop_thread(None)
            self.final_verified = final_seal(
                sealer, self.store, self.spec.name, self.spec.ckpt_dir, self.event
            )
            self.mirror_quietly()
            return
        budget_end = deadline - MARGIN
        # A preemption's store calls end within its grace (a stop's within [store] stall).
        until = budget_end if reason == "preempt" else None
        self._grace_end = deadline if reason == "preempt" else None
        if not self._stop_thread(budget_end):
            return seal_cut(self, reason)
        try:
            # A run frozen by a NaN loss (its attempt being ended when the stop or preemption
            # came) seals no final checkpoint: it would be LATEST, written after the NaN.
            with self.store.calls_bounded(self._within(until)):
                sealed = not frozen and seal_in_budget(
                    sealer, self.spec.ckpt_dir, reason, budget_end, self.event
                )
        except StoreError as e:
            # Said, not raised: the run must still end STOPPED or PREEMPTED with its state
            # written (an agent that died here left it STOPPING, its job already gone).
            self._said(e, "the checkpoints stay on the box; the next start seals them")
            sealed = False
        if sealed:
            self.mirror_quietly(until=until)
        if reason == "preempt":  # the final checkpoint first; what is left of the grace, logs
            logs_in_grace(self, budget_end)

    def close(self, ended: str = "") -> bool:
        """The agent is leaving: the thread stops between two seals, never in the middle of
        writing a document. A run that FAILED still gets its checkpoints sealed first; one
        that ``ended`` FAILED or STOPPED then gets its job's logs sealed (onbox/agent/
        endlogs.py). True when ``warnings`` may have changed (a log held a secret)."""
        if self._thread is None:
            return False
        stopped = self._stop.is_set()
        # Past a grace the thread gets the final mirror's margin to end its pass (a SIGTERM
        # just after a seal finds it about to mirror), or the store's state is left older.
        if not self._stop_thread(
            None if self._grace_end is None else self._grace_end + self._margin
        ):
            return self.logs_sealed  # a preemption's seal_cut said it: the grace is over
        # A frozen run (a NaN loss) leaves its newer checkpoints unsealed: LATEST stays good.
        if not stopped and self.sealer is not None and self.frozen_above is None:
            try:
                self.sealer.seal_pending()
            except StoreError as e:
                self._said(e, "the checkpoints stay on the box; the next start seals them")
        changed = self.sealer is not None and logs_at_end(self, ended)
        self.mirror_quietly(health=True, final=True)
        return changed or self.logs_sealed

    @property
    def _margin(self) -> float:
        """How long past a grace the letting go may mirror the final state."""
        return min(MARGIN, self.spec.restore_stall)

    def _within(self, until: Optional[float]) -> float:
        """The bound of a store call of the letting go: ``[store] stall``, and never past
        ``until`` (monotonic; a preemption's grace when before_terminal set it)."""
        until = self._grace_end if until is None else until
        bound = self.spec.restore_stall
        return bound if until is None else max(0.0, min(bound, until - time.monotonic()))

    def mirror_quietly(
        self, health: bool = False, until: Optional[float] = None, final: bool = False
    ) -> None:
        """The mirror as the agent lets go of the run, each store call bounded (``_within``; in
        a preemption no health samples, and none once the grace is over but the ``final``
        state's, given MARGIN: past a grace of 0 too, the store's copy, what `rgt status` reads
        once the box is gone, says PREEMPTED where the store answers; a SIGKILL meanwhile cuts
        no document, each put whole or not at all); a store that gives up said once
        (seal_error), never raised: the agent must still let go of the run."""
        health = health and self._grace_end is None
        bound = self._within(until)
        if final and self._grace_end is not None:
            bound = max(bound, self._margin)
        if bound <= 0:
            return
        try:
            with self.store.calls_bounded(bound):
                self.mirror(health=health)
        except StoreError as e:
            if not self._mirror_said:
                self._mirror_said = True
                keep = "the run's state and events stay on the box, where `rgt status` reads them"
                self._said(e, keep, "the run's state was not mirrored to the store: ")

    def _said(self, e: StoreError, keep: str, what: str = "") -> None:
        """A store error of the letting go, said (seal_error): its remedy, then ``keep``."""
        remedy = (e.remedy + "; " if e.remedy else "") + keep
        self.event("seal_error", what + e.what, klass=event_class(e), remedy=remedy)
