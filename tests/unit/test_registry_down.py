"""The laptop's record of a run taken down (``RunRecord.down_at``): a runs.json written before
the field reads as runs on their boxes, and a record marked taken down keeps everything else."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from controller.registry import Registry
from onbox.common.errors import NotFound

OLD = {
    "runs": {
        "r1": {
            "name": "r1",
            "target": {"kind": "local"},
            "profile": "local",
            "store": "s3://bucket/rgt",
            "box_home": "/home/u/.rgt",
            "agent": ["rgt-agent"],
            "created": 1700000000.0,
            "updated": 1700000000.0,
        }
    }
}


def test_an_old_record_is_on_its_box_and_marking_it_taken_down_keeps_the_rest(
    tmp_path: Any,
) -> None:
    home = str(tmp_path)
    with open(os.path.join(home, "runs.json"), "w") as f:
        json.dump(OLD, f)
    reg = Registry(home)
    rec = reg.get("r1")
    assert rec.down_at is None and rec.taken_down() == ""
    rec.check_on_box("rgt logs")  # nothing raised: the run is on its box

    marked = reg.mark_down("r1")
    assert marked is not None and marked.down_at is not None
    again = Registry(home).get("r1")
    assert again == marked and again.store == "s3://bucket/rgt" and again.created == 1700000000.0
    assert again.taken_down().startswith("taken down at 20")
    with pytest.raises(NotFound, match=r"run r1 was taken down at .* so rgt logs has nothing"):
        again.check_on_box("rgt logs")
    assert reg.mark_down("nope") is None


def test_a_taken_down_run_whose_file_store_is_not_here_says_where_it_is(tmp_path: Any) -> None:
    """A file:// store on the taken-down box's mount: `rgt pull N` reads the store (the box is
    not tried) and, as that path is not on this laptop, says so and how to reach it."""
    from controller.registry import RunRecord
    from controller.results.pull import pull
    from controller.target import Target

    store = f"file://{tmp_path}/mnt/nas/rgt"
    rec = RunRecord("r1", Target("ssh", host="192.0.2.1"), store=store, down_at=1700000000.0)
    with pytest.raises(NotFound) as info:
        pull(rec, str(tmp_path / "dest"), "auto")
    assert "run r1 was taken down at 2023-11-14T22:13:20+00:00 (rgt down)" in info.value.what
    assert f"mount it here at {tmp_path}/mnt/nas/rgt" in (info.value.remedy or "")
    with pytest.raises(NotFound, match="so rgt pull --from box has nothing to reach"):
        pull(rec, str(tmp_path / "dest"), "box")
