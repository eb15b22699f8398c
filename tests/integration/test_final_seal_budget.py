"""The final seal of a preemption, judged against its grace before it starts.

What a user relies on when a short grace meets a large checkpoint: the agent does not start a
seal it cannot finish before the SIGKILL (a half-sealed checkpoint), it says so
(``final_not_sealed``), and the previous sealed checkpoint stays the one a fresh box restores.
A checkpoint that fits is sealed within the grace. Real agent, real job, a file:// store, a real
SIGTERM.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any, Dict, List

import pytest

from tests.conftest import Cli, _kill_run_processes
from tests.polling import wait

RUN = "fb1"
GRACE = "5"  # the agent's budget; MARGIN (1 s) of it is kept for its exit
FIRST = b"the first checkpoint, sealed in the normal way\n"
# The final seal's estimate uses the sealer's rate: 50 MB/s until a seal of at least 8 MiB
# measures it (RATE_MIN_BYTES; the first seal's 47 bytes do not), plus 0.5 s: 256 MiB needs ~5.9
# s, more than the whole grace, on any machine however fast its disk (a seal that ran would take
# ~1 s here). 64 KiB needs ~0.5 s of the ~4 s left.
BIG = 256 << 20
SMALL = 64 << 10

JOB = """\
import hashlib, os, sys, time
path = os.path.join(sys.argv[1], "model.bin")
if os.path.exists(path):  # restored by the agent before this start
    with open(path, "rb") as f:
        print("restored sha256", hashlib.sha256(f.read()).hexdigest(), flush=True)
    sys.exit(0)
os.makedirs(sys.argv[1], exist_ok=True)
with open(path + ".tmp", "wb") as f:
    f.write(FIRST_BYTES)
    f.flush()
    os.fsync(f.fileno())
os.replace(path + ".tmp", path)
print("ready", flush=True)
while True:
    time.sleep(3600)
""".replace("FIRST_BYTES", repr(FIRST))


def _latest_step(root: str) -> Any:
    try:
        with open(os.path.join(root, RUN, "LATEST.json")) as f:
            return json.load(f)["step"]
    except FileNotFoundError:
        return None


def _start(cli: Cli, work: str, root: str) -> None:
    """The job in ``work`` (its checkpoint dir ``work/ckpt``), sealed to ``root``. The scan is
    an hour: the sealing thread wakes only when a file in the checkpoint dir is closed or
    renamed (inotify), so what the final seal finds is all the final seal's doing."""
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(JOB)
    ckpt = os.path.join(work, "ckpt")
    with open(os.path.join(work, "job.toml"), "w") as f:
        f.write(
            f"name = {json.dumps(RUN)}\n"
            f"command = {json.dumps([sys.executable, 'job.py', ckpt])}\n"
            f'store = "file://{root}"\n'
            f'[checkpoint]\ndir = {json.dumps(ckpt)}\nscan = "1h"\n'
        )
    cli("start", os.path.join(work, "job.toml"), "--grace", GRACE, check=True, cwd=work)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size,fits", [(BIG, False), (SMALL, True)], ids=["too_big", "fits"])
