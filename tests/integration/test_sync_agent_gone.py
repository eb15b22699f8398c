"""`rgt-agent sync` while the run's agent dies: the seal is made anyway.

`sync` asks a live agent to seal and waits; with no agent it seals from itself. An agent that
dies while `sync` waits on it (the OOM killer, a person's kill, a preemption of the agent alone)
used to leave `sync` waiting out its whole timeout, or, when the lock came free between two
looks, failing at once with "does not answer" (exit 10): the user's explicit "seal now" lost.
Now `sync` seals from itself as soon as no agent holds the run. Real agent, real job, a real
SIGSTOP and SIGKILL, a file:// store.

And a sync exits 0 only when the box's newest complete checkpoint is sealed: a seal that found
the checkpoint changed under it sealed nothing, and the sync used to exit 0 all the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Tuple

from onbox.agent import procfs
from onbox.common.faults import STOP_AFTER_EVENT
from tests.conftest import Cli, agent_exe
from tests.polling import wait

JOB = """\
import os, signal, sys, time
ckpt = sys.argv[1]
os.makedirs(ckpt, exist_ok=True)
path = os.path.join(ckpt, "step_1.pt")
with open(path + ".tmp", "wb") as f:
    f.write(b"step one" * 1000)
os.replace(path + ".tmp", path)
print("wrote step_1.pt", flush=True)
time.sleep(120)  # bounded: the test kills it by PID long before
"""


# A job that writes no checkpoint: the test puts one in its checkpoint dir before the start.
STILL = """\
import time
print("ready", flush=True)
time.sleep(120)  # bounded: the test's sweep kills it by PID long before
"""


def _job(tmp_path: Any, job: str = JOB) -> Tuple[str, str]:
    """The job's spec (its store under ``tmp_path``): (job.toml's path, the store's root)."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = str(tmp_path / "box")
    os.makedirs(work)
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(job)
    ckpt = os.path.join(work, "ckpt")
    with open(os.path.join(work, "job.toml"), "w") as f:
        f.write(
            'name = "gone"\n'
            f"command = {json.dumps([sys.executable, 'job.py', ckpt])}\n"
            f'store = "file://{root}"\n'
            # An hour's scan: the agent seals only when asked (or woken by a close), so what
            # is sealed below is the sync's doing.
            f'[checkpoint]\ndir = {json.dumps(ckpt)}\nscan = "1h"\n'
        )
    return os.path.join(work, "job.toml"), root


