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


# Distributed jobs (onbox/agent/launchers.py). The outputs below are what torch 2.13's
# torchrun printed on this machine for two CPU ranks on gloo (paths shortened); the NCCL lines
# are NCCL's own wording, which no CPU here can produce (no GPU: a fixed text is the seam).
RANKED_IMPORT = (
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/job/train.py", line 5, in <module>\n'
    "[rank0]:     import no_such_module\n"
    "[rank0]: ModuleNotFoundError: No module named 'no_such_module'\n"
)
_LAUNCHER_TB = (
    "Traceback (most recent call last):\n"
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File "/venv/torch/distributed/launcher/api.py", line 383, in launch_agent\n'
    "    raise ChildFailedError(\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "============================================================\n"
    "train.py FAILED\n"
    "------------------------------------------------------------\n"
    "Failures:\n"
    "[1]:\n"
    "  time      : 2026-12-06_13:10:44\n"
    "  host      : localhost\n"
    "  rank      : 0 (local_rank: 0)\n"
    "  exitcode  : -15 (pid: 20122)  (SIGTERM)\n"
    "  error_file: <N/A>\n"
    "  traceback : Signal 15 (SIGTERM) received by PID 20122\n"
    "------------------------------------------------------------\n"
    "Root Cause (first observed failure):\n"
    "[0]:\n"
    "  time      : 2026-12-06_13:10:44\n"
    "  host      : localhost\n"
    "  rank      : 1 (local_rank: 1)\n"
    "  exitcode  : {code} (pid: 20123) {sig}\n"
    "  error_file: <N/A>\n"
    "  traceback : {said}\n"
    "============================================================\n"
)
GLOO_PEER = (
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/job/train.py", line 7, in <module>\n'
    "[rank0]:     dist.all_reduce(t)\n"
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:718. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error.\n"
)


def _torchrun(ranks: str, code: int, sig: str = "", said: str = "") -> str:
    return ranks + _LAUNCHER_TB.format(code=code, sig=sig, said=said or "To enable traceback")


def test_a_ranks_prefixed_import_error_is_not_retried() -> None:
    """PyTorch prefixes a rank's uncaught exception with ``[rankN]:``: the import error was
    not found, and the end read "exited with code 1", retried on the error budget."""
    v = classify(ExitStatus(code=1), "step 3\n" + RANKED_IMPORT)
    assert (v.kind, v.deterministic) == (Kind.IMPORT_ERROR, True), v
    assert v.reason == "ModuleNotFoundError: No module named 'no_such_module'", v.reason


def test_under_torchrun_the_first_failed_ranks_error_decides() -> None:
    """torchrun exits 1 with its own ChildFailedError; the first failed rank's import error
    is what ended the job (rank 0 then failed on the lost peer, and was sent SIGTERM)."""
    ranks = RANKED_IMPORT.replace("[rank0]", "[rank1]") + GLOO_PEER
    v = classify(ExitStatus(code=1), _torchrun(ranks, 1))
    assert (v.kind, v.deterministic) == (Kind.IMPORT_ERROR, True), v
    assert v.reason == "rank 1: ModuleNotFoundError: No module named 'no_such_module'", v.reason
    assert "ChildFailedError" not in v.reason


def test_under_torchrun_a_rank_the_oom_killer_ended_is_an_oom_kill() -> None:
    """Killed by the OOM killer, a rank is "exitcode -9"; torchrun's own status is 1, so the
    kill (its SIGKILL) and the cgroup's count were never put together."""
    out = _torchrun(GLOO_PEER, -9, "(SIGKILL)", "Signal 9 (SIGKILL) received by PID 20123")
    v = classify(ExitStatus(code=1), out, oom_kills_rose=True)
    assert v.kind == Kind.OOM_KILLED and v.reason.startswith("rank 1: killed by the kernel's")
    v = classify(ExitStatus(code=1), out, oom_kills_rose=False)  # killed from outside
    assert (v.kind, v.budget) == (Kind.SIGNAL, Budget.PREEMPT), v
    assert v.reason == "rank 1: killed by signal 9 (SIGKILL)", v.reason


