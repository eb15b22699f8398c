"""The dir's links as the sealer saw them (onbox/sealing/dirlinks.py ``Seen``): a link is
recorded with each checkpoint it led to at a moment the sealer looked, whatever it leads to by
the MANIFEST, and never with one it was never seen leading to. A real directory, real links."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List

from onbox.sealing import manifest as mf
from onbox.sealing.dirlinks import Seen


def _doc(root: str, step: int) -> Dict[str, Any]:
    f = {"path": root, "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    f["key"] = mf.new_object_key("r", step, 1, root)
    return mf.new_manifest("r", step, 1, root, "file", [f])


def _point(d: Any, link: str, name: str) -> None:
    os.symlink(name, str(d / ".tmp-link"))
    os.replace(str(d / ".tmp-link"), str(d / link))


def test_a_link_moved_on_past_a_backlog_is_recorded_with_each_checkpoint_it_was_seen_at(
    tmp_path: Any,
) -> None:
    for step in (2, 4, 6):
        (tmp_path / f"s{step}.ckpt").write_bytes(b"x")
    _point(tmp_path, "best.ckpt", "s2.ckpt")
    seen = Seen(str(tmp_path))
    _point(tmp_path, "last.ckpt", "s2.ckpt")
    seen.look()  # picked: step 2 sealed, the job goes on
    _point(tmp_path, "last.ckpt", "s4.ckpt")
    seen.look()  # during the upload of step 2
    _point(tmp_path, "last.ckpt", "s6.ckpt")
    assert seen.leading_to(_doc("s2.ckpt", 2)) == [
        {"name": "best.ckpt", "target": "s2.ckpt"},
        {"name": "last.ckpt", "target": "s2.ckpt"},
    ]
    seen.sealed("s2.ckpt")
    # The backlog: steps 4 and 6, picked when last.ckpt led to 6 already.
    assert seen.leading_to(_doc("s4.ckpt", 4)) == [{"name": "last.ckpt", "target": "s4.ckpt"}]
    assert seen.leading_to(_doc("s6.ckpt", 6)) == [{"name": "last.ckpt", "target": "s6.ckpt"}]


def test_a_link_to_a_checkpoint_the_job_deleted_is_forgotten(tmp_path: Any) -> None:
    (tmp_path / "s2.ckpt").write_bytes(b"x")
    seen = Seen(str(tmp_path))
    _point(tmp_path, "last.ckpt", "s2.ckpt")
    seen.look()
    os.unlink(str(tmp_path / "s2.ckpt"))
    os.unlink(str(tmp_path / "last.ckpt"))
    seen.look()
    assert seen.pairs == {}


def test_the_memory_outlives_the_sealer_and_forgets_what_was_sealed_or_deleted(
    tmp_path: Any,
) -> None:
    d, state = tmp_path / "ckpt", str(tmp_path / "sealer-links.json")
    d.mkdir()
    for step in (2, 4):
        (d / f"s{step}.ckpt").write_bytes(b"x")
    _point(d, "last.ckpt", "s2.ckpt")
    Seen(str(d), state).look()  # that agent is gone before step 2's MANIFEST
    _point(d, "last.ckpt", "s4.ckpt")
    again = Seen(str(d), state)
    want = [{"name": "last.ckpt", "target": "s2.ckpt"}]
    assert again.leading_to(_doc("s2.ckpt", 2)) == want
    again.sealed("s2.ckpt")
    assert Seen(str(d), state).pairs == {("last.ckpt", "s4.ckpt"): 2}
    os.remove(str(d / "s4.ckpt"))  # rotation
    again.look()
    assert Seen(str(d), state).pairs == {}


def test_a_torn_or_odd_memory_loses_what_does_not_parse_and_never_stops_sealing(
    tmp_path: Any,
) -> None:
    (tmp_path / "s2.ckpt").write_bytes(b"x")
    state = tmp_path / "sealer-links.json"
    state.write_text('{"version": 1, "pairs": [["last.ckpt", "s2.ck')  # torn
    seen = Seen(str(tmp_path), str(state))
    assert seen.pairs == {}
    assert seen.leading_to(_doc("s2.ckpt", 2)) == []
    odd = [
        ["last.ckpt", "s2.ckpt", 3],
        ["up", "../s2.ckpt", 1],
        ["a/b", "s2.ckpt", 1],
        ["abs", "/s2.ckpt", 1],
        ["n", "s2.ckpt", "1"],
        ["t", "s2.ckpt", True],
        ["short", "s2.ckpt"],
        "last.ckpt",
    ]
    docs: List[Any] = [[], {"pairs": {}}, None]
    for doc in docs:
        state.write_text(json.dumps(doc))
        assert Seen(str(tmp_path), str(state)).pairs == {}
    state.write_text(json.dumps({"pairs": odd}))
    seen = Seen(str(tmp_path), str(state))
    assert seen.pairs == {("last.ckpt", "s2.ckpt"): 3}
    assert seen.leading_to(_doc("s2.ckpt", 2)) == [{"name": "last.ckpt", "target": "s2.ckpt"}]
