"""An object of LATEST's checkpoint is lost or rots in the store (F1, B4; issue 11, items 3-4).

Box A seals steps 10 and 20 and is gone. Then one object of step 20 is deleted, or one bit of
it flipped, in the store's own bytes. A fresh restore falls back to step 10, the previous
verified checkpoint, and quarantines 20 (kept, flagged: I2, I7); a fresh box B resumes from 10
(I6) and its next checkpoint, step 15, lower than the bad 20, becomes LATEST: the one reason a
step may go down. Then the invariants, from the store's own bytes (I1, I2, I3, I5, I6), and a
fresh restore gives exactly step 15.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.chaos.harness import Backend, Box, wait
from tests.chaos.invariants import LatestWatch, Survivor, restore_fresh


def _latest_step(backend: Backend, run: str) -> int:
    doc = backend.checker(run).latest()
    return int(doc["step"]) if doc else -1


@pytest.mark.parametrize("fault", ["deleted", "bit_flipped"])
def test_an_object_of_latest_lost_or_rotten_a_fresh_box_falls_back_and_moves_on(
    tmp_path: Any, backend: Backend, run_name: str, fault: str
) -> None:
    run, chk = run_name, backend.checker(run_name)
    a, b = Box(str(tmp_path), "box-a", backend.env), Box(str(tmp_path), "box-b", backend.env)
    try:
        a.start(run, backend.url, ["--steps", "10,20", "--mib", "1", "--then", "idle"])
        wait(lambda: _latest_step(backend, run) == 20, 60, "steps 10 and 20 sealed")
        a.kill_all()  # the box is gone
        got = chk.manifest(10)
        assert got is not None
        survivor = Survivor(10, got[0])
        bad = chk.manifest(20)
        assert bad is not None
        key = next(f["key"] for f in bad[1]["files"] if f["path"].endswith("b.bin"))
        if fault == "deleted":
            backend.view.delete(key)
        else:
            data = bytearray(backend.view.read(key) or b"")
            data[len(data) // 2] ^= 0x01
            backend.view.write(key, bytes(data))
        # A fresh restore falls back to step 10, the previous verified checkpoint.
        fresh = str(tmp_path / "fresh-10")
        doc = chk.manifest(10)
        assert doc is not None
        _restore_is(backend, run, fresh, doc[1])
        with LatestWatch(backend.view, run) as watch:
            # A fresh box resumes from 10; its step 15 is below the bad 20 and must be sealed.
            job = ["--steps", "10,15", "--mib", "1", "--tag", "B", "--then", "idle"]
            b.start(run, backend.url, job)
            wait(
                lambda: _latest_step(backend, run) == 15,
                60,
                f"B's step 15 to become LATEST (after the fallback)\n{b.diagnose(run)}",
            )
        b.kill_all()
        assert "resumed at 10" in b.log(run), f"I6: B resumes from step 10:\n{b.log(run)}"
        assert 20 in chk.quarantined(), "I2/I7: the bad step 20 is quarantined (kept, flagged)"
        assert chk.view.objects(f"{run}/checkpoints/20/"), "quarantine keeps the bad checkpoint"
        chk.assert_writer(b.epochs(run))
        chk.assert_survived(survivor)
        chk.assert_visible_verify()
        watch.check(chk.quarantined())
        chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
    finally:
        a.kill_all()
        b.kill_all()


def _restore_is(backend: Backend, run: str, dest: str, doc: Any) -> None:
    """`rgt-agent restore` into ``dest`` succeeds with exactly the files of ``doc``."""
    p, got = restore_fresh(backend.env, backend.url, run, dest)
    assert p.returncode == 0, (
        f"I1: a fresh restore must fall back to step {doc['step']}, the previous verified "
        f"checkpoint; it exited {p.returncode}: {p.stdout}{p.stderr}"
    )
    found = {rel: sha for rel, (_, sha) in got.items()}
    want = {f["path"]: f["sha256"] for f in doc["files"]}
    assert found == want, f"I1: the fallback restore gave {sorted(found)}, not step {doc['step']}"
