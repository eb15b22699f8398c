"""One writer per run, fenced at every write (issue 11, findings 1 and 4): two real agents'
sealers on one run, on real stores (a directory, SeaweedFS; the Hub through the FAKE Hub).

Agent A (an older epoch) is a real second process running the real Sealer; it freezes itself
with SIGSTOP at one step of its seal (before it uploads its object, before it writes its
MANIFEST, before it moves LATEST: the moments a preempted box comes back at), while agent B
(the newest epoch, in this process) restores and seals its own checkpoint of the same step.
Then A is resumed with SIGCONT. Whatever the order, the store must end with LATEST and the
MANIFEST of that step written by B, a restore returning B's bytes, B's objects unchanged, and
A saying once that it is stale and writing nothing after. A late MANIFEST of A's above LATEST is
never promoted by the next start. After restore falls back from a corrupt checkpoint, the job's
next, lower checkpoint is sealed and LATEST re-pointed to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from tests.conftest import ROOT
from tests.polling import wait
from tests.seaweed import SeaweedServer

RUN = "fence"

# Agent A: the real Sealer in a process of its own, frozen (SIGSTOP to itself) at one step.
CHILD = r"""
import json, os, signal, sys
from onbox.sealing.epochs import take_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store

cfg = json.loads(sys.argv[1])
store = open_store(cfg["url"])
events = open(cfg["events"], "a")


def event(kind, reason, **kw):
    events.write(json.dumps({"kind": kind, "reason": reason, "klass": kw.get("klass")}) + "\n")
    events.flush()


armed = [False]
pause = cfg["pause"]
real_put_file, real_put_bytes, real_put_data = store.put_file, store.put_bytes, store.put_data


def stop():
    if armed[0]:
        armed[0] = False
        os.kill(os.getpid(), signal.SIGSTOP)


def put_file(key, *a, **k):
    if pause == "object":
        stop()
    return real_put_file(key, *a, **k)


def put_data(key, *a, **k):
    if pause == "object":
        stop()
    return real_put_data(key, *a, **k)


def put_bytes(key, data, **k):
    if (pause == "manifest" and key.endswith("/MANIFEST.json")) or (
        pause == "latest" and key.endswith("/LATEST.json")
    ):
        stop()
    return real_put_bytes(key, data, **k)


store.put_file, store.put_bytes, store.put_data = put_file, put_bytes, put_data
s = Sealer(cfg["run"], cfg["ckpt"], store, cfg["staging"], epoch=take_epoch(store, cfg["run"]),
           event=event, state_path=cfg["state"])
s.load()
print(json.dumps({"epoch": s.epoch}), flush=True)
armed[0] = True
first = s.seal_pending()
# Once stale, nothing more: a newer checkpoint of A's is not sealed either.
with open(os.path.join(cfg["ckpt"], "step_90.pt"), "wb") as f:
    f.write(b"A's step 90" * 100)
second = s.seal_pending()
print(json.dumps({"first": first, "second": second, "stale": s.stale}), flush=True)
"""


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store URL; for s3, the environment points boto3 at SeaweedFS (the child
    inherits it, as an agent would)."""
    if request.param == "file":
        (tmp_path / "durable").mkdir()
        yield f"file://{tmp_path}/durable"
        return
    server: SeaweedServer = request.getfixturevalue("s3_server")
    saved = dict(os.environ)
    os.environ.update(server.env({}))
    try:
        yield f"s3://{server.bucket()}/rgt"
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Events:
    """An event sink that keeps what it is told."""

    def __init__(self) -> None:
        self.got: List[Dict[str, Any]] = []

    def __call__(self, kind: str, reason: str, **kw: Any) -> None:
        self.got.append({"kind": kind, "reason": reason, **kw})

    def kinds(self) -> List[str]:
        return [e["kind"] for e in self.got]


def _sealer(
    store: Store, tmp_path: Path, name: str, ckpt: str, events: Events, **kw: Any
) -> Sealer:
    return Sealer(
        RUN,
        ckpt,
        store,
        str(tmp_path / f"stage-{name}"),
        epoch=take_epoch(store, RUN),
        event=events,
        state_path=str(tmp_path / f"seq-{name}.json"),
        **kw,
    )


