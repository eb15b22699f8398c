"""A fresh box killed in the middle of its restore, then started again (F3).

The restore protocol's crash points (onbox/common/faults.py ``restore.*``) cut a fresh box's restore
of step 10 short. A cut restore leaves nothing half-written under a final name on the box (I3),
and the next start restores the same checkpoint whole and the job resumes from it (I1, I6).
"""

from __future__ import annotations

import os
from typing import Any, List

import pytest

from onbox.common import faults
from tests.chaos.conftest import file_backend
from tests.chaos.harness import Box, wait

RESTORE_POINTS = [p for p in faults.POINTS if p.startswith("restore.")]


@pytest.mark.parametrize("point", RESTORE_POINTS)
def test_a_fresh_box_killed_mid_restore_restores_whole_on_the_next_start(
    tmp_path: Any, run_name: str, point: str
) -> None:
    backend = file_backend(str(tmp_path / "store"))
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, ["--steps", "10", "--mib", "1", "--then", "idle"])
        wait(lambda: (chk.latest() or {}).get("step") == 10, 60, "step 10 sealed")
        a.kill_all()
        survivor = chk.survivor()
        job = ["--steps", "10,20", "--mib", "1", "--then", "idle"]
        b.start(run, backend.url, job, env={"RGT_CRASH_AT": point}, check=False)
        wait(lambda: "epoch" in b.kinds(run), 30, "B's agent to start")
        wait(lambda: b.agent_pid(run) is None, 30, f"B's agent to die at {point}")
        assert "restored" not in b.kinds(run), f"the crash point {point} never fired"
        step_dir = os.path.join(b.ckpt, "step_10")
        # Under the final name: all of the checkpoint or nothing of it (I3).
        got: List[str] = sorted(os.listdir(step_dir)) if os.path.isdir(step_dir) else []
        assert got in ([], [".rgt-complete", "a.bin", "b.bin"]), (
            f"I3: a cut restore left part of step 10 under its final name: {got}"
        )
        b.restart(run)
        wait(lambda: (chk.latest() or {}).get("step") == 20, 60, "B to resume and seal step 20")
        b.kill_all()
        assert "resumed at 10" in b.log(run), f"I6: B resumed from step 10:\n{b.log(run)}"
        chk.assert_writer(b.epochs(run))
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        a.kill_all()
        b.kill_all()
