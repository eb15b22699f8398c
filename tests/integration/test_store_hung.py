"""A store that stops answering before a download, and the commands that read a store without
one: each ends within its ``[store] stall`` bound, exit 14, naming the store and the call.

- `rgt-agent start`'s check of an S3 store (its preflight), on a SeaweedFS SIGSTOPped before
  `start` runs: botocore waited 60 s for each of 4 tries (241 s measured) before the fix, and
  every read wrapped in base.with_retries five times that.
- `rgt-agent checkpoints` and `rgt-agent restore` on a hung ``file://`` mount (hold point
  ``store.list``, onbox/common/faults.py: until HOLD_FOR, 120 s; a real hung mount, for ever)
  and on a stopped S3 store; `--stall` gives them the bound a job file gives a run.
- `rgt status` of a run taken off its box, read from its stopped S3 store with the run's
  recorded stall.
- A restore on boto3's own path (no lean reader: AWS_CSM_ENABLED, as on AWS's endpoint) whose
  store stops mid-download: once it has said the stall it exits, where the lanes' threads
  (Python joins a ThreadPoolExecutor's at exit) held it for the read timeouts of their
  requests.

Real processes and real signals: a ``weed mini`` of the test's own, SIGSTOPped, then SIGCONTed
and ended by PID in a ``finally``; every CLI run is bounded (WAIT) and killed by PID past it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from controller.registry import Registry, RunRecord
from controller.target import Target
from onbox.sealing import manifest as mf
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store, with_retries
from onbox.sealing.stores.filecopy import SMALL_FILE
from onbox.sealing.stores.hangbound import StoreHung
from tests import seaweed
from tests.conftest import Cli, agent_exe, require
from tests.laptop import nesting, rgt_exe
from tests.sealsvc import old_box_sealer
from tests.seaweed import SeaweedServer, start_seaweed

RUN = "hung"
STEP = 10
WAIT = 60.0  # the test's bound on each command: before the fixes, 241 s and more, or for ever


def _seal(store: Store, tmp_path: Any, size: int, files: int = 1) -> None:
    """One checkpoint of ``files`` files of ``size`` bytes at step STEP, sealed by the real
    Sealer, as the run's box did."""
    ckpt = str(tmp_path / "old-box-ckpt")
    path = os.path.join(ckpt, f"ckpt_{STEP}")
    os.makedirs(path)
    for i in range(files):
        with open(os.path.join(path, f"shard_{i}.bin"), "wb") as f:
            f.write(os.urandom(size))
    with open(os.path.join(path, ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    assert old_box_sealer(RUN, ckpt, store, tmp_path).seal_pending() == 1


@contextlib.contextmanager
def _weed(tmp_path: Any) -> Iterator[Tuple[SeaweedServer, Store, List[bool]]]:
    """A SeaweedFS of this test's own, a store on a fresh bucket of it, and a flag list the
    test appends to once it has SIGSTOPped the server (SIGCONTed, then ended, when it leaves)."""
    require(seaweed.missing() is None, seaweed.missing() or "")
    server = start_seaweed(str(tmp_path / "weed"))
    stopped: List[bool] = []
    try:
        yield server, server.store(server.bucket(), "p"), stopped
    finally:
        if stopped and server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def _stop(server: SeaweedServer, stopped: List[bool]) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    stopped.append(True)


def _bounded(argv: List[str], env: Dict[str, str], cwd: str) -> Tuple[int, str, str]:
    """``argv`` run to its end, at most WAIT seconds (then killed by PID: the test fails)."""
    p = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = p.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"{' '.join(argv[-6:])} still waited on the hung store after {WAIT:.0f}s")
    return p.returncode, out, err


def test_start_on_a_stopped_s3_store_fails_within_its_stall_bound(cli: Cli, tmp_path: Any) -> None:
    """`start` checks the store before it claims the run; with the S3 server stopped, the
    check's first request is never answered. Before the fix `start` waited botocore's 4 tries
    of 60 s (241 s) and then said a read timeout, whatever the job file's stall."""
    with _weed(tmp_path) as (server, store, stopped):
        job = str(tmp_path / "job.toml")
        with open(job, "w") as f:
            f.write(f'name = "{RUN}"\n[store]\nurl = "{store.url}"\nstall = "3s"\n')
        _stop(server, stopped)
        argv = [*agent_exe(), "start", job, "--name", RUN, "--", sys.executable, "-c", "pass"]
        rc, out, err = _bounded(argv, server.env(cli.env), cli.home)
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 3s (its preflight for {RUN})" in err, err
    assert "stopped answering" in err and "[store] stall" in err, err
    assert not os.path.exists(os.path.join(cli.home, "runs", RUN)), os.listdir(cli.home)


def _file_store(tmp_path: Any, size: int = 1 << 16) -> Tuple[str, Store]:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    _seal(store, tmp_path, size)
    return root, store


@pytest.mark.parametrize(
    "command, hold, call",
    [("checkpoints", "store.list", f"listing {RUN}/epochs/"), ("restore", "store.get", "reading")],
)
def test_a_hung_mount_under_checkpoints_and_restore_ends_them_after_stall(
    cli: Cli, tmp_path: Any, command: str, hold: str, call: str
) -> None:
    """`rgt-agent checkpoints` lists the run's epochs first, `restore` reads its LATEST: on a
    mount that hangs there they exit 14 after --stall, naming the store, the call and the
    option. Before the fix they waited there (until the hold's own limit, 120 s; on a real
    hung mount, for ever), and the user's terminal with them."""
    root, store = _file_store(tmp_path)
    env = dict(cli.env, RGT_HOLD_AT=hold)
    to = ["--to", str(tmp_path / "restored")] if command == "restore" else []
    argv = [*agent_exe(), command, "--store", store.url, "--name", RUN, "--stall", "2s", *to]
    rc, out, err = _bounded(argv, env, cli.home)
    assert rc == 14, (out, err)
    assert f"file://{root} did not answer for 2s ({call}" in err, err
    assert "the mount under it hangs" in err and "--stall" in err, err
    assert not os.path.exists(tmp_path / "restored")


def test_restore_from_a_stopped_s3_store_ends_after_stall(cli: Cli, tmp_path: Any) -> None:
    """`rgt-agent restore` from an S3 server stopped before it runs: exit 14 after --stall.
    Before the fix botocore's timeouts and the restore's retries held it for many minutes."""
    with _weed(tmp_path) as (server, store, stopped):
        _seal(store, tmp_path, 1 << 16)
        _stop(server, stopped)
        to = str(tmp_path / "restored")
        argv = [*agent_exe(), "restore", "--store", store.url, "--name", RUN]
        rc, out, err = _bounded([*argv, "--stall", "3s", "--to", to], server.env(cli.env), cli.home)
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 3s (" in err, err
    assert "stopped answering" in err and "--stall" in err, err
    assert not os.path.exists(to)


def test_a_restore_on_boto3s_path_exits_once_it_has_said_the_stall(cli: Cli, tmp_path: Any) -> None:
    """The restore's download stops mid-body (the S3 server SIGSTOPped, the restore held for
    that moment so that it cannot end first) on boto3's own path, whose receives a stop does
    not cut. The restore says the stall and exits 14. Before the fix it said it and then
    waited at exit for the lanes' threads (a ThreadPoolExecutor's, joined at exit) until each
    request's read timeouts ran out."""
    with _weed(tmp_path) as (server, store, stopped):
        _seal(store, tmp_path, 4 << 20, files=24)
        to = str(tmp_path / "restored")
        argv = [*agent_exe(), "restore", "--store", store.url, "--name", RUN]
        env = server.env(cli.env, AWS_CSM_ENABLED="true")  # no lean reader: boto3's receives
        p = subprocess.Popen(
            [*argv, "--stall", "3s", "--to", to],
            env=env, cwd=cli.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + WAIT
            while not glob.glob(os.path.join(to, STAGE_PREFIX + "*")):
                assert p.poll() is None and time.monotonic() < deadline, "no download began"
                time.sleep(0.01)
            os.kill(p.pid, signal.SIGSTOP)
            try:
                _stop(server, stopped)
            finally:
                os.kill(p.pid, signal.SIGCONT)
            try:
                out, err = p.communicate(timeout=WAIT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the restore had not exited {WAIT:.0f}s after its store stopped")
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert p.returncode == 14, (out, err)
    assert f"{store.url} sent nothing of the checkpoint for 3s" in err, err
    assert not glob.glob(os.path.join(to, STAGE_PREFIX + "*")), os.listdir(to)


def test_rgt_status_of_a_run_whose_s3_store_stopped_ends_after_its_stall(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """`rgt status` of a run taken off its box reads the store's mirror of its state: with the
    S3 server stopped it exits 14 after the run's recorded stall (the job file's), naming the
    store and the read. Before the fix it waited botocore's 241 s per read."""
    with _weed(tmp_path) as (server, store, stopped):
        store.put_bytes(mf.state_key(RUN, "state.json"), b'{"state": "SUCCEEDED"}')
        rec = RunRecord(
            RUN,
            Target("local"),
            profile="local",
            store=store.url,
            store_endpoint_url=server.endpoint,
            store_stall=3.0,
            down_at=time.time(),
        )
        Registry().put(rec)
        env = server.env(dict(os.environ, **controller_env))
        rc, out, err = _bounded([*rgt_exe(), "status", RUN], env, str(tmp_path))
        assert rc == 0 and "SUCCEEDED" in out, (out, err)  # the store answers: the mirror
        _stop(server, stopped)
        rc, out, err = _bounded([*rgt_exe(), "status", RUN], env, str(tmp_path))
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 3s (reading {RUN}/state/state.json)" in err, err
    assert "stopped answering" in err and "[store] stall" in err, err


def test_a_restore_whose_download_stalls_names_the_stall_option_that_bounded_it(
    cli: Cli, tmp_path: Any
) -> None:
    """`rgt-agent restore --stall 2s` whose download moves nothing (the ``file://`` store's copy
    held after its first piece, as on a mount that hangs mid-file) ends after 2 s, and its error
    tells the option that gave that bound, as the store's own calls' error does. Before the fix
    it said to give the store longer with ``[store] stall in the job file``, which the command
    does not read."""
    _root, store = _file_store(tmp_path, SMALL_FILE + (1 << 20))  # copied in pieces
    env = dict(cli.env, RGT_HOLD_AT="copy.after_piece")
    to = str(tmp_path / "restored")
    argv = [*agent_exe(), "restore", "--store", store.url, "--name", RUN, "--stall", "2s"]
    rc, out, err = _bounded([*argv, "--to", to], env, cli.home)
    assert rc == 14, (out, err)
    assert f"{store.url} sent nothing of the checkpoint for 2s" in err, err
    assert "can be given longer: --stall" in err and "[store] stall" not in err, err
    # The CLI's line puts the remedy in one pair of parentheses: none of its own inside it.
    line = next(x for x in err.splitlines() if "sent nothing of the checkpoint" in x)
    assert "a hung mount" in line and nesting(line) == 1, line
    assert not os.path.exists(to)


def test_a_hung_store_call_is_not_retried_so_the_user_waits_its_bound_once(tmp_path: Any) -> None:
    """A call that outlives its bound raises StoreHung, and ``with_retries`` (which every read
    of the store goes through) gives it up at once: a hung store is no transient hiccup, and
    each retry would have added its backoff (0.5 + 1 + 2 + 4 s) to the bound the user set. The
    error names the store, the call and the bound. Before the fix ``with_retries`` slept its
    backoff four times before raising it (a 3 s bound took about 12 s)."""
    with _weed(tmp_path) as (server, store, stopped):
        _stop(server, stopped)
        slept: List[float] = []
        with store.calls_bounded(1.0), pytest.raises(StoreHung) as hung:
            with_retries(lambda: store.get_bytes(mf.latest_key(RUN)), sleep=slept.append)
    assert slept == [], "with_retries backed off and retried a hung store"
    assert f"{store.url} did not answer for 1s (reading {mf.latest_key(RUN)})" in hung.value.what
    assert hung.value.exit_code == 14


def test_a_call_refused_while_an_earlier_one_is_hung_names_itself_and_the_hung_one(
    tmp_path: Any,
) -> None:
    """The server stopped: a read of LATEST.json outlives its 1 s bound and is left hung; a
    look at another key, made while that read is still hung, is refused at once. Its error
    names the refused call (what was not done) and the earlier call still hung (why). Before
    the fix the refusal repeated the hung call's error word for word: "did not answer for 1s
    (reading .../LATEST.json)", naming a call that was not this one."""
    latest, other = mf.latest_key(RUN), mf.done_key(RUN)
    with _weed(tmp_path) as (server, store, stopped):
        _stop(server, stopped)
        with store.calls_bounded(1.0):
            with pytest.raises(StoreHung) as hung:
                store.get_bytes(latest)
            with pytest.raises(StoreHung) as refused:
                store.stat(other)
    assert f"{store.url} did not answer for 1s (reading {latest})" in hung.value.what
    what = refused.value.what
    assert f"{store.url} was not asked (looking at {other})" in what, what
    assert f"an earlier call (reading {latest}) is still hung" in what, what
    assert "[store] stall" in (refused.value.remedy or ""), refused.value.remedy
    assert refused.value.exit_code == 14


def _registered(server: SeaweedServer, store: Store) -> RunRecord:
    """RUN's laptop record on ``store``, taken off its box, its stall not recorded (the
    default, 5 min)."""
    rec = RunRecord(
        RUN,
        Target("local"),
        profile="local",
        store=store.url,
        store_endpoint_url=server.endpoint,
        down_at=time.time(),
    )
    Registry().put(rec)
    return rec


def test_rgt_pull_stall_bounds_its_reads_of_a_stopped_s3_store(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """`rgt pull --stall 2s` from an S3 server that stopped answering: exit 14 after 2 s, the
    store, the read and the option named, nothing made at --to. Before the fix `rgt pull` had
    no --stall (exit 2: no such option), and the pull waited on the run's recorded stall, by
    default 5 min, with no way to say less."""
    with _weed(tmp_path) as (server, store, stopped):
        _seal(store, tmp_path, 1 << 16)
        _registered(server, store)
        env = server.env(dict(os.environ, **controller_env))
        _stop(server, stopped)
        to = str(tmp_path / "pulled")
        argv = [*rgt_exe(), "pull", RUN, "--from", "store", "--to", to, "--stall", "2s"]
        rc, out, err = _bounded(argv, env, str(tmp_path))
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 2s (reading {RUN}/" in err, err
    assert "can be given longer: --stall" in err and "[store] stall" not in err, err
    assert not os.path.exists(to)


@pytest.mark.parametrize("bad", ["0", "-1s", "soon"])
def test_rgt_pull_refuses_a_bad_stall_as_rgt_agent_restore_does(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], bad: str
) -> None:
    """A bad `rgt pull --stall` is a usage error (exit 2) naming the option, as `rgt-agent
    restore --stall` says it, checked before the store is read or --to made."""
    Registry().put(RunRecord(RUN, Target("local"), profile="local", store="s3://b/p"))
    to = str(tmp_path / "pulled")
    argv = [*rgt_exe(), "pull", RUN, "--from", "store", "--to", to, f"--stall={bad}"]
    rc, out, err = _bounded(argv, dict(os.environ, **controller_env), str(tmp_path))
    agent = [*agent_exe(), "restore", "--store", "s3://b/p", "--name", RUN, f"--stall={bad}"]
    arc, _, aerr = _bounded([*agent, "--to", to], cli.env, cli.home)
    assert rc == arc == 2, (out, err, aerr)
    assert err.strip().splitlines()[-1] == aerr.strip().splitlines()[-1], (err, aerr)
    assert "--stall" in err and not os.path.exists(to), err
