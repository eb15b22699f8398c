"""A preemption that arrives while the agent restores the checkpoint, before the job starts.

A spot box boots, `rgt-agent start` begins restoring a large checkpoint from the store, and the
box is reclaimed: SIGTERM reaches the agent mid-restore (or a person's Ctrl-C, SIGINT). The agent
must end cleanly (not by Python's default handler): the restore stops, nothing torn is left
under a final name, the run is PREEMPTED (STOPPED) with an event saying the restore was cut, and
the next start restores and resumes.

Real processes, a real ``file://`` store, real signals. Each file's copy holds after each piece
until the restore is stopped (``RGT_HOLD_AT``, onbox/common/faults.py): the restore cannot end
before the signal, so the signal lands mid-restore however slow the test or the machine is.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from controller.deploy.boxstart import start_failed
from onbox.agent import procfs
from onbox.common.errors import FINAL_EXIT_CODES
from onbox.common.faults import STOP_AFTER_EVENT
from onbox.sealing import fetch
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from onbox.sealing.stores.filecopy import COPY_CHUNK, SMALL_FILE
from tests.conftest import Cli, agent_exe
from tests.sealsvc import old_box_sealer

RUN = "cut"
STEP = 10
# Files copied in pieces (larger than SMALL_FILE), so that the hold point after each piece
# keeps the restore from ending before the test's signal (HOLD).
FILES = 8
FILE_SIZE = SMALL_FILE + (1 << 20)
HOLD = "copy.after_piece"  # RGT_HOLD_AT: each copy waits after its piece until it is stopped
JOB = [sys.executable, "-c", "import os; print('resume=' + os.environ['RGT_RESUME_FROM'])"]


def _seal_old_box(store: Store, ckpt: str, tmp_path: Any) -> None:
    """Seal the one checkpoint in ``ckpt`` with the real Sealer, as the run's old box did."""
    sealer = old_box_sealer(RUN, ckpt, store, tmp_path)
    assert sealer.seal_pending() == 1


