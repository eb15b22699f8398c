"""`rgt reconcile` of a cell whose run the store holds no trace of: not even the epoch every
agent of a run with a store takes there before its job starts (``RUN/epochs/``). That is not a
run still on its way to its DONE.json: its agent never started, or the store this laptop reads
is not the one the cell's box writes to. Its verdict stays "missing" (nothing there to verify,
and `rgt down`'s gate refuses its box), and its reason says which of the two it may be, as
`rgt pull` says of a run with no trace (controller/results/sealed.py).

Real parts: a ``file://`` store on this machine, the epoch taken by the agent's own
``take_epoch``, and the real `rgt` CLI as a process, bounded and killed by PID past it.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

from controller.registry import Registry, RunRecord
from controller.sweep import record
from controller.sweep.plan import load_plan
from controller.sweep.reconcile import check_run
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.stores import open_store
from tests.integration.test_store_hung import _bounded
from tests.integration.test_sweep_unread import _plan, _verdicts
from tests.laptop import nesting, rgt_exe


def test_a_cell_the_store_holds_no_trace_of_is_not_said_to_be_on_its_way(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """Both cells deployed (the sweep's record says running); the first's agent took its
    epoch in the store and has sealed nothing yet, the second's store holds nothing of it.
    Before the fix both read "no DONE.json in the store: never ran, still running, or its box
    died", the second as if its box wrote here."""
    home = controller_env["RGT_CONTROLLER_HOME"]
    root = tmp_path / "durable"
    root.mkdir()
    url = f"file://{root}"
    plan = _plan(tmp_path, url)
    record.begin(load_plan(plan), home)
    with record.update("sw", home) as doc:
        for c in doc["cells"].values():
            c.update(runs=[c["run"]], state="running")
    started, untraced = sorted(doc["cells"], key=lambda n: doc["cells"][n]["index"])
    assert take_epoch(open_store(url), started) == 1
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "reconcile", plan], env, str(tmp_path))
    assert rc == 18, (out, err)
    assert "Traceback" not in err, err
    lines = {n: [ln for ln in out.splitlines() if f": {n} (run" in ln] for n in doc["cells"]}
    assert all(len(v) == 1 for v in lines.values()), out
    assert "MISSING" in lines[started][0] and "no DONE.json" in lines[started][0], out
    line = lines[untraced][0]
    assert "MISSING" in line, out
    assert f"{url} holds nothing of run {untraced}" in line, out
    assert f"{untraced}/epochs/" in line and "its agent has not started yet" in line, out
    assert "another store than this one (a wrong directory)" in line, out
    assert "still running" not in line, out
    assert set(_verdicts(home).values()) == {"missing"}, _verdicts(home)


def _running_cell(tmp_path: Any, controller_env: Dict[str, str]) -> Tuple[str, str, str]:
    """A sweep over a ``file://`` store that holds nothing, its cells recorded running and its
    first cell's run known to this laptop: (the plan, that cell, its run)."""
    root = tmp_path / "durable"
    root.mkdir()
    url = f"file://{root}"
    plan = _plan(tmp_path, url)
    home = controller_env["RGT_CONTROLLER_HOME"]
    record.begin(load_plan(plan), home)
    with record.update("sw", home) as doc:
        for c in doc["cells"].values():
            c.update(runs=[c["run"]], state="running")
    cell = min(doc["cells"], key=lambda n: doc["cells"][n]["index"])
    run = str(doc["cells"][cell]["run"])
    Registry(home).put(RunRecord(run, record.cell_target(doc["cells"][cell]), store=url))
    return str(plan), cell, run


def test_rgt_down_refused_by_the_gate_says_each_reason_without_nesting_parentheses(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """`rgt down` of a cell's run that the store holds no trace of is refused by the sweep's
    gate (exit 7, before the box is asked anything); its line names the cell, its verdict and
    the reconcile reason, whose own parentheses ("(a wrong directory)") are the only ones
    inside the remedy's pair. Before the fix each reason was wrapped in a pair of its own
    ("missing (... (a wrong directory) ...)"), and the remedy held "(then rgt sweep it ...)"."""
    plan, cell, run = _running_cell(tmp_path, controller_env)
    env = dict(os.environ, **controller_env)
    rc, out, err = _bounded([*rgt_exe(), "down", run, "--yes"], env, str(tmp_path))
    assert rc == 7, (out, err)
    assert "Traceback" not in err, err
    line = next(ln for ln in err.splitlines() if "not reconciled" in ln)
    assert f"{cell} is missing: the store" in line and "(a wrong directory)" in line, line
    assert f"rgt reconcile {plan}" in line and nesting(line) == 1, line


def test_rgt_down_gated_on_a_hung_store_says_its_remedy_without_nesting_parentheses(
    tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """`rgt down` of a cell's run whose ``file://`` store hangs as a mount does on its reads
    (``RGT_HOLD_AT=store.get``): the gate's reconcile ends after the job file's 2 s, exit 14,
    and the store's remedy ("check the mount and its server") sits in the CLI's one pair with
    none of its own. Before the fix it read "(check the mount and its server (NFS, a FUSE
    daemon), then try again; ...)"."""
    plan, cell, run = _running_cell(tmp_path, controller_env)
    env = dict(os.environ, **controller_env, RGT_HOLD_AT="store.get")
    rc, out, err = _bounded([*rgt_exe(), "down", run, "--yes"], env, str(tmp_path))
    assert rc == 14, (out, err)
    assert "Traceback" not in err, err
    line = next(ln for ln in err.splitlines() if "did not answer for 2s" in ln)
    assert "check the mount and its server" in line and nesting(line) == 1, line


def test_a_cell_whose_done_json_cannot_be_read_says_why_and_what_to_do(tmp_path: Any) -> None:
    """A cell whose DONE.json in the store is not valid JSON is unverified, its reason saying
    as `rgt pull` does that the run's sealed state in that store cannot be read, and what to
    do (controller/results/sealed.py ``cannot_read``). Before: only the document's own error
    ("r1/DONE.json is not valid JSON"), no store, no remedy."""
    root = tmp_path / "durable"
    root.mkdir()
    url = f"file://{root}"
    store = open_store(url)
    store.put_bytes(mf.done_key("r1"), b"{not json")
    work = tmp_path / "work"
    work.mkdir()
    verdict, reason = check_run(store, "r1", False, str(work))
    assert verdict == "unverified", reason
    assert f"the run's sealed state in the store {url} cannot be read: " in reason, reason
    assert "DONE.json" in reason and "not valid JSON" in reason, reason
    assert f"what to do: look at the document it names in the store {url}" in reason, reason
    assert nesting(reason) == 0, reason  # the gate's line shows it inside the CLI's pair
