"""The state machine of one run: decides, and acts only through an injected Runner and Clock.

``_change`` is the one place the state changes; it checks the edge against ``states.TRANSITIONS``
and writes state.json and an event. The agent feeds the machine three kinds of input:
``on_exit`` (the attempt's main process ended), ``request_stop`` (``rgt-agent stop`` or SIGTERM)
and ``tick`` (time passed; ``next_wakeup`` says when the machine next needs one). Because time
comes from the clock and processes from the runner, the policy is tested without sleeping.
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Dict, Optional

from onbox.agent import launchers
from onbox.agent.attemptkill import AttemptKill
from onbox.agent.classify import (
    Budget,
    ExitStatus,
    Kind,
    Verdict,
    classify,
    ended_by_agent,
    ended_by_stop,
)
from onbox.agent.journal import iso
from onbox.agent.leftovers import Reaper
from onbox.agent.restarts import crash_loop, not_restarted, with_tail
from onbox.agent.seams import Clock, Hooks, Journal, Runner, to_mono, to_wall
from onbox.agent.spec import JobSpec, preempt_kill_delay
from onbox.agent.states import ACTIVE, TERMINAL, State, can_transition

# How often to look for processes while waiting for an attempt's processes to vanish.
REAP_POLL = 0.05
GATE_POLL = 0.5  # how often a start held by the start gate asks it again
# How much of a torchrun job's output is read for its failed rank's own lines: eight ranks'
# NCCL aborts print some 4 KiB of C++ frames each after the first failure.
RANKS_TAIL_BYTES = 1 << 20


class Supervisor:
    """One run's state machine: a new run's with no ``doc``, a run found on disk's with its
    state.json as ``doc`` (what ``to_doc`` wrote)."""

    def __init__(
        self,
        spec: JobSpec,
        runner: Runner,
        clock: Clock,
        journal: Journal,
        hooks: Optional[Hooks] = None,
        doc: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.spec = spec
        self.policy = spec.restart
        self.runner = runner
        self.clock = clock
        self.journal = journal
        self.hooks = hooks or Hooks()
        self.extra: Dict[str, Any] = {}  # agent-provided fields for state.json
        d = doc or {}
        self.state = State(d.get("state", State.PENDING.value))
        self.incarnation: int = d.get("incarnation", 1)
        self.attempt: int = d.get("attempt", 0)
        self.restarts: int = d.get("restarts", 0)
        budgets = d.get("budgets", {})
        self.error_restarts: int = budgets.get("error_used", 0)
        self.preempt_restarts: int = budgets.get("preempt_used", 0)
        self.quick_failures: int = d.get("quick_failures", 0)
        self.last_exit: Optional[Dict[str, Any]] = d.get("last_exit")
        self.last_cuda_oom_step: Optional[int] = d.get("last_cuda_oom_step", -1)
        self.pid: Optional[int] = d.get("pid")
        self.started_at: float = d.get("started_ts", clock.time())
        self.updated_at: float = d.get("updated_ts", clock.time())
        self.oom_before: Optional[int] = d.get("oom_before")
        self.kmsg_before: Optional[int] = d.get("kmsg_before")
        self.exit_seen: bool = d.get("exit_seen", True)
        self.stop: Optional[Dict[str, Any]] = d.get("stop")
        # Deadlines are monotonic in memory and wall-clock on disk (a restarted agent converts).
        self._attempt_started = to_mono(self.clock, d.get("attempt_started_ts"))
        self._backoff_until = to_mono(self.clock, d.get("backoff_until_ts"))
        self._kill_at = to_mono(self.clock, self.stop.get("kill_at_ts") if self.stop else None)
        self._deadline = to_mono(self.clock, self.stop.get("deadline_ts") if self.stop else None)
        self.leftovers = Reaper(runner, journal.event)  # what an ended attempt left alive
        # An end the agent asked for on a probe's word (kill_attempt): what it was for.
        self.kill = AttemptKill(spec, runner, clock, journal, d.get("kill"))
        # The crash-loop rule: LATEST when the attempt started, and how many error ends in a
        # row did not move it.
        self.sealed_at_start: Optional[int] = d.get("sealed_at_start")
        self.stuck_restarts: int = d.get("stuck_restarts", 0)
        # Whether the next attempt may start (the GPU probe waits, bounded, for the last
        # attempt's GPU memory to be released); asked in BACKOFF once nothing is left alive.
        self.start_gate: Callable[[], bool] = lambda: True
        self._gate_held = False
        # The agent's mailbox, read once more before a stop's terminal state: a stop the user
        # asked for while the final seal ran is taken in (``request_stop``) before it is written.
        self.mailbox: Callable[[], None] = lambda: None

    # ---- the one place state changes (the event first: whoever sees a state finds its event)
    def _change(
        self, new: State, reason: str, *, klass: Optional[str] = None, remedy: str = ""
    ) -> None:
        old = self.state
        if not can_transition(old, new):
            raise AssertionError(f"illegal transition {old} -> {new}: {reason}")
        self.state = new
        self.updated_at = self.clock.time()
        self.journal.event(
            "state",
            reason,
            klass=klass,
            remedy=remedy,
            state_from=old.value,
            state=new.value,
            attempt=self.attempt,
        )
        self.save()

    def save(self) -> None:
        self.journal.save(self.to_doc())

    def to_doc(self) -> Dict[str, Any]:
        """The state.json document."""
        doc: Dict[str, Any] = {
            "name": self.spec.name,
            "state": self.state.value,
            "pid": self.pid,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "incarnation": self.incarnation,
            "last_exit": self.last_exit,
            "started_at": iso(self.started_at),
            "updated_at": iso(self.updated_at),
            "started_ts": self.started_at,
            "updated_ts": self.updated_at,
            "budgets": {
                "error_used": self.error_restarts,
                "error_max": self.policy.max_error_restarts,
                "preempt_used": self.preempt_restarts,
                "preempt_max": self.policy.max_preempt_restarts,
            },
            "quick_failures": self.quick_failures,
            "last_cuda_oom_step": self.last_cuda_oom_step,
            "attempt_started_ts": to_wall(self.clock, self._attempt_started),
            "backoff_until_ts": to_wall(self.clock, self._backoff_until)
            if self.state == State.BACKOFF
            else None,
            "oom_before": self.oom_before,
            "kmsg_before": self.kmsg_before,
            "exit_seen": self.exit_seen,
            "stop": self.stop,
            "kill": self.kill.doc,
            "sealed_at_start": self.sealed_at_start,
            "stuck_restarts": self.stuck_restarts,
            "command": list(self.spec.command),
        }
        doc.update(self.extra)
        return doc

    # ---- inputs
    def new_incarnation(self, reason: str) -> None:
        """Begin again at PENDING (a `start` of a run that reached a terminal state)."""
        if self.state not in TERMINAL and self.attempt > 0:
            raise AssertionError(f"new incarnation of a live run in {self.state}")
        if self.attempt > 0 or self.state != State.PENDING:
            self.incarnation += 1
        self.state = State.PENDING
        self.restarts = self.error_restarts = self.preempt_restarts = self.quick_failures = 0
        self.stuck_restarts = 0
        self.kill.clear()
        self.last_cuda_oom_step = -1
        self.stop = None
        self._kill_at = self._deadline = self._backoff_until = None
        self.exit_seen = True
        self.pid = None
        self.started_at = self.updated_at = self.clock.time()
        self.save()
        self.journal.event("incarnation", reason, incarnation=self.incarnation)

    def fail_to_begin(self, reason: str, klass: str, remedy: str, power_on: bool = False) -> None:
        """PENDING -> FAILED with no attempt: what the first attempt needs before it can run
        (the checkpoint to resume from) cannot be had. ``last_exit`` says why, as status shows
        an attempt's failure, so nothing is left PENDING with no agent behind it. With
        ``power_on`` (``rgt-agent boot``: the power cut the last attempt, and the next one
        must restore first) from STARTING, RUNNING or BACKOFF too."""
        live = (State.STARTING, State.RUNNING, State.BACKOFF) if power_on else ()
        if self.state != State.PENDING and self.state not in live:
            raise AssertionError(f"fail_to_begin() in {self.state}")
        self._record_exit(ExitStatus(code=None, signal=None), reason, "begin", klass, remedy, None)
        self._change(State.FAILED, reason, klass=klass, remedy=remedy)

    def _record_exit(
        self, st: ExitStatus, reason: str, kind: str, klass: Optional[str], remedy: str,
        step: Optional[int],
    ) -> None:  # fmt: skip
        """``last_exit``: how the current attempt ended (or why none could begin)."""
        self.last_exit = {
            "code": st.code, "signal": st.signal, "reason": reason, "kind": kind,
            "class": klass, "remedy": remedy, "attempt": self.attempt, "step": step,
            "at": iso(self.clock.time()),
        }  # fmt: skip

    def begin(self) -> None:
        """PENDING -> STARTING: the first attempt of this incarnation."""
        if self.state != State.PENDING:
            raise AssertionError(f"begin() in {self.state}")
        self._start_attempt()

    def _start_attempt(self) -> None:
        self.attempt += 1
        self._attempt_started = self.clock.monotonic()
        self.oom_before = self.runner.oom_kills()
        self.kmsg_before = self.runner.kernel_log_mark()
        self.exit_seen = False
        self.pid = None
        self.leftovers.kill_at = None
        self.kill.clear()
        self.sealed_at_start = self.hooks.sealed_step()
        self._change(State.STARTING, f"attempt {self.attempt} starting")
        try:
            self.pid = self.runner.spawn(self.attempt)
        except OSError as e:
            self.save()
            self.on_exit(ExitStatus(code=127, note=f"could not start the job: {e}"))
            return
        self.save()

    def on_exit(self, status: ExitStatus) -> None:
        """The current attempt's main process ended (or was found gone)."""
        if self.exit_seen:
            return
        self.exit_seen = True
        job_pid, self.pid = self.pid, None
        now = self.clock.monotonic()
        tail = self.runner.tail()
        if launchers.root_cause(tail) is not None:  # torchrun's: its failed rank's own lines
            tail = self.runner.tail(RANKS_TAIL_BYTES)  # may be far back, behind other ranks'
        oom_after = self.runner.oom_kills()
        oom = oom_after is not None and self.oom_before is not None and oom_after > self.oom_before
        if not oom and job_pid and (status.signal == signal.SIGKILL or status.code == 137):
            # the kernel's word, where readable, from this attempt's records only (pids are reused)
            oom = self.runner.kernel_oom_killed(job_pid, self.kmsg_before)
        verdict = classify(
            status,
            tail,
            success_codes=self.policy.success_codes,
            oom_kills_rose=oom,
            inodes_exhausted=self.runner.inodes_exhausted,
        )
        if self.kill.doc is not None and self.state in (State.STARTING, State.RUNNING):
            verdict = ended_by_agent(verdict, self.kill.doc)  # on a probe's word
        if self.state == State.STOPPING and self.stop is not None:
            verdict = ended_by_stop(verdict, status, self.stop["reason"])
        self._record_exit(
            status, verdict.reason, verdict.kind.value, verdict.klass or None, verdict.remedy,
            verdict.step,
        )  # fmt: skip
        self.journal.event(
            "exit",
            f"attempt {self.attempt}: {verdict.reason}",
            klass=verdict.klass or None,
            remedy=verdict.remedy,
            code=status.code,
            signal=status.signal,
            exit_kind=verdict.kind.value,
        )
        if self.state == State.STOPPING:
            self.save()  # tick() finishes the stop once every process is gone
            return
        if self.state not in (State.STARTING, State.RUNNING):
            raise AssertionError(f"exit in {self.state}")
        self._decide(verdict, tail, now)

    def _decide(self, verdict: Verdict, tail: str, now: float) -> None:
        if verdict.kind == Kind.SUCCESS:
            self.hooks.before_terminal("success", now + 86400.0)
            self._change(State.SUCCEEDED, f"attempt {self.attempt} {verdict.reason}")
            return
        quick = self._attempt_started is not None and (
            now - self._attempt_started < self.policy.start_grace
        )
        failure = not_restarted(
            verdict,
            self.policy,
            last_cuda_oom_step=self.last_cuda_oom_step,
            error_used=self.error_restarts,
            preempt_used=self.preempt_restarts,
        )
        if verdict.kind == Kind.CUDA_OOM:
            self.last_cuda_oom_step = verdict.step
        if failure is None and verdict.budget == Budget.ERROR and self.spec.store is not None:
            self.stuck_restarts, failure = crash_loop(
                verdict,
                self.policy.max_stuck_restarts,
                self.hooks.sealed_step,
                self.sealed_at_start,
                self.stuck_restarts,
            )
        if failure is not None:
            failure = with_tail(failure, tail)
            if self.last_exit is not None:
                self.last_exit["reason"] = failure
            self._change(
                State.FAILED, failure, klass=verdict.klass or "permanent", remedy=verdict.remedy
            )
            return
        if verdict.budget == Budget.ERROR:
            self.error_restarts += 1
        else:
            self.preempt_restarts += 1
        self.restarts += 1
        self.quick_failures = self.quick_failures + 1 if quick else 0
        delay = self.policy.backoff(self.quick_failures)
        self._backoff_until = now + delay
        why = "crash loop: exited within the start grace; " if quick else ""
        used = self.error_restarts if verdict.budget == Budget.ERROR else self.preempt_restarts
        self._change(
            State.BACKOFF,
            f"{why}restarting in {delay:.1f}s ({verdict.budget.value} restart "
            f"{used}): {verdict.reason}",
            klass=verdict.klass or None,
            remedy=verdict.remedy,
        )

    def kill_attempt(
        self, reason: str, *, then: str, kind: str, klass: str = "transient", remedy: str = ""
    ) -> bool:
        """End the running attempt on a probe's word: the stop signal now, SIGKILL after the
        stop grace. ``then`` is "restart" (its end spends the error budget, and the next attempt
        resumes from the newest sealed checkpoint) or "fail" (the run ends FAILED with
        ``reason``). False when there is no attempt to end, or one is being ended already."""
        assert then in ("restart", "fail"), then
        if self.state not in (State.STARTING, State.RUNNING) or self.exit_seen or self.kill.doc:
            return False
        self.kill.ask(reason, then=then, kind=kind, klass=klass, remedy=remedy)
        self.save()  # what the end is for is on disk before the job is signalled
        self.kill.signal_job(self.attempt)
        return True

    def request_stop(self, reason: str, grace: Optional[float] = None) -> None:
        """Begin a stop: ``reason`` is "stop" (ends STOPPED) or "preempt" (ends PREEMPTED).

        For "preempt", ``grace`` is the whole budget: the agent must be gone before it ends.
        """
        preempting = self.stop is not None and self.stop.get("reason") == "preempt"
        if self.state in TERMINAL or (preempting and reason != "stop"):
            return
        grace = self.spec.grace if grace is None else grace
        now = self.clock.monotonic()
        kill_delay = preempt_kill_delay(grace) if reason == "preempt" else grace
        again = self.state == State.STOPPING and self.stop is not None
        # A second stop while one runs (`stop` again, the SIGTERM of a preemption, a second
        # Ctrl-C): the sooner SIGKILL and deadline win, and the first reason stays (a stop the
        # user asked for ends STOPPED, never resumed at the next power-on), but for a stop the
        # user asks during a preemption: it ends STOPPED too (a Slurm job's warning would
        # requeue the job otherwise), within the preemption's budget.
        was = (self._kill_at, self._deadline) if again else (None, None)
        self._kill_at = min(x for x in (was[0], now + kill_delay) if x is not None)
        self._deadline = min(x for x in (was[1], now + grace) if x is not None)
        self.stop = {
            "reason": reason,
            "grace": grace,
            "requested_at": iso(self.clock.time()),
            **(self.stop if again and self.stop else {}),
            **({"reason": "stop"} if preempting else {}),
            "kill_at_ts": to_wall(self.clock, self._kill_at),
            "deadline_ts": to_wall(self.clock, self._deadline),
        }
        if again:
            return self.save()
        final = State.PREEMPTED if reason == "preempt" else State.STOPPED
        if self.state == State.PENDING:
            self._change(final, f"{reason} before the first attempt")
            return
        self.hooks.on_stop_requested(reason, self._deadline)
        self._change(
            State.STOPPING, f"{reason}: signalling the job, SIGKILL after {kill_delay:.1f}s"
        )
        if self.runner.alive():
            self.runner.signal(self.spec.stop_signal)

    def tick(self) -> None:
        """Advance the time-based edges."""
        now = self.clock.monotonic()
        if self.state in (State.STARTING, State.RUNNING):
            self.kill.sigkill_if_due(now)
        if self.state == State.STARTING:
            if self._attempt_started is not None and (
                now - self._attempt_started >= self.policy.start_grace
            ):
                self.quick_failures = 0
                self._change(State.RUNNING, f"attempt {self.attempt} running")
        elif self.state == State.BACKOFF:
            if self.leftovers.reaping(now, self.attempt):
                return
            if self._backoff_until is None or now >= self._backoff_until:
                self._gate_held = not self.start_gate()
                if not self._gate_held:
                    self._start_attempt()
        elif self.state == State.STOPPING:
            alive = self.runner.alive()
            if alive and self._kill_at is not None and now >= self._kill_at:
                self.runner.signal(signal.SIGKILL)
                alive = self.runner.alive()
            if not alive and self.exit_seen:
                assert self.stop is not None
                self.hooks.before_terminal(self.stop["reason"], self._deadline or now)
                self.mailbox()  # a stop asked while the seal ran (its signal waits till now)
                reason = self.stop["reason"]
                final = State.PREEMPTED if reason == "preempt" else State.STOPPED
                self._change(final, f"{reason}: every process of attempt {self.attempt} is gone")

    def next_wakeup(self) -> Optional[float]:
        """Seconds until the machine needs a ``tick``; None when only an exit can move it."""
        now = self.clock.monotonic()
        if self.kill.doc is not None and self.state in (State.STARTING, State.RUNNING):
            return self.kill.wakeup(now)
        if self.state == State.STARTING and self._attempt_started is not None:
            return max(0.0, self._attempt_started + self.policy.start_grace - now)
        if self.state == State.BACKOFF:
            if self.leftovers.kill_at is not None:
                return REAP_POLL
            if self._gate_held:
                return GATE_POLL
            return max(0.0, (self._backoff_until or now) - now)
        if self.state == State.STOPPING:
            return REAP_POLL
        return None

    @property
    def attempt_started(self) -> Optional[float]:
        """When the current attempt started (monotonic), for the health probes."""
        return self._attempt_started

    @property
    def active(self) -> bool:
        return self.state in ACTIVE