def _seal_big(root: str, tmp_path: Any) -> Dict[str, bytes]:
    """One directory checkpoint of FILES files at step STEP, sealed by the real Sealer."""
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "old-box-ckpt")
    path = os.path.join(ckpt, f"ckpt_{STEP}")
    os.makedirs(path)
    files = {f"shard_{i:03d}.bin": os.urandom(FILE_SIZE) for i in range(FILES)}
    for rel, data in files.items():
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(path, ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    _seal_old_box(store, ckpt, tmp_path)
    return files


def _child_of(parent: int, deadline: float) -> int:
    """The pid of ``parent``'s child (the agent `start` spawned)."""
    while time.monotonic() < deadline:
        for pid in procfs.pids():
            st = procfs.read_stat(pid)
            if st is not None and st.ppid == parent and st.state not in ("Z", "X"):
                return pid
        time.sleep(0.01)
    raise AssertionError("`rgt-agent start` spawned no agent")


@contextlib.contextmanager
def _starting(cli: Cli, url: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """`rgt-agent start` of RUN from the store ``url``, with ``env`` added to its environment
    (a hold point, a seam); killed by PID if it is still running when the test leaves."""
    start = subprocess.Popen(
        [*agent_exe(), "start", "--name", RUN, "--store", url, "--", *JOB],
        env=dict(cli.env, **env),
        cwd=cli.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield start
    finally:
        if start.poll() is None:
            start.kill()
            start.wait()


def _stopped(pid: int) -> None:
    """Until ``pid`` is stopped (or gone)."""
    while True:
        st = procfs.read_stat(pid)
        if st is None or st.state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.001)


def _wait_mid_restore(ckpt: str, deadline: float) -> None:
    """Until the agent's restore has a staging directory. The restore holds (HOLD) until a
    signal stops it: no file is in place before, whatever the machine's speed."""
    final = os.path.join(ckpt, f"ckpt_{STEP}")
    while not glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*")):
        assert time.monotonic() < deadline, "the agent never began its restore"
        time.sleep(0.01)
    assert not os.path.exists(final), "the restore put a file in place before it was stopped"


def _signal_mid_restore(agent: int, sig: int, ckpt: str, deadline: float) -> None:
    """``sig`` to the agent once its restore has a staging directory. The signal goes to the
    running agent, whose main thread takes it at once."""
    _wait_mid_restore(ckpt, deadline)
    os.kill(agent, sig)


@pytest.mark.parametrize("sig, final_state", [("SIGTERM", "PREEMPTED"), ("SIGINT", "STOPPED")])
def test_a_signal_during_the_restore_ends_the_run_cleanly_and_the_next_start_resumes(
    cli: Cli, tmp_path: Any, sig: str, final_state: str
) -> None:
    """SIGTERM (a preemption) ends the run PREEMPTED, which `rgt-agent boot` starts again at
    the next power-on; SIGINT (a stop) ends it STOPPED. Before the fix the agent died of
    Python's default handler: the run stayed PENDING with no agent and no event."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    files = _seal_big(root, tmp_path)
    url = "file://" + root
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    with _starting(cli, url, RGT_HOLD_AT=HOLD) as start:
        deadline = time.monotonic() + 60
        agent = _child_of(start.pid, deadline)
        _signal_mid_restore(agent, signal.Signals[sig], ckpt, deadline)
        out, err = start.communicate(timeout=60)
    # `start` says the run did not start, and exits as `run` does for that state (it printed
    # "started run cut: ..., PREEMPTED" and exited 0, as if the job were on its way).
    assert start.returncode == FINAL_EXIT_CODES[final_state], (out, err)
    assert "started" not in out, out
    assert f"run {RUN} did not start" in err and final_state in err, err
    assert f"rgt-agent start --name {RUN}" in err, err
    # The agent ended by itself, the run PREEMPTED before any attempt, and said why.
    st = cli.wait_over(RUN, final_state, timeout=60)
    assert st["attempt"] == 0, st
    events = cli.events(RUN)
    kinds = [e["kind"] for e in events]
    (cut,) = [e for e in events if e["kind"] == "restore_interrupted"]
    assert sig in cut["reason"] and cut["class"] == "transient", cut
    assert (sig == "SIGTERM") == ("preempt" in kinds), kinds
    assert [e["state"] for e in events if e["kind"] == "state"] == [final_state], events
    assert "restored" not in kinds
    attempts = os.path.join(cli.home, "runs", RUN, "attempts")
    assert not os.path.isdir(attempts) or not os.listdir(attempts)  # the job never ran
    # Nothing torn under a final name: whatever is in place is whole (a stage may be left).
    final = os.path.join(ckpt, f"ckpt_{STEP}")
    for rel in os.listdir(final) if os.path.isdir(final) else []:
        with open(os.path.join(final, rel), "rb") as f:
            assert f.read() == files[rel], rel
    # The next start restores (clearing what the cut one left) and the job resumes from it.
    cli("start", "--name", RUN, "--store", url, "--", *JOB, check=True, timeout=120)
    cli.wait_over(RUN, "SUCCEEDED", timeout=120)
    assert f"resume={final}" in cli("logs", RUN, check=True).stdout
    assert glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*")) == []
    for rel, data in files.items():
        with open(os.path.join(final, rel), "rb") as f:
            assert f.read() == data, rel
    assert "restored" in [e["kind"] for e in cli.events(RUN)]


def _staged_held(ckpt: str) -> List[str]:
    """The staging files of the restore that hold their first piece (HOLD: each copy waits
    there until the restore stops)."""
    held = []
    for p in glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*", "*")):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(p).st_size >= min(COPY_CHUNK, FILE_SIZE):
                held.append(p)
    return held


# tgkill(2)'s number, for a signal to one thread of another process (os has no call for it).
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


@pytest.mark.skipif(SYS_TGKILL is None, reason="tgkill's syscall number unknown on this CPU")
def test_a_sigterm_a_worker_thread_takes_stops_the_restore_all_the_same(
    cli: Cli, tmp_path: Any
) -> None:
    """The kernel hands a process's SIGTERM to any thread not blocking it (another than the
    main one when that is stopped or already has a signal pending), and Python runs the
    handler in the main thread only, once it runs again. The restore's main thread waited
    for the next file to end with no timeout, so a SIGTERM that a copying thread took was not
    acted on before that file was whole (never, here: each file is held until the restore
    stops). Sent to one worker thread (tgkill), it now stops the restore as one to the process
    does: PREEMPTED, `restore_interrupted`, nothing in place."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal_big(root, tmp_path)
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    with _starting(cli, "file://" + root, RGT_HOLD_AT=HOLD) as start:
        deadline = time.monotonic() + 60
        agent = _child_of(start.pid, deadline)
        _wait_mid_restore(ckpt, deadline)
        # Every copying thread holds its file after its first piece, so the main thread has
        # handed out the files and waits for one to end (in the kernel, not running: state S).
        while not (
            len(_staged_held(ckpt)) == min(fetch.FILES, FILES)
            and procfs.read_stat(agent) is not None
            and procfs.read_stat(agent).state == "S"  # type: ignore[union-attr]
        ):
            assert time.monotonic() < deadline, "the restore's copies never all held"
            time.sleep(0.01)
        workers = sorted(int(t) for t in os.listdir(f"/proc/{agent}/task") if int(t) != agent)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_TGKILL, agent, workers[0], signal.SIGTERM) != 0:
            raise OSError(ctypes.get_errno(), "tgkill")
        out, err = start.communicate(timeout=60)
    assert start.returncode == FINAL_EXIT_CODES["PREEMPTED"], (out, err)
    cli.wait_over(RUN, "PREEMPTED", timeout=60)
    kinds = [e["kind"] for e in cli.events(RUN)]
    assert "restore_interrupted" in kinds and "restored" not in kinds, kinds
    assert not os.path.exists(os.path.join(ckpt, f"ckpt_{STEP}"))


