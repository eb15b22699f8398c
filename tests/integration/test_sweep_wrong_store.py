"""`rgt sweep` after a reconcile that found cells the sweep saw succeed "missing", their runs
with no trace in the store (not even the epoch every agent takes there before its job starts,
``RUN/epochs/``). The sweep saw each one's DONE.json in this store when it marked it succeeded,
so a store that now holds nothing of it is most likely not the store its box wrote to: a wrong
bucket, prefix or directory, or a mount that is not there. Deploying those cells again would
send every finished cell back to its box, whose agent holds its DONE.json and refuses to train,
until the box is left. So the sweep stops before it deploys anything (WrongStore, exit 21),
naming the store and the cells. A cell whose store holds its trace but lost its DONE.json is
still continued under its own name, as before.

Real parts: a ``file://`` store on this machine, an epoch taken by the agent's own
``take_epoch``, the real `rgt reconcile` and `rgt sweep` CLIs as processes, bounded and killed
by PID past it. The plan's one box does not resolve (``.invalid``): a deploy to it fails.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

from controller.sweep import record
from controller.sweep.plan import load_plan
from onbox.common.errors import WrongStore
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.stores import open_store
from tests.integration.test_store_hung import _bounded
from tests.integration.test_sweep_unread import _plan, _verdicts
from tests.laptop import nesting as _nesting
from tests.laptop import rgt_exe


def _succeeded(tmp_path: Any, home: str) -> Tuple[str, str, List[str]]:
    """A sweep of two cells the record says succeeded (as `rgt sweep` marks a cell once it
    reads its DONE.json), over an empty ``file://`` store: (plan, store URL, cells)."""
    root = tmp_path / "durable"
    root.mkdir()
    url = f"file://{root}"
    plan = _plan(tmp_path, url)
    record.begin(load_plan(plan), home)
    with record.update("sw", home) as doc:
        for c in doc["cells"].values():
            c.update(runs=[c["run"]], state="succeeded")
    cells = sorted(doc["cells"], key=lambda n: doc["cells"][n]["index"])
    return plan, url, cells


def _cells(home: str) -> Dict[str, Dict[str, Any]]:
    with open(os.path.join(home, "sweeps", "sw.json")) as f:
        cells: Dict[str, Dict[str, Any]] = json.load(f)["cells"]
    return cells


def test_succeeded_cells_with_no_trace_in_the_store_stop_the_sweep_before_any_deploy(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """Both cells succeeded; the first's run has its epoch in the store (its DONE.json lost),
    the second's nothing at all. Reconcile calls both missing. Before the fix `rgt sweep` set
    both back to pending and deployed the first to its box (here one that does not resolve:
    "its queue is left", exit 3); on a real box, its agent refuses a run it finished."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    plan, url, (traced, untraced) = _succeeded(tmp_path, home)
    assert take_epoch(open_store(url), traced) == 1
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "reconcile", plan], env, str(tmp_path))
    assert rc == 18, (out, err)
    assert set(_verdicts(home).values()) == {"missing"}, _verdicts(home)

    rc, out, err = _bounded([*rgt_exe(), "sweep", plan, "--interval", "0.1"], env, str(tmp_path))
    assert rc == WrongStore.exit_code == 21, (out, err)
    assert "Traceback" not in err, err
    assert f"the store {url} holds nothing of" in err and untraced in err, err
    assert traced not in err, err  # its store holds its trace: not evidence of a wrong store
    assert "saw succeed" in err and "nothing was deployed" in err, err
    assert "a wrong directory" in err and f"rgt reconcile {plan}" in err, err
    assert _nesting(err) == 1, err
    assert " -> " not in err and "queue is left" not in err, err  # no box was reached
    cells = _cells(home)
    assert {n: c["state"] for n, c in cells.items()} == {traced: "succeeded", untraced: "succeeded"}
    assert set(_verdicts(home).values()) == {"missing"}, _verdicts(home)  # left for a look


def test_a_succeeded_cell_whose_store_holds_its_trace_is_still_continued(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """Both cells succeeded and their runs' epochs are in the store, their DONE.json gone (a
    deleted result, not a wrong store): the sweep continues each under its own name as before,
    deploying it to its box (which does not resolve here, so its queue is left, exit 3)."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    plan, url, cells = _succeeded(tmp_path, home)
    for run in cells:
        assert take_epoch(open_store(url), run) == 1
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "reconcile", plan], env, str(tmp_path))
    assert rc == 18, (out, err)
    rc, out, err = _bounded([*rgt_exe(), "sweep", plan, "--interval", "0.1"], env, str(tmp_path))
    assert rc == 3, (out, err)
    assert "Traceback" not in err and "holds nothing of" not in err, err
    assert f"{cells[0]} -> rgt-sweep-unread-box.invalid" in err, err
    assert "queue is left" in err, err


def test_a_succeeded_cell_whose_done_json_is_back_without_an_epoch_is_skipped(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """Reconcile found both cells missing with no trace; then their DONE.json is in the store
    again, with no epoch beside it (as an agent older than the epochs left a run). That store
    does not hold "nothing" of them: the sweep takes each as sealed already, deploys nothing,
    exit 0 (not WrongStore, whose words would be false)."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    plan, url, cells = _succeeded(tmp_path, home)
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "reconcile", plan], env, str(tmp_path))
    assert rc == 18 and "holds nothing of" in out, (out, err)
    store = open_store(url)
    for run in cells:
        store.put_bytes(mf.done_key(run), mf.dump({"files": [], "finished_at": 0}))
    rc, out, err = _bounded([*rgt_exe(), "sweep", plan, "--interval", "0.1"], env, str(tmp_path))
    assert rc == 0, (out, err)
    assert err.count("is sealed already (DONE.json): skipped") == 2, err
    assert " -> " not in err and "holds nothing of" not in err, err
    assert {c["state"] for c in _cells(home).values()} == {"succeeded"}
