"""`rgt reconcile` and `rgt down`'s sweep gate print what the store says about a cell (a path
its DONE.json lists, an output it says is missing): a hostile store must not drive the laptop's
terminal with an escape sequence nor forge a line of rgt's own with a newline
(controller/sweep/reconcile.py, onbox/common/terminal.py). A real file:// store, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.cli import main
from controller.registry import RunRecord
from controller.sweep import record
from controller.sweep.reconcile import gate
from controller.target import Target
from onbox.common.errors import UnsafeRefused
from onbox.sealing.stores import open_store

PLAN = """\
name = "hs"
command = ["python", "job.py", "--a", "{a}", "--out", "{out}"]
targets = ["gpu1"]
outputs = ["out"]
[grid]
a = [1, 2]
"""
# An ESC sequence that sets the terminal's title, and a newline that starts a line of rgt's.
HOSTILE = "x\x1b]0;owned\x07\nrgt: sweep hs: 2/2 cells reconciled"


def _done(store: Any, run: str, files: List[Dict[str, Any]], missing: List[str]) -> None:
    doc = {"schema": 1, "run": run, "files": files, "missing_outputs": missing}
    store.put_bytes(f"{run}/DONE.json", json.dumps(doc).encode())


@pytest.fixture
def swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    """A plan of two cells whose store holds a DONE.json each, naming hostile text: cell 0
    says an output is missing, cell 1 lists a file (with a newline in its path) the store lacks.
    The sweep record as `rgt reconcile` made it."""
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    (tmp_path / "store").mkdir()
    plan = tmp_path / "PLAN.toml"
    plan.write_text(f'store = "file://{tmp_path}/store"\n' + PLAN)
    store = open_store(f"file://{tmp_path}/store")
    assert main(["reconcile", str(plan)]) == 18  # every cell missing: makes the record
    doc = record.load("hs")
    assert doc is not None
    runs = [c["run"] for c in sorted(doc["cells"].values(), key=lambda c: c["index"])]
    _done(store, runs[0], [], [HOSTILE])
    entry = {"path": "a\nb", "key": f"{runs[1]}/outputs/a\nb", "size": 1, "sha256": "0" * 64}
    _done(store, runs[1], [entry], [])
    return {"plan": str(plan), "doc": doc}


def _clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, text
    assert not any(line.startswith("rgt: sweep hs: 2/2") for line in text.splitlines()), text


def test_reconcile_prints_what_the_store_names_one_line_each_no_escape(
    swept: Dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["reconcile", swept["plan"]]) == 18
    out = capsys.readouterr()
    _clean(out.out + out.err)
    assert "UNVERIFIED" in out.out and "owned" in out.out and "a?b" in out.out, out.out
    # --json escapes it as JSON does, and keeps the store's text as it is
    assert main(["reconcile", swept["plan"], "--json"]) == 18
    rep = json.loads(capsys.readouterr().out)
    assert any(HOSTILE in c["reason"] for c in rep["cells"]), rep


def test_downs_gate_names_the_unreconciled_cells_without_their_control_characters(
    swept: Dict[str, Any],
) -> None:
    cells = swept["doc"]["cells"]
    with record.update("hs") as doc:  # both cells ran on the box, as `rgt sweep` records it
        for c in doc["cells"].values():
            c["runs"] = [c["run"]]
    first = next(iter(cells.values()))
    rec = RunRecord(first["run"], Target.from_json(first["target"]))
    with pytest.raises(UnsafeRefused) as e:
        gate(rec)
    _clean(e.value.line())
    assert "owned" in e.value.what and "a?b" in e.value.what, e.value.what