def test_a_rank_whose_peer_went_says_so() -> None:
    """gloo's lost connection and NCCL's watchdog abort (SIGABRT) are a peer's end, not this
    rank's own fault: said as such, on the error budget, with where to look."""
    v = classify(ExitStatus(code=1), GLOO_PEER)
    assert (v.kind, v.budget, v.klass) == (Kind.PEER_LOST, Budget.ERROR, "transient"), v
    assert "another rank stopped" in v.reason and "Connection closed by peer" in v.reason
    assert "other ranks" in v.remedy and "max_error_restarts" in v.remedy
    nccl = (
        "step 41\n"
        "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=4661, "
        "NumelOut=4661, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.\n"
        "[rank0]:[E321 02:07:08.865763562 ProcessGroupNCCL.cpp:698] [Rank 0] To avoid data "
        "inconsistency, we are taking the entire process down.\n"
    )
    for status in (ExitStatus(signal=signal.SIGABRT), ExitStatus(code=128 + signal.SIGABRT)):
        v = classify(status, nccl)
        assert (v.kind, v.budget, v.step) == (Kind.PEER_LOST, Budget.ERROR, 41), v
        assert "Watchdog caught collective operation timeout" in v.reason, v.reason
    # Another rank's words in the output are not this process's end.
    v = classify(ExitStatus(code=1), GLOO_PEER + TB + "ValueError: bad shape\n")
    assert v.kind == Kind.PYTHON_EXCEPTION, v


def test_a_plain_jobs_reset_connection_is_its_own_exception_not_a_lost_rank() -> None:
    """ "Connection reset by peer" is any socket's error (a dataset download, an HTTP API):
    a single-process job that ended on it ended on its own exception, as before, and one
    that aborted after a download retried on it crashed; neither lost a rank."""
    for exc in (
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        "requests.exceptions.ConnectionError: ('Connection aborted.', "
        "ConnectionResetError(104, 'Connection reset by peer'))",
    ):
        v = classify(ExitStatus(code=1), "step 7\n" + TB + exc + "\n")
        assert (v.kind, v.reason) == (Kind.PYTHON_EXCEPTION, exc), v
    retried = "Retrying after ConnectionResetError(104, 'Connection reset by peer')\nstep 8\n"
    v = classify(ExitStatus(signal=signal.SIGABRT), retried + "terminate called, aborting\n")
    assert v.kind == Kind.CRASHED, v
    gloo = GLOO_PEER.replace(
        "553] Connection closed", "598] Read error [10.0.0.2]:41018: Connection reset"
    )
    assert classify(ExitStatus(code=1), gloo).kind == Kind.PEER_LOST  # gloo's, still


def test_torchrun_tee_prefixes_are_taken_off_too() -> None:
    """``torchrun --tee 3`` puts ``[defaultN]:`` before PyTorch's ``[rankN]:``."""
    ranks = "".join(
        "[default1]:" + ln + "\n" for ln in RANKED_IMPORT.replace("0]", "1]").split("\n") if ln
    )
    v = classify(ExitStatus(code=1), _torchrun(ranks, 1))
    assert v.kind == Kind.IMPORT_ERROR and v.reason.startswith("rank 1: ModuleNotFoundError"), v


def test_a_killed_dataloader_worker_is_an_oom_kill_only_when_the_count_rose() -> None:
    tail = TB + "RuntimeError: DataLoader worker (pid(s) 5666) exited unexpectedly\n"
    assert classify(ExitStatus(code=1), tail).kind == Kind.PYTHON_EXCEPTION
    v = classify(ExitStatus(code=1), tail, oom_kills_rose=True)
    assert v.kind == Kind.OOM_KILLED and "DataLoader worker" in v.reason, v


def test_a_quota_exceeded_is_a_full_disk_whatever_df_says() -> None:
    """EDQUOT (a RunPod network volume past its size, a shared box's user quota) read as a
    Python exception, "fix the error shown in the log". This kernel has no quota support
    (no CONFIG_QFMT_V2, no tmpfs quota), so the errno's text is the seam here."""
    tail = TB + "OSError: [Errno 122] Disk quota exceeded: '/workspace/ckpt/step_9/model.pt'\n"
    v = classify(ExitStatus(code=1), tail, inodes_exhausted=lambda: False)
    assert (v.kind, v.budget, v.klass) == (Kind.DISK_FULL, Budget.ERROR, "permanent"), v
    assert "quota" in v.reason and "quota" in v.remedy and "df" in v.remedy, v


# torch.multiprocessing.spawn (onbox/agent/launchers.py): what torch 2.13 printed on this
# machine for a parent whose child 1 raised, or was killed (paths shortened).
_SPAWN_PARENT = (
    "W1206 16:25:22.675000 29340 torch/multiprocessing/spawn.py:165] Terminating process 29375 "
    "via signal SIGTERM\n"
    "Traceback (most recent call last):\n"
    '  File "/job/spawned.py", line 16, in <module>\n'
    "    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)\n"
    '  File "/venv/torch/multiprocessing/spawn.py", line 340, in spawn\n'
    '    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")\n'
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/venv/torch/multiprocessing/spawn.py", line 296, in start_processes\n'
    "    while not context.join():\n"
    "              ^^^^^^^^^^^^^^\n"
)
_CHILD_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/torch/multiprocessing/spawn.py", line 87, in _wrap\n'
    "    fn(i, *args)\n"
    '  File "/job/spawned.py", line 6, in work\n'
)
SPAWN_RAISED = (
    "step 9\n"
    + _SPAWN_PARENT
    + '  File "/venv/torch/multiprocessing/spawn.py", line 211, in join\n'
    "    raise ProcessRaisedException(msg, error_index, failed_process.pid)\n"
    "torch.multiprocessing.spawn.ProcessRaisedException: \n\n"
    "-- Process 1 terminated with the following error:\n"
    + _CHILD_TB
    + "    import no_such_module_rgt  # noqa: F401\n"
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "ModuleNotFoundError: No module named 'no_such_module_rgt'\n\n"
)
SPAWN_EXITED = (
    "step 5\n"
    + _SPAWN_PARENT
    + '  File "/venv/torch/multiprocessing/spawn.py", line 192, in join\n'
    "    raise ProcessExitedException(\n"
    "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with {how}\n"
)


