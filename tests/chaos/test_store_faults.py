"""The store itself fails: its server is killed mid-upload, or its disk fills.

- SeaweedFS is SIGKILLed while a checkpoint larger than the multipart threshold is uploading,
  then restarted on the same data (C1, C5): the upload is retried and LATEST moves on only to
  the whole checkpoint; what was sealed before survives.
- The ``file://`` store (a small tmpfs) runs out of bytes, or of inodes, in the middle of a
  seal (B1, B2): the seal fails as a permanent error, nothing torn is visible, the job goes on,
  and once there is room again the checkpoint is sealed.

After each: the invariants of tests/chaos/invariants.py, from the store's own bytes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests import seaweed
from tests.chaos.conftest import file_backend, s3_backend
from tests.chaos.harness import Backend, Box, remount, tmpfs, upload_started, wait
from tests.chaos.invariants import LatestWatch
from tests.conftest import require
from tests.seaweed import start_seaweed


def _latest_step(backend: Backend, run: str) -> int:
    try:
        doc = backend.checker(run).latest()
    except Exception:  # the server is down on purpose
        return -1
    return int(doc["step"]) if doc else -1


def test_seaweedfs_killed_mid_multipart_upload_and_restarted(tmp_path: Any, run_name: str) -> None:
    why = seaweed.missing()
    require(why is None, why or "")
    server = start_seaweed(str(tmp_path / "seaweed"))
    backend = s3_backend(server)
    run, chk = run_name, backend.checker(run_name)
    box = Box(str(tmp_path), "box", backend.env)
    try:
        with LatestWatch(backend.view, run) as watch:
            # 20 MiB > MULTIPART_THRESHOLD (8 MiB): step 20 goes up in parts.
            job = ["--steps", "10,20", "--kind", "file", "--mib", "20", "--gate", box.gate]
            box.start(run, backend.url, [*job, "--then", "idle"])
            box.open_gate(10)
            wait(lambda: _latest_step(backend, run) == 10, 60, "step 10 sealed")
            survivor = chk.survivor()
            before = backend.view.objects(f"{run}/")
            box.open_gate(20)
            wait(lambda: backend.view.temps(f"{run}/"), 60, "a multipart upload of step 20")
            assert upload_started(backend.view, run, before)
            server.kill()
            time.sleep(1.0)  # down: the parts in flight fail, the sealer retries meanwhile
            server.start()
            wait(lambda: _latest_step(backend, run) == 20, 90, f"step 20\n{box.diagnose(run)}")
        box.kill_all()
        errors = [e for e in box.events(run) if e["kind"] == "seal_error"]
        assert all(e["class"] == "transient" for e in errors), (
            f"I7: a store outage is a transient error with a reason: {errors}"
        )
        chk.assert_writer(box.epochs(run))
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        box.kill_all()
        server.kill()  # this server is the test's own: no clean shutdown to wait for


@pytest.mark.parametrize(
    "opts,grown,at",
    [
        ("size=4m", "size=64m", "20:6:0"),  # bytes: step 20 (6 MiB) cannot fit
        ("size=64m,nr_inodes=48", "nr_inodes=4000", "20:0.1:64"),  # inodes: 66 more files
    ],
    ids=["enospc", "inodes"],
)
def test_the_store_filling_up_mid_seal_fails_cleanly_and_seals_once_there_is_room(
    tmp_path: Any, run_name: str, opts: str, grown: str, at: str
) -> None:
    run = run_name
    root = str(tmp_path / "store")
    with tmpfs(root, opts):
        backend = file_backend(os.path.join(root, "rgt"))
        chk = backend.checker(run)
        box = Box(str(tmp_path), "box", backend.env)
        try:
            with LatestWatch(backend.view, run) as watch:
                job = ["--steps", "10,20", "--mib", "0.5", "--gate", box.gate, "--at", at]
                box.start(run, backend.url, [*job, "--then", "idle"])
                box.open_gate(10)
                wait(lambda: _latest_step(backend, run) == 10, 60, "step 10 sealed")
                survivor = chk.survivor()
                box.open_gate(20)
                wait(
                    lambda: "seal_error" in box.kinds(run),
                    60,
                    f"the seal of step 20 to fail on the full store\n{box.diagnose(run)}",
                )
                errors = [e for e in box.events(run) if e["kind"] == "seal_error"]
                assert errors[0]["class"] == "permanent", f"I7: a full disk is permanent: {errors}"
                # Nothing torn is visible meanwhile, and training goes on (I4).
                chk.assert_latest_verified()
                assert _latest_step(backend, run) == 10
                chk.assert_visible_verify()
                assert box.state(run) in ("STARTING", "RUNNING"), (
                    f"I4: training goes on: {box.state(run)}"
                )
                remount(root, grown)  # the operator makes room
                wait(lambda: _latest_step(backend, run) == 20, 60, f"step 20\n{box.diagnose(run)}")
            # A clean stop, so that a kill mid-mirror cannot leave the temporary file the I3
            # check below looks for (the agent mirrors its state on its own schedule).
            box.stop(run)
            box.kill_all()
            chk.assert_writer(box.epochs(run))
            chk.assert_survived(survivor)
            chk.assert_visible_verify()
            chk.assert_no_temps()
            watch.check(chk.quarantined())
            chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
        finally:
            box.kill_all()
