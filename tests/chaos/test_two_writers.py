"""Two agents on one run: the preempted box comes back while its replacement writes (E4, A7).

Box A (epoch 1) seals step 10, then is frozen (SIGSTOP) in the middle of uploading its next
checkpoint. Box B, a fresh box, starts the same run on the same store: it takes epoch 2,
restores step 10 and seals its own checkpoints. Then A is resumed (SIGCONT), in both orders:
after B sealed (A's checkpoint collides with B's step 30), or before (A's late checkpoint is
step 40, above B's LATEST, and B's agent restarts afterwards, reading the store A wrote into).
A variant kills A right after its next object upload (RGT_CRASH_AT=seal.after_object).

Whatever A does, the store must stay B's: LATEST names a checkpoint B sealed, verified (I2,
I3), by B's epoch (I5, I6); B's sealed checkpoints are unchanged and step 10 still verifies
(I1); a fresh restore gives exactly LATEST's bytes; A says once that it is stale (I7).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import pytest

from tests.chaos.harness import Backend, Box, alive, freeze_mid_upload, thaw, wait
from tests.chaos.invariants import LatestWatch

CLASSES = ("transient", "permanent", "integrity", "usage")


def _job(
    box: Box, steps: str, tag: str, kind: str = "dir", then: str = "idle", frozen: int = 0
) -> List[str]:
    # The step whose seal freeze_mid_upload catches is 48 MiB, not 12: the sealer puts a
    # checkpoint's files at once, and a small one can be sealed between two polls of the store.
    big = ["--at", f"{frozen}:48:0"] if frozen else []
    return [
        "--steps", steps, "--gate", box.gate, "--tag", tag, "--kind", kind,
        "--mib", "12", "--then", then, "--limit", "120", *big,
    ]  # fmt: skip


def _latest_is(backend: Backend, run: str, step: int, epoch: int) -> bool:
    doc = backend.checker(run).latest()
    return bool(doc and doc["step"] == step and doc.get("epoch") == epoch)


def _settle(box: Box, run: str, since: int, what: str = "stale_epoch") -> None:
    """Give a thawed stale agent time to do whatever it will: until it says it is stale."""
    try:
        wait(lambda: what in box.kinds(run)[since:], 15, f"{box.label} to report {what}")
    finally:
        time.sleep(0.5)  # and any write it was about to make after that


@pytest.mark.parametrize("order", ["thawed_after_new_sealed", "thawed_before_new_sealed"])
def test_a_frozen_stale_agent_resumed_cannot_touch_the_new_writers_store(
    tmp_path: Any, backend: Backend, run_name: str, order: str
) -> None:
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    stale_step = 30 if order == "thawed_after_new_sealed" else 40
    try:
        with LatestWatch(backend.view, run) as watch:
            a.start(run, backend.url, _job(a, f"10,{stale_step}", "A", frozen=stale_step))
            a.open_gate(10)
            wait(lambda: _latest_is(backend, run, 10, a.epoch(run)), 60, "A to seal step 10")
            survivor = chk.survivor()
            a_pid = freeze_mid_upload(a, run, backend.view, stale_step)
            seen_a = len(a.events(run))
            b.start(run, backend.url, _job(b, "10,30", "B"))
            epoch_b = b.wait_epoch(run)
            wait(lambda: "restored" in b.kinds(run), 60, "B to restore step 10")
            if order == "thawed_before_new_sealed":
                thaw(a_pid)
                _settle(a, run, seen_a)
            b.open_gate(30)
            wait(lambda: _latest_is(backend, run, 30, epoch_b), 60, "B to seal step 30")
            snap = chk.snapshot(epoch_b)
            if order == "thawed_after_new_sealed":
                thaw(a_pid)
                _settle(a, run, seen_a)
            else:
                # B's next agent reads a store the stale A wrote into (Sealer.load).
                b_pid = b.wait_agent(run)
                b.kill_agent(run)
                wait(lambda: not alive(b_pid), 10, "B's agent to die")
                b.restart(run)
                wait(lambda: len(b.epochs(run)) == 2, 30, "B's second agent to take an epoch")
                time.sleep(1.0)
        a.kill_all()
        b.kill_all()
        chk.assert_writer(b.epochs(run))
        chk.assert_unchanged(snap)
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
        stale = [e for e in a.events(run) if e["kind"] == "stale_epoch"]
        assert len(stale) == 1 and stale[0]["class"] in CLASSES and stale[0]["reason"], (
            f"I7: the stale agent says once, classified, that it no longer writes: {stale}"
        )
    finally:
        a.kill_all()
        b.kill_all()


def test_a_stale_agent_killed_right_after_an_object_upload_leaves_latest_intact(
    tmp_path: Any, backend: Backend, run_name: str
) -> None:
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        with LatestWatch(backend.view, run) as watch:
            # One object per checkpoint: the 2nd object A uploads is its step 30.
            a.start(
                run,
                backend.url,
                _job(a, "10,30", "A", kind="file", frozen=30),
                env={"RGT_CRASH_AT": "seal.after_object:2"},
            )
            a.open_gate(10)
            wait(lambda: _latest_is(backend, run, 10, a.epoch(run)), 60, "A to seal step 10")
            survivor = chk.survivor()
            a_pid = freeze_mid_upload(a, run, backend.view, 30)
            b.start(run, backend.url, _job(b, "10,30", "B", kind="file"))
            epoch_b = b.wait_epoch(run)
            wait(lambda: "restored" in b.kinds(run), 60, "B to restore step 10")
            b.open_gate(30)
            wait(lambda: _latest_is(backend, run, 30, epoch_b), 60, "B to seal step 30")
            snap = chk.snapshot(epoch_b)
            seen_a = len(a.events(run))
            thaw(a_pid)
            # A dies at the crash point, or (fenced before it uploads) says it is stale.
            wait(
                lambda: not alive(a_pid) or "stale_epoch" in a.kinds(run)[seen_a:],
                20,
                "A to die at seal.after_object:2 or to report itself stale",
            )
            time.sleep(0.5)
            crashed = not alive(a_pid)
        a.kill_all()
        b.kill_all()
        chk.assert_writer(b.epochs(run))
        chk.assert_unchanged(snap)
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
        assert crashed or "stale_epoch" in a.kinds(run), (
            "the crash point seal.after_object:2 never fired and A never said it was stale"
        )
    finally:
        a.kill_all()
        b.kill_all()


@pytest.mark.chaos_long
def test_long_the_only_agent_paused_for_a_minute_gets_no_twin_and_goes_on(
    tmp_path: Any, run_name: str
) -> None:
    """A7: SIGSTOP for 60 s, then SIGCONT. The shim starts no second agent while the paused
    one holds the run (its lock), and the paused one finishes its seal (I1, I2, I5)."""
    from tests.chaos.conftest import file_backend

    backend = file_backend(str(tmp_path / "store"))
    run, chk = run_name, backend.checker(run_name)
    box = Box(str(tmp_path), "box", backend.env)
    try:
        with LatestWatch(backend.view, run) as watch:
            env = {"RGT_AGENT_RESPAWN_DELAY": "1"}  # the shim's watch is armed
            box.start(run, backend.url, _job(box, "10,20", "A", frozen=20), env=env)
            box.open_gate(10)
            wait(lambda: _latest_is(backend, run, 10, box.epoch(run)), 60, "step 10 sealed")
            survivor = chk.survivor()
            pid = freeze_mid_upload(box, run, backend.view, 20)
            time.sleep(60)
            assert box.agent_pid(run) == pid and "agent_respawn" not in box.kinds(run), (
                "I5: a second agent was started while the first was only paused"
            )
            thaw(pid)
            wait(lambda: _latest_is(backend, run, 20, box.epoch(run)), 60, "step 20 sealed")
        box.kill_all()
        chk.assert_writer(box.epochs(run))
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        box.kill_all()


def test_a_stale_agent_whose_job_succeeds_writes_no_done_json(
    tmp_path: Any, backend: Backend, run_name: str
) -> None:
    """A's job finishes (exit 0) after B took the run over: A's completion would end a run B is
    still training, so A writes no DONE.json, no outputs and no state mirror (I5), and B later
    completes the run itself."""
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, _job(a, "10,20", "A", then="exit"))
        a.open_gate(10)
        wait(lambda: _latest_is(backend, run, 10, a.epoch(run)), 60, "A to seal step 10")
        b.start(run, backend.url, _job(b, "10,30", "B"))
        epoch_b = b.wait_epoch(run)
        wait(lambda: "restored" in b.kinds(run), 60, "B to restore step 10")
        seen_a = len(a.events(run))
        a.open_gate(20)  # A's job writes step 20 and exits 0: A's agent would complete the run
        # Its seal of step 20 finds B's epoch: A stops the job (STOPPED), unless the exit came
        # first (SUCCEEDED, its completion finding B's epoch); either way, no DONE.json.
        ended = ("SUCCEEDED", "STOPPED")
        wait(lambda: a.state(run) in ended, 60, "A's run to end")
        wait(lambda: a.agent_pid(run) is None, 30, "A's agent to exit")
        assert chk.view.read(f"{run}/DONE.json") is None, (
            "I5: a stale agent wrote DONE.json for a run a newer epoch is training"
        )
        assert "done" not in a.kinds(run)[seen_a:], a.events(run)[seen_a:]
        b.open_gate(30)
        wait(lambda: _latest_is(backend, run, 30, epoch_b), 60, "B to seal step 30")
        b.kill_all()
        chk.assert_writer(b.epochs(run))
        chk.assert_visible_verify()
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        a.kill_all()
        b.kill_all()


# ---- the old box going on with a run a newer box took over


def _store_epochs(backend: Backend, run: str) -> List[int]:
    keys = backend.view.objects(f"{run}/epochs/")
    return sorted(int(k.rsplit("/", 1)[1]) for k in keys if k.rsplit("/", 1)[1].isdigit())


def _mirrored_state(backend: Backend, run: str) -> Dict[str, Any]:
    """The run's state as mirrored to the store (what `rgt status` reads, the box silent)."""
    data = backend.view.read(f"{run}/state/state.json")
    return dict(json.loads(data)) if data else {}


