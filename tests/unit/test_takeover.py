"""A box's writer after another box took its run over, on a real ``file://`` store: the epoch
a writer that goes on with the run here takes (onbox/agent/ownership.py, the ledger's
``take_epoch_after``), and the state mirror's own fence (onbox/agent/mirror.py). The agents'
side of both, with real processes on two boxes, is in tests/chaos/test_two_writers.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from onbox.agent.mirror import StateMirror
from onbox.agent.ownership import Superseded, recorded_epoch, take_epoch_here, writer_mark
from onbox.common.errors import PermanentStoreError, UnsafeRefused
from onbox.common.rundir import RunDir
from onbox.sealing import epochs
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch, take_epoch_after
from onbox.sealing.ledger import Ledger, newest_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store

RUN = "r"


@pytest.fixture
def store(tmp_path: Any) -> Store:
    (tmp_path / "store").mkdir()
    return open_store(f"file://{tmp_path}/store")


@pytest.fixture
def rd(tmp_path: Any) -> RunDir:
    rd = RunDir(RUN, str(tmp_path / "home"))
    rd.create()
    return rd


def test_a_writer_going_on_here_takes_the_next_epoch_while_its_own_is_the_newest(
    store: Store, rd: RunDir
) -> None:
    assert recorded_epoch(rd) is None
    first = take_epoch_here(store, rd, going_on=True)  # nothing recorded: taken as before
    assert first == 1 and recorded_epoch(rd) == 1
    assert take_epoch_here(store, rd, going_on=True) == 2  # the respawned agent, this box
    assert recorded_epoch(rd) == 2 and newest_epoch(store, RUN) == 2


def test_a_writer_going_on_here_takes_none_over_another_boxs_newer_epoch(
    store: Store, rd: RunDir
) -> None:
    assert take_epoch_here(store, rd, going_on=False) == 1
    assert take_epoch(store, RUN) == 2  # box B took the run over
    with pytest.raises(Superseded) as got:
        take_epoch_here(store, rd, going_on=True)
    e = got.value
    assert isinstance(e, UnsafeRefused) and e.exit_code == 7
    assert (e.own, e.newer) == (1, 2)
    assert "epoch 2, host " in e.what and "epoch 1" in e.what and "\n" not in e.line()
    assert newest_epoch(store, RUN) == 2 and recorded_epoch(rd) == 1  # nothing taken
    said: List[Dict[str, Any]] = []
    e.tell(lambda kind, reason, **kw: said.append({"kind": kind, "reason": reason, **kw}))
    assert [(s["kind"], s["klass"], s["epoch"], s["newer_epoch"]) for s in said] == [
        ("superseded", "permanent", 1, 2)
    ]
    # A new incarnation (`rgt-agent start` of an ended run) takes the run back, as before.
    assert take_epoch_here(store, rd, going_on=False) == 3 and recorded_epoch(rd) == 3


def test_the_next_epoch_taken_first_by_another_writer_is_a_newer_writer(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the listing and the create, another box took the next number: it is the newer
    writer, and this one takes none (not the number after it)."""
    assert take_epoch(store, RUN) == 1
    assert take_epoch(store, RUN) == 2
    monkeypatch.setattr(epochs, "newest_epoch", lambda store, run: 1)  # listed before B's
    assert take_epoch_after(store, RUN, 1) is None
    monkeypatch.undo()
    assert newest_epoch(store, RUN) == 2


def test_the_epoch_of_a_run_begun_before_epoch_json_is_its_last_epoch_event(rd: RunDir) -> None:
    with open(rd.events, "w") as f:
        for ev in ({"kind": "epoch", "epoch": 3}, {"kind": "epoch", "epoch": 4}, {"kind": "x"}):
            f.write(json.dumps(ev) + "\n")
        f.write('{"kind": "epo')  # a torn last line
    assert recorded_epoch(rd) == 4
    with open(rd.epoch_record, "w") as f:
        f.write('{"epoch": 5}')
    assert recorded_epoch(rd) == 5


