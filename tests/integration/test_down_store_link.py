"""`rgt down` of a run whose file:// store is named on a mount that outlives the box but is a
link to the box's own disk: judged where the store is. Before, down judged the store by its
name: it promised the store's checkpoints as kept and kept the run's record for it, while the
provider's destroy deletes them with the disk. A real agent run, a real store, a real pull and
plan, on this machine."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from controller.remote import open_remote
from controller.results.down import plan_down
from controller.results.pull import pull
from tests.conftest import Cli
from tests.integration.test_down import Box, _nas_profile


def test_a_store_named_on_a_mount_but_linked_to_the_boxs_disk_is_lost_in_the_plan(
    cli: Cli, tmp_path: Any, laptop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nas/store -> store``: the profile's network mount is ``nas`` (outlives the box), the
    store's bytes are on the box's own disk (``/``: deleted when it is destroyed). The plan
    lists the store as lost, says where it is, and forgets the run rather than keeping its
    record for a store that will be gone."""
    (tmp_path / "nas").mkdir()
    named = str(tmp_path / "nas" / "store")
    os.symlink(str(tmp_path / "store"), named)  # Box makes tmp_path/store, the real dir
    box = Box(cli, tmp_path, store="file://" + named)
    box.checkpoint(1)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles))
    _nas_profile(str(profiles), str(tmp_path / "nas"))
    rec = dataclasses.replace(box.record(), profile="nas")
    pull(rec, str(tmp_path / "dest"), "store")
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = text.split("will be lost")[1].split("kept:")[0]
    kept = text.split("kept:")[1].split("billing:")[0]
    assert f"the store file://{named}" in lost, text
    assert f"at {tmp_path / 'store'} on the box" in lost, text
    assert "the provider deletes it at the meter-stop" in lost, text
    assert "the store" not in kept, text
    assert "forget the run on this laptop" in text, text
    assert "keep the run's record" not in text, text
    box.intact()  # only a plan: nothing was done
