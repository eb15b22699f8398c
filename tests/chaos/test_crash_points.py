"""The agent killed at each step of its protocols, then started again (borg, CrashMonkey).

For every crash point of onbox/common/faults.py in the seal, prune and finish protocols, a real
agent
runs a bounded job (three checkpoints, keep = 2 so that one is pruned, then success) with
RGT_CRASH_AT naming that point: it ends there as SIGKILL would. The store it leaves must
already satisfy the invariants (I2, I3). Then a new agent is started by hand, adopts the run
and completes it: LATEST is the last checkpoint, verified (I2, I3), written by this box's
agents (I5, I6), the checkpoint verified before the crash survives or was superseded (I1),
DONE.json is written, a fresh restore gives LATEST's bytes, and the canary secret the job
printed is nowhere in the store (I8).

The long tier (RGT_CHAOS_LONG=1) runs every point against S3 too, and at its 2nd occurrence.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from onbox.common import faults
from onbox.sealing import manifest as mf
from tests.chaos.harness import Backend, Box, alive, wait
from tests.chaos.invariants import Checker, LatestWatch

POINTS = [p for p in faults.POINTS if p.startswith(("seal.", "prune.", "finish."))]
STEPS = "10,20,30"


def _crashed_or_done(box: Box, run: str, pid: int, chk: Checker) -> bool:
    return not alive(pid) or chk.view.read(mf.done_key(run)) is not None


def _cut_and_resume(tmp_path: Any, backend: Backend, run: str, point: str) -> None:
    chk = backend.checker(run)
    box = Box(str(tmp_path), "box", backend.env)
    canary = f"canary-{uuid.uuid4().hex}"
    box.secrets(run, {"CHAOS_CANARY": canary})
    job = ["--steps", STEPS, "--mib", "0.25", "--every", "0.3", "--print-env", "CHAOS_CANARY"]
    try:
        with LatestWatch(backend.view, run) as watch:
            box.start(run, backend.url, job, keep=2, env={"RGT_CRASH_AT": point})
            pid = box.wait_agent(run)
            wait(lambda: _crashed_or_done(box, run, pid, chk), 60, f"the agent to reach {point}")
            # The agent also leaves when the run is done: only a death before DONE is the crash.
            crashed = not alive(pid) and chk.view.read(mf.done_key(run)) is None
            assert crashed, (
                f"the crash point {point} never fired: the run completed without reaching it "
                f"(is crash_point({point!r}) called in onbox/?)\n{box.diagnose(run)}"
            )
            # What the dead agent left must already be consistent.
            if chk.latest() is not None:
                chk.assert_latest_verified()
            chk.assert_visible_verify()
            survivor = chk.survivor() if chk.verified_steps() else None
            box.restart(run)
            wait(
                lambda: chk.view.read(mf.done_key(run)) is not None,
                60,
                f"the next agent to complete the run (DONE.json)\n{box.diagnose(run)}",
            )
            wait(lambda: box.state(run) == "SUCCEEDED", 30, "SUCCEEDED")
            # The agent still mirrors its last state after SUCCEEDED: let it finish and exit,
            # or the kill below leaves the mirror's temporary file for the I3 check to find.
            wait(lambda: box.agent_pid(run) is None, 30, "the agent to exit after SUCCEEDED")
        box.kill_all()
        chk.assert_writer(box.epochs(run))
        latest = chk.assert_latest_verified()
        assert latest["step"] == 30, f"the run completed: LATEST is its last step, not {latest}"
        if survivor is not None:
            chk.assert_survived(survivor, may_be_pruned=True)
        chk.assert_visible_verify()
        chk.assert_no_temps()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
        done = json.loads(chk.view.read(mf.done_key(run)) or b"{}")
        assert done.get("latest") == 30, f"DONE.json names the last checkpoint: {done}"
        chk.assert_no_secret(canary)
    finally:
        box.kill_all()


@pytest.mark.parametrize("point", POINTS)
def test_the_agent_killed_at_each_step_of_sealing_then_restarted_completes_the_run(
    tmp_path: Any, run_name: str, point: str
) -> None:
    from tests.chaos.conftest import file_backend

    _cut_and_resume(tmp_path, file_backend(str(tmp_path / "store")), run_name, point)


@pytest.mark.chaos_long
@pytest.mark.parametrize("point", [f"{p}:2" for p in POINTS] + POINTS)
def test_long_every_crash_point_against_every_store(
    tmp_path: Any, backend: Backend, run_name: str, point: str
) -> None:
    _cut_and_resume(tmp_path, backend, run_name, point)
