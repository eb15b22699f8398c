"""What the sealer says of the checkpoint dir's symlinks (onbox/sealing/refusals.py
``report_links``), on a real directory.

Lightning re-links ``last.ckpt`` by removing it and making it again: a listing can name it while
it is gone. A clean-clone CI run saw the sealer then say "'last.ckpt' is a symlink to
'last.ckpt'" (``links.within`` is the path itself for a name that is no link). A name that is no
longer a symlink is said nothing of, and is said when it is a link again.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

from onbox.sealing.refusals import Refusals


def _refusals(said: List[Dict[str, Any]]) -> Refusals:
    return Refusals(lambda kind, reason, **kw: said.append({"kind": kind, **kw}))


def test_a_link_gone_between_the_listing_and_the_report_is_said_nothing_of(tmp_path: Any) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "epoch=0-step=2.ckpt").write_bytes(b"x")
    said: List[Dict[str, Any]] = []
    r = _refusals(said)
    r.report_links(str(ckpt), ["last.ckpt"])  # listed as a link, removed before the report
    assert said == []
    os.symlink("epoch=0-step=2.ckpt", str(ckpt / "last.ckpt"))  # made again: said now
    r.report_links(str(ckpt), ["last.ckpt"])
    assert [(e["kind"], e.get("target")) for e in said] == [("ckpt_link", "epoch=0-step=2.ckpt")]


def test_a_link_replaced_by_a_file_is_no_link_said(tmp_path: Any) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "last.ckpt").write_bytes(b"a real copy")  # save_last=True, or a link's fallback copy
    said: List[Dict[str, Any]] = []
    _refusals(said).report_links(str(ckpt), ["last.ckpt"])
    assert said == []
