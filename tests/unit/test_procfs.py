"""Process identity from /proc, with real processes: pid reuse and zombies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Tuple

from onbox.agent import procfs
from tests.pidreuse import squatter

# A job, a session leader, whose child leaves its session (argv[1] == "setsid") or stays in it;
# the job prints the child's pid once it is settled, then exits (the test reaps it).
_LEADER = """
import os, sys, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    if sys.argv[1] == "setsid":
        os.setsid()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.write(w, b"x")
    time.sleep(60)
    os._exit(0)
os.read(r, 1)
print(child, flush=True)
"""


def test_identity_of_a_live_process_and_a_stale_record() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ident = procfs.identity(p.pid)
        assert ident is not None and procfs.is_alive(ident)
        # Same pid, another start time: a record from a process that is gone (pid reused).
        assert not procfs.is_alive(procfs.Identity(p.pid, ident.start_ticks + 1))
    finally:
        p.kill()
        p.wait()
    assert not procfs.is_alive(ident)


def test_a_zombie_counts_as_dead() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while (st := procfs.read_stat(pid)) is not None and st.state != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert st is not None and st.state == "Z"  # not reaped yet: kill(pid, 0) would succeed
        os.kill(pid, 0)
        assert procfs.identity(pid) is None
        assert not procfs.is_alive(procfs.Identity(pid, st.start_ticks))
    finally:
        os.waitpid(pid, 0)


def test_find_tagged_sees_a_process_that_left_the_group() -> None:
    env = dict(os.environ, RGT_TEST_TAG="t-123")
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"  # exec'd: env is its own
        found = procfs.find_tagged("RGT_TEST_TAG", "t-123")
        assert [i.pid for i in found] == [p.pid]
        assert procfs.find_tagged("RGT_TEST_TAG", "t-124") == []
    finally:
        p.kill()
        p.communicate()


def _job(tag: str, how: str) -> Tuple[subprocess.Popen[str], procfs.Identity, int]:
    """The job (its identity taken before it ends) and its child's pid."""
    p = subprocess.Popen(
        [sys.executable, "-c", _LEADER, how],
        env=dict(os.environ, RGT_TEST_TAG=tag) if tag else {"PATH": "/usr/bin:/bin"},
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    leader = procfs.child_identity(p.pid)
    assert p.stdout is not None and leader is not None
    return p, leader, int(p.stdout.readline())


def test_find_attempt_ignores_a_new_session_leader_that_reused_the_dead_leaders_pid() -> None:
    """The job died; an unrelated process got its pid and leads a session and group of that id
    while the job's setsid child lives on. Only the child is the attempt's: a stop's SIGKILL
    must not reach the stranger."""
    p, leader, child = _job("t-reuse", "setsid")
    child_id = procfs.identity(child)
    try:
        assert child_id is not None
        p.wait(timeout=30)
        with squatter(leader.pid) as stranger:
            st = procfs.read_stat(stranger.pid)
            assert st is not None and st.sid == st.pgid == leader.pid  # the premise
            assert stranger != leader
            assert procfs.find_attempt("RGT_TEST_TAG", "t-reuse", leader, ()) == [child_id]
    finally:
        if child_id is not None and procfs.is_alive(child_id):
            os.kill(child, signal.SIGKILL)
        p.kill()
        p.communicate(timeout=30)


def test_find_attempt_ignores_a_session_led_by_a_process_that_is_not_the_leader() -> None:
    """The same without root: a record of a leader whose pid is now held by a process with
    another start time. That process's session and group are not the attempt's."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        env={"PATH": "/usr/bin:/bin"},
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        now = procfs.identity(p.pid)
        assert now is not None
        ghost = procfs.Identity(p.pid, now.start_ticks - 1)  # the dead job this pid once was
        assert procfs.find_attempt("RGT_TEST_TAG", "t-none", ghost, ()) == []
        assert procfs.find_attempt("RGT_TEST_TAG", "t-none", now, ()) == [now]
    finally:
        p.kill()
        p.communicate(timeout=30)


def test_find_attempt_still_finds_the_dead_leaders_session_while_its_pid_is_free() -> None:
    """The job died and its pid is nobody's: a process left in its session, untagged and
    orphaned (no descent names it), is still the attempt's. The id cannot be reused while
    such a member lives, so this match is safe."""
    p, leader, child = _job("", "stay")
    child_id = procfs.identity(child)
    try:
        assert child_id is not None
        p.wait(timeout=30)
        assert procfs.read_stat(leader.pid) is None  # reaped; the session outlives it
        assert procfs.find_attempt("RGT_TEST_TAG", "t-none", leader, ()) == [child_id]
    finally:
        if child_id is not None and procfs.is_alive(child_id):
            os.kill(child, signal.SIGKILL)
        p.kill()
        p.communicate(timeout=30)


def test_pidfd_wakes_when_the_process_exits() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    ident = procfs.identity(p.pid)
    assert ident is not None
    fd = procfs.open_pidfd(ident)
    assert fd is not None
    try:
        assert procfs.wait_readable([fd], 10.0) == [fd]
    finally:
        os.close(fd)
        p.wait()