BIG = 1 << 30  # one file: a kernel copy of it all takes long enough for a signal to land in it


def _seal_one_big(root: str, tmp_path: Any) -> None:
    """One file checkpoint ``step_<STEP>.pt`` of BIG real bytes, sealed by the real Sealer."""
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "old-box-ckpt")
    os.makedirs(ckpt)
    block = os.urandom(1 << 20)
    with open(os.path.join(ckpt, f"step_{STEP}.pt"), "wb") as f:
        for _ in range(BIG >> 20):
            f.write(block)
    _seal_old_box(store, ckpt, tmp_path)
    os.unlink(os.path.join(ckpt, f"step_{STEP}.pt"))  # the disk is the test's only budget


def test_a_sigterm_stops_the_restore_of_one_large_file_part_way(cli: Cli, tmp_path: Any) -> None:
    """The restore of one large file from a file:// store was one kernel copy of it all, which
    no signal cuts short: after a SIGTERM (a preemption with a short grace) the agent went on
    copying and hashing to the last byte before it ended. The copy is made in bounded pieces,
    and a stopped restore copies no further piece: its staging file never grows to the whole."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal_one_big(root, tmp_path)
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    # The copy waits after each piece until the restore is stopped (onbox/common/faults.py):
    # the SIGTERM lands mid-copy however slow the test is to send it.
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)  # a GiB: not left for pytest
        start = stack.enter_context(_starting(cli, "file://" + root, RGT_HOLD_AT=HOLD))
        deadline = time.monotonic() + 60
        agent = _child_of(start.pid, deadline)
        staged: List[str] = []
        before = 0
        while not before:  # the staging file of the one file holds its first piece
            assert time.monotonic() < deadline, "the agent never began its restore"
            staged = glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*", "0"))
            with contextlib.suppress(FileNotFoundError, IndexError):
                before = os.stat(staged[0]).st_size
            time.sleep(0.01)  # not a busy loop: the agent's threads need the cores
        os.kill(agent, signal.SIGTERM)
        assert before < BIG, "the copy was over before the test could signal"
        most = before
        while True:  # the file's size until the stopped restore removes its stage
            assert time.monotonic() < deadline, "the agent did not end its restore"
            try:
                most = max(most, os.stat(staged[0]).st_size)
            except FileNotFoundError:
                break
            time.sleep(0.001)
        start.communicate(timeout=60)
    cli.wait_over(RUN, "PREEMPTED", timeout=60)
    assert [e["kind"] for e in cli.events(RUN) if e["kind"] == "restore_interrupted"] == [
        "restore_interrupted"
    ]
    # Stopped part way: the stage never held the whole file, nor a piece after the one the
    # SIGTERM found, and nothing is in place.
    assert most < BIG, f"the restore copied all {BIG} bytes after the SIGTERM"
    assert most <= COPY_CHUNK, f"{most} bytes: the stopped restore copied a further piece"
    assert not os.path.exists(os.path.join(ckpt, f"step_{STEP}.pt"))
    assert glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*", "0")) == []


def _seal_small(root: str, tmp_path: Any) -> None:
    """One small directory checkpoint at step STEP, sealed by the real Sealer."""
    ckpt = str(tmp_path / "old-box-ckpt")
    os.makedirs(os.path.join(ckpt, f"ckpt_{STEP}"))
    with open(os.path.join(ckpt, f"ckpt_{STEP}", "weights.bin"), "wb") as f:
        f.write(os.urandom(4096))
    with open(os.path.join(ckpt, f"ckpt_{STEP}", ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    _seal_old_box(open_store("file://" + root), ckpt, tmp_path)


@pytest.mark.parametrize("sig, final_state", [("SIGTERM", "PREEMPTED"), ("SIGINT", "STOPPED")])
def test_a_signal_just_as_the_restore_completes_ends_the_run_as_one_mid_restore_does(
    cli: Cli, tmp_path: Any, sig: str, final_state: str
) -> None:
    """The signal lands at the exact moment the restore is complete (the checkpoint verified
    and in place, its `restored` event written) and the job not started: the agent stops
    itself there (the journal's test seam) and the signal is sent while it is stopped. A
    SIGTERM is a preemption (PREEMPTED: the run resumes on the next box or power-on), a
    SIGINT a stop (STOPPED), as mid-restore; the events do not say the restore was cut."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal_small(root, tmp_path)
    url = "file://" + root
    with _starting(cli, url, **{STOP_AFTER_EVENT: "restored"}) as start:
        agent = _child_of(start.pid, time.monotonic() + 60)
        _stopped(agent)  # after its `restored` event, by itself
        assert [e["kind"] for e in cli.events(RUN)][-1] == "restored"
        os.kill(agent, signal.Signals[sig])  # delivered at SIGCONT: no later, no sooner
        os.kill(agent, signal.SIGCONT)
        out, err = start.communicate(timeout=60)
    assert start.returncode == FINAL_EXIT_CODES[final_state], (out, err)
    assert f"run {RUN} did not start" in err and final_state in err, err
    st = cli.wait_over(RUN, final_state, timeout=60)
    assert st["attempt"] == 0, st
    events = cli.events(RUN)
    kinds = [e["kind"] for e in events]
    assert kinds.index("restored") < kinds.index("restore_interrupted"), kinds
    (cut,) = [e for e in events if e["kind"] == "restore_interrupted"]
    assert sig in cut["reason"] and "the job did not start" in cut["reason"], cut
    assert "the restore stopped" not in cut["reason"], cut  # it had completed
    assert (sig == "SIGTERM") == ("preempt" in kinds), kinds
    assert [e["state"] for e in events if e["kind"] == "state"] == [final_state], events
    attempts = os.path.join(cli.home, "runs", RUN, "attempts")
    assert not os.path.isdir(attempts) or not os.listdir(attempts)  # the job never ran
    # The next start resumes from the checkpoint that restore put in place.
    cli("start", "--name", RUN, "--store", url, "--", *JOB, check=True, timeout=120)
    cli.wait_over(RUN, "SUCCEEDED", timeout=120)
    final = os.path.join(cli.home, "runs", RUN, "ckpt", f"ckpt_{STEP}")
    assert f"resume={final}" in cli("logs", RUN, check=True).stdout


def _agent_of(home: str, deadline: float) -> int:
    """The pid of the agent of a run under ``home`` (``python -m onbox.agent.loop``)."""
    while time.monotonic() < deadline:
        for pid in procfs.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if b"onbox.agent.loop" in cmd and f"RGT_HOME={home}".encode() in env:
                return pid
        time.sleep(0.01)
    raise AssertionError("no agent came up")


def _preempt_at_epoch(argv: List[str], cli: Cli) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a `start` or a `boot`), SIGTERM its agent right after it took its epoch
    (the journal's seam: it stops itself there), before its restore; what ``argv`` printed."""
    p = subprocess.Popen(
        argv,
        env=dict(cli.env, **{STOP_AFTER_EVENT: "epoch"}),
        cwd=cli.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        agent = _agent_of(cli.home, time.monotonic() + 60)
        _stopped(agent)
        os.kill(agent, signal.SIGTERM)
        os.kill(agent, signal.SIGCONT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_a_run_preempted_in_its_restore_is_said_so_by_boot_and_by_the_laptop(
    cli: Cli, tmp_path: Any
) -> None:
    """`rgt-agent boot` of such a run said "(no output)" (or the store's first line) for it, and
    the laptop's deploy "rgt-agent start failed (exit 13)": both now say the run did not start
    because of a preemption during its restore, and what to do."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal_small(root, tmp_path)
    start = [*agent_exe(), "start", "--name", RUN, "--store", "file://" + root, "--", *JOB]
    first = _preempt_at_epoch(start, cli)
    assert first.returncode == FINAL_EXIT_CODES["PREEMPTED"], first
    cli.wait_over(RUN, "PREEMPTED", timeout=60)
    # The laptop's deploy, given what that real `rgt-agent start` printed and exited with.
    e = start_failed("box1", RUN, first.returncode, first.stderr)
    assert e.exit_code == FINAL_EXIT_CODES["PREEMPTED"] and "failed" not in e.what, e.line()
    assert f"run {RUN} did not start on box1: the box was preempted" in e.what, e.line()
    assert "restored" in e.what and "PREEMPTED" in e.what, e.line()
    assert "`rgt deploy` again" in (e.remedy or ""), e.line()
    # A power-on: `boot` starts it again, and it is preempted in its restore once more.
    with open(os.path.join(cli.home, "boot_id"), "w") as f:
        f.write("a-boot-before\n")
    boot = _preempt_at_epoch([*agent_exe(), "boot"], cli)
    first_line = boot.stdout.splitlines()[0]
    assert first_line.startswith(
        f"rgt-agent boot: {RUN}: not started: run {RUN} did not start: "
        "a SIGTERM (a preemption) came"
    ), boot.stdout
    assert "PREEMPTED" in first_line and "rgt-agent boot" in first_line, boot.stdout
    assert "(no output)" not in boot.stdout + boot.stderr, boot
    assert cli.wait_over(RUN, "PREEMPTED", timeout=60)["attempt"] == 0
