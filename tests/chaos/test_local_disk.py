"""The box's own disk runs low while the job checkpoints in place (issue 11, item 2).

The job rewrites one file, ``ckpt.pt``, at every step (``torch.save(state, "ckpt.pt")``), on a
checkpoint disk (a small tmpfs) that is almost full. Each rewrite is sealed as the next step of
the sequence, and low disk makes the agent free local room. ``ckpt.pt`` is one path for every
step: deleting "the local copy of an older step" deletes the newest state. The newest local
state must survive (I1, on the box), and the store's LATEST be that very state (I2).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from tests.chaos.conftest import file_backend
from tests.chaos.harness import Box, tmpfs, wait
from tests.chaos.invariants import LatestWatch

MIB = 1 << 20


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_low_disk_with_only_in_place_checkpoints_keeps_the_newest_local_state(
    tmp_path: Any, run_name: str
) -> None:
    run = run_name
    backend = file_backend(str(tmp_path / "store"))
    chk = backend.checker(run)
    box = Box(str(tmp_path), "box", backend.env)
    ckpt = str(tmp_path / "ckpt-disk")
    with tmpfs(ckpt, "size=16m"):
        # Leave about 2% free once ckpt.pt (1 MiB) is written: under the 5% low-water mark.
        st = os.statvfs(ckpt)
        filler = st.f_bavail * st.f_frsize - MIB - int(0.02 * st.f_blocks * st.f_frsize)
        with open(os.path.join(ckpt, "dataset.shard"), "wb") as f:
            f.write(b"\0" * filler)
        try:
            with LatestWatch(backend.view, run) as watch:
                job = ["--steps", "1,2,3", "--kind", "inplace", "--mib", "1", "--every", "0.8"]
                box.start(run, backend.url, [*job, "--then", "idle"], ckpt_dir=ckpt)
                wait(
                    lambda: "ckpt.pt" in box.wrote(run) and box.log(run).count("wrote") == 3,
                    30,
                    "the job's third rewrite",
                )
                newest = box.wrote(run)["ckpt.pt"]

                def sealed_newest() -> bool:
                    latest = chk.latest()
                    got = chk.manifest(latest["step"]) if latest else None
                    return bool(got and got[1]["files"][0]["sha256"] == newest)

                wait(sealed_newest, 30, f"the newest rewrite to be sealed\n{box.diagnose(run)}")
                wait(lambda: box.kinds(run)[-1] != "sealed", 5, "the pass after the seal")
            path = os.path.join(ckpt, "ckpt.pt")
            freed = [e["reason"] for e in box.events(run) if e["kind"] == "freed_local"]
            kinds = box.kinds(run)
            assert "freed_local" in kinds or "room_exhausted" in kinds, (
                f"scenario precondition: the agent saw the disk low and looked for room: {kinds}"
            )
            assert os.path.exists(path), (
                f"I1 (local): ckpt.pt, the newest local state, was deleted to free room: {freed}"
            )
            assert _sha(path) == newest, (
                f"I1 (local): ckpt.pt is not the newest state the job wrote: {freed}"
            )
            box.kill_all()
            chk.assert_writer(box.epochs(run))
            chk.assert_visible_verify()
            watch.check(chk.quarantined())
            latest = chk.assert_restorable(backend.env, str(tmp_path / "fresh"))
            got = chk.manifest(latest["step"])
            assert got is not None and got[1]["files"][0]["sha256"] == newest, (
                "I2: LATEST is the newest state the job wrote"
            )
        finally:
            box.kill_all()
