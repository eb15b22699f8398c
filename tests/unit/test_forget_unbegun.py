"""``forget_unbegun``: a new run that could not begin goes from the box whole, but never takes a
file in its checkpoint dir with it, and never touches a checkpoint dir outside the run's."""

from __future__ import annotations

import os
from pathlib import Path

from onbox.agent.beginning import forget_unbegun
from onbox.common.rundir import RunDir


def _run(tmp_path: Path) -> RunDir:
    rd = RunDir("nb", home=str(tmp_path / "home"))
    rd.create()
    Path(rd.spec).write_text("{}")
    Path(rd.state).write_text('{"state": "FAILED"}')
    return rd


def test_a_new_run_with_an_empty_checkpoint_dir_goes_whole(tmp_path: Path) -> None:
    rd = _run(tmp_path)
    os.makedirs(os.path.join(rd.path, "ckpt"))
    assert forget_unbegun(rd, os.path.join(rd.path, "ckpt"))
    assert os.listdir(os.path.dirname(rd.path)) == []  # nothing aside left either


def test_a_file_in_the_checkpoint_dir_inside_keeps_the_run(tmp_path: Path) -> None:
    rd = _run(tmp_path)
    ckpt = os.path.join(rd.path, "ckpt", "sub")
    os.makedirs(ckpt)
    Path(ckpt, "step_1.pt").write_bytes(b"w")
    assert not forget_unbegun(rd, os.path.join(rd.path, "ckpt"))
    assert Path(ckpt, "step_1.pt").read_bytes() == b"w" and os.path.isfile(rd.state)


def test_a_checkpoint_dir_outside_the_run_is_left_as_it_is(tmp_path: Path) -> None:
    rd = _run(tmp_path)
    ckpt = tmp_path / "mine"
    ckpt.mkdir()
    (ckpt / "step_1.pt").write_bytes(b"w")
    assert forget_unbegun(rd, str(ckpt))
    assert not os.path.exists(rd.path)
    assert (ckpt / "step_1.pt").read_bytes() == b"w"
