"""How `rgt sweep` reads a cell's run between two polls: a run that ended between its look at
the store and its look at the box is done, not dead.

The sweep looked for the run's DONE.json in the store, then asked the box for its status. A run
whose agent wrote DONE.json and let go in between (a fraction of a second, but the status is an
ssh round trip, longer under load) read as SUCCEEDED with its agent gone: "gone mid-cell", and
the cell was deployed again; four such in one sweep left a box's queue ("its agent died 4
times"), which is how the two-box sweep test failed under load.

Real parts: a real run deployed on the ``local`` target (the same commands as an ssh box), a
real file:// store, the real `rgt-agent status`. The race itself is pinned at its seam: the
run's DONE.json is held back from the store until the status has been read, as when the agent
finishes during that read (named ``race_seam``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from controller import boxrun
from controller.cli import main as rgt_main
from controller.registry import Registry
from controller.sweep import run as sweeprun
from onbox.sealing import manifest as mf
from onbox.sealing.stores import open_store
from tests.conftest import Cli

RUN = "obs"


def test_a_run_that_ends_while_its_status_is_read_is_done_not_dead_race_seam(
    cli: Cli, tmp_path: Any, controller_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RGT_BOX_HOME", cli.home)
    root = str(tmp_path / "durable")
    os.makedirs(root)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text("print('done', flush=True)\n")
    code = rgt_main(
        ["deploy", "local", "--name", RUN, "--python", sys.executable, "--project", str(proj),
         "--store", f"file://{root}", "--", sys.executable, "job.py"]
    )  # fmt: skip
    assert code == 0
    st = cli.wait_over(RUN, "SUCCEEDED", timeout=120)
    cli.wait_for(RUN, lambda s: not s["agent"]["alive"], what="the agent to let go")
    done = os.path.join(root, mf.done_key(RUN))
    held = done + ".held"
    assert os.path.exists(done), st
    os.rename(done, held)  # not yet written when the sweep looks at the store ...

    real = boxrun.poll_status

    def status_then_done(rec: Any, remote: Any) -> Any:
        got = real(rec, remote)
        os.rename(held, done)  # ... written, and the agent gone, by the time the status is read
        return got

    monkeypatch.setattr(boxrun, "poll_status", status_then_done)  # what the sweep calls
    driver = sweeprun.Driver.__new__(sweeprun.Driver)  # only what _observe reads
    driver.registry = Registry()
    driver.store = open_store(f"file://{root}")
    seen = driver._observe(sweeprun.Box("local"), RUN, RUN)
    assert seen == "done", seen