def _write(ckpt: str, name: str, data: bytes) -> None:
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)


def _doc(store: Store, key: str) -> Optional[Dict[str, Any]]:
    data = store.get_bytes(key)
    return None if data is None else dict(json.loads(data))


def _restored_bytes(store: Store, tmp_path: Path, name: str) -> bytes:
    dest = str(tmp_path / f"fresh-{time.monotonic_ns()}")
    doc = restore_latest(store, RUN, dest, Events())
    assert doc is not None
    with open(os.path.join(dest, name), "rb") as f:
        return f.read()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _agent_a(url: str, tmp_path: Path, pause: str, ckpt: str) -> subprocess.Popen[str]:
    cfg = {
        "url": url,
        "run": RUN,
        "ckpt": ckpt,
        "staging": str(tmp_path / "stage-a"),
        "state": str(tmp_path / "seq-a.json"),
        "events": str(tmp_path / "a-events.jsonl"),
        "pause": pause,
    }
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _events_of_a(tmp_path: Path) -> List[Dict[str, Any]]:
    with open(tmp_path / "a-events.jsonl") as f:
        return [json.loads(line) for line in f]


def _check_b_owns_step_30(store: Store, tmp_path: Path, a_epoch: int, b: Sealer) -> None:
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None
    assert (latest["step"], latest["epoch"], latest["writer"]) == (30, b.epoch, b.epoch), latest
    man = _doc(store, mf.manifest_key(RUN, 30))
    assert man is not None and man["epoch"] == b.epoch, man
    for f in man["files"]:  # B's objects, unchanged, under B's epoch
        assert f["key"].startswith(mf.epoch_prefix(RUN, 30, b.epoch)), f
        data = store.get_bytes(f["key"])
        assert data is not None and hashlib.sha256(data).hexdigest() == f["sha256"]
    assert _restored_bytes(store, tmp_path, "step_30.pt") == b"B's step 30" * 100
    # A wrote nothing under B's keys, and nothing of step 90 at all.
    assert not [i.key for i in store.list(f"{RUN}/checkpoints/90/")]
    stale = [e for e in _events_of_a(tmp_path) if e["kind"] == "stale_epoch"]
    assert len(stale) == 1, _events_of_a(tmp_path)
    assert f"epoch {b.epoch}" in stale[0]["reason"] and f"epoch {a_epoch}" in stale[0]["reason"]
    assert stale[0]["klass"] == "permanent"


