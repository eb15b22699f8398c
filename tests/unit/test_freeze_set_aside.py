"""``freeze.lift``: a new incarnation of a run a NaN loss froze moves the checkpoints the job
wrote after the frozen step aside (loose files and the links to them too), leaves the others and
everything that is not a checkpoint, and clears the freeze; a move that fails keeps it frozen."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from onbox.agent import freeze
from onbox.common.errors import HostError
from onbox.common.jobenv import COMPLETE_MARKER
from onbox.common.rundir import RunDir
from onbox.sealing.discovery import newest_local_step


def _setup(tmp_path: Path, above: int) -> Tuple[RunDir, str, List[Dict[str, Any]]]:
    rd = RunDir("nf", home=str(tmp_path / "home"))
    rd.create()
    freeze.write(rd, above, "loss is nan at step 211", "fix it")
    ckpt = str(tmp_path / "ckpt")
    for step in (100, 200, 250):
        Path(ckpt, f"step_{step}").mkdir(parents=True)
        Path(ckpt, f"step_{step}", COMPLETE_MARKER).write_text(f'{{"step": {step}}}')
    Path(ckpt, "epoch=3-step=300.ckpt").write_bytes(b"w")  # Lightning's, with its last.ckpt
    os.symlink("epoch=3-step=300.ckpt", os.path.join(ckpt, "last.ckpt"))
    Path(ckpt, "train_step_900.log").write_text("not a checkpoint")
    Path(ckpt, "step_400").mkdir()  # no marker: not a complete checkpoint
    return rd, ckpt, []


def test_the_checkpoints_after_the_frozen_step_are_moved_aside(tmp_path: Path) -> None:
    rd, ckpt, events = _setup(tmp_path, 200)
    freeze.lift(rd, ckpt, lambda kind, reason, **kw: events.append(dict(kind=kind, **kw)))
    [ev] = events
    dest = ev["path"]
    assert ev["kind"] == "set_aside" and ev["steps"] == [250, 300] and ev["above"] == 200
    assert sorted(os.listdir(dest)) == [
        "epoch=3-step=300.ckpt",
        "last.ckpt",
        "sealing-frozen.json",
        "step_250",
    ]
    assert os.path.realpath(os.path.join(dest, "last.ckpt")) == os.path.join(
        dest, "epoch=3-step=300.ckpt"
    )
    left = sorted(n for n in os.listdir(ckpt) if not n.startswith("."))
    assert left == ["step_100", "step_200", "step_400", "train_step_900.log"]
    assert newest_local_step(ckpt) == 200  # the sealer's and the resume's newest
    assert freeze.read(rd) is None


def test_with_no_good_checkpoint_every_one_goes(tmp_path: Path) -> None:
    rd, ckpt, events = _setup(tmp_path, -1)
    freeze.lift(rd, ckpt, lambda kind, reason, **kw: events.append(dict(kw, reason=reason)))
    assert events[0]["steps"] == [100, 200, 250, 300]
    assert "with no good checkpoint before them" in events[0]["reason"]
    assert newest_local_step(ckpt) is None


def test_a_run_not_frozen_keeps_its_checkpoints(tmp_path: Path) -> None:
    rd, ckpt, events = _setup(tmp_path, 200)
    freeze.clear(rd)
    freeze.lift(rd, ckpt, lambda *a, **kw: events.append(kw))
    assert events == [] and newest_local_step(ckpt) == 300


def test_a_move_that_fails_keeps_the_run_frozen(tmp_path: Path) -> None:
    rd, ckpt, events = _setup(tmp_path, 200)
    Path(ckpt, freeze.ASIDE).write_text("in the way")
    with pytest.raises(HostError) as e:
        freeze.lift(rd, ckpt, lambda *a, **kw: events.append(kw))
    assert freeze.ASIDE in e.value.what and events == []
    frozen = freeze.read(rd)
    assert frozen is not None and frozen["above"] == 200


def test_a_run_with_no_store_keeps_the_newest_checkpoint_at_or_before_the_last_good_loss(
    tmp_path: Path,
) -> None:
    _, ckpt, _ = _setup(tmp_path, 200)
    assert freeze.last_good(ckpt, 249) == 200  # step_400 has no marker: not one
    assert freeze.last_good(ckpt, 250) == 250
    assert freeze.last_good(ckpt, 1000) == 300  # a loose file counts as the resume takes it
    assert freeze.last_good(ckpt, 99) is None
    assert freeze.last_good(str(tmp_path / "none"), 99) is None
