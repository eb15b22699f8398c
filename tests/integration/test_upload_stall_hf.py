"""An ``hf://`` store whose Hub stops taking a checkpoint's upload: the seal is cut after
``[store] stall`` with nothing moved, and the agent lets go of the run in time; an upload that
is slow but moves is never cut (onbox/sealing/stores/hfmoved.py); once the Hub answers again,
the cut upload's thread ends and the same sealer, or agent, seals the next checkpoint.

huggingface_hub sets no timeout on its requests and reports no progress: before the fix an LFS
upload whose storage stopped reading held the seal, and the agent's sealing thread, for as long
as the Hub hung (for ever), and `rgt-agent stop` then found the run's lock still held.

The Hub is the FAKE one (tests/fakehub.py), in this process, over real HTTP on loopback: its
storage server takes the first 64 KiB of an upload and then reads and answers nothing
(``hold_uploads``), as a Hub that stopped answering mid-upload, until the test lets those
connections go (``release_uploads``, in a ``finally``), taking later uploads meanwhile once it
``recover_uploads``; or it holds a commit unanswered
(``before_next_commit``); or it reads each upload slowly (``slow_uploads``). The agents and
jobs are real processes, waited for with a bound (WAIT) and killed by PID past it (the cli
fixture).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from huggingface_hub import close_session, get_session, set_client_factory
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils._http import default_client_factory

from onbox.agent import procfs
from onbox.sealing.stores import hfmoved
from onbox.sealing.stores.hangbound import StoreHung
from onbox.sealing.stores.hf import HFStore
from tests.conftest import Cli
from tests.fakehub import FakeHub
from tests.heldstore import staged_job
from tests.polling import wait
from tests.sealsvc import old_box_sealer

# huggingface_hub 2.4 hands httpx2 a file object for the LFS upload, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Use 'content=<...>' to upload raw bytes/text content:DeprecationWarning"
)

TOKEN = "hf_fake_bob_write"
REPO = "bob/ckpts"
RUN = "hfstall"
WAIT = 45.0  # the test's bound on a seal or an agent's exit: before the fix, for ever
# tests/heldstore.py's staged job; its step 2 16 MiB: more than the socket buffers hold, so its
# upload is held mid-request.
JOB = staged_job("os.urandom(16 << 20)")


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A fresh fake Hub with bob's repo; this process's huggingface_hub pointed at it. Held
    uploads are let go, and the Hub stopped, when the test leaves."""
    hub = FakeHub().start()
    hub.add_token(TOKEN, "bob")
    hub.create_repo(REPO)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)  # the fake has no Xet
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub-cache"))
    # The client's timeout is the process's largest bound given (hfmoved.py): a test that ran
    # before in this process (another file's store, with the default bound) must not have set
    # it to minutes, so each test starts with none given.
    monkeypatch.setattr(hfmoved, "_idle", None)
    set_client_factory(default_client_factory)
    try:
        yield hub
    finally:
        hub.release_uploads()
        hub.stop()
        set_client_factory(default_client_factory)
        close_session()  # drop this process's pooled connections to it
    assert not hub.bugs, hub.bugs


def _latest(hub: FakeHub) -> Optional[int]:
    f = hub.file(REPO, f"rgt/{RUN}/LATEST.json")
    return None if f is None else int(json.loads(f.content)["step"])


