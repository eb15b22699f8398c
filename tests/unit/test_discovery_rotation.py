"""A job that deletes its own old checkpoint directories while the sealer lists them (rotation)
is normal (DESIGN: "never blocks the newer ones"): the listing skips the one that went and
finds the rest, never raising (a raise was a `seal_bug` event and a lost sealing pass)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator, Tuple

import pytest

from onbox.common import jobenv
from onbox.sealing import discovery


def _ckpt(root: Any, step: int) -> str:
    path = os.path.join(str(root), f"step_{step}")
    os.makedirs(path)
    with open(os.path.join(path, "model.bin"), "wb") as f:
        f.write(b"w" * 64)
    with open(os.path.join(path, jobenv.COMPLETE_MARKER), "w") as f:
        json.dump({"step": step}, f)
    return path


def test_a_directory_rotated_away_mid_listing_is_skipped_and_the_rest_found(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = _ckpt(tmp_path, 100), _ckpt(tmp_path, 200)
    real_walk = os.walk

    def walk_then_rotate(top: str, *a: Any, **kw: Any) -> Iterator[Tuple[str, Any, Any]]:
        yield from real_walk(top, *a, **kw)
        if top == old:  # the job removes it right after its files were listed
            shutil.rmtree(old)

    monkeypatch.setattr(os, "walk", walk_then_rotate)
    dirs, _, _ = discovery.listing(str(tmp_path))
    assert [c.step for c in dirs] == [200]
    assert os.path.isdir(new)