def _mirrored_by(backend: Backend, run: str, pid: Optional[int]) -> bool:
    return pid is not None and (_mirrored_state(backend, run).get("agent") or {}).get("pid") == pid


@pytest.mark.parametrize("command", ["stop", "sync", "start"])
def test_the_old_box_going_on_with_a_run_taken_over_leaves_the_store_to_the_new_box(
    tmp_path: Any, backend: Backend, run_name: str, command: str
) -> None:
    """Box A dies whole (its state.json still says RUNNING); box B takes the run over. Then on
    box A, with no agent alive: `rgt-agent stop` (it finishes the stop in-process, through the
    adopt path), `rgt-agent sync` (it seals from the command) or `rgt-agent start` (its agent
    adopts the run). None may take an epoch over B's: each says `superseded` and writes nothing
    to the store, and B goes on sealing. (They took a new epoch: B went stale for good and
    never sealed again.)"""
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, _job(a, "10,30", "A"))
        a.open_gate(10)
        wait(lambda: _latest_is(backend, run, 10, a.epoch(run)), 60, "A to seal step 10")
        epoch_a = a.epoch(run)
        a.kill_all()  # box A is gone with its agent, shim and job
        b.start(run, backend.url, _job(b, "10,30", "B"))
        epoch_b = b.wait_epoch(run)
        wait(lambda: "restored" in b.kinds(run), 60, "B to restore step 10")
        b_pid = b.wait_agent(run)
        wait(lambda: _mirrored_by(backend, run, b_pid), 30, "B to mirror its state")
        seen_a = len(a.events(run))
        if command == "start":
            a.restart(run, check=False)
            wait(
                lambda: {"superseded", "epoch"} & set(a.kinds(run)[seen_a:]),
                30,
                "A's new agent to adopt the run",
            )
        else:
            args = ["--grace", "0"] if command == "stop" else []
            p = a.cli(command, run, *args, timeout=90)
        assert _store_epochs(backend, run) == [epoch_a, epoch_b], "box A took an epoch"
        if command == "stop":  # the stop itself is done all the same
            assert p.returncode == 0 and a.state(run) == "STOPPED", (p.stdout, p.stderr)
        elif command == "sync":  # one line, and an exit code that says nothing was sealed
            assert p.returncode == 7, (p.returncode, p.stdout, p.stderr)
            line = p.stderr.strip()
            assert "\n" not in line and "taken over" in line and f"epoch {epoch_b}" in line, line
        assert _mirrored_by(backend, run, b_pid), _mirrored_state(backend, run)
        b.open_gate(30)
        wait(
            lambda: _latest_is(backend, run, 30, epoch_b),
            60,
            f"B to go on sealing (step 30)\n{b.diagnose(run)}",
        )
        said = [e for e in a.events(run)[seen_a:] if e["kind"] == "superseded"]
        assert len(said) == 1, a.events(run)[seen_a:]
        assert (said[0]["epoch"], said[0]["newer_epoch"], said[0]["class"]) == (
            epoch_a,
            epoch_b,
            "permanent",
        ), said
        assert "stale_epoch" not in b.kinds(run)
        b.kill_all()
        chk.assert_writer([epoch_b])
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        a.kill_all()
        b.kill_all()