def _checkpoint(tmp_path: Path, size: int) -> str:
    """A checkpoint dir with one complete checkpoint at step 10: one file of ``size`` bytes."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "ckpt_10").mkdir(parents=True)
    (ckpt / "ckpt_10" / "shard.bin").write_bytes(os.urandom(size))
    (ckpt / "ckpt_10" / ".rgt-complete").write_text(json.dumps({"step": 10}))
    return str(ckpt)


def _seal(store: HFStore, tmp_path: Path, ckpt: str, before: Any = lambda: None) -> Any:
    """The real sealer's pass over ``ckpt`` in a daemon thread, its epoch taken before, then
    ``before()``: (thread, what it raised)."""
    sealer = old_box_sealer(RUN, ckpt, store, tmp_path)
    before()
    raised: List[BaseException] = []

    def seal() -> None:
        try:
            sealer.seal_pending()
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=seal, daemon=True)
    t.start()
    return t, raised


def test_a_seal_whose_upload_the_fake_hub_stops_taking_is_cut_after_its_stall_bound(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The storage stops reading a checkpoint's LFS upload after its first 64 KiB: the seal
    fails as a StoreHung once nothing moved for the bound (2 s), naming the store and the
    upload, and no MANIFEST names the step. Before the fix: still waiting after WAIT."""
    store = HFStore(REPO, "rgt", token=TOKEN, endpoint=hub.url)
    store.bound_calls(2.0)
    ckpt = _checkpoint(tmp_path, 16 << 20)
    hub.hold_uploads()
    t, raised = _seal(store, tmp_path, ckpt)
    assert hub.upload_held.wait(WAIT), "the upload never reached the storage"
    t.join(WAIT)
    assert not t.is_alive(), f"the seal still waited on the held upload after {WAIT:.0f}s"
    assert raised and isinstance(raised[0], StoreHung), raised
    assert f"{store.url} took nothing for 2s (uploading {RUN}/checkpoints/10/" in str(raised[0])
    # The upload left hung ends once the Hub answers again; waited for, so that no thread of
    # this test holds a connection of huggingface_hub's shared client into the next test.
    hub.release_uploads()
    wait(lambda: not _left_puts(), WAIT, "the left upload to end once the Hub answers")
    assert hub.file(REPO, f"rgt/{RUN}/checkpoints/10/MANIFEST.json") is None


def test_a_seal_whose_commit_the_fake_hub_never_answers_is_cut_after_its_stall_bound(
    hub: FakeHub, tmp_path: Path
) -> None:
    """The file's content is taken, but the Hub never answers its commit: the seal fails as
    a StoreHung once nothing moved for the bound, and no MANIFEST names the step. Before the
    fix: still waiting after WAIT."""
    store = HFStore(REPO, "rgt", token=TOKEN, endpoint=hub.url)
    store.bound_calls(2.0)
    answer, asked = threading.Event(), threading.Event()

    def hang() -> None:
        asked.set()
        answer.wait()

    t, raised = _seal(
        store, tmp_path, _checkpoint(tmp_path, 1 << 20), lambda: hub.before_next_commit(hang)
    )
    try:
        assert asked.wait(WAIT), "the commit never reached the Hub"
        t.join(WAIT)
        assert not t.is_alive(), f"the seal still waited on the commit after {WAIT:.0f}s"
    finally:
        answer.set()
    assert raised and isinstance(raised[0], StoreHung), raised
    assert f"{store.url} took nothing for 2s (uploading {RUN}/checkpoints/10/" in str(raised[0])
    wait(lambda: not _left_puts(), WAIT, "the left upload to end once the Hub answers")
    assert hub.file(REPO, f"rgt/{RUN}/checkpoints/10/MANIFEST.json") is None


def test_after_a_cut_upload_the_fake_hub_answers_again_and_the_next_seal_goes_through(
    hub: FakeHub, tmp_path: Path
) -> None:
    """An upload is cut as the Hub stops taking it; the Hub then answers again, but keeps the
    cut upload's connection open and never reads it. The cut upload's thread ends (the
    client's timeout, hfmoved.py), and the same sealer's next seal, of a later checkpoint, goes
    through. Before the fix the left thread waited on that connection for ever, and every
    later upload was refused ("an earlier call ... is still hung") until the agent restarted."""
    store = HFStore(REPO, "rgt", token=TOKEN, endpoint=hub.url)
    store.bound_calls(2.0)
    ckpt = _checkpoint(tmp_path, 16 << 20)
    sealer = old_box_sealer(RUN, ckpt, store, tmp_path)
    hub.hold_uploads()
    with pytest.raises(StoreHung, match="took nothing for 2s"):
        sealer.seal_pending()
    assert _left_puts(), "no upload thread was left"
    hub.recover_uploads()
    wait(lambda: not _left_puts(), WAIT, "the cut upload's thread to end")
    assert hub.holding(), "the cut upload's connection was let go: the test tests nothing"
    (Path(ckpt) / "ckpt_20").mkdir()
    (Path(ckpt) / "ckpt_20" / "shard.bin").write_bytes(os.urandom(1 << 20))
    (Path(ckpt) / "ckpt_20" / ".rgt-complete").write_text(json.dumps({"step": 20}))
    sealer.seal_pending()
    assert _latest(hub) == 20
    assert hub.file(REPO, f"rgt/{RUN}/checkpoints/20/MANIFEST.json") is not None


