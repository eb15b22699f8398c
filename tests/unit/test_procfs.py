"""Process identity from /proc, with real processes: pid reuse and zombies."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from onbox.agent import procfs


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