def _sealer(store: Store, rd: RunDir, events: List[str]) -> Sealer:
    ckpt = os.path.join(rd.path, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    s = Sealer.for_run(rd, store, ckpt, keep=3, event=lambda k, r, **kw: events.append(k))
    s.load()
    return s


def test_the_mirror_lists_epochs_before_it_writes_and_never_writes_once_stale(
    store: Store, rd: RunDir
) -> None:
    """The sealer of agent A has had nothing to seal (so it never listed epochs/) when box B
    takes the run over: A's next mirror finds out, puts nothing, and never puts again."""
    events: List[str] = []
    sealer = _sealer(store, rd, events)
    mirror = StateMirror(RUN, rd, store)
    with open(rd.state, "w") as f:
        f.write('{"state": "RUNNING", "who": "A"}')
    mirror.write(sealer, events=True, health=False)
    assert json.loads(store.get_bytes(mf.state_key(RUN, "state.json")) or b"")["who"] == "A"
    take_epoch(store, RUN)  # box B
    store.put_bytes(mf.state_key(RUN, "state.json"), b'{"state": "RUNNING", "who": "B"}')
    assert not sealer.stale
    with open(rd.state, "w") as f:
        f.write('{"state": "STOPPED", "who": "A"}')
    os.utime(rd.state, (1, 1))  # another mtime than the one put, whatever the clock's grain
    mirror.write(sealer, events=True, health=True)
    assert sealer.stale and events.count("stale_epoch") == 1
    assert json.loads(store.get_bytes(mf.state_key(RUN, "state.json")) or b"")["who"] == "B"
    os.utime(rd.state, (2, 2))
    mirror.write(sealer, events=True, health=True)
    assert json.loads(store.get_bytes(mf.state_key(RUN, "state.json")) or b"")["who"] == "B"
    mirror.write(None, events=True, health=True)  # an agent with no sealer: nothing either
    assert json.loads(store.get_bytes(mf.state_key(RUN, "state.json")) or b"")["who"] == "B"


# A writer of this box killed -9 after it created epochs/<n> and before it recorded it.
_KILLED_WRITER = """
import sys, time
from onbox.agent import ownership
from onbox.common.rundir import RunDir
from onbox.sealing.stores import open_store

real = ownership.write_json

def write_json(path, doc):
    if path.endswith("epoch.json") and "epoch" in doc:
        print("taken", doc["epoch"], flush=True)
        time.sleep(120)  # killed here by the test, before the record is written
    real(path, doc)

ownership.write_json = write_json
rd = RunDir(sys.argv[2], sys.argv[3])
ownership.take_epoch_here(open_store(sys.argv[1]), rd, going_on=True)
"""


def test_an_epoch_this_box_took_but_never_recorded_is_its_own_not_a_takeover(
    store: Store, rd: RunDir
) -> None:
    """Without the run directory's mark in the epoch document, the next agent here read the
    epoch its killed predecessor took as another box's, took none, and sealed nothing more."""
    assert take_epoch_here(store, rd, going_on=False) == 1
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, store.url, RUN, rd.home],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["taken", "2"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert newest_epoch(store, RUN) == 2 and recorded_epoch(rd) == 1  # the window
    assert take_epoch_here(store, rd, going_on=True) == 3  # not Superseded
    assert recorded_epoch(rd) == 3
    assert epochs.epoch_doc(store, RUN, 3)["writer"] == writer_mark(rd)


def test_an_epoch_with_this_marks_copy_on_another_host_is_a_takeover(
    store: Store, rd: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box made from a copy of this disk carries the mark, not the host name: its epoch is
    another box's, and this one takes none after it."""
    assert take_epoch_here(store, rd, going_on=False) == 1
    real = os.uname()
    clone = type("U", (), {"nodename": real.nodename + "-clone"})()
    monkeypatch.setattr(os, "uname", lambda: clone)  # for the clone's epoch document
    assert take_epoch(store, RUN, writer_mark(rd)) == 2  # the clone's start
    monkeypatch.undo()
    with pytest.raises(Superseded) as got:
        take_epoch_here(store, rd, going_on=True)
    assert (got.value.own, got.value.newer) == (1, 2)
    assert f"host {real.nodename}-clone" in got.value.what


def test_a_store_that_lost_the_writers_epoch_is_written_no_more(
    store: Store, tmp_path: Any
) -> None:
    """The store under the same URL no longer holds the epoch this agent took (a durable mount
    dropped under its path, a bucket emptied): a seal there is refused, said as a store error,
    never taken as 'no newer writer' (before, the next checkpoint was sealed into it)."""
    epoch = take_epoch(store, RUN)
    ledger = Ledger(RUN, store, epoch=epoch, keep=2, event=lambda *a, **k: None)
    assert not ledger.is_stale()
    shutil.rmtree(tmp_path / "store" / RUN / "epochs")
    with pytest.raises(PermanentStoreError) as got:
        ledger.is_stale("checkpoint step_2.pt (step 2)")
    assert f"no longer holds run {RUN}'s epoch 1 (its newest is none)" in got.value.what
    assert "checkpoint step_2.pt (step 2) is not sealed" in got.value.what
    assert not ledger.stale  # not a newer writer: the run's own epoch may come back