def _left_puts() -> List[threading.Thread]:
    """The upload threads (onbox/sealing/upload.py) still running in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("rgt-seal-put_")]


BOUND = 2.0  # the stall bound of the slow upload: it takes longer, and is never still as long


def test_a_slow_upload_to_the_fake_hub_that_moves_is_not_cut(hub: FakeHub, tmp_path: Path) -> None:
    """The storage reads a 32 MiB upload 1 MiB at a time, 0.2 s apart: the upload takes longer
    than the bound, and than the timeout of huggingface_hub's client (twice the bound, per
    send: hfmoved.py), and is sealed, since each piece the Hub takes is movement."""
    store = HFStore(REPO, "rgt", token=TOKEN, endpoint=hub.url)
    store.bound_calls(BOUND)
    ckpt = _checkpoint(tmp_path, 32 << 20)
    hub.slow_uploads(1 << 20, 0.2)
    t, raised = _seal(store, tmp_path, ckpt)
    t.join(WAIT * 2)
    assert not t.is_alive() and not raised, raised
    assert hub.slow_pieces * 0.2 > BOUND  # the upload took longer than the bound: it moved
    # ... and than the client's timeout: it bounds a send, not a request
    idle = get_session().timeout.write
    assert idle is not None and hub.slow_pieces * 0.2 > idle
    assert _latest(hub) == 10


def _env(cli: Cli, hub: FakeHub, tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in cli.env.items() if not k.startswith(("HF_", "HUGGING"))}
    return dict(
        env,
        HF_TOKEN=TOKEN,
        HF_ENDPOINT=hub.url,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(tmp_path / "hf-home"),
    )


@pytest.mark.parametrize("how", ["stop", "fail"])
def test_an_agent_whose_upload_the_fake_hub_stops_taking_lets_go_of_the_run_in_time(
    cli: Cli, hub: FakeHub, tmp_path: Path, how: str
) -> None:
    """Step 1 sealed into the Hub; then its storage stops taking uploads, and the agent is held
    in step 2's when the run ends (`rgt-agent stop`, or the job fails). The agent says the
    upload that moved nothing (seal_error, naming the store, its remedy the store's stall),
    leaves LATEST at step 1, ends the run and exits within WAIT. Before the fix it stayed as
    long as the Hub held the upload: `rgt-agent stop` failed (exit 10, the lock still held)."""
    cli.env = _env(cli, hub, tmp_path)
    job_py, job = tmp_path / "job.py", tmp_path / "job.toml"
    job_py.write_text(JOB)
    argv = [sys.executable, str(job_py), str(tmp_path), "3"]
    job.write_text(
        # start_grace: RUNNING (waited for below) 1 s after the start, not 5; the job never
        # exits before the test tells it to.
        f'command = {json.dumps(argv)}\n[restart]\nmax_error_restarts = 0\nstart_grace = "1s"\n'
        f'[store]\nurl = "hf://{REPO}/rgt"\nstall = "3s"\n'
    )
    cli("start", str(job), "--name", RUN, "--grace", "5", check=True, cwd=cli.home)
    cli.wait_state(RUN, "RUNNING")
    cli.wait_output(RUN, "ready")
    wait(lambda: _latest(hub) == 1, 60, "step 1 sealed")
    pid = cli.status(RUN)["agent"]["pid"]
    agent = procfs.identity(pid)
    hub.hold_uploads()
    (tmp_path / "more").write_text("")
    assert hub.upload_held.wait(60), "step 2's upload never reached the storage"
    if how == "stop":
        p = cli("stop", RUN, "--grace", "1", timeout=WAIT + 30)
        assert p.returncode == 0, (p.stdout, p.stderr)
    else:
        (tmp_path / "go").write_text("")
    wait(lambda: not procfs.is_alive(agent), WAIT, f"the agent (pid {pid}) to exit")
    assert cli.peek(RUN)["state"] == {"stop": "STOPPED", "fail": "FAILED"}[how]
    assert _latest(hub) == 1  # never a step whose upload was cut
    assert hub.file(REPO, f"rgt/{RUN}/checkpoints/2/MANIFEST.json") is None
    errors = [e for e in cli.events(RUN) if e["kind"] == "seal_error"]
    moved = [e for e in errors if "took nothing for 3s" in e["reason"]]
    assert moved and all("[store] stall" in e["remedy"] for e in moved), errors
    assert all(f"hf://{REPO}/rgt" in e["reason"] for e in moved), errors


# Step 1, then once ``more`` exists step 2 (16 MiB, held), then once ``later`` exists step 3.
LATER_JOB = """\
import os, sys, time
d, tmp = os.environ["RGT_CKPT_DIR"], sys.argv[1]
os.makedirs(d, exist_ok=True)

def write(step, data):
    path = os.path.join(d, f"step_{step}.pt")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)