@pytest.mark.parametrize("pause", ["object", "manifest", "latest"])
def test_a_stale_agent_frozen_mid_seal_never_overwrites_the_newer_agents_checkpoint(
    url: str, tmp_path: Path, pause: str
) -> None:
    """Finding 1, B first: A freezes before its object upload, its MANIFEST or its LATEST;
    B restores step 20 and seals its own step 30; A resumes and finishes what it can."""
    store = open_store(url)
    seed = _sealer(store, tmp_path, "seed", str(tmp_path / "seed"), Events())
    seed.load()
    _write(str(tmp_path / "seed"), "step_20.pt", b"step 20" * 100)
    seed.seal_pending()

    a_ckpt = str(tmp_path / "a")
    _write(a_ckpt, "step_20.pt", b"step 20" * 100)
    _write(a_ckpt, "step_30.pt", b"A's step 30" * 100)
    a = _agent_a(url, tmp_path, pause, a_ckpt)
    try:
        assert a.stdout is not None
        a_epoch = json.loads(a.stdout.readline())["epoch"]
        wait(lambda: _stopped(a.pid), 60, f"agent A to freeze before its {pause}", poll=0.02)
        if pause == "latest":  # A's MANIFEST of step 30 is in the store, LATEST not moved
            assert _doc(store, mf.manifest_key(RUN, 30))["epoch"] == a_epoch  # type: ignore[index]

        events = Events()
        b_ckpt = str(tmp_path / "b")
        b = _sealer(store, tmp_path, "b", b_ckpt, events)
        store.abort_stale_uploads(f"{RUN}/")  # as an agent's start does
        b.load()
        restored = restore_latest(store, RUN, b_ckpt, events)
        assert restored is not None
        b.remember_restored(restored)
        if pause == "latest":
            # A's MANIFEST of 30 was written, verified, before B started: B adopts it (as
            # after an agent killed between MANIFEST and LATEST) and goes on from it.
            assert restored["step"] == 30 and restored["epoch"] == a_epoch
            _write(b_ckpt, "step_40.pt", b"B's step 40" * 100)
            assert b.seal_pending() == 1
        else:
            assert restored["step"] == 20
            _write(b_ckpt, "step_30.pt", b"B's step 30" * 100)
            assert b.seal_pending() == 1
            assert b.latest == 30

        os.kill(a.pid, signal.SIGCONT)
        out, _ = a.communicate(timeout=120)
        assert a.returncode == 0, out
        result = json.loads(out.strip().splitlines()[-1])
        # Paused before LATEST, A's MANIFEST of 30 was sealed already: it counts, B adopted it.
        sealed = 1 if pause == "latest" else 0
        assert result == {"first": sealed, "second": 0, "stale": True}, result
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    if pause == "latest":
        latest = _doc(store, mf.latest_key(RUN))
        assert latest is not None
        assert (latest["step"], latest["epoch"], latest["writer"]) == (40, b.epoch, b.epoch)
        assert [e["kind"] for e in _events_of_a(tmp_path)].count("stale_epoch") == 1
        assert not [i.key for i in store.list(f"{RUN}/checkpoints/90/")]
    else:
        _check_b_owns_step_30(store, tmp_path, a_epoch, b)
        # B goes on sealing; the next start finds B's line intact.
        _write(b_ckpt, "step_40.pt", b"B's step 40" * 100)
        assert b.seal_pending() == 1
    c = _sealer(store, tmp_path, "c", str(tmp_path / "c"), Events())
    c.load()
    assert c.latest == 40
    assert _restored_bytes(store, tmp_path, "step_40.pt") == b"B's step 40" * 100


def test_a_stale_agent_that_resumes_first_writes_nothing_the_newer_one_needs(
    url: str, tmp_path: Path
) -> None:
    """Finding 1, A first: B has taken its epoch and loaded (claimed LATEST) while A was frozen
    before its MANIFEST; A resumes and runs to its end before B seals anything. A's MANIFEST
    lands as an orphan, but LATEST never moves to it, and B then seals its own step 30 over
    it."""
    store = open_store(url)
    seed = _sealer(store, tmp_path, "seed", str(tmp_path / "seed"), Events())
    seed.load()
    _write(str(tmp_path / "seed"), "step_20.pt", b"step 20" * 100)
    seed.seal_pending()

    a_ckpt = str(tmp_path / "a")
    _write(a_ckpt, "step_20.pt", b"step 20" * 100)
    _write(a_ckpt, "step_30.pt", b"A's step 30" * 100)
    a = _agent_a(url, tmp_path, "manifest", a_ckpt)
    events = Events()
    b_ckpt = str(tmp_path / "b")
    try:
        assert a.stdout is not None
        a_epoch = json.loads(a.stdout.readline())["epoch"]
        wait(lambda: _stopped(a.pid), 60, "agent A to freeze before its MANIFEST", poll=0.02)
        b = _sealer(store, tmp_path, "b", b_ckpt, events)
        b.load()  # claims LATEST (step 20) for B's epoch
        os.kill(a.pid, signal.SIGCONT)
        out, _ = a.communicate(timeout=120)
        assert a.returncode == 0, out
        assert json.loads(out.strip().splitlines()[-1])["stale"] is True
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None and (latest["step"], latest["writer"]) == (20, b.epoch), latest
    orphan = _doc(store, mf.manifest_key(RUN, 30))
    assert orphan is not None and orphan["epoch"] == a_epoch  # A's create landed, unpromoted
    restored = restore_latest(store, RUN, b_ckpt, events)
    assert restored is not None and restored["step"] == 20
    b.remember_restored(restored)
    _write(b_ckpt, "step_30.pt", b"B's step 30" * 100)
    assert b.seal_pending() == 1
    _check_b_owns_step_30(store, tmp_path, a_epoch, b)


