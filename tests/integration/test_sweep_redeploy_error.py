"""`rgt sweep` deploying again a cell whose agent is gone mid-cell, to a box that cannot take
the deploy: the cell's record keeps the deploy's error, as a cell's first deploy does, so the
record says why the cell did not go on (its box's queue is left after MAX_REDEPLOYS). Each
failed deploy, a cell's first one or one again, is said as it happens, after the line that
announced it: before, only the summary said the box's last error, once its queue was left.

Real parts: the real `rgt sweep` CLI as a process, bounded and killed by PID past it, a
``file://`` store on this machine; the plan's one box does not resolve (``.invalid``), so each
deploy to it fails in ssh.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

from controller.sweep import record
from controller.sweep.plan import load_plan
from tests.integration.test_store_hung import _bounded
from tests.integration.test_sweep_unread import _plan
from tests.laptop import rgt_exe

BOX = "rgt-sweep-unread-box.invalid"


def _swept(tmp_path: Any, controller_env: Dict[str, str]) -> Tuple[int, str, str, List[str]]:
    """`rgt sweep` of a two-cell plan on BOX whose first cell is running in the sweep's
    record, with no run record on this laptop (a deploy cut off before it: the sweep takes its
    agent as gone) and nothing sealed: (exit code, stdout, stderr, the cells in order)."""
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
    return rc, out, err, cells


def test_a_failed_deploy_of_a_cell_whose_agent_is_gone_is_recorded_on_the_cell(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """The first cell is running in the sweep's record, with no run record on this laptop (a
    deploy cut off before it: the sweep takes its agent as gone) and nothing sealed; the sweep
    deploys it again, and each deploy fails. Before the fix the cell's error stayed None: only
    a pending cell's first deploy recorded its error."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    rc, out, err, cells = _swept(tmp_path, controller_env)
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


def test_a_box_left_after_its_redeploys_failed_says_why_in_the_summary(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """As above: the summary's line for the box that is left says the last deploy's error
    (its box cannot be reached), the cause the cell's record keeps. Before the fix it said
    only "its agent died 4 times", as if the job's agent had died on the box each time."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    rc, out, err, cells = _swept(tmp_path, controller_env)
    assert rc == 3, (out, err)
    with open(os.path.join(home, "sweeps", "sw.json")) as f:
        error = json.load(f)["cells"][cells[0]]["error"]
    assert error and error.startswith(f"rgt: cannot reach {BOX}: "), error  # RemoteUnreachable
    left = [ln for ln in err.splitlines() if "its queue is left" in ln]
    assert len(left) == 1 and left[0].startswith(f"  {BOX}: its queue is left: "), err
    assert f"{cells[0]} could not be deployed again: " in left[0], left[0]
    assert error[len("rgt: ") :] in left[0] and "agent died" not in left[0], left[0]


def _failed_deploys_said(err: str, cell: str, announced: str) -> int:
    """How many deploys of ``cell`` ``err`` announces with ``announced``; each one's next sweep
    line (the deploy's own indented lines left out) must say that it failed, naming the box and
    why."""
    lines = [ln for ln in err.splitlines() if ln.startswith("rgt sweep")]
    starts = [i for i, ln in enumerate(lines) if ln.startswith(announced)]
    for i in starts:
        assert lines[i + 1].startswith(f"rgt sweep: {cell}: its deploy to {BOX} failed"), lines
        assert f"cannot reach {BOX}: " in lines[i + 1], lines
    return len(starts)


def test_each_failed_deploy_again_is_said_as_it_happens(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    rc, out, err, cells = _swept(tmp_path, controller_env)
    assert rc == 3, (out, err)
    said = _failed_deploys_said(
        err, cells[0], f"rgt sweep: {cells[0]}'s agent on {BOX} is gone mid-cell"
    )
    assert said >= 1, err


def test_each_failed_first_deploy_is_said_as_it_happens(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """A fresh sweep of the plan: each deploy of its first cell to BOX fails; each is said."""
    root = tmp_path / "durable"
    root.mkdir()
    plan = _plan(tmp_path, f"file://{root}")
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "sweep", plan, "--interval", "0.1"], env, str(tmp_path))
    assert rc == 3, (out, err)
    first = sorted(load_plan(plan).cells, key=lambda c: c.index)[0].name
    assert _failed_deploys_said(err, first, f"rgt sweep: {first} -> {BOX} ") >= 1, err
