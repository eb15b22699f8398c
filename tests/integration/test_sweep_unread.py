"""`rgt reconcile` on a store it cannot read: a verdict says something about a cell's sealed
state, never about the network. A store that does not answer (after the store layer's own
retries), or stalls mid-file, ends the command with exit 14 naming the store, the cell and the
read, and no verdict is written (the record keeps the previous one, so `rgt sweep` re-runs
nothing). A store that answers and lacks an object the MANIFEST names, or has other bytes
under its key, is corruption: "unverified", as before.

Real parts: a ``weed mini`` of the test's own (tests/seaweed.py) behind a real TCP relay that
resets the connections asking for one cell's file (tests/relay.py: the transient error
base.with_retries retries, then gives up on); a ``file://`` store
whose copy of a file holds after its first piece (``RGT_HOLD_AT=copy.after_piece``, a read that
stalls mid-file as on a hung mount); the real Sealer writes each cell's checkpoint, and every
CLI run is the real `rgt`, bounded (WAIT) and killed by PID past it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, List, Tuple

import pytest

from controller.registry import RunRecord
from controller.sweep import reconcile, record
from controller.sweep.plan import load_plan
from onbox.common.errors import StoreError
from onbox.sealing import manifest as mf
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from onbox.sealing.stores.filecopy import SMALL_FILE
from tests.integration.test_store_hung import _bounded, _weed
from tests.laptop import nesting as _nesting
from tests.laptop import rgt_exe
from tests.relay import Relay
from tests.sealsvc import old_box_sealer

STEP = 10


def _plan(tmp_path: Any, url: str, endpoint: str = "") -> str:
    """A sweep of two cells under ``url``, whose job file gives the store 2 s."""
    project = tmp_path / "project"
    project.mkdir()
    at = f'endpoint_url = "{endpoint}"\n' if endpoint else ""
    (project / "job.toml").write_text(f'[store]\nurl = "{url}"\n{at}stall = "2s"\n')
    plan = project / "PLAN.toml"
    plan.write_text(
        f'name = "sw"\nstore = "{url}"\njob = "job.toml"\n'
        'targets = ["rgt-sweep-unread-box.invalid"]\n'
        f'command = ["{sys.executable}", "-c", "pass", "{{seed}}"]\n'
        "[grid]\nseed = [0, 1]\n"
    )
    return str(plan)


def _sealed_cells(plan: str, store: Store, tmp_path: Any, home: str, size: int) -> List[str]:
    """The sweep's record made, and each cell's run sealed as its box would have: one
    checkpoint (a file of ``size`` bytes) by the real Sealer, then DONE.json. The runs."""
    doc = record.begin(load_plan(plan), home)
    runs = []
    for name, c in sorted(doc["cells"].items()):
        run = str(c["run"])
        ckpt = tmp_path / "ckpt" / name
        path = ckpt / f"ckpt_{STEP}"
        path.mkdir(parents=True)
        (path / "model.bin").write_bytes(os.urandom(size))
        (path / ".rgt-complete").write_text(json.dumps({"step": STEP}))
        where = tmp_path / "box" / name
        where.mkdir(parents=True)
        assert old_box_sealer(run, str(ckpt), store, where).seal_pending() == 1
        store.put_bytes(mf.done_key(run), mf.dump({"files": [], "finished_at": 0}))
        runs.append(run)
    return runs


def _verdicts(home: str) -> Dict[str, Any]:
    with open(os.path.join(home, "sweeps", "sw.json")) as f:
        return {
            n: (c.get("verdict") or {}).get("verdict") for n, c in json.load(f)["cells"].items()
        }


def _reconcile(plan: str, env: Dict[str, str], cwd: str) -> Tuple[int, str, str]:
    return _bounded([*rgt_exe(), "reconcile", plan], env, cwd)


@pytest.mark.parametrize("read", ["DONE.json", "model.bin"])
def test_a_store_that_resets_connections_is_no_cells_verdict(
    tmp_path: Any, controller_env: Dict[str, str], read: str
) -> None:
    """Both cells sealed and reconciled ok; then the laptop's way to the store (a real TCP
    relay) resets every connection that asks for one cell's ``read`` (its DONE.json, or its
    checkpoint file), through each of the store layer's retries. Before the fix reconcile
    called that cell "unverified: the store could not give it" (exit 18) and recorded it, and
    the next `rgt sweep` trained it again as a fresh run."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        runs: List[str] = []
        relay = Relay(
            "127.0.0.1",
            ("127.0.0.1", server.port),
            lambda data: bool(runs) and f"/{runs[0]}/".encode() in data and read.encode() in data,
        )
        try:
            plan = _plan(tmp_path, store.url, f"http://127.0.0.1:{relay.port}")
            env = server.env(dict(os.environ, **controller_env))
            sealed = _sealed_cells(plan, store, tmp_path, home, 1 << 12)
            rc, out, err = _reconcile(plan, env, str(tmp_path))
            assert rc == 0, (out, err)
            assert set(_verdicts(home).values()) == {"ok"}, _verdicts(home)
            runs.extend(sealed)  # from now on, the first cell's reads are reset
            rc, out, err = _reconcile(plan, env, str(tmp_path))
        finally:
            relay.close()
    assert rc == 14, (out, err)
    assert "Traceback" not in err, err
    assert store.url in err and f"(run {runs[0]})" in err and read in err, err
    assert "connection" in err and "no verdict was written" in err and "again" in err, err
    assert _nesting(err) == 1, err
    assert "UNVERIFIED" not in out, out
    assert set(_verdicts(home).values()) == {"ok"}, _verdicts(home)  # the previous verdicts