def _sync_while_the_agent_dies(cli: Cli, agent: int, shim: int) -> Tuple[int, str, str]:
    """Stop the agent, start `rgt-agent sync`, kill the agent once asked: sync's (code, out,
    err). The shim is killed too (it would bring no agent back: RGT_AGENT_RESPAWN_DELAY)."""
    os.kill(agent, signal.SIGSTOP)  # holds the run's lock and answers nothing
    env = {k: v for k, v in cli.env.items() if k != STOP_AFTER_EVENT}
    sync = subprocess.Popen(
        [*agent_exe(), "sync", "gone", "--timeout", "30s"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        request = os.path.join(cli.home, "runs", "gone", "sync.request")
        wait(lambda: os.path.exists(request), 30, "sync to ask the agent")
        os.kill(agent, signal.SIGKILL)  # dies without answering: the lock comes free
        out, err = sync.communicate(timeout=50)
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
        os.kill(shim, signal.SIGKILL)
    return sync.returncode, out, err


def _assert_sealed_step_1(root: str, code: int, out: str, err: str) -> None:
    assert code == 0, (code, out, err)
    assert "LATEST is step 1" in out, (out, err)
    with open(os.path.join(root, "gone", "LATEST.json")) as f:
        assert json.load(f)["step"] == 1


def test_sync_seals_from_itself_when_the_agent_it_asked_dies(cli: Cli, tmp_path: Any) -> None:
    spec, root = _job(tmp_path)
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # the shim does not bring the agent back
    cli("start", spec, check=True, cwd=os.path.dirname(spec))
    st = cli.wait_state("gone", "RUNNING", "STARTING")
    cli.wait_output("gone", "wrote step_1.pt")
    _assert_sealed_step_1(root, *_sync_while_the_agent_dies(cli, st["agent"]["pid"], st["pid"]))


def test_sync_finishes_a_seal_the_dead_agent_left_between_manifest_and_latest(
    cli: Cli, tmp_path: Any
) -> None:
    """The agent, woken by the job's close, wrote step 1's MANIFEST and is stopped before it
    moved LATEST (its first: there is none yet), then killed while sync waits on it. Sync
    must promote that verified MANIFEST: it used to count step 1 as sealed and exit 0 with
    "LATEST is step none" (seen once under load, where the SIGSTOP landed right there)."""
    spec, root = _job(tmp_path)
    # The `sealed` event is written between the MANIFEST and LATEST: the agent stops there.
    cli.env.update({"RGT_AGENT_RESPAWN_DELAY": "1000", STOP_AFTER_EVENT: "sealed"})
    cli("start", spec, check=True, cwd=os.path.dirname(spec))
    st = cli.wait_state("gone", "RUNNING", "STARTING")
    agent = st["agent"]["pid"]
    wait(lambda: _stopped(agent), 60, "the agent to stop after step 1's MANIFEST")
    assert [e["kind"] for e in cli.events("gone")][-1] == "sealed"
    assert os.path.exists(os.path.join(root, "gone", "checkpoints", "1", "MANIFEST.json"))
    assert not os.path.exists(os.path.join(root, "gone", "LATEST.json"))
    _assert_sealed_step_1(root, *_sync_while_the_agent_dies(cli, agent, st["pid"]))


def _stopped(pid: int) -> bool:
    st = procfs.read_stat(pid)
    return st is not None and st.state in ("T", "t")


def test_a_sync_whose_seal_found_the_checkpoint_changed_fails_saying_so(
    cli: Cli, tmp_path: Any
) -> None:
    """The agent's pass for the sync holds at the store's put of step_1.pt (a hold point); the
    job's file grows meanwhile and stays open for writing: the seal reads that as "changed
    while sealed" and seals nothing (the open file is no complete checkpoint for the next
    pass either). The sync used to exit 0, "LATEST is step none"."""
    spec, root = _job(tmp_path, STILL)
    ckpt = os.path.join(os.path.dirname(spec), "ckpt")
    os.makedirs(ckpt)
    path = os.path.join(ckpt, "step_1.pt")
    with open(path, "wb") as f:
        f.write(b"step one" * 1000)
    reached, release = str(tmp_path / "reached"), str(tmp_path / "release")
    cli.env.update(RGT_HOLD_AT="store.put_file", RGT_HOLD_REACHED=reached)
    cli.env["RGT_HOLD_UNTIL"] = release
    cli("start", spec, check=True, cwd=os.path.dirname(spec))
    cli.wait_output("gone", "ready")
    sync = subprocess.Popen(
        [*agent_exe(), "sync", "gone", "--timeout", "60s"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait(lambda: os.path.exists(reached), 60, "the sync's seal to reach the store")
        with open(path, "ab") as writer:  # the job writes it again while it is sealed
            writer.write(b"a later save")
            writer.flush()
            open(release, "w").close()
            out, err = sync.communicate(timeout=90)
            print(err)  # shown when the test fails
            assert sync.returncode == 22, (sync.returncode, out, err)
            assert "step 1, is not sealed" in err, err
            assert "changed" in err and "rgt-agent sync gone" in err, err
            assert not os.path.exists(os.path.join(root, "gone", "LATEST.json"))
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
    # Closed, it holds still: a sync again seals it, and says so.
    p = cli("sync", "gone", check=True)
    assert "LATEST is step 1" in p.stdout, p.stdout