def test_a_spawned_childs_own_exception_decides_and_is_named() -> None:
    v = classify(ExitStatus(code=1), SPAWN_RAISED)
    assert (v.kind, v.deterministic, v.step) == (Kind.IMPORT_ERROR, True, 9), v
    assert v.reason == "process 1: ModuleNotFoundError: No module named 'no_such_module_rgt'"
    # A child's chained exception: its last one, as for any traceback.
    chained = SPAWN_RAISED.replace(
        "ModuleNotFoundError: No module named 'no_such_module_rgt'\n",
        "KeyError: 'a'\n\nDuring handling of the above exception, another exception occurred:"
        "\n\n" + _CHILD_TB + "ValueError: bad shard\n",
    )
    assert classify(ExitStatus(code=1), chained).reason == "process 1: ValueError: bad shard"
    # A parent that went on after the child's failure and then failed of its own is not it.
    later = SPAWN_RAISED + "retrying without workers\n" + TB + "OSError: disk gone\n"
    v = classify(ExitStatus(code=1), later)
    assert (v.kind, v.reason) == (Kind.PYTHON_EXCEPTION, "OSError: disk gone"), v


def test_a_spawned_child_ended_by_a_signal_is_told_as_its_signal() -> None:
    """The parent's ProcessExitedException and exit code 1 read as its own Python exception,
    on the error budget: a child the OOM killer took, or one killed from outside, was not
    told."""
    out = SPAWN_EXITED.format(how="signal SIGKILL")
    v = classify(ExitStatus(code=1), out, oom_kills_rose=True)
    assert v.kind == Kind.OOM_KILLED and v.reason.startswith("process 1: killed by the kernel's")
    v = classify(ExitStatus(code=1), out)
    assert (v.kind, v.budget, v.step) == (Kind.SIGNAL, Budget.PREEMPT, 5), v
    assert v.reason == "process 1: killed by signal 9 (SIGKILL)", v.reason
    v = classify(ExitStatus(code=1), SPAWN_EXITED.format(how="signal SIGSEGV"))
    assert (v.kind, v.budget) == (Kind.CRASHED, Budget.ERROR), v
    v = classify(ExitStatus(code=1), SPAWN_EXITED.format(how="exit code 3"))
    assert (v.kind, v.reason) == (Kind.EXIT_CODE, "process 1: exited with code 3"), v


def test_a_spawn_exception_the_job_went_on_from_is_not_its_end() -> None:
    """Only the job's final traceback is mp.spawn's word on a child: one logged and gone on
    from, or one behind a parent ended otherwise, would put a crash loop on the preemption
    budget (tests/integration/test_distributed_exits.py runs the real job)."""
    out = SPAWN_EXITED.format(how="signal SIGKILL")
    went_on = out + "spawn 0 failed; retrying\ngiving up\n"
    v = classify(ExitStatus(code=1), went_on)
    assert (v.kind, v.budget) == (Kind.PYTHON_EXCEPTION, Budget.ERROR), v
    # The parent logged it, printed nothing more, and then a signal ended it: the parent's own.
    v = classify(ExitStatus(signal=15), SPAWN_EXITED.format(how="signal SIGSEGV"))
    assert (v.kind, v.budget, v.reason) == (
        Kind.SIGNAL,
        Budget.PREEMPT,
        "killed by signal 15 (SIGTERM)",
    )
    v = classify(ExitStatus(code=3), SPAWN_RAISED)
    assert v.reason == "ModuleNotFoundError: No module named 'no_such_module_rgt'", v
    # What Python prints as it shuts down after the uncaught exception is no more of the job.
    leaked = (
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
        "resource_tracker: There appear to be 1 leaked semaphore objects to clean up at "
        "shutdown\n  warnings.warn('resource_tracker: There appear to be %d '\n"
    )
    v = classify(ExitStatus(code=1), out + "\n" + leaked)
    assert (v.kind, v.budget, v.reason) == (
        Kind.SIGNAL, Budget.PREEMPT, "process 1: killed by signal 9 (SIGKILL)"
    ), v  # fmt: skip
