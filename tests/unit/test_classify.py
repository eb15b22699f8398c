"""Every way a job ends becomes a reason a person can act on and a budget it spends."""

from __future__ import annotations

import signal

import pytest

from onbox.agent.classify import Budget, ExitStatus, Kind, classify, last_exception

TB = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    main()\n'


@pytest.mark.parametrize(
    "status,tail,kind,budget",
    [
        (ExitStatus(code=0), "", Kind.SUCCESS, Budget.NONE),
        (ExitStatus(signal=signal.SIGKILL), "step 3\n", Kind.SIGNAL, Budget.PREEMPT),
        (ExitStatus(code=143), "", Kind.SIGNAL, Budget.PREEMPT),
        (
            ExitStatus(code=1),
            TB + "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB\n",
            Kind.CUDA_OOM,
            Budget.ERROR,
        ),
        (ExitStatus(code=1), "step 7 loss nan\n", Kind.NAN_LOSS, Budget.ERROR),
        (
            ExitStatus(code=1),
            TB + "OSError: [Errno 28] No space left on device\n",
            Kind.DISK_FULL,
            Budget.ERROR,
        ),
        (ExitStatus(code=1), TB + "ValueError: bad shape\n", Kind.PYTHON_EXCEPTION, Budget.ERROR),
        (
            ExitStatus(code=1),
            TB + "mylib.errors.ShardMissing: shard 7\n",
            Kind.PYTHON_EXCEPTION,
            Budget.ERROR,
        ),
        (
            ExitStatus(code=1),
            TB + "ModuleNotFoundError: No module named 'x'\n",
            Kind.IMPORT_ERROR,
            Budget.ERROR,
        ),
        (
            ExitStatus(code=1),
            '  File "t.py", line 1\n    def (\nSyntaxError: invalid syntax\n',
            Kind.SYNTAX_ERROR,
            Budget.ERROR,
        ),
        (
            ExitStatus(code=127, note="could not start 'trian.py': No such file"),
            "",
            Kind.COMMAND_NOT_FOUND,
            Budget.ERROR,
        ),
        (ExitStatus(code=3), "done?\n", Kind.EXIT_CODE, Budget.ERROR),
        (ExitStatus(), "", Kind.UNKNOWN, Budget.PREEMPT),
    ],
)
def test_kinds(status: ExitStatus, tail: str, kind: Kind, budget: Budget) -> None:
    v = classify(status, tail)
    assert (v.kind, v.budget) == (kind, budget)
    assert v.reason
    if kind != Kind.SUCCESS:
        assert v.klass in ("transient", "permanent", "integrity", "usage")
        assert v.remedy


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGSEGV,
        signal.SIGABRT,
        signal.SIGBUS,
        signal.SIGFPE,
        signal.SIGILL,
        signal.SIGSYS,
        signal.SIGTRAP,
    ],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_signal_of_the_jobs_own_fault_is_a_crash_on_the_error_budget(sig: int) -> None:
    name = signal.Signals(sig).name
    for status, said in (
        (ExitStatus(signal=sig), f"crashed with signal {sig} ({name})"),
        (ExitStatus(code=128 + sig), f"crashed with signal {sig} ({name}) (a shell's exit code"),
    ):
        v = classify(status, "step 40\nFatal Python error: Segmentation fault\n")
        assert (v.kind, v.budget, v.klass) == (Kind.CRASHED, Budget.ERROR, "permanent"), status
        assert v.reason.startswith(said), v.reason
        assert "log" in v.remedy and "core dump" in v.remedy
        assert v.step == 40 and not v.deterministic


@pytest.mark.parametrize(
    "sig, limit",
    [(signal.SIGXFSZ, "RLIMIT_FSIZE"), (signal.SIGXCPU, "RLIMIT_CPU")],
    ids=["SIGXFSZ", "SIGXCPU"],
)
def test_a_resource_limit_of_the_jobs_own_is_a_crash_on_the_error_budget(
    sig: int, limit: str
) -> None:
    """The kernel sends SIGXFSZ / SIGXCPU when the job passes a limit it runs under: the next
    attempt meets the same limit, so it is no outside kill (the preemption budget's 100
    tries), but a crash that spends the error budget, with the limit named."""
    name = signal.Signals(sig).name
    for status in (ExitStatus(signal=sig), ExitStatus(code=128 + sig)):
        v = classify(status, "step 7\n")
        assert (v.kind, v.budget, v.klass) == (Kind.CRASHED, Budget.ERROR, "permanent"), status
        assert name in v.reason and limit in v.reason, v.reason
        assert limit in v.remedy and v.step == 7 and not v.deterministic


def test_abort_after_a_printed_traceback_is_still_a_crash() -> None:
    v = classify(ExitStatus(signal=signal.SIGABRT), TB + "RuntimeError: caught, then abort\n")
    assert (v.kind, v.budget) == (Kind.CRASHED, Budget.ERROR)


@pytest.mark.parametrize(
    "status",
    [
        ExitStatus(signal=signal.SIGTERM),
        ExitStatus(signal=signal.SIGINT),
        ExitStatus(signal=signal.SIGHUP),
        ExitStatus(signal=signal.SIGQUIT),
        ExitStatus(signal=signal.SIGKILL),
        ExitStatus(code=128 + signal.SIGTERM),
        ExitStatus(code=128 + signal.SIGKILL),
        ExitStatus(code=128 + signal.SIGINT),
        ExitStatus(code=128 + signal.SIGHUP),
    ],
)
def test_a_signal_from_outside_is_a_preemption(status: ExitStatus) -> None:
    v = classify(status, "")
    assert (v.kind, v.budget, v.klass) == (Kind.SIGNAL, Budget.PREEMPT, "transient")
    assert v.reason.startswith("killed by signal ")


def test_oom_killer_needs_the_cgroup_count_to_rise() -> None:
    killed = ExitStatus(signal=signal.SIGKILL)
    assert classify(killed, "", oom_kills_rose=True).kind == Kind.OOM_KILLED
    assert classify(ExitStatus(code=137), "", oom_kills_rose=True).kind == Kind.OOM_KILLED
    assert classify(killed, "", oom_kills_rose=False).kind == Kind.SIGNAL


def test_enospc_from_inodes() -> None:
    tail = TB + "OSError: [Errno 28] No space left on device\n"
    v = classify(ExitStatus(code=1), tail, inodes_exhausted=lambda: True)
    assert v.kind == Kind.INODES_EXHAUSTED and "inode" in v.reason


def test_exception_message_and_step_are_kept() -> None:
    v = classify(ExitStatus(code=1), "step 10\nstep 11\n" + TB + "KeyError: 'labels'\n")
    assert v.reason == "KeyError: 'labels'" and v.step == 11
    assert v.deterministic is False


def test_last_exception_of_a_chain() -> None:
    tail = (
        TB + "KeyError: 'a'\n\nDuring handling of the above exception, another exception "
        "occurred:\n\n" + TB + "ValueError: second\n"
    )
    assert last_exception(tail) == ("ValueError", "second")