def test_an_object_missing_or_other_bytes_in_a_store_that_answers_stays_unverified(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """Corruption is a verdict: one cell's checkpoint object deleted (the store answers 404),
    the other's replaced by other bytes of its size: both "unverified", exit 18."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        plan = _plan(tmp_path, store.url, server.endpoint)
        env = server.env(dict(os.environ, **controller_env))
        runs = _sealed_cells(plan, store, tmp_path, home, 1 << 12)
        keys = [[i.key for i in store.list(r + "/") if i.key.endswith("model.bin")] for r in runs]
        assert all(len(k) == 1 for k in keys), keys
        store.delete(keys[0][0])
        store.put_bytes(keys[1][0], os.urandom(1 << 12))
        rc, out, err = _reconcile(plan, env, str(tmp_path))
    assert rc == 18, (out, err)
    assert "is missing from the store" in out and "sealed as 4096 bytes" in out, out
    assert set(_verdicts(home).values()) == {"unverified"}, _verdicts(home)


def test_a_store_that_stalls_mid_file_ends_reconcile_after_the_job_files_stall(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """A ``file://`` store whose copy of a checkpoint file stops after its first piece (a hung
    mount mid-file). Before the fix reconcile's ``get_file`` had no stall watch: it waited
    there (the hold's own limit, 120 s; on a real hung mount for ever) and the test gave up
    (WAIT). Now: exit 14 after the job file's 2 s, naming the cell, no verdict written."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    root = tmp_path / "durable"
    root.mkdir()
    url = f"file://{root}"
    plan = _plan(tmp_path, url)
    runs = _sealed_cells(plan, open_store(url), tmp_path, home, SMALL_FILE + (1 << 20))
    env = dict(os.environ, **controller_env, RGT_HOLD_AT="copy.after_piece")
    rc, out, err = _reconcile(plan, env, str(tmp_path))
    assert rc == 14, (out, err)
    assert "Traceback" not in err, err
    assert f"{url} sent nothing for 2s" in err and f"(run {runs[0]})" in err, err
    assert "no verdict was written" in err, err
    assert f"then run it again: rgt reconcile {plan} checks every cell anew" in err, err
    assert _nesting(err) == 1, err
    assert set(_verdicts(home).values()) == {None}, _verdicts(home)


def test_downs_gate_on_a_store_that_resets_connections_ends_with_the_store_error(
    tmp_path: Any, controller_env: Dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rgt down`'s gate (reconcile.gate, in this process) for a run on the box of a sweep's
    cell whose DONE.json read is reset: the store's error (exit 14) naming the cell, not a
    refusal for a cell "not reconciled". Before the fix it refused down (UnsafeRefused, exit
    7) calling the cell unverified, and told to re-run it with `rgt sweep`."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        runs: List[str] = []
        relay = Relay(
            "127.0.0.1",
            ("127.0.0.1", server.port),
            lambda data: bool(runs) and f"/{runs[0]}/DONE.json".encode() in data,
        )
        try:
            plan = _plan(tmp_path, store.url, f"http://127.0.0.1:{relay.port}")
            for k, v in server.env({}).items():
                monkeypatch.setenv(k, v)
            sealed = _sealed_cells(plan, store, tmp_path, home, 1 << 12)
            with record.update("sw", home) as doc:
                for c in doc["cells"].values():
                    c["runs"] = [c["run"]]
                    target = record.cell_target(c)
            rec = RunRecord(sealed[0], target)
            reconcile.gate(rec, home)  # every cell sealed and verified: down may go on
            runs.extend(sealed)
            with pytest.raises(StoreError) as got:
                reconcile.gate(rec, home)
        finally:
            relay.close()
    assert got.value.exit_code == 14, got.value.line()
    assert f"(run {sealed[0]})" in got.value.what and "DONE.json" in got.value.what, got.value
    assert "no verdict was written" in got.value.what, got.value.what


@pytest.mark.parametrize("resets", [3, 99])
def test_sweeps_look_for_a_cells_done_json_is_retried_and_never_blames_the_box(
    tmp_path: Any, controller_env: Dict[str, str], resets: int
) -> None:
    """`rgt sweep` asks the store whether each cell is sealed already (its DONE.json) before
    it reaches a box; here both cells are, and the relay resets the first ``resets``
    connections asking for the first cell's DONE.json. Three (botocore's own tries of one
    request) are a blip the store layer's retries outlast: both cells skipped, exit 0, no box
    reached. Resets through every retry: the store's error, exit 14, naming the store, the cell
    and the read. Before the fix the look was not retried and its error was taken as the box's:
    "its queue is left" (exit 3), for the blip as for the rest."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        runs: List[str] = []
        seen: List[bytes] = []

        def reset_on(data: bytes) -> bool:
            if not runs or f"/{runs[0]}/DONE.json".encode() not in data:
                return False
            seen.append(data)
            return len(seen) <= resets

        relay = Relay("127.0.0.1", ("127.0.0.1", server.port), reset_on)
        try:
            plan = _plan(tmp_path, store.url, f"http://127.0.0.1:{relay.port}")
            env = server.env(dict(os.environ, **controller_env))
            runs.extend(_sealed_cells(plan, store, tmp_path, home, 1 << 12))
            argv = [*rgt_exe(), "sweep", plan, "--interval", "0.1"]
            rc, out, err = _bounded(argv, env, str(tmp_path))
        finally:
            relay.close()
    assert "Traceback" not in err and "queue is left" not in err, err
    if resets == 3:
        assert rc == 0, (out, err)
        assert err.count("is sealed already (DONE.json): skipped") == 2, err
        return
    assert rc == 14, (out, err)
    assert store.url in err and f"(run {runs[0]})" in err and "DONE.json" in err, err
    assert "connection" in err and "again" in err, err


@pytest.mark.parametrize("resets", [4, 99])
def test_a_reset_listing_for_duplicates_is_retried_and_leaves_nothing_half_done(
    tmp_path: Any, controller_env: Dict[str, str], resets: int
) -> None:
    """Both cells sealed; the relay resets the first ``resets`` connections that list the
    store under the sweep's prefix (the look for duplicate runs). Four (botocore's own tries
    of one listing) are a blip the store layer's retries outlast: reconciled, exit 0, both
    verdicts written. Resets through every retry: exit 14 naming the sweep, the store and what
    was listed and why, and no cell judged (the listing comes first: nothing half-done). Before
    the fix the listing was not retried, and came after every cell had been fetched and
    judged: its error (exit 14) named no sweep, and threw those verdicts away."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        seen: List[bytes] = []
        asked: List[bytes] = []  # each request's first line, in order

        def reset_on(data: bytes) -> bool:
            asked.append(data.split(b"\r\n", 1)[0])
            if re.search(rb"[?&]prefix=p%2Fsw-(&| )", data) is None:
                return False
            seen.append(data)
            return len(seen) <= resets

        relay = Relay("127.0.0.1", ("127.0.0.1", server.port), reset_on)
        try:
            plan = _plan(tmp_path, store.url, f"http://127.0.0.1:{relay.port}")
            env = server.env(dict(os.environ, **controller_env))
            _sealed_cells(plan, store, tmp_path, home, 1 << 12)
            rc, out, err = _reconcile(plan, env, str(tmp_path))
        finally:
            relay.close()
    assert seen, "the relay saw no listing under the sweep's prefix"
    assert "Traceback" not in err, err
    if resets == 4:
        assert rc == 0, (out, err)
        assert set(_verdicts(home).values()) == {"ok"}, _verdicts(home)
        return
    assert rc == 14, (out, err)
    assert f"sweep sw: the store could not be listed under {store.url}/sw-" in err, err
    assert "duplicate" in err and "connection" in err and "again" in err, err
    assert set(_verdicts(home).values()) == {None}, _verdicts(home)
    assert not [a for a in asked if b"DONE.json" in a], asked  # no cell was judged


def test_a_done_json_removed_while_its_cell_is_read_is_judged_as_first_read(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """A cell whose run sealed DONE.json and no checkpoint (no LATEST.json); its DONE.json is
    removed from the store (directly, not through the relay) the moment reconcile asks for its
    LATEST.json, i.e. after reconcile saw the DONE.json and before it reads the sealed state.
    The cell is judged by the DONE.json it read: ok, exit 0. Before the fix DONE.json was read
    a second time for the sealed state, found gone, and the whole command ended with "run ...
    has nothing sealed yet" (NotFound, exit 8: "no such run"), a cell it had just seen sealed."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    with _weed(tmp_path) as (server, store, _stopped):
        runs: List[str] = []
        removed: List[str] = []

        def remove_done(data: bytes) -> bool:
            if runs and not removed and f"/{runs[0]}/LATEST.json".encode() in data:
                store.delete(mf.done_key(runs[0]))
                removed.append(runs[0])
            return False

        relay = Relay("127.0.0.1", ("127.0.0.1", server.port), remove_done)
        try:
            plan = _plan(tmp_path, store.url, f"http://127.0.0.1:{relay.port}")
            env = server.env(dict(os.environ, **controller_env))
            sealed = _sealed_cells(plan, store, tmp_path, home, 1 << 12)
            store.delete(mf.latest_key(sealed[0]))  # DONE.json alone: no checkpoint sealed
            runs.extend(sealed)
            rc, out, err = _reconcile(plan, env, str(tmp_path))
            gone = store.get_bytes(mf.done_key(sealed[0])) is None
        finally:
            relay.close()
    assert removed and gone, "DONE.json was not removed between the reads"
    assert rc == 0, (out, err)
    assert "Traceback" not in err and "nothing sealed" not in err, err
    assert set(_verdicts(home).values()) == {"ok"}, _verdicts(home)
