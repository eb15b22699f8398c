"""A deploy of a new run whose agent could not begin it (its store's epoch cannot be taken, so the
run ended FAILED before its first attempt) fails with the store's error and exit code, and
leaves nothing of the run on the box: no runs/N that `rgt status N` would not know and `rgt
down N` could not remove, and a deploy again once the store is fixed starts it as a new run.
A run that was on the box before keeps its directory, FAILED.

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tests.conftest import _kill_run_processes
from tests.integration.test_refused_secrets import Laptop
from tests.sshd import SshServer


def _block_epochs(store: Path, name: str) -> Path:
    """The run's epochs cannot be taken in ``store``: RUN/epochs is a file, not a directory."""
    (store / name).mkdir(parents=True, exist_ok=True)
    blocker = store / name / "epochs"
    blocker.write_text("in the way\n")
    return blocker


def test_a_new_run_that_could_not_begin_leaves_nothing_on_the_box(
    sshd: SshServer, tmp_path: Path
) -> None:
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    blocker = _block_epochs(store, "unbegun")
    try:
        rc, out = lap.deploy(
            "unbegun", "--store", f"file://{store}", "--", sys.executable, "job.py"
        )
        assert rc == 14, out  # the store's error, as the box said it
        assert "run unbegun could not begin" in out, out
        assert "taking the run's epoch in file://" in out, out
        assert "nothing of the run is left on the box" in out, out
        assert not lap.runs("unbegun").exists(), "the run that never began stayed on the box"
        assert not lap.secrets("unbegun").exists()
        rc, out = lap.rgt("status", "unbegun")
        assert rc == 8, out  # no such run, on the laptop or the box
        # Fixed, the same deploy starts it as the first one would have.
        blocker.unlink()
        rc, out = lap.deploy(
            "unbegun", "--store", f"file://{store}", "--", sys.executable, "job.py"
        )
        assert rc == 0, out
        kinds = [
            json.loads(line)
            for line in (lap.runs("unbegun") / "events.jsonl").read_text().splitlines()
        ]
        assert not [e for e in kinds if e["kind"] == "restore_failed"], kinds
        assert "(new run)" in kinds[0]["reason"], kinds[0]
    finally:
        _kill_run_processes(str(lap.box))


def test_a_run_on_the_box_that_could_not_begin_keeps_its_directory(
    sshd: SshServer, tmp_path: Path
) -> None:
    """Only what the refused start itself made goes: a run the box held before is kept, FAILED."""
    lap = Laptop(sshd, tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    try:
        job = ("--", sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)")
        rc, out = lap.deploy("held", "--store", f"file://{store}", *job)
        assert rc == 0, out
        rc, out = lap.rgt("stop", "held")
        assert rc == 0, out
        shutil.rmtree(store / "held" / "epochs")
        _block_epochs(store, "held")
        rc, out = lap.deploy("held", "--store", f"file://{store}", *job)
        assert rc == 14 and "epochs/00000001: not a directory" in out, out
        assert "nothing of the run is left" not in out, out
        state = json.loads((lap.runs("held") / "state.json").read_text())
        assert state["state"] == "FAILED", state
    finally:
        _kill_run_processes(str(lap.box))