def test_a_preemption_seals_the_pending_checkpoint_only_if_it_fits_in_the_grace(
    cli: Cli, tmp_path: Any, size: int, fits: bool
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    box = str(tmp_path / "box")
    model = os.path.join(box, "ckpt", "model.bin")
    try:
        _start(cli, box, root)
        st = cli.wait_state(RUN, "RUNNING", "STARTING")
        cli.wait_output(RUN, "ready")
        wait(lambda: _latest_step(root) == 0, 30, "the first checkpoint sealed as step 0")
        # The first checkpoint's write woke the sealing thread several times (created, closed,
        # moved); a wake delivered late, on a loaded machine, ran a pass after the growth below
        # and sealed the big checkpoint itself, before the SIGTERM. A sync is one more pass,
        # answered once it is done: the wakes before it are spent by then.
        cli("sync", RUN, check=True)
        # The job's second checkpoint: its in-place file grown to ``size`` (sparse: no bytes
        # written here). A truncate is a modification inotify does not wake the sealer for,
        # so the checkpoint is pending, unsealed, when the SIGTERM comes: the final seal's.
        os.truncate(model, size)
        second = _sha(FIRST + bytes(size - len(FIRST))) if fits else None
        os.kill(st["agent"]["pid"], signal.SIGTERM)  # the platform's preemption
        over = cli.wait_over(RUN, "PREEMPTED", "STOPPED", "FAILED", timeout=30)
        assert over["state"] == "PREEMPTED", over
        events = cli.events(RUN)
        not_sealed = [e for e in events if e["kind"] == "final_not_sealed"]
        manifests = sorted(os.listdir(os.path.join(root, RUN, "checkpoints")))
        if fits:
            assert not not_sealed, not_sealed
            assert _latest_step(root) == 1 and manifests == ["0", "1"], manifests
            # sealed by the final seal: after the preemption began, not by the sealing thread
            kinds = [(e["kind"], e.get("step")) for e in events]
            assert kinds.index(("sealed", 1)) > kinds.index(("preempt", None)), kinds
        else:
            assert len(not_sealed) == 1, [(e["kind"], e["reason"]) for e in events[-8:]]
            ev = not_sealed[0]
            assert ev["class"] == "transient", ev
            assert ev["reason"].startswith(f"preempt: sealing {size} bytes needs ~"), ev
            assert "LATEST stays at step 0" in ev["reason"], ev
            assert "a longer grace" in ev["remedy"], ev  # what to do (docs/events.md)
            assert "stays on this box's disk" in ev["remedy"], ev
            # No seal was started: nothing of the second checkpoint is in the store, and
            # LATEST is still the first.
            assert not [e for e in events if e["kind"] == "seal_cut"], events
            assert _latest_step(root) == 0 and manifests == ["0"], manifests
            assert os.path.getsize(model) == size  # still on the box's disk
        os.unlink(model)  # the big file goes now, not with tmp_path's later clean-up

        # A fresh box (its own RGT_HOME, no local checkpoint) on the same store restores the
        # sealed step, verified against its MANIFEST; the job reports the bytes it got.
        home2 = str(tmp_path / "home2")
        os.makedirs(home2)
        fresh = Cli(home2, {**cli.env, "RGT_HOME": home2})
        try:
            _start(fresh, str(tmp_path / "box2"), root)
            fresh.wait_over(RUN, "SUCCEEDED", "FAILED", "STOPPED", timeout=60)
            restored: List[Dict[str, Any]] = [
                e for e in fresh.events(RUN) if e["kind"] == "restored"
            ]
            assert [e["step"] for e in restored] == [1 if fits else 0], restored
            out = fresh.log_text(RUN)
            assert f"restored sha256 {second or _sha(FIRST)}" in out, out[-2000:]
        finally:
            _kill_run_processes(home2)
    finally:
        for path in (model, os.path.join(str(tmp_path), "box2", "ckpt", "model.bin")):
            if os.path.exists(path):
                os.unlink(path)


def test_small_seals_before_do_not_make_a_fitting_final_seal_look_too_slow(
    cli: Cli, tmp_path: Any
) -> None:
    """The final seal's estimate used a rate every seal moved halfway to its bytes over its
    time, and a small seal's time is its fixed costs (the epoch's listing, the MANIFEST's put,
    the fsyncs): after six checkpoints of a few bytes the rate was under 1 MB/s, and a 16 MiB
    checkpoint at a preemption with a 5 s grace was refused as needing ~20 s (it takes well
    under one). Only seals large enough to measure the link now move the rate."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    box = str(tmp_path / "box")
    model = os.path.join(box, "ckpt", "model.bin")
    _start(cli, box, root)
    st = cli.wait_state(RUN, "RUNNING", "STARTING")
    cli.wait_output(RUN, "ready")
    wait(lambda: _latest_step(root) == 0, 30, "the first checkpoint sealed as step 0")
    for step in range(1, 7):  # small checkpoints, each new bytes, each sealed on its rename
        with open(model + ".tmp", "wb") as f:
            f.write(b"small checkpoint %d\n" % step)
        os.replace(model + ".tmp", model)
        wait(lambda s=step: _latest_step(root) == s, 30, f"small checkpoint {step} sealed")
    size = 16 << 20
    os.truncate(model, size)  # pending, unsealed (see the test above)
    os.kill(st["agent"]["pid"], signal.SIGTERM)
    over = cli.wait_over(RUN, "PREEMPTED", "STOPPED", "FAILED", timeout=30)
    assert over["state"] == "PREEMPTED", over
    events = cli.events(RUN)
    assert not [e for e in events if e["kind"] == "final_not_sealed"], [
        e["reason"] for e in events if e["kind"] == "final_not_sealed"
    ]
    assert _latest_step(root) == 7