def test_a_stale_agents_late_manifest_is_never_promoted_at_the_next_start(
    url: str, tmp_path: Path
) -> None:
    """A freezes before writing the MANIFEST of step 50, which B never reaches; B seals 30 and
    moves LATEST; A's late MANIFEST of step 50 lands. The next start keeps LATEST at 30."""
    store = open_store(url)
    seed = _sealer(store, tmp_path, "seed", str(tmp_path / "seed"), Events())
    seed.load()
    _write(str(tmp_path / "seed"), "step_20.pt", b"step 20" * 100)
    seed.seal_pending()

    a_ckpt = str(tmp_path / "a")
    _write(a_ckpt, "step_20.pt", b"step 20" * 100)
    _write(a_ckpt, "step_50.pt", b"A's step 50" * 100)
    a = _agent_a(url, tmp_path, "manifest", a_ckpt)
    try:
        assert a.stdout is not None
        json.loads(a.stdout.readline())
        wait(lambda: _stopped(a.pid), 60, "agent A to freeze before its MANIFEST", poll=0.02)
        b_ckpt = str(tmp_path / "b")
        b = _sealer(store, tmp_path, "b", b_ckpt, Events())
        b.load()
        restored = restore_latest(store, RUN, b_ckpt, Events())
        assert restored is not None
        b.remember_restored(restored)
        _write(b_ckpt, "step_30.pt", b"B's step 30" * 100)
        assert b.seal_pending() == 1
        os.kill(a.pid, signal.SIGCONT)
        out, _ = a.communicate(timeout=120)
        assert a.returncode == 0, out
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    late = _doc(store, mf.manifest_key(RUN, 50))
    if late is not None:  # A's create-if-absent may land: it is an orphan, never LATEST
        assert late["epoch"] < b.epoch
    events = Events()
    c = _sealer(store, tmp_path, "c", str(tmp_path / "c"), events)
    c.load()
    assert c.latest == 30
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None and latest["step"] == 30 and latest["epoch"] == b.epoch
    if late is not None:
        assert "manifest_not_promoted" in events.kinds()
    assert _restored_bytes(store, tmp_path, "step_30.pt") == b"B's step 30" * 100


def test_a_newer_manifest_is_promoted_only_when_its_files_are_there(
    url: str, tmp_path: Path
) -> None:
    """An agent that died between its MANIFEST and LATEST left step 30 behind: the next start
    promotes it. One that left step 40 with an object missing: the next start does not (and
    LATEST stays at 30)."""
    store = open_store(url)

    def seal_without_latest(name: str, step: int) -> Dict[str, Any]:
        ckpt = str(tmp_path / name)
        s = _sealer(store, tmp_path, name, ckpt, Events())
        s.load()
        _write(ckpt, f"step_{step}.pt", f"step {step}".encode() * 100)
        s.ledger.advance_latest = lambda step, epoch=None: False  # type: ignore[method-assign]
        s.seal_pending()  # the MANIFEST, LATEST left: as if killed in between
        man = _doc(store, mf.manifest_key(RUN, step))
        assert man is not None
        return man

    first = _sealer(store, tmp_path, "first", str(tmp_path / "first"), Events())
    first.load()
    _write(str(tmp_path / "first"), "step_20.pt", b"step 20" * 100)
    first.seal_pending()
    man = seal_without_latest("died30", 30)
    assert _doc(store, mf.latest_key(RUN))["step"] == 20  # type: ignore[index]
    b = _sealer(store, tmp_path, "b", str(tmp_path / "b"), Events())
    b.load()
    assert b.latest == 30
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None and (latest["step"], latest["epoch"]) == (30, man["epoch"])

    man = seal_without_latest("died40", 40)
    store.delete(man["files"][0]["key"])
    events = Events()
    c = _sealer(store, tmp_path, "c", str(tmp_path / "c"), events)
    c.load()
    assert c.latest == 30 and "manifest_not_promoted" in events.kinds()
    assert _doc(store, mf.latest_key(RUN))["step"] == 30  # type: ignore[index]


