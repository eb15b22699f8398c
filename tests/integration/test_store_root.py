"""Where a ``file://`` store's root may be made, with a real agent and real mounts.

What a user relies on: a mistyped durable path (``/mnt/durabel/rgt``) is refused before anything
is made, instead of being made on the box's own disk where every seal would "succeed" and die with
the box; a root under a mount of its own (a network volume, a data disk: here a tmpfs) is made;
and a durable mount that goes away under a running job is never replaced by a directory on the
box's disk: the seal fails, saying so, and the checkpoint stays on the box.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, List

import pytest

from onbox.common.errors import PermanentStoreError
from onbox.sealing.stores.local import LocalStore
from tests.conftest import FIXTURES, Cli
from tests.mounts import tmpfs
from tests.polling import latest_step, wait

WRITER = [sys.executable, os.path.join(FIXTURES, "ckpt_writer.py"), "on_signal", "1"]


def _job(cli: Cli, name: str, root: str) -> str:
    job = os.path.join(cli.home, f"{name}.toml")
    with open(job, "w") as f:
        f.write(f'command = {json.dumps(WRITER)}\nstore = "file://{root}"\n')
    return job


@pytest.mark.parametrize("where", ["mnt/durabel/rgt", "durabel"])  # a typo: the mount's, the root's
def test_a_store_root_that_does_not_exist_is_refused_before_anything_is_made(
    cli: Cli, tmp_path: Any, where: str
) -> None:
    (tmp_path / "mnt").mkdir()  # (the mount point: a directory on the box's disk)
    root = str(tmp_path / where)
    p = cli("start", _job(cli, "typo", root), "--name", "typo")
    assert p.returncode == 8, p.stderr
    assert f"the store root {root} does not exist on this box" in p.stderr, p.stderr
    under = tmp_path / "mnt" if where.startswith("mnt/") else tmp_path
    assert f"made on the box's root filesystem (under {under}, not a mount)" in p.stderr
    assert f"mkdir -p {root}" in p.stderr, p.stderr
    assert not os.path.lexists(tmp_path / where.split("/")[0] / "durabel")
    assert not os.path.lexists(root)
    assert not os.path.lexists(os.path.join(cli.home, "runs", "typo"))


def test_a_store_root_under_a_mount_of_its_own_is_made(cli: Cli, tmp_path: Any) -> None:
    with tmpfs(str(tmp_path / "vol"), "size=16m") as vol:
        root = os.path.join(vol, "proj", "rgt")  # (every directory under the mount is made)
        cli("start", _job(cli, "made", root), "--name", "made", check=True)
        try:
            st = cli.wait_state("made", "RUNNING", "STARTING")
            wait(lambda: "ready" in cli.log_text("made"), what="the job to be ready")
            os.kill(st["pid"], signal.SIGUSR2)
            wait(lambda: latest_step(root, "made") == 1, what="step 1 sealed in the new root")
        finally:
            cli("stop", "made", "--grace", "5", timeout=60)
            cli.wait_over("made", "STOPPED", "SUCCEEDED", "FAILED")


def _seal_errors(cli: Cli, name: str) -> List[str]:
    return [e["reason"] for e in cli.events(name) if e["kind"] == "seal_error"]


@pytest.mark.parametrize("under", ["rgt", ""], ids=["root under the mount", "root is the mount"])
def test_a_durable_mount_that_goes_away_is_not_replaced_on_the_boxs_disk(
    cli: Cli, tmp_path: Any, under: str
) -> None:
    """The mount is taken away (lazily unmounted, as a dropped NFS or volume can be) between two
    checkpoints: the root under it is gone, or, where the root is the mount point itself, an
    empty directory on the box's disk. Before, step 2 was sealed onto the box's disk there (the
    root made again, or written into)."""
    mnt = str(tmp_path / "mnt")
    root = os.path.join(mnt, under) if under else mnt
    with tmpfs(mnt, "size=16m"):
        cli("start", _job(cli, "away", root), "--name", "away", check=True)
        st = cli.wait_state("away", "RUNNING", "STARTING")
        pid = int(st["pid"])
        try:
            wait(lambda: "ready" in cli.log_text("away"), what="the job to be ready")
            os.kill(pid, signal.SIGUSR2)
            wait(lambda: latest_step(root, "away") == 1, what="step 1 sealed on the mount")
            subprocess.run(["umount", "-l", mnt], check=True, timeout=30)
            os.kill(pid, signal.SIGUSR2)
            ckpt = os.path.join(cli.home, "runs", "away", "ckpt", "step_2.pt")
            wait(lambda: os.path.exists(ckpt), what="step 2 written")
            # Sealed now or by the stop's final seal below: either way it meets the gone root.
        finally:
            cli("stop", "away", "--grace", "5", timeout=60)
        # The stop's final seal fails the same way; the run still ends STOPPED, its state
        # written (the agent died on the error and left it STOPPING).
        st = cli.wait_over("away", "STOPPED")
        assert st["last_exit"]["reason"].startswith("ended by stop"), st
        [reason, *_] = _seal_errors(cli, "away")
        # (Said by the epoch's check before any put: the store is not the one the run's epoch
        # was taken in; or, where the root is the mount point and a pass met it first, by the
        # root's filesystem check. The puts' own checks are tested below, without a ledger.)
        assert (
            f"file://{root} no longer holds run away's epoch 1" in reason
            or f"the store root {root} is on the box's root filesystem now" in reason
        ), reason
        assert "was the durable mount unmounted?" in reason, reason
        assert not os.path.lexists(os.path.join(root, "away", "checkpoints"))
        assert os.path.exists(ckpt)  # kept on the box


@pytest.mark.parametrize("under", ["rgt", ""], ids=["root under the mount", "root is the mount"])
def test_a_put_after_the_mount_dropped_writes_nothing_on_the_boxs_disk(
    tmp_path: Any, under: str
) -> None:
    """The store's own check, whoever writes (a ledger's epoch check is not the only guard)."""
    mnt = str(tmp_path / "mnt")
    root = os.path.join(mnt, under) if under else mnt
    src = tmp_path / "w.bin"
    src.write_bytes(b"w" * 4096)
    with tmpfs(mnt, "size=16m"):
        store = LocalStore(root)
        store.preflight("r")
        store.put_file("r/checkpoints/1/w.bin", str(src), sha256=None, size=4096)
        subprocess.run(["umount", "-l", mnt], check=True, timeout=30)
        with pytest.raises(PermanentStoreError) as got:
            store.put_file("r/checkpoints/2/w.bin", str(src), sha256=None, size=4096)
        assert "(was the durable mount unmounted?)" in got.value.what, got.value.what
        assert not os.path.lexists(os.path.join(root, "r"))