def wait(name):
    while not os.path.exists(os.path.join(tmp, name)):
        time.sleep(0.05)

write(1, b"weights of step 1" * 100)
print("ready", flush=True)
wait("more")
write(2, os.urandom(16 << 20))
wait("later")
write(3, b"weights of step 3" * 100)
print("step 3", flush=True)
wait("go")
"""


def test_an_agent_seals_again_once_the_fake_hub_answers_after_a_cut_upload(
    cli: Cli, hub: FakeHub, tmp_path: Path
) -> None:
    """Step 2's upload is cut (the storage stopped reading it); the Hub then answers again but
    keeps that upload's connection open, unread. The same agent seals step 3: LATEST reaches
    it within WAIT. Before the fix the cut upload's thread waited on that connection for ever,
    and the agent refused every later upload until it was restarted."""
    cli.env = _env(cli, hub, tmp_path)
    job_py, job = tmp_path / "job.py", tmp_path / "job.toml"
    job_py.write_text(LATER_JOB)
    argv = [sys.executable, str(job_py), str(tmp_path)]
    job.write_text(
        f"command = {json.dumps(argv)}\n"
        '[restart]\nstart_grace = "1s"\n'  # RUNNING (waited for below) 1 s after the start
        f'[store]\nurl = "hf://{REPO}/rgt"\nstall = "3s"\n'
    )
    cli("start", str(job), "--name", RUN, "--grace", "5", check=True, cwd=cli.home)
    cli.wait_state(RUN, "RUNNING")
    wait(lambda: _latest(hub) == 1, 60, "step 1 sealed")
    pid = cli.status(RUN)["agent"]["pid"]
    hub.hold_uploads()
    (tmp_path / "more").write_text("")
    assert hub.upload_held.wait(60), "step 2's upload never reached the storage"
    wait(
        lambda: any("took nothing for 3s" in e["reason"] for e in _seal_errors(cli)),
        WAIT,
        "step 2's upload to be cut",
    )
    hub.recover_uploads()
    (tmp_path / "later").write_text("")
    cli.wait_output(RUN, "step 3")
    wait(
        lambda: _latest(hub) == 3,
        WAIT,
        "step 3 sealed by the same agent",
        info=lambda: _seal_errors(cli),
    )
    assert hub.holding(), "step 2's connection was let go: the test tests nothing"
    assert cli.status(RUN)["agent"]["pid"] == pid
    p = cli("stop", RUN, "--grace", "1", timeout=WAIT + 30)
    assert p.returncode == 0, (p.stdout, p.stderr)


def _seal_errors(cli: Cli) -> List[Dict[str, Any]]:
    return [e for e in cli.events(RUN) if e["kind"] == "seal_error"]