@pytest.mark.parametrize("whole", [True, False])
def test_the_first_manifest_with_no_latest_yet_is_promoted_only_when_its_files_are_there(
    url: str, tmp_path: Path, whole: bool
) -> None:
    """An agent that died between the run's first MANIFEST and its first LATEST: there is no
    LATEST at all. The next start promotes that MANIFEST when its files are all there; when one
    is missing it does not, and the step is sealed again. It used to count as sealed either
    way, with no LATEST until the next step (`rgt-agent sync`: "LATEST is step none", exit 0)."""
    store = open_store(url)
    a_ckpt = str(tmp_path / "a")
    a = _sealer(store, tmp_path, "a", a_ckpt, Events())
    a.load()
    _write(a_ckpt, "step_10.pt", b"step 10" * 100)
    a.ledger.advance_latest = lambda step, epoch=None: False  # type: ignore[method-assign]
    assert a.seal_pending() == 1  # the MANIFEST, no LATEST: as if killed in between
    assert _doc(store, mf.latest_key(RUN)) is None
    man = _doc(store, mf.manifest_key(RUN, 10))
    assert man is not None
    if not whole:
        store.delete(man["files"][0]["key"])

    events = Events()
    b_ckpt = str(tmp_path / "b")
    _write(b_ckpt, "step_10.pt", b"step 10" * 100)
    b = _sealer(store, tmp_path, "b", b_ckpt, events)
    b.load()
    latest = _doc(store, mf.latest_key(RUN))
    if whole:
        assert b.latest == 10 and b.seal_pending() == 0
        assert latest is not None and (latest["step"], latest["epoch"]) == (10, a.epoch)
        return
    assert b.latest is None and latest is None and "manifest_not_promoted" in events.kinds()
    assert b.seal_pending() == 1  # sealed again, in b's epoch
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None and (latest["step"], latest["epoch"]) == (10, b.epoch)


def test_after_a_fallback_from_a_quarantined_checkpoint_the_run_moves_on(
    url: str, tmp_path: Path
) -> None:
    """Finding 4: step 20 is corrupt in the store; a fresh box falls back to step 10; the job's
    step 15 is sealed and LATEST re-pointed down to it (quarantine: the one reason), and the
    job's new step 20 is sealed too and restorable."""
    store = open_store(url)
    ckpt = str(tmp_path / "old")
    s = _sealer(store, tmp_path, "old", ckpt, Events())
    s.load()
    for step in (10, 20):
        _write(ckpt, f"step_{step}.pt", f"old step {step}".encode() * 100)
        s.seal_pending()
    man = _doc(store, mf.manifest_key(RUN, 20))
    assert man is not None
    store.put_bytes(man["files"][0]["key"], b"bit rot" * 100)  # same key, other bytes

    events = Events()
    fresh = str(tmp_path / "fresh")
    b = _sealer(store, tmp_path, "b", fresh, events)
    b.load()
    restored = restore_latest(store, RUN, fresh, events)
    assert restored is not None and restored["step"] == 10
    b.remember_restored(restored)
    _write(fresh, "step_15.pt", b"new step 15" * 100)
    assert b.seal_pending() == 1
    latest = _doc(store, mf.latest_key(RUN))
    assert latest is not None and latest["step"] == 15 and latest["epoch"] == b.epoch
    assert "latest_after_quarantine" in events.kinds()
    assert _restored_bytes(store, tmp_path, "step_15.pt") == b"new step 15" * 100
    _write(fresh, "step_20.pt", b"new step 20" * 100)
    assert b.seal_pending() == 1
    assert _doc(store, mf.latest_key(RUN))["step"] == 20  # type: ignore[index]
    assert _restored_bytes(store, tmp_path, "step_20.pt") == b"new step 20" * 100
    # The quarantined checkpoint's record and MANIFEST are kept, out of the way.
    kept = [i.key for i in store.list(f"{RUN}/quarantine/")]
    assert any(k.endswith("/20.e1.json") for k in kept), kept


