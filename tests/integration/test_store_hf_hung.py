"""An ``hf://`` store whose Hub stops answering before a download: each command ends within its
stall bound, exit 14, naming the store and the call (onbox/sealing/stores/hangbound.py).

huggingface_hub gives its API requests no timeout (its client's is None): against a Hub that
stopped answering, `rgt-agent start` (its preflight's first request), `rgt-agent restore --stall
3s` and `rgt-agent checkpoints --stall 3s` each still waited after 300 s (measured before the
fix), and would have for ever.

The Hub is the FAKE one (tests/fakehub.py) in a process of its own (tests/hubproc.py),
SIGSTOPped: its listener still takes connections, and no answer comes, as from a Hub whose
server hung. It is SIGCONTed and ended by PID when the test leaves; every CLI run is bounded
(WAIT) and killed by PID past it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
from huggingface_hub import close_session
from huggingface_hub import constants as hf_constants

from onbox.sealing.stores.hf import HFStore
from tests.conftest import Cli, agent_exe
from tests.hubproc import hub_process
from tests.sealsvc import old_box_sealer

# huggingface_hub 2.4 hands httpx2 a file object for the LFS upload, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Use 'content=<...>' to upload raw bytes/text content:DeprecationWarning"
)

TOKEN = "hf_fake_bob_write"
REPO = "bob/ckpts"
RUN = "hung"
WAIT = 60.0  # the test's bound on each command: before the fix, still waiting after 300 s


@contextlib.contextmanager
def _hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Tuple[int, HFStore, List[bool]]]:
    """A fake Hub process, a store on it (this process's, to seal into it), and a flag list the
    test appends to once it has SIGSTOPped the Hub (hub_process SIGCONTs it in any case)."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)  # the fake has no Xet
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub-cache"))
    stopped: List[bool] = []
    with hub_process(TOKEN, "bob") as (pid, url):
        try:
            store = HFStore(REPO, "rgt", token=TOKEN, endpoint=url)
            store.ensure_repo()
            yield pid, store, stopped
        finally:
            close_session()  # drop this process's pooled connections to it


def _stop(pid: int, stopped: List[bool]) -> None:
    os.kill(pid, signal.SIGSTOP)
    stopped.append(True)


def _seal(store: HFStore, tmp_path: Path) -> None:
    """One checkpoint at step 10, sealed by the real Sealer into the Hub, as the run's box did."""
    path = tmp_path / "old-box-ckpt" / "ckpt_10"
    path.mkdir(parents=True)
    (path / "shard.bin").write_bytes(os.urandom(64 << 10))
    (path / ".rgt-complete").write_text(json.dumps({"step": 10}))
    assert old_box_sealer(RUN, str(path.parent), store, tmp_path).seal_pending() == 1


def _env(cli: Cli, store: HFStore, tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in cli.env.items() if not k.startswith(("HF_", "HUGGING"))}
    return dict(
        env,
        HF_TOKEN=TOKEN,
        HF_ENDPOINT=store.endpoint,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(tmp_path / "hf-home"),
    )


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
        pytest.fail(f"{' '.join(argv[-6:])} still waited on the stopped Hub after {WAIT:.0f}s")
    return p.returncode, out, err


def test_start_on_a_stopped_fake_hub_fails_within_its_stall_bound(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`start` checks the store before it claims the run; the preflight's first request to the
    stopped Hub is never answered: exit 14 after the job file's 3 s, nothing claimed."""
    with _hub(monkeypatch, tmp_path) as (pid, store, stopped):
        job = str(tmp_path / "job.toml")
        with open(job, "w") as f:
            f.write(f'name = "{RUN}"\n[store]\nurl = "{store.url}"\nstall = "3s"\n')
        _stop(pid, stopped)
        argv = [*agent_exe(), "start", job, "--name", RUN, "--", sys.executable, "-c", "pass"]
        rc, out, err = _bounded(argv, _env(cli, store, tmp_path), cli.home)
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 3s (its preflight for {RUN})" in err, err
    assert "the Hub" in err and "stopped answering" in err and "[store] stall" in err, err
    assert not os.path.exists(os.path.join(cli.home, "runs", RUN)), os.listdir(cli.home)


@pytest.mark.parametrize("command", ["checkpoints", "restore"])
def test_checkpoints_and_restore_on_a_stopped_fake_hub_end_after_stall(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """`rgt-agent checkpoints` lists the run's epochs first, `restore` reads its LATEST (and
    its quarantine records beside it): with the Hub stopped they exit 14 after --stall, naming
    the store, the call and the option; nothing restored."""
    with _hub(monkeypatch, tmp_path) as (pid, store, stopped):
        _seal(store, tmp_path)
        to = str(tmp_path / "restored")
        extra = ["--to", to] if command == "restore" else []
        argv = [*agent_exe(), command, "--store", store.url, "--name", RUN, "--stall", "3s"]
        _stop(pid, stopped)
        rc, out, err = _bounded([*argv, *extra], _env(cli, store, tmp_path), cli.home)
    assert rc == 14, (out, err)
    assert f"{store.url} did not answer for 3s (" in err, err
    assert "stopped answering" in err and "--stall" in err, err
    assert not os.path.exists(to)


# In a process of its own: the call left hung holds a connection of huggingface_hub's shared
# client, which this test's process would carry into the next tests.
PUT = """
import sys
from onbox.common.errors import TransientStoreError
from onbox.sealing.stores.hangbound import StoreHung
from onbox.sealing.stores.hf import HFStore
store = HFStore("bob/ckpts", "rgt", token=sys.argv[1], endpoint=sys.argv[2])
with store.calls_bounded(2.0):
    for call in (lambda: store.put_bytes("hung/LATEST.json", b"{}"),
                 lambda: store.stat("hung/LATEST.json")):
        try:
            call()
            print("answered")
        except StoreHung as e:
            print(type(e).__name__, isinstance(e, TransientStoreError), e.what)
"""


def test_a_document_put_to_a_stopped_fake_hub_ends_after_its_bound(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put of a document (the sealer's LATEST, a run's state) while the store's calls are
    bounded: StoreHung (transient) after the bound, and the next call fails at once while that
    one is still hung, rather than waiting the bound again. Before the fix the put waited for
    ever."""
    with _hub(monkeypatch, tmp_path) as (pid, store, stopped):
        _stop(pid, stopped)
        argv = [sys.executable, "-c", PUT, TOKEN, store.endpoint]
        rc, out, err = _bounded(argv, _env(cli, store, tmp_path), cli.home)
    assert rc == 0, (out, err)
    put, stat = out.splitlines()
    assert put.startswith("StoreHung True ") and stat.startswith("StoreHung True "), out
    assert f"{store.url} did not answer for 2s (writing {RUN}/LATEST.json)" in put, out
