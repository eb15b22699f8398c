"""The agent: one per run, holding its lock, driving the Supervisor from real events.

``python -m onbox.agent.loop NAME --lock-fd N [--ready-fd N] [--adopt-only]`` is the daemon that
``rgt-agent start`` detaches (and that a shim starts again when the agent died). The foreground
``rgt-agent run`` and a ``rgt-agent stop`` that finds no agent use the same ``Agent`` in-process.

Signals: SIGTERM is a preemption (ends PREEMPTED within the grace budget); SIGINT is a stop;
SIGUSR2 means "read stop.request"; SIGHUP is ignored (sessions come and go). Inside a Slurm job
(``rgt-agent run``; onbox/agent/slurm.py) a SIGUSR2 with no request file is Slurm's warning.
They are taken from the start of ``prepare``: a SIGTERM or SIGINT during the epoch and restore
cuts them short (onbox/agent/beginning.py ``Interrupted``), and the run ends PREEMPTED (or
STOPPED) before its first attempt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, TextIO, Tuple, cast

from onbox.agent import freeze, healthuse, procfs
from onbox.agent.beginning import (
    Interrupted,
    begin_failure,
    fallback_warning,
    forget_unbegun,
    tell_interrupted,
)
from onbox.agent.boot import install_hook, take_from_boot
from onbox.agent.daemon import TAG_VAR, agent_argv, parse_agent_args
from onbox.agent.detach import ReadyPipe
from onbox.agent.journal import FileJournal, log
from onbox.agent.letgo import left_unended, let_go
from onbox.agent.lock import RunLock
from onbox.agent.meter import MeterCap
from onbox.agent.notice import NoticeWatcher, watcher_for
from onbox.agent.resumecheck import ResumeCheck, advance
from onbox.agent.runner import ShimRunner
from onbox.agent.sealservice import SealService
from onbox.agent.seams import Clock, Hooks, RealClock
from onbox.agent.slurm import SlurmWatch
from onbox.agent.spec import JobSpec
from onbox.agent.states import TERMINAL, State
from onbox.agent.supervisor import Supervisor
from onbox.agent.title import set_title
from onbox.common import redact
from onbox.common.durable import read_json
from onbox.common.errors import RgtError, StoreError, UsageError, event_class
from onbox.common.rundir import RunDir, drop_secrets

if TYPE_CHECKING:
    from onbox.health.notify import Notifier


class Agent:
    """Supervises one run until it reaches a terminal state."""

    runner_class = ShimRunner  # rgt-agent run --pod: onbox/agent/podrunner.py PodRunner

    def __init__(
        self,
        rd: RunDir,
        lock: RunLock,
        *,
        clock: Optional[Clock] = None,
        hooks: Optional[Hooks] = None,
    ) -> None:
        self.rd = rd
        self.lock = lock
        doc = read_json(rd.spec)
        if doc is None:
            raise SystemExit(f"rgt agent: {rd.spec} is missing")
        self.spec = JobSpec.from_json(doc)
        self.journal = FileJournal(rd.state, rd.events, rd.agent_log)
        self.notifier: Optional[Notifier] = None  # Apprise URLs and the dead-man's switch
        if self.spec.health.notify.urls or self.spec.health.notify.deadman:
            # Imported only here: urllib, ssl and logging cost an agent without them ~4 MiB.
            from onbox.health.notify import Notifier

            self.notifier = Notifier(self.spec.health.notify, rd.name, self.journal.event)
            self.journal.listeners.append(self.notifier.listen)
        argv, delay = agent_argv(rd.name), float(os.environ.get("RGT_AGENT_RESPAWN_DELAY", "3"))
        self.runner = self.runner_class(
            rd, self.spec, agent_cmd=argv, base_environ=os.environ, respawn_delay=delay
        )
        state_doc = read_json(rd.state)
        self.fresh = state_doc is None
        self.seal: Optional[SealService] = None
        if self.spec.store:
            self.seal = SealService(self.spec, rd, self.journal, self.runner.signal_job)
            self.seal.workdir_root = self.runner.workdir_root  # a pod's outputs: another fs
            hooks = self.seal
        self.runner.resume_from = self._resume_from
        self.runner.event = self.journal.event  # the proxy hook's events
        self.sup = Supervisor(
            self.spec, self.runner, clock or RealClock(), self.journal, hooks=hooks, doc=state_doc
        )
        self.sup.extra["agent"] = {"pid": os.getpid(), "host": os.uname().nodename}
        self.sup.mailbox = self.check_stop_request
        # status's ``warnings`` (a job's log held a secret): kept across agents of the run. The
        # supervisor's state document holds this very list, so what is appended is saved.
        self.warnings: List[Dict[str, Any]] = list((state_doc or {}).get("warnings") or [])
        self.sup.extra["warnings"] = self.warnings
        if self.seal is not None:
            self.seal.warnings = self.warnings
        # The meter cap (onbox/agent/meter.py); a stop it began goes on under this agent.
        self.meter = MeterCap.resume(self.spec.deadline, state_doc)
        if self.meter.stopping:
            self.sup.extra["meter_cap"] = {"deadline": self.spec.deadline}
            if self.seal is not None:
                self.seal.capped = True
        self.check: Optional[ResumeCheck] = None
        try:
            self.check = ResumeCheck(
                rd,
                self.spec.ckpt_dir,
                self.spec.progress_pattern,
                self.journal.event,
                doc=(state_doc or {}).get("resume_check"),
            )
        except UsageError as e:  # a spec.json edited by hand: supervise without the check
            log(rd.agent_log, f"resume check off: {e}")
        self.adopted = False
        self.cut: Optional[str] = None  # the state a signal that cut the beginning ends it in
        self.journal.listeners.append(self._wake_on_takeover)
        self.notice: Optional[NoticeWatcher] = None  # the platform's preemption notice
        self.health: Optional[healthuse.AgentHealth] = None  # the probes (onbox/health/)
        self._pending: List[int] = []
        self._interruptible = False  # a SIGTERM or SIGINT now raises Interrupted (_on_signal)
        self._wake_r = self._wake_w = -1
        self.slurm: Optional[SlurmWatch] = None  # set by `rgt-agent run` inside a Slurm job
        # The agent of a `start`: a new run it cannot begin goes from the box (forget_unbegun),
        # as its deploy keeps no record of it. Not `rgt-agent run`'s (a Slurm or Kubernetes
        # job, which its scheduler and the laptop's record follow), nor a respawned agent's.
        self.unbegun_goes = False

    # ---- deciding what to do with the run as found
    def prepare(self, may_begin: bool) -> bool:
        """Adopt a live run, or (when ``may_begin``) begin a new incarnation of an ended one.

        Returns False when there is nothing to supervise.
        """
        sup = self.sup
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):  # kept for run()
            signal.signal(sig, self._on_signal)
        # `rgt-agent boot` started this agent after a power-on: restore as a beginning does.
        from_boot = take_from_boot(self.rd)
        if from_boot:
            self.journal.event("boot", "started again by `rgt-agent boot` after a power-on")
        if self.fresh or sup.state in TERMINAL:
            if not may_begin:
                return False
            try:
                os.unlink(self.rd.stop_request)
            except FileNotFoundError:
                pass
            was = "new run" if self.fresh else f"run was {sup.state}"
            sup.new_incarnation(f"rgt-agent start ({was}); agent pid {os.getpid()}")
            self._begin_sealing()
            return True
        self.adopted = True
        self.journal.event(
            "adopt",
            f"agent pid {os.getpid()} took over the run in {sup.state}, attempt {sup.attempt}",
        )
        if sup.attempt == 0:
            # The last agent died before the first attempt started (in its restore, say):
            # nothing has run, so this one restores as a beginning does; adopting would start
            # the job from step 0 beside a sealed checkpoint.
            self._begin_sealing()
        else:
            # After a power-on the checkpoint dir may be gone with the disk it was on: restore
            # as a beginning does (not for a stop the power cut: it only has to finish). Else
            # an adopting agent keeps the warnings of the incarnation's beginning.
            self._begin_sealing(from_boot and sup.state != State.STOPPING, power_on=True)
        if self.check is not None:
            self.check.skip(sup.attempt)  # no-op when the last agent recorded this attempt's S
        if sup.attempt > 0:
            status = self.runner.adopt(sup.attempt)
            if status is not None and not sup.exit_seen:
                sup.on_exit(status)
        sup.save()
        return True

    def _begin_sealing(self, begin: bool = True, power_on: bool = False) -> None:
        """Take an epoch, restore (``begin``), then seal in the background (when the run has a
        store). A beginning that cannot resume fails the run: no agent is left behind it. With
        no store, a beginning only lifts the freeze of a NaN loss (freeze.py), as the sealer's
        start does: what the job wrote after the last good step is set aside."""
        if self.seal is None and not begin:
            return
        self._interruptible = self.seal is not None  # not a lift alone: a few renames
        try:
            if self.seal is None:
                freeze.lift(self.rd, self.spec.ckpt_dir, self.journal.event)
            else:
                self.seal.start(begin=begin, adopting=self.adopted)
            self._interruptible = False
        except Interrupted as cut:  # run() ends the run as the signal asks, before any attempt
            tell_interrupted(self.journal.event, cut.signum)
            # Said in the ready message: the job does not run (again), also for a run taken
            # over, which is still STOPPING then (onbox/agent/detach.py NotStarted).
            self.cut = "PREEMPTED" if cut.signum == signal.SIGTERM else "STOPPED"
            return
        except RgtError as e:
            self._interruptible = False
            if begin:
                self._fail_to_begin(e, power_on)
            raise
        finally:
            self._interruptible = False
        if begin and self.seal is not None and fallback_warning(self.warnings, self.seal.restored):
            self.sup.save()

    def _fail_to_begin(self, e: RgtError, power_on: bool = False) -> None:
        """The incarnation cannot begin (its epoch, its ledger or what it resumes from cannot be
        had: onbox/agent/beginning.py ``begin_failure`` says which): one ``restore_failed``
        event with what failed and what was tried, the run FAILED with the reason (never left
        PENDING with no agent), the secrets of a run that never ran an attempt removed, a new run
        of `start`'s removed from the box whole (``unbegun_goes``), the lock let go. The caller
        raises ``e``: its exit code is the command's."""
        klass = event_class(e)
        remedy = e.remedy or "start the run again once the store answers"
        tried = getattr(e, "tried", None)
        why = begin_failure(e, self.seal.doing if self.seal is not None else freeze.LIFTING)
        self.journal.event(
            "restore_failed",
            why,
            klass=klass,
            remedy=remedy,
            **({"tried": [{"step": s, "reason": r} for s, r in tried]} if tried else {}),
        )
        self.sup.fail_to_begin(why, klass, remedy, power_on)
        if self.sup.attempt == 0:
            self._drop_secrets(e, why, remedy)
        if self.notifier is not None:
            self.notifier.finish(self.sup.state.value)
        self.runner.close()
        # Removed while the lock is held, so that no other start has claimed the name meanwhile.
        new = self.unbegun_goes and self.fresh and self.sup.attempt == 0 and not power_on
        if new and forget_unbegun(self.rd, self.spec.ckpt_dir):
            e.what = (
                f"run {self.rd.name} could not begin: {why}; nothing of the run is left on the "
                "box (it was new: `start` removed it again)"
            )
        self.lock.release()

    def _drop_secrets(self, e: RgtError, why: str, remedy: str) -> None:
        """A run that never ran an attempt (in any incarnation) and cannot begin keeps no
        secrets on the box: the deploy stored them for a start that did not happen, and the
        laptop keeps no record of a run whose start failed, so no `rgt down` would remove them.
        ``e`` then says so (``why``: what failed), and what to do (``remedy`` and more)."""
        try:
            dropped = drop_secrets(self.rd.secrets_file)
        except OSError as oe:  # said, never in place of why the run could not begin
            log(self.rd.agent_log, f"could not remove {self.rd.secrets_file}: {oe}")
            return
        e.what = f"run {self.rd.name} could not begin (FAILED before its first attempt): {why}"
        if dropped:
            e.remedy = (
                f"{remedy}; its secrets were removed from the box with it: give them again "
                "when you start it, `rgt deploy --secret-env VAR` or `rgt-agent secrets "
                f"{self.rd.name}` on the box"
            )

    # ---- signals
    def _on_signal(self, signum: int, frame: object) -> None:
        self._pending.append(signum)  # handled in run(), this one too
        if self._interruptible and signum in (signal.SIGTERM, signal.SIGINT):
            self._interruptible = False  # once: a second signal must not cut the clean-up
            raise Interrupted(signum)

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)
        self.lock.write_record("agent")  # from now on a stop may wake this process
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def _handle_signals(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass
        pending, self._pending = self._pending, []
        for signum in pending:
            if signum == signal.SIGTERM:
                self.journal.event(
                    "preempt",
                    "SIGTERM to the agent: treating it as a "
                    f"preemption with a {self.spec.grace:.0f}s budget",
                )
                self.sup.request_stop("preempt")
                if self.slurm is not None:
                    self.slurm.on_term()
            elif signum == signal.SIGINT:
                self.sup.request_stop("stop")
            elif signum == signal.SIGUSR2:
                asked = any(map(os.path.exists, (self.rd.stop_request, self.rd.sync_request)))
                self.check_stop_request()
                if self.seal is not None and os.path.exists(self.rd.sync_request):
                    self.seal.sync_soon(self.rd.sync_request)
                if not asked and self.slurm is not None:  # no mailbox request: Slurm's warning
                    self.slurm.on_usr2(self.sup.request_stop)

    def _wake_on_takeover(self, ev: Dict[str, Any]) -> None:
        """The journal's listener: the sealer's thread found the run taken over; the loop acts."""
        if ev.get("kind") in ("stale_epoch", "superseded") and self._wake_w >= 0:
            with contextlib.suppress(OSError):  # full: the loop is awake already
                os.write(self._wake_w, b"\0")

    def _leave_if_taken_over(self) -> None:
        """E4: once another box's agent owns the run in the store, this box's job trains for
        nothing (none of it can be sealed): stop it with its grace, as a stop would. Its
        checkpoints stay on this disk; the run goes on where the newer agent runs."""
        if self.seal is not None and self.seal.elsewhere and self.sup.stop is None:
            self.sup.request_stop("superseded")

    def check_stop_request(self) -> None:
        try:
            req = read_json(self.rd.stop_request)
        except ValueError:
            req = {}
        if req is None:
            return
        grace = req.get("grace")
        self.journal.event(
            "stop",
            "stop requested by rgt-agent stop"
            + (f" with grace {grace}s" if grace is not None else ""),
        )
        self.sup.request_stop("stop", None if grace is None else float(grace))
        try:
            os.unlink(self.rd.stop_request)
        except FileNotFoundError:
            pass

    # ---- the loop
    def run(
        self, ready: Optional[ReadyPipe] = None, stop: Optional[Tuple[str, Optional[float]]] = None
    ) -> State:
        """Supervise until terminal; return the final state (said on ``ready`` once begun)."""
        self._install_signals()
        sup = self.sup
        log(
            self.rd.agent_log,
            f"agent pid {os.getpid()} supervising {self.rd.name} "
            f"({sup.state}, attempt {sup.attempt})",
        )
        if self.notifier is not None:
            self.notifier.start()
        if stop is not None:
            sup.request_stop(*stop)
        self.check_stop_request()
        self._handle_signals()  # those that came while prepare() ran: before any attempt
        if sup.state == State.PENDING:
            sup.begin()
        if ready is not None:
            ready.say(
                {
                    "ok": True,
                    "pid": os.getpid(),
                    "job_pid": sup.pid,
                    "state": sup.state.value,
                    "attempt": sup.attempt,
                    "adopted": self.adopted,
                    **({"cut": self.cut} if self.cut else {}),
                },
            )
        self._check_resume()
        self.notice = watcher_for(self.spec, self.seal, self.journal.event)
        install_hook(self.rd, getattr(self.spec, "profile", None), self.journal.event)
        self.health = healthuse.start(
            self.spec, self.rd, self.journal, sup, self.runner, self.seal, self._wake_w
        )
        if self.slurm is not None:
            seal = self.seal
            self.slurm.begin(sup.extra, (seal is not None, seal.sealed_step() if seal else None))
            sup.save()
        self._leave_if_taken_over()
        try:
            self._supervise()
        except StoreError as e:  # said, and the run let go of as it is: no traceback
            raise left_unended(self, e) from None
        let_go(self)  # nothing of the last attempt outlives the run; then the lock goes
        return sup.state

    def _supervise(self) -> None:
        """The loop proper, until the run is terminal."""
        sup = self.sup
        while sup.state not in TERMINAL:
            waits = [
                w
                for w in (
                    sup.next_wakeup(),
                    self.runner.poll_interval(),
                    self.check.next_wakeup() if self.check is not None else None,
                    self.meter.wait(sup, self.seal),
                    self.slurm.wait() if self.slurm is not None else None,
                )
                if w is not None
            ]
            procfs.wait_readable(
                [self._wake_r, *self.runner.watch_fds()], min(waits) if waits else None
            )
            self._handle_signals()
            self._leave_if_taken_over()
            if self.slurm is not None:
                self.slurm.tick(sup.request_stop, sup.active)
            if self.health is not None:
                self.health.act()
            self.meter.check(sup, self.seal, self.journal.event)
            if sup.active and not sup.exit_seen:
                status = self.runner.poll_exit()
                if status is not None:
                    # The attempt's output is complete: its check concludes before its exit.
                    self._check_resume(final=True)
                    sup.on_exit(status)
            sup.tick()
            self._check_resume()
        self._check_resume(final=True)

    def working(self) -> Dict[str, Any]:
        """What the agent is doing while it prepares the run, for `start` (onbox/agent/detach.py
        ReadyPipe): the sealing service's step and, in a restore's download, its bytes."""
        if self.seal is None or not self.seal.doing:
            return {"working": "preparing the run"}
        from onbox.sealing.fetch import progress  # loaded already: the service imports it

        out: Dict[str, Any] = {"working": self.seal.doing}
        got = progress()
        if got is not None:
            out["done"], out["total"] = got
        return out

    def _resume_from(self) -> str:
        """RGT_RESUME_FROM for the attempt being spawned. Its resume check begins here, where
        S is taken: before the job can write a checkpoint of its own."""
        path = self.seal.resume_from() if self.seal is not None else ""
        self._check_resume(resume_from=path)
        return path

    def _check_resume(self, final: bool = False, resume_from: Optional[str] = None) -> None:
        """The resume contract check (onbox/agent/resumecheck.py ``advance``); a bug in it
        turns it off for this agent, never the supervision."""
        check = self.check
        if check is not None and not advance(
            check, self.sup, self.seal, self.journal.event, final, resume_from
        ):
            self.check = None


def main(argv: List[str]) -> int:
    args = parse_agent_args(argv)
    os.umask(0o077)
    os.environ.pop(TAG_VAR, None)
    rd = RunDir(args["name"])
    # `start` waits on this pipe for the run to begin: a sign of life from now on, before the
    # epoch and the restore, which may take minutes.
    ready = ReadyPipe(args["ready_fd"]) if args["ready_fd"] is not None else None
    # The agent's stdout and stderr are agent.log (onbox/agent/daemon.py): a traceback or a warning
    # printed there is redacted like every line the journal writes.
    sys.stdout = cast(TextIO, redact.RedactingStream(sys.stdout, lambda: redact.for_home(rd.home)))
    sys.stderr = cast(TextIO, redact.RedactingStream(sys.stderr, lambda: redact.for_home(rd.home)))
    set_title(f"rgt-agent agent {rd.name}")
    lock = RunLock.adopt(args["lock_fd"], rd.lock)
    agent = Agent(rd, lock)
    if ready is not None:
        ready.working = agent.working
        agent.unbegun_goes = not args["adopt_only"]
    try:
        prepared = agent.prepare(may_begin=not args["adopt_only"])
    except RgtError as e:  # the run is FAILED already; `start` prints this and exits with it
        if os.path.isdir(rd.path):  # else it went from the box whole (forget_unbegun)
            log(rd.agent_log, f"agent pid {os.getpid()}: {e.line()}")
        if ready is not None:
            ready.say(
                {"ok": False, "what": e.what, "remedy": e.remedy, "exit_code": e.exit_code},
            )
        return e.exit_code
    if not prepared:
        log(rd.agent_log, f"agent pid {os.getpid()}: run is {agent.sup.state}; nothing to do")
        lock.release()
        return 0
    try:
        agent.run(ready=ready)
    except StoreError as e:  # said in agent.log and the events (letgo.py left_unended)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
