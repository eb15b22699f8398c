"""`rgt sweep` deploying again a cell whose agent is gone mid-cell, to a box that cannot take
the deploy: the cell's record keeps the deploy's error, as a cell's first deploy does, so the
record says why the cell did not go on (its box's queue is left after MAX_REDEPLOYS).

Real parts: the real `rgt sweep` CLI as a process, bounded and killed by PID past it, a
``file://`` store on this machine; the plan's one box does not resolve (``.invalid``), so each
deploy to it fails in ssh.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from controller.sweep import record
from controller.sweep.plan import load_plan
from tests.integration.test_store_hung import _bounded
from tests.integration.test_sweep_unread import _plan
from tests.laptop import rgt_exe

BOX = "rgt-sweep-unread-box.invalid"


def test_a_failed_deploy_of_a_cell_whose_agent_is_gone_is_recorded_on_the_cell(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """The first cell is running in the sweep's record, with no run record on this laptop (a
    deploy cut off before it: the sweep takes its agent as gone) and nothing sealed; the sweep
    deploys it again, and each deploy fails. Before the fix the cell's error stayed None: only
    a pending cell's first deploy recorded its error."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    root = tmp_path / "durable"
    root.mkdir()
    plan = _plan(tmp_path, f"file://{root}")
    record.begin(load_plan(plan), home)
    with record.update("sw", home) as doc:
        cells = sorted(doc["cells"], key=lambda n: doc["cells"][n]["index"])
        gone = doc["cells"][cells[0]]
        gone.update(runs=[gone["run"]], state="running")
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "sweep", plan, "--interval", "0.1"], env, str(tmp_path))
    assert rc == 3, (out, err)
    assert "Traceback" not in err, err
    assert f"{cells[0]}'s agent on {BOX} is gone mid-cell" in err, err
    assert "its queue is left" in err, err
    with open(os.path.join(home, "sweeps", "sw.json")) as f:
        got = json.load(f)["cells"]
    c = got[cells[0]]
    assert c["state"] == "running", c  # its agent gone, its run not done: the next sweep goes on
    assert c["error"] and c["error"].startswith("rgt: ") and BOX in c["error"], c
    assert got[cells[1]]["state"] == "pending" and got[cells[1]]["error"] is None, got
