"""The restart and stop policy, on a fake clock and a fake runner (no processes, no sleeping).

The runner and the clock are the supervisor's seams; here both are fakes, as each test's name
says, so the decisions can be checked step by step. The same Supervisor drives real processes
in tests/integration.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox.agent.classify import ExitStatus
from onbox.agent.journal import MemoryJournal
from onbox.agent.leftovers import LEFTOVER_GRACE
from onbox.agent.seams import Hooks
from onbox.agent.spec import JobSpec, RestartPolicy, preempt_kill_delay
from onbox.agent.states import TERMINAL, TRANSITIONS, State
from onbox.agent.supervisor import Supervisor
from onbox.common.storeurl import parse_store_url


class FakeClock:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_800_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


class FakeRunner:
    """Records what the supervisor asked for; the test says what the processes do."""

    def __init__(self) -> None:
        self.spawned: List[int] = []
        self.signals: List[int] = []
        self.processes_alive = False
        self.output = ""
        self.ooms: Optional[int] = 0
        self.no_inodes = False
        # The kernel log's OOM records, oldest first, as the pids they name; a record's sequence
        # number is its place in the list, counted from 1 (None: the log cannot be read).
        self.kernel_log: Optional[List[int]] = []

    def spawn(self, attempt: int) -> int:
        self.spawned.append(attempt)
        self.processes_alive = True
        return 4000 + attempt

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def alive(self) -> bool:
        return self.processes_alive

    def tail(self, limit: int = 16384) -> str:
        return self.output[-limit:]

    def oom_kills(self) -> Optional[int]:
        return self.ooms

    def inodes_exhausted(self) -> bool:
        return self.no_inodes

    def kernel_log_mark(self) -> Optional[int]:
        return None if self.kernel_log is None else len(self.kernel_log)

    def kernel_oom_killed(self, pid: int, after: Optional[int]) -> bool:
        if self.kernel_log is None or after is None:
            return False
        return pid in self.kernel_log[after:]


# Every Rig made while this is a list joins it: how the edge test below sees what each
# scenario did, whatever order (or selection) the tests run in.
_RIGS: Optional[List[Rig]] = None


class Rig:
    def __init__(self, **policy: object) -> None:
        if _RIGS is not None:
            _RIGS.append(self)
        self.clock = FakeClock()
        self.runner = FakeRunner()
        self.journal = MemoryJournal()
        spec = JobSpec(
            name="t",
            command=("train",),
            workdir="/w",
            ckpt_dir="/w/ckpt",
            grace=10.0,
            restart=RestartPolicy(**policy),  # type: ignore[arg-type]
        )
        self.sup = Supervisor(spec, self.runner, self.clock, self.journal)

    def exit(self, code: Optional[int] = None, sig: Optional[int] = None, output: str = "") -> None:
        self.runner.output = output
        self.runner.processes_alive = False
        self.sup.on_exit(ExitStatus(code=code, signal=sig))

    def run_for(self, seconds: float, step: float = 0.5) -> None:
        end = self.clock.mono + seconds
        while self.clock.mono < end:
            self.clock.advance(step)
            self.sup.tick()

    def states(self) -> List[str]:
        return [e["state"] for e in self.journal.events if e["kind"] == "state"]


def test_fake_clock_healthy_run_then_success() -> None:
    rig = Rig(start_grace=5.0)
    rig.sup.begin()
    assert rig.sup.state == State.STARTING and rig.runner.spawned == [1]
    rig.run_for(5.0)
    assert rig.sup.state == State.RUNNING
    rig.exit(code=0)
    assert rig.sup.state == State.SUCCEEDED
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] == "success"


def test_fake_clock_quick_success_is_success_not_crash() -> None:
    rig = Rig(start_grace=5.0)
    rig.sup.begin()
    rig.exit(code=0)
    assert rig.sup.state == State.SUCCEEDED


def test_fake_clock_first_restart_after_healthy_run_has_no_backoff() -> None:
    rig = Rig(start_grace=2.0)
    rig.sup.begin()
    rig.run_for(3.0)
    rig.exit(code=1, output="Traceback (most recent call last):\nRuntimeError: boom\n")
    assert rig.sup.state == State.BACKOFF
    assert rig.sup.next_wakeup() == 0.0
    rig.sup.tick()
    assert rig.sup.state == State.STARTING and rig.runner.spawned == [1, 2]


def test_fake_clock_crash_loop_backs_off_exponentially_then_fails_with_log_tail() -> None:
    rig = Rig(start_grace=5.0, max_error_restarts=4, backoff_initial=1.0, backoff_max=4.0)
    rig.sup.begin()
    delays = []
    for _ in range(4):
        rig.exit(code=1, output="loading data\nboom: cannot open shard 7\n")
        assert rig.sup.state == State.BACKOFF
        wait = rig.sup.next_wakeup()
        assert wait is not None
        delays.append(wait)
        rig.clock.advance(wait - 0.01)
        rig.sup.tick()
        assert rig.sup.state == State.BACKOFF  # not a moment early
        rig.clock.advance(0.01)
        rig.sup.tick()
        assert rig.sup.state == State.STARTING
    assert delays == [1.0, 2.0, 4.0, 4.0]  # doubles, capped
    rig.exit(code=1, output="loading data\nboom: cannot open shard 7\n")
    assert rig.sup.state == State.FAILED
    reason = rig.sup.last_exit["reason"] if rig.sup.last_exit else ""
    assert "error restart budget spent (4/4)" in reason
    assert "boom: cannot open shard 7" in reason  # the tail of the log is in the reason
    assert rig.journal.events[-1]["class"] == "permanent"
    assert "crash loop" in " ".join(e["reason"] for e in rig.journal.events)


def test_fake_clock_budgets_are_separate() -> None:
    rig = Rig(start_grace=1.0, max_error_restarts=1, max_preempt_restarts=3)
    rig.sup.begin()
    for _ in range(3):  # three outside kills spend the preemption budget only
        rig.run_for(2.0)
        rig.exit(sig=signal.SIGKILL)
        assert rig.sup.state == State.BACKOFF
        rig.sup.tick()
    assert (rig.sup.preempt_restarts, rig.sup.error_restarts) == (3, 0)
    rig.run_for(2.0)
    rig.exit(code=1)  # a code error still has its own budget
    assert rig.sup.state == State.BACKOFF and rig.sup.error_restarts == 1
    rig.sup.tick()
    rig.run_for(2.0)
    rig.exit(sig=signal.SIGTERM)  # but the preemption budget is spent now
    assert rig.sup.state == State.FAILED
    assert "preemption restart budget spent (3/3)" in rig.journal.events[-1]["reason"]


def test_fake_clock_the_kernels_word_on_an_oom_kill_counts_too() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    assert rig.runner.kernel_log is not None
    rig.runner.kernel_log.append(4001)  # no cgroup counter, but the kernel log names the job
    rig.runner.ooms = None
    rig.exit(sig=signal.SIGKILL)
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] == "oom_killed"


def test_fake_clock_an_oom_record_from_before_the_attempt_never_names_its_job() -> None:
    """pid_max is often 32768, so a long-lived box reuses pids: the kernel log still holds the
    OOM kill of an earlier process that had the job's pid. A SIGKILL from outside is then not an
    OOM kill: it spends the preemption budget, not the error budget."""
    rig = Rig(start_grace=1.0)
    rig.runner.ooms = None  # no cgroup counter: only the kernel log can say
    rig.runner.kernel_log = [4001, 17]  # 4001 was OOM-killed long before this run began
    rig.sup.begin()
    rig.run_for(2.0)
    rig.exit(sig=signal.SIGKILL)
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] != "oom_killed"
    assert (rig.sup.error_restarts, rig.sup.preempt_restarts) == (0, 1)


def test_fake_clock_the_kernel_log_mark_outlives_an_agent_restart() -> None:
    """An agent that restarts during an attempt reads the kernel log from the attempt's mark,
    kept in state.json, not from its own start (an OOM kill in between would be missed)."""
    rig = Rig(start_grace=1.0)
    rig.runner.ooms = None
    rig.sup.begin()
    rig.run_for(2.0)
    assert rig.runner.kernel_log is not None
    rig.runner.kernel_log.append(4001)  # the OOM killer takes the job while no agent runs
    rig.sup = Supervisor(rig.sup.spec, rig.runner, rig.clock, rig.journal, doc=rig.sup.to_doc())
    rig.exit(sig=signal.SIGKILL)
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] == "oom_killed"


def test_fake_clock_oom_kill_spends_the_error_budget() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.runner.ooms = 3  # the cgroup's oom_kill count rose during the attempt
    rig.exit(sig=signal.SIGKILL)
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] == "oom_killed"
    assert (rig.sup.error_restarts, rig.sup.preempt_restarts) == (1, 0)


@pytest.mark.parametrize(
    "how",
    [{"sig": signal.SIGABRT}, {"sig": signal.SIGSEGV}, {"code": 128 + signal.SIGSEGV}],
)
def test_fake_clock_a_crash_by_a_signal_of_its_own_spends_the_error_budget(
    how: Dict[str, int],
) -> None:
    """os.abort(), a C extension's segfault (or a shell's 139 for one): the job's own failure,
    so max_error_restarts ends the crash loop, not the preemption budget of 100."""
    rig = Rig(start_grace=1.0, max_error_restarts=1)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.exit(output="step 1\nFatal Python error: Aborted\n", **how)
    assert rig.sup.state == State.BACKOFF
    assert (rig.sup.error_restarts, rig.sup.preempt_restarts) == (1, 0)
    assert rig.sup.last_exit is not None and rig.sup.last_exit["kind"] == "crashed"
    rig.sup.tick()
    rig.run_for(2.0)
    rig.exit(output="step 1\nFatal Python error: Aborted\n", **how)
    assert rig.sup.state == State.FAILED and rig.runner.spawned == [1, 2]
    last = rig.journal.events[-1]
    assert "crashed with signal" in last["reason"], last
    assert "error restart budget spent (1/1)" in last["reason"], last
    assert last["class"] == "permanent" and "core dump" in last["remedy"], last


@pytest.mark.parametrize(
    "output",
    [
        '  File "train.py", line 3\n    def f(:\n          ^\nSyntaxError: invalid syntax\n',
        'Traceback (most recent call last):\n  File "train.py", line 1, in <module>\n'
        "ModuleNotFoundError: No module named 'flash_attn'\n",
    ],
)
def test_fake_clock_deterministic_failures_are_not_retried(output: str) -> None:
    rig = Rig()
    rig.sup.begin()
    rig.exit(code=1, output=output)
    assert rig.sup.state == State.FAILED
    assert rig.runner.spawned == [1]
    assert "not retried" in rig.journal.events[-1]["reason"]


def test_fake_clock_cuda_oom_at_the_same_step_is_not_retried_again() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    oom = "step 1200 loss 0.3\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    rig.run_for(2.0)
    rig.exit(code=1, output=oom)
    assert rig.sup.state == State.BACKOFF  # once may be fragmentation: try again
    rig.sup.tick()
    rig.run_for(2.0)
    rig.exit(code=1, output=oom)
    assert rig.sup.state == State.FAILED
    assert "CUDA out of memory again at step 1200" in rig.journal.events[-1]["reason"]


def test_fake_clock_stop_escalates_to_sigkill_after_grace_and_waits_for_every_process() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("stop", grace=3.0)
    assert rig.sup.state == State.STOPPING
    assert rig.runner.signals == [signal.SIGTERM]
    rig.run_for(2.5, step=0.5)
    assert signal.SIGKILL not in rig.runner.signals  # the job still has its grace
    rig.run_for(1.0, step=0.5)
    assert signal.SIGKILL in rig.runner.signals
    rig.runner.output = ""
    rig.sup.on_exit(ExitStatus(signal=signal.SIGKILL))  # main process gone, a child is not
    rig.sup.tick()
    assert rig.sup.state == State.STOPPING
    rig.runner.processes_alive = False
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED
    assert rig.sup.last_exit is not None and "ended by stop" in rig.sup.last_exit["reason"]


@pytest.mark.parametrize("then", ["stop", "preempt"])
def test_fake_clock_a_second_stop_while_stopping_hastens_it_and_keeps_its_reason(
    then: str,
) -> None:
    """A second `rgt-agent stop`, or a preemption's SIGTERM, while a stop ran: STOPPING ->
    STOPPING raised in the agent, which died (and every respawned one with it), and a job
    that ignores SIGTERM was never killed. The sooner SIGKILL wins; the run ends STOPPED."""
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("stop", grace=20.0)
    rig.run_for(1.0)
    rig.sup.request_stop(then, grace=1.0)
    assert rig.sup.state == State.STOPPING and rig.states().count("STOPPING") == 1
    rig.run_for(1.5, step=0.25)
    assert signal.SIGKILL in rig.runner.signals  # not after the first stop's 20 s
    rig.runner.processes_alive = False
    rig.sup.on_exit(ExitStatus(signal=signal.SIGKILL))
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED
    rig = Rig(start_grace=1.0)  # a later stop with a longer grace does not postpone it
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("stop", grace=2.0)
    rig.sup.request_stop(then, grace=60.0)
    rig.run_for(2.5, step=0.25)
    assert signal.SIGKILL in rig.runner.signals


def test_fake_clock_preemption_ends_preempted_and_kills_before_the_budget_ends() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("preempt", grace=5.0)
    kill_after = preempt_kill_delay(5.0)
    assert 0 < kill_after < 5.0
    rig.run_for(kill_after + 0.1, step=0.1)
    assert signal.SIGKILL in rig.runner.signals
    rig.exit(sig=signal.SIGKILL)
    rig.sup.tick()
    assert rig.sup.state == State.PREEMPTED


def test_fake_clock_a_stop_during_a_preemption_ends_stopped_within_its_budget() -> None:
    """A stop the user asks while a preemption (a Slurm job's time-limit warning) is under
    way: the run ends STOPPED (not PREEMPTED, which a Slurm job's agent requeues), and the
    preemption's budget stays: SIGKILL comes no later than it would have."""
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("preempt", grace=5.0)
    rig.sup.request_stop("stop", grace=60.0)
    assert rig.sup.state == State.STOPPING and rig.states().count("STOPPING") == 1
    rig.run_for(preempt_kill_delay(5.0) + 0.1, step=0.1)
    assert signal.SIGKILL in rig.runner.signals  # not after the stop's 60 s
    rig.exit(sig=signal.SIGKILL)
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED


def test_fake_clock_a_stop_asked_during_the_final_seal_is_read_before_the_end() -> None:
    """The final seal runs in the loop, so a stop asked meanwhile (its signal waits for the
    loop) is read from the mailbox before the terminal state is written: STOPPED."""
    rig = Rig(start_grace=1.0)
    asked: List[bool] = []

    class Sealing(Hooks):
        def before_terminal(self, reason: str, deadline: float) -> None:
            asked.append(True)  # `rgt-agent stop` wrote its request during the seal

    rig.sup = Supervisor(rig.sup.spec, rig.runner, rig.clock, rig.journal, hooks=Sealing())
    rig.sup.mailbox = lambda: rig.sup.request_stop("stop") if asked else None
    rig.sup.begin()
    rig.run_for(2.0)
    rig.sup.request_stop("preempt", grace=5.0)
    rig.exit(code=0)
    rig.sup.tick()
    assert asked and rig.sup.state == State.STOPPED


def test_fake_clock_stop_during_backoff_and_before_start() -> None:
    rig = Rig(start_grace=5.0, backoff_initial=30.0)
    rig.sup.begin()
    rig.exit(code=1)
    assert rig.sup.state == State.BACKOFF
    rig.sup.request_stop("stop")
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED
    assert rig.runner.spawned == [1]  # the backoff never turned into a start
    for reason, final in (("stop", State.STOPPED), ("preempt", State.PREEMPTED)):
        rig2 = Rig()
        rig2.sup.request_stop(reason)
        assert rig2.sup.state == final and rig2.runner.spawned == []


def test_fake_clock_stop_while_starting() -> None:
    rig = Rig(start_grace=5.0)
    rig.sup.begin()
    rig.sup.request_stop("stop", grace=1.0)
    rig.exit(sig=signal.SIGTERM)
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED


def test_fake_clock_leftovers_are_killed_before_the_next_start() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.runner.output = ""
    rig.sup.on_exit(ExitStatus(code=1))  # the main process died; a worker did not
    assert rig.runner.processes_alive
    rig.sup.tick()
    assert rig.runner.signals == [signal.SIGTERM] and rig.runner.spawned == [1]
    rig.clock.advance(LEFTOVER_GRACE)
    rig.sup.tick()
    assert rig.runner.signals[-1] == signal.SIGKILL and rig.runner.spawned == [1]
    rig.runner.processes_alive = False
    rig.sup.tick()
    assert rig.runner.spawned == [1, 2]


def test_fake_clock_deadlines_survive_a_restarted_agent() -> None:
    rig = Rig(start_grace=5.0, backoff_initial=20.0)
    rig.sup.begin()
    rig.exit(code=1)
    doc = rig.sup.to_doc()
    rig.clock.advance(15.0)
    again = Supervisor(rig.sup.spec, rig.runner, rig.clock, rig.journal, doc=doc)
    wait = again.next_wakeup()
    assert wait is not None and abs(wait - 5.0) < 1e-6  # 20 s backoff, 15 s already passed


def test_fake_clock_new_incarnation_after_a_terminal_state_resets_budgets() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    rig.exit(sig=signal.SIGKILL)
    rig.sup.tick()
    rig.sup.request_stop("stop")
    rig.exit(sig=signal.SIGTERM)
    rig.sup.tick()
    assert rig.sup.state == State.STOPPED and rig.sup.restarts == 1
    rig.sup.new_incarnation("start again")
    assert (rig.sup.state, rig.sup.incarnation, rig.sup.restarts) == (State.PENDING, 2, 0)
    rig.sup.begin()
    assert rig.runner.spawned == [1, 2, 3]  # attempt numbers go on across incarnations


def test_fake_clock_terminal_states_accept_no_input() -> None:
    rig = Rig()
    rig.sup.begin()
    rig.exit(code=0)
    before = list(rig.journal.events)
    rig.sup.request_stop("stop")
    rig.sup.tick()
    rig.sup.on_exit(ExitStatus(code=1))
    assert rig.sup.state == State.SUCCEEDED and rig.journal.events == before


def test_fake_clock_a_run_that_cannot_begin_fails_from_pending_with_no_attempt() -> None:
    rig = Rig()
    rig.sup.fail_to_begin("no verified checkpoint left", "integrity", "repair the store")
    assert rig.states() == ["FAILED"] and rig.runner.spawned == []
    last = rig.sup.last_exit
    assert last is not None and last["reason"] == "no verified checkpoint left"
    assert last["class"] == "integrity" and last["attempt"] == 0


@pytest.mark.parametrize("where", ["STARTING", "RUNNING", "BACKOFF"])
def test_fake_clock_a_power_on_that_cannot_resume_the_cut_attempt_fails_from_where_it_was(
    where: str,
) -> None:
    """`rgt-agent boot` found the run live on disk (the power cut its attempt) and what the
    next attempt resumes from cannot be had: FAILED from that state, why in last_exit. Only
    after a power-on: anywhere but PENDING it is a bug otherwise."""
    rig = Rig(start_grace=2.0)
    rig.sup.begin()
    if where != "STARTING":
        rig.run_for(3.0)
    if where == "BACKOFF":
        rig.exit(code=1, output="RuntimeError: boom\n")
    assert rig.sup.state == State(where)
    with pytest.raises(AssertionError):
        rig.sup.fail_to_begin("no verified checkpoint left", "integrity", "repair the store")
    rig.sup.fail_to_begin("no verified checkpoint left", "integrity", "repair it", power_on=True)
    assert rig.states()[-1] == "FAILED" and rig.sup.state == State.FAILED
    last = rig.sup.last_exit
    assert last is not None and last["kind"] == "begin" and last["class"] == "integrity"


class SealedHooks(Hooks):
    """The sealed step (LATEST) the test says, for the crash-loop rule."""

    def __init__(self) -> None:
        self.latest: Optional[int] = None

    def sealed_step(self) -> Optional[int]:
        return self.latest


def _with_store(rig: Rig) -> SealedHooks:
    hooks = SealedHooks()
    spec = dataclasses.replace(rig.sup.spec, store=parse_store_url("file:///tmp/rgt-store"))
    rig.sup = Supervisor(spec, rig.runner, rig.clock, rig.journal, hooks=hooks)
    return hooks


def test_fake_clock_error_ends_that_never_advance_latest_stop_as_a_crash_loop() -> None:
    rig = Rig(start_grace=1.0, max_error_restarts=10, max_stuck_restarts=3)
    hooks = _with_store(rig)
    hooks.latest = 40
    rig.sup.begin()
    for n in range(3):  # each attempt resumes from step 40 and gets nowhere
        rig.run_for(2.0)
        rig.exit(code=1, output="RuntimeError: NCCL timeout\n")
        assert rig.sup.state == State.BACKOFF, n
        rig.sup.tick()
    rig.run_for(2.0)
    rig.exit(code=1, output="RuntimeError: NCCL timeout\n")  # the 4th in a row
    assert rig.sup.state == State.FAILED and rig.runner.spawned == [1, 2, 3, 4]
    reason = rig.sup.last_exit["reason"] if rig.sup.last_exit else ""
    assert reason.startswith("crash loop: 3 restarts in a row") and "(step 40)" in reason
    assert "NCCL timeout" in reason


def test_fake_clock_error_ends_that_advance_latest_keep_restarting() -> None:
    rig = Rig(start_grace=1.0, max_error_restarts=10, max_stuck_restarts=3)
    hooks = _with_store(rig)
    rig.sup.begin()
    for n in range(6):
        rig.run_for(2.0)
        hooks.latest = 10 * (n + 1)  # each attempt sealed something newer before it died
        rig.exit(code=1)
        assert rig.sup.state == State.BACKOFF and rig.sup.stuck_restarts == 0
        rig.sup.tick()
    assert rig.runner.spawned == [1, 2, 3, 4, 5, 6, 7]


def test_fake_clock_kill_attempt_restart_ends_it_as_stalled_on_the_error_budget() -> None:
    rig = Rig(start_grace=1.0)
    rig.sup.begin()
    rig.run_for(2.0)
    why = "stalled: no step for 12.0 s, budget 10.0 s = 5 x longest interval 2.0 s, last step 7"
    assert rig.sup.kill_attempt(why, then="restart", kind="stalled", remedy="see stacks.txt")
    assert rig.runner.signals == [signal.SIGTERM]
    assert not rig.sup.kill_attempt("again", then="restart", kind="stalled")  # once
    rig.run_for(9.0)
    assert signal.SIGKILL not in rig.runner.signals  # the stop grace (10 s) first
    rig.run_for(1.5)
    assert rig.runner.signals[-1] == signal.SIGKILL
    rig.exit(sig=signal.SIGKILL)
    last = rig.sup.last_exit or {}
    assert last["kind"] == "stalled" and last["reason"].startswith(why)
    assert last["remedy"] == "see stacks.txt"
    assert rig.sup.state == State.BACKOFF and rig.sup.error_restarts == 1
    rig.sup.tick()
    assert rig.runner.spawned == [1, 2] and rig.sup.kill.doc is None


def test_fake_clock_kill_attempt_fail_ends_the_run_and_needs_a_running_attempt() -> None:
    rig = Rig(start_grace=1.0)
    assert not rig.sup.kill_attempt("nan", then="fail", kind="health")  # nothing runs yet
    rig.sup.begin()
    rig.run_for(2.0)
    assert rig.sup.kill_attempt("loss is NaN at step 30", then="fail", kind="health")
    rig.exit(sig=signal.SIGTERM)
    assert rig.sup.state == State.FAILED and rig.runner.spawned == [1]
    assert "loss is NaN at step 30" in rig.journal.events[-1]["reason"]


def test_transition_table_shape() -> None:
    assert set(TRANSITIONS) == set(State)
    for state, exits in TRANSITIONS.items():
        assert state not in exits
        assert bool(exits) == (state not in TERMINAL), state
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()


def _scenarios() -> Iterator[Tuple[str, Callable[..., None], Dict[str, Any]]]:
    """Every fake-clock scenario of this module, once per parameter."""
    for name, fn in sorted(globals().items()):
        if not name.startswith("test_fake_clock_") or fn is _edge_test:
            continue
        params = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        if not params:
            yield name, fn, {}
            continue
        (mark,) = params  # one parametrize, one argument: all this module has
        argname, values = mark.args
        for value in values:
            yield f"{name}[{value!r:.20}]", fn, {argname: value}


def test_fake_clock_scenarios_take_every_edge_of_the_table_and_no_other() -> None:
    """Runs every scenario above itself (so it holds alone and in any order): together they
    take every edge the transition table allows, and none it does not."""
    global _RIGS
    table = {(s, d) for s, exits in TRANSITIONS.items() for d in exits}
    taken: Dict[Tuple[State, State], str] = {}
    ran = 0
    for name, fn, kwargs in _scenarios():
        _RIGS = []
        try:
            fn(**kwargs)
        finally:
            rigs, _RIGS = _RIGS, None
        ran += 1
        for rig in rigs:
            for e in rig.journal.events:
                if e["kind"] == "state":
                    taken.setdefault((State(e["state_from"]), State(e["state"])), name)
    assert ran >= 15, ran  # the scenarios were found
    assert set(taken) - table == set(), {e: taken[e] for e in set(taken) - table}
    assert table - set(taken) == set(), f"edges never exercised: {table - set(taken)}"


_edge_test = test_fake_clock_scenarios_take_every_edge_of_the_table_and_no_other
