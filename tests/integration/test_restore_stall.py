"""A restore whose store stops answering in the middle of the download.

`rgt-agent start` restores the newest sealed checkpoint before the job starts, and `start` (and
the laptop's `rgt deploy` over it) waits for the whole restore, as long as the agent beats. The
beat is a thread of its own, so a store that stops sending mid-body (a black-holed network, a
stopped server, a hung mount) held the restore, and both waits, for as long as the client's read
timeout and retries allowed (minutes for S3), or for ever (a mount). Now a download that moves
nothing for the job file's ``[store] stall`` ends as a transient store error (exit 14) naming the
store and how long nothing moved, the run FAILED with a ``restore_failed`` event (a new run
that `start` made then goes from the box whole), and nothing under a final name.

Real processes, real signals. The S3 store is a SeaweedFS of the test's own (``weed mini``),
SIGSTOPped once the restore has begun its download (and SIGCONTed in a ``finally``); the agent is
stopped for that moment, so the download cannot end before the store does. The ``file://``
store's copies hold after their first piece (``RGT_HOLD_AT``, onbox/common/faults.py) until the
restore is stopped, as a read from a hung mount would: never released by the test.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from onbox.agent import procfs
from onbox.sealing import fetch
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.stall import RestoreStalled, Stall, stage_marks
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from onbox.sealing.stores.filecopy import SMALL_FILE
from tests import seaweed
from tests.conftest import Cli, agent_exe, require
from tests.laptop import nesting
from tests.polling import wait
from tests.sealsvc import old_box_sealer
from tests.seaweed import start_seaweed

RUN = "stall"
STEP = 10
JOB = [sys.executable, "-c", "import os; print('resume=' + os.environ['RGT_RESUME_FROM'])"]
# Large enough that the download outlasts the moment the test stops the store: what the kernel
# buffers of a loopback connection hold after the stop is a few MiB.
S3_FILE = 48 << 20
WAIT = 60.0  # the test's bound on `start`; before the fix S3's read timeout alone was 60 s


def _seal(store: Store, tmp_path: Any, size: int, files: int = 2) -> None:
    """One checkpoint of ``files`` files of ``size`` bytes at step STEP, sealed by the real
    Sealer, as the run's old box did."""
    ckpt = str(tmp_path / "old-box-ckpt")
    path = os.path.join(ckpt, f"ckpt_{STEP}")
    os.makedirs(path)
    for i in range(files):
        with open(os.path.join(path, f"shard_{i}.bin"), "wb") as f:
            f.write(os.urandom(size))
    with open(os.path.join(path, ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    sealer = old_box_sealer(RUN, ckpt, store, tmp_path)
    assert sealer.seal_pending() == 1


def _child_of(parent: int) -> int:
    """The pid of ``parent``'s child (the agent `start` spawned)."""
    found: List[int] = []

    def child() -> bool:
        found[:] = [
            p
            for p in procfs.pids()
            if (st := procfs.read_stat(p)) is not None
            and st.ppid == parent
            and st.state not in ("Z", "X")
        ]
        return bool(found)

    wait(child, 60, "`rgt-agent start` to spawn an agent", poll=0.01)
    return found[0]


def _job_file(where: Any, store: str, stall: str) -> str:
    """A job file for RUN in the directory ``where`` whose store moves nothing for ``stall``."""
    path = str(where / "job.toml")
    with open(path, "w") as f:
        f.write(f'name = "{RUN}"\n[store]\nurl = "{store}"\nstall = "{stall}"\n')
    return path


@contextlib.contextmanager
def _starting(
    cli: Cli, job: str, env: Dict[str, str]
) -> Iterator[Tuple[subprocess.Popen[str], int]]:
    """`rgt-agent start` of RUN with the job file ``job``, and the pid of its agent; both are
    killed by PID if they still run when the test leaves."""
    start = subprocess.Popen(
        [*agent_exe(), "start", job, "--name", RUN, "--", *JOB],
        env=env,
        cwd=cli.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    agent: List[int] = []
    try:
        agent.append(_child_of(start.pid))
        yield start, agent[0]
    finally:
        for pid in agent:
            st = procfs.read_stat(pid)
            if st is not None and st.state not in ("Z", "X"):  # before the fix: waiting on
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if start.poll() is None:
            start.kill()
            start.communicate()


def _nothing_in_place(ckpt: str) -> None:
    """No file of the checkpoint under its final name, no staging directory left."""
    assert not os.path.exists(os.path.join(ckpt, f"ckpt_{STEP}")), os.listdir(ckpt)
    assert not glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*")), os.listdir(ckpt)


def _gone(cli: Cli, err: str) -> None:
    """The new run that could not begin went from the box whole, and its error says so
    (onbox/agent/beginning.py ``forget_unbegun``)."""
    assert "nothing of the run is left on the box" in err, err
    assert not os.path.exists(os.path.join(cli.home, "runs", RUN)), os.listdir(cli.home)


def test_a_store_stopped_mid_restore_fails_the_start_as_transient_within_its_stall_bound(
    cli: Cli, tmp_path: Any
) -> None:
    """Before the fix `start` waited on: the lean S3 reader's receive blocked for its read
    timeout (60 s), then each request was retried, and `start` was still waiting when the test
    gave up (WAIT)."""
    require(seaweed.missing() is None, seaweed.missing() or "")
    server = start_seaweed(str(tmp_path / "weed"))
    weed, stopped = server.pid, False
    assert weed is not None
    try:
        bucket = server.bucket()
        _seal(server.store(bucket, "p"), tmp_path, S3_FILE)
        url = f"s3://{bucket}/p"
        job = _job_file(tmp_path, url, "3s")
        ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
        with _starting(cli, job, server.env(cli.env)) as (start, agent):
            wait(
                lambda: glob.glob(f"{ckpt}/{STAGE_PREFIX}*"), 60, "the restore to begin", poll=0.01
            )
            # The agent held while the store stops: its download cannot end first.
            os.kill(agent, signal.SIGSTOP)
            try:
                os.kill(weed, signal.SIGSTOP)
                stopped = True
            finally:
                os.kill(agent, signal.SIGCONT)
            try:
                out, err = start.communicate(timeout=WAIT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"`start` still waited on the stalled restore after {WAIT:.0f}s")
        assert start.returncode == 14, (out, err)
        assert f"{url} sent nothing of the checkpoint for 3s" in err, err
        assert "stopped answering mid-download" in err and "[store] stall" in err, err
        assert "started" not in out, out
        _nothing_in_place(ckpt)
        assert f"restoring the newest checkpoint from {url} failed" in err, err
        _gone(cli, err)
    finally:
        if stopped:
            os.kill(weed, signal.SIGCONT)
        server.stop()


RGT = [sys.executable, "-c", "import sys; from controller.cli import main; sys.exit(main())"]


def test_rgt_deploy_says_the_restore_stalled_on_a_store_that_stopped_moving_bytes(
    cli: Cli, tmp_path: Any, controller_env: Any
) -> None:
    """The laptop's side, on a ``file://`` store whose copies hold as a hung mount's read
    would: `rgt deploy` exits 14 with the box's error. Before the fix the copies held until
    the hold's own limit (HOLD_FOR, 120 s), then the restore went on and the deploy succeeded.
    (``--store`` as well: on ``local`` the deploy passes $RGT_HOME/store over the job file's;
    the job file's ``[store] stall`` holds under a ``--store`` all the same.)"""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal(open_store("file://" + root), tmp_path, SMALL_FILE + (1 << 20))
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text("import os\nprint(os.environ['RGT_RESUME_FROM'], flush=True)\n")
    job = _job_file(proj, f"file://{root}", "2s")
    env = dict(os.environ, RGT_BOX_HOME=cli.home, RGT_HOLD_AT="copy.after_piece")
    p = subprocess.Popen(
        [*RGT, "deploy", "local", job, "--python", sys.executable, "--project", str(proj),
         "--store", f"file://{root}", "--", sys.executable, "job.py"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=100)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        agent = cli.peek(RUN).get("agent") or {}
        if agent.get("alive"):  # before the fix: restoring on, held
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent["pid"], signal.SIGKILL)
    assert p.returncode == 14, (out, err)
    assert f"file://{root} sent nothing of the checkpoint for 2s" in err, err
    # The line `rgt deploy` prints puts the box's remedy in one pair: none of its own inside.
    line = next(x for x in err.splitlines() if "sent nothing of the checkpoint" in x)
    assert "a hung mount" in line and nesting(line) == 1, line
    assert "Traceback" not in err, err
    _nothing_in_place(os.path.join(cli.home, "runs", RUN, "ckpt"))
    _gone(cli, err)


def test_a_download_a_stop_cannot_reach_is_let_go_after_a_stall(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read from a hung mount is not cut by the lanes' stop (no receive to abort): after a
    stall the restore waits LET_GO for it, then raises and leaves it. Before, in_parallel
    waited for every worker, so the stall's error came only once the mount answered: never."""
    monkeypatch.setattr(fetch, "LET_GO", 1.0)
    stage = str(tmp_path / "stage")
    os.makedirs(stage)
    hung, let_go = threading.Event(), threading.Event()

    def blocked(lanes: Any) -> None:
        with open(os.path.join(stage, "0"), "wb") as f:
            f.write(b"x" * 4096)  # some bytes, then a read that never returns until let go
        hung.set()
        let_go.wait(120)

    def stalled() -> Exception:
        return RestoreStalled("stalled", None)

    raised: List[BaseException] = []

    def restore() -> None:
        try:
            fetch.in_parallel([blocked], stall=Stall(0.5, lambda: stage_marks(stage), stalled))
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    try:
        assert hung.wait(30)
        t.join(30)
        assert not t.is_alive(), "the restore still waited on a worker no stop reaches"
        assert len(raised) == 1 and isinstance(raised[0], RestoreStalled), raised
    finally:
        let_go.set()
        t.join(30)


def _hung_mount(cli: Cli, tmp_path: Any, hold: str) -> Tuple[str, str, Dict[str, str]]:
    """A ``file://`` store with a sealed checkpoint, a job file giving it 2 s, and the
    environment under which its calls at ``hold`` hang as on a hung mount (until HOLD_FOR)."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal(open_store("file://" + root), tmp_path, 1 << 20)
    return root, _job_file(tmp_path, f"file://{root}", "2s"), dict(cli.env, RGT_HOLD_AT=hold)


def _ended(start: subprocess.Popen[str]) -> Tuple[str, str]:
    try:
        return start.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`start` still waited on the hung store after {WAIT:.0f}s")


def test_a_hung_mount_under_the_beginnings_reads_fails_the_start_as_transient(
    cli: Cli, tmp_path: Any
) -> None:
    """The agent's reads before the download (here the epochs' listing, the first of them)
    hang as on a mount whose server stopped: `start` exits 14 naming the store and the call,
    the run FAILED with a transient ``restore_failed``, nothing restored. Before the fix the
    agent's main thread waited in the listing (until the hold's own limit, HOLD_FOR, 120 s,
    on a real hung mount for ever) and `start` with it."""
    root, job, env = _hung_mount(cli, tmp_path, "store.list")
    with _starting(cli, job, env) as (start, _):
        out, err = _ended(start)
    assert start.returncode == 14, (out, err)
    assert f"file://{root} did not answer for 2s (listing {RUN}/epochs/)" in err, err
    assert "the mount under it hangs" in err and "[store] stall" in err, err
    assert "started" not in out, out
    _nothing_in_place(os.path.join(cli.home, "runs", RUN, "ckpt"))
    assert f"taking the run's epoch in file://{root} failed" in err, err
    _gone(cli, err)


def test_a_hung_mount_under_starts_check_of_the_store_fails_it_before_anything_is_made(
    cli: Cli, tmp_path: Any
) -> None:
    """`start` reads the store's DONE.json before it claims the run: on a hung mount it exits
    14 naming the store, and no run is made. Before the fix it waited in that read."""
    root, job, env = _hung_mount(cli, tmp_path, "store.get")
    start = subprocess.Popen(
        [*agent_exe(), "start", job, "--name", RUN, "--", *JOB],
        env=env, cwd=cli.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = _ended(start)
    finally:
        if start.poll() is None:
            start.kill()
            start.communicate()
    assert start.returncode == 14, (out, err)
    assert f"file://{root} did not answer for 2s (reading {RUN}/DONE.json)" in err, err
    assert not os.path.exists(os.path.join(cli.home, "runs", RUN)), os.listdir(cli.home)


# A process whose download stalls on a worker no stop reaches (as a read from a hung mount),
# then exits with the stall's code, as `rgt pull` and the agent do once they have said it.
LEFT_BEHIND = (
    "import os, sys, threading\n"
    "from onbox.sealing import fetch\n"
    "from onbox.sealing.stall import RestoreStalled, Stall, stage_marks\n"
    "fetch.LET_GO = 0.5\n"
    "stage = sys.argv[1]\n"
    "never = threading.Event()\n"
    "stall = Stall(0.5, lambda: stage_marks(stage), lambda: RestoreStalled('stalled', None))\n"
    "try:\n"
    "    fetch.in_parallel([lambda lanes: never.wait()], stall=stall)\n"
    "except RestoreStalled as e:\n"
    "    print(e.what, flush=True)\n"
    "    sys.exit(e.exit_code)\n"
)


def test_a_process_whose_download_stalled_on_a_worker_no_stop_reaches_still_exits(
    tmp_path: Any,
) -> None:
    """The worker left behind after a stall must not hold the process: before the fix it was a
    ThreadPoolExecutor's, which Python joins at exit, so the stalled pull or agent said its
    error and then never exited (until the mount answered)."""
    stage = str(tmp_path / "stage")
    os.makedirs(stage)
    p = subprocess.Popen(
        [sys.executable, "-c", LEFT_BEHIND, stage], stdout=subprocess.PIPE, text=True
    )
    try:
        out, _ = p.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"the process still waited on its left worker after {WAIT:.0f}s ({out!r})")
    assert (p.returncode, out) == (14, "stalled\n")