def test_a_superseded_agent_with_nothing_to_seal_never_mirrors_over_the_new_one(
    tmp_path: Any, backend: Backend, run_name: str
) -> None:
    """Agent A lives on after box B took the run over, with no checkpoint to seal (the sealer
    lists epochs/ only before a seal). Its mirror must find out by itself: with B's box gone
    silent, stopping A leaves the store's state B's (RUNNING, B's agent) and its events B's,
    not A's STOPPED, which `rgt status` would print for a run that goes on elsewhere."""
    run = run_name
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, _job(a, "10", "A"))  # its gate stays shut: nothing to seal
        a.wait_epoch(run)
        wait(lambda: _mirrored_by(backend, run, a.agent_pid(run)), 30, "A to mirror its state")
        # RUNNING (waited for below) 1 s after B's start, not 5
        b.start(run, backend.url, _job(b, "10", "B"), start_grace="1s")
        epoch_b = b.wait_epoch(run)
        b_pid = b.wait_agent(run)
        wait(
            lambda: (
                _mirrored_by(backend, run, b_pid)
                and _mirrored_state(backend, run).get("state") == "RUNNING"
            ),
            30,
            "B to mirror its state",
        )
        b.kill_all()  # box B goes silent: its last mirror stands for the run
        time.sleep(2.0)  # A's passes go on meanwhile (scan 1s)
        a.stop(run)
        assert a.state(run) == "STOPPED"
        doc = _mirrored_state(backend, run)
        assert doc.get("state") == "RUNNING" and doc["agent"]["pid"] == b_pid, doc
        events = backend.view.read(f"{run}/state/events.jsonl") or b""
        assert f'"epoch": {epoch_b}'.encode() in events, "the store's events are not B's"
        stale = [e for e in a.events(run) if e["kind"] == "stale_epoch"]
        assert len(stale) == 1 and stale[0]["newer_epoch"] == epoch_b, stale
    finally:
        a.kill_all()
        b.kill_all()


