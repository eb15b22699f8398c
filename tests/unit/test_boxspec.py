"""The laptop's reading of the box's spec.json (controller/deploy/boxspec.py): the box is
untrusted, so a store it names is kept only when it is a store URL, its endpoint only when a
plain http(s)://host[:port] URL for an s3:// store and its stall only when a duration, as the
agent writes them.

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


def _recorded(tmp_path: Path, store: Any, **more: Any) -> Tuple[RunRecord, List[str]]:
    """The record after ``record_box_store`` read a spec.json naming ``store`` (and ``more``
    fields), and what it said."""
    box = tmp_path / "box"
    run = box / "runs" / NAME
    run.mkdir(parents=True)
    spec = {"command": ["python", "train.py"], "workdir": str(tmp_path), "store": store, **more}
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


def test_the_stores_endpoint_and_stall_the_agent_recorded_are_the_laptops(tmp_path: Path) -> None:
    ep = "https://minio.internal:9000"
    rec, said = _recorded(tmp_path, "s3://bkt/p", store_endpoint_url=ep, restore_stall=420.0)
    assert (rec.store, rec.store_endpoint_url, rec.store_stall) == ("s3://bkt/p", ep, 420.0)
    assert said == []


@pytest.mark.parametrize(
    "store, more",
    [
        ("s3://bkt/p", {"store_endpoint_url": "file:///etc/passwd"}),
        ("s3://bkt/p", {"store_endpoint_url": "http://"}),
        ("s3://bkt/p", {"store_endpoint_url": "http://host:port"}),
        ("s3://bkt/p", {"store_endpoint_url": ["http://h"]}),
        ("file:///mnt/s", {"store_endpoint_url": "http://h:9000"}),
        ("s3://bkt/p", {"restore_stall": -1}),
        ("s3://bkt/p", {"restore_stall": "forever"}),
        ("s3://bkt/p", {"restore_stall": True}),
    ],
)
def test_an_endpoint_or_stall_the_agent_would_never_write_is_not_recorded(
    tmp_path: Path, store: str, more: Any
) -> None:
    rec, said = _recorded(tmp_path, store, **more)
    assert rec.store is None and rec.store_endpoint_url is None and rec.store_stall is None
    assert len(said) == 1 and "not a run's spec" in said[0], said
