"""The laptop's reading of the box's spec.json (controller/deploy/boxspec.py): the box is
untrusted, so a store it names is kept only when it is a store URL, as the agent writes it.

The box is this machine (the ``local`` target runs the same shell commands as an ssh box)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from controller.deploy.boxspec import record_box_store
from controller.registry import Registry, RunRecord
from controller.remote import LocalRemote
from controller.target import Target

NAME = "r1"


def _recorded(tmp_path: Path, store: Any) -> Tuple[RunRecord, List[str]]:
    """The record after ``record_box_store`` read a spec.json naming ``store``, and what it said."""
    box = tmp_path / "box"
    run = box / "runs" / NAME
    run.mkdir(parents=True)
    spec = {"command": ["python", "train.py"], "workdir": str(tmp_path), "store": store}
    (run / "spec.json").write_text(json.dumps(spec))
    registry = Registry(str(tmp_path / "ctl"))
    rec = RunRecord(NAME, Target("local"), profile="local", box_home=str(box))
    registry.put(rec)
    said: List[str] = []
    record_box_store(LocalRemote(), registry, rec, "local", said.append)
    return registry.get(NAME), said


def test_the_store_the_boxs_agent_recorded_is_the_laptops(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    rec, said = _recorded(tmp_path, url)
    assert rec.store == url and said == []


@pytest.mark.parametrize(
    "store",
    ["file://../../etc", "file://relative/path", "gopher://x/y", "s3://UPPER/x", "no url", 7],
)
def test_a_store_the_agent_would_never_write_is_not_recorded_and_said(
    tmp_path: Path, store: Any
) -> None:
    rec, said = _recorded(tmp_path, store)
    assert rec.store is None
    assert len(said) == 1 and said[0].startswith("rgt: warning: the store run r1 runs with"), said
    assert "not a run's spec" in said[0], said