def _job_pid(box: Box, run: str) -> int:
    with open(os.path.join(box.home, "runs", run, "state.json")) as f:
        pid = json.load(f).get("pid")
    assert isinstance(pid, int) and alive(pid), f"{box.label}'s job of {run} is not alive"
    return pid


@pytest.mark.parametrize("found", ["sealing", "adopting"])
def test_the_old_box_stops_its_job_once_another_box_took_the_run_over(
    tmp_path: Any, backend: Backend, run_name: str, found: str
) -> None:
    """E4: box A's job goes on training after box B took the run over, none of it sealable (A's
    agent finds out at its next seal or mirror, or a new agent of A's adopting the live job
    finds it at once). A's agent stops the job itself (it trained on, with no end, on a meter): A's
    run ends STOPPED, its job gone, its checkpoints left on its disk, and B goes on."""
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, _job(a, "10,20", "A"))
        a.open_gate(10)
        wait(lambda: _latest_is(backend, run, 10, a.epoch(run)), 60, "A to seal step 10")
        job_a = _job_pid(a, run)
        if found == "adopting":
            a.kill_agent(run)  # A's agent dies; its job lives on
        seen_a = len(a.events(run))
        b.start(run, backend.url, _job(b, "10,30", "B"))
        epoch_b = b.wait_epoch(run)
        wait(lambda: "restored" in b.kinds(run), 60, "B to restore step 10")
        if found == "sealing":
            # A's job writes step 20, and A's seal of it finds B's epoch, if A's mirror of
            # its state (its health samples) has not found it first
            a.open_gate(20)
        else:
            a.restart(run)  # a new agent of A's adopts the live job
        wait(lambda: a.state(run) == "STOPPED", 60, f"A to stop its job\n{a.diagnose(run)}")
        wait(lambda: not alive(job_a), 30, "A's job to be gone")
        kinds = a.kinds(run)[seen_a:]
        assert ("stale_epoch" if found == "sealing" else "superseded") in kinds, kinds
        stopping = [e for e in a.events(run)[seen_a:] if e.get("state") == "STOPPING"]
        assert len(stopping) == 1 and "superseded" in stopping[0]["reason"], stopping
        assert os.listdir(a.ckpt), "A's checkpoints stay on its disk"
        b.open_gate(30)
        wait(lambda: _latest_is(backend, run, 30, epoch_b), 60, f"B to seal 30\n{b.diagnose(run)}")
        assert b.state(run) in ("STARTING", "RUNNING") and "stale_epoch" not in b.kinds(run)
        b.kill_all()
        chk.assert_visible_verify()
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        a.kill_all()
        b.kill_all()
