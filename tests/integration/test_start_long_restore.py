"""`rgt-agent start` over a restore longer than its wait for the agent.

`start` returns once the job runs (or says why it did not), so it waits for the agent's whole
restore: 20 GiB from S3 takes minutes. It used to wait READY_TIMEOUT (10 s) in all, then said
"the agent did not come up" (exit 9) while the agent went on and started the job. Now the agent
says what it is doing while it prepares the run, and READY_TIMEOUT bounds the silence: a long
restore is waited for (its progress shown), a hung agent is still given up on. The laptop's
`rgt deploy` ran that start with 120 s for all of it; now its START_SILENCE bounds the silence, and
the start's lines reach the user's terminal, quoted.

Real processes, a real ``file://`` store. The restore's copies hold after each piece
(``RGT_HOLD_AT``, onbox/common/faults.py) until the test creates the release file
(``RGT_HOLD_UNTIL``), which it does once the restore has outlasted the silence bound, made
short for the test (``RGT_TEST_READY_SILENCE``): no timing decides the outcome.
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
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from controller.cli import main as rgt_main
from controller.deploy import boxstart
from controller.deploy.boxstart import start_failed
from controller.remote import LocalRemote
from onbox.agent import procfs
from onbox.common.errors import RemoteUnreachable
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.stores import open_store
from onbox.sealing.stores.filecopy import SMALL_FILE
from tests.conftest import Cli, agent_exe
from tests.polling import wait
from tests.sealsvc import old_box_sealer

RUN = "slow"
STEP = 10
FILE_SIZE = SMALL_FILE + (1 << 20)  # copied in pieces: the hold point after each applies
SILENCE = 3.0  # RGT_TEST_READY_SILENCE: the longest silence `start` takes from its agent
JOB = [sys.executable, "-c", "import os; print('resume=' + os.environ['RGT_RESUME_FROM'])"]


def _seal(root: str, tmp_path: Any, run: str = RUN) -> None:
    """One checkpoint of two files at step STEP in the store, sealed by the real Sealer."""
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "old-box-ckpt")
    path = os.path.join(ckpt, f"ckpt_{STEP}")
    os.makedirs(path)
    for i in range(2):
        with open(os.path.join(path, f"shard_{i}.bin"), "wb") as f:
            f.write(os.urandom(FILE_SIZE))
    with open(os.path.join(path, ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    sealer = old_box_sealer(run, ckpt, store, tmp_path)
    assert sealer.seal_pending() == 1


def _start(cli: Cli, tmp_path: Any) -> Tuple[subprocess.Popen[str], str, str]:
    """`rgt-agent start` of RUN from a store holding its checkpoint, its restore held until
    the release file exists: (the process, the release file, the run's ckpt dir)."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal(root, tmp_path)
    release = str(tmp_path / "release")
    env = dict(
        cli.env,
        RGT_HOLD_AT="copy.after_piece",
        RGT_HOLD_UNTIL=release,
        RGT_TEST_READY_SILENCE=str(SILENCE),
    )
    with open(tmp_path / "start.out", "w") as out, open(tmp_path / "start.err", "w") as err:
        start = subprocess.Popen(
            [*agent_exe(), "start", "--name", RUN, "--store", "file://" + root, "--", *JOB],
            env=env,
            cwd=cli.home,
            stdout=out,
            stderr=err,
            text=True,
        )
    return start, release, os.path.join(cli.home, "runs", RUN, "ckpt")


def _restoring(ckpt: str) -> bool:
    return bool(glob.glob(os.path.join(ckpt, STAGE_PREFIX + "*")))


def _agent_of(start: subprocess.Popen[str]) -> int:
    """The pid of the agent `start` spawned (its child)."""
    found: List[int] = []

    def child() -> bool:
        found[:] = [
            p
            for p in procfs.pids()
            if (st := procfs.read_stat(p)) is not None
            and st.ppid == start.pid
            and st.state not in ("Z", "X")
        ]
        return bool(found)

    wait(child, 60, "`rgt-agent start` to spawn an agent")
    return found[0]


def _finish(start: subprocess.Popen[str], tmp_path: Any) -> Tuple[str, str]:
    try:
        start.wait(timeout=60)
    finally:
        if start.poll() is None:
            start.kill()
            start.wait()
    return (tmp_path / "start.out").read_text(), (tmp_path / "start.err").read_text()


def test_start_waits_for_a_restore_longer_than_its_bound_and_shows_its_progress(
    cli: Cli, tmp_path: Any
) -> None:
    """Before the fix `start` gave up READY_TIMEOUT after it spawned the agent (exit 9, "did
    not come up") while the agent restored on and started the job."""
    start, release, ckpt = _start(cli, tmp_path)
    try:
        began = lambda: _restoring(ckpt) or start.poll() is not None  # noqa: E731
        wait(began, 60, "the agent to begin its restore")
        held = time.monotonic()
        # The restore outlasts the silence bound twice over (or `start` gave up: the failure).
        wait(
            lambda: start.poll() is not None or time.monotonic() - held > 2 * SILENCE,
            60,
            "the restore held twice the silence bound",
        )
    finally:
        open(release, "w").close()
    out, err = _finish(start, tmp_path)
    assert start.returncode == 0, (out, err)
    assert f"started run {RUN}" in out, out
    # Its progress on stderr, as the agent said it: what, and how far.
    assert "rgt-agent: restoring the newest checkpoint from file://" in err, err
    assert " of 10.0 MiB" in err, err
    st = cli.wait_over(RUN, "SUCCEEDED", timeout=120)
    assert st["attempt"] == 1, st
    assert f"resume={os.path.join(ckpt, f'ckpt_{STEP}')}" in cli("logs", RUN, check=True).stdout


def test_start_gives_up_on_an_agent_that_goes_silent_mid_restore(cli: Cli, tmp_path: Any) -> None:
    """A hung agent (stopped mid-restore) says nothing more: `start` gives up after the
    silence bound with the error it always gave, rather than waiting on it for ever."""
    start, release, ckpt = _start(cli, tmp_path)
    try:
        agent = _agent_of(start)
        wait(lambda: _restoring(ckpt), 60, "the agent to begin its restore")
        wait(lambda: "restoring" in _err(tmp_path), 60, "start to say the restore's progress")
        os.kill(agent, signal.SIGSTOP)
        out, err = _finish(start, tmp_path)
    finally:
        open(release, "w").close()
    assert start.returncode == 9, (out, err)
    assert f"the agent for {RUN!r} did not come up" in err, err
    assert "started" not in out, out
    # The laptop's error for it (`rgt deploy`) is the start's error, not its progress again
    # (that reached the terminal as it came).
    e = start_failed("box1", RUN, start.returncode, err)
    assert f"the agent for {RUN!r} did not come up" in e.what, e.what
    assert "restoring" not in e.what, e.what


def _err(tmp_path: Any) -> str:
    try:
        with open(os.path.join(str(tmp_path), "start.err")) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def test_rgt_run_waits_for_a_box_start_that_outlasts_its_bound_and_shows_the_progress(
    cli: Cli,
    tmp_path: Any,
    controller_env: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The laptop's side: the deploy ran `rgt-agent start` with 120 s for all of it, so a
    restore longer than that failed `rgt deploy` ("did not finish within 120 s") while the run
    started on the box. Now START_SILENCE (made short here) bounds the silence of the start,
    which says how the restore goes; its lines reach the user's terminal, quoted. A ``local``
    target runs the same commands as an ssh box."""
    laptop_silence = 3 * SILENCE
    monkeypatch.setattr(boxstart, "START_SILENCE", laptop_silence)
    monkeypatch.setenv("RGT_BOX_HOME", cli.home)
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal(root, tmp_path, "dep")
    release = str(tmp_path / "release")
    for k, v in (("RGT_HOLD_AT", "copy.after_piece"), ("RGT_HOLD_UNTIL", release)):
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RGT_TEST_READY_SILENCE", str(SILENCE))

    def let_go() -> None:
        """The release, once the box's restore has outlasted the laptop's bound twice."""
        stage = os.path.join(cli.home, "**", STAGE_PREFIX + "*")
        deadline = time.monotonic() + 120
        while not glob.glob(stage, recursive=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2 * laptop_silence)
        open(release, "w").close()

    releaser = threading.Thread(target=let_go, daemon=True)
    releaser.start()
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(
        "import os\nprint('resume=' + os.environ['RGT_RESUME_FROM'], flush=True)\n"
    )
    try:
        code = rgt_main(
            ["deploy", "local", "--name", "dep", "--python", sys.executable, "--project",
             str(proj), "--store", f"file://{root}", "--", sys.executable, "job.py"]
        )  # fmt: skip
    finally:
        releaser.join(180)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "  | rgt-agent: restoring the newest checkpoint from file://" in err, err
    out = cli.wait_output("dep", "resume=")
    assert f"ckpt_{STEP}" in out, out


def test_a_relayed_start_is_cut_after_its_silence_and_its_stderr_reaches_the_terminal_safely(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the deploy's start rests on (Remote.sh with relay): the box's stderr goes on to the
    terminal as it comes, through ``printable`` under QUOTED (no escape sequence, no line
    passing for rgt's own), and a command silent for the bound is given up on."""
    script = "printf 'one\\033]0;pwned\\007\\nrgt: forged\\n' >&2; exec sleep 60"
    with pytest.raises(RemoteUnreachable, match="sent nothing for 2 s"):
        LocalRemote().sh(script, timeout=2, relay=True)
    err = capsys.readouterr().err
    assert "  | one?]0;pwned?\n" in err, err
    assert "  | rgt: forged\n" in err, err
    assert "\033" not in err, err


RGT = [sys.executable, "-c", "import sys; from controller.cli import main; sys.exit(main())"]


@contextlib.contextmanager
def _deploy_held(
    cli: Cli, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Tuple[subprocess.Popen[str], Dict[str, str]]]:
    """`rgt deploy local` of run dep from a store holding its checkpoint, yielded (with the
    environment it runs in) once the box's restore has begun, held there; on leaving, the
    restore is let go and the deploy killed by PID if it still runs."""
    monkeypatch.setenv("RGT_BOX_HOME", cli.home)
    root = str(tmp_path / "durable")
    os.makedirs(root)
    _seal(root, tmp_path, "dep")
    release = str(tmp_path / "release")
    env = dict(
        os.environ, RGT_HOLD_AT="copy.after_piece", RGT_HOLD_UNTIL=release, PYTHONUNBUFFERED="1"
    )
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(
        "import os\nprint('resume=' + os.environ['RGT_RESUME_FROM'], flush=True)\n"
    )
    p = subprocess.Popen(
        [*RGT, "deploy", "local", "--name", "dep", "--python", sys.executable, "--project",
         str(proj), "--store", f"file://{root}", "--", sys.executable, "job.py"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stage = os.path.join(cli.home, "**", STAGE_PREFIX + "*")
        wait(lambda: glob.glob(stage, recursive=True), 60, "the box's restore to begin")
        yield p, env
    finally:
        open(release, "w").close()
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_ctrl_c_of_rgt_run_during_a_long_start_leaves_the_run_known_to_the_laptop(
    cli: Cli, tmp_path: Any, controller_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C of `rgt deploy` while the box's agent restores (minutes, now waited out) ended
    rgt with a traceback and no record of the run on the laptop, while the agent on the box
    went on and started the job: `rgt status` knew nothing of it. rgt now records the run,
    says the start goes on on the box and how to see it, and exits 130."""
    with _deploy_held(cli, tmp_path, monkeypatch) as (p, env):
        os.kill(p.pid, signal.SIGINT)  # the person's Ctrl-C, to rgt (ssh would not pass it on)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert "rgt status dep" in err, err
    st = subprocess.run([*RGT, "status", "dep"], env=env, capture_output=True, text=True)
    assert st.returncode == 0, (st.stdout, st.stderr)
    assert "dep" in st.stdout, st.stdout
    out = cli.wait_output("dep", "resume=")  # the box went on: restored and started the job
    assert f"ckpt_{STEP}" in out, out


def test_rgt_deploy_of_a_box_preempted_in_its_restore_leaves_the_run_known_to_the_laptop(
    cli: Cli, tmp_path: Any, controller_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The box is preempted (SIGTERM to its agent) while its agent restores: `rgt deploy` exits 13
    and says the run did not start. It left no record of the run on the laptop, so `rgt status`
    said it knew no such run while the box held it PREEMPTED (and `rgt deploy` there again, as the
    error says, found no previous run to compare with). The run is recorded now."""
    with _deploy_held(cli, tmp_path, monkeypatch) as (p, env):
        agent = cli.peek("dep")["agent"]["pid"]
        os.kill(agent, signal.SIGTERM)  # the box's preemption
        out, err = p.communicate(timeout=120)
    assert p.returncode == 13, (out, err)
    assert "run dep did not start on" in err and "the run is PREEMPTED" in err, err
    st = subprocess.run([*RGT, "status", "dep"], env=env, capture_output=True, text=True)
    assert st.returncode == 0, (st.stdout, st.stderr)
    assert "PREEMPTED" in st.stdout, st.stdout
