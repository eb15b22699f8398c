"""An agent whose store stops taking a checkpoint's upload still lets go of the run: in time.

The store is a ``file://`` directory whose uploads of files hang from a chosen moment on (hold
point ``store.put_file``, onbox/common/faults.py: as on an NFS or FUSE mount whose server stopped
answering mid-write; the hold ends after HOLD_FOR, 120 s, a real hung mount's never). The run's
step 1 is sealed first; then the store hangs, the job writes step 2, and the test waits until
the agent is held in step 2's upload (``RGT_HOLD_REACHED``) before the run ends: its job fails or
succeeds, `rgt-agent stop` stops it, or a real SIGTERM preempts it with a grace. Before the fix
the agent waited on that upload as long as the store hung (close() and the success seal joined
the sealing thread without a bound), holding the run's lock. Now an upload that moves nothing
for ``[store] stall`` is cut: a ``seal_error`` says so, LATEST stays at step 1 (no MANIFEST of a
torn step 2), and the agent writes the run's final state, lets go of the lock and exits, and a
new `rgt-agent start` takes the run.

Real agents and jobs, a real SIGTERM; the test waits for the agent's PID with a bound (WAIT,
well under the hold's 120 s) and kills what is left by PID (the cli fixture). On S3 the store is
a SeaweedFS of the test's own (``weed mini``), SIGSTOPped mid-upload, as a server or a network
that stopped answering mid-PUT (botocore alone waits 4 x 60 s per request), SIGCONTed in a
``finally``; the sealer is the real one, in the test's process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import pytest

from controller.observe import describe
from onbox.agent.observe import public_state
from onbox.common import writeback
from onbox.common.errors import StoreError
from onbox.sealing.stores import filecopy, open_store
from onbox.sealing.stores.base import Store
from onbox.sealing.stores.hangbound import StoreHung
from tests import seaweed
from tests.conftest import Cli, agent_exe, require
from tests.heldstore import end_while_held, held_store, running_with_step_one, staged_job
from tests.httpsink import HttpSink
from tests.polling import latest_step, wait
from tests.relay import Relay
from tests.sealsvc import old_box_sealer
from tests.seaweed import start_seaweed

RUN = "upstall"
WAIT = 45.0  # the test's bound on the agent's exit: before the fix, the hold's 120 s
# tests/heldstore.py's staged job; its step 2 another size than step 1's, so it is copied with
# put_file, not deduplicated.
JOB = staged_job('b"weights of step 2" * 200')


def _events(cli: Cli, kind: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(RUN) if e["kind"] == kind]


def _start(cli: Cli, tmp_path: Any, root: str, code: int, more: str = "") -> None:
    """`rgt-agent start` of JOB exiting ``code``, its store ``root``; ``more``: job file text."""
    job_py = tmp_path / "job.py"
    job_py.write_text(JOB)
    job = tmp_path / "job.toml"
    argv = [sys.executable, str(job_py), str(tmp_path), str(code)]
    job.write_text(
        f"command = {json.dumps(argv)}\n"
        # start_grace: RUNNING (what running_with_step_one waits for) 1 s after the start,
        # not 5; the job never exits before the test tells it to.
        '[restart]\nmax_error_restarts = 0\nstart_grace = "1s"\n[store]\nurl = "file://'
        + root
        + '"\nstall = "2s"\n'
        + more
    )
    cli("start", str(job), "--name", RUN, "--grace", "5", check=True, cwd=cli.home)


@pytest.mark.parametrize("how", ["fail", "stop", "preempt", "success"])
def test_an_agent_whose_checkpoint_upload_hangs_exits_in_time_and_frees_the_run(
    cli: Cli, tmp_path: Any, how: str
) -> None:
    """Step 1 sealed; then the store's uploads of files hang, and the agent is held in step 2's
    upload when the run ends (``how``). The agent ends the run on the box, says the upload
    that moved nothing with seal_error (naming the store, its remedy the store's stall), leaves
    LATEST at step 1, exits within WAIT, and a new `rgt-agent start` of the run is not refused.
    Before the fix it stayed as long as the upload hung (the hold's 120 s): `rgt-agent stop`
    failed (exit 10, the lock still held)."""
    root, release, reached = held_store(cli.env, tmp_path, "store.put_file", "upload-held")
    code = 0 if how == "success" else 3
    _start(cli, tmp_path, root, code)
    pid, agent = running_with_step_one(cli, RUN, root)
    release.unlink()  # from here on the store's uploads hang
    (tmp_path / "more").write_text("")
    wait(reached.exists, 60, "the agent held in step 2's upload")
    # A success whose completion seal the store cut is not SUCCEEDED: no DONE.json, the run
    # left to its next agent (as after a crash before DONE.json: test_completion.py).
    final = {"fail": "FAILED", "stop": "STOPPED", "preempt": "PREEMPTED", "success": "RUNNING"}
    end_while_held(cli, RUN, tmp_path, how, pid, agent, release, WAIT)
    assert cli.peek(RUN)["state"] == final[how]
    assert latest_step(root, RUN) == 1  # never a step whose upload was cut
    assert not os.path.exists(os.path.join(root, RUN, "checkpoints", "2", "MANIFEST.json"))
    errors = _events(cli, "seal_error")
    if how != "preempt":  # a preemption's grace ends first: seal_cut, logs_not_sealed
        moved = [e for e in errors if "took nothing" in e["reason"]]
        assert moved and all("[store] stall" in e["remedy"] for e in moved), errors
        assert all(root in e["reason"] for e in moved), errors
    if how == "success":
        _said_not_sealed(cli)
    del cli.env["RGT_HOLD_AT"]
    if how == "success":  # as its seal_error says: a start by name completes it
        assert any("rgt-agent start --name" in e["remedy"] for e in errors), errors
        cli("start", "--name", RUN, check=True, cwd=cli.home)
        cli.wait_over(RUN, "SUCCEEDED", timeout=60)
        assert latest_step(root, RUN) == 2 and os.path.exists(os.path.join(root, RUN, "DONE.json"))
        return
    (tmp_path / "go").write_text("")
    _start(cli, tmp_path, root, 3)  # the new attempt fails at once
    cli.wait_over(RUN, "FAILED", timeout=60)


def test_an_agent_that_leaves_a_success_unsealed_mirrors_it_and_pings_the_switch(
    cli: Cli, tmp_path: Any
) -> None:
    """A success whose completion seal the store cut (its uploads hang; its small documents are
    still taken): the agent leaves the run RUNNING (exit 14), and as on its other exits the
    store's copy of the state, which `rgt status` reads while the box does not answer, says
    what the box says (the success whose results are not sealed, and the start that completes
    it), and the dead-man's switch (a real HTTP server) gets the last ping: /fail, naming the
    unsealed success and its remedy. Before: the store's copy still had the plain success (or
    no last exit), and the switch got no last ping at all, only /start."""
    sink = HttpSink("ok")
    try:
        root, release, reached = held_store(cli.env, tmp_path, "store.put_file", "upload-held")
        more = f'[notify]\ndeadman = "{sink.url}/hc"\n'
        _start(cli, tmp_path, root, 0, more)
        pid, agent = running_with_step_one(cli, RUN, root)
        release.unlink()  # from here on the store's uploads hang
        (tmp_path / "more").write_text("")
        wait(reached.exists, 60, "the agent held in step 2's upload")
        end_while_held(cli, RUN, tmp_path, "success", pid, agent, release, WAIT)
        _said_not_sealed(cli)
        box = cli.status(RUN)
        with open(os.path.join(root, RUN, "state", "state.json")) as f:
            mirrored = json.load(f)
        assert mirrored["state"] == box["state"] == "RUNNING", (mirrored, box)
        assert mirrored["last_exit"] == box["last_exit"], (mirrored, box)
        # `rgt status`'s lines from that copy (controller/observe.py from_store, describe)
        doc = dict(public_state(mirrored), source="store", read_at="now")
        text = describe(doc, "the box does not answer")
        assert "results are not sealed" in text and f"rgt-agent start --name {RUN}" in text, text
        pings = [r for r in sink.seen() if r.path.startswith("/hc")]
        assert [r.path for r in pings] == ["/hc/start", "/hc/fail"], pings
        last = pings[-1].body.decode()
        assert f"rgt {RUN}: RUNNING" in last and "results are not sealed" in last, last
        assert f"rgt-agent start --name {RUN}" in last, last
    finally:
        sink.close()


def test_rgt_agent_run_whose_completion_seal_the_store_cuts_exits_14_without_a_traceback(
    cli: Cli, tmp_path: Any
) -> None:
    """`rgt-agent run` (foreground) of a job that succeeds while the store's uploads hang: the
    completion seal is cut, and the command exits 14 (a store error) with one line that says
    the run is left RUNNING with its results not sealed, and what to do. Before: exit 14 with
    the store's own line only, naming neither the run's state nor the start that completes
    it."""
    root, release, reached = held_store(cli.env, tmp_path, "store.put_file", "upload-held")
    job_py, job = tmp_path / "job.py", tmp_path / "job.toml"
    job_py.write_text(JOB)
    argv = [sys.executable, str(job_py), str(tmp_path), "0"]
    job.write_text(
        f"command = {json.dumps(argv)}\n"
        '[restart]\nmax_error_restarts = 0\n[store]\nurl = "file://' + root + '"\nstall = "2s"\n'
    )
    p = subprocess.Popen(
        [*agent_exe(), "run", str(job), "--name", RUN],
        env=cli.env,
        cwd=cli.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        cli.wait_output(RUN, "ready")
        wait(lambda: latest_step(root, RUN) == 1, 60, "step 1 sealed")
        release.unlink()  # from here on the store's uploads hang
        (tmp_path / "more").write_text("")
        wait(reached.exists, 60, "the agent held in step 2's upload")
        (tmp_path / "go").write_text("")
        out, err = p.communicate(timeout=WAIT)
    finally:
        release.write_text("")
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == StoreError.exit_code, (p.returncode, out, err)
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"rgt: run {RUN}: the agent exits"), err
    # STARTING or RUNNING: the state the run was in as its job ended (its start grace).
    assert re.search("leaving the run (STARTING|RUNNING): attempt 1 succeeded", line), err
    assert "results are not sealed (no DONE.json)" in line, err
    assert f"rgt-agent start --name {RUN}" in line, err


def _said_not_sealed(cli: Cli) -> None:
    """A success whose completion seal the store cut: the agent exited without a traceback,
    saying so in agent.log and in an ``agent_left`` event (what, why, what to do) with exit 14,
    its lock released; the status says RUNNING with the job not running, its last exit the
    success whose results are not sealed, and the start that completes it. Before: a
    traceback in agent.log, no event, and the status said only "exited with code 0"."""
    with open(os.path.join(cli.home, "runs", RUN, "agent.log")) as f:
        log = f.read()
    assert "Traceback" not in log, log
    left = _events(cli, "agent_left")
    assert len(left) == 1, left
    assert "results are not sealed" in left[0]["reason"], left
    assert "took nothing" in left[0]["reason"] or "not asked" in left[0]["reason"], left
    assert left[0]["remedy"].startswith(f"`rgt-agent start --name {RUN}` once the store"), left
    assert f"exits {StoreError.exit_code}: run is RUNNING" in log, log
    st = cli.status(RUN)
    assert not st["agent"]["alive"] and st["state"] == "RUNNING", st
    assert "results are not sealed" in st["last_exit"]["reason"], st
    text = cli("status", RUN, check=True).stdout
    assert "results are not sealed" in text and f"rgt-agent start --name {RUN}" in text, text


def _checkpoint(tmp_path: Any, size: int) -> str:
    """A checkpoint dir with one complete checkpoint at step 10: one file of ``size`` bytes."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(ckpt, "ckpt_10"))
    with open(os.path.join(ckpt, "ckpt_10", "shard.bin"), "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    with open(os.path.join(ckpt, "ckpt_10", ".rgt-complete"), "w") as f:
        json.dump({"step": 10}, f)
    return ckpt


def _seal_in_thread(store: Store, tmp_path: Any, ckpt: str) -> Any:
    """The real sealer's pass over ``ckpt``, in a daemon thread, its epoch taken before:
    (thread, what it raised)."""
    sealer = old_box_sealer(RUN, ckpt, store, tmp_path)
    raised: List[BaseException] = []

    def seal() -> None:
        try:
            sealer.seal_pending()
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=seal, daemon=True)
    t.start()
    return t, raised


def test_an_s3_store_that_stops_mid_upload_cuts_the_seal_after_its_stall_bound(
    tmp_path: Any,
) -> None:
    """A multipart upload whose server stops answering once its first part is taken (of 24):
    the seal fails
    as a StoreHung after the bound (3 s) with nothing moved, and no MANIFEST names the step.
    Before the fix it waited on botocore's read timeout and retries (minutes): still running
    after WAIT."""
    require(seaweed.missing() is None, seaweed.missing() or "")
    server = start_seaweed(str(tmp_path / "weed"))
    weed, stopped = server.pid, False
    assert weed is not None
    try:
        store = server.store(server.bucket(), "p")
        store.bound_calls(3.0)
        ckpt = _checkpoint(tmp_path, 192 << 20)
        t, raised = _seal_in_thread(store, tmp_path, ckpt)  # its epoch is put before
        before = store.sent
        deadline = time.monotonic() + 60  # the first part taken: the rest cannot be yet
        while store.sent == before and t.is_alive():
            assert time.monotonic() < deadline, "no part of the upload was taken"
            time.sleep(0.001)
        os.kill(weed, signal.SIGSTOP)
        stopped = True
        t.join(WAIT)
        assert not t.is_alive(), f"the seal still waited on the stopped store after {WAIT}s"
        assert raised and isinstance(raised[0], StoreHung), raised
        assert f"{store.url} took nothing for 3s (uploading {RUN}/checkpoints/10/" in str(raised[0])
    finally:
        if stopped:
            os.kill(weed, signal.SIGCONT)
    assert store.get_bytes(f"{RUN}/checkpoints/10/MANIFEST.json") is None
    server.stop()


SLOW, BOUND = 0.15, 0.5  # each piece of the fake slow disk, and the stall bound: 20 pieces


def test_a_slow_upload_that_moves_is_not_cut_fake_slow_disk(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file:// upload that takes longer than the bound, each piece of its copy slowed by a
    fake slow disk (the copy's hold point, made to sleep SLOW, less than the bound), is sealed:
    the bound is on movement, not on a file's whole upload."""
    pieces: List[int] = []

    def slow(*_: Any) -> None:
        pieces.append(1)
        time.sleep(SLOW)

    monkeypatch.setattr(filecopy, "COPY_CHUNK", 256 << 10)
    monkeypatch.setattr(filecopy, "hold_point", slow)
    root = str(tmp_path / "store")
    os.makedirs(root)
    store = open_store("file://" + root)
    store.bound_calls(BOUND)
    t, raised = _seal_in_thread(store, tmp_path, _checkpoint(tmp_path, 5 << 20))
    t.join(WAIT)
    assert not t.is_alive() and not raised, raised
    assert len(pieces) * SLOW > BOUND  # the upload took longer than the bound: it moved
    assert latest_step(root, RUN) == 10


RATE, SLOW_BOUND = 4 << 20, 1.5  # the fake slow disk's bytes a second, and the stall bound


class _SlowDisk:
    """A fake slow disk under a file:// store (no real one can be made here: no FUSE library,
    no dm-delay): a kernel copy into it moves RATE bytes a second, steadily, 64 KiB at a time,
    and returns only once all it was asked for is written, as a copy into a slow mount does
    while the kernel throttles its writer; what was written is durable only once waited for (a
    ``sync_file_range`` that waits, or an fsync), which moves at RATE too, as the mount's
    writeback does. The waits of the fsync of a file already waited for cost nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.copy, self.fsync = os.copy_file_range, os.fsync
        self.sfr = writeback._sync_file_range
        self.dirty: Dict[int, int] = {}  # bytes written to a descriptor, not yet waited for
        monkeypatch.setattr(os, "copy_file_range", self._copy)
        monkeypatch.setattr(os, "fsync", self._fsync)
        if self.sfr is not None:
            monkeypatch.setattr(writeback, "_sync_file_range", self._sync_file_range)

    def _copy(self, src: int, dst: int, count: int, off: Any = None, dst_off: Any = None) -> int:
        done = 0
        while done < count:
            piece = min(64 << 10, count - done)
            n = self.copy(src, dst, piece, None if off is None else off + done, dst_off)
            if not n:
                break
            done += n
            self.dirty[dst] = self.dirty.get(dst, 0) + n
            time.sleep(n / RATE)
        return done

    def _settle(self, fd: int, length: int) -> None:
        n = min(length, self.dirty.get(fd, 0))
        self.dirty[fd] = self.dirty.get(fd, 0) - n
        time.sleep(n / RATE)

    def _fsync(self, fd: int) -> None:
        time.sleep(self.dirty.pop(fd, 0) / RATE)
        self.fsync(fd)

    def _sync_file_range(self, fd: int, offset: int, length: int, flags: int) -> int:
        if flags & 4:  # SYNC_FILE_RANGE_WAIT_AFTER: the range is written when it returns
            self._settle(fd, length)
        assert self.sfr is not None
        return int(self.sfr(fd, offset, length, flags))


def test_a_file_store_slower_than_a_piece_per_bound_is_not_cut_fake_slow_disk(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file:// store on a slow disk (``_SlowDisk``) that takes a 16 MiB file at 4 MiB/s, with
    a stall bound of 1.5 s: the copy takes 4 s and its fsync 4 more, and both move all along,
    so the seal completes. Before the fix the whole file was one piece of the copy (64 MiB a
    piece), and the fsync after it no movement at all: the upload was cut as stalled."""
    _SlowDisk(monkeypatch)
    root = str(tmp_path / "store")
    os.makedirs(root)
    store = open_store("file://" + root)
    store.bound_calls(SLOW_BOUND)
    t, raised = _seal_in_thread(store, tmp_path, _checkpoint(tmp_path, 16 << 20))
    t.join(WAIT)
    assert not t.is_alive() and not raised, raised
    assert latest_step(root, RUN) == 10


LINK, LINK_BOUND = 2 << 20, 2.0  # the slow link's bytes a second per connection, the bound


def test_an_s3_upload_on_a_slow_link_that_moves_is_not_cut(tmp_path: Any) -> None:
    """A multipart upload (two parts of 8 MiB, each sent in one request) through a real TCP
    relay that takes 2 MiB a second from each connection (tests/relay.py ``rate``), with a
    stall bound of 2 s: each part takes some 4 s, moving all along, and the seal completes.
    Before the fix the upload's movement was counted per part put, so nothing moved for 4 s:
    cut as stalled."""
    require(seaweed.missing() is None, seaweed.missing() or "")
    server = start_seaweed(str(tmp_path / "weed"))
    relay = Relay("127.0.0.1", ("127.0.0.1", server.port), rate=LINK)
    try:
        url = f"http://127.0.0.1:{relay.port}"
        store = server.store(server.bucket(), "p", endpoint_url=url)
        store.bound_calls(LINK_BOUND)
        t, raised = _seal_in_thread(store, tmp_path, _checkpoint(tmp_path, 16 << 20))
        t.join(WAIT)
        assert not t.is_alive() and not raised, raised
        assert store.get_bytes(f"{RUN}/checkpoints/10/MANIFEST.json") is not None
    finally:
        relay.close()
        server.stop()