def test_prune_keeps_latest_the_one_before_it_and_shared_objects(url: str, tmp_path: Path) -> None:
    """keep=1 still leaves the newest checkpoint before LATEST, and an object a kept MANIFEST
    shares with a pruned one (same sha256) stays."""
    store = open_store(url)
    ckpt = str(tmp_path / "ckpt")
    s = _sealer(store, tmp_path, "s", ckpt, Events(), keep=1)
    s.load()
    for step in (1, 2, 3, 4):
        d = os.path.join(ckpt, f"step_{step}")
        _write(d, "shared.bin", b"the same every time" * 50)
        _write(d, "own.bin", f"step {step}".encode() * 50)
        _write(d, ".rgt-complete", json.dumps({"step": step}).encode())
        s.seal_pending()
    steps = sorted(
        st
        for st in (mf.manifest_step(RUN, i.key) for i in store.list(f"{RUN}/checkpoints/"))
        if st is not None
    )
    assert steps == [3, 4]
    for step in steps:
        doc = _doc(store, mf.manifest_key(RUN, step))
        assert doc is not None
        for f in doc["files"]:
            data = store.get_bytes(f["key"])
            assert data is not None and hashlib.sha256(data).hexdigest() == f["sha256"], f


# ---- hf:// through the FAKE Hub: the stale agent is paused by a seam in this process


@pytest.mark.filterwarnings(
    "ignore:Use 'content=<...>' to upload raw bytes/text content:DeprecationWarning"
)
def test_fake_hub_a_stale_agent_paused_mid_seal_never_overwrites_the_newer_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import close_session
    from huggingface_hub import constants as hf_constants

    from tests.fakehub import FakeHub

    hub = FakeHub().start()
    try:
        hub.add_token("hf_fake_write", "alice")
        hub.create_repo("alice/ckpts")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_write")
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        url = "hf://alice/ckpts/rgt"
        store = open_store(url)
        seed = _sealer(store, tmp_path, "seed", str(tmp_path / "seed"), Events())
        seed.load()
        _write(str(tmp_path / "seed"), "step_20.pt", b"step 20" * 100)
        seed.seal_pending()

        a_store = open_store(url)
        paused, go = threading.Event(), threading.Event()
        go.set()  # A's load passes; its seal then pauses before its MANIFEST
        real = a_store.put_bytes

        def put_bytes(key: str, data: bytes, **kw: Any) -> Any:
            if key.endswith("/MANIFEST.json") and not go.is_set():
                paused.set()
                go.wait(60)
            return real(key, data, **kw)

        a_store.put_bytes = put_bytes  # type: ignore[method-assign]
        a_ckpt = str(tmp_path / "a")
        _write(a_ckpt, "step_20.pt", b"step 20" * 100)
        _write(a_ckpt, "step_30.pt", b"A's step 30" * 100)
        a_events = Events()
        a = _sealer(a_store, tmp_path, "a", a_ckpt, a_events)
        a.load()
        go.clear()
        worker = threading.Thread(target=a.seal_pending)
        worker.start()
        assert paused.wait(60)

        b_ckpt = str(tmp_path / "b")
        b = _sealer(store, tmp_path, "b", b_ckpt, Events())
        b.load()
        restored = restore_latest(store, RUN, b_ckpt, Events())
        assert restored is not None and restored["step"] == 20
        b.remember_restored(restored)
        _write(b_ckpt, "step_30.pt", b"B's step 30" * 100)
        assert b.seal_pending() == 1
        go.set()
        worker.join(120)
        assert not worker.is_alive()
        assert a.stale and a_events.kinds().count("stale_epoch") == 1
        latest = _doc(store, mf.latest_key(RUN))
        assert latest is not None and (latest["step"], latest["writer"]) == (30, b.epoch)
        assert _doc(store, mf.manifest_key(RUN, 30))["epoch"] == b.epoch  # type: ignore[index]
        assert _restored_bytes(store, tmp_path, "step_30.pt") == b"B's step 30" * 100
    finally:
        hub.stop()
        close_session()
